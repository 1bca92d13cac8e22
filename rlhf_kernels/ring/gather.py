"""Per-token results of a ring group: gather to full sequences, reduce token means.

Model outputs stay sharded (``(local_len, ...)`` per rank, ``RingPlan`` order). Only what needs the
whole sequence (GAE over a response, logging) is gathered; losses never need a gather: each rank
divides its local sum by the ring-wide token count, so the local losses add up to the global mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf_kernels.ring.plan import RingPlan

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _group_rank(plan: RingPlan, group) -> int:
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    if dist.get_world_size(group) != plan.world_size:
        raise ValueError(
            f"plan was built for world_size={plan.world_size}, but the group has "
            f"{dist.get_world_size(group)} ranks"
        )
    return rank


def gather_from_ring(
    local: torch.Tensor, plan: RingPlan, group=None, dst: int | None = None
) -> torch.Tensor | None:
    """Reassemble the packed stream from every rank's shard (not differentiable).

    Args:
        local: ``(plan.local_len, ...)``, this rank's per-token values (log-probs, values, ...).
        plan: the group's ``RingPlan``.
        group: the ring's process group (None: default group).
        dst: group rank that receives the result; None gives it to every rank.

    Returns: ``(plan.total, ...)`` in packed order (pads dropped) on the receiving ranks, None on
    the others. Split per document with ``plan.cu_seqlens``.
    """
    rank = _group_rank(plan, group)
    if not isinstance(local, torch.Tensor) or local.dim() < 1 or local.shape[0] != plan.local_len:
        shape = tuple(local.shape) if isinstance(local, torch.Tensor) else type(local).__name__
        raise ValueError(
            f"local must have the plan's local_len={plan.local_len} as first dim, got {shape}"
        )
    local = local.detach().contiguous()
    if dst is None:
        flat = torch.empty(
            (plan.world_size * plan.local_len, *local.shape[1:]),
            dtype=local.dtype,
            device=local.device,
        )
        _all_gather(flat, local, group=group)
        return plan.unshard(flat.split(plan.local_len))
    if not 0 <= dst < plan.world_size:
        raise ValueError(f"dst must be a group rank in [0, {plan.world_size}), got {dst}")
    shards = [torch.empty_like(local) for _ in range(plan.world_size)] if rank == dst else None
    global_dst = dst if group is None else dist.get_global_rank(group, dst)
    dist.gather(local, shards, dst=global_dst, group=group)
    return plan.unshard(shards) if rank == dst else None


def ring_token_mean(values: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's share of the mean of ``values`` over the masked tokens of the whole ring.

    Returns ``sum(values * mask) / N`` where ``N`` is the masked-token count summed over the
    group (one all_reduce of a scalar). The shares of all ranks add up to the global token mean,
    and so do their gradients (an all-reduce-sum of parameter gradients over the ring gives the
    gradient of the global mean). Ranks with no masked token return 0 (still differentiable).

    Args:
        values: ``(local_len, ...)`` per-token values (e.g. per-token losses), any float dtype.
        mask: same shape (or broadcastable), bool/float; 0 for pads and ignored tokens.
        group: the ring's process group (None: default group).
    """
    if not isinstance(values, torch.Tensor) or not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"values and mask must be tensors, got {type(values).__name__} and "
            f"{type(mask).__name__}"
        )
    # count in float64 and sum in fp32: an fp16 count overflows at 65k tokens, bf16 rounds at 257
    count = torch.broadcast_to(mask, values.shape).detach().sum(dtype=torch.float64)
    dist.all_reduce(count, group=group)
    acc = torch.promote_types(values.dtype, torch.float32)
    total = (values.to(acc) * mask.to(acc)).sum()
    return (total / count.clamp(min=1).to(acc)).to(values.dtype)
