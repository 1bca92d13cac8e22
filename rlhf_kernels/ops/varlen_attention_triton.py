"""Triton backend of :func:`rlhf_kernels.ops.varlen_attention.varlen_attention`.

FlashAttention-2 style kernels over packed sequences (flash-attn layout): q ``(total_q, H, D)``,
k/v ``(total_k, KVH, D)``, ``cu_seqlens_*`` int32 ``(batch + 1,)``, lse ``(H, total_q)`` fp32.
The semantics are those of ``varlen_attention_reference`` (bottom-right aligned causal mask,
``(left, right)`` sliding window, softcap, output 0 and lse ``-inf`` for a query that sees no key).

* Schedule (:mod:`.attention_schedule`): each launch walks a table of ``(sequence, block)``
  slots; the 1-D grid is slots x heads, in head sections (:func:`_head_section`): every slot
  of a few heads, heads inner, then the next heads. A section holds as many heads as fit half
  the L2 with the tensors their programs stream (all heads for small packs, so every head of
  the first slot starts first; one kv head at 128k tokens). With skewed lengths the table is
  flat, one slot per real block, heaviest block first (most keys or queries left visible by the
  mask), built on the device at every launch (one small kernel and a sort) and sized by a
  host-side bound (no ``cu_seqlens`` value is read back). When lengths are close to uniform it
  is the static ``batch x cdiv(max_len, block)`` rectangle, last block first, cached per shape:
  no per-call host work.
* Forward: one launch for the whole pack, grid ``slots * H``. Online softmax in fp32 with exp2
  (scores carried in log2 units); only the key blocks that the causal/window mask leaves visible
  to a query block are visited, so no ``T x T`` matrix exists anywhere.
* Addresses: the tiles a program keeps across its loop (q and out; k, v, dK and dV) use one 64-bit
  base per block and 32-bit offsets inside the tile; the streamed tiles keep per-row 64-bit
  offsets, which the software pipeline holds in fewer registers than a loop-carried pointer.
  The sm_90 register spills of the bf16/fp16 builds are pinned by a test (ptxas, no GPU needed).
* Backward: ``delta = rowsum(dO * O)`` (preprocess kernel), then a dK/dV kernel (one program per
  key block and KV head, summing the query heads of its GQA group; when that grid is smaller
  than two programs per SM the group is split across programs into fp32 partials, see
  :func:`_gqa_split`) and a dQ kernel (one program per query block and head). No atomics: the
  gradients are deterministic.

Block sizes (see :func:`_block_sizes`): the head dim is padded to ``BLOCK_D = max(16,
next_pow2(D))`` with masked loads. Under ``TRITON_INTERPRET=1`` every block is 16 (the smallest
``tl.dot`` tile) so the CPU interpreter stays fast. On CUDA the defaults come from a sweep on an
H100 (``bench/attn_sweep.py``, 32k-token causal bf16 packs; results in ``bench/results``):
forward ``128 x 64`` (8 warps, 3 stages) at ``BLOCK_D = 64``, ``128 x 128`` at 128; backward
``64 x 64`` with 4 warps (3 stages at 64, 2 at 128), except fp16/bf16 at ``BLOCK_D = 64``: dQ
and, from 64k tokens, dK/dV at ``128 x 128`` with 8 warps (autotuning's picks there); halved for
fp32 inputs at ``BLOCK_D >= 128`` and above 128 (the shared memory per tile doubles). A launch
that runs out of shared memory (smaller GPUs) is retried with halved blocks, and the blocks that
fit are remembered.

Precision: fp16/bf16 dots multiply in the input dtype with fp32 accumulation. fp32 inputs use
exact fp32 products (``input_precision="ieee"``) unless
``torch.backends.cuda.matmul.allow_tf32`` is set, in which case they use TF32 as torch matmuls do.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from rlhf_kernels._checks import check_triton_device, device_guard
from rlhf_kernels.ops._once import once_differentiable_grads
from rlhf_kernels.ops.attention_schedule import _cdiv
from rlhf_kernels.ops.attention_schedule import schedule as _schedule
from rlhf_kernels.ops.attention_schedule import schedule_slots as _schedule_slots
from rlhf_kernels.ops.varlen_attention import fold_lse_grad

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


# fmt: off
# ----------------------------------------------------------------------------- shared pieces
@triton.jit
def _dot(a, b, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr):
    # DOT_F32: multiply in fp32. Only for bf16 under the interpreter, whose bf16 tl.dot is wrong
    # (numpy has no bf16); the operands are already rounded to bf16, so the result matches a GPU
    # bf16 x bf16 -> fp32 product up to summation order.
    if DOT_F32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PREC)


@triton.jit
def _tanh(x):
    # tanh(|x|) = (1 - e^{-2|x|}) / (1 + e^{-2|x|}): no overflow for any x, portable (no libdevice)
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # -2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _scores(q, k, start_m, start_n, lq, lk, diff, left, right, scale, softcap,
            HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
            DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Masked scores of the tile (rows ``start_m + [0, BLOCK_M)``, keys ``start_n + [0, BLOCK_N)``
    of one sequence) in log2 units, and tanh of the scaled scores (for the softcap backward).

    Query ``i`` sits at key ``i + diff`` (``diff = lk - lq``, bottom-right alignment). Masked
    entries are ``-inf``; tiles that the mask leaves fully visible skip the mask arithmetic.
    """
    s = _dot(q, tl.trans(k), DOT_PREC, DOT_F32) * scale
    t = s
    if SOFTCAP:
        t = _tanh(s / softcap)
        s = softcap * t
    s = s * LOG2E
    partial = (start_m + BLOCK_M > lq) | (start_n + BLOCK_N > lk)
    if HAS_RIGHT:  # last key vs the first row's right edge
        partial = partial | (start_n + BLOCK_N - 1 > start_m + diff + right)
    if HAS_LEFT:  # first key vs the last row's left edge
        partial = partial | (start_n < start_m + BLOCK_M - 1 + diff - left)
    if partial:
        rows = start_m + tl.arange(0, BLOCK_M)
        cols = start_n + tl.arange(0, BLOCK_N)
        valid = (rows[:, None] < lq) & (cols[None, :] < lk)
        qpos = rows[:, None] + diff
        if HAS_RIGHT:
            valid = valid & (cols[None, :] <= qpos + right)
        if HAS_LEFT:
            valid = valid & (cols[None, :] >= qpos - left)
        s = tl.where(valid, s, float("-inf"))
    return s, t


@triton.jit
def _key_range(
    start_m, lq, lk, diff, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``[lo, hi)`` keys that rows ``start_m .. start_m + BLOCK_M - 1`` may see; lo is aligned."""
    lo = start_m * 0
    hi = lk + 0
    if HAS_LEFT:
        lo = tl.maximum(start_m + diff - left, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        last = tl.minimum(start_m + BLOCK_M, lq) - 1
        hi = tl.minimum(last + diff + right + 1, lk)
    return lo, hi


@triton.jit
def _query_range(
    start_n, lq, lk, diff, left, right, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``[lo, hi)`` queries that may see keys ``start_n .. start_n + BLOCK_N - 1``."""
    # key j is visible to query i  <=>  i + diff - left <= j <= i + diff + right
    lo = start_n * 0
    hi = lq + 0
    if HAS_RIGHT:
        lo = tl.maximum(start_n - diff - right, 0)
        lo = (lo // BLOCK_M) * BLOCK_M
    if HAS_LEFT:
        last = tl.minimum(start_n + BLOCK_N, lk) - 1
        hi = tl.minimum(last - diff + left + 1, lq)
    return lo, hi


@triton.jit
def _diff(DIFF, b, lk, lq, HAS_DIFF: tl.constexpr):
    """Key index of query 0 of sequence ``b``: ``lk - lq`` (bottom-right aligned), or an explicit
    per-sequence value (ring attention tiles, whose queries start anywhere in the document)."""
    if HAS_DIFF:
        return tl.load(DIFF + b)
    else:
        return lk - lq


@triton.jit
def _program(pid, n_slots, sec):
    """Program ``pid`` -> ``(slot, head)``: heads in sections of ``sec`` (see
    :func:`_head_section`), every slot of a section before the next, ``sec`` heads inner."""
    per = n_slots * sec
    part = pid // per
    r = pid - part * per
    slot = r // sec
    return slot, part * sec + (r - slot * sec)


# ----------------------------------------------------------------------------- forward
@triton.jit
def _slot(SCHED, CU_Q, CU_K, DIFF, slot, HAS_DIFF: tl.constexpr):
    """Schedule slot ``slot``: ``(b, blk, q0, lq, k0, lk, diff)``; ``b < 0`` marks an unused
    slot (the table is sized by an upper bound, so no host sync is needed)."""
    b = tl.load(SCHED + 2 * slot)
    blk = tl.load(SCHED + 2 * slot + 1)
    bb = tl.maximum(b, 0)
    q0 = tl.load(CU_Q + bb)
    lq = tl.load(CU_Q + bb + 1) - q0
    k0 = tl.load(CU_K + bb)
    lk = tl.load(CU_K + bb + 1) - k0
    return b, blk, q0, lq, k0, lk, _diff(DIFF, bb, lk, lq, HAS_DIFF)


@triton.jit
def _fwd_kernel(
    Q, K, V, O, LSE, CU_Q, CU_K, DIFF, SCHED, n_slots, sec, stride_qt, stride_qh, stride_kt,
    stride_kh, stride_ot, stride_oh, stride_lh, scale, softcap, left, right, head_dim,
    GROUP: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, HAS_DIFF: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # 1-D grid of slots x heads (in sections, heads inner: _program); k and v share shape and
    # strides (contiguous copies)
    slot, h = _program(tl.program_id(0), n_slots, sec)
    b, blk, q0, lq, k0, lk, diff = _slot(SCHED, CU_Q, CU_K, DIFF, slot, HAS_DIFF)
    start_m = blk * BLOCK_M
    if (b < 0) | (start_m >= lq):  # unused slot, or past the sequence's end
        return
    kh = h // GROUP

    # q/out: a 64-bit base once per block, 32-bit offsets inside the tile
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    rows = start_m + offs_m
    row_ok = rows < lq
    tok0 = (q0 + start_m).to(tl.int64)
    q = tl.load(
        Q + tok0 * stride_qt + h * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
        mask=row_ok[:, None] & d_ok, other=0.0,
    )

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = _key_range(start_m, lq, lk, diff, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = (k0 + cols).to(tl.int64)[:, None] * stride_kt + kh * stride_kh + offs_d[None, :]
        kv_mask = (cols[:, None] < lk) & d_ok
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
        s, _ = _scores(
            q, k, start_m, start_n, lq, lk, diff, left, right, scale, softcap, HAS_LEFT,
            HAS_RIGHT, SOFTCAP, DOT_PREC, DOT_F32, BLOCK_M, BLOCK_N,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PREC, DOT_F32)
        m_i = m_new

    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]  # rows that saw no key: acc == 0 -> out 0
    lse = tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    tl.store(
        O + tok0 * stride_ot + h * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
        out.to(O.dtype.element_ty), mask=row_ok[:, None] & d_ok,
    )
    tl.store(LSE + h.to(tl.int64) * stride_lh + tok0 + offs_m, lse, mask=row_ok)


# ----------------------------------------------------------------------------- backward
@triton.jit
def _bwd_delta_kernel(
    O, DO, DELTA, total, stride_ot, stride_oh, stride_dt, stride_dh, stride_lh, head_dim,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # DELTA (H, total_q) fp32 = rowsum(dO * O)
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    t64 = toks.to(tl.int64)
    mask = (toks[:, None] < total) & (offs_d[None, :] < head_dim)
    o = tl.load(
        O + t64[:, None] * stride_ot + h * stride_oh + offs_d[None, :], mask=mask, other=0.0
    )
    do = tl.load(
        DO + t64[:, None] * stride_dt + h * stride_dh + offs_d[None, :], mask=mask, other=0.0
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + h.to(tl.int64) * stride_lh + t64, delta, mask=toks < total)


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, DIFF, SCHED, n_slots, sec, stride_qt,
    stride_qh, stride_kt, stride_kh, stride_lh, stride_split, scale, softcap, left, right, head_dim,
    GROUP: tl.constexpr, SPLIT: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
    HAS_DIFF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # 1-D grid of key-block slots x (KVH * SPLIT) (in sections: _program): program (slot, kh *
    # SPLIT + sp) sums query heads [sp * GROUP // SPLIT, (sp + 1) * GROUP // SPLIT) of kv head
    # kh's group into DK/DV[sp] (SPLIT > 1: fp32 partials the host sums; no atomics,
    # deterministic). q/dO share strides; k/v/dk/dv share strides; lse/delta are (H, total_q).
    slot, hs = _program(tl.program_id(0), n_slots, sec)
    b, blk, q0, lq, k0, lk, diff = _slot(SCHED, CU_Q, CU_K, DIFF, slot, HAS_DIFF)
    if b < 0:  # unused slot
        return
    start_n = blk * BLOCK_N
    kh = hs // SPLIT
    sp = hs % SPLIT

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    cols = start_n + offs_n
    kv_mask = (cols[:, None] < lk) & d_ok
    kv_off = (k0 + start_n).to(tl.int64) * stride_kt + kh * stride_kh
    kv_tile = offs_n[:, None] * stride_kt + offs_d[None, :]
    k = tl.load(K + kv_off + kv_tile, mask=kv_mask, other=0.0)
    v = tl.load(V + kv_off + kv_tile, mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)

    # (empty loops when lq == 0 or no query sees this block: dk/dv rows are stored as zeros)
    lo, hi = _query_range(start_n, lq, lk, diff, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    hi = tl.where(start_n < lk, hi, lo)  # past the sequence's end (rectangle): nothing to do
    for g in range(GROUP // SPLIT):  # this program's query heads of the group
        h = kh * GROUP + sp * (GROUP // SPLIT) + g
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + offs_m
            row_ok = rows < lq
            q_tok = (q0 + rows).to(tl.int64)
            q_off = q_tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :]
            q = tl.load(Q + q_off, mask=row_ok[:, None] & d_ok, other=0.0)
            do = tl.load(DO + q_off, mask=row_ok[:, None] & d_ok, other=0.0)
            lse = tl.load(LSE + h.to(tl.int64) * stride_lh + q_tok, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + h.to(tl.int64) * stride_lh + q_tok, mask=row_ok, other=0.0)
            s, t = _scores(
                q, k, start_m, start_n, lq, lk, diff, left, right, scale, softcap, HAS_LEFT,
                HAS_RIGHT, SOFTCAP, DOT_PREC, DOT_F32, BLOCK_M, BLOCK_N,
            )
            # a row with lse == -inf sees no key: all its s are -inf, so p == 0 with lse -> 0
            lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
            p = tl.exp2(s - lse2[:, None])  # (BLOCK_M, BLOCK_N) probabilities
            dv += _dot(tl.trans(p.to(do.dtype)), do, DOT_PREC, DOT_F32)
            dp = _dot(do, tl.trans(v), DOT_PREC, DOT_F32)
            ds = p * (dp - delta[:, None])  # d loss / d (capped, scaled) score
            if SOFTCAP:
                ds = ds * (1.0 - t * t)
            dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PREC, DOT_F32)

    dk = dk * scale
    out_off = sp.to(tl.int64) * stride_split + kv_off
    tl.store(DK + out_off + kv_tile, dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off + kv_tile, dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, CU_Q, CU_K, DIFF, SCHED, n_slots, sec, stride_qt, stride_qh,
    stride_kt, stride_kh, stride_lh, scale, softcap, left, right, head_dim, GROUP: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, HAS_DIFF: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # 1-D grid of query-block slots x H (in sections: _program); q/dO/dQ share strides; k/v
    # share strides
    slot, h = _program(tl.program_id(0), n_slots, sec)
    b, blk, q0, lq, k0, lk, diff = _slot(SCHED, CU_Q, CU_K, DIFF, slot, HAS_DIFF)
    if b < 0:  # unused slot
        return
    start_m = blk * BLOCK_M
    kh = h // GROUP

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d[None, :] < head_dim
    row_ok = start_m + offs_m < lq
    tok0 = (q0 + start_m).to(tl.int64)
    q_off = tok0 * stride_qt + h * stride_qh
    q_tile = offs_m[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(Q + q_off + q_tile, mask=row_ok[:, None] & d_ok, other=0.0)
    do = tl.load(DO + q_off + q_tile, mask=row_ok[:, None] & d_ok, other=0.0)
    lse = tl.load(LSE + h.to(tl.int64) * stride_lh + tok0 + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + h.to(tl.int64) * stride_lh + tok0 + offs_m, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * LOG2E)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    lo, hi = _key_range(start_m, lq, lk, diff, left, right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)
    hi = tl.where(start_m < lq, hi, lo)  # past the sequence's end (rectangle): nothing to do
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = (k0 + cols).to(tl.int64)[:, None] * stride_kt + kh * stride_kh + offs_d[None, :]
        kv_mask = (cols[:, None] < lk) & d_ok
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
        s, t = _scores(
            q, k, start_m, start_n, lq, lk, diff, left, right, scale, softcap, HAS_LEFT,
            HAS_RIGHT, SOFTCAP, DOT_PREC, DOT_F32, BLOCK_M, BLOCK_N,
        )
        p = tl.exp2(s - lse2[:, None])
        dp = _dot(do, tl.trans(v), DOT_PREC, DOT_F32)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq += _dot(ds.to(k.dtype), k, DOT_PREC, DOT_F32)

    dq = dq * scale
    tl.store(DQ + q_off + q_tile, dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & d_ok)


# fmt: on


# ----------------------------------------------------------------------------- host side
def _block_sizes(
    head_dim: int, dtype: torch.dtype, kernel: str, tokens: int = 0
) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of ``kernel`` (``"fwd"``, ``"dkdv"`` or
    ``"dq"``) for a padded head dim and a pack of ``tokens`` (rule in the module docstring).
    Starting points for Hopper/Ampere; the interpreter always gets 16 x 16."""
    if kernel not in ("fwd", "dkdv", "dq"):
        raise ValueError(f"kernel must be 'fwd', 'dkdv' or 'dq', got {kernel!r}")
    if _interpreting():
        return 16, 16, 1, 1
    block_d = _block_d(head_dim)
    if kernel == "fwd":
        bm, bn, warps, stages = (128, 64, 8, 3) if block_d <= 64 else (128, 128, 8, 3)
        if block_d > 128:
            bm, bn, warps, stages = 64, 32, 8, 2
    else:
        bm, bn, warps, stages = (64, 64, 4, 3) if block_d <= 64 else (64, 64, 4, 2)
        # autotuning's picks on an H100 at head_dim 64 (bench/results/attn-host-*): 128 x 128
        # for dQ (at 32k and 128k tokens; used at every size), for dK/dV at 128k (fwd+bwd 150
        # ms instead of 198 there); narrower heads were not measured and keep 64 x 64
        half = dtype in (torch.float16, torch.bfloat16)
        if half and block_d == 64 and (kernel == "dq" or tokens >= 1 << 16):
            bm, bn, warps, stages = 128, 128, 8, 3
        if block_d > 128:
            bm, bn, warps, stages = 32, 32, 4, 2
    if dtype == torch.float32 and block_d >= 128:
        bm, bn = max(bm // 2, 16), max(bn // 2, 16)
    return bm, bn, warps, stages


def _block_d(head_dim: int) -> int:
    return max(16, 1 << (head_dim - 1).bit_length())


# (kernel name, device, dtype, requested blocks, constexprs) -> blocks that fit in shared memory
# (or, with autotuning on, the fastest that fit); fp32 and bf16 may share every constexpr (TF32)
# but not their shared-memory need
_FITTING_BLOCKS: dict = {}

# Autotuning candidates (BLOCK_M, BLOCK_N, warps, stages): the default first, then the best of the
# H100 sweep (bench/results/attn-sweep-*), with halved tiles where the default is already small
# (fp32 or BLOCK_D > 128); candidates that overflow shared memory are skipped.
_TUNE_FWD = ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2))
_TUNE_BWD = ((64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 4, 3), (128, 128, 8, 3))


def _autotune_on(device: torch.device) -> bool:
    """``RLHF_KERNELS_AUTOTUNE=1``: time the candidate blocks on the first launch of each
    (kernel, head dim, dtype, mask flags) on a CUDA device and keep the fastest."""
    return device.type == "cuda" and os.environ.get("RLHF_KERNELS_AUTOTUNE", "0") == "1"


def _candidates(blocks, backward: bool) -> list[tuple[int, int, int, int]]:
    shrink = min(blocks[0], blocks[1]) < 64
    out = [blocks]
    for bm, bn, warps, stages in _TUNE_BWD if backward else _TUNE_FWD:
        if shrink:
            bm, bn = max(bm // 2, 16), max(bn // 2, 16)
        if (bm, bn, warps, stages) not in out:
            out.append((bm, bn, warps, stages))
    return out


def _time_ms(fn, reps: int = 5) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA stream (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _tune(kernel, make, meta, candidates):
    """Fastest of ``candidates`` on this call's inputs (the kernels overwrite their outputs, so
    repeated launches are harmless); configurations that overflow shared memory are skipped."""
    best, best_ms = None, float("inf")
    for bm, bn, warps, stages in candidates:
        grid, args = make(bm, bn)

        def run(bm=bm, bn=bn, warps=warps, stages=stages, grid=grid, args=args):
            kernel[grid](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)

        try:
            ms = _time_ms(run)
        except OutOfResources:
            continue
        if ms < best_ms:
            best, best_ms = (bm, bn, warps, stages), ms
    return best or candidates[0]


def _launch(kernel, make, meta, blocks, device, backward=False, tokens=0, dtype=None):
    """Launch ``kernel`` with ``grid, args = make(BLOCK_M, BLOCK_N)``; on a shared-memory overflow
    halve the blocks (down to 16) and retry.

    The blocks that fit are remembered, so the overflow is paid once per configuration; with
    autotuning on (:func:`_autotune_on`) the first launch of a configuration and pack size
    (``tokens``, to the next power of two) picks the fastest candidate instead.
    """
    tune = _autotune_on(device)
    size = 1 << (max(int(tokens), 1) - 1).bit_length() if tune else None
    key = (kernel.fn.__name__, str(device), str(dtype), blocks, tuple(sorted(meta.items())), size)
    if key not in _FITTING_BLOCKS and tune:
        _FITTING_BLOCKS[key] = _tune(kernel, make, meta, _candidates(blocks, backward))
    bm, bn, warps, stages = _FITTING_BLOCKS.get(key, blocks)
    while True:
        grid, args = make(bm, bn)
        if grid[0] == 0:  # nothing to schedule
            return
        try:
            kernel[grid](*args, **meta, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            _FITTING_BLOCKS[key] = (bm, bn, warps, stages)
            return
        except OutOfResources:
            if bm == 16 and bn == 16 and stages == 1:
                raise
            bm, bn, stages = max(bm // 2, 16), max(bn // 2, 16), 1


def _gqa_split(slots: int, kv_heads: int, group: int, device: torch.device) -> int:
    """Programs per GQA group in the dK/dV launch: 1 (each program sums all ``group`` query
    heads) unless the grid is smaller than two programs per SM; then the group is split in
    powers of two (fp32 partials summed on the host) until it is, or every head has its own."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    split = 1
    while slots * kv_heads * split < 2 * sms and group % (2 * split) == 0:
        split *= 2
    return split


def _head_section(device: torch.device, n_heads: int, unit: int, unit_bytes: int) -> int:
    """Heads per section of a launch's grid (``_program``): a multiple of ``unit`` (the grid
    heads that read one kv head) dividing ``n_heads``.

    A launch runs every slot of one section of heads before the next, so the programs in flight
    stream the tensors of a few heads (``unit_bytes`` per ``unit``) and find them in L2 when
    the section's share fits half of it. With all heads in one section (the order before
    sections, kept where everything fits), a 128k-token pack keeps every head's K/V in flight
    at once. ``RLHF_KERNELS_HEAD_SECTION``: ``auto`` (default; all heads off CUDA), ``all``, or
    a number of kv heads per section (rounded down to a divisor)."""
    env = os.environ.get("RLHF_KERNELS_HEAD_SECTION", "auto")
    return _section(env, n_heads, unit, unit_bytes, _l2_bytes(device) if env == "auto" else 0)


@functools.lru_cache(maxsize=256)
def _section(env: str, n_heads: int, unit: int, unit_bytes: int, l2: int) -> int:
    units = n_heads // unit
    if env == "all" or (env == "auto" and not l2):
        return n_heads
    if env == "auto":
        want = l2 // 2 // max(unit_bytes, 1)
    elif env.isdigit() and int(env) > 0:
        want = int(env)
    else:
        raise ValueError(
            f"RLHF_KERNELS_HEAD_SECTION must be 'auto', 'all' or a number of kv heads >= 1, "
            f"got {env!r}"
        )
    return unit * max(d for d in range(1, units + 1) if units % d == 0 and d <= max(want, 1))


@functools.lru_cache(maxsize=16)
def _l2_bytes(device: torch.device) -> int:
    """L2 cache bytes of a CUDA device (0 elsewhere, or where torch does not report it)."""
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)


# window sides at or past this are unbounded: the kernels add them to int32 token indices, and
# no sequence reaches it (triton_varlen_attention refuses longer ones)
_WINDOW_CAP = 1 << 30


def _mask_meta(causal: bool, window_size: tuple[int, int]) -> tuple[int, int, bool, bool]:
    """``(left, right, has_left, has_right)`` of a mask: sides >= 0, -1 (and sides of at least
    ``_WINDOW_CAP``, which hide nothing) unbounded."""
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0
    left, right = (-1 if w >= _WINDOW_CAP else w for w in (left, right))
    return max(left, 0), max(right, 0), left >= 0, right >= 0


def _kernel_meta(q, k, mask, softcap, diff) -> dict:
    """The constexprs every attention kernel takes (``mask`` from ``_mask_meta``)."""
    return dict(
        GROUP=q.shape[1] // k.shape[1],
        HAS_LEFT=mask[2],
        HAS_RIGHT=mask[3],
        SOFTCAP=softcap > 0,
        **_dot_meta(q.dtype),
        HAS_DIFF=diff is not None,
        BLOCK_D=_block_d(q.shape[2]),
    )


def varlen_attention_triton_forward(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    diff: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    q_schedules: dict | None = None,
):
    """Forward kernel launch. Inputs as in :func:`triton_varlen_attention` (contiguous).

    ``diff``: optional int32 ``(batch,)``, the key index that query 0 of each sequence sits at
    (default ``lk - lq``, bottom-right alignment); ring attention tiles set it.
    ``q_schedules``: a dict that receives the query-block schedule built here, by ``BLOCK_M``
    (the backward's dQ launch takes it when its block is the same: one schedule build less).
    Returns ``(out, lse)``: out ``(total_q, H, D)`` in ``out_dtype`` (default q's dtype), lse
    ``(H, total_q)`` fp32.
    """
    del max_seqlen_k  # key loops are bounded per sequence inside the kernel
    total_q, heads, dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty_like(q, dtype=out_dtype or q.dtype)
    lse = torch.empty(heads, total_q, dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0:
        return out, lse
    mask = _mask_meta(causal, window_size)
    left, right = mask[:2]

    def make(bm, bn):
        sched = _schedule(cu_seqlens_q, cu_seqlens_k, diff, bm, False, mask, total_q, max_seqlen_q)
        if q_schedules is not None:
            q_schedules[bm] = sched
        slots = sched.shape[0]
        args = (
            q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
            cu_seqlens_q if diff is None else diff, sched, slots, sec, q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), out.stride(0), out.stride(1), lse.stride(0),
            float(softmax_scale), float(softcap), left, right, dim,
        )  # fmt: skip
        return (slots * heads,), args

    meta = _kernel_meta(q, k, mask, softcap, diff)
    blocks = _block_sizes(dim, q.dtype, "fwd", total_q)
    # every program of a section streams K and V of its kv head
    sec = _head_section(q.device, heads, meta["GROUP"], 2 * k.shape[0] * dim * k.element_size())
    _launch(_fwd_kernel, make, meta, blocks, q.device, tokens=total_q, dtype=q.dtype)
    return out, lse


def varlen_attention_triton_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
    diff: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
    grad_dtype: torch.dtype | None = None,
    gqa_split: int | None = None,
    dlse: torch.Tensor | None = None,
    q_schedules: dict | None = None,
):
    """Backward kernel launches: ``(dq, dk, dv)`` in the shapes of q, k, v and their dtypes (or
    ``grad_dtype``).

    ``dout`` ``(total_q, H, D)`` is the gradient of ``out``; ``lse`` the forward's ``(H, total_q)``.
    ``diff`` as in the forward. ``delta``: ``rowsum(dout * out)`` ``(H, total_q)`` fp32 when the
    caller has it (ring attention: from the merged output; ``out`` is then not read).
    ``dlse``: the gradient of ``lse`` ``(H, total_q)``, if any (see :func:`fold_lse_grad`).
    ``q_schedules``: the forward's query-block schedules (its ``q_schedules``), built from the
    same ``cu_seqlens``, ``diff``, mask and lengths as this call's.
    """
    total_q, heads, dim = q.shape
    batch = cu_seqlens_q.numel() - 1
    dout = dout.contiguous()
    dq, dk, dv = (torch.empty_like(t, dtype=grad_dtype or t.dtype) for t in (q, k, v))
    if batch == 0 or total_q == 0 or k.shape[0] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    block_d = _block_d(dim)
    if delta is not None:
        delta = fold_lse_grad(delta, dlse, lse)
        return _backward_kernels(
            dout, q, k, v, lse, delta, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
            max_seqlen_k, softmax_scale, causal, window_size, softcap, diff, gqa_split,
            q_schedules,
        )  # fmt: skip
    delta = torch.empty_like(lse)
    block_t = 16 if _interpreting() else 64
    _bwd_delta_kernel[(_cdiv(total_q, block_t), heads)](
        out,
        dout,
        delta,
        total_q,
        out.stride(0),
        out.stride(1),
        dout.stride(0),
        dout.stride(1),
        delta.stride(0),
        dim,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
    )
    delta = fold_lse_grad(delta, dlse, lse)
    return _backward_kernels(
        dout, q, k, v, lse, delta, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, softmax_scale, causal, window_size, softcap, diff, gqa_split,
        q_schedules,
    )  # fmt: skip


def _backward_kernels(
    dout, q, k, v, lse, delta, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
    max_seqlen_k, softmax_scale, causal, window_size, softcap, diff, gqa_split=None,
    q_schedules=None,
):  # fmt: skip
    """The dK/dV and dQ launches, writing into ``dk, dv, dq``; returns ``(dq, dk, dv)``."""
    heads, dim, kv_heads = q.shape[1], q.shape[2], k.shape[1]
    total_q, total_k = q.shape[0], k.shape[0]
    batch = cu_seqlens_q.numel() - 1
    group = heads // kv_heads
    mask = _mask_meta(causal, window_size)
    left, right = mask[:2]
    cu_diff = cu_seqlens_q if diff is None else diff
    meta = _kernel_meta(q, k, mask, softcap, diff)
    blocks_kv = _block_sizes(dim, q.dtype, "dkdv", total_k)
    blocks_q = _block_sizes(dim, q.dtype, "dq", total_q)
    split = gqa_split or _gqa_split(
        _schedule_slots(total_k, batch, max_seqlen_k, blocks_kv[1]), kv_heads, group, q.device
    )
    if not (isinstance(split, int) and split >= 1 and group % split == 0):
        raise ValueError(
            f"gqa_split={split!r} must be an int >= 1 dividing the GQA group size {group}"
        )
    # split > 1: fp32 partial sums per slice of the group, (split, total_k, KVH, D)
    gk, gv = (dk, dv) if split == 1 else (k.new_empty((split, *k.shape), dtype=torch.float32)
                                          for _ in range(2))  # fmt: skip

    def make_dkdv(bm, bn):
        sched = _schedule(cu_seqlens_q, cu_seqlens_k, diff, bn, True, mask, total_k, max_seqlen_k)
        slots = sched.shape[0]
        args = (
            q, k, v, dout, lse, delta, gk, gv, cu_seqlens_q, cu_seqlens_k, cu_diff, sched,
            slots, sec_kv, q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
            gk.stride(0) if split > 1 else 0,
            float(softmax_scale), float(softcap), left, right, dim,
        )  # fmt: skip
        return (slots * kv_heads * split,), args

    def make_dq(bm, bn):
        sched = q_schedules.get(bm) if q_schedules else None  # the forward's, same inputs
        if sched is None:
            sched = _schedule(
                cu_seqlens_q, cu_seqlens_k, diff, bm, False, mask, total_q, max_seqlen_q
            )
        slots = sched.shape[0]
        args = (
            q, k, v, dout, lse, delta, dq, cu_seqlens_q, cu_seqlens_k, cu_diff, sched, slots,
            sec_q, q.stride(0), q.stride(1), k.stride(0), k.stride(1), lse.stride(0),
            float(softmax_scale), float(softcap), left, right, dim,
        )  # fmt: skip
        return (slots * heads,), args

    # dK/dV programs stream q, dO (and lse, delta) of their query heads; dQ ones K and V
    per_q = total_q * (2 * dim * q.element_size() + 8)  # per query head
    sec_kv = _head_section(q.device, kv_heads * split, split, per_q * group)
    sec_q = _head_section(q.device, heads, group, 2 * total_k * dim * k.element_size())
    meta_kv = dict(meta, SPLIT=split)
    _launch(_bwd_dkdv_kernel, make_dkdv, meta_kv, blocks_kv, q.device, True, total_k, q.dtype)
    if split > 1:
        dk.copy_(gk.sum(0))
        dv.copy_(gv.sum(0))
    _launch(_bwd_dq_kernel, make_dq, meta, blocks_q, q.device, True, total_q, q.dtype)
    # every token of dq/dk/dv is written: the schedules hold every block of every sequence
    return dq, dk, dv


def _dot_meta(dtype: torch.dtype) -> dict:
    """fp32 inputs: exact fp32 products, or TF32 where torch's own matmuls use it
    (``torch.backends.cuda.matmul.allow_tf32``); fp16/bf16 use their tensor-core dots."""
    f32 = dtype == torch.bfloat16 and _interpreting()
    exact = dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    return dict(DOT_PREC="ieee" if exact or f32 else "tf32", DOT_F32=f32)


class VarlenAttentionTriton(torch.autograd.Function):
    """Autograd wrapper: differentiable in q, k, v through ``out`` and ``lse``, once (a double
    backward through its gradients raises, see :mod:`rlhf_kernels.ops._once`)."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        window_size,
        softcap,
    ):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # the kernels read cu_seqlens[b] at base + b: int32 and unit stride
        cu_seqlens_q = cu_seqlens_q.to(torch.int32).contiguous()
        cu_seqlens_k = cu_seqlens_k.to(torch.int32).contiguous()
        ctx.q_schedules = {}  # the forward's query-block table, reused by the dQ launch
        with device_guard(q):
            out, lse = varlen_attention_triton_forward(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                softmax_scale,
                causal,
                window_size,
                softcap,
                q_schedules=ctx.q_schedules,
            )
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.params = (max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap)
        ctx.set_materialize_grads(False)  # an unused lse costs nothing in the backward
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        with device_guard(q):
            dq, dk, dv = varlen_attention_triton_backward(
                dout,
                q,
                k,
                v,
                out,
                lse,
                cu_q,
                cu_k,
                *ctx.params,
                dlse=dlse,
                q_schedules=ctx.q_schedules,
            )
        dq, dk, dv = once_differentiable_grads(  # create_graph=True: a 2nd backward raises
            "varlen_attention(backend='triton')", (dq, dk, dv), (q, k, v, dout, dlse)
        )
        return dq, dk, dv, None, None, None, None, None, None, None, None


def triton_varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int],
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed attention with Triton kernels (called by ``varlen_attention(backend="triton")``).

    The caller has validated shapes and ``cu_seqlens`` (see ``varlen_attention``).

    Args:
        q: ``(total_q, H, D)`` fp32/fp16/bf16, ``D <= 256``.
        k, v: ``(total_k, KVH, D)``, same dtype; ``H % KVH == 0`` (query head ``h`` reads kv head
            ``h // (H // KVH)``).
        cu_seqlens_q, cu_seqlens_k: int32/int64 ``(batch + 1,)`` prefix sums of the lengths.
        max_seqlen_q, max_seqlen_k: the longest query / key sequence (grid sizes).
        softmax_scale: multiplies ``q @ k^T`` before softcap and masking.
        causal: bottom-right aligned causal mask (forces the window's right side to 0).
        window_size: ``(left, right)``, -1 = unbounded on that side.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)``.

    Returns:
        ``(out, lse)``: out ``(total_q, H, D)`` in q's dtype (0 for a query that sees no key),
        lse ``(H, total_q)`` fp32 natural-log log-sum-exp (``-inf`` for such a query).
    """
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"backend='triton' needs fp32/fp16/bf16 tensors, got {q.dtype}")
    if max(int(max_seqlen_q), int(max_seqlen_k)) >= _WINDOW_CAP:
        raise ValueError(
            f"backend='triton' takes sequences shorter than 2**30 tokens, got "
            f"max_seqlen_q={max_seqlen_q}, max_seqlen_k={max_seqlen_k}"
        )
    check_triton_device("q", q)
    return VarlenAttentionTriton.apply(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        float(softmax_scale),
        bool(causal),
        (int(window_size[0]), int(window_size[1])),
        float(softcap),
    )
