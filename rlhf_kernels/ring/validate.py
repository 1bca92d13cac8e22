"""Argument checks of the ring that raise on every rank of the group, and group-rank helpers.

A bad argument on one rank must not leave the others blocked in a collective: each rank checks
what it can locally, then one tiny all_gather of ``(problem code, facts...)`` tells every rank
whether any rank failed (and whether all ranks agree on the facts), and all of them raise.
"""

from __future__ import annotations

import operator
import struct
import zlib

import torch
import torch.distributed as dist

from rlhf_kernels.ops.varlen_attention import scalar_problem, window_side
from rlhf_kernels.ring.plan import RingPlan

COMMS = ("p2p", "allgather")
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
# torch >= 2.13 name; older releases call it all_gather_into_tensor (same semantics, flat dim 0)
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def group_rank(group) -> tuple[int, int]:
    """``(rank in group, group size)``; ``(0, 1)`` without an initialised process group.

    Raises ValueError when this process is not a member of ``group``."""
    if not dist.is_initialized():
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this process is not a member of the given group")
    return rank, dist.get_world_size(group)


def global_rank(group, rank: int) -> int:
    """Global rank of group rank ``rank`` (what P2P ops and ``dst`` arguments take)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def dtype_code(dtype: torch.dtype) -> int:
    """A small int naming ``dtype`` (the same on every process)."""
    return zlib.crc32(str(dtype).encode()) & 0x7FFFFFFF


def check_on_every_rank(
    what: str, code: int, msg: str, facts, group, world: int, device, reasons: dict, disagree: str
) -> None:
    """Raise the same kind of error on every rank if any rank has a local problem.

    Args:
        what: the caller's name, prefixed to messages.
        code: 0 = fine, 4 = TypeError, any other key of ``reasons`` = ValueError.
        msg: this rank's own message (used when ``code`` != 0).
        facts: ints every rank must agree on (only read when ``code`` == 0), at most 31.
        group, world: the process group and its size (world 1 or no process group: local raise).
        device: where the tiny all_gather runs (cuda for NCCL).
        reasons: ``{code: text}`` naming each problem for the ranks that did not see it.
        disagree: the ValueError message (after ``what: ``) when the ranks' facts differ.
    """
    if code and (world == 1 or not dist.is_initialized()):
        raise (TypeError if code == 4 else ValueError)(f"{what}: {msg}")
    facts = [code] + (list(facts) if code == 0 else [])
    if world == 1 or not dist.is_initialized():
        return
    facts += [0] * (32 - len(facts))
    mine = torch.tensor(facts, dtype=torch.int64, device=device)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    all_gather_flat(every, mine, group=group)
    every = every.view(world, -1).cpu().tolist()
    if code:
        raise (TypeError if code == 4 else ValueError)(
            f"{what}: {msg} (every rank of the group raises)"
        )
    bad = [r for r, f in enumerate(every) if f[0]]
    if bad:
        why = "; ".join(sorted({reasons.get(every[r][0], "invalid input") for r in bad}))
        raise ValueError(
            f"{what}: bad input on group rank(s) {bad}: {why} "
            f"(see the error on those ranks; every rank raises so none waits)"
        )
    if any(f != every[0] for f in every):
        raise ValueError(f"{what}: {disagree}")


_REASONS = {
    1: "the plan was built for another world size than the group's",
    2: "a q/k/v shard does not have the plan's local length",
    3: "invalid q/k/v or options",
    4: "q/k/v/plan/options of the wrong type or dtype",
}


def _bits(x: float) -> int:
    """A float as the int64 of its bits: an exact fingerprint of any finite value."""
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _local_problem(
    q, k, v, plan, world, comm, window_size, softcap, kv_head_stride, tile, causal,
    softmax_scale=None,
):  # fmt: skip
    """Checks that need no communication: (code, message); 0 = fine, 4 = a TypeError. Every
    option's type is checked here, so building the facts afterwards cannot raise on one rank."""
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
    if q.shape[1] == 0 or q.shape[2] == 0:
        return 3, f"q must have at least one head and head_dim >= 1, got shape {tuple(q.shape)}"
    if len({q.device, k.device, v.device}) > 1:
        return 3, f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}"
    if comm not in COMMS:
        return 3, f"comm must be one of {COMMS}, got {comm!r}"
    try:
        if any(isinstance(w, bool) for w in window_size):  # as varlen_attention: True is not 1
            raise TypeError
        window = [operator.index(w) for w in window_size]
    except TypeError:
        return 4, f"window_size must be (left, right) ints, got {window_size!r}"
    if len(window) != 2:
        return 3, f"window_size must be (left, right), got {window_size!r}"
    problem = scalar_problem(softmax_scale, causal, softcap, q.dtype)
    if problem:
        return (4 if problem.startswith("causal") else 3), problem
    if kv_head_stride is not None and not (isinstance(kv_head_stride, int) and kv_head_stride > 0):
        return 3, f"kv_head_stride must be a positive int or None, got {kv_head_stride!r}"
    if not isinstance(tile, int) or tile < 1:
        return 3, f"tile must be a positive int, got {tile!r}"
    sizes = [kv_head_stride or 0, tile, *(w for w in window if w < 2**31)]  # (int64 facts)
    if any(abs(x) >= 2**62 for x in sizes):
        return 3, (
            f"kv_head_stride, tile and window sides must be below 2**62 (a window side >= 2**31 "
            f"is unbounded), got {kv_head_stride!r}, {tile!r}, {window_size!r}"
        )
    return 0, ""


def validate_ring_call(
    q, k, v, plan, group, world, comm, window_size, softcap, kv_head_stride, tile, causal,
    softmax_scale=None,
):  # fmt: skip
    """Raise the same error on every rank of the group (one tiny all_gather), before any ring
    traffic, so a bad input on one rank cannot leave the others waiting.

    A call that passed is remembered on the plan (keyed by group, shapes, dtypes, devices and
    options), so the next layers and micro-batches with the same plan skip the all_gather and its
    host sync.
    Ranks of a group hold the same plan and shapes, so they skip together. Limitation: once a
    plan has passed, a rank whose arguments alone change is not checked on the other ranks (they
    skip); it raises its local error at once rather than entering the check alone, and the
    others wait until the collective timeout. It does so only when a call with its options
    (causal, window, softcap, comm, stride, tile, scale) passed before: with new options (a
    model alternating sliding and full layers) the others check too, so it joins them. Plans are
    built per batch, so the first call of every batch keeps the every-rank guarantee as long as
    every rank builds a new plan for it: a rank that alone reuses an earlier batch's (checked)
    plan object with the same local length is not caught, and attends by the wrong plan.
    """
    key = None
    try:  # unhashable or malformed options: no key, the checks below name the problem
        tensors = tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype
        options = bool(causal), tuple(window_size), softcap, comm, kv_head_stride, tile
        devices = q.device, k.device, v.device
        key = ("validated", group, world, tensors + devices, options + (softmax_scale,))
        if key in plan._cache:
            return
    except (TypeError, AttributeError):
        key = None
    code, msg = _local_problem(
        q, k, v, plan, world, comm, window_size, softcap, kv_head_stride, tile, causal,
        softmax_scale,
    )  # fmt: skip
    same_options = (
        key is not None
        and any(  # passed before with other (this rank's bad) tensors
            type(c) is tuple and len(c) == 5 and c[:3] == key[:3] and c[4] == key[4]
            for c in plan._cache
        )
    )
    if code and same_options:
        # the other ranks passed these options with this plan and skip the check: do not wait
        raise (TypeError if code == 4 else ValueError)(
            f"ring_varlen_attention: {msg} (after earlier calls with this plan passed the "
            "group-wide check; other ranks are not told)"
        )
    facts = []
    if code == 0:
        facts = plan.fingerprint() + [
            q.shape[1],
            k.shape[1],
            q.shape[2],
            DTYPES.index(q.dtype),
            int(causal),
            *(window_side(int(w)) for w in window_size),  # (int64 facts)
            _bits(softcap),
            COMMS.index(comm),
            kv_head_stride or 0,
            tile,
            -1 if softmax_scale is None else _bits(softmax_scale),
        ]
    device = q.device if isinstance(q, torch.Tensor) else torch.device("cpu")
    check_on_every_rank(
        "ring_varlen_attention",
        code,
        msg,
        facts,
        group,
        world,
        device,
        _REASONS,
        disagree="ranks disagree on the plan (world size, layout, cu_seqlens) or on "
        "heads/head_dim/dtype/options; every rank must call with the same plan and arguments",
    )
    if key is not None:
        plan._cache[key] = True
