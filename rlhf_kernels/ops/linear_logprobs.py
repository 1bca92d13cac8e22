"""Fused lm_head + token log-prob (+ entropy): the ``(T, V)`` logits never exist in full.

``u = (hidden @ weight.T + bias) / tau`` is computed one ``(Tc, Vc)`` block at a time:

- forward: token chunks x vocab chunks with an online log-sum-exp per token (running max ``m``,
  ``s = sum exp(u - m)``, ``t = sum exp(u - m) * (u - m)``, relative to the running max so a
  large common logit offset does not cancel); keeps only ``lse``, ``logp``, ``entropy``
  (three fp32 vectors of length ``T``).
- backward: recomputes each block from the saved ``lse`` (``p = exp(u - lse)``), forms
  ``dU = g_logp * (onehot - p) - g_ent * p * (log p + H)``, and accumulates
  ``dhidden += dU @ W_c`` (fp32 ``(T, H)``), ``dweight_c += dU.T @ h`` (fp32 ``(Vc, H)``, one
  vocab chunk at a time, then cast), ``dbias_c += dU.sum(0)``.

Why recompute rather than computing gradients in the forward (Liger-style)? The outputs are
per-token, so the upstream gradient ``g_logp[t]`` is unknown until backward: precomputing would
mean storing ``(T, V)`` partials, exactly what we avoid. The price is one extra matmul (4 instead
of the naive 3); the gain is that no ``(T, V)`` tensor is ever alive, in any dtype.
When the result is a scalar loss the upstream gradient is one number, so ``linear_nll_loss``
(SFT) and ``linear_policy_loss`` (PPO) do compute gradients in the forward, in one pass
(``_FusedLinearLoss``, 3 matmuls), whenever the whole vocabulary fits one block; under
``no_grad`` / ``inference_mode``, or when no input requires grad, they run the forward only.

Chunk rule (``_chunk_sizes``): a block budget of ``B = max(T * H, 2**22)`` fp32 elements (as
large as the hidden states themselves, at least 16 MiB). Vocab chunk ``Vc = min(V, B // H)``
rounded down to a multiple of 128 (so the fp32 ``dweight`` accumulator ``(Vc, H)`` also fits
the budget), token chunk ``Tc = clamp(B // Vc, 16, T)``. Matmuls run in the input dtype
(fp32 accumulation inside), everything after them in fp32.
"""

from __future__ import annotations

import math
import os

import torch

_MIN_BUDGET = 1 << 22
_NEG = torch.finfo(torch.float32).min  # stands in for -inf where 0 * -inf would give NaN
# Label range check: a host sync per call. Always on CPU; on CUDA only with RLHF_KERNELS_DEBUG=1.
CHECK_LABELS_ON_CUDA = os.environ.get("RLHF_KERNELS_DEBUG", "0") == "1"


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
    p = logp_all.exp()  # p log p = 0 where p = 0 (-inf logits)
    return logp, -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)


# ----------------------------------------------------------------------------- blocks
def _block(buf, hc, wc, b_s, inv_tau, lse=None):
    """``buf``'s first ``n * nv`` floats as ``(n, nv)`` = ``(hc @ wc.T + b) / tau [- lse]``, fp32.

    Reusing one preallocated buffer avoids a fresh (page-faulted) allocation per block; for fp32
    the ``1/tau`` scale goes onto ``hc`` ``(n, H)`` and ``-lse`` into the matmul's epilogue.
    """
    n, nv = hc.shape[0], wc.shape[0]
    u = buf.view(-1)[: n * nv].view(n, nv)
    if hc.dtype == torch.float32:
        hs = hc * inv_tau if inv_tau != 1.0 else hc
        if lse is None:
            torch.mm(hs, wc.T, out=u)
        else:
            torch.addmm(lse[:, None], hs, wc.T, beta=-1.0, out=u)
    else:  # low precision: matmul in the input dtype, everything after in fp32
        torch.mul(hc @ wc.T, inv_tau, out=u)
        if lse is not None:
            u.sub_(lse[:, None])
    if b_s is not None:
        u.add_(b_s)
    return u


def _view(buf, like):
    return buf.view(-1)[: like.numel()].view(like.shape)


def _label_in_chunk(lab, v0, nv):
    idx = lab - v0
    return idx.clamp(0, nv - 1)[:, None], (idx >= 0) & (idx < nv)


def _forward(h, w, b_s, labels, inv_tau, tc, vc, want_entropy):
    T, V = h.shape[0], w.shape[0]
    lse = torch.empty(T, dtype=torch.float32, device=h.device)
    logp, ent = torch.empty_like(lse), torch.empty_like(lse)
    buf_u = torch.empty(min(tc, T) * min(vc, V), dtype=torch.float32, device=h.device)
    buf_e = torch.empty_like(buf_u)
    for t0 in range(0, T, tc):
        hc, lab = h[t0 : t0 + tc], labels[t0 : t0 + tc]
        n = hc.shape[0]
        m = torch.full((n,), -math.inf, dtype=torch.float32, device=h.device)
        s, t, u_lab = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
        for v0 in range(0, V, vc):
            bc = None if b_s is None else b_s[v0 : v0 + vc]
            u = _block(buf_u, hc, w[v0 : v0 + vc], bc, inv_tau)
            col, here = _label_in_chunk(lab, v0, u.shape[1])
            u_lab += torch.where(here, u.gather(1, col)[:, 0], 0.0)
            m_new = torch.maximum(m, u.amax(1))
            # -inf logits (e.g. a -inf bias masking vocab) give e = 0 and never 0 * -inf
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
            live = m > -math.inf
            scale = torch.where(live, torch.exp(m - m_safe), 0.0)
            u.sub_(m_safe[:, None])  # u - m_new <= 0
            e = torch.exp(u, out=_view(buf_e, u))
            e_sum = e.sum(1)
            if want_entropy:  # t = sum e * (u - m), kept relative to the running max
                u.clamp_(min=_NEG)
                shift = torch.where(live, (m - m_safe) * s, 0.0)
                t = (t + shift) * scale + torch.bmm(e[:, None], u[:, :, None])[:, 0, 0]
            s = s * scale + e_sum
            m = m_new
        sl = slice(t0, t0 + n)
        log_s = torch.log(s)
        lse[sl] = m + log_s
        logp[sl] = u_lab - lse[sl]
        ent[sl] = log_s - t / s
    return logp, (ent if want_entropy else None), lse


def _new_grads(h, w, needs):
    T, H = h.shape
    f32 = dict(dtype=torch.float32, device=h.device)
    dh = torch.zeros(T, H, **f32) if needs[0] else None
    dw = torch.empty_like(w) if needs[1] else None
    db = torch.zeros(w.shape[0], **f32) if needs[2] else None
    return dh, dw, db


def _accumulate(g, hc, wc, dh_c, acc):
    """dh_c += g @ wc, acc += g.T @ hc (fp32 accumulators; g fp32 (n, nv))."""
    gd = g if hc.dtype == torch.float32 else g.to(hc.dtype)
    if dh_c is not None:
        if gd.dtype == torch.float32:
            dh_c.addmm_(gd, wc)
        else:
            dh_c += (gd @ wc).float()
    if acc is not None:
        if gd.dtype == torch.float32:
            acc.addmm_(gd.T, hc)
        else:
            acc += (gd.T @ hc).float()


def _backward(h, w, b_s, labels, inv_tau, tc, vc, lse, ent, g_lp, g_ent, needs):
    """Gradients (dhidden, dweight, dbias) for upstream g_lp (T,) and g_ent (T,) or None.

    Vocab chunks outer, token chunks inner: the fp32 weight-gradient accumulator is one
    ``(Vc, H)`` chunk (written in place when weight is fp32), ``dhidden`` is fp32 ``(T, H)``.
    """
    T, H = h.shape
    V = w.shape[0]
    dh, dw, db = _new_grads(h, w, needs)
    g_lp = g_lp * inv_tau  # d u / d z = 1 / tau folded into the upstream gradients
    g_ent = None if g_ent is None else g_ent * inv_tau
    buf_u = torch.empty(min(tc, T) * min(vc, V), dtype=torch.float32, device=h.device)
    buf_p = torch.empty_like(buf_u)
    for v0 in range(0, V, vc):
        wc = w[v0 : v0 + vc]
        bc = None if b_s is None else b_s[v0 : v0 + vc]
        nv = wc.shape[0]
        acc = None
        if dw is not None:
            acc = dw[v0 : v0 + nv].zero_() if w.dtype == torch.float32 else None
            acc = torch.zeros(nv, H, dtype=torch.float32, device=h.device) if acc is None else acc
        for t0 in range(0, T, tc):
            hc, lab = h[t0 : t0 + tc], labels[t0 : t0 + tc]
            sl = slice(t0, t0 + hc.shape[0])
            logp = _block(buf_u, hc, wc, bc, inv_tau, lse=lse[sl])  # (n, nv) log p
            p = torch.exp(logp, out=_view(buf_p, logp))
            if g_ent is not None:  # -g_ent * p * (log p + H) - g_lp * p; p = 0 at log p = -inf
                g = logp.clamp_(min=_NEG).add_(ent[sl, None]).mul_(p).mul_(-g_ent[sl, None])
                g.addcmul_(p, g_lp[sl, None], value=-1.0)
            else:
                g = p.mul_(-g_lp[sl, None])
            col, here = _label_in_chunk(lab, v0, nv)
            g.scatter_add_(1, col, torch.where(here, g_lp[sl], 0.0)[:, None])
            if db is not None:
                db[v0 : v0 + nv] += g.sum(0)
            _accumulate(g, hc, wc, None if dh is None else dh[sl], acc)
        if dw is not None and w.dtype != torch.float32:
            dw[v0 : v0 + nv] = acc
    return dh, dw, db


def _cast_grads(dh, dw, db, h, b):
    return (
        None if dh is None else dh.to(h.dtype),
        dw,
        None if db is None else db.to(b.dtype),
    )


def _scaled_bias(b, inv_tau):
    return None if b is None else b.float() * inv_tau


class _LinearLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, b, labels, tau, want_entropy, tc, vc):
        inv_tau = 1.0 / tau
        b_s = _scaled_bias(b, inv_tau)
        logp, ent, lse = _forward(h, w, b_s, labels, inv_tau, tc, vc, want_entropy)
        ctx.save_for_backward(h, w, b, labels, lse, ent)
        ctx.cfg = (inv_tau, tc, vc)
        return logp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, w, b, labels, lse, ent = ctx.saved_tensors
        inv_tau, tc, vc = ctx.cfg
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
            _scaled_bias(b, inv_tau),
            labels,
            inv_tau,
            tc,
            vc,
            lse,
            ent,
            g_lp.float(),
            None if g_ent is None else g_ent.float(),
            needs,
        )
        return (*_cast_grads(dh, dw, db, h, b), None, None, None, None, None)


class _FusedLinearLoss(torch.autograd.Function):
    """A scalar loss ``sum_chunks token_loss(logp_chunk, rows)`` with gradients made in forward.

    The upstream gradient of a scalar is one number, so (Liger-style) each token chunk's
    ``dL/dlogp`` (autograd on the small ``(n,)`` vector) is turned into
    ``dU = dL/dlogp * (onehot - p) / tau`` right after the chunk's log-sum-exp and folded into
    ``dhidden`` / ``dweight``: 3 matmuls instead of 4. Needs the whole vocabulary in one block.
    ``token_loss`` must be a sum over tokens (weights precomputed), so chunks add up.
    """

    @staticmethod
    def forward(ctx, h, w, b, labels, tau, tc, token_loss):
        inv_tau = 1.0 / tau
        T, H = h.shape
        V = w.shape[0]
        b_s = _scaled_bias(b, inv_tau)
        ng = ctx.needs_input_grad  # grad mode and requires_grad, as seen by autograd
        needs = (ng[0], ng[1], b is not None and ng[2])
        dh, dw, db = _new_grads(h, w, needs)
        acc = None
        if dw is not None:  # fp32 accumulator (in place for fp32 weights)
            acc = dw.zero_() if w.dtype == torch.float32 else torch.zeros(V, H, device=h.device)
        buf_u = torch.empty(min(tc, T) * V, dtype=torch.float32, device=h.device)
        buf_p = torch.empty_like(buf_u)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for t0 in range(0, T, tc):
            hc, lab = h[t0 : t0 + tc], labels[t0 : t0 + tc]
            sl = slice(t0, t0 + hc.shape[0])
            u = _block(buf_u, hc, w, b_s, inv_tau)
            u.sub_(u.amax(1, keepdim=True))
            p = torch.exp(u, out=_view(buf_p, u))
            s = p.sum(1)
            logp = (u.gather(1, lab[:, None])[:, 0] - torch.log(s)).requires_grad_(any(needs))
            with torch.enable_grad():
                part = token_loss(logp, sl)
            loss += part.detach().float()
            if any(needs):
                (g_lp,) = torch.autograd.grad(part, logp)
                g_lp = g_lp.float() * inv_tau
                g = p.mul_((-g_lp / s)[:, None])  # -g_lp * softmax / tau
                g.scatter_add_(1, lab[:, None], g_lp[:, None])
                if db is not None:
                    db += g.sum(0)
                _accumulate(g, hc, w, None if dh is None else dh[sl], acc)
        if dw is not None and w.dtype != torch.float32:
            dw.copy_(acc)
        ctx.save_for_backward(*_cast_grads(dh, dw, db, h, b))
        return loss

    @staticmethod
    def backward(ctx, g):
        dh, dw, db = ctx.saved_tensors
        return tuple(None if t is None else t * g.to(t.dtype) for t in (dh, dw, db)) + (None,) * 4


def _fits_one_pass(T: int, H: int, V: int, dtype: torch.dtype) -> tuple[bool, int]:
    """Whole vocabulary in one block, and the fp32 dweight accumulator free or within budget."""
    tc, vc = _chunk_sizes(T, H, V)
    ok = vc == V and (dtype == torch.float32 or V * H <= max(T * H, _MIN_BUDGET))
    return ok, tc


def _grad_wanted(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _logprobs_no_grad(hidden, weight, labels, bias, temperature):
    """Forward only (no_grad / inference_mode / nothing requires grad): ``(T,)`` fp32 logp.

    No gradient buffers, no saved tensors, no extra matmuls."""
    T, H = hidden.shape
    tc, vc = _chunk_sizes(T, H, weight.shape[0])
    inv_tau = 1.0 / float(temperature)
    b_s = _scaled_bias(bias, inv_tau)
    return _forward(hidden, weight, b_s, labels.long(), inv_tau, tc, vc, False)[0]


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
    if labels.numel() and (not labels.is_cuda or CHECK_LABELS_ON_CUDA):
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
        labels: int64 ``(T,)`` target token ids in ``[0, V)`` (checked on CPU; on CUDA, where
            the check is a host sync, only with ``RLHF_KERNELS_DEBUG=1``).
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
    """SFT loss without logits: ``-sum(mask * logp) / sum(mask)``.

    Args: as :func:`linear_logprobs`; ``mask`` ``(T,)`` 0/1 (bool or numeric) selects the tokens
    that count (default: all). Returns a float32 scalar (0 when the mask is empty).
    When the whole vocabulary fits one block (``_chunk_sizes``) and the fp32 weight-gradient
    accumulator is free (fp32 weight) or within the block budget, gradients are computed in the
    forward pass (``_LinearNLL``, 3 matmuls); otherwise this is ``linear_logprobs`` + a sum.
    """
    _check(hidden, weight, labels, bias, temperature, None, None)
    T, H = hidden.shape
    V = weight.shape[0]
    if mask is not None and mask.shape != (T,):
        raise ValueError(f"mask must have shape ({T},), got {tuple(mask.shape)}")
    m = torch.ones(T, device=hidden.device) if mask is None else mask.to(torch.float32)
    wt = m / m.sum().clamp_min(1.0)  # per-token weight of -logp in the loss
    if not _grad_wanted(hidden, weight, bias):  # forward only: no gradients made or saved
        return -(_logprobs_no_grad(hidden, weight, labels, bias, temperature) * wt).sum()
    one_pass, tc = _fits_one_pass(T, H, V, weight.dtype)
    if one_pass:
        nll = lambda logp, sl: -(wt[sl] * logp).sum()
        return _FusedLinearLoss.apply(
            hidden, weight, bias, labels.long(), float(temperature), tc, nll
        )
    # vocab too large for one block (or the fp32 weight-gradient copy would not be small)
    return -(linear_logprobs(hidden, weight, labels, bias, temperature) * wt).sum()


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """PPO clipped loss straight from hidden states: lm_head -> log-prob -> ``policy_loss``.

    Args:
        hidden, weight, labels, bias, temperature: as :func:`linear_logprobs` (packed
            ``(T, H)`` tokens; ``labels[t]`` is the sampled token scored at position ``t``).
        old_logp, advantages: ``(T,)`` float, behaviour-policy log-probs and advantages.
        mask: ``(T,)`` 0/1 tokens that count (default all). cu_seqlens: ``(S + 1,)`` sequence
            boundaries for the sequence-level aggregations (default: one sequence).
        clip_low, clip_high, dual_clip, aggregation: as
            :func:`rlhf_kernels.ops.losses.policy_loss`.
    Returns: float32 scalar, equal to ``policy_loss(linear_logprobs(...), ...)``; computed in
    one pass with gradients made during the forward when the vocabulary fits one block.
    """
    from rlhf_kernels.ops import losses

    _check(hidden, weight, labels, bias, temperature, None, None)
    losses._check_float(old_logp=old_logp, advantages=advantages)
    losses._check_policy_args(aggregation, clip_low, clip_high, dual_clip)
    T, H = hidden.shape
    V = weight.shape[0]
    if cu_seqlens is None:
        cu_seqlens = torch.tensor([0, T], device=hidden.device)
    ref = old_logp.float()
    m, seq, n_seq = losses._token_layout("old_logp", ref, mask, cu_seqlens, advantages=advantages)
    wt = losses._token_weights(m, seq, n_seq, aggregation)
    adv = advantages.float()

    def ppo(logp, sl):
        tok = losses._ppo_token_loss(logp, ref[sl], adv[sl], clip_low, clip_high, dual_clip)[0]
        return (tok * wt[sl]).sum()

    if not _grad_wanted(hidden, weight, bias):  # forward only: no gradients made or saved
        return ppo(_logprobs_no_grad(hidden, weight, labels, bias, temperature), slice(0, T))
    one_pass, tc = _fits_one_pass(T, H, V, weight.dtype)
    if one_pass:
        return _FusedLinearLoss.apply(
            hidden, weight, bias, labels.long(), float(temperature), tc, ppo
        )
    return ppo(linear_logprobs(hidden, weight, labels, bias, temperature), slice(0, T))
