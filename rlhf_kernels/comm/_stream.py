"""Raw-byte transfer of tensor lists through fixed, reused staging buffers.

The payload of a micro-batch is one flat byte stream: tensor ``j`` occupies
``[offsets[j], offsets[j] + nbytes[j])`` with 16-byte aligned offsets. It moves in pieces of at
most ``piece_bytes``; the sender packs each piece into one of two staging buffers (double
buffering: piece ``k + 1`` is packed while piece ``k`` is in flight), the receiver writes straight
into the block (from a small recycled pool) whose views it hands out, so no side ever holds the
whole payload, nor a staging copy of what it received.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._wire import ALIGN, align


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Aligned stream offsets of tensors of ``sizes`` bytes each, and the stream length."""
    offsets, pos = [], 0
    for n in sizes:
        offsets.append(pos)
        pos += align(n)
    return offsets, pos


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def spec_nbytes(dtype: torch.dtype, shape) -> int:
    numel = 1
    for s in shape:
        numel *= s
    return numel * dtype.itemsize


def piece_size(max_chunk_bytes: int) -> int:
    return max(ALIGN, max_chunk_bytes - max_chunk_bytes % ALIGN)


def view_tensor(flat: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """The tensor of ``dtype``/``shape`` stored at byte ``offset`` of the uint8 ``flat``."""
    n = spec_nbytes(dtype, shape)
    if n == 0:
        return torch.empty(shape, dtype=dtype, device=flat.device)
    return flat[offset : offset + n].view(dtype).view(shape)


class Sender:
    """Packs tensor pieces into two reused staging buffers and issues async sends.

    ``send_fn(buf) -> Work`` issues one async transfer of ``buf`` (a broadcast or an isend).
    """

    def __init__(self, piece_bytes: int, device: torch.device):
        self.piece_bytes, self.device = piece_bytes, device
        self.bufs: list[torch.Tensor | None] = [None, None]
        self.works: list[list] = [[], []]
        self.k = 0

    def _slot(self, need: int) -> torch.Tensor:
        slot = self.k % 2
        for w in self.works[slot]:  # the buffer is reused: its last transfer must be done
            w.wait()
        self.works[slot] = []
        buf = self.bufs[slot]
        if buf is None or buf.numel() < need:  # grows up to piece_bytes, then stays
            size = min(self.piece_bytes, max(need, 2 * (0 if buf is None else buf.numel())))
            buf = self.bufs[slot] = torch.empty(size, dtype=torch.uint8, device=self.device)
        return buf

    @torch.no_grad()
    def send(self, tensors: list[torch.Tensor], offsets: list[int], total: int, send_fns) -> None:
        """Send the stream made of ``tensors`` (at increasing ``offsets``) once through every
        function of ``send_fns``. If packing a piece fails (an allocation, a dtype without a
        copy kernel), the rest of the stream goes out as filler (``fill``) before the error
        propagates, so the receivers' transfers complete and the group stays in step."""
        contiguous: dict[int, torch.Tensor] = {}  # tensors split across pieces, made flat once
        sizes = [nbytes(t) for t in tensors]
        first = 0  # offsets increase: tensors before ``first`` ended in earlier pieces
        for start in range(0, total, self.piece_bytes):
            stop = min(total, start + self.piece_bytes)
            try:
                buf = self._slot(stop - start)
                while first < len(tensors) and offsets[first] + sizes[first] <= start:
                    first += 1
                for j in range(first, len(tensors)):
                    t, off, n = tensors[j], offsets[j], sizes[j]
                    if off >= stop:
                        break
                    lo, hi = max(off, start), min(off + n, stop)
                    if lo >= hi:
                        continue
                    if lo == off and hi == off + n:  # whole tensor in this piece: strided copy
                        view_tensor(buf, off - start, t.dtype, t.shape).copy_(t)
                    else:
                        if j not in contiguous:
                            # (a conjugate or negative view has no byte view: resolve it first)
                            contiguous[j] = (
                                t.resolve_conj().resolve_neg().contiguous().reshape(-1)
                            ).view(torch.uint8)  # no other name: freed at its del below
                        buf[lo - start : hi - start].copy_(contiguous[j][lo - off : hi - off])
                        if hi == off + n:
                            del contiguous[j]
            except Exception:
                contiguous.clear()
                self.fill(start, total, send_fns)
                raise
            piece = buf[: stop - start]
            self.works[self.k % 2] = [fn(piece) for fn in send_fns]
            self.k += 1

    def fill(self, start: int, total: int, send_fns) -> None:
        """Send bytes ``[start, total)`` of a stream as filler (whatever a staging buffer holds):
        the receivers' transfers complete, and the header that follows tells them to drop it.
        Reuses a staging buffer when one is large enough (the failure may have been an
        allocation); raises ``StreamBroken`` if even that fails."""
        try:
            for lo in range(start, total, self.piece_bytes):
                n = min(total, lo + self.piece_bytes) - lo
                fits = [b for b in self.bufs if b is not None and b.numel() >= n]
                # (the buffer is only read: sharing it with a send in flight is harmless)
                buf = fits[0] if fits else torch.empty(n, dtype=torch.uint8, device=self.device)
                self.works[self.k % 2] += [fn(buf[:n]) for fn in send_fns]
                self.k += 1
        except Exception as exc:
            raise StreamBroken(
                f"could not complete a stream with filler after a failed send ({exc}); the "
                "receivers will time out"
            ) from exc

    def wait(self) -> None:
        for slot in (0, 1):
            for w in self.works[slot]:
                w.wait()
            self.works[slot] = []


class StreamBroken(RuntimeError):
    """The source failed mid-stream and could not complete the receivers' transfers: no error
    header can follow (the receivers raise on their timeout)."""


_use_count = getattr(torch._C, "_storage_Use_Count", None)


class RecvPool:
    """A few fixed receive blocks of ``piece_bytes``, recycled once nobody references them.

    A micro-batch is received into a free block and handed out as views of it; the block is
    free again when the caller has dropped every view (storage use count, read with
    ``torch._C._storage_Use_Count``, back to the pool's own reference), so in steady state no
    memory is allocated at all. When every block is still held by the caller (it keeps
    micro-batches) or for an oversize sample, a fresh buffer is allocated instead: never a
    reuse of memory somebody can still see.
    """

    def __init__(self, piece_bytes: int, device: torch.device, size: int = 3):
        self.piece_bytes, self.device, self.size = piece_bytes, device, size
        self.blocks: list[torch.Tensor] = []

    @staticmethod
    def _refs(block: torch.Tensor) -> int:
        return _use_count(block.untyped_storage()._cdata) if _use_count is not None else -1

    def _free(self, block: torch.Tensor) -> bool:
        return _use_count is not None and self._refs(block) == self.unused_refs

    def take(self, total: int) -> torch.Tensor:
        """A uint8 ``(total,)`` buffer nobody else references."""
        if 0 < total <= self.piece_bytes:
            for block in self.blocks:
                if self._free(block):
                    return block[:total]
            if len(self.blocks) < self.size:
                block = torch.empty(self.piece_bytes, dtype=torch.uint8, device=self.device)
                self.unused_refs = self._refs(block)  # the pool's own reference, as counted
                self.blocks.append(block)
                return block[:total]
        return torch.empty(total, dtype=torch.uint8, device=self.device)


def recv_into(flat: torch.Tensor, piece_bytes: int, recv_fn) -> list:
    """Issue async receives of ``flat`` (uint8) in ``piece_bytes`` pieces; returns the works."""
    return [
        recv_fn(flat[start : start + piece_bytes]) for start in range(0, flat.numel(), piece_bytes)
    ]


def bcast_fn(gsrc: int, group):
    return lambda buf: dist.broadcast(buf, src=gsrc, group=group, async_op=True)


def isend_fn(gdst: int, group):
    return lambda buf: dist.isend(buf, dst=gdst, group=group)


def irecv_fn(gsrc: int, group):
    return lambda buf: dist.irecv(buf, src=gsrc, group=group)
