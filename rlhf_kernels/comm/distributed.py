"""Distributed generation: every ring rank generates its share, then owners stream in turn.

Instead of ring rank 0 generating ``(rollout_batch_size / world) * n_samples_per_prompt``
samples alone and holding all of them, rank ``r`` generates the rollouts of its contiguous share
of the prompts (all ranks in parallel, each holding 1/world of the samples), then rank 0, 1, ...
streams its own rollouts to the group in bounded micro-batches. Shares are contiguous, so with a
per-prompt deterministic ``generate`` the samples arrive in the same order as when one rank
generates everything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

from .broadcast import broadcast_chunked, scatter_for_ring


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
        layout, max_chunk_bytes, timeout: passed on (same on every rank).

    Yields: what ``broadcast_chunked`` or ``scatter_for_ring`` yields, rank 0's micro-batches
    first, then rank 1's, ...; the same on every rank.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = list(generate(local_share(prompts, rank, world)))
    for owner in range(world):
        samples = _consume(mine) if rank == owner else None
        if token_keys is None:
            stream = broadcast_chunked(
                samples, src=owner, group=group, max_chunk_bytes=max_chunk_bytes, timeout=timeout
            )
        else:
            stream = scatter_for_ring(
                samples,
                src=owner,
                group=group,
                token_keys=token_keys,
                layout=layout,
                max_chunk_bytes=max_chunk_bytes,
                timeout=timeout,
            )
        yield from stream


def _consume(items: list) -> Iterator:
    """Yield and forget the items of ``items`` in order, so sent samples can be freed."""
    items.reverse()
    while items:
        yield items.pop()
