"""Documented contracts of the transformers attention function (padded rows split at position
restarts, padding query rows, refused inputs, the mask function) and of the attention
kernels' launch schedule (rectangle vs flat choice, tie order). Fast: torch backend, float64."""

import pytest
import torch

from rlhf_kernels.integrations import hf
from rlhf_kernels.ops import attention_schedule as sch
from rlhf_kernels.ops import varlen_attention_triton as vt
from rlhf_kernels.ops.varlen_attention import varlen_attention_reference

HEADS, KV_HEADS, DIM = 2, 1, 8


def _module(causal=True):
    module = torch.nn.Module()
    module.is_causal = causal
    return module


def _qkv(bsz, s_q, s_k=None, seed=0, *, heads=HEADS, kv_heads=KV_HEADS, k_dim=DIM):
    """HF layout ``(B, heads, S, D)`` float64 q, k, v (k's head dim ``k_dim``)."""
    g = torch.Generator().manual_seed(seed)
    s_k = s_q if s_k is None else s_k
    q = torch.randn(bsz, heads, s_q, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(bsz, kv_heads, s_k, k_dim, generator=g, dtype=torch.float64)
    v = torch.randn(bsz, kv_heads, s_k, DIM, generator=g, dtype=torch.float64)
    return q, k, v


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _forward(q, k, v, mask=None, causal=True, **kwargs):
    return hf.rlhf_attention_forward(
        _module(causal), q, k, v, mask, scaling=0.25, backend="torch", **kwargs
    )[0]


def _want_padded(q, k, v, mask, segments, causal=True):
    """Expected ``(B, S, heads, D)``: each listed segment (row, first column, length) of real
    tokens attends within itself; padding query rows are 0."""
    out = torch.zeros(q.shape[0], q.shape[2], HEADS, DIM, dtype=q.dtype)
    for row, c, n in segments:
        assert bool(mask[row, c : c + n].all())
        qs, ks, vs = (t[row, :, c : c + n].transpose(0, 1) for t in (q, k, v))
        cu = _cu([n])
        ref, _ = varlen_attention_reference(qs, ks, vs, cu, cu, softmax_scale=0.25, causal=causal)
        out[row, c : c + n] = ref
    return out


# ----------------------------------------------------------------------------- padded rows
def test_padded_row_splits_where_the_position_does_not_increase():
    """A 1-token sample followed by another sample (positions ``0, 0, 1, 2``): the second 0 is
    not above the first, so a new sample starts there."""
    q, k, v = _qkv(1, 5)
    mask = torch.tensor([[True, True, True, True, False]])
    pos = torch.tensor([[0, 0, 1, 2, 0]])
    out = _forward(q, k, v, mask, position_ids=pos)
    torch.testing.assert_close(out, _want_padded(q, k, v, mask, [(0, 0, 1), (0, 1, 3)]))


def test_padded_row_position_jump_splits_beside_but_not_across_padding():
    """Next to each other, transformers' rule: an upward jump (``2 -> 5``) starts a sample, as it
    does with no mask (an all-ones mask, dropped in eager mode, kept under torch.compile, once
    split differently). Across padding inside a row only a drop or a repeat starts one: the
    positions of a row with a hole may skip the hole."""
    q, k, v = _qkv(1, 6)
    mask = torch.tensor([[True] * 5 + [False]])
    pos = torch.tensor([[0, 1, 2, 5, 6, 0]])
    out = _forward(q, k, v, mask, position_ids=pos)
    torch.testing.assert_close(out, _want_padded(q, k, v, mask, [(0, 0, 3), (0, 3, 2)]))
    ones = torch.ones(1, 6, dtype=torch.bool)
    pos = torch.tensor([[0, 1, 2, 5, 6, 7]])
    want = _want_padded(q, k, v, ones, [(0, 0, 3), (0, 3, 3)])
    torch.testing.assert_close(_forward(q, k, v, ones, position_ids=pos), want)
    torch.testing.assert_close(_forward(q, k, v, None, position_ids=pos), want)
    hole = torch.tensor([[True, True, False, True, True, False]])
    pos = torch.tensor([[0, 1, 2, 3, 4, 5]])  # arange positions over a hole: one sample
    out = _forward(q, k, v, hole, position_ids=pos)
    qs, ks, vs = (t[:, :, [0, 1, 3, 4]] for t in (q, k, v))
    ref = _want_padded(qs, ks, vs, torch.ones(1, 4, dtype=torch.bool), [(0, 0, 4)])
    torch.testing.assert_close(out[:, [0, 1, 3, 4]], ref)
    assert not out[:, [2, 5]].any()


def test_every_padded_row_starts_a_sample_even_when_positions_continue():
    """Row 1's positions continue row 0's (``... 2 | 3 ...``): rows still never attend to each
    other."""
    q, k, v = _qkv(2, 4, seed=1)
    mask = torch.tensor([[True, True, True, False], [True, True, True, True]])
    pos = torch.tensor([[0, 1, 2, 0], [3, 4, 5, 6]])
    out = _forward(q, k, v, mask, position_ids=pos)
    torch.testing.assert_close(out, _want_padded(q, k, v, mask, [(0, 0, 3), (1, 0, 4)]))


def test_fully_padded_row_with_position_ids_gives_zero_rows():
    """Padding query rows give 0, also for a row with no real token at all (last row here)."""
    q, k, v = _qkv(2, 3, seed=2)
    mask = torch.tensor([[True, True, True], [False, False, False]])
    pos = torch.tensor([[0, 1, 2], [0, 0, 0]])
    out = _forward(q, k, v, mask, position_ids=pos)
    torch.testing.assert_close(out, _want_padded(q, k, v, mask, [(0, 0, 3)]))
    assert not out[1].any()


def test_padding_query_rows_are_zero():
    q, k, v = _qkv(2, 5, seed=3)
    mask = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    out = _forward(q, k, v, mask)
    torch.testing.assert_close(out, _want_padded(q, k, v, mask, [(0, 2, 3), (1, 0, 5)]))
    assert not out[0, :2].any()


def test_same_mask_tensor_with_and_without_position_ids():
    """The per-forward layout cache must not hand a layout computed without ``position_ids``
    to a call that has them (or one computed before an in-place edit of the mask)."""
    q, k, v = _qkv(1, 6, seed=4)
    mask = torch.tensor([[True] * 5 + [False]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    whole = _forward(q, k, v, mask)
    torch.testing.assert_close(whole, _want_padded(q, k, v, mask, [(0, 0, 5)]))
    split = _forward(q, k, v, mask, position_ids=pos)
    torch.testing.assert_close(split, _want_padded(q, k, v, mask, [(0, 0, 3), (0, 3, 2)]))
    mask[0, 0] = False  # in place: the cached layout is stale
    out = _forward(q, k, v, mask)
    torch.testing.assert_close(out, _want_padded(q, k, v, mask, [(0, 1, 4)]))


def test_non_causal_padded_rows_compute_every_query_and_ignore_position_ids():
    """Non-causal layers mask keys only and compute every query row (as SDPA); position_ids
    split causal self-attention only. The same mask tensor first served a causal layer."""
    q, k, v = _qkv(1, 5, seed=10)
    mask = torch.tensor([[False, True, True, True, True]])
    pos = torch.tensor([[0, 0, 1, 0, 1]])
    _forward(q, k, v, mask)  # a causal layer: fills the layout cache for this mask
    out = _forward(q, k, v, mask, causal=False, position_ids=pos)
    qs, ks, vs = (t[0].transpose(0, 1) for t in (q, k, v))
    want, _ = varlen_attention_reference(qs, ks[1:], vs[1:], _cu([5]), _cu([4]), softmax_scale=0.25)
    torch.testing.assert_close(out[0], want)


def test_non_causal_window_on_padded_rows_keeps_query_key_alignment():
    """A non-causal window on a padded row: real query ``i`` sees real keys within the
    window of ``i`` (the padding is not counted as tokens)."""
    q, k, v = _qkv(1, 6, seed=11)
    mask = torch.tensor([[True, True, True, True, False, False]])
    out = hf.rlhf_attention_forward(
        _module(False), q, k, v, mask, scaling=0.25, sliding_window=2, backend="torch"
    )[0]
    qs, ks, vs = (t[0, :, :4].transpose(0, 1) for t in (q, k, v))
    cu = _cu([4])
    want, _ = varlen_attention_reference(qs, ks, vs, cu, cu, softmax_scale=0.25, window_size=(1, 1))
    torch.testing.assert_close(out[0, :4], want)


def test_shared_position_ids_tensor_reused_for_another_batch_size():
    """The same ``(1, S)`` position_ids tensor with one row and then with two rows sharing it
    (the per-tensor segment cache must not hand over the one-row result)."""
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    q, k, v = _qkv(1, 5, seed=12)
    out = _forward(q, k, v, position_ids=pos)
    ones = torch.ones(2, 5, dtype=torch.bool)
    torch.testing.assert_close(out, _want_padded(q, k, v, ones, [(0, 0, 3), (0, 3, 2)]))
    q, k, v = _qkv(2, 5, seed=13)
    out = _forward(q, k, v, position_ids=pos)
    segs = [(r, c, n) for r in (0, 1) for c, n in ((0, 3), (3, 2))]
    torch.testing.assert_close(out, _want_padded(q, k, v, ones, segs))


def test_padded_mask_shapes_refused():
    q, k, v = _qkv(2, 4)
    for bad in (
        torch.ones(2, 3, dtype=torch.bool),
        torch.ones(2, 4, 4, dtype=torch.bool),
        torch.ones(2, 1, 4, 4, dtype=torch.bool),
    ):
        bad[0, 0] = False
        with pytest.raises(ValueError, match="2-D padding mask"):
            _forward(q, k, v, bad)


def test_position_ids_shape_with_a_padding_mask_refused():
    q, k, v = _qkv(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    for pos in (torch.zeros(1, 1, 4, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)):
        with pytest.raises(ValueError, match="position_ids must be"):
            _forward(q, k, v, mask, position_ids=pos)


def test_non_causal_window_needs_self_attention():
    q, _, _ = _qkv(1, 3)
    _, k, v = _qkv(1, 5)
    mask = torch.tensor([[True, True, True, True, False]])
    with pytest.raises(ValueError, match="non-causal sliding window"):
        hf.rlhf_attention_forward(
            _module(False), q, k, v, mask, scaling=0.25, sliding_window=2, backend="torch"
        )


def test_sliding_window_refuses_holes_every_layer():
    """Padding between real tokens with a window is refused, also when the layout is read
    from the cache (the second layer of a forward)."""
    q, k, v = _qkv(1, 4)
    mask = torch.tensor([[True, False, True, True]])
    for _ in range(2):
        with pytest.raises(ValueError, match="contiguous"):
            _forward(q, k, v, mask, sliding_window=2)


# ----------------------------------------------------------------------------- packed kwargs
def test_cu_seq_lens_refused_with_a_padding_mask_even_one_of_them():
    q, k, v = _qkv(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    with pytest.raises(ValueError, match="came with a padding"):
        _forward(q, k, v, mask, cu_seq_lens_k=_cu([3]))


def test_cu_seq_lens_need_one_row_and_both_tensors():
    q, k, v = _qkv(2, 4)
    cu = _cu([4])
    with pytest.raises(ValueError, match="packed batch of one row"):
        _forward(q, k, v, cu_seq_lens_q=cu, cu_seq_lens_k=cu)
    q, k, v = _qkv(1, 4)
    with pytest.raises(ValueError, match="packed batch of one row"):
        _forward(q, k, v, cu_seq_lens_q=cu)


def test_cu_seq_lens_q_and_k_both_used():
    """Different query and key splits (non-causal: every query sees its sequence's keys)."""
    q, k, v = _qkv(1, 6, seed=5)
    cu_q, cu_k = _cu([2, 4]), _cu([4, 2])
    out = _forward(q, k, v, causal=False, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k)
    qs, ks, vs = (t[0].transpose(0, 1) for t in (q, k, v))
    want, _ = varlen_attention_reference(qs, ks, vs, cu_q, cu_k, softmax_scale=0.25)
    torch.testing.assert_close(out[0], want)


def test_packed_segment_numbers_split_where_the_number_changes():
    """An int32 mask holds the segment numbers of packed rows (``padding_mask``): a sample
    starts wherever the number changes and at each row start."""
    q, k, v = _qkv(2, 5, seed=14)
    segments = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]], dtype=torch.int32)
    out = _forward(q, k, v, segments)
    segs = [(0, 0, 2), (0, 2, 3), (1, 0, 3), (1, 3, 2)]
    torch.testing.assert_close(out, _want_padded(q, k, v, torch.ones(2, 5, dtype=torch.bool), segs))


def test_packed_segment_numbers_shape_refused():
    q, k, v = _qkv(1, 4)
    with pytest.raises(ValueError, match="segment numbers"):
        _forward(q, k, v, torch.zeros(1, 3, dtype=torch.int32))


def test_position_ids_of_the_wrong_length_refused():
    q, k, v = _qkv(1, 4)
    with pytest.raises(ValueError, match="positions per row"):
        _forward(q, k, v, position_ids=torch.arange(5)[None])


# ----------------------------------------------------------------------------- settings
@pytest.mark.parametrize("window", [0, True, 2.0])
def test_sliding_window_values_refused(window):
    q, k, v = _qkv(1, 4)
    with pytest.raises((TypeError, ValueError), match="sliding_window"):
        _forward(q, k, v, sliding_window=window)


def test_non_causal_sliding_window_is_symmetric():
    """Non-causal: key ``j`` visible from query ``i`` when ``|i - j| < sliding_window``."""
    q, k, v = _qkv(1, 6, seed=6)
    out = _forward(q, k, v, causal=False, sliding_window=2)
    qs, ks, vs = (t[0].transpose(0, 1) for t in (q, k, v))
    cu = _cu([6])
    want, _ = varlen_attention_reference(qs, ks, vs, cu, cu, softmax_scale=0.25, window_size=(1, 1))
    torch.testing.assert_close(out[0], want)


@pytest.mark.parametrize("name", ["indices", "block_indices", "sinks"])
def test_every_score_modifier_refused(name):
    q, k, v = _qkv(1, 4)
    with pytest.raises(ValueError, match="cannot apply"):
        _forward(q, k, v, **{name: torch.zeros(1)})


def test_decode_step_sees_its_whole_row():
    """Fewer queries than keys (a decode step after a KV cache): each row is one sequence,
    queries aligned to the end of its keys, with or without position_ids (they have no key
    positions) and with a padding mask."""
    q, _, _ = _qkv(2, 2, seed=7)
    _, k, v = _qkv(2, 5, seed=8)
    qs, ks, vs = (t.transpose(1, 2).reshape(-1, t.shape[1], DIM) for t in (q, k, v))
    want, _ = varlen_attention_reference(
        qs, ks, vs, _cu([2, 2]), _cu([5, 5]), softmax_scale=0.25, causal=True
    )
    pos = torch.tensor([[3, 4], [3, 4]])
    for kw in ({}, dict(position_ids=pos)):
        out = _forward(q, k, v, **kw)
        torch.testing.assert_close(out.reshape(4, HEADS, DIM), want)
    mask = torch.tensor([[True] * 5, [False, True, True, True, True]])
    out = _forward(q, k, v, mask, position_ids=pos)
    real = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9])  # row 1's first key is padding
    want, _ = varlen_attention_reference(
        qs, ks[real], vs[real], _cu([2, 2]), _cu([5, 4]), softmax_scale=0.25, causal=True
    )
    torch.testing.assert_close(out.reshape(4, HEADS, DIM), want)


# ----------------------------------------------------------------------------- mask function
def test_padding_mask_keeps_the_last_kv_length_columns_and_drops_all_ones():
    causal = __import__("transformers.masking_utils", fromlist=["x"]).causal_mask_function
    am = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    got = hf.padding_mask(2, 4, 4, mask_function=causal, attention_mask=am)
    assert got is None  # the last 4 columns are all real
    am[1, 2] = 0
    got = hf.padding_mask(2, 4, 4, mask_function=causal, attention_mask=am)
    assert got.tolist() == [[True] * 4, [True, False, True, True]]


def test_padding_mask_refuses_keys_past_the_queries_only():
    causal = __import__("transformers.masking_utils", fromlist=["x"]).causal_mask_function
    am = torch.ones(1, 6, dtype=torch.long)
    assert hf.padding_mask(1, 4, 4, 2, 0, causal, am) is None  # keys end at the last query
    with pytest.raises(ValueError, match="static"):
        hf.padding_mask(1, 4, 5, 0, 0, causal, am)


def test_padding_mask_lets_bidirectional_keys_outnumber_queries():
    """Cross-attention (a bidirectional mask: transformers passes
    ``allow_is_bidirectional_skip``) may have more keys than queries: not a static cache."""
    mu = __import__("transformers.masking_utils", fromlist=["x"])
    am = torch.tensor([[1, 1, 1, 1, 0]])
    got = hf.padding_mask(
        1, 3, 5, 0, 0, mu.bidirectional_mask_function, am, allow_is_bidirectional_skip=True
    )
    assert got.tolist() == [[True, True, True, True, False]]


# ----------------------------------------------------------------------------- schedule
def test_schedule_rectangle_only_when_the_flat_bound_is_over_three_quarters():
    """``4 * slots == 3 * rectangle`` is not over 3/4: the flat table; one more slot: the
    rectangle."""
    mask = vt._mask_meta(True, (-1, -1))
    lens = [64, 48, 1, 1]  # bound cdiv(114, 16) + 4 = 12 slots, rectangle 4 x 4 = 16
    cu = _cu(lens)
    assert sch.schedule_slots(114, 4, 64, 16) == 12
    table = sch.schedule(cu, cu, None, 16, False, mask, 114, 64)
    assert table.shape == (12, 2)
    used = sorted(tuple(r) for r in table.tolist() if r[0] >= 0)
    assert used == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (1, 1), (1, 2), (2, 0), (3, 0)]
    lens = [64, 64, 1, 1]  # 13 slots: 52 > 48
    cu = _cu(lens)
    table = sch.schedule(cu, cu, None, 16, False, mask, 130, 64)
    assert table.tolist() == [[b, m] for m in (3, 2, 1, 0) for b in range(4)]


@pytest.mark.parametrize("build", ["flat_schedule", "flat_schedule_reference"])
def test_flat_schedule_ties_in_sequence_then_block_order(build):
    """Non-causal full attention: every query block of a sequence has the same work (its key
    count), so equal-work blocks keep sequence then block order."""
    lens = [40, 5, 40, 33, 40]
    cu = _cu(lens)
    slots = sch.schedule_slots(sum(lens), len(lens), 40, 8)
    table = getattr(sch, build)(cu, cu, None, 8, False, vt._mask_meta(False, (-1, -1)), slots)
    want = [[b, m] for b in (0, 2, 4) for m in range(5)] + [[3, m] for m in range(5)] + [[1, 0]]
    assert table[: len(want)].tolist() == want
    assert all(r == [-1, 0] for r in table[len(want) :].tolist())


def test_schedule_slots_bounds_every_pack():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        batch = int(torch.randint(1, 9, (1,), generator=g))
        lens = torch.randint(0, 50, (batch,), generator=g).tolist()
        block = int(torch.randint(1, 20, (1,), generator=g))
        blocks = sum(-(-n // block) for n in lens)
        slots = sch.schedule_slots(sum(lens), batch, max(lens), block)
        assert blocks <= slots <= batch * -(-max(lens) // block), (lens, block)


# ----------------------------------------------------------------------------- compiled path
def test_compiled_shared_position_ids_split_every_row():
    """Under torch.compile the position-id split runs as a custom op: a ``(1, S)``
    ``position_ids`` shared by two rows splits both rows, as in eager mode."""
    q, k, v = _qkv(2, 6, seed=9)
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    torch._dynamo.reset()
    out = torch.compile(_forward, backend="eager")(q, k, v, position_ids=pos)
    segs = [(r, c, 3) for r in (0, 1) for c in (0, 3)]
    torch.testing.assert_close(out, _want_padded(q, k, v, torch.ones(2, 6, dtype=torch.bool), segs))
