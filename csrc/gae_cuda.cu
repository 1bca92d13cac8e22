// CUDA implementation of rlhf_kernels::fused_gae, fused_returns and their backward ops (see
// gae.cpp for the contract; the schemas are defined there).
//
// One block per sequence (a padded row or a cu_seqlens run), kThreads threads. The sequence is
// walked in tiles of kTile = kThreads * kItems tokens in scan order (backwards in time for the
// forward ops, forwards for the backward ops); thread i owns kItems consecutive tokens of a tile,
// and the threads before it in scan order are i + 1, i + 2, ... (so one suffix scan serves both
// directions). Per tile: each thread computes its tokens' inputs (delta, or the summed
// output gradient) and reduces them to one affine map  y_out = a + b * y_in; a block-wide
// exclusive scan of the maps (warp shuffles, then one value per warp in shared memory) gives each
// thread the value entering its tokens; each thread replays its tokens and writes the outputs;
// the tile's composed map carries the value into the next tile. Loads of a warp are contiguous.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <type_traits>

namespace {

constexpr int kThreads = 256;
constexpr int kItems = 4;
constexpr int kTile = kThreads * kItems;
constexpr int kWarps = kThreads / 32;

struct NoMask {};

template <typename T>
constexpr bool kHasMask = !std::is_same<T, NoMask>::value;

template <typename mask_t, typename acc_t>
__device__ __forceinline__ acc_t mask_at(const mask_t* m, int64_t t) {
  if constexpr (kHasMask<mask_t>) {
    return static_cast<acc_t>(m[t]);
  } else {
    return acc_t(1);
  }
}

// Bounds of sequence s: row s of length T, or [cu[s], cu[s + 1]) clamped into [0, N].
struct Bounds {
  int64_t lo, hi;
};

__device__ __forceinline__ Bounds bounds(int64_t s, int64_t T, int64_t N, const int32_t* cu32,
                                         const int64_t* cu64) {
  if (cu32 == nullptr && cu64 == nullptr) return {s * T, (s + 1) * T};
  int64_t lo = cu32 ? static_cast<int64_t>(cu32[s]) : cu64[s];
  int64_t hi = cu32 ? static_cast<int64_t>(cu32[s + 1]) : cu64[s + 1];
  lo = min(max(lo, int64_t(0)), N);
  hi = min(max(hi, lo), N);
  return {lo, hi};
}

// b * y, 0 where b == 0: a zero coefficient cuts the recurrence, even before an inf (0 * inf
// would be NaN), as the scan backends do; like theirs, a product of coefficients that underflows
// to 0 cuts too (the sequential CPU op cuts only where gamma * lam is 0)
template <typename acc_t>
__device__ __forceinline__ acc_t times(acc_t b, acc_t y) {
  return b == acc_t(0) ? acc_t(0) : b * y;
}

// Block-wide exclusive suffix composition of the threads' maps. Thread i's map (a, b) takes the
// value entering its tokens to the value leaving them; on return (ea, eb) is the composition of
// the maps of threads i + 1 .. kThreads - 1 (identity for the last thread) and (ta, tb) that of
// all threads. Composition "mine after later": (a, b) o (a', b') = (a + b * a', b * b').
template <typename acc_t>
__device__ __forceinline__ void suffix_scan(acc_t a, acc_t b, acc_t& ea, acc_t& eb, acc_t& ta,
                                            acc_t& tb, acc_t* sa, acc_t* sb) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {  // inclusive within the warp: lanes lane .. 31
    const acc_t a2 = __shfl_down_sync(0xffffffffu, a, off);
    const acc_t b2 = __shfl_down_sync(0xffffffffu, b, off);
    if (lane + off < 32) {
      a = a + times(b, a2);
      b = b * b2;
    }
  }
  if (lane == 0) {
    sa[warp] = a;
    sb[warp] = b;
  }
  __syncthreads();
  acc_t A = 0, B = 1;  // the warps after this one
  for (int w = kWarps - 1; w > warp; --w) {
    A = sa[w] + times(sb[w], A);
    B = sb[w] * B;
  }
  ta = A;
  tb = B;
  for (int w = warp; w >= 0; --w) {  // ... and all of them
    ta = sa[w] + times(sb[w], ta);
    tb = sb[w] * tb;
  }
  acc_t na = __shfl_down_sync(0xffffffffu, a, 1);
  acc_t nb = __shfl_down_sync(0xffffffffu, b, 1);
  if (lane == 31) {
    na = 0;
    nb = 1;
  }
  ea = na + times(nb, A);
  eb = nb * B;
  __syncthreads();  // sa / sb are reused by the next tile
}

// delta / adv / ret backwards in time (kValues = false: fused_returns, x = r, ret unused).
template <bool kValues, typename scalar_t, typename mask_t>
__global__ void fused_forward_kernel(const scalar_t* __restrict__ r,
                                     const scalar_t* __restrict__ v,
                                     const mask_t* __restrict__ m, const int32_t* cu32,
                                     const int64_t* cu64, int64_t T, int64_t N,
                                     scalar_t* __restrict__ adv, scalar_t* __restrict__ ret,
                                     at::opmath_type<scalar_t> g, at::opmath_type<scalar_t> c) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t sa[kWarps], sb[kWarps];
  const Bounds bd = bounds(blockIdx.x, T, N, cu32, cu64);
  acc_t carry = 0;  // the value after the tile (0 after the sequence)
  for (int64_t tile_hi = bd.hi; tile_hi > bd.lo; tile_hi -= kTile) {
    const int64_t base = tile_hi - kTile + int64_t(kItems) * threadIdx.x;
    acc_t x[kItems], vm[kItems];
    // the value after this thread's tokens (0 after the sequence's last token)
    acc_t v_next = 0;
    if (kValues && base + kItems < bd.hi && base + kItems >= bd.lo) {
      v_next = mask_at<mask_t, acc_t>(m, base + kItems) != acc_t(0)
                   ? static_cast<acc_t>(v[base + kItems])
                   : acc_t(0);
    }
    acc_t a = 0, b = 1;
#pragma unroll
    for (int j = kItems - 1; j >= 0; --j) {
      const int64_t t = base + j;
      x[j] = vm[j] = 0;
      if (t >= bd.lo) {
        acc_t rt = static_cast<acc_t>(r[t]);
        acc_t vt = kValues ? static_cast<acc_t>(v[t]) : acc_t(0);
        if constexpr (kHasMask<mask_t>) {
          // select, not multiply: junk (NaN, inf) at a masked token must not leak
          const bool keep = mask_at<mask_t, acc_t>(m, t) != acc_t(0);
          rt = keep ? rt : acc_t(0);
          if (kValues) vt = keep ? vt : acc_t(0);
        }
        x[j] = kValues ? (rt + g * v_next) - vt : rt;
        vm[j] = vt;
        v_next = vt;
        a = x[j] + times(c, a);
        b = c * b;
      }
    }
    acc_t ea, eb, ta, tb;
    suffix_scan(a, b, ea, eb, ta, tb, sa, sb);
    acc_t y = ea + times(eb, carry);
#pragma unroll
    for (int j = kItems - 1; j >= 0; --j) {
      const int64_t t = base + j;
      if (t >= bd.lo) {
        y = x[j] + times(c, y);
        adv[t] = static_cast<scalar_t>(y);
        if (kValues) ret[t] = static_cast<scalar_t>(y + vm[j]);
      }
    }
    carry = ta + times(tb, carry);
  }
}

// The adjoint, forwards in time: gx[t] = ga[t] + gr[t] + c * gx[t - 1] (gx[lo - 1] = 0),
// d rewards = m ? gx : 0, d values = m ? gr - gx + gamma * gx[t - 1] : 0 (select, as the forward).
template <bool kValues, typename scalar_t, typename mask_t>
__global__ void fused_backward_kernel(const scalar_t* __restrict__ ga,
                                      const scalar_t* __restrict__ gr,
                                      const mask_t* __restrict__ m, const int32_t* cu32,
                                      const int64_t* cu64, int64_t T, int64_t N,
                                      scalar_t* __restrict__ dr, scalar_t* __restrict__ dv,
                                      at::opmath_type<scalar_t> g, at::opmath_type<scalar_t> c) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ acc_t sa[kWarps], sb[kWarps];
  const Bounds bd = bounds(blockIdx.x, T, N, cu32, cu64);
  acc_t carry = 0;  // gx before the tile
  for (int64_t tile_lo = bd.lo; tile_lo < bd.hi; tile_lo += kTile) {
    // thread kThreads - 1 owns the tile's first tokens: later threads come earlier in time
    const int64_t base = tile_lo + kTile - int64_t(kItems) * (threadIdx.x + 1);
    acc_t x[kItems], grv[kItems];
    acc_t a = 0, b = 1;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t t = base + j;
      x[j] = grv[j] = 0;
      if (t < bd.hi) {
        const acc_t gat = ga ? static_cast<acc_t>(ga[t]) : acc_t(0);
        grv[j] = (kValues && gr) ? static_cast<acc_t>(gr[t]) : acc_t(0);
        x[j] = gat + grv[j];
        a = x[j] + times(c, a);
        b = c * b;
      }
    }
    acc_t ea, eb, ta, tb;
    suffix_scan(a, b, ea, eb, ta, tb, sa, sb);
    acc_t prev = ea + times(eb, carry);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int64_t t = base + j;
      if (t < bd.hi) {
        const acc_t gx = x[j] + times(c, prev);
        // select, as the forward: a masked token's gradient is 0 even where gx is not finite
        const bool keep = mask_at<mask_t, acc_t>(m, t) != acc_t(0);
        dr[t] = static_cast<scalar_t>(keep ? gx : acc_t(0));
        if (kValues) {
          const acc_t d = (grv[j] - gx) + g * prev;
          dv[t] = static_cast<scalar_t>(keep ? d : acc_t(0));
        }
        prev = gx;
      }
    }
    carry = ta + times(tb, carry);
  }
}

// ------------------------------------------------------------------------------ host side
at::ScalarType compute_type(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

void check_layout(const char* op, const at::Tensor& x, const c10::optional<at::Tensor>& mask,
                  const c10::optional<at::Tensor>& cu) {
  const auto st = x.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16,
              op, ": expected a float32/float64/float16/bfloat16 tensor, got ", st);
  TORCH_CHECK(x.is_cuda(), op, ": expected CUDA tensors");
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

c10::optional<at::Tensor> prepare_mask(const c10::optional<at::Tensor>& mask, at::ScalarType st) {
  if (!mask.has_value()) return c10::nullopt;
  const auto mt = mask->scalar_type();
  if (mt == at::kBool || mt == st || mt == compute_type(st)) return mask->contiguous();
  return mask->to(compute_type(st)).contiguous();
}

template <typename scalar_t, typename F>
void with_mask(const c10::optional<at::Tensor>& mask, F&& f) {
  using acc_t = at::opmath_type<scalar_t>;
  if (!mask.has_value()) {
    f(static_cast<const NoMask*>(nullptr));
  } else if (mask->scalar_type() == at::kBool) {
    f(static_cast<const bool*>(mask->data_ptr<bool>()));
  } else if (mask->scalar_type() == c10::CppTypeToScalarType<scalar_t>::value) {
    f(static_cast<const scalar_t*>(mask->data_ptr<scalar_t>()));
  } else {
    f(static_cast<const acc_t*>(mask->data_ptr<acc_t>()));
  }
}

// Launch geometry and sequence bounds shared by the four ops.
struct Layout {
  at::Tensor cu;  // contiguous cu_seqlens, or undefined
  const int32_t* cu32 = nullptr;
  const int64_t* cu64 = nullptr;
  int64_t count = 0, T = 0, N = 0;
};

Layout make_layout(const at::Tensor& x, const c10::optional<at::Tensor>& cu) {
  Layout l;
  l.N = x.numel();
  if (cu.has_value()) {
    l.cu = cu->contiguous();
    if (l.cu.scalar_type() == at::kInt) {
      l.cu32 = l.cu.data_ptr<int32_t>();
    } else {
      l.cu64 = l.cu.data_ptr<int64_t>();
    }
    l.count = l.cu.numel() - 1;
  } else {
    l.count = x.size(0);
    l.T = x.size(1);
  }
  TORCH_CHECK(l.count < (int64_t(1) << 31), "too many sequences for one launch: ", l.count);
  return l;
}

dim3 blocks(const Layout& l) { return dim3(static_cast<unsigned>(l.count)); }

template <typename scalar_t>
const scalar_t* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<scalar_t>() : nullptr;
}

std::tuple<at::Tensor, at::Tensor> fused_gae_cuda(const at::Tensor& rewards,
                                                  const at::Tensor& values,
                                                  const c10::optional<at::Tensor>& mask_in,
                                                  const c10::optional<at::Tensor>& cu_in,
                                                  double gamma, double lam) {
  check_layout("fused_gae", rewards, mask_in, cu_in);
  check_like("fused_gae", "values", values, rewards);
  const c10::cuda::CUDAGuard guard(rewards.device());
  const auto r = rewards.contiguous();
  const auto v = values.contiguous();
  const auto mask = prepare_mask(mask_in, r.scalar_type());
  const Layout l = make_layout(r, cu_in);
  auto adv = at::empty(r.sizes(), r.options());
  auto ret = at::empty(r.sizes(), r.options());
  if (l.count <= 0 || l.N == 0) return {adv, ret};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, r.scalar_type(), "fused_gae_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const acc_t g = static_cast<acc_t>(gamma), c = static_cast<acc_t>(gamma * lam);
    with_mask<scalar_t>(mask, [&](const auto* m) {
      using mask_t = std::remove_cv_t<std::remove_pointer_t<decltype(m)>>;
      fused_forward_kernel<true, scalar_t, mask_t><<<blocks(l), kThreads, 0, stream>>>(
          r.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), m, l.cu32, l.cu64, l.T, l.N,
          adv.data_ptr<scalar_t>(), ret.data_ptr<scalar_t>(), g, c);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {adv, ret};
}

at::Tensor fused_returns_cuda(const at::Tensor& rewards, const c10::optional<at::Tensor>& mask_in,
                              const c10::optional<at::Tensor>& cu_in, double gamma) {
  check_layout("fused_returns", rewards, mask_in, cu_in);
  const c10::cuda::CUDAGuard guard(rewards.device());
  const auto r = rewards.contiguous();
  const auto mask = prepare_mask(mask_in, r.scalar_type());
  const Layout l = make_layout(r, cu_in);
  auto out = at::empty(r.sizes(), r.options());
  if (l.count <= 0 || l.N == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, r.scalar_type(), "fused_returns_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const acc_t g = static_cast<acc_t>(gamma);
        with_mask<scalar_t>(mask, [&](const auto* m) {
          using mask_t = std::remove_cv_t<std::remove_pointer_t<decltype(m)>>;
          fused_forward_kernel<false, scalar_t, mask_t><<<blocks(l), kThreads, 0, stream>>>(
              r.data_ptr<scalar_t>(), nullptr, m, l.cu32, l.cu64, l.T, l.N,
              out.data_ptr<scalar_t>(), nullptr, g, g);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_gae_backward_cuda(
    const c10::optional<at::Tensor>& grad_adv, const c10::optional<at::Tensor>& grad_ret,
    const c10::optional<at::Tensor>& mask_in, const c10::optional<at::Tensor>& cu_in,
    double gamma, double lam) {
  TORCH_CHECK(grad_adv.has_value() || grad_ret.has_value(),
              "fused_gae_backward: at least one gradient must be given");
  const at::Tensor& ref = grad_adv.has_value() ? *grad_adv : *grad_ret;
  check_layout("fused_gae_backward", ref, mask_in, cu_in);
  if (grad_adv.has_value()) check_like("fused_gae_backward", "grad_adv", *grad_adv, ref);
  if (grad_ret.has_value()) check_like("fused_gae_backward", "grad_ret", *grad_ret, ref);
  const c10::cuda::CUDAGuard guard(ref.device());
  const auto ga = grad_adv.has_value() ? grad_adv->contiguous() : at::Tensor();
  const auto gr = grad_ret.has_value() ? grad_ret->contiguous() : at::Tensor();
  const auto mask = prepare_mask(mask_in, ref.scalar_type());
  const Layout l = make_layout(ref, cu_in);
  auto dr = at::empty(ref.sizes(), ref.options().memory_format(at::MemoryFormat::Contiguous));
  auto dv = at::empty_like(dr);
  if (l.count <= 0 || l.N == 0) return {dr, dv};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, ref.scalar_type(), "fused_gae_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const acc_t g = static_cast<acc_t>(gamma), c = static_cast<acc_t>(gamma * lam);
        with_mask<scalar_t>(mask, [&](const auto* m) {
          using mask_t = std::remove_cv_t<std::remove_pointer_t<decltype(m)>>;
          fused_backward_kernel<true, scalar_t, mask_t><<<blocks(l), kThreads, 0, stream>>>(
              ptr_or_null<scalar_t>(ga), ptr_or_null<scalar_t>(gr), m, l.cu32, l.cu64, l.T, l.N,
              dr.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(), g, c);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return {dr, dv};
}

at::Tensor fused_returns_backward_cuda(const at::Tensor& grad,
                                       const c10::optional<at::Tensor>& mask_in,
                                       const c10::optional<at::Tensor>& cu_in, double gamma) {
  check_layout("fused_returns_backward", grad, mask_in, cu_in);
  const c10::cuda::CUDAGuard guard(grad.device());
  const auto gg = grad.contiguous();
  const auto mask = prepare_mask(mask_in, gg.scalar_type());
  const Layout l = make_layout(gg, cu_in);
  auto dr = at::empty(gg.sizes(), gg.options());
  if (l.count <= 0 || l.N == 0) return dr;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, gg.scalar_type(), "fused_returns_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const acc_t g = static_cast<acc_t>(gamma);
        with_mask<scalar_t>(mask, [&](const auto* m) {
          using mask_t = std::remove_cv_t<std::remove_pointer_t<decltype(m)>>;
          fused_backward_kernel<false, scalar_t, mask_t><<<blocks(l), kThreads, 0, stream>>>(
              gg.data_ptr<scalar_t>(), nullptr, m, l.cu32, l.cu64, l.T, l.N,
              dr.data_ptr<scalar_t>(), nullptr, g, g);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
  return dr;
}

}  // namespace

TORCH_LIBRARY_IMPL(rlhf_kernels, CUDA, m) {
  m.impl("fused_gae", &fused_gae_cuda);
  m.impl("fused_gae_backward", &fused_gae_backward_cuda);
  m.impl("fused_returns", &fused_returns_cuda);
  m.impl("fused_returns_backward", &fused_returns_backward_cuda);
}
