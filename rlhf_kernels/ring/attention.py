"""Ring attention over a packed (varlen) stream sharded by a ``RingPlan``.

Each rank holds ``local_len`` slots of q/k/v (``RingPlan.shard``). Its queries must meet the keys
of every rank; two ways to bring them:

``comm="p2p"``: the K/V shard (only the KV heads, GQA is never expanded) walks around the ring
with ``batch_isend_irecv``; the transfer of the next block overlaps the compute of the current one.
In backward the K/V walk again and the fp32 dK/dV accumulators follow one hop behind, ending on
their owner after ``world_size`` hops.

``comm="allgather"``: K/V are all-gathered ``kv_head_stride`` KV heads at a time (the next group
prefetched while the current one is computed); dK/dV are reduce-scattered.

Block math (local queries vs one rank's keys) is exact flash-style attention in fp32 (float64 for
float64 inputs) over tiles of at most ``tile`` x ``tile`` tokens of the same document. Visibility
uses the global (document, position) of each slot: key ``j`` is visible to query ``i`` of the
same document iff ``j <= i + right`` (``right = 0`` when causal) and ``j >= i - left`` (negative =
unbounded), as in ``varlen_attention`` for self-attention. Fully masked tiles are skipped; that is
where the zigzag layout's balance shows. Partial outputs are merged with their lse in fp32; the
backward uses the final lse and ``delta = rowsum(dO * O)``, so it is exact for any ring size.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlhf_kernels.ring.plan import RingPlan

COMMS = ("p2p", "allgather")
DEFAULT_TILE = 1024
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# torch >= 2.13 names; older releases call them *_tensor (same semantics, flat dim 0)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
# fused CPU flash kernel (fp32 math, returns lse; its backward takes the final out and lse)
_flash_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_flash_cpu_backward = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


# ----------------------------------------------------------------------------- tile schedule
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
    k_by_doc: dict[int, list] = {}
    for ks, kn, d, kp in plan.segments(src):
        k_by_doc.setdefault(d, []).append((ks, kn, kp))
    pairs = []
    for qs, qn, d, qp in plan.segments(rank):
        for ks, kn, kp in k_by_doc.get(d, ()):
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


class _Spec:
    """Per-call constants shared by forward and backward."""

    def __init__(self, plan, group, rank, causal, scale, window, softcap, comm, stride, tile):
        self.plan, self.group, self.rank, self.world = plan, group, rank, plan.world_size
        self.causal, self.scale, self.softcap = causal, scale, softcap
        self.left, self.right = window[0], (0 if causal else window[1])
        self.window, self.comm, self.stride, self.tile = window, comm, stride, tile
        self.fused = False  # set per call: fused CPU kernel for all-visible / diagonal tiles
        if self.world > 1:  # P2P peers are global ranks
            nxt, prv = (rank + 1) % self.world, (rank - 1) % self.world
            glob = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
            self.next_peer, self.prev_peer = glob(nxt), glob(prv)

    def pairs(self, src):
        return tile_pairs(self.plan, self.rank, src, self.causal, self.window, self.tile)


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


def _forward_block(spec, q, k, v, pairs, acc_o, acc_lse):
    """Merge one key block into the running (out, lse). q/acc in compute dtype.

    q ``(Lq, H, D)``, k/v ``(Lk, KVH, D)``; acc_o ``(Lq, H, D)``, acc_lse ``(H, Lq)`` (views ok).
    """
    h, kvh = q.shape[1], k.shape[1]
    for qs, ta, ks, tb, mask in pairs:
        kt = k[ks : ks + tb].to(q.dtype)
        vt = v[ks : ks + tb].to(q.dtype)
        fused = _fused_causal(spec, ta, tb, mask)
        if fused is not None:
            o, lse = _flash_cpu(
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


def _backward_block(spec, q, k, v, out, do, lse, delta, pairs, dq, dk, dv):
    """Gradients of one key block. q/out/do/dq ``(Lq, H, D)``, lse/delta ``(H, Lq)`` (final,
    merged), k/v ``(Lk, KVH, D)``, dk/dv ``(Lk, KVH, D)`` accumulators; compute dtype except k/v.
    """
    h, kvh = q.shape[1], k.shape[1]
    g = h // kvh
    safe_lse = torch.where(torch.isinf(lse), 0.0, lse)
    for qs, ta, ks, tb, mask in pairs:
        kt = k[ks : ks + tb].to(q.dtype)
        vt = v[ks : ks + tb].to(q.dtype)
        fused = _fused_causal(spec, ta, tb, mask)
        if fused is not None:  # the kernel takes the final out/lse: exact per-block gradients
            gq, gk, gv = _flash_cpu_backward(
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


# ----------------------------------------------------------------------------- communication
def _exchange(spec, send):
    """Send ``send`` to the next rank and receive the previous rank's tensor (async)."""
    recv = torch.empty_like(send)
    ops = [
        dist.P2POp(dist.isend, send, spec.next_peer, group=spec.group),
        dist.P2POp(dist.irecv, recv, spec.prev_peer, group=spec.group),
    ]
    return dist.batch_isend_irecv(ops), recv


def _wait(reqs):
    for r in reqs:
        r.wait()


def _allgather(spec, x):
    """Async all-gather of ``x`` -> ``(world, *x.shape)``."""
    out = torch.empty((spec.world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    work = _all_gather(out, x.contiguous(), group=spec.group, async_op=True)
    return work, out.view(spec.world, *x.shape)


def _reduce_scatter(spec, full):
    """Sum ``full`` ``(world, *shape)`` over ranks; return this rank's slice ``shape``."""
    out = torch.empty(full.shape[1:], dtype=full.dtype, device=full.device)
    try:
        _reduce_scatter_flat(out, full.reshape(-1, *full.shape[2:]), group=spec.group)
    except (RuntimeError, NotImplementedError):  # backends without reduce_scatter (older gloo)
        dist.all_reduce(full, group=spec.group)
        out.copy_(full[spec.rank])
    return out


def _head_groups(kvh, stride):
    stride = kvh if stride is None else stride
    return [(h0, min(h0 + stride, kvh)) for h0 in range(0, kvh, stride)]


# ----------------------------------------------------------------------------- ring passes
def _ring_forward(spec, q, k, v):
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc = q.to(cdt)
    acc_o = torch.zeros(q.shape, dtype=cdt, device=q.device)
    acc_lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=cdt, device=q.device)
    if q.shape[0] == 0:  # empty stream: every rank knows it from the plan, nothing to send
        return acc_o, acc_lse
    g = q.shape[1] // k.shape[1]
    if spec.comm == "p2p" or spec.world == 1:
        kv = torch.stack([k, v]).contiguous()  # (2, L, KVH, D): one message per hop
        for step in range(spec.world):
            if step < spec.world - 1:
                reqs, nxt = _exchange(spec, kv)
            src = (spec.rank - step) % spec.world
            _forward_block(spec, qc, kv[0], kv[1], spec.pairs(src), acc_o, acc_lse)
            if step < spec.world - 1:
                _wait(reqs)
                kv = nxt
        return acc_o, acc_lse
    groups = _head_groups(k.shape[1], spec.stride)
    pending = _allgather(spec, torch.stack([k[:, : groups[0][1]], v[:, : groups[0][1]]]))
    for i, (h0, h1) in enumerate(groups):
        work, kv = pending
        work.wait()
        if i + 1 < len(groups):
            n0, n1 = groups[i + 1]
            pending = _allgather(spec, torch.stack([k[:, n0:n1], v[:, n0:n1]]))
        hq = slice(h0 * g, h1 * g)
        for src in range(spec.world):
            _forward_block(
                spec, qc[:, hq], kv[src, 0], kv[src, 1], spec.pairs(src), acc_o[:, hq], acc_lse[hq]
            )
    return acc_o, acc_lse


def _ring_backward(spec, q, k, v, out, lse, dout):
    cdt = lse.dtype
    qc, do, outc = q.to(cdt), dout.to(cdt), out.to(cdt)
    delta = (do * outc).sum(-1).T.contiguous()  # (H, L)
    dq = torch.zeros(q.shape, dtype=cdt, device=q.device)
    g = q.shape[1] // k.shape[1]
    if q.shape[0] == 0:
        return dq, torch.zeros_like(k, dtype=cdt), torch.zeros_like(v, dtype=cdt)
    if spec.comm == "p2p" or spec.world == 1:
        kv = torch.stack([k, v]).contiguous()
        d_reqs, d_in = None, None
        for step in range(spec.world):
            if step < spec.world - 1:
                kv_reqs, kv_next = _exchange(spec, kv)
            src = (spec.rank - step) % spec.world
            dkv = torch.zeros(kv.shape, dtype=cdt, device=q.device)
            _backward_block(
                spec, qc, kv[0], kv[1], outc, do, lse, delta, spec.pairs(src), dq, dkv[0], dkv[1]
            )
            if d_reqs is not None:  # dK/dV of this block from the ranks that saw it before
                _wait(d_reqs)
                dkv += d_in
            if spec.world > 1:  # one hop behind K/V; the last hop lands on the owner
                d_reqs, d_in = _exchange(spec, dkv)
            if step < spec.world - 1:
                _wait(kv_reqs)
                kv = kv_next
        if d_reqs is not None:
            _wait(d_reqs)
            dkv = d_in
        return dq, dkv[0], dkv[1]
    dk = torch.zeros(k.shape, dtype=cdt, device=k.device)
    dv = torch.zeros(v.shape, dtype=cdt, device=v.device)
    groups = _head_groups(k.shape[1], spec.stride)
    pending = _allgather(spec, torch.stack([k[:, : groups[0][1]], v[:, : groups[0][1]]]))
    for i, (h0, h1) in enumerate(groups):
        work, kv = pending
        work.wait()
        if i + 1 < len(groups):
            n0, n1 = groups[i + 1]
            pending = _allgather(spec, torch.stack([k[:, n0:n1], v[:, n0:n1]]))
        hq = slice(h0 * g, h1 * g)
        dkv = torch.zeros(kv.shape, dtype=cdt, device=k.device)  # (W, 2, L, hs, D)
        for src in range(spec.world):
            _backward_block(
                spec,
                qc[:, hq],
                kv[src, 0],
                kv[src, 1],
                outc[:, hq],
                do[:, hq],
                lse[hq],
                delta[hq],
                spec.pairs(src),
                dq[:, hq],
                dkv[src, 0],
                dkv[src, 1],
            )
        mine = _reduce_scatter(spec, dkv)
        dk[:, h0:h1], dv[:, h0:h1] = mine[0], mine[1]
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec):
        out, lse = _ring_forward(spec, q, k, v)
        out = out.to(q.dtype)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, out, lse)
        lse32 = lse.float()
        ctx.mark_non_differentiable(lse32)
        return out, lse32

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.spec, q, k, v, out, lse, dout.contiguous())
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


# ----------------------------------------------------------------------------- validation
_REASONS = {
    1: "the plan was built for another world size than the group's",
    2: "a q/k/v shard does not have the plan's local length",
    3: "invalid q/k/v or options",
    4: "q/k/v/plan of the wrong type or dtype",
}


def _local_problem(q, k, v, plan, world, comm, window_size, softcap, kv_head_stride, tile):
    """Checks that need no communication: (code, message); 0 = fine, 4 = a TypeError."""
    if not isinstance(plan, RingPlan):
        return 4, f"plan must be a RingPlan, got {type(plan).__name__}"
    if plan.world_size != world:
        return 1, (
            f"plan was built for world_size={plan.world_size}, but the group has {world} ranks"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return 4, f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 3:
            return 3, f"{name} must be (local_tokens, heads, head_dim), got {tuple(t.shape)}"
        if t.dtype not in _DTYPES:
            return 4, f"{name} must be float32/float16/bfloat16/float64, got {t.dtype}"
        if t.shape[0] != plan.local_len:
            return 2, (
                f"{name} must hold the plan's local_len={plan.local_len} tokens, got "
                f"shape {tuple(t.shape)}"
            )
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return 4, f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if k.shape != v.shape or k.shape[2] != q.shape[2]:
        return (
            3,
            f"k, v must be (L, kv_heads, {q.shape[2]}), got {tuple(k.shape)}, {tuple(v.shape)}",
        )
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return 3, f"heads of q ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})"
    if len({q.device, k.device, v.device}) > 1:
        return 3, f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
    if comm not in COMMS:
        return 3, f"comm must be one of {COMMS}, got {comm!r}"
    if len(tuple(window_size)) != 2:
        return 3, f"window_size must be (left, right), got {window_size!r}"
    if softcap < 0:
        return 3, f"softcap must be >= 0, got {softcap}"
    if kv_head_stride is not None and not (isinstance(kv_head_stride, int) and kv_head_stride > 0):
        return 3, f"kv_head_stride must be a positive int or None, got {kv_head_stride!r}"
    if not isinstance(tile, int) or tile < 1:
        return 3, f"tile must be a positive int, got {tile!r}"
    return 0, ""


def _validate(
    q, k, v, plan, group, world, comm, window_size, softcap, kv_head_stride, tile, causal
):
    """Raise the same error on every rank of the group (one tiny all_gather), before any ring
    traffic, so a bad input on one rank cannot leave the others waiting."""
    code, msg = _local_problem(
        q, k, v, plan, world, comm, window_size, softcap, kv_head_stride, tile
    )
    if world == 1 or not dist.is_initialized():
        if code:
            raise (TypeError if code == 4 else ValueError)(msg)
        return
    facts = [code]
    if code == 0:
        facts += plan.fingerprint() + [
            q.shape[1],
            k.shape[1],
            q.shape[2],
            _DTYPES.index(q.dtype),
            int(causal),
            int(window_size[0]),
            int(window_size[1]),
            int(round(softcap * 1e6)),
            COMMS.index(comm),
            kv_head_stride or 0,
            tile,
        ]
    facts += [0] * (18 - len(facts))
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    mine = torch.tensor(facts, dtype=torch.int64, device=device)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    _all_gather(every, mine, group=group)
    every = every.view(world, -1).cpu().tolist()
    if code:
        raise (TypeError if code == 4 else ValueError)(
            f"ring_varlen_attention: {msg} (every rank of the group raises)"
        )
    bad = [r for r, f in enumerate(every) if f[0]]
    if bad:
        reasons = "; ".join(sorted({_REASONS[every[r][0]] for r in bad}))
        raise ValueError(
            f"ring_varlen_attention: bad input on group rank(s) {bad}: {reasons} "
            f"(see the error on those ranks; every rank raises so none waits)"
        )
    if any(f != every[0] for f in every):
        raise ValueError(
            "ring_varlen_attention: ranks disagree on the plan (world size, layout, "
            "cu_seqlens) or on heads/head_dim/dtype/options; every rank must call "
            "with the same plan and arguments"
        )


# ----------------------------------------------------------------------------- public API
def ring_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: RingPlan,
    *,
    group=None,
    causal: bool = True,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    comm: str = "p2p",
    kv_head_stride: int | None = None,
    tile: int = DEFAULT_TILE,
    validate: bool = True,
    return_lse: bool = False,
    fused: bool = True,
):
    """Attention of a packed stream split over a ring group; each rank passes its shard.

    The unsharded output (``plan.unshard`` of every rank's result) equals single-device
    ``varlen_attention(q, k, v, cu, cu, causal=..., ...)`` on the whole stream (self-attention:
    every document has as many queries as keys), and so do the gradients.

    Args:
        q: ``(plan.local_len, heads, head_dim)``, this rank's shard (``plan.shard(q_full, rank)``).
        k, v: ``(plan.local_len, kv_heads, head_dim)``; ``heads % kv_heads == 0`` (GQA: only the
            KV heads travel). Pad slots may hold anything: they neither attend nor are attended.
        plan: the ``RingPlan`` every rank of the group uses (checked across ranks).
        group: the ring's process group (None: the default group); its size must be
            ``plan.world_size``. Without an initialised process group, world size 1 runs locally.
        causal: causal mask on positions inside each document.
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        window_size: ``(left, right)`` sliding window; -1 means unbounded.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.
        comm: ``"p2p"`` (K/V around the ring, overlapped) or ``"allgather"`` (K/V gathered per
            group of ``kv_head_stride`` KV heads, dK/dV reduce-scattered).
        kv_head_stride: KV heads gathered at once in allgather mode (None: all). Smaller bounds the
            memory of the gathered K/V to ``world * local_len * stride * head_dim`` per tensor.
        tile: largest query/key tile of the block math (memory ``heads * tile^2`` in fp32).
        validate: check arguments and plan agreement across the group first (one all_gather of
            ~18 ints and a host sync); every rank raises the same error instead of hanging.
        return_lse: also return the lse ``(heads, local_len)`` fp32 (``-inf`` for pads).
        fused: on CPU, tiles that are all visible or the aligned causal diagonal (no softcap,
            not float64) use torch's fused flash kernel; False forces the explicit math.

    Returns:
        out ``(local_len, heads, head_dim)`` in q's dtype (pad rows 0), or ``(out, lse)``.
    """
    rank = dist.get_rank(group) if dist.is_initialized() else 0
    if rank < 0:
        raise ValueError("ring_varlen_attention: this process is not a member of the given group")
    group_size = dist.get_world_size(group) if dist.is_initialized() else 1
    if validate:
        _validate(
            q,
            k,
            v,
            plan,
            group,
            group_size,
            comm,
            window_size,
            softcap,
            kv_head_stride,
            tile,
            causal,
        )
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    window = (int(window_size[0]), int(window_size[1]))
    spec = _Spec(
        plan, group, rank, bool(causal), scale, window, float(softcap), comm, kv_head_stride, tile
    )
    spec.fused = (
        _flash_cpu is not None
        and _flash_cpu_backward is not None
        and fused
        and q.device.type == "cpu"
        and q.dtype != torch.float64
        and spec.softcap == 0
    )
    out, lse = _RingAttention.apply(q, k, v, spec)
    return (out, lse) if return_lse else out
