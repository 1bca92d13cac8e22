"""Token log-probs (and entropy) from logits without a full fp32 copy of the logits.

For logits ``z`` ``(R, V)`` (any leading shape flattened into ``R`` rows), temperature ``tau``,
``u = z / tau``, ``lse = logsumexp(u)``:

- ``logp[r] = u[r, label[r]] - lse[r]``
- ``entropy[r] = lse[r] - sum_v softmax(u)[r, v] * u[r, v]``
- ``d logp / d z = (onehot(label) - p) / tau``,  ``d entropy / d z = -p * (log p + entropy) / tau``

OpenRLHF upcasts the whole ``(R, V)`` tensor to fp32 and runs ``log_softmax`` on it (two fp32
copies). Here the forward keeps only ``lse`` and ``entropy`` per row (fp32, ``R`` floats each);
the backward recomputes ``p`` per row block and writes the one gradient tensor (logits' dtype).

Backends: ``triton`` (one program per row, online log-sum-exp over vocab blocks; CUDA, or CPU
under ``TRITON_INTERPRET=1``) and ``torch`` (row chunks of at most ``_CHUNK_ELEMS`` elements
upcast at a time).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional
    triton = None

BACKENDS = ("auto", "triton", "torch")
_CHUNK_ELEMS = 1 << 22  # torch backend: fp32 elements upcast per row chunk (16 MiB)


# ----------------------------------------------------------------------------- reference
def logprobs_reference(logits, labels, temperature=1.0):
    """Readable math in logits' dtype (callers pass float64 for a reference): (logp, entropy)."""
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


# ----------------------------------------------------------------------------- torch backend
def _rows_per_chunk(V: int) -> int:
    return max(1, _CHUNK_ELEMS // max(V, 1))


def _row_buffers(z):
    """Two reusable fp32 ``(rows, V)`` buffers: no fresh allocation per row chunk."""
    rows = min(_rows_per_chunk(z.shape[1]), z.shape[0])
    return [torch.empty(rows, z.shape[1], dtype=torch.float32, device=z.device) for _ in "ab"]


def _forward_torch(z, labels, tau, want_entropy):
    R, _ = z.shape
    lse = torch.empty(R, dtype=torch.float32, device=z.device)
    logp = torch.empty_like(lse)
    ent = torch.empty_like(lse) if want_entropy else None
    step = _rows_per_chunk(z.shape[1])
    buf_u, buf_e = _row_buffers(z)
    for s in range(0, R, step):
        sl = slice(s, s + step)
        n = z[sl].shape[0]
        u = torch.div(z[sl], tau, out=buf_u[:n])  # (rows, V) fp32: the only upcast copy
        m = u.amax(1)
        u.sub_(m[:, None])  # u - max <= 0
        e = torch.exp(u, out=buf_e[:n])
        log_s = torch.log(e.sum(1))
        lse[sl] = m + log_s
        logp[sl] = u.gather(1, labels[sl, None])[:, 0] - log_s
        if want_entropy:  # H = log s - sum(e * (u - m)) / s
            ent[sl] = log_s - torch.bmm(e[:, None], u[:, :, None])[:, 0, 0] / log_s.exp()
    return logp, ent, lse


def _backward_torch(z, labels, tau, lse, ent, g_logp, g_ent):
    grad = torch.empty_like(z)
    step = _rows_per_chunk(z.shape[1])
    buf_u, buf_p = _row_buffers(z)
    g_logp = g_logp / tau  # fold d u / d z = 1 / tau into the upstream gradients
    g_ent = None if g_ent is None else g_ent / tau
    for s in range(0, z.shape[0], step):
        sl = slice(s, s + step)
        n = z[sl].shape[0]
        logp_all = torch.div(z[sl], tau, out=buf_u[:n]).sub_(lse[sl, None])
        p = torch.exp(logp_all, out=buf_p[:n])
        if g_ent is not None:
            # -p * (log p + H) * g_H, then the log-prob term
            g = logp_all.add_(ent[sl, None]).mul_(p).mul_(-g_ent[sl, None])
            g.addcmul_(p, g_logp[sl, None], value=-1.0)
        else:
            g = p.mul_(-g_logp[sl, None])
        g.scatter_add_(1, labels[sl, None], g_logp[sl, None])
        grad[sl] = g
    return grad


# ----------------------------------------------------------------------------- triton backend
if triton is not None:

    @triton.jit
    def _logprobs_fwd_kernel(
        z_ptr, stride, lab_ptr, logp_ptr, ent_ptr, lse_ptr, V, inv_tau, BLOCK_V: tl.constexpr
    ):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * stride
        cols = tl.arange(0, BLOCK_V)
        m = tl.max(tl.full((BLOCK_V,), float("-inf"), tl.float32), axis=0)
        s = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)  # sum exp(u - m)
        t = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)  # sum exp(u - m) * u
        for start in range(0, V, BLOCK_V):
            ok = start + cols < V
            u = tl.load(z_row + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
            u = u * inv_tau
            m_new = tl.maximum(m, tl.max(u, axis=0))
            scale = tl.exp(m - m_new)
            e = tl.where(ok, tl.exp(u - m_new), 0.0)
            s = s * scale + tl.sum(e, axis=0)
            t = t * scale + tl.sum(e * tl.where(ok, u, 0.0), axis=0)
            m = m_new
        lse = m + tl.log(s)
        label = tl.load(lab_ptr + row)
        u_lab = tl.load(z_row + label).to(tl.float32) * inv_tau
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, u_lab - lse)
        tl.store(ent_ptr + row, lse - t / s)

    @triton.jit
    def _logprobs_bwd_kernel(
        z_ptr,
        stride,
        g_ptr,
        lab_ptr,
        lse_ptr,
        ent_ptr,
        glp_ptr,
        gent_ptr,
        V,
        inv_tau,
        HAS_ENT: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * stride
        g_row = g_ptr + row.to(tl.int64) * V
        cols = tl.arange(0, BLOCK_V)
        lse = tl.load(lse_ptr + row)
        label = tl.load(lab_ptr + row)
        g_lp = tl.load(glp_ptr + row)
        if HAS_ENT:
            ent = tl.load(ent_ptr + row)
            g_ent = tl.load(gent_ptr + row)
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            ok = idx < V
            u = tl.load(z_row + idx, mask=ok, other=0.0).to(tl.float32) * inv_tau
            logp = u - lse
            p = tl.exp(logp)
            g = tl.where(idx == label, g_lp, 0.0) - p * g_lp
            if HAS_ENT:
                g -= g_ent * p * (logp + ent)
            tl.store(g_row + idx, (g * inv_tau).to(g_ptr.dtype.element_ty), mask=ok)

    def _block_v(V: int) -> int:
        return min(4096, triton.next_power_of_2(V))


def _forward_triton(z, labels, tau, want_entropy):
    R, V = z.shape
    lse = torch.empty(R, dtype=torch.float32, device=z.device)
    logp, ent = torch.empty_like(lse), torch.empty_like(lse)
    if R:
        _logprobs_fwd_kernel[(R,)](
            z, z.stride(0), labels, logp, ent, lse, V, 1.0 / tau, BLOCK_V=_block_v(V)
        )
    return logp, (ent if want_entropy else None), lse


def _backward_triton(z, labels, tau, lse, ent, g_logp, g_ent):
    R, V = z.shape
    grad = torch.empty(R, V, dtype=z.dtype, device=z.device)
    has_ent = g_ent is not None
    if R:
        _logprobs_bwd_kernel[(R,)](
            z,
            z.stride(0),
            grad,
            labels,
            lse,
            ent if has_ent else lse,
            g_logp,
            g_ent if has_ent else g_logp,
            V,
            1.0 / tau,
            HAS_ENT=has_ent,
            BLOCK_V=_block_v(V),
        )
    return grad


# ----------------------------------------------------------------------------- autograd
class _LogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, labels, tau, want_entropy, backend):
        fwd = _forward_triton if backend == "triton" else _forward_torch
        logp, ent, lse = fwd(z, labels, tau, want_entropy)
        ctx.save_for_backward(z, labels, lse, ent)
        ctx.tau, ctx.backend = tau, backend
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        z, labels, lse, ent = ctx.saved_tensors
        if g_logp is None:
            g_logp = torch.zeros_like(lse)
        bwd = _backward_triton if ctx.backend == "triton" else _backward_torch
        grad = bwd(
            z,
            labels,
            ctx.tau,
            lse,
            ent,
            g_logp.float().contiguous(),
            None if g_ent is None else g_ent.float().contiguous(),
        )
        return grad, None, None, None, None


# ----------------------------------------------------------------------------- API
def _check(logits, labels, temperature, backend):
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(
            f"logits must be a float tensor, got {getattr(logits, 'dtype', type(logits).__name__)}"
        )
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must be [..., V] with V >= 1, got shape {tuple(logits.shape)}")
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"labels must be an int64 tensor, got {getattr(labels, 'dtype', type(labels).__name__)}"
        )
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"labels must have shape logits.shape[:-1]={tuple(logits.shape[:-1])}, "
            f"got {tuple(labels.shape)}"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels on {labels.device} but logits on {logits.device}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton" and triton is None:
        raise ValueError("backend='triton' needs the triton package, which is not installed")
    if labels.numel():
        lo, hi = torch.aminmax(labels)
        if lo < 0 or hi >= logits.shape[-1]:
            raise ValueError(
                f"labels must lie in [0, {logits.shape[-1]}), got values in [{int(lo)}, {int(hi)}]"
            )


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    backend: str = "auto",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each label (and entropy) under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., V]`` float16/bfloat16/float32/float64 scores; differentiable.
        labels: int64 (or int32) ``[...]`` token ids in ``[0, V)``, logits' leading shape.
        temperature: > 0; the distribution is ``softmax(logits / temperature)``.
        return_entropy: also return the entropy of that distribution.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.
    Returns:
        ``logp`` ``[...]`` float32 (float64 for float64 logits on the torch backend), or
        ``(logp, entropy)`` when ``return_entropy``. No ``[..., V]`` fp32 copy is kept; the
        backward allocates only the gradient (logits' dtype).
    """
    _check(logits, labels, temperature, backend)
    if backend == "auto":
        backend = "triton" if logits.is_cuda and triton is not None else "torch"
    V = logits.shape[-1]
    z = logits.reshape(-1, V)
    if z.stride(-1) != 1:
        z = z.contiguous()
    lab = labels.reshape(-1).long()
    if logits.dtype == torch.float64:  # keep float64 end to end (reference-grade path)
        backend = "torch"
        logp, ent = logprobs_reference(z, lab, temperature)
    else:
        logp, ent = _LogProbs.apply(z, lab, float(temperature), return_entropy, backend)
    logp = logp.reshape(labels.shape)
    if return_entropy:
        return logp, ent.reshape(labels.shape)
    return logp
