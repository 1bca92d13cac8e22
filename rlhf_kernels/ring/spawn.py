"""Run a function on ``world_size`` local processes joined in a gloo group (tests, benchmarks).

Every worker runs ``fn(rank, world_size, *args)`` after ``init_process_group("gloo")`` on a free
127.0.0.1 port; return values come back to the caller in rank order, and a worker's exception
comes back as its traceback (raised in the caller as ``RuntimeError``), so nothing is lost.
``gloo_rank0`` makes the calling process rank 0 instead (benchmarks that time rank 0 in-process).
For real jobs use ``torchrun`` (see the README); this helper is for one machine.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import queue
import socket
import time
import traceback
from multiprocessing.reduction import ForkingPickler

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_kernels._checks import is_real


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, results, args, threads, timeout_s):
    try:
        import torch

        torch.set_num_threads(threads)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        out = fn(rank, world_size, *args)
        ForkingPickler.dumps(out)  # here, or the queue's feeder thread drops it unpicklable
        results.put((rank, True, out))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _gone(rank: int, code: int) -> str:
    why = "killed by a signal" if code < 0 else "exited"
    return f"--- rank {rank} ---\n{why} (exit code {code}) without a result"


def _check(who: str, world_size, timeout_s, threads) -> None:
    """ValueError before anything starts (``world_size=0`` would run ``fn`` nowhere)."""
    for name, v in (("world_size", world_size), ("threads", threads)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{who}: {name}: expected an int >= 1, got {v!r}")
    if not is_real(timeout_s, finite=True, positive=True):
        raise ValueError(
            f"{who}: timeout_s: expected a finite number of seconds > 0, got {timeout_s!r}"
        )


def _collect(procs: dict, results, timeout_s: float) -> tuple[dict, list[str]]:
    """``{rank: value}`` from ``procs`` (``{rank: process}``) and the failures; stops at the first
    failure (the others may be blocked on it), a worker gone without a word, or ``timeout_s``."""
    got, errors = {}, []
    deadline = time.monotonic() + timeout_s
    while len(got) < len(procs) and not errors:
        try:  # short waits: a worker gone without a word (segfault, OOM) is seen at once
            rank, ok, value = results.get(timeout=min(1.0, timeout_s))
        except queue.Empty:
            gone = [r for r, p in procs.items() if r not in got and p.exitcode is not None]
            if gone and results.empty():  # an exited worker's result is in the pipe by now
                time.sleep(0.2)
                if results.empty():
                    errors += [_gone(r, procs[r].exitcode) for r in gone]
            elif time.monotonic() > deadline:
                errors.append(f"timed out after {timeout_s}s waiting for the workers")
            continue
        if ok:
            got[rank] = value
        else:
            errors.append(f"--- rank {rank} ---\n{value}")
    return got, errors


def _reap(procs, wait_s: float) -> None:
    """Join each process, waiting up to ``wait_s`` seconds; terminate one still running."""
    for p in procs:
        p.join(timeout=wait_s)
        if p.is_alive():
            p.terminate()
            p.join()


def run_gloo(fn, world_size: int, *args, timeout_s: float = 300.0, threads: int = 1) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes (gloo, CPU).

    Args:
        fn: a module-level (picklable) function.
        world_size: number of processes.
        args: picklable extra arguments.
        timeout_s: wall-clock limit for the whole run, also the collectives' timeout.
        threads: ``torch.set_num_threads`` in each worker.

    Returns: the workers' return values, in rank order.
    """
    _check("run_gloo", world_size, timeout_s, threads)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        procs = [
            ctx.Process(
                target=_worker,
                args=(fn, r, world_size, port, results, args, threads, timeout_s),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    got, errors = {}, []
    try:
        got, errors = _collect(dict(enumerate(procs)), results, timeout_s)
    finally:
        _reap(procs, 5 if not errors else 1)
    if errors:
        raise RuntimeError("worker failed:\n" + "\n".join(errors))
    return [got[r] for r in range(world_size)]


@contextlib.contextmanager
def gloo_rank0(fn, world_size: int, *args, timeout_s: float = 300.0, threads: int = 1):
    """Join a gloo group as rank 0 while ranks ``1..world_size-1`` run ``fn(rank, world, *args)``.

    Yields a list that, once the block exits, holds the other ranks' return values in rank order;
    a helper's exception (or exit without a result) is raised here as ``RuntimeError``, also
    when the block fails because of it (chained). This process uses ``threads`` torch threads
    inside the block, like the helpers.
    """
    _check("gloo_rank0", world_size, timeout_s, threads)
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, results, args, threads, timeout_s),
            daemon=True,
        )
        for r in range(1, world_size)
    ]
    for p in procs:
        p.start()
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    others: list = []
    got, errors = {}, []
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=0,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        try:
            yield others
        except Exception as e:  # a helper's failure (already reported) may be the cause
            _, errors = _collect(dict(enumerate(procs, 1)), results, min(timeout_s, 2.0))
            errors = [x for x in errors if x.startswith("--- rank")]  # not "timed out"
            if errors:
                raise RuntimeError("helper rank failed:\n" + "\n".join(errors)) from e
            raise
        got, errors = _collect(dict(enumerate(procs, 1)), results, timeout_s)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        torch.set_num_threads(saved_threads)
        _reap(procs, 30 if not errors else 1)
    if errors:
        raise RuntimeError("helper rank failed:\n" + "\n".join(errors))
    others.extend(got[r] for r in range(1, world_size))
