// Fused GAE and discounted returns: one pass per sequence, no intermediate tensors.
//
// For each sequence (a row of a padded (B, T) input, or a run [cu[s], cu[s + 1]) of a packed
// (N,) input), with m the mask (1 when absent), r = rewards where m else 0, likewise v, v[end] = 0:
//
//   delta[t] = r[t] + gamma * v[t + 1] - v[t]
//   adv[t]   = delta[t] + gamma * lam * adv[t + 1],   adv[end] = 0
//   ret[t]   = adv[t] + v[t]
//
// fused_returns is the same with v = 0 and lam = 1:  G[t] = r[t] + gamma * G[t + 1].
// This is exactly what rlhf_kernels/ops/gae.py's torch path computes (masked inputs, the
// recurrence over the whole padded row, no bootstrap after a sequence's last token), in the same
// operation order, in the inputs' dtype (float16 / bfloat16 in float32) with float32 / float64
// outputs in that dtype. The backward ops (the adjoint: a scan forward in time) take the gradients
// of the outputs (either may be undefined = zero) and return those of rewards (and values).
//
// Masks: bool, the inputs' dtype or their compute dtype are read as they are; other dtypes are
// converted to the compute dtype first (as `mask.to(float)` would). cu_seqlens: int32 or int64,
// cu[0] = 0, non-decreasing, cu[-1] = N (checked here on CPU; the CUDA kernel clamps instead).
// CPU: sequences in parallel (at::parallel_for), one sequential pass each; equal-length rows
// are interleaved four at a time so their independent recurrences overlap in the pipeline.
// CUDA: csrc/gae_cuda.cu.
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <type_traits>

namespace {

struct NoMask {};

template <typename T>
constexpr bool kHasMask = !std::is_same<T, NoMask>::value;

at::ScalarType compute_type(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

// Shared argument checks (CPU and CUDA entry points mirror them).
void check_layout(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                  const c10::optional<at::Tensor>& cu) {
  const auto st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16,
              op, ": expected a float32/float64/float16/bfloat16 tensor, got ", st);
  if (cu.has_value()) {
    TORCH_CHECK(x.dim() == 1, op, ": with cu_seqlens the input must be packed 1-D (N,), got ",
                x.dim(), "-D");
    TORCH_CHECK(cu->dim() == 1 && cu->numel() >= 1, op,
                ": cu_seqlens must be 1-D with at least one entry");
    TORCH_CHECK(cu->scalar_type() == at::kInt || cu->scalar_type() == at::kLong, op,
                ": cu_seqlens must be int32 or int64, got ", cu->scalar_type());
    TORCH_CHECK(cu->device() == x.device(), op, ": cu_seqlens on ", cu->device(),
                ", the input on ", x.device());
  } else {
    TORCH_CHECK(x.dim() == 2, op, ": without cu_seqlens the input must be padded 2-D (B, T), got ",
                x.dim(), "-D");
  }
  if (mask.has_value()) {
    TORCH_CHECK(mask->sizes() == x.sizes(), op, ": mask must have the input's shape ", x.sizes(),
                ", got ", mask->sizes());
    TORCH_CHECK(mask->device() == x.device(), op, ": mask on ", mask->device(), ", the input on ",
                x.device());
  }
}

void check_like(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x) {
  TORCH_CHECK(t.sizes() == x.sizes(), op, ": ", name, " must have shape ", x.sizes(), ", got ",
              t.sizes());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), op, ": ", name, " dtype ", t.scalar_type(),
              " differs from ", x.scalar_type());
  TORCH_CHECK(t.device() == x.device(), op, ": ", name, " on ", t.device(), ", expected ",
              x.device());
}

// The mask as it is read: contiguous, and in bool, the input dtype or the compute dtype.
c10::optional<at::Tensor> prepare_mask(const c10::optional<at::Tensor>& mask, at::ScalarType st) {
  if (!mask.has_value()) return c10::nullopt;
  const auto mt = mask->scalar_type();
  if (mt == at::kBool || mt == st || mt == compute_type(st)) return mask->contiguous();
  return mask->to(compute_type(st)).contiguous();
}

// Calls f(const mask_t* m) with m == nullptr typed NoMask when there is no mask.
template <typename scalar_t, typename F>
void with_mask(const c10::optional<at::Tensor>& mask, F&& f) {
  using acc_t = at::opmath_type<scalar_t>;
  if (!mask.has_value()) {
    f(static_cast<const NoMask*>(nullptr));
  } else if (mask->scalar_type() == at::kBool) {
    f(mask->data_ptr<bool>());
  } else if (mask->scalar_type() == c10::CppTypeToScalarType<scalar_t>::value) {
    f(static_cast<const scalar_t*>(mask->data_ptr<scalar_t>()));
  } else {
    f(static_cast<const acc_t*>(mask->data_ptr<acc_t>()));
  }
}

// Sequence boundaries: rows of length T, or the runs of a validated cu_seqlens.
struct Segments {
  const int64_t* cu = nullptr;
  int64_t count = 0, T = 0;
  int64_t lo(int64_t s) const { return cu ? cu[s] : s * T; }
  int64_t hi(int64_t s) const { return cu ? cu[s + 1] : (s + 1) * T; }
};

at::Tensor cpu_cu(const c10::optional<at::Tensor>& cu, int64_t n) {
  if (!cu.has_value()) return at::Tensor();
  auto c = cu->to(at::kLong).contiguous();
  const int64_t* p = c.data_ptr<int64_t>();
  const int64_t k = c.numel();
  TORCH_CHECK(p[0] == 0, "cu_seqlens[0] must be 0, got ", p[0]);
  for (int64_t i = 1; i < k; ++i) {
    TORCH_CHECK(p[i] >= p[i - 1], "cu_seqlens must be non-decreasing, but cu_seqlens[", i,
                "]=", p[i], " < cu_seqlens[", i - 1, "]=", p[i - 1]);
  }
  TORCH_CHECK(p[k - 1] == n, "cu_seqlens[-1] must equal the packed length ", n, ", got ",
              p[k - 1]);
  return c;
}

Segments make_segments(const at::Tensor& x, const at::Tensor& cu) {
  Segments seg;
  if (cu.defined()) {
    seg.cu = cu.data_ptr<int64_t>();
    seg.count = cu.numel() - 1;
  } else {
    seg.count = x.size(0);
    seg.T = x.size(1);
  }
  return seg;
}

template <typename F>
void for_each_segment(const Segments& seg, int64_t n, F&& f) {
  // grain: about 16k elements per task so small inputs stay single-threaded
  const int64_t avg = std::max<int64_t>(1, n / std::max<int64_t>(seg.count, 1));
  const int64_t grain = std::max<int64_t>(1, 16384 / avg);
  at::parallel_for(0, seg.count, grain, [&](int64_t begin, int64_t end) { f(begin, end); });
}

template <typename mask_t, typename acc_t>
inline acc_t mask_at(const mask_t* m, int64_t t) {
  if constexpr (kHasMask<mask_t>) {
    return static_cast<acc_t>(m[t]);
  } else {
    return acc_t(1);
  }
}

// ------------------------------------------------------------------------------ forward
// K sequences of equal length L starting at lo[0..K): K independent recurrences interleaved.
template <int K, bool kValues, typename scalar_t, typename mask_t>
void forward_rows(const scalar_t* __restrict__ r, const scalar_t* __restrict__ v,
                  const mask_t* __restrict__ m, scalar_t* __restrict__ adv,
                  scalar_t* __restrict__ ret, const int64_t* lo, int64_t L,
                  at::opmath_type<scalar_t> g, at::opmath_type<scalar_t> c) {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t carry[K], v_next[K];
  for (int k = 0; k < K; ++k) carry[k] = v_next[k] = acc_t(0);
  for (int64_t j = L - 1; j >= 0; --j) {
#pragma GCC unroll 4
    for (int k = 0; k < K; ++k) {
      const int64_t t = lo[k] + j;
      acc_t rt = static_cast<acc_t>(r[t]);
      acc_t vt = kValues ? static_cast<acc_t>(v[t]) : acc_t(0);
      if constexpr (kHasMask<mask_t>) {
        // select, not multiply: junk (NaN, inf) at a masked token must not leak (NaN * 0 = NaN)
        const bool keep = mask_at<mask_t, acc_t>(m, t) != acc_t(0);
        rt = keep ? rt : acc_t(0);
        if (kValues) vt = keep ? vt : acc_t(0);
      }
      acc_t delta = rt;
      if (kValues) delta = (rt + g * v_next[k]) - vt;
      // c == 0 (gamma or lam 0): nothing later reaches t, even inf (0 * inf = NaN)
      carry[k] = c == acc_t(0) ? delta : delta + c * carry[k];
      adv[t] = static_cast<scalar_t>(carry[k]);
      if (kValues) {
        ret[t] = static_cast<scalar_t>(carry[k] + vt);
        v_next[k] = vt;
      }
    }
  }
}

template <bool kValues, typename scalar_t, typename mask_t>
void forward_segments(const Segments& seg, int64_t begin, int64_t end, const scalar_t* r,
                      const scalar_t* v, const mask_t* m, scalar_t* adv, scalar_t* ret,
                      at::opmath_type<scalar_t> g, at::opmath_type<scalar_t> c) {
  int64_t s = begin;
  if (!seg.cu) {  // equal-length rows: four at a time
    for (; s + 4 <= end; s += 4) {
      const int64_t lo[4] = {seg.lo(s), seg.lo(s + 1), seg.lo(s + 2), seg.lo(s + 3)};
      forward_rows<4, kValues>(r, v, m, adv, ret, lo, seg.T, g, c);
    }
  }
  for (; s < end; ++s) {
    const int64_t lo[1] = {seg.lo(s)};
    forward_rows<1, kValues>(r, v, m, adv, ret, lo, seg.hi(s) - seg.lo(s), g, c);
  }
}

std::tuple<at::Tensor, at::Tensor> fused_gae_cpu(const at::Tensor& rewards,
                                                 const at::Tensor& values,
                                                 const c10::optional<at::Tensor>& mask_in,
                                                 const c10::optional<at::Tensor>& cu_in,
                                                 double gamma, double lam) {
  check_layout("fused_gae", rewards, mask_in, cu_in);
  check_like("fused_gae", "values", values, rewards);
  TORCH_CHECK(rewards.device().is_cpu(), "fused_gae_cpu: expected CPU tensors");
  const auto r = rewards.contiguous();
  const auto v = values.contiguous();
  const auto mask = prepare_mask(mask_in, r.scalar_type());
  const auto cu = cpu_cu(cu_in, r.numel());
  auto adv = at::empty(r.sizes(), r.options());
  auto ret = at::empty(r.sizes(), r.options());
  const Segments seg = make_segments(r, cu);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.scalar_type(), "fused_gae_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t g = static_cast<acc_t>(gamma), c = static_cast<acc_t>(gamma * lam);
    const scalar_t* rp = r.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    scalar_t* ap = adv.data_ptr<scalar_t>();
    scalar_t* tp = ret.data_ptr<scalar_t>();
    with_mask<scalar_t>(mask, [&](const auto* m) {
      for_each_segment(seg, r.numel(), [&](int64_t b, int64_t e) {
        forward_segments<true>(seg, b, e, rp, vp, m, ap, tp, g, c);
      });
    });
  });
  return {adv, ret};
}

at::Tensor fused_returns_cpu(const at::Tensor& rewards, const c10::optional<at::Tensor>& mask_in,
                             const c10::optional<at::Tensor>& cu_in, double gamma) {
  check_layout("fused_returns", rewards, mask_in, cu_in);
  TORCH_CHECK(rewards.device().is_cpu(), "fused_returns_cpu: expected CPU tensors");
  const auto r = rewards.contiguous();
  const auto mask = prepare_mask(mask_in, r.scalar_type());
  const auto cu = cpu_cu(cu_in, r.numel());
  auto out = at::empty(r.sizes(), r.options());
  const Segments seg = make_segments(r, cu);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, r.scalar_type(), "fused_returns_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const acc_t g = static_cast<acc_t>(gamma);
        const scalar_t* rp = r.data_ptr<scalar_t>();
        scalar_t* op = out.data_ptr<scalar_t>();
        with_mask<scalar_t>(mask, [&](const auto* m) {
          for_each_segment(seg, r.numel(), [&](int64_t b, int64_t e) {
            forward_segments<false>(seg, b, e, rp, rp, m, op, op, g, g);
          });
        });
      });
  return out;
}

// ------------------------------------------------------------------------------ backward
// Adjoint of the forward pass, forward in time over one sequence [lo, hi):
//   gx[t] = ga[t] + gr[t] + c * gx[t - 1]                (gx[lo - 1] = 0)
//   d rewards[t] = m[t] ? gx[t] : 0
//   d values[t]  = m[t] ? gr[t] - gx[t] + gamma * gx[t - 1] : 0
// ga / gr may be null (zero gradient); without values gr is null and dv unused.
template <bool kValues, typename scalar_t, typename mask_t>
void backward_segment(const scalar_t* __restrict__ ga, const scalar_t* __restrict__ gr,
                      const mask_t* __restrict__ m, scalar_t* __restrict__ dr,
                      scalar_t* __restrict__ dv, int64_t lo, int64_t hi,
                      at::opmath_type<scalar_t> g, at::opmath_type<scalar_t> c) {
  using acc_t = at::opmath_type<scalar_t>;
  acc_t prev = 0;
  for (int64_t t = lo; t < hi; ++t) {
    const acc_t gat = ga ? static_cast<acc_t>(ga[t]) : acc_t(0);
    const acc_t grt = (kValues && gr) ? static_cast<acc_t>(gr[t]) : acc_t(0);
    const acc_t gx = c == acc_t(0) ? gat + grt : (gat + grt) + c * prev;
    if constexpr (kHasMask<mask_t>) {
      // select, as the forward: a masked token's gradient is 0 even if gx is not finite
      const bool keep = mask_at<mask_t, acc_t>(m, t) != acc_t(0);
      dr[t] = static_cast<scalar_t>(keep ? gx : acc_t(0));
      if (kValues) dv[t] = static_cast<scalar_t>(keep ? (grt - gx) + g * prev : acc_t(0));
    } else {
      dr[t] = static_cast<scalar_t>(gx);
      if (kValues) dv[t] = static_cast<scalar_t>((grt - gx) + g * prev);
    }
    prev = gx;
  }
}

// The reference tensor for shape / dtype / device: the first defined gradient.
const at::Tensor& first_defined(const c10::optional<at::Tensor>& a,
                                const c10::optional<at::Tensor>& b) {
  TORCH_CHECK(a.has_value() || b.has_value(), "backward: at least one gradient must be given");
  return a.has_value() ? *a : *b;
}

at::Tensor contiguous_or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

template <typename scalar_t>
const scalar_t* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<scalar_t>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor> fused_gae_backward_cpu(
    const c10::optional<at::Tensor>& grad_adv, const c10::optional<at::Tensor>& grad_ret,
    const c10::optional<at::Tensor>& mask_in, const c10::optional<at::Tensor>& cu_in,
    double gamma, double lam) {
  const at::Tensor& ref = first_defined(grad_adv, grad_ret);
  check_layout("fused_gae_backward", ref, mask_in, cu_in);
  if (grad_adv.has_value()) check_like("fused_gae_backward", "grad_adv", *grad_adv, ref);
  if (grad_ret.has_value()) check_like("fused_gae_backward", "grad_ret", *grad_ret, ref);
  TORCH_CHECK(ref.device().is_cpu(), "fused_gae_backward_cpu: expected CPU tensors");
  const auto ga = contiguous_or_undefined(grad_adv);
  const auto gr = contiguous_or_undefined(grad_ret);
  const auto mask = prepare_mask(mask_in, ref.scalar_type());
  const auto cu = cpu_cu(cu_in, ref.numel());
  auto dr = at::empty(ref.sizes(), ref.options().memory_format(at::MemoryFormat::Contiguous));
  auto dv = at::empty_like(dr);
  const Segments seg = make_segments(ref, cu);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, ref.scalar_type(), "fused_gae_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const acc_t g = static_cast<acc_t>(gamma), c = static_cast<acc_t>(gamma * lam);
        const scalar_t* gap = ptr_or_null<scalar_t>(ga);
        const scalar_t* grp = ptr_or_null<scalar_t>(gr);
        scalar_t* drp = dr.data_ptr<scalar_t>();
        scalar_t* dvp = dv.data_ptr<scalar_t>();
        with_mask<scalar_t>(mask, [&](const auto* m) {
          for_each_segment(seg, ref.numel(), [&](int64_t b, int64_t e) {
            for (int64_t s = b; s < e; ++s)
              backward_segment<true>(gap, grp, m, drp, dvp, seg.lo(s), seg.hi(s), g, c);
          });
        });
      });
  return {dr, dv};
}

at::Tensor fused_returns_backward_cpu(const at::Tensor& grad,
                                      const c10::optional<at::Tensor>& mask_in,
                                      const c10::optional<at::Tensor>& cu_in, double gamma) {
  check_layout("fused_returns_backward", grad, mask_in, cu_in);
  TORCH_CHECK(grad.device().is_cpu(), "fused_returns_backward_cpu: expected CPU tensors");
  const auto gg = grad.contiguous();
  const auto mask = prepare_mask(mask_in, gg.scalar_type());
  const auto cu = cpu_cu(cu_in, gg.numel());
  auto dr = at::empty(gg.sizes(), gg.options());
  const Segments seg = make_segments(gg, cu);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, gg.scalar_type(), "fused_returns_backward_cpu", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const acc_t g = static_cast<acc_t>(gamma);
        const scalar_t* gp = gg.data_ptr<scalar_t>();
        scalar_t* drp = dr.data_ptr<scalar_t>();
        with_mask<scalar_t>(mask, [&](const auto* m) {
          for_each_segment(seg, gg.numel(), [&](int64_t b, int64_t e) {
            for (int64_t s = b; s < e; ++s)
              backward_segment<false>(gp, static_cast<const scalar_t*>(nullptr), m, drp,
                                      static_cast<scalar_t*>(nullptr), seg.lo(s), seg.hi(s), g,
                                      g);
          });
        });
      });
  return dr;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlhf_kernels, m) {
  m.def(
      "fused_gae(Tensor rewards, Tensor values, Tensor? mask, Tensor? cu_seqlens, float gamma, "
      "float lam) -> (Tensor, Tensor)");
  m.def(
      "fused_gae_backward(Tensor? grad_adv, Tensor? grad_ret, Tensor? mask, Tensor? cu_seqlens, "
      "float gamma, float lam) -> (Tensor, Tensor)");
  m.def("fused_returns(Tensor rewards, Tensor? mask, Tensor? cu_seqlens, float gamma) -> Tensor");
  m.def(
      "fused_returns_backward(Tensor grad, Tensor? mask, Tensor? cu_seqlens, float gamma) -> "
      "Tensor");
}

TORCH_LIBRARY_IMPL(rlhf_kernels, CPU, m) {
  m.impl("fused_gae", &fused_gae_cpu);
  m.impl("fused_gae_backward", &fused_gae_backward_cpu);
  m.impl("fused_returns", &fused_returns_cpu);
  m.impl("fused_returns_backward", &fused_returns_backward_cpu);
}
