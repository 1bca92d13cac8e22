"""Ring attention over a packed (varlen) stream sharded by a ``RingPlan``.

Each rank holds ``local_len`` slots of q/k/v (``RingPlan.shard``). Its queries must meet the keys
of every rank; two ways to bring them:

``comm="p2p"``: the K/V shard (only the KV heads, GQA is never expanded) walks around the ring
with ``batch_isend_irecv``; the transfer of the next block overlaps the compute of the current one.
In backward the K/V walk again and the fp32 dK/dV accumulators follow one hop behind, ending on
their owner after ``world_size`` hops.

``comm="allgather"``: K/V are all-gathered ``kv_head_stride`` KV heads at a time (the next group
prefetched while the current one is computed); dK/dV are reduce-scattered.

Block math (local queries vs one rank's keys): on CUDA (``triton``), one launch of the Triton
varlen kernels per block, each (query run, key run) of a document a "sequence" whose queries sit
at an explicit key offset (``blocks.segment_pairs``), outputs in fp32; elsewhere exact
flash-style attention in fp32 (float64 for float64 inputs) over tiles of at most ``tile`` x
``tile`` tokens of the same document. Visibility
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

from rlhf_kernels.ops._once import once_differentiable_grads
from rlhf_kernels.ops.varlen_attention import fold_lse_grad, window_side
from rlhf_kernels.ring.blocks import (
    backward_block,
    backward_block_triton,
    flash_cpu,
    flash_cpu_backward,
    forward_block,
    forward_block_triton,
    segment_pairs,
    tile_pairs,
)
from rlhf_kernels.ring.plan import RingPlan
from rlhf_kernels.ring.validate import (
    all_gather_flat,
    global_rank,
    group_rank,
    validate_ring_call,
)

DEFAULT_TILE = 1024
# torch >= 2.13 name; older releases call it reduce_scatter_tensor (same semantics, flat dim 0)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _Spec:
    """Per-call constants shared by forward and backward."""

    def __init__(self, plan, group, rank, causal, scale, window, softcap, comm, stride, tile):
        self.plan, self.group, self.rank, self.world = plan, group, rank, plan.world_size
        self.causal, self.scale, self.softcap = causal, scale, softcap
        self.left, self.right = window[0], (0 if causal else window[1])
        self.window, self.comm, self.stride, self.tile = window, comm, stride, tile
        self.fused = False  # set per call: fused CPU kernel for all-visible / diagonal tiles
        self.triton = False  # set per call: each block is one Triton varlen launch (CUDA)
        if self.world > 1:  # P2P peers are global ranks
            self.next_peer = global_rank(group, (rank + 1) % self.world)
            self.prev_peer = global_rank(group, (rank - 1) % self.world)

    def pairs(self, src, device=None):
        if self.triton:
            return segment_pairs(self.plan, self.rank, src, self.left, self.right, device)
        return tile_pairs(self.plan, self.rank, src, self.causal, self.window, self.tile)

    def forward_block(self, q, k, v, src, acc_o, acc_lse):
        fn = forward_block_triton if self.triton else forward_block
        fn(self, q, k, v, self.pairs(src, q.device), acc_o, acc_lse)

    def backward_block(self, q, k, v, out, do, lse, delta, src, dq, dk, dv):
        if self.triton:  # out is only needed through delta
            pairs = self.pairs(src, q.device)
            backward_block_triton(self, q, k, v, do, lse, delta, pairs, dq, dk, dv)
        else:
            backward_block(self, q, k, v, out, do, lse, delta, self.pairs(src), dq, dk, dv)


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
    work = all_gather_flat(out, x.contiguous(), group=spec.group, async_op=True)
    return work, out.view(spec.world, *x.shape)


def _reduce_scatter(spec, full):
    """Sum ``full`` ``(world, *shape)`` over ranks; return this rank's slice ``shape``."""
    out = torch.empty(full.shape[1:], dtype=full.dtype, device=full.device)
    try:
        _reduce_scatter_flat(out, full.reshape(-1, *full.shape[2:]), group=spec.group)
    except (RuntimeError, NotImplementedError) as e:  # backends without it (older gloo)
        if not isinstance(e, NotImplementedError) and "support" not in str(e).lower():
            raise  # a real failure (timeout, lost peer): no different collective on one rank
        dist.all_reduce(full, group=spec.group)
        out.copy_(full[spec.rank])
    return out


def _head_groups(kvh, stride):
    stride = kvh if stride is None else stride
    return [(h0, min(h0 + stride, kvh)) for h0 in range(0, kvh, stride)]


# ----------------------------------------------------------------------------- ring passes
def _ring_forward(spec, q, k, v):
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc = q if spec.triton else q.to(cdt)  # the Triton kernels take the input dtype
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
            spec.forward_block(qc, kv[0], kv[1], src, acc_o, acc_lse)
            if step < spec.world - 1:
                _wait(reqs)
                kv = nxt
        return acc_o, acc_lse
    for h0, h1, kv in _gathered_head_groups(spec, k, v):
        hq = slice(h0 * g, h1 * g)
        for src in range(spec.world):
            spec.forward_block(qc[:, hq], kv[src, 0], kv[src, 1], src, acc_o[:, hq], acc_lse[hq])
        del kv  # else it lives on beside the next group and the one prefetched after it
    return acc_o, acc_lse


def _gathered_head_groups(spec, k, v):
    """Yield ``(h0, h1, kv)`` per group of KV heads, kv ``(W, 2, L, h1 - h0, D)`` from every rank;
    the next group's all_gather is in flight while the caller computes on the current one (the
    caller drops ``kv`` before the next step, so two groups are alive at most)."""
    groups = _head_groups(k.shape[1], spec.stride)
    pending = _allgather(spec, torch.stack([k[:, : groups[0][1]], v[:, : groups[0][1]]]))
    for i, (h0, h1) in enumerate(groups):
        work, kv = pending
        work.wait()
        if i + 1 < len(groups):
            n0, n1 = groups[i + 1]
            pending = _allgather(spec, torch.stack([k[:, n0:n1], v[:, n0:n1]]))
        yield h0, h1, kv


def _ring_backward(spec, q, k, v, out, lse, dout, dlse=None):
    cdt = lse.dtype
    do, outc = dout.to(cdt), out.to(cdt)
    delta = fold_lse_grad((do * outc).sum(-1).T, dlse, lse).contiguous()  # (H, L)
    if dlse is not None:  # the fused CPU tile kernel makes its own delta: explicit tiles
        spec.fused = False
    qc, do = (q, dout) if spec.triton else (q.to(cdt), do)  # Triton: the input dtype
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
            spec.backward_block(qc, kv[0], kv[1], outc, do, lse, delta, src, dq, dkv[0], dkv[1])
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
    for h0, h1, kv in _gathered_head_groups(spec, k, v):
        hq = slice(h0 * g, h1 * g)
        dkv = torch.zeros(kv.shape, dtype=cdt, device=k.device)  # (W, 2, L, hs, D)
        for src in range(spec.world):
            spec.backward_block(
                qc[:, hq],
                kv[src, 0],
                kv[src, 1],
                outc[:, hq],
                do[:, hq],
                lse[hq],
                delta[hq],
                src,
                dq[:, hq],
                dkv[src, 0],
                dkv[src, 1],
            )
        del kv  # as in the forward: two gathered groups alive at most
        mine = _reduce_scatter(spec, dkv)
        dk[:, h0:h1], dv[:, h0:h1] = mine[0], mine[1]
        del dkv, mine
    return dq, dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, spec):
        out, lse = _ring_forward(spec, q, k, v)
        out = out.to(q.dtype)
        ctx.spec = spec
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.set_materialize_grads(False)  # an unused lse costs nothing in the backward
        return out, lse  # fp32, float64 for float64 inputs (as varlen_attention's)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout.contiguous()
        with torch.no_grad():  # (create_graph=True: no partial graph through the ring's blocks)
            dq, dk, dv = _ring_backward(ctx.spec, q, k, v, out, lse, dout, dlse)
        grads = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        grads = once_differentiable_grads("ring_varlen_attention", grads, (q, k, v, dout, dlse))
        return *grads, None


def _use_triton(q: torch.Tensor, asked: bool | None) -> bool:
    import os

    env = os.environ.get("RLHF_KERNELS_RING_TRITON")
    if asked is None and env in ("0", "1"):
        asked = env == "1"
    ok = q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    try:
        import triton  # noqa: F401
    except ImportError:
        ok = False
    if asked:
        if ok and not q.is_cuda:
            from rlhf_kernels.ops.varlen_attention_triton import _interpreting

            ok = _interpreting()
        if not ok:
            raise ValueError(
                f"ring_varlen_attention(triton=True) needs the triton package, fp32/fp16/bf16 "
                f"inputs and CUDA tensors (or TRITON_INTERPRET=1), got {q.dtype} on {q.device}"
            )
        return True
    return bool(asked is None and ok and q.is_cuda)


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
    triton: bool | None = None,
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
            gathered K/V to two groups (the current one and the prefetched next) of
            ``world * local_len * stride * head_dim`` per tensor, and in backward one fp32 dK/dV
            accumulator of one group.
        tile: largest query/key tile of the block math (memory ``heads * tile^2`` in fp32).
        validate: check arguments and plan agreement across the group first (one all_gather of
            32 ints and a host sync); every rank raises the same error instead of hanging. Done
            once per plan, group, shapes and options: later calls with the same plan (the other
            layers, the next micro-batches) reuse the verdict cached on the plan.
        return_lse: also return the lse ``(heads, local_len)`` fp32, float64 for float64 inputs
            (``-inf`` for pads).
        fused: on CPU, tiles that are all visible or the aligned causal diagonal (no softcap,
            not float64) use torch's fused flash kernel; False forces the explicit math.
        triton: each block (local queries x one rank's keys) is one launch of the Triton varlen
            kernels, every (query run, key run) of a document a "sequence" with its own
            position offset; partial results merged in fp32. None (default): on CUDA for
            fp32/fp16/bf16 when Triton is installed (``RLHF_KERNELS_RING_TRITON=0`` turns it
            off, ``=1`` forces it, e.g. on CPU under ``TRITON_INTERPRET=1``).

    Returns:
        out ``(local_len, heads, head_dim)`` in q's dtype (pad rows 0), or ``(out, lse)``;
        differentiable in q, k, v through both.
    """
    softcap = 0.0 if softcap is None else softcap  # None: off, as in varlen_attention
    try:
        rank, group_size = group_rank(group)
    except ValueError as e:
        raise ValueError(f"ring_varlen_attention: {e}") from None
    if validate:
        validate_ring_call(
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
            softmax_scale,
        )
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    window = tuple(window_side(int(w)) for w in window_size)
    spec = _Spec(
        plan, group, rank, bool(causal), scale, window, float(softcap), comm, kv_head_stride, tile
    )
    spec.fused = (
        flash_cpu is not None
        and flash_cpu_backward is not None
        and fused
        and q.device.type == "cpu"
        and q.dtype != torch.float64
        and spec.softcap == 0
    )
    spec.triton = _use_triton(q, triton)
    out, lse = _RingAttention.apply(q, k, v, spec)
    return (out, lse) if return_lse else out
