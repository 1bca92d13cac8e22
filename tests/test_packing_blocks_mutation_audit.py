"""Mutation audit of packing.py and ring/blocks.py: pins the behaviour that mutants of these
files changed while the existing tests still passed.

packing: ``causal_lm_labels`` ignores every sample's first token, the first sample's included;
``shifted_labels`` is int64 even for int32 token ids; an empty plan has one (empty) list per
group; best fit and the minimum-slack fill take exact fits; a micro-batch is split into balanced
halves (largest sample first) and the fullest micro-batch is the one split.

ring/blocks: ``segment_pairs`` (the Triton block list, built on CPU here) lists exactly the
(query segment, key segment) pairs with a visible pair, with int32 ``cu``/``diff`` and the right
max lengths (brute force over positions); ``tile_pairs`` is cached per tile size; a zero window
side masks to the diagonal, and a simulated ring with one matches the float64 reference
(forward and backward, explicit and fused tiles); the fused kernel is only taken for
all-visible tiles or the aligned square causal diagonal; ``_merge`` and ``_merge_rows`` fold
partial results with their lse weights (float64 reference, lse near 1000, repeated rows, a
filled accumulator) and leave rows that saw nothing at (0, -inf).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from rlhf_kernels import packing
from rlhf_kernels.ops.varlen_attention import varlen_attention_reference
from rlhf_kernels.packing import pack_sequences, plan_micro_batches
from rlhf_kernels.ring import blocks
from rlhf_kernels.ring.plan import RingPlan


# ----------------------------------------------------------------------------- packing
def test_causal_lm_labels_ignore_the_first_token_of_every_sample_including_the_first():
    packed = pack_sequences([torch.tensor([7, 8, 9]), torch.tensor([4, 5]), torch.tensor([6])])
    assert packed.causal_lm_labels().tolist() == [-100, 8, 9, -100, 5, -100]
    mask = torch.tensor([1, 1, 0, 1, 1, 1])
    assert packed.causal_lm_labels(mask, ignore_index=-1).tolist() == [-1, 8, -1, -1, 5, -1]


def test_shifted_labels_are_int64_for_int32_token_ids():
    seqs = [torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32)]
    packed = pack_sequences(seqs)
    labels = packed.shifted_labels()
    assert labels.dtype == torch.int64
    assert labels.tolist() == [2, 3, -100, 5, -100]
    assert packed.causal_lm_labels().dtype == torch.int64


@pytest.mark.parametrize("num_groups", [1, 3])
def test_plan_of_no_samples_has_one_empty_list_per_group(num_groups):
    assert plan_micro_batches([], 8, num_groups=num_groups) == [[] for _ in range(num_groups)]


def test_best_fit_decreasing_takes_an_exact_fit():
    # 6 opens a micro-batch with 4 free; 4 fits it exactly, 5 then needs a new one
    assert packing._best_fit_decreasing([0, 1, 2], [6, 4, 5], 10) == [[0, 1], [2]]


def test_fill_bins_takes_a_sample_that_fills_the_slack_exactly():
    assert packing._fill_bins([0, 1], [3, 2], 5, packing._Budget(0)) == [[0, 1]]
    assert packing._fill_bins([0, 1], [3, 2], 5, packing._Budget(100)) == [[0, 1]]


def test_split_bin_gives_the_largest_sample_first_to_the_lighter_half():
    for lens, loads in (([1, 1, 2], [2, 2]), ([4, 3, 3, 2], [6, 6])):
        halves = packing._split_bin(list(range(len(lens))), lens)
        assert sorted(i for h in halves for i in h) == list(range(len(lens)))
        assert sorted(sum(lens[i] for i in h) for h in halves) == loads


def test_rounding_up_to_the_groups_splits_the_fullest_micro_batch():
    # packs into [6,4] (10), [6,3] (9), [6]; two groups need 4 micro-batches: splitting the
    # fullest leaves at most 9 tokens in any micro-batch, splitting [6,3] would keep a full one
    lens = [6, 4, 6, 3, 6]
    plan = plan_micro_batches(lens, 10, num_groups=2)
    assert [len(g) for g in plan] == [2, 2]
    assert sorted(i for g in plan for b in g for i in b) == list(range(5))
    assert max(sum(lens[i] for i in b) for g in plan for b in g) == 9


# ----------------------------------------------------------------------------- ring blocks
LENGTHS = [3, 17, 1, 12]


def _plan(world=3, layout="zigzag"):
    cu = torch.tensor(list(itertools.accumulate([0, *LENGTHS])), dtype=torch.int32)
    return RingPlan.build(cu, world, layout), cu


def _visible(qp, qn, kp, kn, left, right):
    return any(
        (right < 0 or j <= i + right) and (left < 0 or j >= i - left)
        for i in range(qp, qp + qn)
        for j in range(kp, kp + kn)
    )


@pytest.mark.parametrize("left,right", [(-1, 0), (2, 0), (0, 3), (3, 1), (1, -1)])
def test_segment_pairs_are_exactly_the_segment_pairs_with_a_visible_pair(left, right):
    plan, _ = _plan()
    for rank, src in itertools.product(range(plan.world_size), repeat=2):
        want = [
            (qs, qn, ks, kn, qp - kp)
            for qs, qn, d, qp in plan.segments(rank)
            for ks, kn, dk, kp in plan.segments(src)
            if d == dk and _visible(qp, qn, kp, kn, left, right)
        ]
        got = blocks.segment_pairs(plan, rank, src, left, right, "cpu")
        if not want:
            assert got is None
            continue
        idx_q, idx_k, cu_q, cu_k, diff, max_q, max_k = got
        lq, lk = cu_q.diff().tolist(), cu_k.diff().tolist()
        assert cu_q.dtype == cu_k.dtype == diff.dtype == torch.int32
        assert sorted(zip(lq, lk, diff.tolist())) == sorted((w[1], w[3], w[4]) for w in want)
        assert (max_q, max_k) == (max(lq), max(lk))
        starts = sorted((int(idx_q[a]), int(idx_k[b])) for a, b in zip(cu_q[:-1], cu_k[:-1]))
        assert starts == sorted((w[0], w[2]) for w in want)


def test_tile_pairs_are_cached_per_tile_size():
    plan, _ = _plan()
    big = blocks.tile_pairs(plan, 1, 1, True, (-1, -1), 8)
    small = blocks.tile_pairs(plan, 1, 1, True, (-1, -1), 2)
    assert max(ta for _, ta, _, _, _ in big) > 2
    assert max(max(ta, tb) for _, ta, _, tb, _ in small) <= 2


def test_tile_mask_with_zero_window_sides():
    i = torch.arange(2, 6).unsqueeze(1)
    j = torch.arange(0, 7).unsqueeze(0)
    assert torch.equal(blocks._tile_mask(4, 7, 2, 0, 0, -1, "cpu"), j >= i)
    assert torch.equal(blocks._tile_mask(4, 7, 2, 0, -1, 0, "cpu"), j <= i)
    assert torch.equal(blocks._tile_mask(4, 7, 2, 0, 0, 0, "cpu"), j == i)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("window", [(0, 2), (0, 0), (2, -1)])
def test_simulated_ring_with_a_zero_window_side_matches_the_reference(window, fused):
    """Forward and backward of every (rank, src) block in one process against the float64
    ``varlen_attention_reference``; a zero window side (only the diagonal on that side). The
    fused CPU kernel runs in float32 only (``ring_varlen_attention`` never fuses float64)."""
    dtype = torch.float32 if fused else torch.float64
    plan, cu = _plan()
    g = torch.Generator().manual_seed(3)
    total = sum(LENGTHS)
    q, do = (torch.randn(total, 4, 8, generator=g, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(total, 2, 8, generator=g, dtype=torch.float64) for _ in "kv")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = varlen_attention_reference(*leaves, cu, cu, causal=False, window_size=window)
    ref.backward(do)
    spec = SimpleNamespace(scale=8**-0.5, softcap=0.0, left=window[0], right=window[1], fused=fused)
    world = plan.world_size
    shards = ([plan.shard(t.to(dtype), r) for r in range(world)] for t in (q, k, v, do))
    qs, ks, vs, dos = shards
    outs, lses = [], []
    for r in range(world):
        acc_o = torch.zeros_like(qs[r])
        acc_lse = torch.full((4, plan.local_len), float("-inf"), dtype=dtype)
        for src in range(world):
            pairs = blocks.tile_pairs(plan, r, src, False, window, 4)
            blocks.forward_block(spec, qs[r], ks[src], vs[src], pairs, acc_o, acc_lse)
        outs.append(acc_o)
        lses.append(acc_lse)
    dq, dk, dv = ([torch.zeros_like(t) for t in ts] for ts in (qs, ks, vs))
    for r in range(world):
        delta = (dos[r] * outs[r]).sum(-1).T.contiguous()
        for src in range(world):
            pairs = blocks.tile_pairs(plan, r, src, False, window, 4)
            args = (qs[r], ks[src], vs[src], outs[r], dos[r], lses[r], delta, pairs)
            blocks.backward_block(spec, *args, dq[r], dk[src], dv[src])
    got = [plan.unshard(t) for t in (outs, dq, dk, dv)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, [ref, *(t.grad for t in leaves)]):
        tol = 1e-5 if fused else 1e-10
        torch.testing.assert_close(
            a.double(), b, rtol=tol, atol=tol, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_merge_weights_partials_by_their_lse():
    """Two partial results of one row merge to the softmax-weighted mix; a row that saw
    nothing in either stays (0, -inf) without NaN."""
    g = torch.Generator().manual_seed(0)
    o1, o2 = (torch.randn(3, 2, 4, generator=g, dtype=torch.float64) for _ in "12")
    l1, l2 = (torch.randn(2, 3, generator=g, dtype=torch.float64) for _ in "12")
    l1[:, 2] = l2[:, 2] = float("-inf")
    o1[2] = o2[2] = 0.0
    acc_o = torch.zeros(5, 2, 4, dtype=torch.float64)
    acc_lse = torch.full((2, 5), float("-inf"), dtype=torch.float64)
    blocks._merge(acc_o, acc_lse, 1, 3, o1, l1)
    blocks._merge(acc_o, acc_lse, 1, 3, o2, l2)
    w = torch.softmax(torch.stack([l1[:, :2], l2[:, :2]]), 0)  # (2 partials, H, rows)
    want = o1[:2] * w[0].T[..., None] + o2[:2] * w[1].T[..., None]
    torch.testing.assert_close(acc_o[1:3], want)
    torch.testing.assert_close(acc_lse[:, 1:3], torch.logaddexp(l1[:, :2], l2[:, :2]))
    assert torch.equal(acc_o[3], torch.zeros(2, 4, dtype=torch.float64))
    assert torch.isneginf(acc_lse[:, 3]).all()
    assert torch.isneginf(acc_lse[:, [0, 4]]).all() and not acc_o[[0, 4]].any()


def test_fused_kernel_only_for_all_visible_or_the_aligned_causal_diagonal():
    spec = SimpleNamespace(right=0, left=-1, fused=True)
    assert blocks._fused_causal(spec, 3, 3, None) is False
    assert blocks._fused_causal(spec, 3, 3, (4, 4)) is True
    assert blocks._fused_causal(spec, 3, 3, (5, 2)) is None  # off the diagonal: top-left is wrong
    assert blocks._fused_causal(spec, 3, 2, (4, 4)) is None
    assert blocks._fused_causal(SimpleNamespace(right=0, left=2, fused=True), 3, 3, (4, 4)) is None
    assert blocks._fused_causal(SimpleNamespace(right=0, left=-1, fused=False), 3, 3, None) is None


def test_merge_rows_into_a_filled_accumulator_with_large_lse():
    """Two merges (the second with repeated rows) against a float64 softmax-weighted reference;
    lse near 1000 must not overflow (the stabiliser is the row max)."""
    g = torch.Generator().manual_seed(5)
    acc_o = torch.zeros(4, 2, 3, dtype=torch.float64)
    acc_lse = torch.full((2, 4), float("-inf"), dtype=torch.float64)
    parts = []
    for idx in (torch.tensor([0, 1, 2]), torch.tensor([1, 1, 3, 0])):
        o = torch.randn(len(idx), 2, 3, generator=g, dtype=torch.float64)
        lse = 1000.0 + torch.randn(2, len(idx), generator=g, dtype=torch.float64)
        blocks._merge_rows(acc_o, acc_lse, idx, o, lse)
        parts += [(int(r), o[n], lse[:, n]) for n, r in enumerate(idx)]
    for row in range(4):
        os_ = torch.stack([o for r, o, _ in parts if r == row])  # (m, H, D)
        ls = torch.stack([lse for r, _, lse in parts if r == row])  # (m, H)
        w = torch.softmax(ls, 0)
        torch.testing.assert_close(acc_o[row], (os_ * w[..., None]).sum(0))
        torch.testing.assert_close(acc_lse[:, row], torch.logsumexp(ls, 0))
