"""Bounded-memory distribution of rollouts: chunked broadcast and ring-shard scatter.

``broadcast_chunked`` replaces ``broadcast_object_list(whole_rollout_list)``: the source streams
micro-batches whose tensor bytes fit ``max_chunk_bytes``; tensors travel as raw bytes from two
reused staging buffers into a small pool of reused receive blocks, only metadata is pickled.
Every rank, source included, holds a few chunks at a time whatever the rollout size, and the
next micro-batch is in flight while the caller works on the current one.

``scatter_for_ring`` does the same for data that ring attention consumes: the source packs each
micro-batch, builds its ``RingPlan`` and sends every rank only that rank's token shard.

Failure handling: every stream starts with a handshake (``all_gather`` of each rank's
arguments, bounded by ``timeout``), so mismatched ``max_chunk_bytes``/``src``/``token_keys``/
``layout``/``allow_early_stop`` raise the same ``ValueError`` on every rank, and so does an
invalid argument on any one rank (it joins the handshake before raising its own error). If the
source's iterable raises, or sending a micro-batch fails on the source (an allocation, a dtype
without a kernel), the error message travels in the next header and every receiver raises
``RuntimeError`` with it. If the source's caller stops early, it must close the generator
(``stream.close()``, e.g. in a ``finally``, or iterate under ``contextlib.closing``): the
receivers then raise ``RuntimeError`` too, unless every rank passed ``allow_early_stop=True``.
A generator left open (the caller raised in its loop body but still holds it) tells the
receivers nothing until it is garbage collected: until then they wait, up to ``timeout``. A
source that dies breaks the connection (gloo raises at once); a rank that stalls or never joins
is bounded by ``timeout`` (seconds per header exchange and for the
handshake) or by ``init_process_group(timeout=...)``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._checks import is_real
from ..ring.plan import LAYOUTS, RingPlan
from . import _protocol, _stream, _wire

__all__ = ["broadcast_chunked", "scatter_for_ring"]

Sample = dict[str, Any]


def _group_rank(name: str, group) -> tuple[int, int]:
    """This process's rank and the group's size; raises where there is no group to tell."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{name} needs an initialised torch.distributed process group")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{name}: this process is not a member of group")
    return rank, dist.get_world_size(group)


def _common_error(name: str, world: int, src, max_chunk_bytes, timeout) -> Exception | None:
    if not isinstance(src, int) or isinstance(src, bool) or not 0 <= src < world:
        return ValueError(f"{name}: src must be a rank of group in [0, {world}), got {src!r}")
    if not isinstance(max_chunk_bytes, int) or max_chunk_bytes < _wire.MIN_CHUNK_BYTES:
        return ValueError(
            f"{name}: max_chunk_bytes must be an int >= {_wire.MIN_CHUNK_BYTES}, "
            f"got {max_chunk_bytes!r}"
        )
    if not _timeout_ok(timeout):
        return ValueError(f"{name}: timeout must be None or seconds > 0 (finite), got {timeout!r}")
    return None


def _samples_error(name: str, rank: int, src: int, samples) -> Exception | None:
    if rank == src and samples is None:
        msg = f"{name}: samples must be an iterable of dicts on the source rank {src}, got None"
        return ValueError(msg)
    not_iterable = isinstance(samples, (dict, str, bytes)) or not hasattr(samples, "__iter__")
    if rank == src and not_iterable:
        return ValueError(
            f"{name}: samples must be an iterable (list or generator) of dicts on the "
            f"source rank, got {type(samples).__name__}"
        )
    if rank != src and samples is not None:
        return ValueError(
            f"{name}: samples must be None on rank {rank} (the source is rank {src}), got "
            f"{type(samples).__name__}"
        )
    return None


def _keys_error(name: str, token_keys, layout) -> tuple[Any, Exception | None]:
    """``token_keys`` as a tuple, and the error of scatter_for_ring's own arguments if any."""
    if isinstance(token_keys, (str, bytes)) or not isinstance(token_keys, Sequence):
        return token_keys, TypeError(
            f"{name}: token_keys must be a sequence of keys, got {token_keys!r}"
        )
    token_keys = tuple(token_keys)
    if not token_keys or len(set(token_keys)) != len(token_keys):
        return token_keys, ValueError(
            f"{name}: token_keys must be non-empty and unique, got {token_keys}"
        )
    if layout not in LAYOUTS:
        return token_keys, ValueError(f"{name}: layout must be one of {LAYOUTS}, got {layout!r}")
    return token_keys, None


def _timeout_ok(timeout) -> bool:
    """None, or finite seconds > 0 that a ``timedelta`` holds (inf would raise OverflowError
    later, on the first ``next()`` of that rank alone, leaving the others waiting)."""
    if timeout is None:
        return True
    if not is_real(timeout, finite=True, positive=True):
        return False
    try:
        timedelta(seconds=timeout)
    except OverflowError:
        return False
    return True


def _refuse(name: str, error: Exception, fields: dict, group, timeout) -> None:
    """Raise ``error`` after joining the handshake the other ranks run on their first
    ``next()``, so that an invalid argument on one rank raises on every rank (they read "rank(s)
    [r] ... invalid arguments") instead of leaving them waiting until the timeout."""
    timeout = timedelta(seconds=timeout) if timeout is not None and _timeout_ok(timeout) else None
    try:
        _wire.handshake(
            dict.fromkeys(fields, 0),  # the same row length as the other ranks'
            str(error),
            group=group,
            device=_wire.comm_device(group),
            who=name,
            timeout=timeout,
        )
    except (ValueError, RuntimeError):  # our own error, or the others never joined
        pass
    raise error


# resident cost of the Python objects a received micro-batch is made of, beyond its bytes:
# each tensor a receiver rebuilds is a view (Python object + TensorImpl, ~0.9 kB measured), each
# sample a dict; each document of a scatter micro-batch costs its RingPlan ~(100 * world + 300)
# bytes of run tables and Python lists on every rank. Counted in the budget, so micro-batches of
# many tiny samples stay within a few max_chunk_bytes of memory, not ~10x.
_TENSOR_OBJ_BYTES = 1024
_SAMPLE_OBJ_BYTES = 256


def _plan_doc_bytes(world: int) -> int:
    return 128 * world + 384


def _sample_bytes(sample: Sample, index: int, objects: bool = True) -> int:
    total = _SAMPLE_OBJ_BYTES if objects else 0
    for key, value in sample.items():
        if isinstance(value, torch.Tensor):
            _wire.check_tensor(value, f"samples[{index}][{key!r}]")
            total += _wire.align(_wire.tensor_nbytes(value)) + (_TENSOR_OBJ_BYTES if objects else 0)
    return total


def _broadcast_meta_size(sample: Sample) -> int:
    """Pickled size of the sample's entry in ``_describe`` (8 bytes per tensor for its offset)."""
    fields = [
        (k, ("t", v.dtype, tuple(v.shape), 0) if isinstance(v, torch.Tensor) else ("o", _own(v)))
        for k, v in sample.items()
    ]
    return _wire.meta_nbytes(fields) + 8 * sum(isinstance(v, torch.Tensor) for v in sample.values())


def _describe(batch: list[Sample]) -> tuple[list, list[torch.Tensor]]:
    """Per sample ``[(key, ("t", dtype, shape, offset) | ("o", value))]`` and the tensors."""
    tensors = [v for s in batch for v in s.values() if isinstance(v, torch.Tensor)]
    offsets, _ = _stream.layout([_stream.nbytes(t) for t in tensors])
    desc, j = [], 0
    for sample in batch:
        fields = []
        for key, value in sample.items():
            if isinstance(value, torch.Tensor):
                fields.append((key, ("t", value.dtype, tuple(value.shape), offsets[j])))
                j += 1
            else:  # (tensors nested in it travel as CPU copies of their own size)
                fields.append((key, ("o", _own(value))))
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
    allow_early_stop: bool = False,
    count_objects: bool = True,
) -> Iterator[list[Sample]]:
    """Stream ``samples`` from ``src`` to every rank of ``group`` in bounded micro-batches.

    A generator, to be iterated to the end on every rank of ``group`` in the same order as
    other collectives.

    Args:
        samples: on ``src``, an iterable (list or generator: generation may run lazily, it is
            pulled one micro-batch ahead) of dicts. Tensor values (any dtype and shape, 0-d and
            empty included, dense, on CPU or the device) travel as raw bytes; every other value is
            metadata and is pickled (at most 8 MiB per sample; tensors nested in it, in dicts,
            lists or tuples, as CPU copies of their own size). ``None`` on other ranks.
        src: rank within ``group`` that owns ``samples`` (the global rank when ``group`` is None).
        group: process group (default: the world). gloo stages through CPU buffers, NCCL through
            the current CUDA device.
        max_chunk_bytes: budget of a micro-batch: tensor bytes (each tensor rounded up to 16
            bytes) plus each sample's pickled description and the objects a receiver rebuilds
            (``_TENSOR_OBJ_BYTES`` per tensor, ``_SAMPLE_OBJ_BYTES`` per sample); also the size
            of each staging buffer.
        count_objects: False leaves the objects out of the budget (tensor and metadata bytes
            only: micro-batches as a token budget, e.g. training micro-batches of long samples);
            only the source's value matters.
            The pickled descriptions of one micro-batch also stay under 8 MiB, so any number of
            metadata-heavy samples streams. A sample over the budget travels alone, split over
            several transfers. Must be the same on every rank (checked).
        timeout: seconds to wait for the handshake and for each micro-batch header before
            raising (default: the process group's timeout).
        allow_early_stop: if True (on every rank, checked), the source may stop early and the
            receivers then simply end at the same point. If False, the receivers raise
            ``RuntimeError`` in that case. Either way the source stops by closing its generator
            (``stream.close()`` or ``contextlib.closing``, also when its loop body raises): the
            receivers learn of the stop only then (or when the generator is garbage
            collected), and otherwise wait up to ``timeout``.

    Yields:
        Lists of sample dicts, the same micro-batches in the same order on every rank. On
        ``src`` they are the input dicts themselves; elsewhere fresh tensors on the buffer device
        (CPU for gloo, CUDA for NCCL), bit-identical to the source, ``requires_grad=False``; the
        tensors of one micro-batch share one storage. Memory: the source holds two staging
        buffers of ``max_chunk_bytes``; a receiver receives into a pool of at most three such
        blocks, each recycled once the caller has dropped every tensor of the micro-batch it
        held (keep micro-batches and fresh buffers are allocated instead, never overwritten).
        A receiver must iterate to the end; only the source may stop early (see
        ``allow_early_stop``).

    Raises:
        ValueError on every rank if the ranks disagree on ``src`` or ``max_chunk_bytes`` or one
        rank has invalid arguments (that rank raises its own error at call time, after joining
        the handshake the others run on their first ``next()``); RuntimeError on the receivers,
        after the micro-batches sent before it, if the source's iterable raised or sending a
        micro-batch failed there (the source re-raises the original error), or if the source
        closed its generator early without ``allow_early_stop``; RuntimeError when ``timeout``
        passes.
    """
    name = "broadcast_chunked"
    rank, world = _group_rank(name, group)
    error = _common_error(name, world, src, max_chunk_bytes, timeout)
    error = error or _samples_error(name, rank, src, samples)
    allow_early_stop = bool(allow_early_stop)
    fields = {
        "kind": 1,
        "src": src,
        "max_chunk_bytes": max_chunk_bytes,
        "allow_early_stop": int(allow_early_stop),
    }
    if error is not None:
        _refuse(name, error, fields, group, timeout)
    side = _broadcast_side
    args = (samples, max_chunk_bytes, allow_early_stop, bool(count_objects))
    return _stream_gen(name, fields, src, group, timeout, side, *args)


def _stream_gen(name, fields, src, group, timeout, side, *args):
    # argument checks ran at call time; communication starts on the first next()
    device = _wire.comm_device(group)
    header = _wire.Header(src=src, group=group, device=device, timeout=timeout)
    _wire.handshake(fields, None, group=group, device=device, who=name, timeout=header.timeout)
    yield from side(name, header, device, *args)


def _broadcast_side(name, header, device, samples, max_chunk_bytes, allow_early_stop, objects):
    piece = _stream.piece_size(max_chunk_bytes)
    group, src = header.group, header.src
    if samples is not None:  # the source
        sender = _stream.Sender(piece, device)
        send_fns = [_stream.bcast_fn(header.gsrc, group)]

        def prepare(batch):
            desc, tensors = _describe(batch)
            offsets, total = _stream.layout([_stream.nbytes(t) for t in tensors])
            start = lambda: sender.send(tensors, offsets, total, send_fns)
            return _wire.dumps_meta(desc, name), total, start, batch

        size = _sample_bytes if objects else functools.partial(_sample_bytes, objects=False)
        batches = _wire.micro_batches(samples, size, max_chunk_bytes, _broadcast_meta_size)
        yield from _protocol.send_loop(header, batches, prepare, sender.wait)
    else:
        recv = _stream.bcast_fn(header.gsrc, group)
        pool = _stream.RecvPool(piece, device)

        def receive(desc, n, total):
            flat = pool.take(total)
            return _rebuild(desc, flat), _stream.recv_into(flat, piece, recv)

        yield from _protocol.recv_loop(header, receive, name, src, allow_early_stop)


def scatter_for_ring(
    samples: Iterable[Sample] | None,
    *,
    src: int,
    group: dist.ProcessGroup | None = None,
    token_keys: Sequence[str],
    layout: str = "zigzag",
    max_chunk_bytes: int = 64 << 20,
    timeout: float | None = None,
    allow_early_stop: bool = False,
    pad_values: dict[str, float] | None = None,
    count_objects: bool = True,
) -> Iterator[tuple[RingPlan, dict[str, torch.Tensor], list[dict[str, Any]]]]:
    """Stream ``samples`` from ``src`` so that each rank of the ring ``group`` gets only its shard.

    For each micro-batch (tensor bytes of ``token_keys`` within ``max_chunk_bytes``) the source
    builds the ``RingPlan`` of the packed samples and sends every rank ``plan.shard(packed[key],
    rank)`` for each key, about 1/world of the bytes. The header carries only ``cu_seqlens`` and
    the per-sample metadata; every rank rebuilds the (deterministic) plan itself. Iterate it to
    the end on every rank of ``group``.

    Cost: every rank builds each micro-batch's ``RingPlan``: O(samples x world) time and memory
    (per-document runs, no per-token tables), so a receiver pays for its shard only. The source
    never packs a micro-batch whose runs average ``_VIEW_MIN_RUN`` tokens or more (a sample
    alone, however large, included): each rank's shard streams from views of the samples' runs
    plus zero pads, so the source holds its own shard and two staging buffers. Micro-batches of
    many short samples (within the budget) are packed once and sharded with ``plan.shard``.

    Args:
        samples: on ``src``, an iterable of dicts; ``sample[key]`` for each of ``token_keys`` is a
            dense tensor ``(len_i, *rest_key)`` with the same ``len_i`` for all keys of a sample
            and the same dtype and ``rest_key`` across samples. Other values are per-sample
            metadata, pickled (tensors among them, also nested in dicts, lists or tuples, as
            CPU copies of their own size). ``None`` elsewhere.
        src: rank within ``group`` that owns ``samples``.
        group: the ring group (default: the world); its size is the plan's ``world_size``.
        token_keys: the per-token fields to shard (same on every rank, checked).
        layout: ``RingPlan`` layout, ``"zigzag"`` or ``"contiguous"`` (same on every rank).
        max_chunk_bytes: budget of one micro-batch's per-token bytes (before sharding) plus the
            samples' pickled metadata and object overhead (``_SAMPLE_OBJ_BYTES`` and the plan's
            tables per sample); transfers and the source's two staging buffers are
            ``max_chunk_bytes / world``. A sample over it travels alone. Metadata of one
            micro-batch also stays under 8 MiB.
        timeout: seconds to wait for the handshake and each micro-batch header (default: the
            group's timeout).
        allow_early_stop: as in ``broadcast_chunked`` (same on every rank, checked).
        pad_values: the value of each key at the shard's pad slots (``plan.valid_mask(rank)`` is
            False there). Default: ``-100`` (the ignore index of the log-prob ops and losses)
            for signed integer keys whose name contains ``"label"`` or ``"target"``, 0 for every
            other key (bool and uint8 masks included); entries given here override that. Keys
            must be token keys and values numbers that fit the key's dtype (an integer in range
            for integer keys; a finite value within ``torch.finfo``, or +-inf/NaN, for floating
            keys; only 0 for dtypes without ``masked_fill``, such as float8), the same on every
            rank. The source refuses a pad that does not fit before sending the first
            micro-batch (ValueError there, RuntimeError with its message on the receivers).
        count_objects: as in ``broadcast_chunked``.

    Yields:
        ``(plan, local_tensors, meta)`` on every rank: ``plan`` the micro-batch's ``RingPlan``
        (``plan.cu_seqlens`` are the packed samples in order), ``local_tensors[key]`` equal to
        ``plan.shard(packed[key], rank)`` of shape ``(plan.local_len, *rest_key)`` with the
        key's pad value at pad slots, and ``meta`` the list of per-sample dicts of non-token
        fields.

    Raises:
        ValueError on every rank for mismatched ``src``/``token_keys``/``layout``/
        ``max_chunk_bytes``/``allow_early_stop``, or invalid arguments on any rank (that rank
        raises its own ValueError or TypeError at call time, as ``broadcast_chunked``);
        RuntimeError on the receivers if the source's
        iterable raised, a sample is malformed, a pad value does not fit or sending failed (the
        source raises the original error), or if the source closed its generator early without
        ``allow_early_stop``; RuntimeError on timeout.
    """
    name = "scatter_for_ring"
    rank, world = _group_rank(name, group)
    token_keys, error = _keys_error(name, token_keys, layout)
    pad_values, pad_error = _pad_values(name, pad_values, token_keys)
    error = error or pad_error
    error = error or _common_error(name, world, src, max_chunk_bytes, timeout)
    error = error or _samples_error(name, rank, src, samples)
    fields = {
        "kind": 2,
        "src": src,
        "max_chunk_bytes": max_chunk_bytes,
        "token_keys": repr(token_keys),
        "layout": LAYOUTS.index(layout) if layout in LAYOUTS else -1,
        "allow_early_stop": int(bool(allow_early_stop)),
        "pad_values": repr(sorted(pad_values.items())),
    }
    if error is not None:
        _refuse(name, error, fields, group, timeout)
    side = _scatter_side
    args = (samples, rank, world, token_keys, layout, max_chunk_bytes, bool(allow_early_stop))
    stream = _stream_gen(
        name, fields, src, group, timeout, side, *args, pad_values, bool(count_objects)
    )  # fmt: skip
    return _with_pad_values(stream, rank, pad_values)


def _pad_values(name: str, pad_values, token_keys) -> tuple[dict, Exception | None]:
    """``pad_values`` as a dict, and the error if it is not token key -> number."""
    if pad_values is None:
        return {}, None
    if not isinstance(pad_values, Mapping):
        return {}, TypeError(f"{name}: pad_values must be a dict, got {type(pad_values).__name__}")
    for key, value in pad_values.items():
        if key not in token_keys:
            return {}, ValueError(
                f"{name}: pad_values key {key!r} is not one of the token_keys {token_keys}"
            )
        if not isinstance(value, (bool, int, float)):
            return {}, TypeError(
                f"{name}: pad_values[{key!r}] must be a number, got {type(value).__name__} "
                f"{value!r}"
            )
    return dict(pad_values), None


def pad_value(key: str, dtype: torch.dtype, pad_values: dict) -> float:
    """The pad-slot value of ``key`` (see ``scatter_for_ring``'s ``pad_values``)."""
    if key in pad_values:
        return pad_values[key]
    label_like = any(w in key.lower() for w in ("label", "target"))
    # -100 only for signed integer ids: a bool / uint8 mask named "*_label*" pads with 0
    ids = dtype.is_signed and not (dtype.is_floating_point or dtype.is_complex)
    return -100 if label_like and ids else 0


def _with_pad_values(stream, rank: int, pad_values: dict):
    """Yield the stream's items with every key's pad slots set to its pad value."""
    try:
        for plan, local, meta in stream:
            for key, t in local.items():
                value = pad_value(key, t.dtype, pad_values)
                if value != 0:
                    pads = ~plan.valid_mask(rank).to(t.device)
                    local[key] = t.masked_fill(pads.view(-1, *[1] * (t.dim() - 1)), value)
            yield plan, local, meta
    finally:
        stream.close()


def _token_budget(token_keys):
    def budget(sample, index):
        for key in token_keys:
            if not isinstance(sample.get(key), torch.Tensor):
                raise TypeError(
                    f"samples[{index}][{key!r}] must be a tensor (a token key), got "
                    f"{type(sample.get(key)).__name__}"
                )
            _wire.check_tensor(sample[key], f"samples[{index}][{key!r}]")
            if sample[key].dim() < 1:
                raise ValueError(
                    f"samples[{index}][{key!r}] must have a token dim, got a 0-d tensor"
                )
        lengths = {k: sample[k].shape[0] for k in token_keys}
        if len(set(lengths.values())) > 1:
            raise ValueError(
                f"samples[{index}]: every token key must have the same length, got {lengths}"
            )
        return sum(_wire.align(_stream.nbytes(sample[k])) for k in token_keys)

    return budget


# the source sends shards from views of the samples' runs when runs average this many tokens
# (fewer, longer copies); below it one packed copy plus ``plan.shard``'s gather is faster
_VIEW_MIN_RUN = 256


def _check_specs(name: str, specs: list, first: list, pad_values: dict, devices=("cpu",)) -> None:
    """On the source, before a micro-batch is sent: its keys' dtypes and trailing shapes match
    the first micro-batch's, and each pad value fits its key's dtype (``_check_pad``)."""
    if not first:
        first.extend(specs)
        for key, dtype, _ in specs:
            if key in pad_values:
                _check_pad(name, key, dtype, pad_values[key], devices)
    elif specs != first:
        raise ValueError(
            f"{name}: every sample's token keys must keep one dtype and trailing shape, got "
            f"{specs} after {first} (key, dtype, trailing shape)"
        )


def _check_pad(name: str, key: str, dtype: torch.dtype, value, devices) -> None:
    """Refuse a pad value that ``_with_pad_values`` could not write into ``dtype`` on
    ``devices`` (every rank would raise there, out of step): an integer key takes integers in
    its range, a floating (or complex) key finite values within ``finfo`` or +-inf/NaN, and a
    dtype without ``masked_fill`` (float8, uint16...) only the default 0 (nothing is filled)."""
    where = f"{name}: pad_values[{key!r}]={value!r}"
    if dtype.is_floating_point or dtype.is_complex:
        info = torch.finfo(dtype)
        finite = not (isinstance(value, float) and not math.isfinite(value))
        if finite and not info.min <= value <= info.max:
            raise ValueError(
                f"{where} does not fit {key!r}'s {dtype} (finite values in "
                f"[{info.min}, {info.max}], or +-inf/NaN)"
            )
    else:
        info = None if dtype == torch.bool else torch.iinfo(dtype)
        fits = (0, 1) if info is None else (info.min, info.max)
        if not fits[0] <= value <= fits[1] or value != int(value):  # inf, NaN: the range
            raise ValueError(
                f"{where} does not fit {key!r}'s {dtype} (integers in [{fits[0]}, {fits[1]}])"
            )
    if value == 0:  # the default: pad slots are zeros already, nothing is filled
        return
    for device in dict.fromkeys(torch.device(d) for d in devices):
        try:  # what _with_pad_values does with it, on one element
            t = torch.zeros(1, dtype=dtype, device=device)
            t.masked_fill(torch.ones(1, dtype=torch.bool, device=device), value)
        except (RuntimeError, TypeError) as exc:  # not implemented for the dtype
            raise ValueError(
                f"{where}: {key!r}'s {dtype} pad slots cannot be filled on {device} "
                f"({exc}); leave its pad at the default 0"
            ) from exc


def _token_specs(batch: list[Sample], token_keys) -> tuple[list[int], list]:
    """cu_seqlens and per-key (key, dtype, rest) of one micro-batch (checked against sample 0)."""
    first = batch[0]
    specs = [(k, first[k].dtype, tuple(first[k].shape[1:])) for k in token_keys]
    cu = [0]
    for i, sample in enumerate(batch):  # lengths agree inside a sample (checked by the budget)
        for key, dtype, rest in specs:
            t = sample[key]
            if t.dtype != dtype or tuple(t.shape[1:]) != rest:
                raise ValueError(
                    f"sample {i} of the micro-batch: {key!r} must be {dtype} of "
                    f"shape (len, {', '.join(map(str, rest))}) like the first "
                    f"sample, got {t.dtype} {tuple(t.shape)}"
                )
        cu.append(cu[-1] + sample[token_keys[0]].shape[0])
    return cu, specs


def _run_pieces(plan: RingPlan, rank: int, batch: list[Sample], key, pads) -> list[torch.Tensor]:
    """``plan.shard(packed[key], rank)`` as a list of pieces, without packing: views of each
    run of the samples' tensors (``RingPlan.runs``: slot, length, doc, pos, global), and
    narrowed views of the zero tensor ``pads`` for the pad slots in between."""
    pieces, slot = [], 0
    for start, n, doc, pos, _ in plan.runs[rank].tolist():
        if start > slot:
            pieces.append(pads.narrow(0, 0, start - slot))
        pieces.append(batch[doc][key].narrow(0, pos, n))
        slot = start + n
    if plan.local_len > slot:
        pieces.append(pads.narrow(0, 0, plan.local_len - slot))
    return pieces


def _views_worth_it(plan: RingPlan, num_samples: int) -> bool:
    runs = sum(r.shape[0] for r in plan.runs)
    return num_samples == 1 or runs * _VIEW_MIN_RUN <= plan.total


def _meta_of(sample: Sample, token_keys) -> dict:
    return {k: _own(v) for k, v in sample.items() if k not in token_keys}


def _own(v):
    """Metadata ready to pickle: every tensor in it (at any depth of dicts, lists and tuples)
    as a CPU tensor with a storage of its own size, since pickling a view (say ``rewards[i]``)
    writes its whole base, once per sample. Containers without tensors are returned as is."""
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu()
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            t = t.clone(memory_format=torch.contiguous_format)
        return t
    if type(v) is dict:
        items = {k: _own(x) for k, x in v.items()}
        return items if any(items[k] is not x for k, x in v.items()) else v
    if type(v) in (list, tuple):
        items = [_own(x) for x in v]
        return type(v)(items) if any(a is not b for a, b in zip(items, v)) else v
    return v


def _scatter_side(
    name, header, device, samples, rank, world, token_keys, layout, max_chunk, allow_early_stop,
    pad_values, objects,
):  # fmt: skip
    # a rank's shard is ~1/world of a micro-batch: transfers (and staging buffers) of that size
    piece = _stream.piece_size(max(max_chunk // world, _wire.MIN_CHUNK_BYTES))
    group, src = header.group, header.src
    if samples is not None:  # the source
        sender = _stream.Sender(piece, device)
        first = []  # the first micro-batch's specs: every later one must match them

        def prepare(batch):
            cu, specs = _token_specs(batch, token_keys)
            # pads are filled on the buffer device (receivers) and the samples' (the source)
            devices = (device, *(batch[0][k].device for k in token_keys))
            _check_specs(name, specs, first, pad_values, devices)
            plan = RingPlan.build(cu, world, layout)
            meta = [_meta_of(s, token_keys) for s in batch]
            desc = {"cu": cu, "specs": specs, "meta": meta, "local_len": plan.local_len}
            views = _views_worth_it(plan, len(batch))
            if views:
                # pads: at most one slot per zigzag chunk, fewer than world at a contiguous end
                gap = max((n for _, n in _gaps(plan)), default=0)
                pads = {k: batch[0][k].new_zeros((gap, *rest)) for k, _, rest in specs}

                def shard_pieces(r):
                    return [_run_pieces(plan, r, batch, k, pads[k]) for k in token_keys]
            else:
                with torch.no_grad():
                    packed = {k: torch.cat([s[k] for s in batch], 0) for k in token_keys}

                def shard_pieces(r):
                    return [[plan.shard(packed[k], r)] for k in token_keys]

            with torch.no_grad():
                # views are joined into a fresh tensor; plan.shard's output is fresh already
                own = {
                    k: (torch.cat(p) if p else batch[0][k].new_zeros((0, *rest))) if views else p[0]
                    for (k, _, rest), p in zip(specs, shard_pieces(rank))
                }

            # every rank's shard stream is this long (as the receivers size theirs from desc)
            shard_bytes = _stream.layout(
                [_stream.spec_nbytes(d, (plan.local_len, *rest)) for _, d, rest in specs]
            )[1]

            def start():
                nonlocal shard_pieces
                owed = [r for r in range(world) if r != rank]
                try:
                    with torch.no_grad():
                        while owed:
                            pieces = shard_pieces(owed[0])
                            # from here on a failure fills the rest of this rank's stream itself
                            _send_shard(sender, pieces, group, owed.pop(0))
                            del pieces
                except Exception:
                    for r in owed:  # complete their transfers: the FAILED header follows
                        send = [_stream.isend_fn(_wire.global_rank(group, r), group)]
                        sender.fill(0, shard_bytes, send)
                    raise
                finally:
                    shard_pieces = None  # nothing of the micro-batch is kept while the caller works

            return _wire.dumps_meta(desc, name), cu[-1], start, (plan, own, meta)

        # the meta dict and the plan's runs (with count_objects), the cu entry
        overhead = (_SAMPLE_OBJ_BYTES + _plan_doc_bytes(world)) if objects else 16
        meta_size = lambda s: _wire.meta_nbytes(_meta_of(s, token_keys)) + overhead
        budget = _token_budget(token_keys)
        batches = _wire.micro_batches(samples, budget, max_chunk, meta_size)
        yield from _protocol.send_loop(header, batches, prepare, sender.wait)
    else:
        recv = _stream.irecv_fn(header.gsrc, group)
        # receive blocks leave 25% for zigzag pads
        pool = _stream.RecvPool(_wire.align(piece + piece // 4), device)

        def receive(desc, n, total):
            shapes = [(desc["local_len"], *rest) for _, _, rest in desc["specs"]]
            sizes = [_stream.spec_nbytes(d, s) for (_, d, _), s in zip(desc["specs"], shapes)]
            offsets, total = _stream.layout(sizes)
            flat = pool.take(total)
            works = _stream.recv_into(flat, piece, recv)
            # the shards are in flight: build the (deterministic) plan meanwhile
            plan = RingPlan.build(desc["cu"], world, layout)
            if plan.local_len != desc["local_len"]:
                raise RuntimeError(
                    f"{name}: the RingPlan built here has local_len "
                    f"{plan.local_len}, the source's {desc['local_len']}"
                )
            local = {
                key: _stream.view_tensor(flat, off, dtype, shape)
                for (key, dtype, _), shape, off in zip(desc["specs"], shapes, offsets)
            }
            return (plan, local, desc["meta"]), works

        yield from _protocol.recv_loop(header, receive, name, src, allow_early_stop)


def _gaps(plan: RingPlan):
    """``(slot, length)`` of every pad stretch of every rank."""
    for runs in plan.runs:
        slot = 0
        for start, n in runs[:, :2].tolist():
            if start > slot:
                yield slot, start - slot
            slot = start + n
        if plan.local_len > slot:
            yield slot, plan.local_len - slot


def _send_shard(sender: _stream.Sender, pieces_per_key: list, group, dst: int) -> None:
    """Send one rank's shards (per key, a list of pieces laid end to end along dim 0) as the
    stream the receiver expects: one 16-byte aligned region per key."""
    sizes = [sum(_stream.nbytes(p) for p in pieces) for pieces in pieces_per_key]
    key_offsets, total = _stream.layout(sizes)
    tensors, offsets = [], []
    for pieces, off in zip(pieces_per_key, key_offsets):
        for p in pieces:
            tensors.append(p)
            offsets.append(off)
            off += _stream.nbytes(p)
    send = [_stream.isend_fn(_wire.global_rank(group, dst), group)]
    sender.send(tensors, offsets, total, send)
