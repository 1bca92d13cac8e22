"""Token log-probs (and entropy) from logits without a full fp32 copy of the logits.

For logits ``z`` ``(R, V)`` (any leading shape flattened into ``R`` rows), temperature ``tau``,
``u = z / tau``, ``lse = logsumexp(u)``:

- ``logp[r] = u[r, label[r]] - lse[r]``
- ``entropy[r] = lse[r] - sum_v softmax(u)[r, v] * u[r, v]``
- ``d logp / d z = (onehot(label) - p) / tau``,  ``d entropy / d z = -p * (log p + entropy) / tau``

OpenRLHF upcasts the whole ``(R, V)`` tensor to fp32 and runs ``log_softmax`` on it (two fp32
copies). Here the forward keeps only the row max ``m``, ``log s`` (``lse = m + log s``) and
``entropy`` per row (fp32, ``R`` floats each); the backward recomputes ``log p = (u - m) - log s``
per row block, rounded as torch's ``log_softmax`` rounds it (``u - lse`` would lose
``|lse| * eps``), and writes the one gradient tensor (logits' dtype).

Backends: ``triton`` (one program per row, online log-sum-exp over vocab blocks; CUDA, or CPU
under ``TRITON_INTERPRET=1``) and ``torch`` (row chunks of at most ``_CHUNK_ELEMS`` elements
upcast at a time). Both read the logits in place as a ``(B, S, V)`` view with two row strides
(``_as_rows``), so the shifted slice ``logits[:, :-1]`` is neither copied nor saved twice.
``-inf`` logits (a masked vocabulary) have ``p = 0`` and contribute ``p log p = 0``.

Labels equal to ``ignore_index`` (default -100, what collators and ``RingPlan`` labels put at
positions with no target) get ``logp = 0`` and pass no gradient through ``logp``, on every
backend; their entropy is still computed (it does not depend on the label). Any other label
outside ``[0, V)`` is a ValueError where the check runs (CPU, or ``RLHF_KERNELS_DEBUG=1``) and a
NaN log-prob otherwise (the kernels never read outside the row). A NaN logit gives a NaN row
on every backend. There is no second derivative: ``create_graph=True`` is a RuntimeError.
"""

from __future__ import annotations

import os

import torch

from rlhf_kernels._checks import check_triton_device, device_guard, is_scalar
from rlhf_kernels.ops._once import first_order_only

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None

BACKENDS = ("auto", "triton", "torch")
_CHUNK_ELEMS = 1 << 22  # torch backend: fp32 elements upcast per row chunk (16 MiB)
_MAX_BLOCK_V = 4096  # triton backend: vocab block per loop step
IGNORE_INDEX = -100  # labels with this value have logp 0 and no logp gradient
# Label range check: a host sync (aminmax + compare) per call. Always on CPU; on CUDA only
# when RLHF_KERNELS_DEBUG=1 (there the torch backend's gather asserts on device anyway).
CHECK_LABELS_ON_CUDA = os.environ.get("RLHF_KERNELS_DEBUG", "0") == "1"


# ----------------------------------------------------------------------------- reference
def logprobs_reference(logits, labels, temperature=1.0, ignore_index=-100):
    """Readable math in logits' dtype (callers pass float64 for a reference): (logp, entropy).

    ``p * log p`` is taken as 0 where ``p = 0`` (``-inf`` logits, e.g. a masked vocabulary);
    ``logp`` is 0 where ``labels == ignore_index``.
    """
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    ignored = torch.zeros_like(labels, dtype=torch.bool)
    if ignore_index is not None:
        ignored = labels == ignore_index
    logp = logp_all.gather(-1, labels.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    logp = logp.masked_fill(ignored, 0.0)
    p = logp_all.exp()
    entropy = -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)
    return logp, entropy


# ----------------------------------------------------------------------------- torch backend
def _rows_per_chunk(V: int) -> int:
    return max(1, _CHUNK_ELEMS // max(V, 1))


def _row_buffers(z):
    """Two reusable fp32 ``(rows, V)`` buffers: no fresh allocation per row chunk."""
    rows = min(_rows_per_chunk(z.shape[2]), z.shape[0] * z.shape[1])
    return [torch.empty(rows, z.shape[2], dtype=torch.float32, device=z.device) for _ in "ab"]


def _chunks(z):
    """Yield ``(r0, view)``: ``view`` a strided ``(n, V)`` slice of ``z`` ``(B, S, V)`` holding
    flat rows ``r0 : r0 + n`` (row ``r = b * S + s``). Views only: nothing is copied."""
    B, S, V = z.shape
    step = _rows_per_chunk(V)
    for b in range(B):
        for s0 in range(0, S, step):
            yield b * S + s0, z[b, s0 : s0 + step]


_NEG = torch.finfo(torch.float32).min  # stands in for -inf where 0 * -inf would give NaN


def _scaled(zc, tau, buf):
    """``zc / tau`` in the fp32 ``buf``: upcast first (a division in bf16/fp16 rounds to the
    input's precision: 1.7e-2 log-prob error for bf16 at tau 0.7, NaN past fp16's range)."""
    buf.copy_(zc)
    return buf if tau == 1.0 else buf.div_(tau)


def _forward_torch(z, labels, tau, want_entropy):
    R = z.shape[0] * z.shape[1]
    mx, log_sum = (torch.empty(R, dtype=torch.float32, device=z.device) for _ in "ml")
    logp = torch.empty_like(mx)
    ent = torch.empty_like(mx) if want_entropy else None
    buf_u, buf_e = _row_buffers(z)
    for r0, zc in _chunks(z):
        n = zc.shape[0]
        sl = slice(r0, r0 + n)
        u = _scaled(zc, tau, buf_u[:n])  # (rows, V) fp32: the only upcast copy
        m = u.amax(1)
        u.sub_(m[:, None])  # u - max <= 0
        e = torch.exp(u, out=buf_e[:n])
        s = e.sum(1)
        log_s = torch.log(s)
        mx[sl], log_sum[sl] = m, log_s
        logp[sl] = u.gather(1, labels[sl, None])[:, 0] - log_s
        if want_entropy:  # H = log s - sum(e * (u - m)) / s; -inf logits have e = 0
            # in place, summed by .sum (a bmm here accumulates 5x plain torch's error)
            ent[sl] = log_s - u.clamp_(min=_NEG).mul_(e).sum(1) / s
    return logp, ent, (mx, log_sum)


def _backward_torch(z, labels, tau, stats, ent, g_logp, g_ent):
    B, S, V = z.shape
    grad = torch.empty(B * S, V, dtype=z.dtype, device=z.device)
    buf_u, buf_p = _row_buffers(z)
    g_logp = g_logp / tau  # fold d u / d z = 1 / tau into the upstream gradients
    g_ent = None if g_ent is None else g_ent / tau
    mx, log_sum = stats
    for r0, zc in _chunks(z):
        n = zc.shape[0]
        sl = slice(r0, r0 + n)
        logp_all = _scaled(zc, tau, buf_u[:n]).sub_(mx[sl, None]).sub_(log_sum[sl, None])
        p = torch.exp(logp_all, out=buf_p[:n])
        if g_ent is not None:
            # -p * (log p + H) * g_H, then the log-prob term (p = 0 where log p = -inf)
            g = logp_all.clamp_(min=_NEG).add_(ent[sl, None]).mul_(p).mul_(-g_ent[sl, None])
            g.addcmul_(p, g_logp[sl, None], value=-1.0)
        else:
            g = p.mul_(-g_logp[sl, None])
        g.scatter_add_(1, labels[sl, None], g_logp[sl, None])
        grad[sl] = g
    return grad.view(B, S, V)


# ----------------------------------------------------------------------------- triton backend
if triton is not None:

    @triton.jit
    def _row_ptr(z_ptr, row, S, stride_b, stride_s):
        """Row ``row = b * S + s`` of a ``(B, S, V)`` view with strides (stride_b, stride_s, 1)."""
        r = row.to(tl.int64)
        b = r // S
        return z_ptr + b * stride_b + (r - b * S) * stride_s

    @triton.jit
    def _logprobs_fwd_kernel(
        z_ptr,
        S,
        stride_b,
        stride_s,
        lab_ptr,
        logp_ptr,
        ent_ptr,
        m_ptr,
        log_s_ptr,
        V,
        inv_tau,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        z_row = _row_ptr(z_ptr, row, S, stride_b, stride_s)
        cols = tl.arange(0, BLOCK_V)
        m = tl.max(tl.full((BLOCK_V,), float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)  # sum exp(u - m)
        t = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)  # sum exp(u - m) * (u - m)
        for start in range(0, V, BLOCK_V):
            ok = start + cols < V
            u = tl.load(z_row + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
            u = u * inv_tau
            m_new = tl.maximum(m, tl.max(u, axis=0))
            # -inf logits (masked vocab, padding lanes) contribute e = 0 and no 0 * -inf
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            live = m > float("-inf")
            scale = tl.where(live, tl.exp(m - m_safe), 0.0)
            shift = tl.where(live, m - m_safe, 0.0)  # re-base t from m to m_new
            d = u - m_safe  # floored, so e * d = 0 (not NaN) where e = 0; a NaN logit stays NaN
            d = tl.where(d < -3.0e38, -3.0e38, d)  # (tl.maximum would drop it: p = 0)
            e = tl.exp(d)
            t = scale * (t + shift * s) + tl.sum(e * d, axis=0)
            s = s * scale + tl.sum(e, axis=0)
            m = m_new
        log_s = tl.log(s)
        label = tl.load(lab_ptr + row)
        in_range = (label >= 0) & (label < V)  # never read outside the row; NaN if not
        u_lab = tl.load(z_row + tl.where(in_range, label, 0)).to(tl.float32) * inv_tau
        tl.store(m_ptr + row, m)
        tl.store(log_s_ptr + row, log_s)
        tl.store(logp_ptr + row, tl.where(in_range, (u_lab - m) - log_s, float("nan")))
        tl.store(ent_ptr + row, log_s - t / s)

    @triton.jit
    def _logprobs_bwd_kernel(
        z_ptr,
        S,
        stride_b,
        stride_s,
        g_ptr,
        lab_ptr,
        m_ptr,
        log_s_ptr,
        ent_ptr,
        glp_ptr,
        gent_ptr,
        V,
        inv_tau,
        HAS_ENT: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        z_row = _row_ptr(z_ptr, row, S, stride_b, stride_s)
        g_row = g_ptr + row.to(tl.int64) * V
        cols = tl.arange(0, BLOCK_V)
        m = tl.load(m_ptr + row)
        log_s = tl.load(log_s_ptr + row)
        label = tl.load(lab_ptr + row)
        g_lp = tl.load(glp_ptr + row)
        if HAS_ENT:
            ent = tl.load(ent_ptr + row)
            g_ent = tl.load(gent_ptr + row)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            ok = idx < V
            u = tl.load(z_row + idx, mask=ok, other=0.0).to(tl.float32) * inv_tau
            logp = (u - m) - log_s  # floored: p * logp = 0 where p = 0 (NaN stays NaN)
            logp = tl.where(logp < -3.0e38, -3.0e38, logp)
            p = tl.exp(logp)
            g = tl.where(idx == label, g_lp, 0.0) - p * g_lp
            if HAS_ENT:
                g -= g_ent * p * (logp + ent)
            tl.store(g_row + idx, (g * inv_tau).to(g_ptr.dtype.element_ty), mask=ok)

    def _block_v(V: int) -> int:
        return min(_MAX_BLOCK_V, triton.next_power_of_2(V))


def _forward_triton(z, labels, tau, want_entropy):
    B, S, V = z.shape
    mx, log_s, logp, ent = torch.empty(4, B * S, dtype=torch.float32, device=z.device)
    if B * S:
        _logprobs_fwd_kernel[(B * S,)](
            z, S, z.stride(0), z.stride(1), labels, logp, ent, mx, log_s, V, 1.0 / tau,
            BLOCK_V=_block_v(V),
        )  # fmt: skip
    return logp, (ent if want_entropy else None), (mx, log_s)


def _backward_triton(z, labels, tau, stats, ent, g_logp, g_ent):
    B, S, V = z.shape
    grad = torch.empty(B, S, V, dtype=z.dtype, device=z.device)
    has_ent = g_ent is not None
    if B * S:
        _logprobs_bwd_kernel[(B * S,)](
            z, S, z.stride(0), z.stride(1), grad, labels, *stats,
            ent if has_ent else g_logp, g_logp, g_ent if has_ent else g_logp,
            V, 1.0 / tau, HAS_ENT=has_ent, BLOCK_V=_block_v(V),
        )  # fmt: skip
    return grad


# ----------------------------------------------------------------------------- autograd
class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, labels, tau, want_entropy, backend):
        fwd = _forward_triton if backend == "triton" else _forward_torch
        with device_guard(z):
            logp, ent, (mx, log_s) = fwd(z, labels, tau, want_entropy)
        ctx.save_for_backward(z, labels, mx, log_s, ent)
        ctx.tau, ctx.backend = tau, backend
        return logp, ent

    @staticmethod
    @first_order_only
    def backward(ctx, g_logp, g_ent):
        z, labels, mx, log_s, ent = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(mx)
        bwd = _backward_triton if ctx.backend == "triton" else _backward_torch
        with device_guard(z):
            grad = bwd(
                z,
                labels,
                ctx.tau,
                (mx, log_s),
                ent,
                g_logp.float().contiguous(),
                None if g_ent is None else g_ent.float().contiguous(),
            )
        return grad, None, None, None, None


# ----------------------------------------------------------------------------- API
def _check(logits, labels, temperature, backend, ignore_index=IGNORE_INDEX):
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(
            f"logits must be a float tensor, got {getattr(logits, 'dtype', type(logits).__name__)}"
        )
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            "labels must be an int64/int32 tensor, got "
            f"{getattr(labels, 'dtype', type(labels).__name__)}"
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have shape logits.shape[:-1]={tuple(logits.shape[:-1])}, "
            f"got {tuple(labels.shape)}"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels on {labels.device} but logits on {logits.device}")
    if not (is_scalar(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and triton is None:
        raise ValueError("backend='triton' needs the triton package, which is not installed")
    if backend == "triton":  # (CPU tensors without the interpreter: "0 active drivers")
        check_triton_device("logits", logits)
    check_label_range(labels, logits.shape[-1], ignore_index, CHECK_LABELS_ON_CUDA)


def check_label_range(labels, V: int, ignore_index: int | None, on_cuda: bool) -> None:
    """ValueError unless every label is in ``[0, V)`` or equals ``ignore_index``. A host sync:
    always on CPU, on CUDA only when ``on_cuda`` (``RLHF_KERNELS_DEBUG=1``)."""
    if not labels.numel() or (labels.is_cuda and not on_cuda):
        return
    bad = (labels < 0) | (labels >= V)
    if ignore_index is not None:
        bad &= labels != ignore_index
    if bad.any():
        vals = labels[bad].unique()[:5].tolist()
        ign = "" if ignore_index is None else f" or ignore_index={ignore_index}"
        raise ValueError(f"labels must lie in [0, {V}){ign}; got {int(bad.sum())} other(s): {vals}")


def mask_labels(labels, V: int, ignore_index: int | None):
    """Flat int64 labels safe to gather with, plus the rows to fix up afterwards.

    Returns ``(safe, ignored, bad)``: ``safe`` in ``[0, V)``; ``ignored`` (or None) where
    ``labels == ignore_index`` (logp 0, no gradient); ``bad`` where a label is out of range
    anyway (reachable only where the range check is off: logp NaN). No host sync.
    """
    lab = labels.reshape(-1).long()
    ignored = None if ignore_index is None else lab == ignore_index
    if ignored is not None:
        lab = lab.masked_fill(ignored, 0)
    bad = (lab < 0) | (lab >= V)
    if torch.compiler.is_compiling():  # traced: the range check runs inside a custom op
        from rlhf_kernels.ops.compiled import safe_labels

        return safe_labels(labels, V, ignore_index, CHECK_LABELS_ON_CUDA), ignored, bad
    return lab.clamp(0, V - 1), ignored, bad


def fix_masked(logp, ignored, bad):
    """``logp`` with NaN at out-of-range labels and 0 (no gradient) at ignored ones."""
    logp = logp.masked_fill(bad, float("nan"))
    return logp if ignored is None else logp.masked_fill(ignored, 0.0)


def _as_rows(logits):
    """``logits`` ``[..., V]`` as a ``(B, S, V)`` view with unit vocab stride, rows ``b * S + s``.

    Two leading strides cover the usual shifted slice ``logits[:, :-1]`` of a ``(B, T, V)``
    tensor without a copy; only layouts that fit neither one nor two row strides (or a
    non-unit vocab stride) are copied.
    """
    V = logits.shape[-1]
    if logits.stride(-1) != 1 and V > 1:
        logits = logits.contiguous()
    for shape in ((1, -1, V), (-1, logits.shape[-2] if logits.dim() > 2 else 1, V)):
        try:
            return logits.view(shape)
        except RuntimeError:
            pass
    return logits.reshape(1, -1, V)


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    ignore_index: int | None = IGNORE_INDEX,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each label (and entropy) under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V]`` float16/bfloat16/float32/float64 scores; differentiable.
        labels: int64 (or int32) ``[...]`` token ids in ``[0, V)`` or ``ignore_index``,
            logits' leading shape.
        temperature: > 0; the distribution is ``softmax(logits / temperature)``.
        return_entropy: also return the entropy of that distribution.
            Other out-of-range labels are a ValueError on CPU; on CUDA that check (a host sync)
            runs only with ``RLHF_KERNELS_DEBUG=1``, and such a label gives a NaN log-prob.
        ignore_index: labels with this value get ``logp = 0`` and no gradient through it (their
            entropy is still computed); ``None`` treats every label as a token id.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.
    Returns:
        ``logp`` ``[...]`` float32 (float64 for float64 logits, on every backend), or
        ``(logp, entropy)`` when ``return_entropy``. No ``[..., V]`` fp32 copy is kept; the
        backward allocates only the gradient (logits' dtype).
    """
    _check(logits, labels, temperature, backend, ignore_index)
    if backend == "auto":
        backend = "triton" if logits.is_cuda and triton is not None else "torch"
    # flat labels (the kernels index them by row), gatherable; ignored/bad rows fixed below
    lab, ignored, bad = mask_labels(labels, logits.shape[-1], ignore_index)
    if logits.dtype == torch.float64:  # keep float64 end to end (reference-grade path)
        logp, ent = logprobs_reference(logits, lab.view(labels.shape), temperature, None)
        logp, ent = logp.reshape(-1), ent.reshape(-1)
    else:
        logp, ent = _LogProbs.apply(
            _as_rows(logits), lab.contiguous(), float(temperature), return_entropy, backend
        )
    logp = fix_masked(logp, ignored, bad).reshape(labels.shape)
    if return_entropy:
        return logp, ent.reshape(labels.shape)
    return logp
