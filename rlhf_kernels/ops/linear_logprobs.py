"""Fused lm_head + token log-prob (+ entropy): the ``(T, V)`` logits never exist in full.

``u = (hidden @ weight.T + bias) / tau`` is computed one ``(Tc, Vc)`` block at a time:

- forward: token chunks x vocab chunks with an online log-sum-exp per token (running max ``m``,
  ``s = sum exp(u - m)``, ``t = sum exp(u - m) * (u - m)``, relative to the running max so a
  large common logit offset does not cancel); keeps only ``m`` and ``log s`` (``lse = m +
  log s``), ``logp``, ``entropy`` (fp32 vectors of length ``T``).
- backward: recomputes each block as the forward formed it, then ``log p = (u - m) - log s``
  (rounded as ``log_softmax`` rounds it; ``u - lse`` loses ``|lse| * eps``) and forms
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
Label smoothing (``linear_nll_loss(label_smoothing=)``, the fused cross-entropy) needs
``u_y - mean_v u_v`` per token, class weights ``sum_v a_v u_v``, the z-loss ``lse``: the forward
can also return ``(lse, u_y, sum_v a_v u_v)`` (row sums of each block), the backward then adds
``g_lse * p + g_uy * onehot + g_sum * a`` to ``dU``, so every term's weight gradient is rounded
once, together.

Chunk rule (``_chunk_sizes``): a block budget of ``B = max(T * H, 2**22)`` fp32 elements (as
large as the hidden states themselves, at least 16 MiB; on CPU also at least ``min(T, 256) * V``,
since CPU BLAS re-packs the weight on every call and small token blocks pay for it). Vocab
chunk ``Vc = min(V, B // H)`` rounded down to a multiple of 128 (so the fp32 ``dweight``
accumulator ``(Vc, H)`` also fits the budget), token chunk ``Tc = clamp(B // Vc, 16, T)``. The
budget is capped at ``2**27`` elements (512 MiB per fp32 block), so temporaries stay bounded at
any ``T x H``: two blocks (three under a soft cap), the fp32 ``dhidden`` and one ``(Vc, H)``
fp32 accumulator.

Precision: logits blocks are always fp32. Low-precision (bf16/fp16) operands are multiplied with
fp32 output (``torch.mm(..., out_dtype=torch.float32)`` on CUDA, an fp32 upcast on CPU), never
rounded to bf16 logits first (a bf16 logit of 30 is off by up to 0.125). On CUDA one Triton pass
per block does the softmax bookkeeping (forward) or forms ``dU`` (backward) instead of several
torch passes.

Layouts: packed ``(T, H)`` hidden with ``(T,)`` labels, or a model's padded ``(B, T, H)`` with
``(B, T)`` labels (and mask); outputs take the labels' shape. The scalar losses run the matmuls on
the rows that count only (``_live_rows``: pads and ignored labels of a padded batch are dropped
first, in eager mode). Under ``torch.compile`` the op is the ``rlhf_kernels::linear_logprobs_fwd``
/ ``_bwd`` custom ops (``ops/compiled.py``), so nothing breaks the graph; ``linear_nll_loss`` and
``linear_policy_loss`` are then the one-pass ``rlhf_kernels::linear_loss_fwd`` op (rows that do
not count skipped inside it); the ``aux`` outputs and label smoothing go through the same ops.

Soft cap (``softcap=c``, Gemma 2's ``final_logit_softcapping``): ``u = c * tanh(z / c) / tau``
in each block; the gradient blocks take the extra factor ``1 - tanh(z / c)^2`` (formed from the
tanh itself as the block is made, as torch's tanh backward does: rebuilt from ``u`` it was off
by two more roundings, magnified where tanh saturates), by torch passes (the Triton gradient pass
is skipped then).

Labels equal to ``ignore_index`` (default -100) get ``logp = 0`` and no gradient through it; the
losses leave those tokens out. Other out-of-range labels: ValueError where checked (CPU, or
``RLHF_KERNELS_DEBUG=1``), a NaN result otherwise. No second derivative (``create_graph=True``
is a RuntimeError); the soft cap must be at most fp32's maximum (the blocks are fp32).
"""

from __future__ import annotations

import functools
import inspect
import math
import os

import torch

from rlhf_kernels._checks import check_mask, device_guard, is_real, is_scalar
from rlhf_kernels.ops._once import first_order_only
from rlhf_kernels.ops.logprobs import IGNORE_INDEX, check_label_range, fix_masked, mask_labels

try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional (CUDA fast path only)
    triton = None

_MIN_BUDGET = 1 << 22
_MAX_BUDGET = 1 << 27
_NEG = torch.finfo(torch.float32).min  # stands in for -inf where 0 * -inf would give NaN
_F32_MAX = torch.finfo(torch.float32).max  # largest soft cap (the logit blocks are fp32)
# Label range check: a host sync per call. Always on CPU; on CUDA only with RLHF_KERNELS_DEBUG=1.
CHECK_LABELS_ON_CUDA = os.environ.get("RLHF_KERNELS_DEBUG", "0") == "1"


# CPU BLAS packs the large (weight) operand afresh on every call, a cost amortised over the
# call's token rows: with 131-row blocks it made each matmul ~1.4x its one-call time (2-core
# EPYC, H=512, V=32000), with >= 256 rows ~1.05x. GPUs (cuBLAS) have no such per-call cost.
_CPU_ROWS = 256


def _budget(T: int, H: int, V: int, cpu: bool = False) -> int:
    """fp32 elements of one logits block: ``max(T * H, 2**22)``, on CPU at least
    ``min(T, 256)`` full-vocabulary rows, at most ``2**27``."""
    b = max(T * H, _MIN_BUDGET)
    if cpu:
        b = max(b, min(T, _CPU_ROWS) * V)
    return min(b, _MAX_BUDGET)


def _chunk_sizes(T: int, H: int, V: int, cpu: bool = False) -> tuple[int, int]:
    budget = _budget(T, H, V, cpu)
    vc = min(V, max(128, (budget // max(H, 1)) // 128 * 128))
    tc = max(1, min(T, max(16, budget // vc)))
    return tc, vc


# ----------------------------------------------------------------------------- reference
def linear_logprobs_reference(
    hidden, weight, labels, bias=None, temperature=1.0, ignore_index=IGNORE_INDEX, softcap=None
):
    """Naive math (full logits), in the inputs' dtype: (logp, entropy); logp 0 where ignored."""
    logits = hidden @ weight.T
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp_all = torch.log_softmax(logits / temperature, dim=-1)
    ignored = labels == ignore_index
    logp = logp_all.gather(-1, labels.masked_fill(ignored, 0)[:, None]).squeeze(-1)
    logp = logp.masked_fill(ignored, 0.0)
    p = logp_all.exp()  # p log p = 0 where p = 0 (-inf logits)
    return logp, -(p * logp_all.masked_fill(p == 0, 0.0)).sum(-1)


# ----------------------------------------------------------------------------- blocks
_F32_OUT: dict = {}  # device type -> whether mm with out_dtype=float32 works for low precision


def _mm_f32(a, b, out, add=None, alpha=1.0, beta=1.0):
    """``out = beta * add + alpha * (a @ b)`` in fp32 (``out`` fp32; ``add`` fp32 or None).

    fp32 operands: one BLAS call. bf16/fp16 on CUDA: cuBLAS with fp32 output (products and
    accumulation in fp32, no rounding of the result to bf16); elsewhere an fp32 upcast.
    """
    if a.dtype != torch.float32:
        key = a.device.type
        if _F32_OUT.get(key, a.is_cuda):
            try:
                if add is None:
                    torch.mm(a, b, out_dtype=torch.float32, out=out)
                    return out.mul_(alpha) if alpha != 1.0 else out
                return torch.addmm(
                    add, a, b, out_dtype=torch.float32, alpha=alpha, beta=beta, out=out
                )
            except (RuntimeError, TypeError):
                _F32_OUT[key] = False
        a, b = a.float(), b.float()
    if add is None:
        torch.mm(a, b, out=out)
        return out.mul_(alpha) if alpha != 1.0 else out
    return torch.addmm(add, a, b, alpha=alpha, beta=beta, out=out)


def _block(buf, hc, wc, b_s, inv_tau, cap=None, fac_buf=None):
    """``buf``'s first ``n * nv`` floats as ``(n, nv)`` = ``u``, fp32, with
    ``u = (z / tau)`` or, with a soft cap, ``u = cap * tanh(z / cap) / tau``; ``z = hc @ wc.T + b``
    (``b_s`` is ``b`` as :func:`_scaled_bias` gives it: ``b / cap`` under a soft cap).

    Reusing one preallocated buffer avoids a fresh (page-faulted) allocation per block. ``z``
    is one ``addmm`` (rounded once, as ``F.linear`` rounds it), then scaled by ``1 / tau``:
    adding a pre-scaled ``b / tau`` rounds twice at ``|b / tau|`` (up to 2.4x plain torch's
    fp32 gradient error at tau 0.7 and logits near 30). Forward and backward form ``u`` by this
    one call, so it rounds the same in both (folding ``-lse`` into an ``addmm`` did not: 8x).
    """
    n, nv = hc.shape[0], wc.shape[0]
    u = buf.view(-1)[: n * nv].view(n, nv)
    if cap is not None:
        _mm_f32(hc, wc.T, u, alpha=1.0 / cap)
        if b_s is not None:
            u.add_(b_s)
        u.tanh_()
        if fac_buf is not None:  # 1 - tanh^2 from tanh itself (from u: rounded twice more)
            torch.mul(u, u, out=_view(fac_buf, u)).neg_().add_(1.0)
        return u.mul_(cap * inv_tau)
    if b_s is None:
        return _mm_f32(hc, wc.T, u, alpha=inv_tau)
    _mm_f32(hc, wc.T, u, add=b_s.expand(n, nv))
    return u.mul_(inv_tau) if inv_tau != 1.0 else u


if triton is not None:
    # fmt: off
    @triton.jit
    def _stats_kernel(U, stride_u, nv, LAB, M, S, TT, ULAB, USUM, A, WANT_ENT: tl.constexpr,
                      WANT_SUM: tl.constexpr, HAS_A: tl.constexpr, BLOCK: tl.constexpr):
        """One row of a fp32 logits block: online update of the running max ``m``, ``s = sum
        exp(u - m)``, ``t = sum exp(u - m) (u - m)`` (and ``USUM += sum_v a_v u_v`` with
        ``WANT_SUM``, ``a`` the block's column weights ``A`` or ones), and pick ``u[label]`` if
        it is here."""
        r = tl.program_id(0)
        row = U + r.to(tl.int64) * stride_u
        m = tl.load(M + r)
        s = tl.load(S + r)
        t = tl.load(TT + r)
        lab = tl.load(LAB + r)  # label - v0 (outside [0, nv): not in this block)
        total = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), 0)
        cols = tl.arange(0, BLOCK)
        for c0 in range(0, nv, BLOCK):
            ok = c0 + cols < nv
            u = tl.load(row + c0 + cols, mask=ok, other=float("-inf"))
            if WANT_SUM:
                if HAS_A:
                    total += tl.sum(tl.where(ok, u * tl.load(A + c0 + cols, mask=ok), 0.0), 0)
                else:
                    total += tl.sum(tl.where(ok, u, 0.0), 0)
            m_new = tl.maximum(m, tl.max(u, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            live = m > float("-inf")
            scale = tl.where(live, tl.exp(m - m_safe), 0.0)
            d = u - m_safe  # floored: e * d = 0 where e = 0; NaN stays (tl.maximum drops it)
            d = tl.where(d < -3.0e38, -3.0e38, d)
            e = tl.exp(d)
            if WANT_ENT:
                shift = tl.where(live, m - m_safe, 0.0)
                t = scale * (t + shift * s) + tl.sum(e * d, 0)
            s = s * scale + tl.sum(e, 0)
            m = m_new
        tl.store(M + r, m)
        tl.store(S + r, s)
        tl.store(TT + r, t)
        if WANT_SUM:
            tl.store(USUM + r, tl.load(USUM + r) + total)
        here = (lab >= 0) & (lab < nv)
        u_lab = tl.load(row + tl.where(here, lab, 0))
        tl.store(ULAB + r, tl.load(ULAB + r) + tl.where(here, u_lab, 0.0))

    @triton.jit
    def _grad_kernel(U, stride_u, G, stride_g, nv, LAB, GHIT, GP, GENT, ENT, M, LOGS, GW, A,
                     HAS_ENT: tl.constexpr, HAS_W: tl.constexpr, HAS_A: tl.constexpr,
                     BLOCK: tl.constexpr):
        """One row: ``dU = hit * onehot - gp * p - g_ent * p * (log p + H) + gw * a`` from the
        fp32 ``u`` with ``log p = (u - m) - log s`` (rounded as ``log_softmax`` rounds it:
        ``u - lse`` loses ``|lse| * eps`` to one row-wide rounding); ``hit = gp = g_lp`` for the
        log-prob alone; ``gw * a`` (column weights ``A`` or ones) with ``HAS_W``. Written in G's
        dtype."""
        r = tl.program_id(0)
        src = U + r.to(tl.int64) * stride_u
        dst = G + r.to(tl.int64) * stride_g
        hit = tl.load(GHIT + r)
        gp = tl.load(GP + r)
        lab = tl.load(LAB + r)
        if HAS_ENT:
            g_ent = tl.load(GENT + r)
            ent = tl.load(ENT + r)
        if HAS_W:
            gw = tl.load(GW + r)
        m = tl.load(M + r)
        log_s = tl.load(LOGS + r)
        cols = tl.arange(0, BLOCK)
        for c0 in range(0, nv, BLOCK):
            idx = c0 + cols
            ok = idx < nv
            lp = (tl.load(src + idx, mask=ok, other=0.0) - m) - log_s
            lp = tl.where(lp < -3.0e38, -3.0e38, lp)  # floored; NaN stays (tl.maximum drops it)
            p = tl.exp(lp)
            g = tl.where(idx == lab, hit, 0.0) - p * gp
            if HAS_ENT:
                g -= g_ent * p * (lp + ent)
            if HAS_W:
                if HAS_A:
                    g += gw * tl.load(A + idx, mask=ok, other=0.0)
                else:
                    g += gw
            tl.store(dst + idx, g.to(G.dtype.element_ty), mask=ok)
    # fmt: on


def _use_triton(h) -> bool:
    """The Triton block passes run on CUDA (``RLHF_KERNELS_LINEAR_TRITON=1`` forces them, e.g.
    under ``TRITON_INTERPRET=1`` in tests; ``=0`` turns them off)."""
    flag = os.environ.get("RLHF_KERNELS_LINEAR_TRITON")
    if triton is None or flag == "0":
        return False
    return flag == "1" or h.is_cuda


def _row_block(nv: int) -> int:
    return min(4096, triton.next_power_of_2(max(nv, 16)))


def _view(buf, like):
    return buf.view(-1)[: like.numel()].view(like.shape)


def _label_in_chunk(lab, v0, nv):
    idx = lab - v0
    return idx.clamp(0, nv - 1)[:, None], (idx >= 0) & (idx < nv)


def _forward(h, w, b_s, labels, inv_tau, tc, vc, want_entropy, cap=None, aux=None, a=None):
    """``(logp, entropy or None, stats)`` of every row, one ``(tc, vc)`` block at a time.
    ``aux``: None or an fp32 ``(3, T)`` tensor that receives ``(lse, u_y, sum_v a_v u_v)``
    (``a``: fp32 ``(V,)`` column weights, None for ones), what label smoothing, class weights
    and the z-loss are made of."""
    T, V = h.shape[0], w.shape[0]
    stats = torch.empty(2, T, dtype=torch.float32, device=h.device)  # row max m, log s
    logp, ent = torch.empty_like(stats[0]), torch.empty_like(stats[0])
    buf_u = torch.empty(min(tc, T) * min(vc, V), dtype=torch.float32, device=h.device)
    fast = _use_triton(h)
    buf_e = None if fast else torch.empty_like(buf_u)
    for t0 in range(0, T, tc):
        hc, lab = h[t0 : t0 + tc], labels[t0 : t0 + tc]
        n = hc.shape[0]
        m = torch.full((n,), -math.inf, dtype=torch.float32, device=h.device)
        s, t, u_lab = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
        u_sum = None if aux is None else torch.zeros_like(m)
        for v0 in range(0, V, vc):
            bc = None if b_s is None else b_s[v0 : v0 + vc]
            u = _block(buf_u, hc, w[v0 : v0 + vc], bc, inv_tau, cap=cap)
            if fast:
                nv = u.shape[1]
                _stats_kernel[(n,)](
                    u, u.stride(0), nv, lab - v0, m, s, t, u_lab, m if u_sum is None else u_sum,
                    m if a is None else a[v0 : v0 + nv], WANT_ENT=want_entropy,
                    WANT_SUM=u_sum is not None, HAS_A=a is not None, BLOCK=_row_block(nv),
                )  # fmt: skip
                continue
            col, here = _label_in_chunk(lab, v0, u.shape[1])
            u_lab += torch.where(here, u.gather(1, col)[:, 0], 0.0)
            if u_sum is not None:
                u_sum += u.sum(1) if a is None else u @ a[v0 : v0 + u.shape[1]]
            m_new = torch.maximum(m, u.amax(1))
            # -inf logits (e.g. a -inf bias masking vocab) give e = 0 and never 0 * -inf
            m_safe = torch.where(m_new == -math.inf, 0.0, m_new)
            live = m > -math.inf
            scale = torch.where(live, torch.exp(m - m_safe), 0.0)
            u.sub_(m_safe[:, None])  # u - m_new <= 0
            e = torch.exp(u, out=_view(buf_e, u))
            e_sum = e.sum(1)
            if want_entropy:  # t = sum e * (u - m), kept relative to the running max
                shift = torch.where(live, (m - m_safe) * s, 0.0)
                # in place, summed by .sum (a bmm accumulates ~2.5x plain torch's error)
                t = (t + shift) * scale + u.clamp_(min=_NEG).mul_(e).sum(1)
            s = s * scale + e_sum
            m = m_new
        sl = slice(t0, t0 + n)
        log_s = torch.log(s)
        stats[0, sl], stats[1, sl] = m, log_s
        logp[sl] = (u_lab - m) - log_s  # as log_softmax rounds it (u - lse loses |lse| * eps)
        ent[sl] = log_s - t / s
        if aux is not None:
            aux[0, sl], aux[1, sl], aux[2, sl] = m + log_s, u_lab, u_sum
    return logp, (ent if want_entropy else None), stats


def _new_grads(h, w, needs):
    T, H = h.shape
    f32 = dict(dtype=torch.float32, device=h.device)
    dh = torch.zeros(T, H, **f32) if needs[0] else None
    dw = torch.empty_like(w) if needs[1] else None
    db = torch.zeros(w.shape[0], **f32) if needs[2] else None
    return dh, dw, db


def _accumulate(g, hc, wc, dh_c, acc):
    """dh_c += g @ wc, acc += g.T @ hc (fp32 accumulators; g (n, nv) fp32 or hc's dtype).

    Low precision: dU is rounded to hc's dtype for the tensor-core matmuls (as the naive
    backward does), products are accumulated into the fp32 accumulators directly."""
    gd = g if g.dtype == hc.dtype else g.to(hc.dtype)
    if dh_c is not None:
        _mm_f32(gd, wc, dh_c, add=dh_c)
    if acc is not None:
        _mm_f32(gd.T, hc, acc, add=acc)


def _backward(
    h, w, b_s, labels, inv_tau, tc, vc, stats, ent, g_lp, g_ent, needs, cap=None, g_aux=None,
    a=None,
):  # fmt: skip
    """Gradients (dhidden, dweight, dbias) for upstream g_lp (T,), g_ent (T,) or None and
    g_aux (3, T) or None (of ``_forward``'s ``aux = (lse, u_y, sum_v a_v u_v)``: ``dU`` gains
    ``g_lse * p + g_uy * onehot + g_sum * a``).

    Vocab chunks outer, token chunks inner: the fp32 weight-gradient accumulator is one
    ``(Vc, H)`` chunk (written in place when weight is fp32), ``dhidden`` is fp32 ``(T, H)``.
    """
    T, H = h.shape
    V = w.shape[0]
    dh, dw, db = _new_grads(h, w, needs)
    g_lp = (g_lp * inv_tau).contiguous()  # d u / d z = 1 / tau folded into the upstream grads
    g_ent = None if g_ent is None else (g_ent * inv_tau).contiguous()
    # coefficients of onehot and of -p, and of the column weights (None: none)
    hit, gp, gw = g_lp, g_lp, None
    if g_aux is not None:
        g_aux = g_aux.float() * inv_tau
        hit, gp, gw = (g_lp + g_aux[1]).contiguous(), (g_lp - g_aux[0]).contiguous(), g_aux[2]
        gw = gw.contiguous()
    buf_u = torch.empty(min(tc, T) * min(vc, V), dtype=torch.float32, device=h.device)
    fast = _use_triton(h) and cap is None  # soft cap: torch passes (one more factor per block)
    # fast path: dU is written straight in the matmul dtype
    buf_p = torch.empty(buf_u.numel(), dtype=h.dtype if fast else torch.float32, device=h.device)
    buf_f = None if cap is None else torch.empty_like(buf_u)
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
            # u exactly as the forward formed it (an addmm folding -lse in rounds differently:
            # CPU BLAS with alpha != 1), then log p = (u - m) - log s
            u = _block(buf_u, hc, wc, bc, inv_tau, cap=cap, fac_buf=buf_f)
            fac = None if cap is None else _view(buf_f, u)
            if fast:
                g = _view(buf_p, u)
                has_ent = g_ent is not None
                _grad_kernel[(u.shape[0],)](
                    u, u.stride(0), g, g.stride(0), nv, lab - v0, hit[sl], gp[sl],
                    g_ent[sl] if has_ent else gp[sl], ent[sl] if has_ent else gp[sl],
                    stats[0, sl], stats[1, sl], gp[sl] if gw is None else gw[sl],
                    gp if a is None else a[v0 : v0 + nv], HAS_ENT=has_ent, HAS_W=gw is not None,
                    HAS_A=a is not None, BLOCK=_row_block(nv),
                )  # fmt: skip
            else:
                logp = u.sub_(stats[0, sl, None]).sub_(stats[1, sl, None])  # (n, nv) log p
                p = torch.exp(logp, out=_view(buf_p, logp))
                if g_ent is not None:  # -g_ent p (log p + H) - gp p; p = 0 at log p = -inf
                    g = logp.clamp_(min=_NEG).add_(ent[sl, None]).mul_(p).mul_(-g_ent[sl, None])
                    g.addcmul_(p, gp[sl, None], value=-1.0)
                else:
                    g = p.mul_(-gp[sl, None])
                if gw is not None:  # + g_sum * a (a: the column weights, or ones)
                    if a is None:
                        g.add_(gw[sl, None])
                    else:
                        g.addcmul_(gw[sl, None], a[None, v0 : v0 + nv])
                col, here = _label_in_chunk(lab, v0, nv)
                g.scatter_add_(1, col, torch.where(here, hit[sl], 0.0)[:, None])
                if cap is not None:
                    g.mul_(fac)
            if db is not None:
                db[v0 : v0 + nv] += g.sum(0, dtype=torch.float32)
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


def _scaled_bias(b, cap=None):
    """The bias as :func:`_block` adds it: fp32 ``b`` (``1 / tau`` comes after it), or
    ``b / cap`` under a soft cap."""
    return None if b is None else b.float() * (1.0 if cap is None else 1.0 / cap)


class _LinearLogProbs(torch.autograd.Function):
    """``(logp, entropy or None, aux or None)``; ``aux`` (with ``want_aux``): fp32 ``(3, T)``
    ``(lse, u_y, sum_v a_v u_v)``, ``a`` fp32 ``(V,)`` constant column weights or None (ones):
    the parts of label smoothing, class weights and the z-loss, differentiable in the same
    backward as ``logp`` (so their weight gradients are rounded once, together)."""

    @staticmethod
    def forward(ctx, h, w, b, labels, tau, want_entropy, tc, vc, cap, want_aux=False, a=None):
        inv_tau = 1.0 / tau
        b_s = _scaled_bias(b, cap)
        aux = torch.empty(3, h.shape[0], dtype=torch.float32, device=h.device) if want_aux else None
        with device_guard(h):
            logp, ent, stats = _forward(
                h, w, b_s, labels, inv_tau, tc, vc, want_entropy, cap, aux, a
            )  # fmt: skip
        ctx.save_for_backward(h, w, b, labels, stats, ent, a)
        ctx.cfg = (inv_tau, tc, vc, cap)
        return logp, ent, aux

    @staticmethod
    @first_order_only
    def backward(ctx, g_lp, g_ent, g_aux=None):
        h, w, b, labels, stats, ent, a = ctx.saved_tensors
        inv_tau, tc, vc, cap = ctx.cfg
        if g_lp is None:
            g_lp = torch.zeros_like(stats[0])
        needs = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            b is not None and ctx.needs_input_grad[2],
        )
        with device_guard(h):
            dh, dw, db = _backward(
                h, w, _scaled_bias(b, cap), labels, inv_tau, tc, vc, stats, ent, g_lp.float(),
                None if g_ent is None else g_ent.float(), needs, cap, g_aux, a,
            )  # fmt: skip
        return (*_cast_grads(dh, dw, db, h, b), *(None,) * 8)


class _FusedLinearLoss(torch.autograd.Function):
    """A scalar loss ``sum_chunks loss(logp_chunk, rows)`` with gradients made in forward.

    The upstream gradient of a scalar is one number, so (Liger-style) each token chunk's
    ``dL/dlogp`` (closed form, from :func:`_token_loss`) is turned into
    ``dU = dL/dlogp * (onehot - p) / tau`` (times ``1 - tanh^2`` under a soft cap) right after
    the chunk's log-sum-exp and folded into ``dhidden`` / ``dweight``: 3 matmuls instead of 4.
    Needs the whole vocabulary in one block.
    ``token_loss = (loss, grad)``: the loss must be a sum over tokens (weights precomputed), so
    chunks add up. ``smooth``: None or per-row label-smoothing weights (see :func:`_fused_loss`).
    """

    @staticmethod
    def forward(ctx, h, w, b, labels, tau, tc, token_loss, cap, smooth):
        ng = ctx.needs_input_grad  # grad mode and requires_grad, as seen by autograd
        needs = (ng[0], ng[1], b is not None and ng[2])
        loss, *grads = _fused_loss(h, w, b, labels, tau, tc, token_loss, cap, needs, smooth)
        # a plain attribute, not save_for_backward: backward hands these very tensors to
        # autograd (scaled in place), which can then keep them as .grad without a copy
        ctx.grads = grads
        return loss

    @staticmethod
    @first_order_only  # the gradients were made in the forward: no second derivative
    def backward(ctx, g):
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(
                "the fused linear loss computed its gradients in the forward and handed them "
                "out in the first backward; run the loss again instead of backward(retain_graph="
                "True) twice"
            )
        out = tuple(None if t is None else t.mul_(g.to(t.dtype)) for t in grads)
        del grads
        return out + (None,) * 6


def _fused_loss(h, w, b, labels, tau, tc, token_loss, cap, needs, smooth=None):
    """``_FusedLinearLoss``'s forward: ``(loss, dh, dw, db)`` with the gradients (of the inputs
    whose ``needs`` entry is True, else None) made chunk by chunk in the same pass.
    ``token_loss``: ``(loss(logp, rows), grad(logp, rows))`` from :func:`_token_loss`; the
    closed-form ``d loss / d logp`` also works inside a custom op's body (below the autograd key,
    where ``torch.autograd.grad`` would record nothing).
    ``smooth``: None or fp32 ``(T,)`` weights ``s``: the loss gains ``sum s * (u_y - mean_v u)``
    (label smoothing, ``u`` the block's logits) and ``dU`` gains ``s * (onehot - 1 / V)``, in the
    same fp32 block, so the weight gradient is rounded once (as plain torch's)."""
    inv_tau = 1.0 / tau
    T, H = h.shape
    V = w.shape[0]
    b_s = _scaled_bias(b, cap)
    # dhidden rows are final after their chunk (whole vocabulary per block): input dtype
    dh = torch.empty_like(h) if needs[0] else None
    _, dw, db = _new_grads(h, w, (False, needs[1], needs[2]))
    acc = None
    if dw is not None:  # fp32 accumulator (in place for fp32 weights)
        acc = dw.zero_() if w.dtype == torch.float32 else torch.zeros(V, H, device=h.device)
    fast = _use_triton(h) and cap is None  # soft cap: torch passes
    buf_u = torch.empty(min(tc, T) * V, dtype=torch.float32, device=h.device)
    # dU: written by the Triton pass in the matmul dtype, or computed in place in fp32
    buf_p = torch.empty(buf_u.numel(), dtype=h.dtype, device=h.device) if fast else None
    buf_f = None if cap is None else torch.empty_like(buf_u)
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    loss_fn, grad_fn = token_loss
    with device_guard(h):
        for t0 in range(0, T, tc):
            hc, lab = h[t0 : t0 + tc], labels[t0 : t0 + tc]
            sl = slice(t0, t0 + hc.shape[0])
            want_fac = cap is not None and any(needs)
            u = _block(buf_u, hc, w, b_s, inv_tau, cap=cap, fac_buf=buf_f if want_fac else None)
            fac = _view(buf_f, u) if want_fac else None
            c = None
            if smooth is not None:  # before _chunk_logp, which may overwrite u
                s_w = smooth[sl]
                gap = u.gather(1, lab[:, None])[:, 0] - u.mean(1)
                loss += torch.where(s_w != 0, s_w * gap, 0.0).sum()
                c = (s_w * inv_tau).contiguous()  # d/dz of s * (u_y - mean u) is c * (1_y - 1/V)
            logp, stats, p_sum = _chunk_logp(u, lab, fast)
            loss += loss_fn(logp, sl).float()
            if not any(needs):
                continue
            g_lp = (grad_fn(logp, sl).float() * inv_tau).contiguous()
            if fast:
                g = _view(buf_p, u)
                hit, gw = (g_lp, g_lp) if c is None else (g_lp + c, c * (-1.0 / V))
                _grad_kernel[(u.shape[0],)](
                    u, u.stride(0), g, g.stride(0), V, lab, hit, g_lp, g_lp, g_lp, *stats, gw,
                    g_lp, HAS_ENT=False, HAS_W=c is not None, HAS_A=False, BLOCK=_row_block(V),
                )  # fmt: skip
            else:  # u holds exp(u - max) here
                g = u.mul_((-g_lp / p_sum)[:, None])  # -g_lp * softmax / tau
                if c is not None:
                    g.sub_(c[:, None] / V)
                    g_lp = g_lp + c
                g.scatter_add_(1, lab[:, None], g_lp[:, None])
                if fac is not None:
                    g.mul_(fac)
            if db is not None:
                db += g.sum(0, dtype=torch.float32)
            gd = g if g.dtype == h.dtype else g.to(h.dtype)
            if dh is not None:
                torch.mm(gd, w, out=dh[sl])
            _accumulate(gd, hc, w, None, acc)
    if dw is not None and w.dtype != torch.float32:
        dw.copy_(acc)
    return (loss, *_cast_grads(dh, dw, db, h, b))


def _token_loss(wt, ppo=None):
    """``(loss(logp, rows), grad(logp, rows))``: ``sum(wt * f(logp))`` over ``rows`` and its
    gradient in ``logp``, with ``f = -logp`` (NLL) or, given ``ppo = (old_logp, advantages,
    clip_low, clip_high, dual_clip)``, the PPO clipped token loss. ``wt`` (and the PPO tensors)
    are per row. A row with ``wt == 0`` adds exactly 0 (a NaN there does not leak), whether a
    path skips it or not."""
    if ppo is None:
        tok, tok_grad = (lambda lp, sl: -lp), (lambda lp, sl: -torch.ones_like(lp))
    else:
        from rlhf_kernels.ops.losses import _ppo_token_grad, _ppo_token_loss

        ref, adv, lo, hi, dual = ppo

        def tok(lp, sl):
            return _ppo_token_loss(lp, ref[sl], adv[sl], lo, hi, dual)[0]

        def tok_grad(lp, sl):
            return _ppo_token_grad(lp, ref[sl], adv[sl], lo, hi, dual)

    def grad(lp, sl):
        return torch.where(wt[sl] != 0, tok_grad(lp, sl) * wt[sl], 0.0)

    def loss(lp, sl):
        return torch.where(wt[sl] != 0, tok(lp, sl) * wt[sl], 0.0).sum()

    return loss, grad


def _loss_with_grads(h, w, b, lab, wt, temperature, softcap, needs, ppo=None, smooth=0.0):
    """``(loss, dh, dw, db)`` of ``_token_loss(wt, ppo)`` (plus label smoothing ``smooth``, as
    in :func:`_scalar_loss`) with the gradients made in the forward; rows with ``wt == 0`` skip
    the matmuls (their dh is 0). The body of the scalar losses under torch.compile
    (``rlhf_kernels::linear_loss_fwd``), where the row selection is opaque."""
    T, H = h.shape
    V, cap, tau = w.shape[0], None if softcap is None else float(softcap), float(temperature)
    keep = (wt != 0).nonzero().squeeze(1)
    part = keep.numel() < T
    rows = (lambda t: t.index_select(0, keep)) if part else (lambda t: t)  # noqa: E731
    hh, ll, ww = rows(h), rows(lab), rows(wt)
    if ppo is not None:
        ppo = (rows(ppo[0]), rows(ppo[1]), *ppo[2:])
    token_loss = _token_loss(ww, ppo)
    n, cpu = hh.shape[0], h.device.type == "cpu"
    one_pass, tc = _fits_one_pass(n, H, V, cpu)
    sw = (smooth * ww).float() if smooth else None  # per-row smoothing weights
    if one_pass:
        loss, dh, dw, db = _fused_loss(hh, w, b, ll, tau, tc, token_loss, cap, needs, sw)
    else:  # vocabulary too large for one block: blocks, then the backward with d loss / d logp
        tc, vc = _chunk_sizes(n, H, V, cpu)
        b_s = _scaled_bias(b, cap)
        aux = None if sw is None else torch.empty(3, n, dtype=torch.float32, device=h.device)
        logp, ent, stats = _forward(hh, w, b_s, ll, 1.0 / tau, tc, vc, False, cap, aux)
        every = slice(0, n)
        loss, dh, dw, db = token_loss[0](logp, every), None, None, None
        if sw is not None:  # e * sum wt * (u_y - mean_v u_v): d/d(u_y, sum u) = sw, -sw / V
            loss = loss + (sw * (aux[1] - aux[2] / V)).sum()
            g_aux = torch.stack([torch.zeros_like(sw), sw, sw * (-1.0 / V)])
        if any(needs):
            g_lp = token_loss[1](logp, every).float()
            grads = _backward(
                hh, w, b_s, ll, 1.0 / tau, tc, vc, stats, ent, g_lp, None, needs, cap,
                None if sw is None else g_aux,
            )  # fmt: skip
            dh, dw, db = _cast_grads(*grads, hh, b)
    if dh is not None:  # contiguous, as the op's fake declares
        dh = h.new_zeros(h.shape).index_copy_(0, keep, dh) if part else dh.contiguous()
    return loss.float(), dh, dw, db


def _chunk_logp(u, lab, fast):
    """Per-row ``(logp, (m, log s), s)`` of a full-vocabulary fp32 block ``u`` ``(n, V)``.

    Fast (Triton) path: one read of ``u``, which is left as is (``s`` None). Torch path:
    ``u`` becomes ``exp(u - max)`` in place and ``s`` its row sums (``(m, log s)`` None)."""
    n = u.shape[0]
    if fast:
        m = torch.full((n,), -math.inf, dtype=torch.float32, device=u.device)
        s, t, u_lab = torch.zeros_like(m), torch.zeros_like(m), torch.zeros_like(m)
        _stats_kernel[(n,)](
            u, u.stride(0), u.shape[1], lab, m, s, t, u_lab, m, m, WANT_ENT=False,
            WANT_SUM=False, HAS_A=False, BLOCK=_row_block(u.shape[1]),
        )  # fmt: skip
        log_s = torch.log(s)
        return (u_lab - m) - log_s, (m, log_s), None
    mx = u.amax(1, keepdim=True)
    u_lab = u.gather(1, lab[:, None])[:, 0] - mx[:, 0]
    p = torch.exp(u.sub_(mx), out=u)
    s = p.sum(1)
    return u_lab - torch.log(s), None, s


def _fits_one_pass(T: int, H: int, V: int, cpu: bool = False) -> tuple[bool, int]:
    """Gradients in the forward (3 matmuls, Liger-style) when a block of ``tc >= min(T, 32)``
    tokens x the whole vocabulary fits the block budget. Its fp32 dweight accumulator is
    ``(V, H)`` (twice a bf16 weight gradient; none for fp32 weights)."""
    tc = min(T, _budget(T, H, V, cpu) // max(V, 1))
    return tc >= min(T, 32), max(tc, 1)


def _grad_wanted(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _logprobs_no_grad(hidden, weight, labels, bias, temperature, cap=None, aux=None):
    """Forward only (no_grad / inference_mode / nothing requires grad): ``(T,)`` fp32 logp
    (and ``(lse, u_y, sum_v u_v)`` into ``aux`` when given, see ``_forward``).

    No gradient buffers, no saved tensors, no extra matmuls."""
    T, H = hidden.shape
    tc, vc = _chunk_sizes(T, H, weight.shape[0], hidden.device.type == "cpu")
    inv_tau = 1.0 / float(temperature)
    b_s = _scaled_bias(bias, cap)
    return _forward(hidden, weight, b_s, labels.long(), inv_tau, tc, vc, False, cap, aux)[0]


# ----------------------------------------------------------------------------- API
def _check(
    hidden, weight, labels, bias, temperature, chunk_tokens, chunk_vocab, ignore_index, softcap
):
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(
                f"{name} must be a float tensor, got {getattr(t, 'dtype', type(t).__name__)}"
            )
    if hidden.dim() < 2:
        raise ValueError(
            f"hidden must be packed (T, H) or padded (B, T, H), got shape {tuple(hidden.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, H={hidden.shape[-1]}), got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype must equal hidden's {hidden.dtype}, got {weight.dtype}")
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            "labels must be an int64/int32 tensor, got "
            f"{getattr(labels, 'dtype', type(labels).__name__)}"
        )
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"labels must have hidden's leading shape {tuple(hidden.shape[:-1])}, got "
            f"{tuple(labels.shape)}"
        )
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must be ({weight.shape[0]},) {weight.dtype}, got "
            f"{tuple(bias.shape)} {bias.dtype}"
        )
    devices = {t.device for t in (hidden, weight, labels, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"hidden, weight, labels, bias must share a device, got {devices}")
    if not is_real(temperature, positive=True):
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if softcap is not None and not (is_real(softcap, positive=True) and softcap <= _F32_MAX):
        # fp32 logit blocks: a larger cap (inf included) made every logit NaN
        raise ValueError(
            f"softcap must be None or a number in (0, {_F32_MAX:.4g}], got {softcap!r}"
        )
    for name, c in (("chunk_tokens", chunk_tokens), ("chunk_vocab", chunk_vocab)):
        if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
            raise ValueError(f"{name} must be None or an int >= 1, got {c!r}")
    if torch.compiler.is_compiling():
        return  # traced: mask_labels' custom op checks the label range at run time
    check_label_range(labels, weight.shape[0], ignore_index, CHECK_LABELS_ON_CUDA)


def under_autocast(fn):
    """Under ``torch.autocast`` on the first argument's device, the lm_head matmul's operands
    (first, second argument and ``bias``) are cast to the autocast dtype, as the model's own
    ``lm_head`` (and Liger) would, and the op runs with autocast off (its fp32 logit blocks and
    accumulators stay fp32); gradients flow back through the casts in the params' dtype."""

    sig = inspect.signature(fn)
    operands = (*list(sig.parameters)[:2], "bias")  # (hidden or input, weight, bias)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = args[0] if args else kwargs.get(operands[0])
        dev = getattr(getattr(first, "device", None), "type", None)
        if dev is None or not torch.is_autocast_enabled(dev):
            return fn(*args, **kwargs)
        dt = torch.get_autocast_dtype(dev)
        bound = sig.bind(*args, **kwargs)
        for name in operands:
            t = bound.arguments.get(name)
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                bound.arguments[name] = t.to(dt)
        with torch.autocast(dev, enabled=False):
            return fn(*bound.args, **bound.kwargs)

    return wrapper


@under_autocast
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
    ignore_index: int | None = IGNORE_INDEX,
    softcap: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax((hidden @ weight.T + bias) / temperature).gather(labels)`` without logits.

    Args:
        hidden: packed ``(T, H)`` or padded ``(B, T, H)`` (any leading shape ``(..., H)``)
            float32/bfloat16/float16 final hidden states (differentiable); float64 is accepted
            but computed in fp32 like the rest (fp32 results; for a float64 ground truth use
            ``linear_logprobs_reference``).
        weight: ``(V, H)`` lm_head weight, hidden's dtype (differentiable).
        labels: int64, hidden's leading shape (``(T,)`` or ``(B, T)``): target token ids in
            ``[0, V)`` or ``ignore_index`` (checked on CPU; on CUDA, where the check is a host
            sync, only with ``RLHF_KERNELS_DEBUG=1``, and an out-of-range label gives NaN).
        bias: optional ``(V,)`` lm_head bias, weight's dtype (differentiable).
        temperature: > 0, divides the logits.
        return_entropy: also return the per-token entropy of the tempered distribution.
        chunk_tokens, chunk_vocab: override the block shape (default: the rule in the module
            docstring, ``_chunk_sizes``).
        ignore_index: labels with this value get ``logp = 0`` and no gradient through it
            (entropy is still computed there); ``None``: every label is a token id.
        softcap: logit soft-capping as in Gemma 2 (``final_logit_softcapping``) and Liger:
            the logits are ``softcap * tanh(z / softcap)`` before the temperature; ``None``: off.
    Returns:
        ``logp`` float32 of labels' shape, or ``(logp, entropy)`` both of that shape. Gradients flow
        to hidden, weight and bias; they are accumulated in fp32 and returned in input dtype.
    """
    _check(
        hidden, weight, labels, bias, temperature, chunk_tokens, chunk_vocab, ignore_index, softcap
    )
    cap = None if softcap is None else float(softcap)
    lead = labels.shape
    hidden = hidden.reshape(-1, hidden.shape[-1])
    T, H = hidden.shape
    tc, vc = _chunk_sizes(T, H, weight.shape[0], hidden.device.type == "cpu")
    tc, vc = chunk_tokens or tc, chunk_vocab or vc
    lab, ignored, bad = mask_labels(labels, weight.shape[0], ignore_index)
    if torch.compiler.is_compiling():  # traced: a custom op with a fake (rlhf_kernels.ops.compiled)
        from rlhf_kernels.ops.compiled import linear_logprobs_fwd

        logp, ent, _, _ = linear_logprobs_fwd(
            hidden, weight, bias, lab, float(temperature), return_entropy, tc, vc, cap
        )
    else:
        logp, ent, _ = _LinearLogProbs.apply(
            hidden, weight, bias, lab, float(temperature), return_entropy, tc, vc, cap
        )
    logp = fix_masked(logp, ignored, bad).view(lead)
    return (logp, ent.view(lead)) if return_entropy else logp


def _logprobs_aux(hidden, weight, labels, bias, ignore_index, softcap, cols=None):
    """``(logp, lse, u_y, sum_v a_v u_v)`` of packed ``(T, H)`` hidden (``a``: ``cols``,
    constant ``(V,)`` column weights, or ones), fp32 ``(T,)`` each, from the same logits blocks
    with one backward for all (their weight gradients rounded once, together; under
    torch.compile the same through the ``linear_logprobs_fwd`` op). At ignored labels ``logp``
    is 0 and the others are finite but meaningless."""
    _check(hidden, weight, labels, bias, 1.0, None, None, ignore_index, softcap)
    cap = None if softcap is None else float(softcap)
    T, H = hidden.shape
    tc, vc = _chunk_sizes(T, H, weight.shape[0], hidden.device.type == "cpu")
    lab, ignored, bad = mask_labels(labels, weight.shape[0], ignore_index)
    a = None if cols is None else cols.detach().float().contiguous()
    if torch.compiler.is_compiling():
        from rlhf_kernels.ops.compiled import linear_logprobs_fwd

        logp, _, _, aux = linear_logprobs_fwd(
            hidden, weight, bias, lab, 1.0, False, tc, vc, cap, True, a
        )
    else:
        logp, _, aux = _LinearLogProbs.apply(
            hidden, weight, bias, lab, 1.0, False, tc, vc, cap, True, a
        )  # fmt: skip
    return fix_masked(logp, ignored, bad), aux[0], aux[1], aux[2]


@under_autocast
def linear_nll_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    ignore_index: int | None = IGNORE_INDEX,
    *,
    group=None,
    softcap: float | None = None,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """SFT loss without logits: ``-sum(mask * logp) / sum(mask)``.

    Args: as :func:`linear_logprobs` (packed ``(T, H)`` or padded ``(B, T, H)`` hidden);
    ``mask`` (labels' shape, 0/1 bool or numeric) selects the tokens that count (default: all);
    tokens whose label is ``ignore_index`` never count (as in ``F.cross_entropy``); ``softcap``
    as in :func:`linear_logprobs`.
    ``label_smoothing``: ``e`` in ``[0, 1]``, ``F.cross_entropy``'s meaning: each token's
    ``-logp`` becomes ``(1 - e) (-logp_y) + e mean_v(-logp_v) = -logp_y + e (u_y - mean_v u_v)``
    (``u`` the logits after temperature and soft cap); in the one pass it costs no matmul.
    ``group``: a ring (or any) process group whose ranks each hold a shard of the tokens: the
    denominator becomes the token count summed over the group (one all-reduce of a scalar), so
    the ranks' losses add up to the single-device loss and their gradients, summed over the
    group, to its gradient (the :func:`rlhf_kernels.ring_token_mean` convention).
    Returns a float32 scalar (0 when no token counts).
    When the whole vocabulary fits one block (``_chunk_sizes``) and the fp32 weight-gradient
    accumulator is free (fp32 weight) or within the block budget, gradients are computed in the
    forward pass (``_FusedLinearLoss``, 3 matmuls; under torch.compile the same math in the
    ``rlhf_kernels::linear_loss_fwd`` op); otherwise this is ``linear_logprobs`` + a sum.
    """
    try:  # a bad input on one rank of ``group`` raises on all (none waits in the all-reduce)
        hidden, lab, bad, m = _nll_inputs(
            hidden, weight, labels, mask, bias, temperature, ignore_index, softcap, label_smoothing
        )
    except Exception:  # any type (an AttributeError, a RuntimeError): the peers must not wait
        _fail_on_group(group, hidden, labels)
        raise
    wt = m / _token_count(m, group)  # per-token weight of -logp in the loss
    hidden, lab, (wt, bad) = _live_rows(hidden, lab, wt, padded=len(labels.shape) > 1, more=(bad,))
    smooth = float(label_smoothing)
    loss = _scalar_loss(hidden, weight, bias, lab, temperature, wt, softcap, smooth=smooth)
    return _nan_if_bad(loss, bad, wt)


def _nll_inputs(
    hidden, weight, labels, mask, bias, temperature, ignore_index, softcap, label_smoothing
):
    """``linear_nll_loss``'s checks; returns hidden ``(T, H)``, the labels and their
    out-of-range flags (``mask_labels``) and the ``(T,)`` token mask."""
    _check(hidden, weight, labels, bias, temperature, None, None, ignore_index, softcap)
    if not (is_scalar(label_smoothing) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a tensor, got {type(mask).__name__}")
    if mask is not None and mask.shape != labels.shape:
        raise ValueError(
            f"mask must have labels' shape {tuple(labels.shape)}, got {tuple(mask.shape)}"
        )
    if mask is not None and mask.device != labels.device:
        raise ValueError(f"mask is on {mask.device}, labels on {labels.device}")
    mask = check_mask(mask)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    T, V = hidden.shape[0], weight.shape[0]
    lab, ignored, bad = mask_labels(labels, V, ignore_index)
    m = torch.ones(T, device=hidden.device) if mask is None else mask.reshape(-1).to(torch.float32)
    if ignored is not None:
        m = m.masked_fill(ignored, 0.0)
    return hidden, lab, bad, m


@under_autocast
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
    ignore_index: int | None = IGNORE_INDEX,
    group=None,
    softcap: float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """PPO clipped loss straight from hidden states: lm_head -> log-prob -> ``policy_loss``.

    Args:
        hidden, weight, labels, bias, temperature, softcap: as :func:`linear_logprobs`: packed
            ``(T, H)`` tokens or a padded ``(B, T, H)`` batch; ``labels[..., t]`` is the
            sampled token scored at position ``t``.
        old_logp, advantages: float, labels' shape: behaviour-policy log-probs and advantages
            (constants: no gradient flows to them).
        mask: labels' shape, 0/1 tokens that count (default all for packed input; required
            for a padded ``(B, T)`` batch, whose sequences are the rows, as in ``policy_loss``).
        cu_seqlens: ``(S + 1,)`` sequence boundaries of the packed layout, needed by the
            sequence-level aggregations (not by ``"token-mean"``).
        clip_low, clip_high, dual_clip, aggregation, norm_length: as
            :func:`rlhf_kernels.ops.losses.policy_loss`.
        ignore_index: tokens with this label are left out (as if masked).
        group: as in :func:`linear_nll_loss` (``"token-mean"`` only): the token count is summed
            over the group, so the ranks' losses add up to the single-device loss.
    Returns: float32 scalar, equal to ``policy_loss(linear_logprobs(...), ...)``; computed in
    one pass with gradients made during the forward when the vocabulary fits one block.
    """
    from rlhf_kernels.ops import losses

    try:  # a bad input on one rank of ``group`` raises on all (none waits in the all-reduce)
        _check(hidden, weight, labels, bias, temperature, None, None, ignore_index, softcap)
        clips = (clip_low, clip_high, dual_clip, norm_length)
        _policy_checks(losses, labels, old_logp, advantages, group, aggregation, *clips)
        m, seq, n_seq = losses._token_layout(
            "old_logp", old_logp.float(), mask, cu_seqlens, aggregation, advantages=advantages
        )
        hidden = hidden.reshape(-1, hidden.shape[-1])
        lab, ignored, bad = mask_labels(labels, weight.shape[0], ignore_index)
        m = m.reshape(-1)
        seq = None if seq is None else seq.reshape(-1)
        if ignored is not None:  # a token with no label does not count
            m = m.masked_fill(ignored, 0.0)
    except Exception:  # any type (an AttributeError, a RuntimeError): the peers must not wait
        _fail_on_group(group, hidden, labels)
        raise
    if group is None:
        wt = losses._token_weights(m, seq, n_seq, aggregation, norm_length)
    else:
        wt = m / _token_count(m, group)
    # constants of the loss (no gradient), on every path
    ref, adv = old_logp.detach().reshape(-1).float(), advantages.detach().reshape(-1).float()
    hidden, lab, (wt, bad, ref, adv) = _live_rows(
        hidden, lab, wt, padded=len(labels.shape) > 1, more=(bad, ref, adv)
    )

    ppo = (ref, adv, clip_low, clip_high, dual_clip)
    loss = _scalar_loss(hidden, weight, bias, lab, temperature, wt, softcap, ppo)
    return _nan_if_bad(loss, bad, wt)


def _policy_checks(losses, labels, old_logp, advantages, group, aggregation, *clips):
    losses._check_float(old_logp=old_logp, advantages=advantages)
    losses._check_policy_args(aggregation, *clips)
    if old_logp.shape != labels.shape:
        raise ValueError(
            f"old_logp must have labels' shape {tuple(labels.shape)}, got {tuple(old_logp.shape)}"
        )
    if old_logp.device != labels.device:
        raise ValueError(f"old_logp is on {old_logp.device}, labels on {labels.device}")
    if group is not None and aggregation != "token-mean":
        raise ValueError(
            f"group= (a token mean over a ring) works with aggregation='token-mean' only, got "
            f"{aggregation!r}"
        )


def _token_count(m, group):
    """``sum(m)`` (at least 1), summed over ``group`` when given: one all-reduce of
    ``[count, failed ranks]`` (``_fail_on_group`` joins it from a rank whose input was bad), so
    a bad input on any rank raises on every rank (at the cost of one host read)."""
    n = m.detach().sum(dtype=torch.float64)
    if group is not None:
        import torch.distributed as dist

        both = torch.stack([n, torch.zeros_like(n)])
        dist.all_reduce(both, group=group)
        if bool(both[1] > 0):
            raise ValueError(
                f"{int(both[1])} other rank(s) of the group passed invalid input (their own "
                "error says which); every rank raises"
            )
        n = both[0]
    return n.clamp_min(1.0).to(m.dtype)


def _fail_on_group(group, *tensors) -> None:
    """A rank whose input failed the checks joins ``_token_count``'s all-reduce, flagged."""
    if group is None:
        return
    import torch.distributed as dist

    flags = torch.tensor([0.0, 1.0], dtype=torch.float64, device=_flag_device(group, *tensors))
    dist.all_reduce(flags, group=group)


def _flag_device(group, *tensors) -> torch.device:
    """Where the failure flag is all-reduced: NCCL takes CUDA tensors only (the bad input may
    be a CPU ``hidden`` or no tensor at all: a CPU flag raised a RuntimeError there and left
    the peers waiting); other backends take the first tensor's device, else the CPU."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend(group)).lower():
        cuda = [t.device for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda]
        return cuda[0] if cuda else torch.device("cuda", torch.cuda.current_device())
    device = next((t.device for t in tensors if isinstance(t, torch.Tensor)), None)
    return device if device is not None and device.type != "meta" else torch.device("cpu")


def _live_rows(hidden, lab, wt, padded, more=()):
    """Padded input: keep only the rows that count (``wt != 0``), so pads cost no matmul.

    Eager only (a data-dependent row count would break a torch.compile graph; there
    the scalar losses' op skips the rows at run time); the gradient of the dropped rows is 0
    either way. Returns ``(hidden, lab, (wt, *more))`` row-selected."""
    if not padded or torch.compiler.is_compiling():
        return hidden, lab, (wt, *more)
    keep = (wt != 0).nonzero().squeeze(1)
    if keep.numel() == wt.numel():
        return hidden, lab, (wt, *more)
    pick = lambda t: t.index_select(0, keep)  # noqa: E731
    return pick(hidden), pick(lab), tuple(pick(t) for t in (wt, *more))


def _scalar_loss(hidden, weight, bias, lab, temperature, wt, softcap=None, ppo=None, smooth=0.0):
    """``_token_loss(wt, ppo)`` over all rows (gatherable labels ``lab``): one pass with
    gradients made in the forward when the vocabulary fits one block (under torch.compile the
    ``rlhf_kernels::linear_loss_fwd`` op, which also skips rows with ``wt == 0``), else
    ``linear_logprobs`` + autograd; forward only without grad. ``smooth``: label smoothing
    ``e``, adding ``e * sum wt * (u_y - mean_v u)`` from the same logits blocks."""
    T, H = hidden.shape
    cap = None if softcap is None else float(softcap)
    if torch.compiler.is_compiling():  # traced: one opaque op, gradients made in its forward
        from rlhf_kernels.ops.compiled import linear_loss_fwd

        grad = torch.is_grad_enabled()
        needs = [grad and t is not None and t.requires_grad for t in (hidden, weight, bias)]
        ref, adv, lo, hi, dual = (None, None, 0.0, 0.0, None) if ppo is None else ppo
        return linear_loss_fwd(
            hidden, weight, bias, lab, wt, ref, adv, float(lo), float(hi),
            None if dual is None else float(dual), float(temperature), cap, needs, float(smooth),
        )[0]  # fmt: skip
    token_loss = _token_loss(wt, ppo)
    loss_fn = token_loss[0]
    tau, cpu = float(temperature), hidden.device.type == "cpu"
    one_pass, tc = _fits_one_pass(T, H, weight.shape[0], cpu)
    if one_pass and _grad_wanted(hidden, weight, bias):
        sw = (smooth * wt).float() if smooth else None
        return _FusedLinearLoss.apply(hidden, weight, bias, lab, tau, tc, token_loss, cap, sw)
    # forward only (nothing saved), or a vocabulary too large for one block (or the fp32
    # weight-gradient copy would not be small): log-probs + autograd
    if not _grad_wanted(hidden, weight, bias):
        aux = torch.empty(3, T, dtype=torch.float32, device=hidden.device) if smooth else None
        logp = _logprobs_no_grad(hidden, weight, lab, bias, tau, cap, aux)
    else:
        tc, vc = _chunk_sizes(T, H, weight.shape[0], cpu)
        logp, _, aux = _LinearLogProbs.apply(
            hidden, weight, bias, lab, tau, False, tc, vc, cap, bool(smooth)
        )  # fmt: skip
    loss = loss_fn(logp, slice(0, T))
    if smooth:
        gap = aux[1] - aux[2] / weight.shape[0]  # u_y - mean_v u_v
        loss = loss + smooth * torch.where(wt != 0, wt * gap, 0.0).sum()
    return loss


def _nan_if_bad(loss, bad, wt):
    """NaN loss if a counted token has an out-of-range label (unchecked CUDA path); no sync."""
    return loss + torch.where((bad & (wt != 0)).any(), float("nan"), 0.0)
