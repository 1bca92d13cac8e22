"""Mutation audit of ``rlhf_kernels.integrations.hf``: pins behaviour that no other test held.

Each test kills one or more mutants that survived the rest of the suite: the key head_dim check,
3-D ``position_ids`` refused for a batch as long as the rows, paged caches and custom mask
overlays (``use_vmap``) refused, a too-small ``max_length_q/k`` refused (not dropped on the way
to the kernel), the ``backend`` argument reaching the kernel, a one-token sliding window
(``window_size=(0, 0)``) still treated as windowed, a padding mask wider than the keys read from
its last columns, ring attention refusing masks and non-causal layers, and the first-layer
tracker forgetting a dead config whose id was reused. Fast: torch backend, float64, a stand-in
attention module (no model).
"""

import functools
import threading
import weakref

import pytest
import torch
from test_hf_schedule_contract import _qkv as contract_qkv

from rlhf_kernels.integrations import hf
from rlhf_kernels.ops.varlen_attention import varlen_attention_reference

HEADS, KV_HEADS, DIM = 4, 2, 8


def _module(causal=True):
    module = torch.nn.Module()
    module.is_causal = causal
    return module.eval()


_qkv = functools.partial(contract_qkv, heads=HEADS, kv_heads=KV_HEADS)


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _forward(q, k, v, mask=None, causal=True, **kwargs):
    kwargs.setdefault("backend", "torch")
    return hf.rlhf_attention_forward(_module(causal), q, k, v, mask, scaling=0.25, **kwargs)[0]


# ----------------------------------------------------------------------------- input checks
def test_key_head_dim_other_than_the_query_refused():
    q, k, v = _qkv(1, 4, k_dim=DIM // 2)
    with pytest.raises(ValueError, match="same head_dim, got 8 and 4"):
        _forward(q, k, v)


def test_three_dim_position_ids_refused_even_when_shapes_line_up():
    """mRoPE-style ``(3, B, S)`` ids with ``B == 3 == S``: dims 0 and 1 fit ``(B, S)``, only
    the number of dimensions tells them apart."""
    q, k, v = _qkv(3, 3)
    pos = torch.arange(3).expand(3, 3, 3)
    with pytest.raises(ValueError, match=r"position_ids must be \(3, 3\) or \(1, 3\)"):
        _forward(q, k, v, position_ids=pos)


def test_paged_cache_refused():
    q, k, v = _qkv(1, 4)
    with pytest.raises(ValueError, match="paged caches"):
        _forward(q, k, v, cache=object())


def test_mask_overlays_refused_by_the_mask_function():
    mu = pytest.importorskip("transformers.masking_utils")
    with pytest.raises(ValueError, match="custom mask overlays"):
        hf.padding_mask(1, 4, 4, mask_function=mu.causal_mask_function, use_vmap=True)


def test_max_length_smaller_than_a_packed_sample_refused():
    """``max_length_q/k`` reach the kernel's validation: a bound below the longest sample is an
    error, not silently replaced by the computed one."""
    q, k, v = _qkv(1, 7)
    cu = _cu([5, 2])
    for name in ("max_length_q", "max_length_k"):
        lengths = dict(max_length_q=5, max_length_k=5)
        lengths[name] = 2
        seqlen = name.replace("length", "seqlen")
        with pytest.raises(ValueError, match=f"{seqlen}=2 is smaller than the longest"):
            _forward(q, k, v, cu_seq_lens_q=cu, cu_seq_lens_k=cu, **lengths)


def _spy_backend(monkeypatch) -> list:
    """Record the backend each kernel call asks for (then run it on torch)."""
    seen = []
    real = hf.varlen_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["backend"])
        return real(*args, **{**kwargs, "backend": "torch"})

    monkeypatch.setattr(hf, "varlen_attention", spy)
    return seen


@pytest.mark.parametrize("padded", [False, True])
def test_backend_reaches_the_kernel(monkeypatch, padded):
    seen = _spy_backend(monkeypatch)
    q, k, v = _qkv(2, 4)
    mask = torch.tensor([[True] * 4, [False] + [True] * 3]) if padded else None
    _forward(q, k, v, mask, backend="triton")
    assert seen == ["triton"]


# ----------------------------------------------------------------------------- padded rows
def test_one_token_window_is_still_a_window():
    """``sliding_window=1`` is ``window_size=(0, 0)``: windowed, so a row with a hole is refused
    (unpadding would change distances) and a non-causal one needs self-attention."""
    q, k, v = _qkv(1, 4)
    holes = torch.tensor([[True, False, True, True]])
    with pytest.raises(ValueError, match="contiguous"):
        _forward(q, k, v, holes, sliding_window=1)
    q2, k2, v2 = _qkv(1, 2, 4)
    with pytest.raises(ValueError, match="needs self-attention"):
        _forward(q2, k2, v2, torch.ones(1, 4, dtype=torch.bool), causal=False, sliding_window=1)


@pytest.mark.parametrize("causal", [True, False])
def test_mask_wider_than_the_keys_uses_its_last_columns(causal):
    """A 2-D mask with more columns than keys (transformers' mask over all cached tokens):
    the keys are its last ``S_k`` columns."""
    q, k, v = _qkv(2, 4)
    mask = torch.tensor([[True, True, True, False], [False, True, True, True]])
    wide = torch.cat([torch.tensor([[False, True], [True, False]]), mask], 1)
    want = _forward(q, k, v, mask, causal=causal)
    torch.testing.assert_close(_forward(q, k, v, wide, causal=causal), want, rtol=0, atol=0)
    # and the result is the per-row reference (left / right padding)
    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
    for row in range(2):
        real = mask[row]
        cu = _cu([int(real.sum())])
        ref, _ = varlen_attention_reference(
            qs[row, real], ks[row, real], vs[row, real], cu, cu, softmax_scale=0.25, causal=causal
        )
        torch.testing.assert_close(want[row, real], ref, rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- ring
def test_ring_refuses_a_mask_and_non_causal_layers():
    q, k, v = _qkv(1, 4)
    with hf.ring_context(object()):
        with pytest.raises(ValueError, match="ring attention needs one causal"):
            _forward(q, k, v, torch.tensor([[False, True, True, True]]))
        with pytest.raises(ValueError, match="ring attention needs one causal"):
            _forward(q, k, v, causal=False)


# ----------------------------------------------------------------------------- first layer
def test_first_layer_forgets_a_dead_config_whose_id_was_reused():
    """A model whose config object sits at a dead config's id: its first attention layer (here
    ``layer_idx=3``, a hybrid model) refreshes, whatever index the dead model's first layer had."""

    class Config:
        pass

    class Layer(torch.nn.Module):
        pass

    dead = Config()
    dead_ref = weakref.ref(dead)
    del dead
    assert dead_ref() is None
    layer = Layer()
    layer.config, layer.layer_idx = Config(), 3
    key = (Layer, id(layer.config))
    hf._FIRST_LAYER[key] = (dead_ref, 0)  # as left by a dead model at the same id
    try:
        assert hf._first_layer(layer)
        assert hf._FIRST_LAYER[key][1] == 3
        later = Layer()
        later.config, later.layer_idx = layer.config, 4
        assert not hf._first_layer(later)
    finally:
        hf._FIRST_LAYER.pop(key, None)


def test_ring_context_seen_from_a_thread_without_one():
    """Autograd's device threads do not inherit the ContextVar: they see the process's open
    ring context, and refuse to guess between several different ones."""
    got = []

    def probe():
        try:
            got.append(hf._ring_state())
        except RuntimeError as e:
            got.append(e)

    def in_thread():
        t = threading.Thread(target=probe)
        t.start()
        t.join()
        return got.pop()

    plan = object()
    opened = hf._RING_OPEN[0]
    with hf.ring_context(plan, group="g"):
        state = in_thread()
        assert state is not None and state.plan is plan and state.group == "g"
        for other_plan, other_group in ((object(), "g"), (plan, "h")):  # another plan / group
            holder, release = threading.Event(), threading.Event()

            def hold_other(
                other_plan=other_plan, other_group=other_group, holder=holder, release=release
            ):
                with hf.ring_context(other_plan, group=other_group):
                    holder.set()
                    release.wait(10)

            t = threading.Thread(target=hold_other)
            t.start()
            try:
                holder.wait(10)
                assert isinstance(in_thread(), RuntimeError)
                assert hf._ring_state().plan is plan  # this thread's own context still wins
            finally:
                release.set()
                t.join()
    assert in_thread() is None
    assert hf._RING_OPEN[0] == opened  # closed again: attention stops reading the ContextVar


def test_ring_only_implementation_refuses_outside_ring_context():
    pytest.importorskip("transformers")
    from transformers import AttentionInterface

    name = hf.register_ring("rlhf_kernels_ring_mutation_audit", backend="torch")
    fn = AttentionInterface()[name]
    q, k, v = _qkv(1, 4)
    with pytest.raises(RuntimeError, match="runs only inside"):
        fn(_module(), q, k, v, None, scaling=0.25)
    with hf.ring_context(object()):  # inside: reaches the attention (which refuses the mask)
        with pytest.raises(ValueError, match="ring attention needs one causal"):
            fn(_module(), q, k, v, torch.tensor([[False, True, True, True]]), scaling=0.25)


def test_traced_mask_function_probes_only_possibly_packed_whole_rows(monkeypatch):
    """Inside a torch.compile trace without a padding mask, segments are probed off the mask
    function only when transformers says rows may be packed (``allow_is_causal_skip=False``) and
    the queries are the whole row; a decode step (1 query, 5 keys) or a causal-skip forward
    gets None (one sequence per row)."""
    mu = pytest.importorskip("transformers.masking_utils")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    causal = mu.causal_mask_function
    assert hf.padding_mask(1, 1, 5, 4, 0, causal, None, allow_is_causal_skip=False) is None
    assert hf.padding_mask(2, 4, 4, 0, 0, causal, None, allow_is_causal_skip=True) is None
    got = hf.padding_mask(2, 4, 4, 0, 0, causal, None, allow_is_causal_skip=False)
    assert got.dtype == torch.int32 and got.tolist() == [[0] * 4] * 2


def test_padding_mask_narrower_than_the_keys_is_kept():
    """A 2-D mask covering fewer columns than the keys (only the new tokens' mask after a
    cache) is handed on, so the attention refuses it, not dropped as "nothing padded"."""
    mu = pytest.importorskip("transformers.masking_utils")
    am = torch.ones(1, 4, dtype=torch.long)
    got = hf.padding_mask(1, 4, 6, 2, 0, mu.causal_mask_function, am)
    assert got is not None and got.shape == (1, 4)
    q, k, v = _qkv(1, 4, 6)
    with pytest.raises(ValueError, match="2-D padding mask"):
        _forward(q, k, v, got)


def test_custom_config_classes_are_not_judged():
    """Configs outside a ``configuration_x`` module (custom code), or whose ``modeling_x`` does
    not import: assumed to call the attention interface."""
    custom = type("CustomConfig", (), {"__module__": "my_package.my_config"})
    missing = type(
        "MissingConfig",
        (),
        {"__module__": "transformers.models.no_such_model_xyz.configuration_no_such_model_xyz"},
    )
    assert hf.uses_attention_interface(custom)
    assert hf.uses_attention_interface(missing)


def test_register_passes_its_backend_on(monkeypatch):
    pytest.importorskip("transformers")
    from transformers import AttentionInterface

    seen = _spy_backend(monkeypatch)
    name = hf.register("rlhf_kernels_mutation_audit_triton", backend="triton")
    q, k, v = _qkv(1, 4)
    AttentionInterface()[name](_module(), q, k, v, None, scaling=0.25)
    assert seen == ["triton"]


def test_position_id_segments_not_reused_for_another_tensor_of_the_same_shape():
    """The segments cache is keyed on the tensor itself: a fresh tensor of the same shape and
    version (0) but other boundaries is recomputed, even without the first-layer refresh."""
    a = torch.tensor([[0, 1, 2, 3, 4, 5]])
    b = torch.tensor([[0, 1, 0, 1, 2, 0]])
    cu_a, longest_a = hf._segments_from_position_ids(a, refresh=True)
    cu_b, longest_b = hf._segments_from_position_ids(b)
    assert cu_a.tolist() == [0, 6] and longest_a == 6
    assert cu_b.tolist() == [0, 2, 5, 6] and longest_b == 3


def test_collator_refuses_an_empty_list():
    with pytest.raises(ValueError, match="at least one sample"):
        hf.PackedCollator()([])


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("positions", [None, (0, 5), (1, 5)])
def test_empty_batch_gives_an_empty_output(padded, positions):
    """A batch of no rows (every rollout filtered out) gives ``(0, S, heads, D)`` as SDPA does;
    it used to fail in ``reshape(..., -1)`` (a size-0 tensor cannot infer the last dim) or in
    ``max()`` of no segment lengths."""
    q, k, v = _qkv(0, 5)
    mask = torch.ones(0, 5, dtype=torch.bool) if padded else None
    kw = {} if positions is None else dict(position_ids=torch.zeros(positions, dtype=torch.long))
    out = _forward(q, k, v, mask, **kw)
    assert out.shape == (0, 5, HEADS, DIM)


@pytest.mark.parametrize("bsz", [0, 2])
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("positions", [False, True])
def test_rows_of_no_tokens_give_an_empty_output(bsz, padded, positions):
    """Rows of length 0 give ``(B, 0, heads, D)`` as SDPA does; with a mask or position_ids
    they failed (an index out of bounds, a slice step of 0)."""
    q, k, v = _qkv(bsz, 0)
    mask = torch.ones(bsz, 0, dtype=torch.bool) if padded else None
    kw = dict(position_ids=torch.zeros(bsz, 0, dtype=torch.long)) if positions else {}
    assert _forward(q, k, v, mask, **kw).shape == (bsz, 0, HEADS, DIM)
