"""RingPlan's documented contract, pinned where mutation testing found it unpinned.

Zigzag: the causal-work balance rule (each short document to the least-loaded rank, each long
document's heaviest head+tail pair to the least-loaded rank, longest first), the head+tail chunk
shape of documents of ``L >= 2W`` tokens, pieces packed in packed order with pads only at the end;
contiguous: padding to a multiple of W; maximal non-empty runs; labels and pickling corner cases.
"""

import pickle

import pytest
import torch

from rlhf_kernels.ring.plan import RingPlan


def _cu(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32)


def _doc_work(plan, d):
    """int64 (world_size,): causal work (``pos + 1`` per token) of document d's tokens per rank."""
    return torch.where(plan.doc == d, plan.pos + 1, 0).sum(1)


def _blocks(positions):
    """Maximal stretches of consecutive ints in a sorted list: [(start, length), ...]."""
    out = []
    for p in positions:
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def _random_lengths(g, world):
    """A small mix: documents shorter than 2W, just over it, and long ones, some empty."""
    n = int(torch.randint(1, 12, (1,), generator=g))
    hi = [2 * world, 4 * world, 200][int(torch.randint(0, 3, (1,), generator=g))]
    return torch.randint(0, hi, (n,), generator=g).tolist()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_places_each_document_on_the_least_loaded_rank(world):
    # documents are placed longest first, so the plan of the k longest documents is the state
    # before the (k+1)-th: a short one goes whole to a rank with the least causal work so far,
    # a long one's heaviest pair goes to such a rank, and nothing placed earlier moves
    g = torch.Generator().manual_seed(11 + world)
    for _ in range(10):
        lengths = sorted((x for x in _random_lengths(g, world) if x > 0), reverse=True)
        if not lengths:
            continue
        before = RingPlan.build(_cu([]), world, "zigzag").attention_work()
        for k, length in enumerate(lengths):
            plan = RingPlan.build(_cu(lengths[: k + 1]), world, "zigzag")
            work = plan.attention_work()
            mine = _doc_work(plan, k)
            assert torch.equal(work - mine, before), (lengths, k)
            held = torch.stack([plan.local_seqlens(r)[k] for r in range(world)])
            if length < 2 * world:  # whole, on a least-loaded rank
                (r,) = held.nonzero().flatten().tolist()
                assert held[r] == length and before[r] == before.min(), (lengths, k)
            else:  # one pair per rank, the heaviest to a least-loaded rank
                assert (held > 0).all(), (lengths, k)
                heaviest = (mine == mine.max()).nonzero().flatten()
                assert before[heaviest].min() == before.min(), (lengths, k, mine, before)
            before = work
        # placement depends only on the lengths, not on the packed order (longest first)
        perm = torch.randperm(len(lengths), generator=g).tolist()
        shuffled = RingPlan.build(_cu([lengths[i] for i in perm]), world, "zigzag")
        assert torch.equal(shuffled.attention_work(), before), (lengths, perm)
        assert shuffled.local_len == plan.local_len


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_zigzag_spread_within_one_placement(world):
    # each placement (a short document whole, or one pair per rank of a long one) goes to the
    # least loaded ranks, so max - min causal work never exceeds the largest single placement:
    # one short document's work, or the spread of one long document's pairs (rounding)
    g = torch.Generator().manual_seed(23 + world)
    for _ in range(25):
        lengths = _random_lengths(g, world) + _random_lengths(g, world)
        plan = RingPlan.build(_cu(lengths), world, "zigzag")
        work = plan.attention_work()
        bound = 0
        for d, n in enumerate(lengths):
            if 0 < n < 2 * world:
                bound = max(bound, n * (n + 1) // 2)
            elif n:
                mine = _doc_work(plan, d)
                bound = max(bound, int(mine.max() - mine.min()))
        assert work.max() - work.min() <= bound, (lengths, work.tolist(), bound)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_long_documents_are_head_tail_chunk_pairs(world):
    # L >= 2W (2W exactly included): 2W chunks of sizes within one token, rank i holding chunk j
    # and chunk 2W-1-j (the middle pair j = W-1 is one stretch); shorter documents stay whole
    for lengths in ([2 * world], [2 * world + 1, 2 * world - 1], [5 * world + 3, 7, 2 * world]):
        plan = RingPlan.build(_cu(lengths), world, "zigzag")
        for d, length in enumerate(lengths):
            pieces = []
            for r in range(world):
                v = plan.doc[r] == d
                pieces.append(_blocks(sorted(plan.pos[r][v].tolist())))
            if length < 2 * world:
                assert sorted(map(len, pieces)) == [0] * (world - 1) + [1], (lengths, d)
                continue
            assert sorted(map(len, pieces)) == [1] + [2] * (world - 1), (lengths, d, pieces)
            heads = sorted((p[0], r) for r, p in enumerate(pieces) if len(p) == 2)
            tails = sorted((p[1], r) for r, p in enumerate(pieces) if len(p) == 2)
            assert [r for _, r in heads] == [r for _, r in tails][::-1], (lengths, d, pieces)
            sizes = [n for p in pieces if len(p) == 2 for _, n in p]
            middle = next(p[0][1] for p in pieces if len(p) == 1)
            lo, hi = length // (2 * world), -(-length // (2 * world))
            assert all(lo <= n <= hi for n in sizes), (lengths, d, pieces)
            assert 2 * lo <= middle <= 2 * hi, (lengths, d, pieces)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_ranks_pack_pieces_in_packed_order_pads_at_end(world):
    g = torch.Generator().manual_seed(31 + world)
    for _ in range(20):
        lengths = _random_lengths(g, world) + _random_lengths(g, world)
        plan = RingPlan.build(_cu(lengths), world, "zigzag")
        for r in range(world):
            n = plan.num_tokens(r)
            assert plan.valid_mask(r)[:n].all() and not plan.valid_mask(r)[n:].any()
            idx = plan.global_index[r][:n]
            assert (idx[1:] > idx[:-1]).all(), (lengths, r, idx.tolist())
        assert plan.local_len == max(plan.num_tokens(r) for r in range(world))


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_segments_are_maximal_and_non_empty(layout):
    # empty documents hold no segment; two segments never continue each other
    g = torch.Generator().manual_seed(41)
    for world in (2, 3, 4):
        for _ in range(10):
            lengths = _random_lengths(g, world) + [0] + _random_lengths(g, world)
            plan = RingPlan.build(_cu(lengths), world, layout)
            count = 0
            for r in range(world):
                segs = plan.segments(r)
                count += len(segs)
                assert all(n > 0 for _, n, _, _ in segs), (lengths, r, segs)
                for (s0, n0, d0, p0), (s1, _, d1, p1) in zip(segs, segs[1:]):
                    assert not (d1 == d0 and s1 == s0 + n0 and p1 == p0 + n0), (lengths, r, segs)
                if layout == "zigzag":
                    assert len(segs) <= 2 * sum(1 for n in lengths if n), (lengths, r, segs)
            if layout == "contiguous":
                assert count <= sum(1 for n in lengths if n) + world, (lengths, count)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_contiguous_pads_only_to_a_multiple_of_world(world):
    for total in range(0, 3 * world + 2):
        plan = RingPlan.build(_cu([total]), world, "contiguous")
        assert plan.local_len * world >= total
        assert plan.local_len * world - total < world or total == 0, (world, total)
        assert plan.local_len == -(-total // world)


def test_next_token_labels_of_an_empty_stream():
    plan = RingPlan.build([0, 0, 0], 2)
    assert plan.next_token_labels(torch.zeros(0, dtype=torch.long)).shape == (0,)
    for r in range(2):
        assert plan.next_token_labels(torch.zeros(0, dtype=torch.long), r).shape == (
            plan.local_len,
        )


def test_contiguous_plan_pickles_with_its_layout():
    plan = RingPlan.build(_cu([5, 9, 2]), 3, "contiguous")
    again = pickle.loads(pickle.dumps(plan))
    assert again.layout == "contiguous"
    assert torch.equal(again.global_index, plan.global_index)
    assert again.fingerprint() == plan.fingerprint()


def test_unshard_of_one_slot_per_rank_returns_the_packed_layout():
    plan = RingPlan.build(_cu([1, 1]), 2)  # one token per rank: local_len 1
    assert plan.local_len == 1
    x = torch.tensor([[3.0], [4.0]])  # (total, 1)
    shards = [plan.shard(x, r) for r in range(2)]
    assert all(s.shape == (1, 1) for s in shards)
    assert torch.equal(plan.unshard(shards), x)


def test_bool_and_empty_arguments_are_refused():
    with pytest.raises(ValueError, match="world_size"):
        RingPlan.build(_cu([3]), True)
    with pytest.raises(TypeError, match="must hold ints"):
        RingPlan.build([0, True, 2], 2)
    with pytest.raises(ValueError, match="at least one entry"):
        RingPlan.build(torch.zeros(0, dtype=torch.int64), 2)
    plan = RingPlan.build(_cu([3, 4]), 2)
    with pytest.raises(ValueError, match="rank"):
        plan.shard(torch.zeros(7), True)
