"""Process groups of a trainer: data-parallel x ring (sequence-parallel) x tensor-parallel.

Global rank ``r = (dp_rank * ring + ring_rank) * tp + tp_rank``: tensor-parallel groups are
consecutive ranks (DeepSpeed AutoTP's ``(data_parallel, tensor_parallel)`` mesh), ring groups
stride by ``tp``. DeepSpeed's data-parallel group (same ``tp_rank``) therefore holds
``dp * ring`` ranks: ring ranks hold the same weights and their gradients are summed like any
data-parallel gradient. Every rank of a ring group and of a TP group gets the same micro-batches.

Launch with ``torchrun``; a plain ``python -m trainers.sft`` is a world of one (gloo on CPU,
NCCL on CUDA).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Layout:
    world: int
    rank: int
    dp: int
    ring: int
    tp: int
    device: torch.device
    ring_group: Any = None  # this rank's ring group (None when ring == 1)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def ring_rank(self) -> int:
        return (self.rank // self.tp) % self.ring

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp * self.ring)

    @property
    def ds_dp_size(self) -> int:
        """Ranks DeepSpeed averages gradients over (data-parallel x ring)."""
        return self.dp * self.ring

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def check_sizes(world: int, ring: int, tp: int) -> None:
    """Raise ValueError unless ``ring * tp`` divides the world size."""
    if world % (ring * tp):
        raise ValueError(
            f"--ring-attn-size ({ring}) x --tp-size ({tp}) = {ring * tp} must divide the number "
            f"of processes ({world})"
        )


def init_distributed(ring: int, tp: int, timeout_s: int = 600) -> Layout:
    """Join (or create) the default process group and build the ring groups.

    Without torchrun's environment this is a world of one on an in-process store (no port to
    race other processes for; the env variables are still set for DeepSpeed). Sizes are
    checked before the group exists, so a bad ``--ring-attn-size`` fails within seconds.
    """
    alone = "RANK" not in os.environ
    if alone:
        from rlhf_kernels.ring.spawn import free_port

        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    world = int(os.environ["WORLD_SIZE"])
    check_sizes(world, ring, tp)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        # a world of one: a TCP store on a port picked earlier could be taken meanwhile
        alone_kw = dict(store=dist.HashStore(), rank=0, world_size=1) if alone else {}
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **alone_kw)
        if not _OWNED:
            atexit.register(_destroy_groups)
        # a weak reference: a destroyed group object kept alive into interpreter finalization
        # aborts there too (5 ranks: 12 of 12 runs)
        world_group = dist.group.WORLD
        _OWNED[:] = [weakref.ref(world_group) if world_group is not None else lambda: None]
    _FINISHED[0] = False
    rank = dist.get_rank()
    layout = Layout(world, rank, world // (ring * tp), ring, tp, device)
    if ring > 1:  # every rank creates every group, in the same order
        for dp_rank in range(layout.dp):
            for tp_rank in range(tp):
                ranks = [(dp_rank * ring + i) * tp + tp_rank for i in range(ring)]
                group = dist.new_group(ranks)
                if rank in ranks:
                    layout.ring_group = group
    return layout


_OWNED: list = []  # [weakref of the default process group init_distributed created last]
_FINISHED = [False]  # whether the last run of this process finished (Session.finish)


def destroy_at_exit() -> None:
    """At interpreter exit, destroy the process groups ``init_distributed`` created (called
    by ``Session.finish``: a successful run).

    A process that exits with gloo groups alive can abort in interpreter finalization (their
    worker threads still hold work objects: "terminate called without an active exception",
    SIGABRT), so a run that trained and saved everything would exit non-zero. Reproduced
    without any trainer: 3 gloo processes that all-gather and exit abort about half the time on
    torch 2.13; with ``destroy_process_group`` never (tests/test_distributed_edges_audit.py).
    At exit, not now: a second run in the same process joins the live group, whose clones
    DeepSpeed caches (destroyed, they fail its next ``initialize``). A group the caller created
    before the trainer ran is left alone; a failed run is left as it was."""
    _FINISHED[0] = True


def _destroy_groups() -> None:  # registered with atexit by init_distributed
    ours = _OWNED and dist.is_initialized() and dist.group.WORLD is _OWNED[0]()
    if _FINISHED[0] and ours:
        gc.collect()  # unreferenced work handles (in cycles) die while their group is alive
        dist.destroy_process_group()
        gc.collect()  # and the group objects themselves, before finalization


def all_ranks_ok(ok: bool, message: str, layout: Layout | None) -> None:
    """Collective check: if any rank is not ok, every rank raises with the first bad rank's
    message (so a bad input never leaves the other ranks waiting in a collective)."""
    if layout is None or layout.world == 1:
        if not ok:
            raise ValueError(message)
        return
    msgs: list = [None] * layout.world
    dist.all_gather_object(msgs, None if ok else message)
    bad = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if bad:
        r, m = bad[0]
        raise ValueError(f"{m} (on rank {r})")


def sum_across(values: list[float], layout: Layout, group=None) -> list[float]:
    """All-reduce a few Python floats (float64) over ``group`` (default: the world)."""
    t = torch.tensor(values, dtype=torch.float64, device=layout.device)
    if layout.world > 1:
        dist.all_reduce(t, group=group)
    return t.tolist()


def max_across(value: int, layout: Layout) -> int:
    """The largest ``value`` over all ranks (how many forwards every rank must run when ZeRO-3
    gathers weights in each one)."""
    if layout.world == 1:
        return value
    t = torch.tensor([value], device=layout.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t)


def peak_memory_mb(layout: Layout) -> float:
    """Peak memory of the busiest rank, MiB: CUDA allocator peak, else the process's peak RSS."""
    if layout.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(layout.device) / 2**20
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    t = torch.tensor([peak], dtype=torch.float64, device=layout.device)
    if layout.world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()
