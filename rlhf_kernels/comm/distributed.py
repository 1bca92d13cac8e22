"""Distributed generation: every ring rank generates its share, then owners stream in turn.

Instead of ring rank 0 generating ``(rollout_batch_size / world) * n_samples_per_prompt``
samples alone and holding all of them, rank ``r`` generates the rollouts of its contiguous share
of the prompts (all ranks in parallel, each holding 1/world of the samples), then rank 0, 1, ...
streams its own rollouts to the group in bounded micro-batches. Shares are contiguous, so with a
per-prompt deterministic ``generate`` the samples arrive in the same order as when one rank
generates everything. If ``generate`` raises on any rank, every rank raises before anything
is streamed, with the failing ranks' messages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import _wire
from .broadcast import _common_error, _keys_error, _timeout_ok, broadcast_chunked, scatter_for_ring


def local_share(items: Sequence, rank: int, world_size: int) -> Sequence:
    """Contiguous slice of ``items`` for ``rank``; share sizes differ by at most one."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    n = len(items)
    return items[rank * n // world_size : (rank + 1) * n // world_size]


def distributed_rollouts(
    prompts: Sequence,
    generate: Callable[[Sequence], Iterable[dict[str, Any]]],
    *,
    group: dist.ProcessGroup | None = None,
    token_keys: Sequence[str] | None = None,
    layout: str = "zigzag",
    max_chunk_bytes: int = 64 << 20,
    timeout: float | None = None,
    count_objects: bool = True,
) -> Iterator:
    """Generate on every rank of ``group``, then distribute the micro-batches from their owners.

    Args:
        prompts: all prompts of the step, the same sequence on every rank.
        generate: ``generate(share)`` returns the rollout dicts of a slice of ``prompts``; it is
            run eagerly on every rank (in parallel), on ``local_share(prompts, rank, world)``.
        group: the ring group (default: the world).
        token_keys: None streams whole samples with ``broadcast_chunked`` (yields lists of
            samples); otherwise the per-token keys for ``scatter_for_ring`` (yields
            ``(plan, local_tensors, meta)``).
        layout, max_chunk_bytes, count_objects: passed on (same on every rank).
        timeout: seconds to wait for the other ranks to finish generating (the status
            exchange after ``generate``) and then for each header (default: the group's
            timeout). Generation times differ across ranks: leave room for the slowest.

    Yields: what ``broadcast_chunked`` or ``scatter_for_ring`` yields, rank 0's micro-batches
    first, then rank 1's, ...; the same on every rank. Iterate to the end on every rank (no
    early stop).

    Raises:
        RuntimeError on every rank if ``generate`` raised on any rank, or a rank was given a bad
        ``timeout``, ``max_chunk_bytes``, ``token_keys`` or ``layout`` (checked before
        ``generate`` runs; the message names the failing ranks and their errors; the failing
        rank chains its original exception), or when ``timeout`` passes; ValueError on every rank if
        the ranks were given different numbers of prompts; what the streams raise.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    error, mine, n_prompts = None, None, -1
    try:
        if not _timeout_ok(timeout):
            bad, timeout = timeout, None  # this rank's exchange waits as long as the group's
            raise ValueError(f"timeout must be a number of seconds > 0 or None, got {bad!r}")
        # the streams' own arguments: refused before generate runs, not after all that work
        bad = _common_error("distributed_rollouts", world, 0, max_chunk_bytes, None)
        if token_keys is not None:
            bad = bad or _keys_error("distributed_rollouts", token_keys, layout)[1]
        if bad is not None:
            raise bad
        n_prompts = len(prompts)  # an iterator raises here: in the try, so every rank hears
        mine = list(generate(local_share(prompts, rank, world)))
    except Exception as exc:  # every rank must hear of it, or the others wait forever
        error = exc
    _exchange_status(error, n_prompts, group, timeout)
    for owner in range(world):
        samples = _consume(mine) if rank == owner else None
        if token_keys is None:
            stream = broadcast_chunked(
                samples, src=owner, group=group, max_chunk_bytes=max_chunk_bytes, timeout=timeout,
                count_objects=count_objects,
            )  # fmt: skip
        else:
            stream = scatter_for_ring(
                samples,
                src=owner,
                group=group,
                token_keys=token_keys,
                layout=layout,
                max_chunk_bytes=max_chunk_bytes,
                timeout=timeout,
                count_objects=count_objects,
            )
        yield from stream


def _exchange_status(error: Exception | None, n_prompts: int, group, timeout: float | None) -> None:
    """All-gather an ok flag, the prompt count and error text per rank; raise on every rank if
    any failed or the ranks were given different numbers of prompts (shares would be lost)."""
    text = "" if error is None else f"{type(error).__name__}: {error}"
    rows = _wire.all_gather_rows(
        [int(error is None), n_prompts, *_wire.encode_message(text)],
        group=group,
        device=_wire.comm_device(group),
        timeout=None if timeout is None else timedelta(seconds=timeout),
        what="distributed_rollouts: the status exchange after generate",
    )
    failed = {r: _wire.decode_message(row[2:]) for r, row in enumerate(rows) if row[0] != 1}
    if failed:
        lines = "; ".join(f"rank {r}: {msg}" for r, msg in failed.items())
        raise RuntimeError(
            f"distributed_rollouts: generate (or the arguments) failed on rank(s) "
            f"{sorted(failed)}: {lines}"
        ) from error
    counts = [row[1] for row in rows]
    if len(set(counts)) > 1:
        raise ValueError(
            "distributed_rollouts: every rank must pass the same prompts, got "
            f"{dict(enumerate(counts))} prompts (rank: count)"
        )


def _consume(items: list) -> Iterator:
    """Yield and forget the items of ``items`` in order, so sent samples can be freed."""
    items.reverse()
    while items:
        yield items.pop()
