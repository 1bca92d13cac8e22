// CUDA implementation of rlhf_kernels::reverse_scan (see reverse_scan.cpp for the contract).
//
// One block per row, kThreads threads. Each thread owns a contiguous chunk of the row and
// reduces it to one affine map  y_chunk_start = a + b * y_after_chunk  (phase 1). A reverse
// Hillis-Steele scan over the threads' maps in shared memory gives every thread the value that
// follows its chunk (phase 2); each thread then replays its chunk from that carry (phase 3).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>
#include <c10/cuda/CUDAGuard.h>

namespace {

constexpr int kThreads = 256;

template <typename scalar_t>
__global__ void reverse_scan_kernel(const scalar_t* __restrict__ x,
                                    const scalar_t* __restrict__ coef,
                                    scalar_t* __restrict__ y, int64_t T) {
  __shared__ scalar_t sa[kThreads];
  __shared__ scalar_t sb[kThreads];
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const int64_t chunk = (T + kThreads - 1) / kThreads;
  const int64_t lo = min(T, tid * chunk), hi = min(T, lo + chunk);
  const scalar_t* xr = x + row * T;
  const scalar_t* cr = coef + row * T;
  scalar_t* yr = y + row * T;

  // phase 1: compose the chunk's maps from its end: (a, b) <- (x + c * a, c * b)
  scalar_t a = 0, b = 1;
  for (int64_t t = hi - 1; t >= lo; --t) {
    const scalar_t c = cr[t];
    a = c == scalar_t(0) ? xr[t] : xr[t] + c * a;  // coef 0 ends a segment (no 0 * inf)
    b = c * b;
  }
  sa[tid] = a;
  sb[tid] = b;
  __syncthreads();

  // phase 2: inclusive reverse scan, thread i composes maps i, i+1, ..., kThreads-1
  for (int off = 1; off < kThreads; off <<= 1) {
    scalar_t na = sa[tid], nb = sb[tid];
    if (tid + off < kThreads) {
      na = sb[tid] == scalar_t(0) ? sa[tid] : sa[tid] + sb[tid] * sa[tid + off];
      nb = sb[tid] * sb[tid + off];
    }
    __syncthreads();
    sa[tid] = na;
    sb[tid] = nb;
    __syncthreads();
  }
  // the value after this chunk is the composed map of all later chunks applied to y[T] = 0
  scalar_t carry = (tid + 1 < kThreads) ? sa[tid + 1] : scalar_t(0);

  // phase 3: replay the chunk
  for (int64_t t = hi - 1; t >= lo; --t) {
    carry = cr[t] == scalar_t(0) ? xr[t] : xr[t] + cr[t] * carry;
    yr[t] = carry;
  }
}

at::Tensor reverse_scan_cuda(const at::Tensor& x_in, const at::Tensor& coef_in) {
  TORCH_CHECK(x_in.dim() == 2, "reverse_scan: x must be 2-D (B, T), got ", x_in.dim(), "-D");
  TORCH_CHECK(coef_in.sizes() == x_in.sizes(), "reverse_scan: coef must have x's shape");
  TORCH_CHECK(coef_in.scalar_type() == x_in.scalar_type(), "reverse_scan: dtype mismatch");
  TORCH_CHECK(x_in.is_cuda() && coef_in.device() == x_in.device(),
              "reverse_scan_cuda: expected CUDA tensors on one device");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const auto x = x_in.contiguous();
  const auto coef = coef_in.contiguous();
  auto y = at::empty_like(x);
  const int64_t B = x.size(0), T = x.size(1);
  if (B == 0 || T == 0) return y;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "reverse_scan_cuda", [&] {
    reverse_scan_kernel<scalar_t><<<B, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<scalar_t>(), coef.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), T);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(rlhf_kernels, CUDA, m) {
  m.impl("reverse_scan", &reverse_scan_cuda);
}
