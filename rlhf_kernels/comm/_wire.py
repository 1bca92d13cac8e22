"""Wire format shared by the chunked senders and receivers.

A stream is: one handshake (``all_gather`` of every rank's argument fingerprint), then per
micro-batch a fixed control word, a pickled description (metadata and tensor layout only, never
tensor data) and the raw tensor bytes. Tensors sit in a flat byte stream at 16-byte aligned
offsets, so a receiver can view them in place without a staging copy.
"""

from __future__ import annotations

import pickle
import time
import zlib
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

MAGIC = 0x524C484B  # "RLHK"
ALIGN = 16  # largest element size of a torch dtype (complex128)
MIN_CHUNK_BYTES = 1024
META_LIMIT = 16 << 20  # pickled metadata per micro-batch; tensors belong in tensors
META_BUDGET = META_LIMIT // 2  # what micro_batches lets the per-sample estimates add up to
MESSAGE_BYTES = 512  # error text carried by a status all-gather (truncated)
HANDSHAKE_FIELDS = 8  # fields per handshake row (unused ones are 0)

# control word: [MAGIC, status, n_samples, payload_bytes, meta_bytes, seq]
# FAILED: the source failed while sending the micro-batch in flight (its transfers were completed
# with filler): the receivers drop that micro-batch and raise with the message the header carries
BATCH, END, ERROR, ABORT, FAILED = 0, 1, 2, 3, 4
CONTROL_LEN = 6


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def comm_device(group) -> torch.device:
    """Where collective buffers live: the current CUDA device for NCCL, else the CPU."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank(group, rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return rank
    return dist.get_global_rank(group, rank)


def fingerprint(text: str) -> int:
    return zlib.crc32(text.encode())  # stable across processes, unlike hash()


def wait(work, timeout: timedelta | None, what: str, poll: bool = False) -> None:
    """Wait for an async collective, at most ``timeout`` (None: the group's own timeout).

    On NCCL ``work.wait(timeout)`` only orders the CUDA stream (the CPU does not block unless
    ``TORCH_NCCL_BLOCKING_WAIT`` is set), so there the CPU polls ``work.is_completed()``
    against a deadline instead (``poll=True``: buffers on a CUDA device).
    """
    if timeout is None:
        work.wait()
        return
    try:
        if poll:
            deadline = time.monotonic() + timeout.total_seconds()
            delay = 1e-5
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise RuntimeError("deadline passed")
                time.sleep(delay)
                delay = min(2 * delay, 1e-3)
            work.wait()
        else:
            work.wait(timeout)
    except RuntimeError as exc:
        if "deadline passed" in str(exc) or "timed out" in str(exc).lower():
            raise RuntimeError(
                f"{what} did not finish within {timeout} (timeout): a rank stalled, failed or "
                "never joined; the group is unusable now"
            ) from exc
        raise RuntimeError(  # a peer died or closed its connection: say so, not "timeout"
            f"{what} failed ({exc}): a rank left or crashed; the group is unusable now"
        ) from exc


def all_gather_rows(row: list[int], *, group, device, timeout, what: str) -> list[list[int]]:
    """All-gather one int64 row per rank (same length everywhere), bounded by ``timeout``."""
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    wait(work, timeout, what, poll=device.type == "cuda")
    return [g.tolist() for g in gathered]


def handshake(
    fields: dict[str, int | str],
    local_error: str | None,
    *,
    group,
    device,
    who: str,
    timeout=None,
) -> None:
    """All-gather every rank's argument fingerprint; raise the same error on every rank when
    the ranks disagree or any rank was called with bad arguments. ``timeout`` (a timedelta or
    None) bounds the wait for ranks that never join. A ``str`` field travels as its CRC; on a
    mismatch the texts themselves are gathered so the error shows every rank's value."""
    names = list(fields)
    if len(names) > HANDSHAKE_FIELDS:
        raise ValueError(f"{who}: at most {HANDSHAKE_FIELDS} handshake fields, got {names}")
    values = [fingerprint(v) if isinstance(v, str) else v for v in fields.values()]
    # one row length for every caller, so ranks in different functions (a mismatched "kind")
    # get the error below instead of a collective of mismatched sizes
    rows = all_gather_rows(
        [MAGIC, int(local_error is None)] + values + [0] * (HANDSHAKE_FIELDS - len(values)),
        group=group,
        device=device,
        timeout=timeout,
        what=f"{who}: the handshake",
    )
    if local_error is not None:
        raise ValueError(local_error)
    bad = [r for r, row in enumerate(rows) if row[1] != 1 or row[0] != MAGIC]
    if bad:
        raise ValueError(
            f"{who}: rank(s) {bad} of the group were called with invalid arguments "
            "(their own error says which)"
        )
    for i, name in enumerate(names):
        values = [row[2 + i] for row in rows]
        if len(set(values)) > 1:
            if isinstance(fields[name], str):  # same branch on every rank: rows agree
                texts = all_gather_rows(
                    encode_message(fields[name]),
                    group=group,
                    device=device,
                    timeout=timeout,
                    what=f"{who}: the handshake",
                )
                values = [decode_message(t) for t in texts]
            raise ValueError(
                f"{who}: every rank must pass the same {name}, got "
                f"{dict(enumerate(values))} (rank: value)"
            )


def encode_message(text: str) -> list[int]:
    """``text`` as MESSAGE_BYTES ints (utf-8, truncated, zero padded) for an int64 row."""
    data = text.encode()[:MESSAGE_BYTES]
    return list(data) + [0] * (MESSAGE_BYTES - len(data))


def decode_message(values: list[int]) -> str:
    return bytes(v for v in values if v).decode(errors="replace")


def tensor_nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def check_tensor(t: torch.Tensor, where: str) -> None:
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(
            f"{where} must be a dense strided tensor, got layout {t.layout}"
            f"{' (quantized)' if t.is_quantized else ''}"
        )
    if t.is_meta:
        raise TypeError(f"{where} is a meta tensor: it has no data to send")


def meta_nbytes(obj: Any) -> int:
    """Pickled size of one sample's share of a micro-batch description."""
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def micro_batches(
    samples: Iterable, budget, max_chunk_bytes: int, meta_size=None
) -> Iterator[list]:
    """Greedy in-order split of ``samples`` into lists whose ``budget(sample, i)`` (tensor bytes)
    plus ``meta_size(sample)`` (pickled description bytes, when given) sum stays within
    ``max_chunk_bytes``, and whose ``meta_size`` sum also stays within ``META_BUDGET`` (so the
    pickled header of any micro-batch stays under ``META_LIMIT`` whatever the sample count). A
    sample over a budget forms a micro-batch alone. If ``samples`` raises (or a sample is
    invalid), the samples before it are yielded first."""
    batch, used, used_meta = [], 0, 0
    try:
        for i, sample in enumerate(samples):
            if not isinstance(sample, Mapping):
                raise TypeError(f"samples[{i}] must be a dict, got {type(sample).__name__}")
            meta = 0 if meta_size is None else meta_size(sample)
            if meta > META_BUDGET:
                raise ValueError(
                    f"samples[{i}]: its non-tensor fields pickle to {meta} bytes, over the "
                    f"{META_BUDGET}-byte limit for one sample's metadata; send large fields "
                    "(long texts, arrays) as tensors"
                )
            size = budget(sample, i) + meta
            if batch and (used + size > max_chunk_bytes or used_meta + meta > META_BUDGET):
                yield batch
                batch, used, used_meta = [], 0, 0
            batch.append(sample)
            used += size
            used_meta += meta
    except Exception:
        if batch:
            yield batch
        raise
    if batch:
        yield batch


def dumps_meta(obj: Any, who: str) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > META_LIMIT:  # micro_batches keeps descriptions far below this
        raise ValueError(
            f"{who}: the description of one micro-batch pickles to {len(data)} bytes, over "
            f"the {META_LIMIT}-byte limit; send large non-tensor fields as tensors"
        )
    return data


class Header:
    """Sends and receives the control word plus pickled description of each micro-batch."""

    def __init__(self, *, src: int, group, device, timeout: float | None):
        self.src, self.group, self.device = src, group, device
        self.gsrc = global_rank(group, src)
        self.timeout = None if timeout is None else timedelta(seconds=timeout)
        self.seq = 0

    def _bcast(self, t: torch.Tensor) -> None:
        work = dist.broadcast(t, src=self.gsrc, group=self.group, async_op=True)
        what = f"header exchange with the source rank {self.src}"
        wait(work, self.timeout, what, poll=self.device.type == "cuda")

    def send(self, status: int, meta: Any = None) -> None:
        self.send_raw(status, b"" if meta is None else dumps_meta(meta, "header"))

    def send_raw(self, status: int, data: bytes, n: int = 0, payload: int = 0) -> None:
        """Control word, then ``data`` (already pickled by ``dumps_meta``) if not empty."""
        ctrl = [MAGIC, status, n, payload, len(data), self.seq]
        self._bcast(torch.tensor(ctrl, dtype=torch.int64, device=self.device))
        if data:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
            self._bcast(buf)
        self.seq += 1

    def recv(self, who: str) -> tuple[int, int, int, Any]:
        ctrl = torch.empty(CONTROL_LEN, dtype=torch.int64, device=self.device)
        self._bcast(ctrl)
        magic, status, n, payload, meta_len, seq = ctrl.tolist()
        if magic != MAGIC or seq != self.seq:
            raise RuntimeError(
                f"{who}: stream out of step (magic {magic:#x}, micro-batch "
                f"{seq}, expected {self.seq}); did every rank call it in the "
                "same order with the same src?"
            )
        meta = None
        if meta_len:
            buf = torch.empty(meta_len, dtype=torch.uint8, device=self.device)
            self._bcast(buf)
            meta = pickle.loads(buf.cpu().numpy().tobytes())
        self.seq += 1
        return status, n, payload, meta
