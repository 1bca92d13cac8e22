"""Fused lm_head + token log-prob (+ entropy): the ``(T, V)`` logits never exist in full.

``u = (hidden @ weight.T + bias) / tau`` is computed one ``(Tc, Vc)`` block at a time:

- forward: token chunks x vocab chunks with an online log-sum-exp per token (running max ``m``,
  ``s = sum exp(u - m)``, ``t = sum exp(u - m) * u``); keeps only ``lse``, ``logp``, ``entropy``
  (three fp32 vectors of length ``T``).
- backward: recomputes each block from the saved ``lse`` (``p = exp(u - lse)``), forms
  ``dU = g_logp * (onehot - p) - g_ent * p * (log p + H)``, and accumulates
  ``dhidden += dU @ W_c`` (fp32 ``(T, H)``), ``dweight_c += dU.T @ h`` (fp32 ``(Vc, H)``, one
  vocab chunk at a time, then cast), ``dbias_c += dU.sum(0)``.

Why recompute rather than computing gradients in the forward (Liger-style)? The outputs are
per-token, so the upstream gradient ``g_logp[t]`` is unknown until backward: precomputing would
mean storing ``(T, V)`` partials, exactly what we avoid. The price is one extra matmul (4 instead
of the naive 3); the gain is that no ``(T, V)`` tensor is ever alive, in any dtype.

Chunk rule (``_chunk_sizes``): a block budget of ``B = max(T * H, 2**22)`` fp32 elements (as
large as the hidden states themselves, at least 16 MiB). Vocab chunk ``Vc = min(V, B // H)``
rounded down to a multiple of 128 (so the fp32 ``dweight`` accumulator ``(Vc, H)`` also fits
the budget), token chunk ``Tc = clamp(B // Vc, 16, T)``. Matmuls run in the input dtype
(fp32 accumulation inside), everything after them in fp32.
"""

from __future__ import annotations

import math

import torch

_MIN_BUDGET = 1 << 22


def _chunk_sizes(T: int, H: int, V: int) -> tuple[int, int]:
    budget = max(T * H, _MIN_BUDGET)
    vc = min(V, max(128, (budget // max(H, 1)) // 128 * 128))
    tc = max(1, min(T, max(16, budget // vc)))
    return tc, vc


# ----------------------------------------------------------------------------- reference
def linear_logprobs_reference(hidden, weight, labels, bias=None, temperature=1.0):
    """Naive math (full logits), in the inputs' dtype: (logp, entropy)."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    logp = logp_all.gather(-1, labels[:, None]).squeeze(-1)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


# ----------------------------------------------------------------------------- blocks
def _block(h, w, b, tau):
    u = (h @ w.T).float()
    if b is not None:
        u += b.float()
    return u.div_(tau)


def _forward(h, w, b, labels, tau, tc, vc, want_entropy):
    T, V = h.shape[0], w.shape[0]
    lse = torch.empty(T, dtype=torch.float32, device=h.device)
    logp, ent = torch.empty_like(lse), torch.empty_like(lse)
    for t0 in range(0, T, tc):
        hc, lab = h[t0 : t0 + tc], labels[t0 : t0 + tc]
        n = hc.shape[0]
        m = torch.full((n,), -math.inf, dtype=torch.float32, device=h.device)
        s, t, u_lab = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
        for v0 in range(0, V, vc):
            u = _block(hc, w[v0 : v0 + vc], None if b is None else b[v0 : v0 + vc], tau)
            idx = lab - v0
            here = (idx >= 0) & (idx < u.shape[1])
            u_lab += torch.where(here, u.gather(1, idx.clamp(0, u.shape[1] - 1)[:, None])[:, 0], 0)
            m_new = torch.maximum(m, u.amax(1))
            scale = torch.exp(m - m_new)
            e = torch.exp(u - m_new[:, None])
            s = s * scale + e.sum(1)
            if want_entropy:
                t = t * scale + (e * u).sum(1)
            m = m_new
        lse[t0 : t0 + n] = m + torch.log(s)
        logp[t0 : t0 + n] = u_lab - lse[t0 : t0 + n]
        ent[t0 : t0 + n] = lse[t0 : t0 + n] - t / s
    return logp, (ent if want_entropy else None), lse


def _backward(h, w, b, labels, tau, tc, vc, lse, ent, g_lp, g_ent, needs):
    """Gradients (dhidden, dweight, dbias) for upstream g_lp (T,) and g_ent (T,) or None."""
    T, H = h.shape
    V = w.shape[0]
    need_h, need_w, need_b = needs
    dh = torch.zeros(T, H, dtype=torch.float32, device=h.device) if need_h else None
    dw = torch.empty_like(w) if need_w else None
    db = torch.zeros(V, dtype=torch.float32, device=h.device) if need_b else None
    for v0 in range(0, V, vc):
        wc = w[v0 : v0 + vc]
        bc = None if b is None else b[v0 : v0 + vc]
        nv = wc.shape[0]
        # fp32 accumulator for this vocab chunk's weight gradient (in place when weight is fp32)
        acc = None
        if need_w:
            acc = dw[v0 : v0 + nv] if w.dtype == torch.float32 else None
            if acc is None:
                acc = torch.zeros(nv, H, dtype=torch.float32, device=h.device)
            else:
                acc.zero_()
        for t0 in range(0, T, tc):
            hc, lab = h[t0 : t0 + tc], labels[t0 : t0 + tc]
            sl = slice(t0, t0 + hc.shape[0])
            logp = _block(hc, wc, bc, tau).sub_(lse[sl, None])  # (n, nv) log p
            p = torch.exp(logp)
            if g_ent is not None:
                g = logp.add_(ent[sl, None]).mul_(p).mul_(-g_ent[sl, None])
                g.addcmul_(p, g_lp[sl, None], value=-1.0)
            else:
                g = p.mul_(-g_lp[sl, None])
            idx = lab - v0
            here = (idx >= 0) & (idx < nv)
            g.scatter_add_(
                1, idx.clamp(0, nv - 1)[:, None], torch.where(here, g_lp[sl], 0)[:, None]
            )
            g.div_(tau)
            if need_b:
                db[v0 : v0 + nv] += g.sum(0)
            gd = g if h.dtype == torch.float32 else g.to(h.dtype)
            if need_h:
                if gd.dtype == torch.float32:
                    dh[sl].addmm_(gd, wc)
                else:
                    dh[sl] += (gd @ wc).float()
            if need_w:
                if gd.dtype == torch.float32:
                    acc.addmm_(gd.T, hc)
                else:
                    acc += (gd.T @ hc).float()
        if need_w and w.dtype != torch.float32:
            dw[v0 : v0 + nv] = acc
    return (
        None if dh is None else dh.to(h.dtype),
        dw,
        None if db is None else db.to(b.dtype),
    )


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, labels, tau, want_entropy, tc, vc):
        logp, ent, lse = _forward(h, w, b, labels, tau, tc, vc, want_entropy)
        ctx.save_for_backward(h, w, b, labels, lse, ent)
        ctx.cfg = (tau, tc, vc)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, w, b, labels, lse, ent = ctx.saved_tensors
        tau, tc, vc = ctx.cfg
        if g_lp is None:
            g_lp = torch.zeros_like(lse)
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            b is not None and ctx.needs_input_grad[2],
        )
        dh, dw, db = _backward(
            h,
            w,
            b,
            labels,
            tau,
            tc,
            vc,
            lse,
            ent,
            g_lp.float(),
            None if g_ent is None else g_ent.float(),
            needs,
        )
        return dh, dw, db, None, None, None, None, None


# ----------------------------------------------------------------------------- API
def _check(hidden, weight, labels, bias, temperature, chunk_tokens, chunk_vocab):
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(
                f"{name} must be a float tensor, got {getattr(t, 'dtype', type(t).__name__)}"
            )
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be 2-D (T, H), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (V, H={hidden.shape[1]}), got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype must equal hidden's {hidden.dtype}, got {weight.dtype}")
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"labels must be an int64 tensor, got {getattr(labels, 'dtype', type(labels).__name__)}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must have shape ({hidden.shape[0]},), got {tuple(labels.shape)}")
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must be ({weight.shape[0]},) {weight.dtype}, got "
            f"{tuple(bias.shape)} {bias.dtype}"
        )
    devices = {t.device for t in (hidden, weight, labels, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"hidden, weight, labels, bias must share a device, got {devices}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    for name, c in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if c is not None and c < 1:
            raise ValueError(f"{name} must be >= 1, got {c}")
    if labels.numel():
        lo, hi = torch.aminmax(labels)
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(
                f"labels must lie in [0, {weight.shape[0]}), got values in [{int(lo)}, {int(hi)}]"
            )


def linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    *,
    chunk_tokens: int | None = None,
    chunk_vocab: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax((hidden @ weight.T + bias) / temperature).gather(labels)`` without logits.

    Args:
        hidden: ``(T, H)`` float32/bfloat16/float16 final hidden states (differentiable).
        weight: ``(V, H)`` lm_head weight, hidden's dtype (differentiable).
        labels: int64 ``(T,)`` target token ids in ``[0, V)``.
        bias: optional ``(V,)`` lm_head bias, weight's dtype (differentiable).
        temperature: > 0, divides the logits.
        return_entropy: also return the per-token entropy of the tempered distribution.
        chunk_tokens, chunk_vocab: override the block shape (default: the rule in the module
            docstring, ``_chunk_sizes``).
    Returns:
        ``logp`` ``(T,)`` float32, or ``(logp, entropy)`` both ``(T,)`` float32. Gradients flow
        to hidden, weight and bias; they are accumulated in fp32 and returned in input dtype.
    """
    _check(hidden, weight, labels, bias, temperature, chunk_tokens, chunk_vocab)
    T, H = hidden.shape
    tc, vc = _chunk_sizes(T, H, weight.shape[0])
    tc, vc = chunk_tokens or tc, chunk_vocab or vc
    logp, ent = _LinearLogProbs.apply(
        hidden, weight, bias, labels.long(), float(temperature), return_entropy, tc, vc
    )
    return (logp, ent) if return_entropy else logp


def linear_nll_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """SFT loss without logits: ``-sum(mask * logp) / sum(mask)`` over ``linear_logprobs``.

    Args: as :func:`linear_logprobs`; ``mask`` ``(T,)`` 0/1 (bool or numeric) selects the tokens
    that count (default: all). Returns a float32 scalar (0 when the mask is empty).
    """
    logp = linear_logprobs(hidden, weight, labels, bias, temperature)
    if mask is None:
        return -logp.mean()
    if mask.shape != logp.shape:
        raise ValueError(f"mask must have shape {tuple(logp.shape)}, got {tuple(mask.shape)}")
    m = mask.to(torch.float32)
    return -(logp * m).sum() / m.sum().clamp_min(1.0)
