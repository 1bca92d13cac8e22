"""GAE and discounted returns as one segmented reverse linear scan.

Both are ``y[t] = x[t] + c[t] * y[t + 1]`` along time, with ``c = 0`` at the last token of each
sequence (so the value after a sequence's end is 0):

- GAE: ``x = r[t] + gamma * v[t + 1] - v[t]`` (``v[t + 1] = 0`` at a sequence end),
  ``c = gamma * lam``; returns ``= advantages + v``.
- discounted returns: ``x = r``, ``c = gamma``.

Layouts: packed 1-D ``(N,)`` with ``cu_seqlens`` (sequences are contiguous runs), or padded
``(B, T)`` with a mask; the padded form reproduces the classic reversed-time loop exactly (rewards
and values zeroed outside the mask, the recurrence runs over the full row).

With the native extension (``auto`` / ``native``), ``gae`` and ``discounted_returns`` run ONE
fused op after validation: ``fused_gae`` / ``fused_returns`` (csrc/gae.cpp, csrc/gae_cuda.cu) read
rewards, values, mask and ``cu_seqlens`` as given and compute mask, delta, scan and returns in one
pass per sequence (the same operations in the same order as the path below; backward: the adjoint
scan, also one pass). Otherwise delta and the scan coefficients are built in torch and scanned:

Backends for the scan ``(B, T) -> (B, T)``: ``native`` (C++ CPU / CUDA op from csrc/, when
``rlhf_kernels._C`` is built), ``triton`` (one program per row, an associative scan per block and
a carry between blocks), ``torch`` (Hillis-Steele: log2(T) vectorised steps). The scan is
differentiable (its adjoint is the same scan run forward in time). On CUDA, fewer than
``_SPLIT_MAX_ROWS`` rows longer than ``2 * _SPLIT_LEN`` (the packed layout is a single row) are
cut into independent chunks plus a carry pass (``_split_scan``), so the GPU works on many
chunks at once instead of one program per row.
"""

from __future__ import annotations

import functools
import importlib

import torch

from rlhf_kernels._checks import (
    as_cu_seqlens,
    check_cu_seqlens,
    check_mask,
    check_same_device,
    check_triton_device,
    is_real,
)

BACKENDS = ("auto", "native", "triton", "torch")

try:  # registers torch.ops.rlhf_kernels.reverse_scan, fused_gae, fused_returns (+ backwards)
    importlib.import_module("rlhf_kernels._C")
    _HAS_NATIVE = hasattr(torch.ops.rlhf_kernels, "reverse_scan")
    _HAS_FUSED = _HAS_NATIVE and hasattr(torch.ops.rlhf_kernels, "fused_gae")
except (ImportError, OSError):
    _HAS_NATIVE = _HAS_FUSED = False

if _HAS_NATIVE:

    @torch.library.register_fake("rlhf_kernels::reverse_scan")
    def _reverse_scan_fake(x, coef):
        return x.new_empty(x.shape)  # contiguous, as the real op's (empty_like keeps x's strides)


def _native_supports(device: torch.device, op: str = "reverse_scan") -> bool:
    if not (_HAS_FUSED if op.startswith("fused") else _HAS_NATIVE):
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and torch._C._dispatch_has_kernel_for_dispatch_key(
        f"rlhf_kernels::{op}", "CUDA"
    )


# ----------------------------------------------------------------------------- fused native ops
# fused_gae / fused_returns (csrc/gae.cpp, csrc/gae_cuda.cu): the whole of gae() /
# discounted_returns() after validation -- mask, delta, scan, returns -- in one pass per
# sequence, reading the inputs as given (any float dtype, bool or float mask, int32/int64
# cu_seqlens) and writing the outputs in the inputs' dtype. Their backward ops are the adjoint
# scans, also one pass. Fake implementations let torch.compile trace them.
if _HAS_FUSED:

    def _contiguous_like(x):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)

    @torch.library.register_fake("rlhf_kernels::fused_gae")
    def _fused_gae_fake(rewards, values, mask, cu_seqlens, gamma, lam):
        return _contiguous_like(rewards), _contiguous_like(rewards)

    @torch.library.register_fake("rlhf_kernels::fused_gae_backward")
    def _fused_gae_backward_fake(grad_adv, grad_ret, mask, cu_seqlens, gamma, lam):
        ref = grad_adv if grad_adv is not None else grad_ret
        return _contiguous_like(ref), _contiguous_like(ref)

    @torch.library.register_fake("rlhf_kernels::fused_returns")
    def _fused_returns_fake(rewards, mask, cu_seqlens, gamma):
        return _contiguous_like(rewards)

    @torch.library.register_fake("rlhf_kernels::fused_returns_backward")
    def _fused_returns_backward_fake(grad, mask, cu_seqlens, gamma):
        return _contiguous_like(grad)

    def _fused_gae_setup(ctx, inputs, output):
        _, _, mask, cu_seqlens, gamma, lam = inputs
        ctx.save_for_backward(mask, cu_seqlens)
        ctx.scalars = (gamma, lam)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not zeros

    def _fused_returns_setup(ctx, inputs, output):
        _, mask, cu_seqlens, gamma = inputs
        ctx.save_for_backward(mask, cu_seqlens)
        ctx.scalars = (gamma,)
        ctx.set_materialize_grads(False)

    def _fused_gae_bwd(ctx, grad_adv, grad_ret):
        if grad_adv is None and grad_ret is None:
            return None, None, None, None, None, None
        mask, cu_seqlens = ctx.saved_tensors
        d_r, d_v = torch.ops.rlhf_kernels.fused_gae_backward(
            grad_adv, grad_ret, mask, cu_seqlens, *ctx.scalars
        )
        return d_r, d_v, None, None, None, None

    def _fused_returns_bwd(ctx, grad):
        if grad is None:
            return None, None, None, None
        mask, cu_seqlens = ctx.saved_tensors
        d_r = torch.ops.rlhf_kernels.fused_returns_backward(grad, mask, cu_seqlens, *ctx.scalars)
        return d_r, None, None, None

    torch.library.register_autograd(
        "rlhf_kernels::fused_gae", _fused_gae_bwd, setup_context=_fused_gae_setup
    )
    torch.library.register_autograd(
        "rlhf_kernels::fused_returns", _fused_returns_bwd, setup_context=_fused_returns_setup
    )


# ----------------------------------------------------------------------------- torch fallback
def reverse_scan_torch(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """``y[:, t] = x[:, t] + coef[:, t] * y[:, t + 1]`` by log-depth doubling; x, coef ``(B, T)``.

    After step ``d`` each position holds the affine map of the next ``2d`` positions composed,
    ``y[t] = a[t] + b[t] * y[t + 2d]`` (positions past the end contribute 0). A map with
    ``b == 0`` ignores what follows, even a non-finite value (``0 * inf`` would be NaN).
    """
    a, b = x, coef
    T = x.shape[-1]
    d = 1
    while d < T:
        a = torch.cat([a[:, :-d] + _times(b[:, :-d], a[:, d:]), a[:, -d:]], dim=1)
        b = torch.cat([b[:, :-d] * b[:, d:], torch.zeros_like(b[:, -d:])], dim=1)
        d *= 2
    return a


def _times(b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``b * y``, 0 where ``b == 0`` (a segment's end: no NaN from a non-finite ``y`` after it)."""
    return torch.where(b == 0, 0.0, b * y)


def reverse_scan_loop(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """Readable reference: the reversed-time loop (tests and benchmarks only)."""
    y = torch.empty_like(x)
    carry = torch.zeros_like(x[:, 0])
    for t in reversed(range(x.shape[1])):
        carry = x[:, t] + _times(coef[:, t], carry)
        y[:, t] = carry
    return y


# ----------------------------------------------------------------------------- triton kernel
try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional; the torch and native backends still work
    triton = None

if triton is not None:

    @triton.jit
    def _compose(a_prev, b_prev, a_cur, b_cur):
        # prev = map of the later positions, cur = this position: y = a_cur + b_cur * y_next
        # (b_cur == 0 ends a segment: nothing after it, not even inf, reaches this position)
        return a_cur + tl.where(b_cur == 0, 0.0, b_cur * a_prev), b_cur * b_prev

    @triton.jit
    def _reverse_scan_kernel(x_ptr, c_ptr, y_ptr, T, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = row.to(tl.int64) * T
        idx = tl.arange(0, BLOCK)
        carry = tl.sum(tl.zeros((BLOCK,), dtype=tl.float32), axis=0)
        for start in range(0, T, BLOCK):
            # walk the row backwards: position j of this block is time T - 1 - start - j
            t = T - 1 - start - idx
            ok = t >= 0
            x = tl.load(x_ptr + base + t, mask=ok, other=0.0).to(tl.float32)
            c = tl.load(c_ptr + base + t, mask=ok, other=0.0).to(tl.float32)
            a, b = tl.associative_scan((x, c), 0, _compose)
            y = a + tl.where(b == 0, 0.0, b * carry)
            tl.store(y_ptr + base + t, y.to(y_ptr.dtype.element_ty), mask=ok)
            carry = tl.sum(tl.where(idx == BLOCK - 1, y, 0.0), axis=0)


def reverse_scan_triton(x: torch.Tensor, coef: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """Triton scan (fp32 carry), x, coef ``(B, T)`` float32. Needs CUDA or TRITON_INTERPRET=1."""
    x, coef = x.contiguous(), coef.contiguous()
    y = torch.empty_like(x)
    B, T = x.shape
    if B and T:
        blk = min(block, triton.next_power_of_2(T))
        _reverse_scan_kernel[(B,)](x, coef, y, T, BLOCK=blk)
    return y


# ----------------------------------------------------------------------------- dispatch + autograd
def gae_reference(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The classic reversed-time loop (OpenRLHF-style) on padded ``(B, T)``: the ground truth
    of ``gae`` in tests and the baseline in benchmarks. Returns ``(advantages, returns)``."""
    values, rewards = torch.where(mask != 0, values, 0), torch.where(mask != 0, rewards, 0)
    T = rewards.shape[1]
    last = torch.zeros_like(rewards[:, 0])
    adv = []
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t < T - 1 else 0.0
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = delta + gamma * lam * last
        adv.append(last)
    adv = torch.stack(adv[::-1], dim=1)
    return adv, adv + values


def discounted_returns_reference(
    rewards: torch.Tensor, mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Reversed-time loop for REINFORCE returns on padded ``(B, T)``."""
    rewards = torch.where(mask != 0, rewards, 0)
    g = torch.zeros_like(rewards[:, 0])
    out = []
    for t in reversed(range(rewards.shape[1])):
        g = rewards[:, t] + gamma * g
        out.append(g)
    return torch.stack(out[::-1], dim=1)


def _pick_backend(backend: str, x: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        if _native_supports(x.device):
            return "native"
        if x.device.type == "cuda" and x.dtype == torch.float32 and triton is not None:
            return "triton"
        return "torch"
    if backend == "native" and not _native_supports(x.device):
        raise ValueError(f"backend='native' needs rlhf_kernels._C built for {x.device.type}")
    if backend == "triton" and triton is None:
        raise ValueError("backend='triton' needs the triton package, which is not installed")
    if backend == "triton" and x.dtype != torch.float32:
        raise ValueError(f"backend='triton' supports float32 only, got {x.dtype}")
    if backend == "triton":
        check_triton_device("x", x)
    return backend


# A few long rows (the packed layout is ONE row) would run on one GPU program / thread block:
# on CUDA such rows are cut into chunks of _SPLIT_LEN scanned in parallel (_split_scan).
_SPLIT_LEN = 2048
_SPLIT_MAX_ROWS = 64


def _split_scan(x: torch.Tensor, coef: torch.Tensor, backend: str, chunk: int) -> torch.Tensor:
    """Two-level reverse scan: ``(B, T)`` as ``(B * K, chunk)`` independent rows, then carries.

    Each chunk ``k`` is scanned with a zero carry-in (``y_loc``) and, in the same batched call,
    for ``b[t] = prod coef[t .. chunk end]`` (the weight of the value after the chunk), so
    ``y = y_loc + b * carry[k]``. The carries are the chunk-start values ``Z[k + 1]`` of
    ``Z[k] = y_loc[k, 0] + b[k, 0] * Z[k + 1]``: a small ``(B, K)`` scan.
    """
    B, T = x.shape
    K = -(-T // chunk)
    pad = K * chunk - T  # zero x and coef after the end: y there is 0, as y[T] = 0
    xs = torch.nn.functional.pad(x, (0, pad)).view(B, K, chunk)
    cs = torch.nn.functional.pad(coef, (0, pad)).view(B, K, chunk)
    e_last = torch.zeros_like(xs)
    e_last[..., -1] = cs[..., -1]  # b[last] = coef[last], then b[t] = coef[t] * b[t + 1]
    both = _scan(
        torch.cat([xs, e_last]).view(-1, chunk), cs.repeat(2, 1, 1).view(-1, chunk), backend
    )
    y_loc, b = both.view(2, B, K, chunk).unbind(0)
    z = reverse_scan_torch(y_loc[..., 0], b[..., 0])  # (B, K) chunk-start values
    carry = torch.cat([z[:, 1:], torch.zeros_like(z[:, :1])], dim=1)
    return (y_loc + _times(b, carry[..., None])).view(B, K * chunk)[:, :T]


def _scan(x: torch.Tensor, coef: torch.Tensor, backend: str) -> torch.Tensor:
    B, T = x.shape
    if x.is_cuda and B < _SPLIT_MAX_ROWS and T > 2 * _SPLIT_LEN:
        return _split_scan(x, coef, backend, _SPLIT_LEN)
    if backend == "native":
        return torch.ops.rlhf_kernels.reverse_scan(x.contiguous(), coef.contiguous())
    if backend == "triton":
        return reverse_scan_triton(x, coef)
    return reverse_scan_torch(x, coef)


class _ReverseScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, coef, backend):
        y = _scan(x, coef, backend)
        ctx.save_for_backward(coef, y)
        ctx.backend = backend
        return y

    @staticmethod
    def backward(ctx, gy):
        coef, y = ctx.saved_tensors
        # adjoint: gx[t] = gy[t] + coef[t - 1] * gx[t - 1], a forward scan = reverse scan of flips
        shifted = torch.cat([torch.zeros_like(coef[:, :1]), coef[:, :-1]], dim=1)
        gx = _scan(gy.flip(1).contiguous(), shifted.flip(1).contiguous(), ctx.backend).flip(1)
        y_next = torch.cat([y[:, 1:], torch.zeros_like(y[:, :1])], dim=1)
        return gx, gx * y_next, None


def reverse_scan(x: torch.Tensor, coef: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """Segmented reverse linear scan ``y[:, t] = x[:, t] + coef[:, t] * y[:, t + 1]``.

    Args:
        x, coef: ``(B, T)`` float tensors of one dtype and device; ``coef == 0`` ends a segment
            (nothing after it reaches ``y[t]``, not even a non-finite value).
        backend: ``"auto"`` (native op, else Triton on CUDA, else torch) or one backend by name.
    Returns: ``y`` ``(B, T)`` in x's dtype (half precisions are computed in float32).
    """
    for n, t in (("x", x), ("coef", coef)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dim() != 2:
            got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if torch.is_tensor(t) else type(t)
            raise ValueError(f"reverse_scan: {n} must be a (B, T) float tensor, got {got}")
    if coef.shape != x.shape or coef.dtype != x.dtype:
        raise ValueError(
            f"reverse_scan: coef must have x's shape {tuple(x.shape)} and dtype {x.dtype}, got "
            f"{tuple(coef.shape)} {coef.dtype}"
        )
    check_same_device(x=x, coef=coef)
    work = x.dtype if x.dtype in _SCAN_DTYPES else torch.float32
    xw, cw = x.to(work), coef.to(work)
    return _ReverseScan.apply(xw, cw, _pick_backend(backend, xw)).to(x.dtype)


# ----------------------------------------------------------------------------- layouts
_SCAN_DTYPES = (torch.float32, torch.float64)


def _check_scalars(**scalars) -> None:
    """``gamma`` / ``lam``: numbers in [0, 1] (a discount above 1 makes returns grow with the
    horizon; NaN would fill every advantage with NaN)."""
    for name, x in scalars.items():
        if not is_real(x):
            raise TypeError(f"{name} must be a number in [0, 1], got {type(x).__name__} {x!r}")
        if not 0 <= x <= 1:  # also NaN
            raise ValueError(f"{name} must be in [0, 1], got {x!r}")


def _validate(name_tensors, cu_seqlens, mask, backend):
    """Every input check, before any work; returns ``(cu, mask)``: the validated ``cu_seqlens``
    list (None; under torch.compile the tensor) and the mask to use (``check_mask``'s)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    (n0, t0), *rest = name_tensors
    for n, t in name_tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{n} must be a float tensor, got {t.dtype}")
        if backend == "triton" and t.dtype == torch.float64:
            raise ValueError(
                f"backend='triton' scans in float32 (half types are upcast), got {n} float64: "
                f"use backend 'auto', 'native' or 'torch'"
            )
        if backend == "triton":
            check_triton_device(n, t)
    for n, t in rest:
        if t.shape != t0.shape:
            raise ValueError(f"{n} must have {n0}'s shape {tuple(t0.shape)}, got {tuple(t.shape)}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    check_same_device(**dict(name_tensors), cu_seqlens=cu_seqlens, mask=mask)
    if mask is not None and mask.shape != t0.shape:
        raise ValueError(f"mask must have {n0}'s shape {tuple(t0.shape)}, got {tuple(mask.shape)}")
    mask = check_mask(mask)
    if cu_seqlens is not None:
        if t0.dim() != 1:
            raise ValueError(
                f"with cu_seqlens, {n0} must be packed 1-D (N,), got shape {tuple(t0.shape)}"
            )
        if torch.compiler.is_compiling():
            return cu_seqlens, mask  # traced: validated at run time by the segment_ids op
        return check_cu_seqlens(cu_seqlens, t0.shape[0]), mask
    if mask is not None:
        if t0.dim() != 2:
            raise ValueError(
                f"with mask, {n0} must be padded 2-D (B, T), got shape {tuple(t0.shape)}"
            )
        return None, mask
    raise ValueError(
        "give either cu_seqlens (packed 1-D layout) or mask (padded (B, T) layout); got neither"
    )


def _use_fused(op, backend, tensors, mask, cu):
    """Whether the fused native op runs this call (auto / native backend, op built for the
    device, one dtype, no gradient wanted for the mask); otherwise the delta + scan path does."""
    t0 = tensors[0]
    if backend not in ("auto", "native") or not _native_supports(t0.device, op):
        return False
    if torch.compiler.is_compiling():
        return False  # traced: the scan path below (the fused op has a fake, but on CUDA it
        # does not check cu_seqlens, which eager validation does before it runs)
    if any(t.dtype != t0.dtype for t in tensors) or (mask is not None and mask.requires_grad):
        return False
    return True


def _prepare(name_tensors, cu, mask):
    """The scan path's inputs (validated by ``_validate``; ``cu`` its list, None, or under
    torch.compile the ``cu_seqlens`` tensor): 2-D float
    tensors, is_last (B, T) bool, out_shape, out_dtype."""
    t0 = name_tensors[0][1]
    if isinstance(cu, torch.Tensor):  # traced: ends from per-token sequence ids
        from rlhf_kernels.ops.compiled import segment_ids

        seq = segment_ids(cu, t0.shape[0])
        is_last = torch.cat([seq[1:] != seq[:-1], seq.new_ones(1, dtype=torch.bool)])
        is_last = is_last[: t0.shape[0]][None]  # (an empty stream: no end)
    elif cu is not None:
        is_last = torch.zeros(1, t0.shape[0], dtype=torch.bool, device=t0.device)
        ends = [e - 1 for s, e in zip(cu[:-1], cu[1:]) if e > s]
        is_last[0, ends] = True
    else:
        is_last = torch.zeros(t0.shape, dtype=torch.bool, device=t0.device)
        is_last[:, -1:] = True  # (T = 0: nothing)
    out_dtype = t0.dtype
    work = functools.reduce(torch.promote_types, [t.dtype for _, t in name_tensors])
    work = work if work in _SCAN_DTYPES else torch.float32  # (half types computed in float32)
    ts = [t.to(work).reshape(is_last.shape) for _, t in name_tensors]
    if mask is not None:
        m = mask.reshape(is_last.shape)
        if m.requires_grad:  # a mask that wants a gradient: the product it differentiates
            ts = [t * m.to(work) for t in ts]
        else:  # a select, not t * m: junk (NaN, inf) at masked tokens stays out
            ts = [torch.where(m != 0, t, 0) for t in ts]
    return ts, is_last, t0.shape, out_dtype


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    cu_seqlens: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over packed or padded sequences.

    Args:
        rewards: per-token rewards, packed ``(N,)`` (with ``cu_seqlens``) or padded ``(B, T)``
            (with ``mask``); any float dtype.
        values: critic values, ``rewards``' shape and device; any float dtype (computed in
            the wider of the two dtypes, half types in float32; outputs in ``rewards``' dtype).
        gamma: discount factor, lam: GAE lambda; numbers in [0, 1] (ValueError otherwise).
        cu_seqlens: int32/int64 ``(S + 1,)`` boundaries of the packed sequences, ending at ``N``
            (a list of ints is converted).
        mask: ``(N,)`` or ``(B, T)`` 0/1 (bool or numeric; other values raise) token mask;
            rewards and values are zeroed where it is 0. Required for the padded layout,
            optional for the packed one. A 0 inside a sequence does NOT end it: that step
            counts as reward 0 and value 0 and the recurrence runs through it (the classic
            padded loop), e.g. ``adv[t-1] = r[t-1] - v[t-1] + gamma * lam * adv[t]`` with
            ``adv[t] = gamma * v[t+1] + gamma * lam * adv[t+1]``. Sequences end only at
            ``cu_seqlens`` boundaries (packed) or at the row end (padded).
        backend: ``"auto"``, ``"native"``, ``"triton"`` or ``"torch"``. ``auto`` / ``native``
            run the fused native op (mask, delta, scan and returns in one pass per sequence)
            where it is built for the device; ``triton`` / ``torch`` (and ``auto`` without the
            extension) build delta in torch and run that backend's scan (``triton``: float32
            and half types, float64 is refused).
    Returns:
        ``(advantages, returns)`` in rewards' shape and dtype; ``returns = advantages + values``
        (values masked). The value after the last token of each sequence is 0. Differentiable.
    """
    cu_seqlens = as_cu_seqlens(cu_seqlens, getattr(rewards, "device", None))
    tensors = [("rewards", rewards), ("values", values)]
    _check_scalars(gamma=gamma, lam=lam)
    cu, mask = _validate(tensors, cu_seqlens, mask, backend)
    if _use_fused("fused_gae", backend, (rewards, values), mask, cu_seqlens):
        adv, ret = torch.ops.rlhf_kernels.fused_gae(
            rewards, values, mask, cu_seqlens, float(gamma), float(lam)
        )
        return adv, ret
    (r, v), is_last, shape, dtype = _prepare(tensors, cu, mask)
    v_next = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], dim=1).masked_fill(is_last, 0.0)
    delta = r + gamma * v_next - v
    coef = torch.full_like(delta, gamma * lam).masked_fill(is_last, 0.0)
    adv = reverse_scan(delta, coef, backend)
    ret = adv + v
    return adv.reshape(shape).to(dtype), ret.reshape(shape).to(dtype)


def discounted_returns(
    rewards: torch.Tensor,
    *,
    gamma: float,
    cu_seqlens: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """REINFORCE returns ``G[t] = r[t] + gamma * G[t + 1]`` per sequence (``G`` after the end = 0).

    Args: as :func:`gae` (``rewards`` packed ``(N,)`` with ``cu_seqlens`` or padded ``(B, T)``
    with ``mask``). Returns: ``G`` in rewards' shape and dtype. Differentiable.
    """
    cu_seqlens = as_cu_seqlens(cu_seqlens, getattr(rewards, "device", None))
    tensors = [("rewards", rewards)]
    _check_scalars(gamma=gamma)
    cu, mask = _validate(tensors, cu_seqlens, mask, backend)
    if _use_fused("fused_returns", backend, (rewards,), mask, cu_seqlens):
        return torch.ops.rlhf_kernels.fused_returns(rewards, mask, cu_seqlens, float(gamma))
    (r,), is_last, shape, dtype = _prepare(tensors, cu, mask)
    coef = torch.full_like(r, gamma).masked_fill(is_last, 0.0)
    return reverse_scan(r, coef, backend).reshape(shape).to(dtype)
