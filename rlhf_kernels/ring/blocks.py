"""Block math of ring attention: this rank's queries against one rank's keys, tile by tile.

Tiles are at most ``tile x tile`` tokens of one document (memory ``heads * tile^2`` in the compute
dtype), chosen from the plan's (document, position) of every slot; fully masked tiles never
appear. Each tile is either all visible, the aligned causal diagonal (both can use torch's fused
CPU flash kernel) or partly masked (explicit fp32 math with a position mask). The forward merges
normalised tile results into running (out, lse); the backward recomputes probabilities from the
final merged lse and ``delta = rowsum(dO * O)``, which makes every block's gradient exact.

``spec`` is the per-call ``_Spec`` of ``attention.py`` (scale, softcap, window sides, fused).
"""

from __future__ import annotations

import torch

from rlhf_kernels._checks import all_finite
from rlhf_kernels.ring.plan import RingPlan

# fused CPU flash kernel (fp32 math, returns lse; its backward takes the final out and lse)
flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
flash_cpu_backward = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


def _visible_runs(plan: RingPlan, rank: int, src: int, left: int, right: int):
    """Yield ``(q_slot, q_len, q_pos, k_slot, k_len, k_pos)`` for every run of ``rank``'s
    queries and run of ``src``'s keys of the same document with at least one visible pair
    (key ``j`` visible from query ``i`` iff ``i - left <= j <= i + right``; negative: unbounded).
    """
    k_by_doc: dict[int, list] = {}
    for ks, kn, d, kp in plan.segments(src):
        k_by_doc.setdefault(d, []).append((ks, kn, kp))
    for qs, qn, d, qp in plan.segments(rank):
        for ks, kn, kp in k_by_doc.get(d, ()):
            if (right >= 0 and kp > qp + qn - 1 + right) or (left >= 0 and kp + kn - 1 < qp - left):
                continue  # fully masked
            yield qs, qn, qp, ks, kn, kp


def tile_pairs(plan: RingPlan, rank: int, src: int, causal: bool, window_size, tile: int):
    """Tiles of ``rank``'s queries x ``src``'s keys that have at least one visible pair.

    Returns ``[(q_slot, q_len, k_slot, k_len, mask), ...]`` where mask is None when every pair of
    the tile is visible, else ``(q_pos0, k_pos0)`` (global positions of the tile's first query and
    key) to build the mask from. Cached on the plan.
    """
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    key = ("tiles", rank, src, left, right, tile)
    if key in plan._cache:
        return plan._cache[key]
    pairs = []
    for qs, qn, qp, ks, kn, kp in _visible_runs(plan, rank, src, left, right):
        for a in range(0, qn, tile):
            ta = min(tile, qn - a)
            qlo, qhi = qp + a, qp + a + ta - 1
            for b in range(0, kn, tile):
                tb = min(tile, kn - b)
                klo, khi = kp + b, kp + b + tb - 1
                if (right >= 0 and klo > qhi + right) or (left >= 0 and khi < qlo - left):
                    continue  # fully masked
                full = (right < 0 or khi <= qlo + right) and (left < 0 or klo >= qhi - left)
                pairs.append((qs + a, ta, ks + b, tb, None if full else (qlo, klo)))
    plan._cache[key] = pairs
    return pairs


def _tile_mask(ta, tb, q0, k0, left, right, device):
    i = torch.arange(q0, q0 + ta, device=device).unsqueeze(1)
    j = torch.arange(k0, k0 + tb, device=device).unsqueeze(0)
    ok = torch.ones(ta, tb, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok


def _scores(spec, qh, kt, mask, ta, tb, device):
    """qh ``(KVH, g*ta, D)``, kt ``(tb, KVH, D)`` -> capped, masked scores ``(KVH, g*ta, tb)``.

    Also returns ``tanh(s / softcap)`` (None without softcap) for the backward.
    """
    s = torch.matmul(qh, kt.permute(1, 2, 0)) * spec.scale
    t = None
    if spec.softcap > 0:
        t = torch.tanh(s / spec.softcap)
        s = spec.softcap * t
    if mask is not None:
        ok = _tile_mask(ta, tb, mask[0], mask[1], spec.left, spec.right, device)
        kvh = s.shape[0]
        s = s.view(kvh, -1, ta, tb).masked_fill(~ok, float("-inf")).view(kvh, -1, tb)
    return s, t


def _heads_to_groups(x, kvh):
    """``(t, H, D)`` -> ``(KVH, g*t, D)``; query head ``h`` reads kv head ``h // g``."""
    t, h, d = x.shape
    return x.permute(1, 0, 2).reshape(kvh, (h // kvh) * t, d)


def _groups_to_heads(x, h, t):
    """Inverse of ``_heads_to_groups``: ``(KVH, g*t, D)`` -> ``(t, H, D)``."""
    return x.reshape(h, t, x.shape[-1]).permute(1, 0, 2)


def _fused_causal(spec, ta, tb, mask):
    """None: explicit math; False/True: the tile can use the fused CPU flash kernel (all visible,
    or the aligned causal diagonal), with that ``is_causal``."""
    if not spec.fused:
        return None
    if mask is None:
        return False
    if spec.right == 0 and spec.left < 0 and mask[0] == mask[1] and ta == tb:
        return True
    return None


def _expand_kv(x, g):
    """``(t, KVH, D)`` -> ``(1, H, t, D)`` with each kv head repeated for its ``g`` query heads."""
    x = x.transpose(0, 1)
    return (x.repeat_interleave(g, dim=0) if g > 1 else x).unsqueeze(0)


def _rows(x, start, n):
    """Rows ``start:start+n`` of ``(L, H, D)`` as ``(1, H, n, D)``."""
    return x[start : start + n].transpose(0, 1).unsqueeze(0)


def _merge(acc_o, acc_lse, qs, ta, o, lse):
    """Fold a partial result (o ``(ta, H, D)``, normalised; lse ``(H, ta)``) into the running
    accumulators."""
    old = acc_lse[:, qs : qs + ta]
    new = torch.logaddexp(old, lse)
    safe = torch.where(torch.isinf(new), 0.0, new)
    w_old, w_new = torch.exp(old - safe).T.unsqueeze(-1), torch.exp(lse - safe).T.unsqueeze(-1)
    acc_o[qs : qs + ta] = acc_o[qs : qs + ta] * w_old + o * w_new
    acc_lse[:, qs : qs + ta] = new


def forward_block(spec, q, k, v, pairs, acc_o, acc_lse):
    """Merge one key block into the running (out, lse). q/acc in compute dtype.

    q ``(Lq, H, D)``, k/v ``(Lk, KVH, D)``; acc_o ``(Lq, H, D)``, acc_lse ``(H, Lq)`` (views ok).
    """
    h, kvh = q.shape[1], k.shape[1]
    finite = not spec.fused or all_finite(q, k, v)  # NaN blocks: explicit math
    for qs, ta, ks, tb, mask in pairs:
        kt = k[ks : ks + tb].to(q.dtype)
        vt = v[ks : ks + tb].to(q.dtype)
        fused = _fused_causal(spec, ta, tb, mask) if finite else None
        if fused is not None:
            o, lse = flash_cpu(
                _rows(q, qs, ta),
                _expand_kv(kt, h // kvh),
                _expand_kv(vt, h // kvh),
                0.0,
                fused,
                scale=spec.scale,
            )
            _merge(acc_o, acc_lse, qs, ta, o[0].transpose(0, 1), lse[0])
            continue
        qh = _heads_to_groups(q[qs : qs + ta], kvh)
        s, _ = _scores(spec, qh, kt, mask, ta, tb, q.device)
        lse = torch.logsumexp(s, -1)  # (KVH, g*ta)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
        o = _groups_to_heads(torch.matmul(p, vt.transpose(0, 1)), h, ta)  # (ta, H, D)
        _merge(acc_o, acc_lse, qs, ta, o, lse.reshape(h, ta))


def backward_block(spec, q, k, v, out, do, lse, delta, pairs, dq, dk, dv):
    """Gradients of one key block. q/out/do/dq ``(Lq, H, D)``, lse/delta ``(H, Lq)`` (final,
    merged), k/v ``(Lk, KVH, D)``, dk/dv ``(Lk, KVH, D)`` accumulators; compute dtype except k/v.
    """
    h, kvh = q.shape[1], k.shape[1]
    g = h // kvh
    safe_lse = torch.where(torch.isinf(lse), 0.0, lse)
    finite = not spec.fused or all_finite(q, k, v, do)
    for qs, ta, ks, tb, mask in pairs:
        kt = k[ks : ks + tb].to(q.dtype)
        vt = v[ks : ks + tb].to(q.dtype)
        fused = _fused_causal(spec, ta, tb, mask) if finite else None
        if fused is not None:  # the kernel takes the final out/lse: exact per-block gradients
            gq, gk, gv = flash_cpu_backward(
                _rows(do, qs, ta),
                _rows(q, qs, ta),
                _expand_kv(kt, g),
                _expand_kv(vt, g),
                _rows(out, qs, ta),
                lse[:, qs : qs + ta].unsqueeze(0).contiguous(),
                0.0,
                fused,
                scale=spec.scale,
            )
            dq[qs : qs + ta] += gq[0].transpose(0, 1)
            dk[ks : ks + tb] += gk[0].view(kvh, g, tb, -1).sum(1).transpose(0, 1)
            dv[ks : ks + tb] += gv[0].view(kvh, g, tb, -1).sum(1).transpose(0, 1)
            continue
        qh = _heads_to_groups(q[qs : qs + ta], kvh)
        doh = _heads_to_groups(do[qs : qs + ta], kvh)
        s, t = _scores(spec, qh, kt, mask, ta, tb, q.device)
        rows_lse = safe_lse[:, qs : qs + ta].reshape(kvh, -1, 1)
        p = torch.exp(s - rows_lse)  # (KVH, g*ta, tb); 0 where masked
        dv[ks : ks + tb] += torch.matmul(p.transpose(1, 2), doh).transpose(0, 1)
        dp = torch.matmul(doh, vt.permute(1, 2, 0))
        ds = p * (dp - delta[:, qs : qs + ta].reshape(kvh, -1, 1))
        if t is not None:
            ds = ds * (1 - t * t)
        ds = ds * spec.scale
        dq[qs : qs + ta] += _groups_to_heads(torch.matmul(ds, kt.transpose(0, 1)), h, ta)
        dk[ks : ks + tb] += torch.matmul(ds.transpose(1, 2), qh).transpose(0, 1)


# ----------------------------------------------------------------------------- Triton (CUDA)
def segment_pairs(plan: RingPlan, rank: int, src: int, left: int, right: int, device):
    """One block as a varlen batch for the Triton kernels: every (query segment of ``rank``, key
    segment of ``src``) of the same document with a visible pair is one "sequence".

    Returns ``(idx_q, idx_k, cu_q, cu_k, diff, max_q, max_k)`` (cached on the plan per device):
    the query / key slots of each pair back to back (int64 gather indices; a query slot appears
    once per key segment it meets), int32 ``cu_seqlens`` over them, and int32 ``diff`` = key index
    that query 0 of the pair sits at (``q_pos0 - k_pos0``), which replaces the kernel's
    bottom-right alignment. Or None when no pair is visible.
    """
    key = ("triton_pairs", rank, src, left, right, str(device))
    if key in plan._cache:
        return plan._cache[key]
    iq, ik, lq, lk, diff = [], [], [], [], []
    for qs, qn, qp, ks, kn, kp in _visible_runs(plan, rank, src, left, right):
        iq.append(torch.arange(qs, qs + qn))
        ik.append(torch.arange(ks, ks + kn))
        lq.append(qn)
        lk.append(kn)
        diff.append(qp - kp)
    if not iq:
        plan._cache[key] = None
        return None

    def cu(lengths):
        return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)

    out = (
        torch.cat(iq).to(device),
        torch.cat(ik).to(device),
        cu(lq).to(device),
        cu(lk).to(device),
        torch.tensor(diff, dtype=torch.int32, device=device),
        max(lq),
        max(lk),
    )
    plan._cache[key] = out
    return out


def _merge_rows(acc_o, acc_lse, idx, o, lse):
    """Fold partial results for rows ``idx`` (repeats allowed; o ``(N, H, D)``, lse ``(H, N)``)
    into the running (acc_o ``(L, H, D)``, acc_lse ``(H, L)``), in place (views ok)."""
    h = acc_lse.shape[0]
    m = acc_lse.clone().scatter_reduce_(1, idx.expand(h, -1), lse.to(acc_lse.dtype), "amax")
    m = torch.where(torch.isinf(m), 0.0, m)
    w_old = torch.exp(acc_lse - m)  # (H, L): 0 where nothing was merged yet
    w_new = torch.exp(lse - m[:, idx])  # (H, N)
    total = w_old.index_add(1, idx, w_new)
    num = (acc_o * w_old.T.unsqueeze(-1)).index_add_(0, idx, o * w_new.T.unsqueeze(-1))
    acc_o.copy_(num / torch.where(total > 0, total, 1.0).T.unsqueeze(-1))
    acc_lse.copy_(m + torch.log(total))


def forward_block_triton(spec, q, k, v, pairs, acc_o, acc_lse):
    """``forward_block`` through the Triton varlen kernel: one launch for the whole block.

    q ``(Lq, H, D)`` in the input dtype, k/v ``(Lk, KVH, D)``; accumulators fp32 (views ok)."""
    from rlhf_kernels.ops.varlen_attention_triton import varlen_attention_triton_forward

    if pairs is None:
        return
    idx_q, idx_k, cu_q, cu_k, diff, max_q, max_k = pairs
    o, lse = varlen_attention_triton_forward(
        q.index_select(0, idx_q).contiguous(),
        k.index_select(0, idx_k).to(q.dtype).contiguous(),
        v.index_select(0, idx_k).to(q.dtype).contiguous(),
        cu_q, cu_k, max_q, max_k, spec.scale, False, (spec.left, spec.right), spec.softcap,
        diff=diff, out_dtype=acc_o.dtype,
    )  # fmt: skip
    _merge_rows(acc_o, acc_lse, idx_q, o, lse)


def backward_block_triton(spec, q, k, v, do, lse, delta, pairs, dq, dk, dv):
    """``backward_block`` through the Triton backward kernels with the final lse and delta
    (exact per-block gradients); q/do in the input dtype, lse/delta/dq/dk/dv fp32."""
    from rlhf_kernels.ops.varlen_attention_triton import varlen_attention_triton_backward

    if pairs is None:
        return
    idx_q, idx_k, cu_q, cu_k, diff, max_q, max_k = pairs
    qp = q.index_select(0, idx_q).contiguous()
    gq, gk, gv = varlen_attention_triton_backward(
        do.index_select(0, idx_q).to(q.dtype), qp,
        k.index_select(0, idx_k).to(q.dtype).contiguous(),
        v.index_select(0, idx_k).to(q.dtype).contiguous(),
        None, lse[:, idx_q].float().contiguous(), cu_q, cu_k, max_q, max_k, spec.scale, False,
        (spec.left, spec.right), spec.softcap, diff=diff,
        delta=delta[:, idx_q].float().contiguous(), grad_dtype=torch.float32,
    )  # fmt: skip
    dq.index_add_(0, idx_q, gq.to(dq.dtype))
    dk.index_add_(0, idx_k, gk.to(dk.dtype))
    dv.index_add_(0, idx_k, gv.to(dv.dtype))
