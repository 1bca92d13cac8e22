"""Per-token results of a ring group: gather to full sequences, reduce token means.

Model outputs stay sharded (``(local_len, ...)`` per rank, ``RingPlan`` order). Only what needs the
whole sequence (GAE over a response, logging) is gathered; losses never need a gather: each rank
divides its local sum by the ring-wide token count, so the local losses add up to the global mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlhf_kernels._checks import check_mask
from rlhf_kernels.ring.plan import RingPlan
from rlhf_kernels.ring.validate import (
    all_gather_flat,
    check_on_every_rank,
    dtype_code,
    global_rank,
    group_rank,
)

_REASONS = {
    1: "the plan was built for another world size than the group's",
    2: "a local tensor does not have the plan's local length",
    3: "invalid dst",
    4: "a local tensor or plan of the wrong type",
}


def _check_gather(local, plan, group, dst) -> int:
    """This rank's group rank; raises on every rank if any rank passed bad arguments."""
    rank, world = group_rank(group)
    code, msg = 0, ""
    if not isinstance(plan, RingPlan):
        code, msg = 4, f"plan must be a RingPlan, got {type(plan).__name__}"
    elif not isinstance(local, torch.Tensor):
        code, msg = 4, f"local must be a torch.Tensor, got {type(local).__name__}"
    elif plan.world_size != world:
        code = 1
        msg = f"plan was built for world_size={plan.world_size}, but the group has {world} ranks"
    elif local.dim() < 1 or local.shape[0] != plan.local_len:
        code = 2
        msg = f"local must have the plan's local_len={plan.local_len} as first dim, got "
        msg += str(tuple(local.shape))
    elif dst is not None and (
        isinstance(dst, bool) or not isinstance(dst, int) or not 0 <= dst < world
    ):
        code, msg = 3, f"dst must be a group rank in [0, {world}), got {dst!r}"
    facts = []
    if code == 0:  # the shards must agree on everything but their values
        trailing = list(local.shape[1:])[:8]
        facts = plan.fingerprint() + [
            dtype_code(local.dtype),
            local.dim(),
            -1 if dst is None else dst,
        ]
        facts += trailing + [0] * (8 - len(trailing))
    device = local.device if isinstance(local, torch.Tensor) else torch.device("cpu")
    check_on_every_rank(
        "gather_from_ring",
        code,
        msg,
        facts,
        group,
        world,
        device,
        _REASONS,
        disagree="ranks disagree on the plan, dst, or the dtype/shape of local (beyond its "
        "first dim); every rank must pass the same plan and alike tensors",
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

    Bad arguments on any rank (wrong ``local`` length, plan for another world size, bad ``dst``,
    ranks that disagree on plan or trailing shape/dtype) raise on every rank of the group (one
    tiny all_gather first), so no rank is left waiting in the gather.

    Returns: ``(plan.total, ...)`` in packed order (pads dropped) on the receiving ranks, None on
    the others. Split per document with ``plan.cu_seqlens``.
    """
    rank = _check_gather(local, plan, group, dst)
    # a conjugate (or negative) view's bytes are not its values: gloo's complex path refused it
    local = local.detach().resolve_conj().resolve_neg().contiguous()
    if plan.world_size == 1:  # a ring of one (no process group needed, as for the attention)
        return plan.unshard([local])
    if dst is None:
        flat = torch.empty(
            (plan.world_size * plan.local_len, *local.shape[1:]),
            dtype=local.dtype,
            device=local.device,
        )
        all_gather_flat(flat, local, group=group)
        n = plan.local_len  # split(0) would give one chunk, not world_size
        return plan.unshard([flat.narrow(0, r * n, n) for r in range(plan.world_size)])
    wire = torch.view_as_real(local) if local.is_complex() else local  # gloo: no complex
    shards = [torch.empty_like(wire) for _ in range(plan.world_size)] if rank == dst else None
    dist.gather(wire, shards, dst=global_rank(group, dst), group=group)
    if rank != dst:
        return None
    if local.is_complex():
        shards = [torch.view_as_complex(t) for t in shards]
    return plan.unshard(shards)


def ring_token_mean(values: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """This rank's share of the mean of ``values`` over the masked tokens of the whole ring.

    Returns ``sum(values * mask) / N`` where ``N`` is the masked-token count summed over the
    group (one all_reduce of a scalar). The shares of all ranks add up to the global token mean,
    and so do their gradients (an all-reduce-sum of parameter gradients over the ring gives the
    gradient of the global mean). Ranks with no masked token return 0 (still differentiable).

    Args:
        values: ``(local_len, ...)`` per-token values (e.g. per-token losses), any float dtype.
        mask: same shape (or broadcastable), bool/float; 0 for pads and ignored tokens (their
            values may be anything, NaN or inf included).
        group: the ring's process group (None: default group).

    A bad ``values`` or ``mask`` on any rank raises on every rank (the flag rides on the same
    all_reduce as the count, at the cost of one host read of it).
    """
    # a bad input on one rank must not leave the others in the all_reduce: the count's
    # all_reduce also carries how many ranks failed their local checks
    error = None
    try:
        if not isinstance(values, torch.Tensor) or not isinstance(mask, torch.Tensor):
            raise TypeError(
                f"values and mask must be tensors, got {type(values).__name__} and "
                f"{type(mask).__name__}"
            )
        if not values.is_floating_point():  # an int or bool mean would be truncated silently
            raise TypeError(f"values must be a floating tensor, got {values.dtype}")
        try:
            fits = torch.broadcast_shapes(mask.shape, values.shape) == values.shape
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to values' shape "
                f"{tuple(values.shape)}"
            )
        mask = check_mask(mask)
        # count in float64 and sum in fp32: an fp16 count overflows at 65k tokens, bf16 rounds
        # at 257
        count = torch.broadcast_to(mask, values.shape).detach().sum(dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError) as exc:
        error = exc
    if error is None:
        both = torch.stack([count, torch.zeros_like(count)])  # [count, failed ranks]
    else:
        both = torch.tensor([0.0, 1.0], dtype=torch.float64, device=_device_of(values, mask))
    if group_rank(group)[1] > 1:  # a ring of one needs no process group
        dist.all_reduce(both, group=group)
    if error is not None:
        raise error
    if bool(both[1] > 0):  # one host read per call (the price of raising on every rank)
        raise ValueError(
            f"ring_token_mean: {int(both[1])} other rank(s) of the group passed invalid values "
            "or mask (their own error says which); every rank raises"
        )
    count = both[0]
    acc = torch.promote_types(values.dtype, torch.float32)
    total = torch.where(mask != 0, values.to(acc), 0).sum()  # NaN * 0 would be NaN
    return (total / count.clamp(min=1).to(acc)).to(values.dtype)


def _device_of(*xs) -> torch.device:
    for x in xs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")
