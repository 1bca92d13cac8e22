"""Bounded-memory distribution of rollouts: chunked broadcast and ring-shard scatter.

``broadcast_chunked`` replaces ``broadcast_object_list(whole_rollout_list)``: the source streams
micro-batches whose tensor bytes fit ``max_chunk_bytes``; tensors travel as raw bytes through two
reused staging buffers, only metadata is pickled. Every rank, source included, holds a few chunks
at a time whatever the rollout size, and the next micro-batch is in flight while the caller
works on the current one.

``scatter_for_ring`` does the same for data that ring attention consumes: the source packs each
micro-batch, builds its ``RingPlan`` and sends every rank only that rank's token shard.

Failure handling: every stream starts with a handshake (``all_gather`` of each rank's
arguments), so mismatched ``max_chunk_bytes``/``src``/``token_keys``/``layout`` raise the same
``ValueError`` on every rank. If the source's iterable raises, the error message travels in the
next header and every receiver raises ``RuntimeError`` with it. A source that dies breaks the
connection (gloo raises at once); a source that stalls is bounded by ``timeout`` (seconds per
header) or by ``init_process_group(timeout=...)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from . import _stream, _wire

__all__ = ["broadcast_chunked"]

Sample = dict[str, Any]


def _check_common(name: str, src, group, max_chunk_bytes) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name} needs an initialised torch.distributed process group")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{name}: this process is not a member of group")
    if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < world:
        raise ValueError(f"{name}: src must be a rank of group in [0, {world}), got {src!r}")
    if not isinstance(max_chunk_bytes, int) or max_chunk_bytes < _wire.MIN_CHUNK_BYTES:
        raise ValueError(
            f"{name}: max_chunk_bytes must be an int >= {_wire.MIN_CHUNK_BYTES}, "
            f"got {max_chunk_bytes!r}"
        )
    return rank, world


def _samples_error(name: str, rank: int, src: int, samples) -> str | None:
    if rank == src and samples is None:
        return f"{name}: samples must be an iterable of dicts on the source rank {src}, got None"
    not_iterable = isinstance(samples, (dict, str, bytes)) or not hasattr(samples, "__iter__")
    if rank == src and not_iterable:
        return (
            f"{name}: samples must be an iterable (list or generator) of dicts on the "
            f"source rank, got {type(samples).__name__}"
        )
    if rank != src and samples is not None:
        return (
            f"{name}: samples must be None on rank {rank} (the source is rank {src}), got "
            f"{type(samples).__name__}"
        )
    return None


def _sample_bytes(sample: Sample, index: int) -> int:
    total = 0
    for key, value in sample.items():
        if isinstance(value, torch.Tensor):
            _wire.check_tensor(value, f"samples[{index}][{key!r}]")
            total += _wire.align(_wire.tensor_nbytes(value))
    return total


def _describe(batch: list[Sample]) -> tuple[list, list[torch.Tensor]]:
    """Per sample ``[(key, ("t", dtype, shape, offset) | ("o", value))]`` and the tensors."""
    tensors = [v for s in batch for v in s.values() if isinstance(v, torch.Tensor)]
    offsets, _ = _stream.layout(tensors)
    desc, j = [], 0
    for sample in batch:
        fields = []
        for key, value in sample.items():
            if isinstance(value, torch.Tensor):
                fields.append((key, ("t", value.dtype, tuple(value.shape), offsets[j])))
                j += 1
            else:
                fields.append((key, ("o", value)))
        desc.append(fields)
    return desc, tensors


def _rebuild(desc: list, flat: torch.Tensor) -> list[Sample]:
    out = []
    for fields in desc:
        sample = {}
        for key, spec in fields:
            if spec[0] == "t":
                sample[key] = _stream.view_tensor(flat, spec[3], spec[1], spec[2])
            else:
                sample[key] = spec[1]
        out.append(sample)
    return out


def broadcast_chunked(
    samples: Iterable[Sample] | None,
    *,
    src: int,
    group: dist.ProcessGroup | None = None,
    max_chunk_bytes: int = 64 << 20,
    timeout: float | None = None,
) -> Iterator[list[Sample]]:
    """Stream ``samples`` from ``src`` to every rank of ``group`` in bounded micro-batches.

    A generator, to be iterated to the end on every rank of ``group`` in the same order as
    other collectives.

    Args:
        samples: on ``src``, an iterable (list or generator: generation may run lazily, it is
            pulled one micro-batch ahead) of dicts. Tensor values (any dtype and shape, 0-d and
            empty included, dense, on CPU or the device) travel as raw bytes; every other value is
            metadata and is pickled (at most 16 MiB per micro-batch). ``None`` on other ranks.
        src: rank within ``group`` that owns ``samples`` (the global rank when ``group`` is None).
        group: process group (default: the world). gloo stages through CPU buffers, NCCL through
            the current CUDA device.
        max_chunk_bytes: tensor-byte budget of a micro-batch (each tensor counted rounded up to
            16 bytes) and size of each staging buffer. A sample over the budget travels alone,
            split over several transfers. Must be the same on every rank (checked).
        timeout: seconds to wait for each micro-batch header before raising (default: the
            process group's timeout).

    Yields:
        Lists of sample dicts, the same micro-batches in the same order on every rank. On
        ``src`` they are the input dicts themselves; elsewhere fresh tensors on the buffer device
        (CPU for gloo, CUDA for NCCL), bit-identical to the source, ``requires_grad=False``; the
        tensors of one micro-batch share one storage. Memory: the source holds two staging
        buffers, a receiver the micro-batch being received plus the one it yielded; drop your
        reference to a micro-batch before asking for the next one to keep it at that.

    Raises:
        ValueError on every rank if the ranks disagree on ``src`` or ``max_chunk_bytes`` or one
        rank has invalid arguments; RuntimeError on the receivers, after the micro-batches sent
        before it, if the source's iterable raised (the source re-raises the original error).
    """
    name = "broadcast_chunked"
    rank, _ = _check_common(name, src, group, max_chunk_bytes)
    device = _wire.comm_device(group)
    fields = {"src": src, "max_chunk_bytes": max_chunk_bytes, "kind": 1}
    return _run(name, rank, src, group, device, samples, fields, max_chunk_bytes, timeout)


def _run(name, rank, src, group, device, samples, fields, max_chunk_bytes, timeout):
    # argument checks happen at call time; communication starts on the first next()
    error = _samples_error(name, rank, src, samples)
    if rank == src:
        gen = _send(name, samples, src, group, device, max_chunk_bytes, timeout)
    else:
        gen = _recv(name, src, group, device, max_chunk_bytes, timeout)

    def stream():
        _wire.handshake(fields, error, group=group, device=device, who=name)
        yield from gen

    return stream()


def _send(name, samples, src, group, device, max_chunk_bytes, timeout):
    header = _wire.Header(src=src, group=group, device=device, timeout=timeout)
    piece = _stream.piece_size(max_chunk_bytes)
    sender = _stream.Sender(piece, device)
    send_fns = [_stream.bcast_fn(header.gsrc, group)]
    batches = _wire.micro_batches(samples, _sample_bytes, max_chunk_bytes)
    prev, closed = None, False
    try:
        while True:
            try:
                batch = next(batches, None)
                if batch is not None:
                    desc, tensors = _describe(batch)
                    meta = _wire.dumps_meta(desc, name)  # raises before anything is sent
            except Exception as exc:
                header.send(_wire.ERROR, f"{type(exc).__name__}: {exc}")
                closed = True
                sender.wait()
                if prev is not None:
                    yield prev
                raise
            if batch is None:
                header.send(_wire.END)
                closed = True
                sender.wait()
                if prev is not None:
                    yield prev
                return
            offsets, total = _stream.layout(tensors)
            header.send_raw(_wire.BATCH, meta, len(batch), total)
            sender.send(tensors, offsets, total, send_fns)
            if prev is not None:
                yield prev
            prev = batch
    except GeneratorExit:
        # the source's caller stopped early: end the stream on the receivers at the same point
        if not closed:
            header.send(_wire.ABORT)
        sender.wait()
        raise


def _recv(name, src, group, device, max_chunk_bytes, timeout):
    header = _wire.Header(src=src, group=group, device=device, timeout=timeout)
    piece = _stream.piece_size(max_chunk_bytes)
    recv = _stream.bcast_fn(header.gsrc, group)
    prev = None  # (micro-batch, works still filling it)
    while True:
        status, n, total, meta = header.recv(name)
        if status == _wire.BATCH:
            flat = torch.empty(total, dtype=torch.uint8, device=device)
            works = _stream.recv_into(flat, piece, recv)
            current = (_rebuild(meta, flat), works)
        if prev is not None and status != _wire.ABORT:
            for w in prev[1]:
                w.wait()
            batch, prev = prev[0], None
            yield batch
        if status == _wire.BATCH:
            prev = current
            del current
        elif status == _wire.END:
            return
        elif status == _wire.ERROR:
            raise RuntimeError(f"{name}: the source rank {src} failed: {meta}")
        elif status == _wire.ABORT:
            for w in prev[1] if prev is not None else []:
                w.wait()
            return
        else:
            raise RuntimeError(f"{name}: unknown stream status {status} from rank {src}")
