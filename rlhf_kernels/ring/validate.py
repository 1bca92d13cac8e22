"""Argument checks of ring attention that raise the same error on every rank of the group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf_kernels.ring.plan import RingPlan

COMMS = ("p2p", "allgather")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# torch >= 2.13 name; older releases call it all_gather_into_tensor (same semantics, flat dim 0)
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

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
        if t.dtype not in DTYPES:
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


def validate_ring_call(
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
            DTYPES.index(q.dtype),
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
    all_gather_flat(every, mine, group=group)
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
