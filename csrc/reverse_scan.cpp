// Segmented reverse linear scan, the core of GAE and discounted returns.
//
//   y[b, t] = x[b, t] + coef[b, t] * y[b, t + 1],   y[b, T] = 0
//
// x, coef: (B, T) contiguous float32/float64 on the same device; sequence boundaries are encoded
// as coef == 0 at the last token of each segment (so packed 1-D inputs are a (1, N) call).
// CPU: one sequential pass per row, rows in parallel. CUDA: csrc/reverse_scan_cuda.cu.
#include <torch/extension.h>
#include <ATen/Parallel.h>

namespace {

void check_inputs(const at::Tensor& x, const at::Tensor& coef) {
  TORCH_CHECK(x.dim() == 2, "reverse_scan: x must be 2-D (B, T), got ", x.dim(), "-D");
  TORCH_CHECK(coef.sizes() == x.sizes(), "reverse_scan: coef must have x's shape ", x.sizes(),
              ", got ", coef.sizes());
  TORCH_CHECK(coef.scalar_type() == x.scalar_type(), "reverse_scan: coef dtype ",
              coef.scalar_type(), " differs from x dtype ", x.scalar_type());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble,
              "reverse_scan: expected float32 or float64, got ", x.scalar_type());
  TORCH_CHECK(coef.device() == x.device(), "reverse_scan: x and coef on different devices");
}

at::Tensor reverse_scan_cpu(const at::Tensor& x_in, const at::Tensor& coef_in) {
  check_inputs(x_in, coef_in);
  TORCH_CHECK(x_in.device().is_cpu(), "reverse_scan_cpu: expected CPU tensors");
  const auto x = x_in.contiguous();
  const auto coef = coef_in.contiguous();
  auto y = at::empty_like(x);
  const int64_t B = x.size(0), T = x.size(1);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "reverse_scan_cpu", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = coef.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    // grain: about 16k elements per task so tiny batches stay single-threaded
    const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(T, 1));
    at::parallel_for(0, B, grain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const scalar_t* xr = xp + b * T;
        const scalar_t* cr = cp + b * T;
        scalar_t* yr = yp + b * T;
        scalar_t carry = 0;
        for (int64_t t = T - 1; t >= 0; --t) {
          // coef 0 ends a segment: the value after it stays out, even inf (0 * inf = NaN)
          carry = cr[t] == scalar_t(0) ? xr[t] : xr[t] + cr[t] * carry;
          yr[t] = carry;
        }
      }
    });
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(rlhf_kernels, m) {
  m.def("reverse_scan(Tensor x, Tensor coef) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlhf_kernels, CPU, m) {
  m.impl("reverse_scan", &reverse_scan_cpu);
}

// Importing rlhf_kernels._C registers the ops above; the Python module itself is empty.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
