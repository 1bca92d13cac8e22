"""RingPlan: placement of a packed stream over ring ranks (single process, no communication)."""

import pickle

import pytest
import torch

from rlhf_kernels.ops.varlen_attention import attention_mask
from rlhf_kernels.ring.plan import LAYOUTS, RingPlan

DOCS = [
    [47],
    [1],
    [3, 1, 31, 2],  # documents shorter than the world size
    [0, 5, 0, 67, 1],  # empty documents
    [13, 17, 19, 23, 29],
]


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("lengths", DOCS)
def test_shard_unshard_roundtrip(lengths, world, layout):
    cu = _cu(lengths)
    plan = RingPlan.build(cu, world, layout)
    total = int(cu[-1])
    x = torch.randn(total, 3, 2, dtype=torch.float64)
    shards = [plan.shard(x, r) for r in range(world)]
    assert all(s.shape == (plan.local_len, 3, 2) for s in shards)
    torch.testing.assert_close(plan.unshard(shards), x, rtol=0, atol=0)
    # every real token exactly once; pad slots are zero
    seen = torch.cat([plan.global_index[r][plan.valid_mask(r)] for r in range(world)])
    assert sorted(seen.tolist()) == list(range(total))
    for r in range(world):
        assert (shards[r][~plan.valid_mask(r)] == 0).all()
    assert sum(plan.num_tokens(r) for r in range(world)) == total
    # positions and per-document counts agree with the stream
    ids = torch.arange(total)
    doc_of = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos_of = ids - cu.long()[doc_of]
    for r in range(world):
        v = plan.valid_mask(r)
        assert torch.equal(plan.position_ids(r)[v], pos_of[plan.global_index[r][v]])
        assert (plan.position_ids(r)[~v] == 0).all()
        assert torch.equal(
            plan.local_seqlens(r),
            torch.bincount(doc_of[plan.global_index[r][v]], minlength=len(lengths)),
        )


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_unshard_is_differentiable(layout):
    plan = RingPlan.build(_cu([5, 9, 2]), 3, layout)
    x = torch.randn(16, 4, requires_grad=True)
    y = plan.unshard([plan.shard(x, r) for r in range(3)])
    w = torch.randn(16, 4)
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, w)


def test_zigzag_holds_head_and_tail_chunks():
    plan = RingPlan.build(_cu([16]), 4, "zigzag")  # 8 chunks of 2, pair j = chunks j and 7-j
    assert plan.local_len == 4
    assert plan.global_index.tolist() == [
        [0, 1, 14, 15],
        [2, 3, 12, 13],
        [4, 5, 10, 11],
        [6, 7, 8, 9],
    ]
    # length 10 on 2 ranks: chunks of sizes 2,3,2,3; pairs (0, 3) and (1, 2) hold 5 tokens each,
    # no pad
    plan = RingPlan.build(_cu([10]), 2, "zigzag")
    assert plan.global_index.tolist() == [[0, 1, 7, 8, 9], [2, 3, 4, 5, 6]]


def test_zigzag_rotates_pairs_and_keeps_short_documents_whole():
    # two documents of 10 on 2 ranks: pair (0, 3) does 30 units of causal work, pair (1, 2) 25;
    # the second document's heavier pair goes to the rank that got the lighter one
    plan = RingPlan.build(_cu([10, 10]), 2, "zigzag")
    heads = [
        sorted({p for d, p in zip(plan.doc[r].tolist(), plan.pos[r].tolist()) if d == 1})
        for r in range(2)
    ]
    first = [
        sorted({p for d, p in zip(plan.doc[r].tolist(), plan.pos[r].tolist()) if d == 0})
        for r in range(2)
    ]
    assert heads == first[::-1]
    # documents shorter than 2W are never split, and no rank pads more than it must
    lengths = [3, 1, 5, 2, 7, 4, 6, 3]
    plan = RingPlan.build(_cu(lengths), 4, "zigzag")
    for r in range(4):
        seg_docs = [d for _, _, d, _ in plan.segments(r)]
        assert len(seg_docs) == len(set(seg_docs))
        assert all(n == lengths[d] for _, n, d, _ in plan.segments(r))
    assert plan.local_len == max(plan.num_tokens(r) for r in range(4))
    assert sum(lengths) / 4 <= plan.local_len <= sum(lengths) / 4 + 7


def test_contiguous_is_equal_slices():
    plan = RingPlan.build(_cu([4, 3]), 3, "contiguous")
    assert plan.global_index.tolist() == [[0, 1, 2], [3, 4, 5], [6, -1, -1]]
    assert plan.doc.tolist() == [[0, 0, 0], [0, 1, 1], [1, -1, -1]]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_next_token_labels_cross_shard_boundaries(layout):
    lengths = [7, 1, 12, 5]
    plan = RingPlan.build(_cu(lengths), 3, layout)
    ids = torch.randint(0, 100, (25,))
    expect = torch.full((25,), -100)
    start = 0
    for n in lengths:
        expect[start : start + n - 1] = ids[start + 1 : start + n]
        start += n
    torch.testing.assert_close(plan.next_token_labels(ids), expect)
    shards = [plan.next_token_labels(ids, r) for r in range(3)]
    torch.testing.assert_close(plan.unshard(shards), expect)
    for r in range(3):
        assert (shards[r][~plan.valid_mask(r)] == -100).all()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (True, (5, 0)), (False, (3, 2)), (False, (-1, -1))]
)
def test_attention_work_counts_visible_pairs(layout, causal, window):
    lengths = [9, 1, 14, 3]
    plan = RingPlan.build(_cu(lengths), 3, layout)
    visible = {}
    for d, n in enumerate(lengths):
        m = attention_mask(n, n, causal, window)
        visible[d] = m.sum(1) if m is not None else torch.full((n,), n)
    for r in range(3):
        expect = sum(
            int(visible[d][p]) for d, p in zip(plan.doc[r].tolist(), plan.pos[r].tolist()) if d >= 0
        )
        assert int(plan.attention_work(causal, window)[r]) == expect


def test_attention_work_takes_the_window_as_the_attention_does():
    plan = RingPlan.build(_cu([9, 1, 14, 3]), 3, "zigzag")
    expect = plan.attention_work(False, (3, 2))
    assert torch.equal(plan.attention_work(False, torch.tensor([3, 2])), expect)
    assert torch.equal(plan.attention_work(False, [-1, 2**31]), plan.attention_work(False))
    with pytest.raises(TypeError, match="window_size must be a pair of ints"):
        plan.attention_work(False, (3.5, 2))  # int() truncated it to 3
    with pytest.raises(ValueError, match="got 3 entries"):
        plan.attention_work(False, (3, 2, 1))


def test_world_size_and_rank_are_ints_numpy_ones_too():
    import numpy as np

    plan = RingPlan.build(_cu([9, 1, 14, 3]), np.int64(3), "zigzag")
    same = RingPlan.build(_cu([9, 1, 14, 3]), 3, "zigzag")
    assert plan.local_len == same.local_len
    assert all(torch.equal(a, b) for a, b in zip(plan.runs, same.runs, strict=True))
    assert type(plan.world_size) is int
    assert torch.equal(plan.valid_mask(np.int32(2)), plan.valid_mask(2))
    for bad in (0, -1, True, 3.0, "3", None):
        with pytest.raises(ValueError, match="world_size must be a positive int"):
            RingPlan.build(_cu([4]), bad)
    for bad in (3, -1, True, 1.0, "1"):
        with pytest.raises(ValueError, match=r"rank must be an int in \[0, 3\)"):
            plan.valid_mask(bad)


def _mix(name, g):
    """Document-length mixes for the balance test."""
    if name == "uneven":  # 1..3000 tokens
        return torch.randint(1, 3000, (24,), generator=g).tolist()
    if name == "rlhf":  # prompt+response packs: mostly 20..300, a few long ones
        return torch.randint(20, 300, (64,), generator=g).tolist() + [2100, 1333, 4001]
    if name == "short_1_7":  # many documents shorter than 2W
        return torch.randint(1, 8, (200,), generator=g).tolist()
    if name == "len3":
        return [3] * 100
    if name == "len9":  # just over 2W at W=4: every chunk has one or two tokens
        return [9] * 100
    if name == "mixed":  # short, medium and long together, with empty documents
        short = torch.randint(0, 8, (60,), generator=g).tolist()
        return short + torch.randint(8, 600, (30,), generator=g).tolist() + [5000]
    raise AssertionError(name)


BALANCE_MIXES = ["uneven", "rlhf", "short_1_7", "len3", "len9", "mixed"]


@pytest.mark.parametrize("mix", BALANCE_MIXES)
def test_zigzag_balances_causal_work(mix):
    # max/mean of per-rank causal work at W=4 <= 1.05, and pads cost at most 3% of the slots
    # (before per-document rotation and whole short documents: short_1_7 1.37 with 2.0
    # slots/token, len3 2.00 with 2.67, len9 1.60 with 1.78)
    g = torch.Generator().manual_seed(1)
    lengths = _mix(mix, g)
    zig = RingPlan.build(_cu(lengths), 4, "zigzag")
    con = RingPlan.build(_cu(lengths), 4, "contiguous")
    wz, wc = zig.attention_work(causal=True).double(), con.attention_work(causal=True).double()
    assert wz.sum() == wc.sum()
    assert wz.max() / wz.mean() <= 1.05, (wz.max() / wz.mean()).item()
    assert zig.local_len * 4 / sum(lengths) <= 1.03
    if mix in ("uneven", "rlhf", "mixed"):  # contiguous is visibly worse on long documents
        assert wc.max() / wc.mean() > wz.max() / wz.mean() + 0.02


@pytest.mark.parametrize("world", [2, 3, 8])
def test_zigzag_balance_other_world_sizes(world):
    g = torch.Generator().manual_seed(2)
    for mix in BALANCE_MIXES:
        lengths = _mix(mix, g)
        plan = RingPlan.build(_cu(lengths), world, "zigzag")
        w = plan.attention_work(causal=True).double()
        # whole short documents leave at most one document's worth of spread
        assert w.max() / w.mean() <= 1.05, (mix, (w.max() / w.mean()).item())
        assert plan.local_len * world / sum(lengths) <= 1.05, mix


def test_segments_cover_real_slots():
    plan = RingPlan.build(_cu([10, 0, 3, 7]), 2, "zigzag")
    for r in range(2):
        covered = torch.zeros(plan.local_len, dtype=torch.bool)
        for start, n, d, p0 in plan.segments(r):
            assert plan.doc[r][start : start + n].eq(d).all()
            assert plan.pos[r][start : start + n].tolist() == list(range(p0, p0 + n))
            covered[start : start + n] = True
        assert torch.equal(covered, plan.valid_mask(r))


def test_plan_is_picklable_and_fingerprinted():
    plan = RingPlan.build(_cu([5, 8]), 2)
    plan.segments(0)
    again = pickle.loads(pickle.dumps(plan))
    assert again.fingerprint() == plan.fingerprint()
    assert torch.equal(again.global_index, plan.global_index)
    assert again._cache == {}
    big = RingPlan.build(_cu([5000] * 20), 4)  # 100k tokens: pickles as its inputs
    assert len(pickle.dumps(big)) < 2000
    assert RingPlan.build(_cu([5, 8]), 3).fingerprint() != plan.fingerprint()
    assert RingPlan.build(_cu([8, 5]), 2).fingerprint() != plan.fingerprint()
    assert RingPlan.build([0, 5, 13], 2, "contiguous").fingerprint() != plan.fingerprint()


def _tensors(obj):
    """Every tensor reachable from obj through dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 4])
def test_build_holds_no_per_token_tables(layout, world):
    # ~1M tokens in 1000 documents: what a plan owns scales with documents x ranks, not tokens
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 2000, (1000,), generator=g)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    plan = RingPlan.build(cu, world, layout)
    assert plan.total > 900_000
    owned = sum(t.numel() for t in _tensors(vars(plan)))
    assert owned <= 5 * 2 * (plan.num_docs + 1) * world  # <= 2 runs of 5 ints per doc and rank
    assert plan._per_token == {} and plan._cache == {}
    # asking for one rank's shard builds at most that rank's gather index
    x = torch.arange(plan.total)
    got = plan.shard(x, 1)
    assert sum(t.numel() for t in _tensors(plan._per_token)) <= plan.local_len
    assert all(key[1] == 1 for key in plan._per_token)
    ref = plan.global_index[1]
    assert torch.equal(got, torch.where(ref >= 0, ref, 0))


@pytest.mark.parametrize("sliced", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_slice_and_index_paths_agree(monkeypatch, sliced, layout):
    # shard/unshard/labels copy run by run for long runs and use a gather index for short ones
    monkeypatch.setattr(RingPlan, "_sliced", lambda self, num_runs: sliced)
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 40, (31,), generator=g).tolist()
    plan = RingPlan.build(_cu(lengths), 3, layout)
    x = torch.randn(plan.total, 2, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 9, (plan.total,), generator=g)
    shards = [plan.shard(x, r) for r in range(3)]
    for r in range(3):
        idx = plan.global_index[r]
        expect = torch.where((idx >= 0).unsqueeze(1), x.detach()[idx.clamp(min=0)], 0)
        torch.testing.assert_close(shards[r], expect, rtol=0, atol=0)
        labels = plan.next_token_labels(ids, r)
        full = plan.next_token_labels(ids)
        torch.testing.assert_close(labels, torch.where(idx >= 0, full[idx.clamp(min=0)], -100))
    y = plan.unshard(shards)
    torch.testing.assert_close(y, x.detach(), rtol=0, atol=0)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, w)


@pytest.mark.parametrize("sliced", [True, False])
@pytest.mark.parametrize("cu", [[0, 1], [0, 0, 0]], ids=["pads_only_rank", "empty_stream"])
def test_shard_of_a_pads_only_rank_stays_differentiable(monkeypatch, sliced, cu):
    """A stream shorter than the world leaves a rank with pads only (or nothing): its shard
    still requires grad (as ``x[:0]``), so its attention output has a backward (before: it
    did not, that rank's backward raised and the others waited in the ring exchange)."""
    monkeypatch.setattr(RingPlan, "_sliced", lambda self, num_runs: sliced)
    plan = RingPlan.build(cu, 2)
    x = torch.randn(plan.total, 3, requires_grad=True)
    shards = [plan.shard(x, r) for r in range(2)]
    assert all(t.requires_grad for t in shards)
    sum(t.sum() for t in shards).backward()
    torch.testing.assert_close(x.grad, torch.ones_like(x))


@pytest.mark.parametrize("sliced", [True, False])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16])
def test_shard_of_dtypes_without_index_fill(monkeypatch, sliced, dtype):
    """float8 (and uint16) tensors shard on both paths, with zero pad slots, and round-trip
    (before: the index path's ``index_fill`` of the pads raised NotImplementedError, so
    ``scatter_for_ring`` could not send a float8 key of a many-sample micro-batch)."""
    monkeypatch.setattr(RingPlan, "_sliced", lambda self, num_runs: sliced)
    plan = RingPlan.build(_cu([3, 7, 1, 2, 9]), 4)  # 22 tokens: pad slots on some ranks
    x = (torch.arange(1, plan.total * 2 + 1).reshape(plan.total, 2) % 7 + 1).to(dtype)
    want = [plan.shard(x.float(), r) for r in range(4)]
    assert any((w == 0).all(1).any() for w in want)  # some pads
    shards = [plan.shard(x, r) for r in range(4)]
    for got, w in zip(shards, want):
        assert got.dtype == dtype and torch.equal(got.float(), w)
    assert torch.equal(plan.unshard(shards).float(), x.float())


def test_bad_input():
    with pytest.raises(TypeError, match=r"must hold ints, got \[2.7, 5.9\]"):
        RingPlan.build([0, 2.7, 5.9], 2)  # was truncated to (0, 2, 5)
    with pytest.raises(ValueError, match="world_size"):
        RingPlan.build(_cu([3]), 0)
    with pytest.raises(ValueError, match="layout"):
        RingPlan.build(_cu([3]), 2, "llama3")
    with pytest.raises(ValueError, match="non-decreasing"):
        RingPlan.build(torch.tensor([0, 4, 2]), 2)
    with pytest.raises(ValueError, match=r"cu_seqlens\[0\]"):
        RingPlan.build(torch.tensor([1, 4]), 2)
    with pytest.raises(TypeError, match="int32 or int64"):
        RingPlan.build(torch.tensor([0.0, 4.0]), 2)
    plan = RingPlan.build(_cu([3, 4]), 2)
    with pytest.raises(ValueError, match="rank"):
        plan.shard(torch.zeros(7), 2)
    with pytest.raises(ValueError, match="packed length 7"):
        plan.shard(torch.zeros(6), 0)
    with pytest.raises(ValueError, match="2 shards"):
        plan.unshard([torch.zeros(plan.local_len)])
    with pytest.raises(ValueError, match=r"shards\[1\]"):
        plan.unshard([torch.zeros(plan.local_len), torch.zeros(plan.local_len + 1)])
    with pytest.raises(ValueError, match="length 7"):
        plan.next_token_labels(torch.zeros(5, dtype=torch.long))


def test_hf_rows_of_one_keep_their_leading_dim():
    """``packed_model_inputs`` gives ``(1, T)`` rows: shard / unshard / next_token_labels take them
    as they are (before: a ValueError, so every call needed ``[0]`` and ``[None]``)."""
    plan = RingPlan.build(_cu([5, 9, 2]), 3, "zigzag")
    ids = torch.arange(16)
    hid = torch.randn(16, 4)
    for r in range(3):
        torch.testing.assert_close(plan.shard(ids[None], r), plan.shard(ids, r)[None])
        torch.testing.assert_close(plan.shard(hid[None], r), plan.shard(hid, r)[None])
        torch.testing.assert_close(
            plan.next_token_labels(ids[None], r), plan.next_token_labels(ids, r)[None]
        )
    assert plan.next_token_labels(ids[None]).shape == (1, 16)
    back = plan.unshard([plan.shard(hid[None], r) for r in range(3)])
    torch.testing.assert_close(back, hid[None])
    with pytest.raises(ValueError, match=r"length 16 or a \(1, 16\) row, got \(2, 16\)"):
        plan.next_token_labels(torch.zeros(2, 16, dtype=torch.long))
    with pytest.raises(ValueError, match="packed length 16 as first dim"):
        plan.shard(torch.zeros(2, 16), 0)
    one = RingPlan.build(_cu([1]), 2)  # a one-token stream's (1, 1) row was refused
    assert one.next_token_labels(torch.tensor([[7]])).tolist() == [[-100]]
