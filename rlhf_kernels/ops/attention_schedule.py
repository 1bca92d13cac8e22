"""Launch schedules of the packed-attention kernels (:mod:`.varlen_attention_triton`).

A schedule is an int32 ``(slots, 2)`` table of ``(sequence, block index)``; the kernels' 1-D grid
is ``slots x heads`` (in head sections: ``varlen_attention_triton._program``). A row
``(-1, 0)`` is an unused slot (tables are sized by a host-side bound, so no ``cu_seqlens`` value
is read back).

* :func:`schedule` picks the table of a launch: the static rectangle (every sequence, every block
  index below ``cdiv(max_len, block)``, cached per shape) when lengths are close to uniform, else
  the flat table, one row per real block, heaviest first.
* :func:`flat_schedule` builds the flat table on the device in one Triton launch plus a stable
  argsort: a few host calls per launch instead of the fifteen small torch ops of the readable
  reference :func:`flat_schedule_reference` (at an 8k-token pack the reference was most of the
  host time of a call). Both give the same table.

The table is rebuilt at every launch: ``cu_seqlens`` may be rewritten between calls in ways that
do not bump a tensor's version (collectives, ``.data``, DLPack), so tables are not cached.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


def _cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (``triton.cdiv`` is a JIT function: microseconds per host call)."""
    return -(-a // b)


# fmt: off
@triton.jit
def _schedule_kernel(
    CU_Q, CU_K, DIFF, SCHED, WORK, batch, slots, block, left, right,
    BY_KEYS: tl.constexpr, HAS_DIFF: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_B: tl.constexpr,
):
    """Unsorted flat table: slot ``s`` gets its ``(sequence, block)`` row in ``SCHED`` and the
    partner rows its block sees in ``WORK`` (-1 for an unused slot).

    Slot ``s`` belongs to sequence ``b = #{i : ends_i <= s}`` (``ends``: inclusive prefix sums of
    the per-sequence block counts) and is block ``s - sum(blocks of the sequences before b)``;
    both counts are summed chunk by chunk over the batch (``BLOCK_S x BLOCK_B`` compares)."""
    slot = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    seq = tl.zeros([BLOCK_S], dtype=tl.int32)  # sequences whose blocks all precede the slot
    start = tl.zeros([BLOCK_S], dtype=tl.int32)  # their blocks
    done = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int32), 0)  # blocks before the current chunk
    for c in range(0, batch, BLOCK_B):
        i = c + tl.arange(0, BLOCK_B)
        ok = i < batch
        if BY_KEYS:
            n = tl.load(CU_K + i + 1, mask=ok, other=0) - tl.load(CU_K + i, mask=ok, other=0)
        else:
            n = tl.load(CU_Q + i + 1, mask=ok, other=0) - tl.load(CU_Q + i, mask=ok, other=0)
        nblk = (n + block - 1) // block
        ends = done + tl.cumsum(nblk, 0)
        before = (ends[None, :] <= slot[:, None]) & ok[None, :]
        seq += tl.sum(before.to(tl.int32), 1)
        start += tl.sum(tl.where(before, nblk[None, :], 0), 1)
        done += tl.sum(nblk, 0)
    used = seq < batch
    b = tl.minimum(seq, batch - 1)
    blk = slot - start
    lq = tl.load(CU_Q + b + 1) - tl.load(CU_Q + b)
    lk = tl.load(CU_K + b + 1) - tl.load(CU_K + b)
    if HAS_DIFF:
        d = tl.load(DIFF + b)
    else:
        d = lk - lq
    first = blk * block
    # visible partners: key j sees query i  <=>  i + d - left <= j <= i + d + right
    if BY_KEYS:
        last = tl.minimum(first + block, lk) - 1
        lo = tl.zeros_like(first)
        hi = lq
        if HAS_RIGHT:
            lo = tl.maximum(first - d - right, 0)
        if HAS_LEFT:
            hi = tl.minimum(last - d + left + 1, lq)
    else:
        last = tl.minimum(first + block, lq) - 1
        lo = tl.zeros_like(first)
        hi = lk
        if HAS_LEFT:
            lo = tl.maximum(first + d - left, 0)
        if HAS_RIGHT:
            hi = tl.minimum(last + d + right + 1, lk)
    work = tl.where(used, tl.maximum(hi - lo, 0), -1)
    keep = slot < slots
    tl.store(SCHED + 2 * slot, tl.where(used, b, -1), mask=keep)
    tl.store(SCHED + 2 * slot + 1, tl.where(used, blk, 0), mask=keep)
    tl.store(WORK + slot, work, mask=keep)
# fmt: on


def schedule(cu_q, cu_k, diff, block, by_keys, mask, total, max_len):
    """The ``(slots, 2)`` int32 ``(sequence, block index)`` table of a launch (``total`` /
    ``max_len``: tokens and longest sequence on the blocked side; host ints).

    When lengths are close to uniform (the flat bound is over 3/4 of the rectangle) the static
    rectangle ``(b, m)`` for every sequence and ``m < cdiv(max_len, block)``, last block first,
    cached per shape (no per-call work; programs past a sequence's end exit at once). Else the
    data-dependent :func:`flat_schedule`, where a rectangle would be mostly empty programs."""
    batch = cu_q.numel() - 1
    slots = schedule_slots(total, batch, max_len, block)
    nblk = _cdiv(max_len, block)
    if 4 * slots > 3 * batch * nblk:
        return _rectangle(batch, nblk, cu_q.device)
    return flat_schedule(cu_q, cu_k, diff, block, by_keys, mask, slots)


@functools.lru_cache(maxsize=64)
def _rectangle(batch: int, nblk: int, device: torch.device) -> torch.Tensor:
    """``(batch * nblk, 2)`` int32: block ``nblk - 1`` of every sequence, then ``nblk - 2``, ...
    (causal work grows with the block index, so the heavy ones go first)."""
    m = torch.arange(nblk - 1, -1, -1, device=device).repeat_interleave(batch)
    b = torch.arange(batch, device=device).repeat(nblk)
    return torch.stack([b, m], 1).to(torch.int32)


def schedule_slots(total: int, batch: int, max_len: int, block: int) -> int:
    """Upper bound on the blocks of a pack, known on the host without reading ``cu_seqlens``:
    ``sum(cdiv(len, block)) <= cdiv(total, block) + batch``, and never more than the rectangular
    ``batch * cdiv(max_len, block)`` grid."""
    return min(_cdiv(total, block) + batch, batch * _cdiv(max_len, block))


def flat_schedule(cu_q, cu_k, diff, block, by_keys, mask, slots):
    """:func:`flat_schedule_reference`'s table from one kernel launch and a stable argsort.

    ``cu_q``, ``cu_k``, ``diff``: int32 and contiguous (the attention kernels' own inputs) on a
    CUDA device or under the Triton interpreter; launched on their device's stream."""
    left, right, has_left, has_right = mask
    batch = cu_q.numel() - 1
    table = torch.empty(slots, 2, dtype=torch.int32, device=cu_q.device)
    work = torch.empty(slots, dtype=torch.int32, device=cu_q.device)
    block_s, block_b = 128, 64
    _schedule_kernel[(_cdiv(slots, block_s),)](
        cu_q, cu_k, cu_q if diff is None else diff, table, work, batch, slots, block, left, right,
        BY_KEYS=by_keys, HAS_DIFF=diff is not None, HAS_LEFT=has_left, HAS_RIGHT=has_right,
        BLOCK_S=block_s, BLOCK_B=block_b,
    )  # fmt: skip
    return table[torch.argsort(work, descending=True, stable=True)]


def flat_schedule_reference(cu_q, cu_k, diff, block, by_keys, mask, slots):
    """Flat schedule ``(slots, 2)`` int32 of ``(sequence, block index)``, heaviest block first
    (pure torch; the readable reference of :func:`flat_schedule`).

    One entry per ``block``-row block of every sequence (query blocks, or key blocks when
    ``by_keys``), ordered by the number of partner rows the mask leaves visible to it (the work
    of its programs), descending, ties in sequence then block order: with skewed lengths no
    program is empty and the long ones start first. Slots past the last block hold ``(-1, 0)``.
    ``mask`` is ``_mask_meta``'s ``(left, right, has_left, has_right)``.
    """
    left, right, has_left, has_right = mask
    lq, lk = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    batch = lq.numel()
    nblk = ((lk if by_keys else lq) + block - 1) // block
    ends = nblk.cumsum(0)
    slot = torch.arange(slots, device=cu_q.device)
    b = torch.searchsorted(ends, slot, right=True)  # == batch past the last block
    used = b < batch
    b = b.clamp(max=batch - 1)
    blk = slot - (ends - nblk)[b]
    lq, lk = lq[b], lk[b]
    d = (lk - lq) if diff is None else diff.long()[b]
    first = blk * block
    last = torch.minimum(first + block, lk if by_keys else lq) - 1
    # visible partners: key j sees query i  <=>  i + d - left <= j <= i + d + right
    if by_keys:
        lo = (first - d - right).clamp(min=0) if has_right else torch.zeros_like(first)
        hi = torch.minimum(last - d + left + 1, lq) if has_left else lq
    else:
        lo = (first + d - left).clamp(min=0) if has_left else torch.zeros_like(first)
        hi = torch.minimum(last + d + right + 1, lk) if has_right else lk
    work = torch.where(used, (hi - lo).clamp(min=0), -1)
    order = torch.argsort(work, descending=True, stable=True)
    table = torch.stack([torch.where(used, b, -1), torch.where(used, blk, 0)], 1)
    return table[order].to(torch.int32).contiguous()
