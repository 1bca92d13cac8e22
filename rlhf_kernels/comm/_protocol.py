"""The micro-batch stream protocol, shared by ``broadcast_chunked`` and ``scatter_for_ring``.

Both sides run one micro-batch ahead: header ``i`` is exchanged and payload ``i`` is put in flight
before micro-batch ``i - 1`` is yielded, so the transfer overlaps the caller's work. The stream
ends with an END header, an ERROR header (the source's iterable or the preparation of a
micro-batch raised; the message travels in it), a FAILED header (sending micro-batch ``i``
raised: the source completed its transfers with filler, every rank drops ``i``) or an ABORT
header (the source's generator was closed before the end: ``close()``, or garbage collection
of a generator its caller dropped). In every case all ranks yield the same micro-batches; on
ABORT the receivers then raise, unless every rank opted in to early stops
(``allow_early_stop``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from . import _stream, _wire

# prepare(batch) -> (pickled description, payload word, start(), value to yield); start() sends
# the payload and, if it fails, first completes every transfer it owes with filler
Prepare = Callable[[list], tuple[bytes, int, Callable[[], None], Any]]
# receive(description, n_samples, payload word) -> (value to yield, works filling it)
Receive = Callable[[Any, int, int], tuple[Any, list]]
ERROR_TEXT = 64 << 10  # characters of an error message an ERROR / FAILED header carries


def _error_text(exc: BaseException) -> str:
    """``Type: message`` for an error header: cut short, and never raising (an error here would
    leave the receivers without their header, waiting for the timeout)."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:
        text = f"{type(exc).__name__}: (its message could not be formatted)"
    return text if len(text) <= ERROR_TEXT else text[:ERROR_TEXT] + " ... (cut)"


def send_loop(header: _wire.Header, batches: Iterator[list], prepare: Prepare, drain) -> Iterator:
    """Source side. ``batches`` yields lists of samples (it may raise); ``drain()`` waits for
    every transfer still in flight."""
    prev, closed = None, False

    def close(status: int, *message: str):
        """Send the last header, finish the transfers, yield the micro-batch still held."""
        nonlocal closed
        header.send(status, *message)
        closed = True
        drain()
        if prev is not None:
            yield prev

    try:
        while True:
            try:
                batch = next(batches, None)
                if batch is not None:
                    data, word, start, value = prepare(batch)  # validates; nothing sent yet
            except Exception as exc:
                yield from close(_wire.ERROR, _error_text(exc))
                raise
            if batch is None:
                yield from close(_wire.END)
                return
            header.send_raw(_wire.BATCH, data, len(batch), word)
            try:
                start()  # on failure it completes the receivers' transfers with filler
            except _stream.StreamBroken:
                closed = True  # out of step: no header can follow; the receivers time out
                raise
            except Exception as exc:
                # the receivers drop this micro-batch (not yielded here either) and raise
                yield from close(_wire.FAILED, _error_text(exc))
                raise
            if prev is not None:
                yield prev
            prev = value
    except GeneratorExit:
        # the source's caller stopped early: end the stream on the receivers at the same point
        if not closed:
            header.send(_wire.ABORT)
        drain()
        raise


def recv_loop(
    header: _wire.Header, receive: Receive, who: str, src: int, allow_early_stop: bool = False
) -> Iterator:
    """Receiver side, mirror of ``send_loop``. On ABORT it returns if ``allow_early_stop``, else
    raises ``RuntimeError`` (after the micro-batches the source yielded)."""
    prev = None  # (value, works still filling it)
    yielded = 0
    while True:
        status, n, word, desc = header.recv(who)
        if status == _wire.BATCH:
            current = receive(desc, n, word)
        if prev is not None:
            _wait_all(prev[1])  # (a loop variable here would pin the last piece's buffer)
            if status not in (_wire.ABORT, _wire.FAILED):  # the source never yields this one
                value, prev = prev[0], None
                yield value
                yielded += 1
                del value  # hold nothing of a yielded micro-batch while receiving the next
            prev = None
        if status == _wire.BATCH:
            prev, current = current, None
        elif status == _wire.END:
            return
        elif status == _wire.ABORT:
            if allow_early_stop:
                return
            raise RuntimeError(
                f"{who}: the source rank {src} stopped the stream early, after {yielded} "
                "micro-batch(es): its caller closed the generator (or dropped it after an error "
                "while consuming it: see the source's own error). Pass allow_early_stop=True on "
                "every rank if early stops are intended"
            )
        elif status == _wire.ERROR:
            raise RuntimeError(f"{who}: the source rank {src} failed: {desc}")
        elif status == _wire.FAILED:
            raise RuntimeError(
                f"{who}: the source rank {src} failed while sending micro-batch {yielded}: {desc}"
            )
        else:
            raise RuntimeError(f"{who}: unknown stream status {status} from rank {src}")


def _wait_all(works: list) -> None:
    for work in works:
        work.wait()
