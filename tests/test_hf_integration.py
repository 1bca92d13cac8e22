"""transformers integration: packed / padded / ring paths against per-sample eager runs (fp32)."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.masking_utils import sliding_window_causal_mask_function

from rlhf_kernels.integrations import hf
from rlhf_kernels.ops.varlen_attention import attention_mask, varlen_attention

VOCAB = 97
LENS = [13, 31, 1, 20]  # longer than every sliding window below
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),
    ),
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7)),
    "gemma2_softcap": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            sliding_window=6,
            attn_logit_softcapping=2.0,
            head_dim=16,
            query_pre_attn_scalar=16,
            final_logit_softcapping=30.0,
        ),
    ),
}
_MODELS = {}


def _models(name, tmp_path_factory):
    """(eager model, rlhf_kernels model) with identical weights, reloaded via from_pretrained."""
    if name not in _MODELS:
        cfg_cls, model_cls, extra = CONFIGS[name]
        model_cls = getattr(transformers, model_cls)
        torch.manual_seed(1)
        model = model_cls(getattr(transformers, cfg_cls)(**TINY, **extra))
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        hf.register()
        eager = model_cls.from_pretrained(path, attn_implementation="eager").eval()
        ours = model_cls.from_pretrained(path, attn_implementation="rlhf_kernels").eval()
        assert ours.config._attn_implementation == "rlhf_kernels"
        _MODELS[name] = (eager, ours)
    return _MODELS[name]


def _samples(lens=LENS):
    g = torch.Generator().manual_seed(sum(lens))
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_logits_match_per_sample_eager(name, tmp_path_factory):
    eager, ours = _models(name, tmp_path_factory)
    samples = _samples()
    inputs = hf.packed_model_inputs(samples)
    with torch.no_grad():
        ref = torch.cat([eager(s[None], use_cache=False).logits[0] for s in samples])
        via_kwargs = ours(**{k: v for k, v in inputs.items() if k != "labels"}).logits[0]
        via_positions = ours(
            input_ids=inputs["input_ids"], position_ids=inputs["position_ids"]
        ).logits[0]
    torch.testing.assert_close(via_kwargs, ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(via_positions, ref, atol=1e-4, rtol=0)


def test_sliding_window_convention_matches_transformers():
    for sw in (1, 3, 8):
        window = hf._window(sw, causal=True)
        fn = sliding_window_causal_mask_function(sw)
        idx = [torch.tensor(i) for i in range(11)]
        hf_mask = torch.tensor([[bool(fn(idx[0], idx[0], i, j)) for j in idx] for i in idx])
        assert torch.equal(attention_mask(11, 11, True, window), hf_mask), sw
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        hf._window(0, causal=True)


def test_packed_gradients_match_per_sample(tmp_path_factory):
    eager, ours = _models("mistral_sliding", tmp_path_factory)
    samples = _samples()
    n_targets = sum(len(s) - 1 for s in samples)
    eager.zero_grad()
    for s in samples:  # token-weighted mean over all samples == the packed loss
        if len(s) > 1:
            (
                eager(s[None], labels=s[None], use_cache=False).loss * (len(s) - 1) / n_targets
            ).backward()
    ours.zero_grad()
    inputs = hf.packed_model_inputs(samples)
    assert (inputs["labels"][0, inputs["cu_seq_lens_q"][:-1].long()] == -100).all()
    ours(**inputs).loss.backward()
    ref = dict(eager.named_parameters())
    for n, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, ref[n].grad, atol=1e-4, rtol=1e-4, msg=n)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["llama", "mistral_sliding"])
def test_padded_batch_with_mask(name, side, tmp_path_factory):
    eager, ours = _models(name, tmp_path_factory)
    samples = _samples([9, 23, 17])
    width = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for b, s in enumerate(samples):
        sl = slice(width - len(s), width) if side == "left" else slice(0, len(s))
        ids[b, sl], mask[b, sl] = s, 1
    with torch.no_grad():
        out = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits
    for b, s in enumerate(samples):
        with torch.no_grad():
            ref = eager(s[None], use_cache=False).logits[0]
        torch.testing.assert_close(out[b][mask[b].bool()], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_packed_rows_with_a_padding_mask(compiled, tmp_path_factory):
    """Samples packed in a padded row (padded to a multiple, left or right, or an all-ones
    mask) split where position_ids restart: each row's real tokens used to be one sequence
    under a mask (0.21 off per-sample eager), and an all-ones mask split them in eager mode
    only. cu_seq_lens with a padding mask are refused (they were ignored)."""
    eager, ours = _models("mistral_sliding", tmp_path_factory)
    samples = _samples([5, 9, 4])
    packed = hf.packed_model_inputs(samples)
    ids, pos = packed["input_ids"], packed["position_ids"]
    n = ids.shape[1]
    rows = {  # row -> (input_ids, position_ids, mask, first real column)
        "ones": (ids, pos, torch.ones_like(ids), 0),
        "right": (F.pad(ids, (0, 3)), F.pad(pos, (0, 3)), F.pad(torch.ones_like(ids), (0, 3)), 0),
        "left": (F.pad(ids, (3, 0)), F.pad(pos, (3, 0)), F.pad(torch.ones_like(ids), (3, 0)), 3),
    }
    run = torch.compile(ours, backend="eager") if compiled else ours
    torch._dynamo.reset()
    with torch.no_grad():
        ref = torch.cat([eager(s[None], use_cache=False).logits[0] for s in samples])
        for name, (i, p, m, c) in rows.items():
            out = run(input_ids=i, position_ids=p, attention_mask=m, use_cache=False).logits
            torch.testing.assert_close(out[0, c : c + n], ref, atol=1e-4, rtol=0, msg=name)
        i, p, m, _ = rows["right"]
        cu = packed["cu_seq_lens_q"]
        with pytest.raises(Exception, match="cu_seq_lens_q/k .* came with a padding"):
            run(input_ids=i, position_ids=p, attention_mask=m, cu_seq_lens_q=cu,
                cu_seq_lens_k=cu, max_length_q=9, max_length_k=9, use_cache=False)  # fmt: skip


@pytest.mark.parametrize("name", ["llama", "gemma2_softcap"])
def test_padded_layout_computed_once_per_forward(name, tmp_path_factory, monkeypatch):
    """The unpadding indices and cu_seqlens (host syncs) are made by the first layer only, also
    when sliding and full layers alternate (Gemma-2: they used to evict each other)."""
    cfg_cls, model_cls, extra = CONFIGS[name]
    cfg = getattr(transformers, cfg_cls)(**{**TINY, "num_hidden_layers": 4}, **extra)
    hf.register()
    ours = getattr(transformers, model_cls)._from_config(cfg, attn_implementation="rlhf_kernels")
    calls = []
    real = hf._padded_layout_uncached
    spy = lambda *a, **k: calls.append(1) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr(hf, "_padded_layout_uncached", spy)
    ids = torch.randint(1, 50, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    kinds = len(set(getattr(ours.config, "layer_types", None) or [0]))  # Gemma-2: sliding, full
    with torch.no_grad():
        ours(input_ids=ids, attention_mask=mask, use_cache=False)
        assert len(calls) == kinds  # one mask per kind of layer
        ours(input_ids=ids, attention_mask=mask.clone(), use_cache=False)  # a new mask: once more
    assert len(calls) == 2 * kinds


def test_shared_position_ids_segments_computed_once_per_forward(tmp_path_factory, monkeypatch):
    """A batch of rows with one (1, S) position_ids row: expanded per layer, the segments used
    to be recomputed by every layer."""
    eager, ours = _models("llama", tmp_path_factory)
    results = []
    monkeypatch.setattr(hf, "_POS_CACHE", [None])
    real = hf._segments_from_position_ids
    spy = lambda *a: results.append(real(*a)) or results[-1]  # noqa: E731
    monkeypatch.setattr(hf, "_segments_from_position_ids", spy)
    ids = torch.randint(1, 50, (3, 10))
    pos = torch.arange(10)[None]
    with torch.no_grad():
        got = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
        want = eager(input_ids=ids, position_ids=pos, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(results) == ours.config.num_hidden_layers
    assert all(cu is results[0][0] for cu, _ in results)  # computed by the first layer only


def test_reused_buffers_written_without_version_bump(tmp_path_factory):
    """A position_ids / mask buffer refilled in place by a write the version counter misses
    (a NumPy alias here; ``dist.broadcast`` into the buffer does the same) is seen by the next
    forward: the first layer rebuilds the segments; the padding mask is a new tensor per
    forward."""
    _, ours = _models("llama", tmp_path_factory)
    ids = torch.randint(1, 50, (1, 12))
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    pos2 = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]])
    with torch.no_grad():
        want = ours(input_ids=ids, position_ids=pos2.clone()).logits
        ours(input_ids=ids, position_ids=pos)
        pos.numpy()[:] = pos2.numpy()
        got = ours(input_ids=ids, position_ids=pos).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    ids = torch.randint(1, 50, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask2 = mask.clone()
    mask2[1, :4] = False
    with torch.no_grad():
        want = ours(input_ids=ids, attention_mask=mask2.clone(), use_cache=False).logits
        ours(input_ids=ids, attention_mask=mask, use_cache=False)
        mask.numpy()[:] = mask2.numpy()
        got = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[mask2], want[mask2], rtol=0, atol=0)


def test_first_attention_layer_and_reused_cu_seq_lens(tmp_path_factory, monkeypatch):
    """The per-forward caches are rebuilt at the smallest ``layer_idx`` seen per attention
    class (hybrid models start attention past 0); ``cu_seq_lens_q/k`` kwargs are re-validated
    there, so a reused device buffer is read once per forward (faked device here)."""
    from rlhf_kernels import _checks

    class Attn(torch.nn.Module):
        def __init__(self, idx, config=None):
            super().__init__()
            self.layer_idx, self.config = idx, config

    class Config:
        pass

    monkeypatch.setattr(hf, "_FIRST_LAYER", {})
    assert [hf._first_layer(Attn(i)) for i in (3, 5, 7, 3, 5)] == [True, False, False, True, False]
    assert hf._first_layer(Attn(None)) is False
    # two models with the same attention class: each refreshes at its own first layer
    dense, hybrid = Config(), Config()
    order = [(dense, 0), (dense, 1), (hybrid, 2), (hybrid, 3), (dense, 0), (hybrid, 2)]
    assert [hf._first_layer(Attn(i, c)) for c, i in order] == [1, 0, 1, 0, 1, 1]

    monkeypatch.setattr(_checks, "_read_every_time", lambda t: False)  # cache as on CUDA
    _, ours = _models("llama", tmp_path_factory)
    ids = torch.randint(1, 50, (1, 12))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    reads = []
    real = _checks.check_cu_seqlens

    def counting(t, total, name="cu_seqlens"):
        reads.append(_checks._cached(t) is None)
        return real(t, total, name)

    monkeypatch.setattr("rlhf_kernels.ops.varlen_attention.check_cu_seqlens", counting)
    layers = ours.config.num_hidden_layers
    once = [True] + [False] * (2 * layers - 1)  # q at the first layer; k is the same tensor
    with torch.no_grad():
        ours(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=7, max_length_k=7)
        assert reads == once
        cu.numpy()[1] = 2  # no version bump
        reads.clear()
        got = ours(
            input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=10, max_length_k=10
        ).logits
        assert reads == once
        want = ours(input_ids=ids, position_ids=torch.tensor([[0, 1] + list(range(10))])).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # RoPE: relative, up to rounding


def test_inference_mode_forward_with_position_ids(tmp_path_factory):
    """Inference tensors have no version counter: the caches still work (before: RuntimeError)."""
    _, ours = _models("llama", tmp_path_factory)
    ids = torch.randint(1, 50, (1, 12))
    pos = [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]]
    with torch.no_grad():
        want = ours(input_ids=ids, position_ids=torch.tensor(pos)).logits
    with torch.inference_mode():
        got = ours(input_ids=ids, position_ids=torch.tensor(pos)).logits
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[1, :5] = 0
        ours(input_ids=ids.expand(2, -1), attention_mask=mask, use_cache=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_rejects_masks_it_cannot_honour(tmp_path_factory):
    _, ours = _models("mistral_sliding", tmp_path_factory)
    ids = torch.randint(0, VOCAB, (1, 12))
    with pytest.raises(ValueError, match="4-D masks are not supported"):
        ours(input_ids=ids, attention_mask=torch.ones(1, 1, 12, 12, dtype=torch.bool))
    holes = torch.ones(1, 12, dtype=torch.long)
    holes[0, 5] = 0
    with pytest.raises(ValueError, match="contiguous"):
        ours(input_ids=ids, attention_mask=holes)
    # without a window a hole is fine: the masked token is simply never attended to
    _, llama = _models("llama", tmp_path_factory)
    with torch.no_grad():
        out = llama(input_ids=ids, attention_mask=holes, use_cache=False).logits
    assert torch.isfinite(out).all()


def test_register_named_backend(tmp_path_factory):
    eager, ours = _models("llama", tmp_path_factory)
    name = hf.register("rlhf_kernels_torch", backend="torch")
    ids = _samples([9])[0][None]
    ours.set_attn_implementation(name)
    try:
        with torch.no_grad():
            got = ours(input_ids=ids, use_cache=False).logits
            want = eager(input_ids=ids, use_cache=False).logits
    finally:
        ours.set_attn_implementation("rlhf_kernels")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        hf.register(backend="cuda")
    with pytest.raises(ValueError, match="new attn_implementation"):
        hf.register("sdpa")


def test_position_id_segments_cached_per_tensor():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6]])
    cu, longest = hf._segments_from_position_ids(pos)
    assert cu.tolist() == [0, 3, 4, 6, 8] and cu.dtype == torch.int32 and longest == 3
    assert hf._segments_from_position_ids(pos)[0] is cu  # reused by the next layer
    pos[0, 7] = 9  # in-place edit bumps the version: recomputed
    assert hf._segments_from_position_ids(pos)[0].tolist() == [0, 3, 4, 6, 7, 8]
    two_rows = torch.tensor([[0, 1, 2], [3, 4, 5]])  # each row starts a sequence
    assert hf._segments_from_position_ids(two_rows)[0].tolist() == [0, 3, 6]


def test_collator_labels_and_validation():
    feats = [
        {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        {"input_ids": [8, 9], "labels": [8, 9]},
    ]
    out = hf.PackedCollator()(feats)
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert out["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert out["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert out["cu_seq_lens_q"].tolist() == [0, 3, 5] and out["max_length_q"] == 3
    with pytest.raises(ValueError, match="every feature or none"):
        hf.PackedCollator()([feats[0], {"input_ids": [1]}])
    with pytest.raises(ValueError, match=r"tensors\[1\] must have first dim 2"):
        hf.packed_model_inputs([[1, 2, 3], [4, 5]], labels=[[1, 2, 3], [4]])


class _Plan:
    """Stand-in for a RingPlan on one rank: this rank holds every token."""

    def __init__(self, cu_seqlens):
        self.cu_seqlens = cu_seqlens


def test_ring_context_calls_ring_attention(monkeypatch, tmp_path_factory):
    calls = []

    def ring_varlen_attention(
        q,
        k,
        v,
        plan,
        group=None,
        causal=False,
        softmax_scale=None,
        window_size=(-1, -1),
        softcap=0.0,
        **kw,
    ):
        calls.append(
            dict(
                shape=tuple(q.shape),
                group=group,
                causal=causal,
                scale=softmax_scale,
                window=window_size,
                softcap=softcap,
                **kw,
            )
        )
        cu = plan.cu_seqlens
        return varlen_attention(
            q,
            k,
            v,
            cu,
            cu,
            causal=causal,
            softmax_scale=softmax_scale,
            window_size=window_size,
            softcap=softcap,
        )

    fake = types.ModuleType("rlhf_kernels.ring.attention")
    fake.ring_varlen_attention = ring_varlen_attention
    monkeypatch.setitem(sys.modules, "rlhf_kernels.ring.attention", fake)

    eager, ours = _models("gemma2_softcap", tmp_path_factory)
    samples = _samples()
    inputs = hf.packed_model_inputs(samples)
    with torch.no_grad():
        ref = torch.cat([eager(s[None], use_cache=False).logits[0] for s in samples])
        with hf.ring_context(_Plan(inputs["cu_seq_lens_q"]), group="ring-group", extra=7):
            # position ids of one packed row without boundaries: only the plan knows them
            out = ours(
                input_ids=inputs["input_ids"], position_ids=inputs["position_ids"], use_cache=False
            ).logits[0]
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    assert len(calls) == 2  # one per layer
    heads, head_dim, total = 4, 16, sum(LENS)
    sliding = [c for c in calls if c["window"] != (-1, -1)]
    assert len(sliding) == 1 and sliding[0]["window"] == (5, 0)  # sliding_window=6
    for c in calls:
        assert c["shape"] == (total, heads, head_dim) and c["group"] == "ring-group"
        assert c["causal"] is True and c["softcap"] == 2.0 and c["extra"] == 7
        assert c["scale"] == pytest.approx(16**-0.5)
    assert hf._RING.get() is None  # context reset on exit
    with hf.ring_context(_Plan(inputs["cu_seq_lens_q"])):
        with pytest.raises(ValueError, match="ring attention needs one causal"):
            ours(input_ids=torch.zeros(2, 5, dtype=torch.long), use_cache=False)
        # train mode with attention dropout: ring attention has none, so it must refuse
        layers = [m for m in ours.modules() if hasattr(m, "attention_dropout")]
        assert layers
        for m in layers:
            m.attention_dropout = 0.1
        ours.train()
        try:
            with pytest.raises(ValueError, match="no attention dropout"):
                ours(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"])
        finally:
            for m in layers:
                m.attention_dropout = 0.0
            ours.eval()


def _ring_worker(rank, world_size, path, samples):
    import torch.nn.functional as F

    from rlhf_kernels.packing import pack_sequences
    from rlhf_kernels.ring.plan import RingPlan

    hf.register()
    model = transformers.MistralForCausalLM.from_pretrained(
        path, attn_implementation="rlhf_kernels"
    )
    packed = pack_sequences(samples)
    plan = RingPlan.build(packed.cu_seqlens, world_size)
    ids, pos = plan.shard(packed.input_ids, rank)[None], plan.position_ids(rank)[None]
    with hf.ring_context(plan):
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    targets = plan.next_token_labels(packed.input_ids, rank)
    F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").backward()
    # numpy: torch tensors would travel as shared-memory handles that die with the worker
    return logits.detach().numpy(), {n: p.grad.numpy() for n, p in model.named_parameters()}


@pytest.mark.multiproc
def test_ring_two_ranks_match_per_sample_eager(tmp_path_factory):
    """A real 2-rank gloo ring (mistral, sliding window): logits and summed grads == eager."""
    pytest.importorskip("rlhf_kernels.ring.attention")
    from rlhf_kernels.packing import pack_sequences
    from rlhf_kernels.ring.plan import RingPlan
    from rlhf_kernels.ring.spawn import run_gloo

    eager, _ = _models("mistral_sliding", tmp_path_factory)
    path = tmp_path_factory.mktemp("ring_mistral")
    eager.save_pretrained(path)
    samples = _samples()
    results = run_gloo(_ring_worker, 2, str(path), samples, timeout_s=120)
    plan = RingPlan.build(pack_sequences(samples).cu_seqlens, 2)
    logits = plan.unshard([torch.from_numpy(r[0]) for r in results])
    eager.zero_grad()
    refs = []
    for s in samples:
        out = eager(s[None], use_cache=False).logits[0]
        refs.append(out.detach())
        if len(s) > 1:
            torch.nn.functional.cross_entropy(out[:-1], s[1:], reduction="sum").backward()
    torch.testing.assert_close(logits, torch.cat(refs), atol=1e-4, rtol=0)
    for n, p in eager.named_parameters():
        grad = torch.from_numpy(results[0][1][n] + results[1][1][n])
        torch.testing.assert_close(grad, p.grad, atol=1e-4, rtol=1e-4, msg=n)


def test_generate_left_padded_with_cache_matches_eager(tmp_path_factory):
    """Decoding (query rows shorter than the cached keys) with a padding mask and a window."""
    eager, ours = _models("mistral_sliding", tmp_path_factory)
    ids = torch.randint(1, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 12, dtype=torch.long)
    ids[0, :4], mask[0, :4] = 0, 0
    kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = eager.generate(input_ids=ids, **kw)
        got = ours.generate(input_ids=ids, **kw)
    assert want.shape[1] == 22 and torch.equal(got, want)  # 22 tokens > sliding window 7


def test_rows_without_mask_or_position_ids_are_one_sequence_each():
    """The fallback for models that pass neither a mask nor position_ids: row = sequence."""
    from rlhf_kernels.ops.varlen_attention import varlen_attention_reference

    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(3, 4, 9, 16, dtype=torch.float64)  # (B, heads, S, D), HF layout
    k = torch.randn(3, 2, 9, 16, dtype=torch.float64)
    v = torch.randn(3, 2, 9, 16, dtype=torch.float64)
    outs = [hf.rlhf_attention_forward(module, q, k, v, None, scaling=0.25)[0] for _ in range(2)]
    cu = torch.arange(0, 4, dtype=torch.int32) * 9
    ref, _ = varlen_attention_reference(
        *(t.transpose(1, 2).reshape(27, t.shape[1], 16) for t in (q, k, v)),
        cu,
        cu,
        softmax_scale=0.25,
        causal=True,
    )
    for out in outs:
        torch.testing.assert_close(out.reshape(27, 4, 16), ref, rtol=0, atol=1e-12)
    assert hf._row_cu_seqlens.cache_info().hits >= 1  # the second call reuses the tensors


def _pair(cfg_cls, model_cls, tmp_path, ref="sdpa", dtype=torch.float64, **cfg):
    """(reference model, rlhf_kernels model) of a tiny config, same weights (from_pretrained)."""
    torch.manual_seed(0)
    cls = getattr(transformers, model_cls)
    cls(getattr(transformers, cfg_cls)(**cfg)).save_pretrained(tmp_path)
    hf.register()
    return tuple(
        cls.from_pretrained(tmp_path, attn_implementation=impl, dtype=dtype).eval()
        for impl in (ref, "rlhf_kernels")
    )


def test_padded_cross_attention_matches_sdpa(tmp_path):
    """BART: the cross-attention mask is the encoder's; every decoder row must still be
    computed (queries used to be masked by the encoder's padding and misplaced)."""
    small = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=64)
    small.update(encoder_attention_heads=4, decoder_attention_heads=4, decoder_ffn_dim=64)
    sdpa, ours = _pair(
        "BartConfig", "BartForConditionalGeneration", tmp_path, vocab_size=VOCAB, **small
    )
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    enc_mask = torch.ones(2, 12, dtype=torch.long)
    enc_mask[1, 8:] = 0
    for dec_len in (5, 12, 15):  # shorter than, as long as and longer than the encoder
        dec = torch.randint(3, VOCAB, (2, dec_len), generator=g)
        kw = dict(input_ids=ids, attention_mask=enc_mask, decoder_input_ids=dec, use_cache=False)
        with torch.no_grad():
            want, got = (m(**kw).logits for m in (sdpa, ours))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_score_modifiers_raise_instead_of_being_ignored(tmp_path):
    # T5 passes position_bias to the attention function: ignoring it changed the logits by 0.18
    _, ours = _pair(
        "T5Config", "T5ForConditionalGeneration", tmp_path, vocab_size=VOCAB, d_model=32,
        d_kv=8, d_ff=64, num_layers=1, num_heads=4,
    )  # fmt: skip
    ids = torch.randint(3, VOCAB, (2, 8))
    with pytest.raises(ValueError, match=r"cannot apply \['position_bias'\]"):
        ours(input_ids=ids, decoder_input_ids=ids[:, :5], use_cache=False)
    module = torch.nn.Module()
    q = torch.randn(1, 4, 6, 8)
    k = torch.randn(1, 2, 6, 8)
    for name in ("s_aux", "sinks", "indices"):
        with pytest.raises(ValueError, match=name):
            hf.rlhf_attention_forward(module, q, k, k, None, **{name: torch.zeros(4)})
    with pytest.warns(UserWarning, match="output_attentions=True returns none"):
        hf._WARNED_ATTENTIONS[0] = False
        hf.rlhf_attention_forward(module, q, k, k, None, output_attentions=True)


def test_mask_structures_it_cannot_apply_raise():
    """Chunked attention (Llama 4) and image-token blocks (Gemma 3) used to be dropped."""
    from transformers.masking_utils import (
        causal_mask_function,
        chunked_causal_mask_function,
        create_causal_mask,
        packed_sequence_compatibility_function,
    )

    kw = dict(batch_size=1, q_length=6, kv_length=6)
    chunked = chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="chunked_overlay"):
        hf.padding_mask(mask_function=chunked, **kw)
    cfg = transformers.LlamaConfig(**TINY)
    cfg._attn_implementation = hf.register()
    with pytest.raises(ValueError, match="or_mask"):  # the image-token block overlay
        blocks = torch.tensor([[-1, 0, 0, 0, -1, -1]])
        create_causal_mask(cfg, torch.zeros(1, 6, 64), None, None, block_sequence_ids=blocks)
    # what it applies itself passes: causal, windows, packing (whose segment numbers it hands on)
    for fn in (causal_mask_function, sliding_window_causal_mask_function(3)):
        assert hf.padding_mask(mask_function=fn, **kw) is None
    segments = torch.tensor([[0, 0, 0, 1, 1, 2]])
    packed = packed_sequence_compatibility_function(causal_mask_function, segments, segments)
    got = hf.padding_mask(mask_function=packed, **kw)
    assert got.dtype == torch.int32 and got.tolist() == segments.tolist()


def test_static_cache_raises_instead_of_attending_to_empty_slots(tmp_path_factory):
    """A static cache hands over keys past the written ones (and no mask): that used to give
    wrong logits silently (0.21 off at prefill)."""
    from transformers import StaticCache

    _, ours = _models("llama", tmp_path_factory)
    ids = torch.randint(3, VOCAB, (2, 12))
    with pytest.raises(ValueError, match="static .*KV cache"):
        ours(input_ids=ids, past_key_values=StaticCache(config=ours.config, max_cache_len=32))
    with pytest.raises(ValueError, match="static .*KV cache"):
        kw = dict(max_new_tokens=2, do_sample=False, cache_implementation="static")
        ours.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)


def test_register_warns_below_the_tested_transformers(monkeypatch):
    """Older releases pass other mask kwargs (no allow_is_bidirectional_skip): encoder masks
    would be taken for causal ones without a word."""
    import warnings

    monkeypatch.setattr(hf, "_transformers_version", lambda: "4.57.1")
    with pytest.warns(UserWarning, match="tested with transformers >= 5.23, got 4.57.1"):
        hf.register("rlhf_kernels_old_tf")
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        hf.register("rlhf_kernels_new_tf")  # the installed (tested) version: silent


# models whose attention layers do not pass position_ids on to the attention function
NO_POSITION_IDS = [
    ("PersimmonConfig", "PersimmonForCausalLM", dict(hidden_size=32, num_attention_heads=4)),
    ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(n_embd=32, n_head=4)),
]


@pytest.mark.parametrize("cfg_cls,model_cls,cfg", NO_POSITION_IDS)
def test_packed_position_ids_in_layers_that_do_not_forward_them(
    cfg_cls, model_cls, cfg, tmp_path, monkeypatch
):
    """transformers finds the packed samples from position_ids at model level; these layers
    got no position_ids and attended across samples (0.3 off per-sample eager)."""
    eager, ours = _pair(
        cfg_cls, model_cls, tmp_path, ref="eager", vocab_size=VOCAB, num_hidden_layers=2,
        intermediate_size=32, n_layer=2,
    )  # fmt: skip
    samples = _samples()
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    with torch.no_grad():
        alone = torch.cat([eager(input_ids=s[None], use_cache=False).logits for s in samples], 1)
        got = ours(input_ids=ids, position_ids=pos, use_cache=False).logits
        want = eager(input_ids=ids, position_ids=pos, use_cache=False).logits
    # fp64 models whose rotary tables are fp32: 3e-7 between eager packed and alone
    torch.testing.assert_close(want, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)
    # with a KV cache transformers does not mark the samples: a training forward warns
    monkeypatch.setattr(hf, "_WARNED_NO_POSITIONS", [False])
    with pytest.warns(UserWarning, match="does not pass position_ids .* use_cache=False"):
        ours.train()(input_ids=ids, position_ids=pos)
    ours.eval()


@pytest.mark.slow
@pytest.mark.parametrize("cfg_cls,model_cls,cfg", NO_POSITION_IDS)
def test_compiled_packed_rows_in_layers_without_position_ids(cfg_cls, model_cls, cfg, tmp_path):
    """Compiled, such layers get the packed samples from segment numbers read off transformers'
    mask function by evaluation (before: none, so they attended across samples, 0.22 off)."""
    config = getattr(transformers, cfg_cls)(
        vocab_size=97, num_hidden_layers=2, n_layer=2, intermediate_size=32, **cfg
    )
    torch.manual_seed(0)
    cls = getattr(transformers, model_cls)
    cls(config).save_pretrained(tmp_path)
    eager, ours = (
        cls.from_pretrained(tmp_path, attn_implementation=impl, dtype=torch.float64)
        for impl in ("eager", hf.register())
    )
    g = torch.Generator().manual_seed(1)
    samples = [torch.randint(1, 97, (n,), generator=g) for n in (5, 9, 3)]
    ids = torch.cat(samples)[None]
    pos = torch.cat([torch.arange(len(s)) for s in samples])[None]
    alone = torch.cat([eager(input_ids=s[None], use_cache=False).logits for s in samples], 1)
    alone.square().mean().backward()
    want = [p.grad for p in eager.parameters() if p.grad is not None]
    torch._dynamo.reset()
    fn = torch.compile(
        lambda **a: ours(**a, use_cache=False).logits, fullgraph=True, backend="aot_eager"
    )
    logits = fn(input_ids=ids, position_ids=pos)
    torch.testing.assert_close(logits, alone, rtol=0, atol=1e-6)
    logits.square().mean().backward()
    got = [p.grad for p in ours.parameters() if p.grad is not None]
    assert len(got) == len(want) > 1
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    single = samples[1][None]  # one sample, no position_ids: unchanged
    torch.testing.assert_close(
        fn(input_ids=single), eager(input_ids=single, use_cache=False).logits, rtol=0, atol=1e-6
    )


@pytest.mark.parametrize(
    "cfg_cls,model_cls,cfg",
    [
        ("CodeGenConfig", "CodeGenForCausalLM", dict(n_embd=32, n_head=4, rotary_dim=4)),
        ("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_head=4)),
    ],
)
def test_models_that_never_call_the_attention_interface_are_refused(cfg_cls, model_cls, cfg):
    """They compute attention in their own layers from the mask transformers builds, which
    ours leaves to the attention function: they ran with no causal mask at all."""
    hf.register()
    config = getattr(transformers, cfg_cls)(vocab_size=VOCAB, n_layer=2, **cfg)
    config._attn_implementation = "rlhf_kernels"
    model = getattr(transformers, model_cls)(config).eval()
    with pytest.raises(ValueError, match="never calls transformers' AttentionInterface"):
        model(input_ids=torch.randint(0, VOCAB, (1, 8)))
    assert hf.uses_attention_interface(transformers.LlamaConfig)


def test_value_heads_narrower_than_query_heads(tmp_path):
    """MLA (DeepSeek-V3: qk head_dim 24, v head_dim 8): v was reshaped with the query's
    head_dim, so 6 tokens became 2 and the forward failed."""
    sdpa, ours = _pair(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", tmp_path, vocab_size=VOCAB, hidden_size=32,
        intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=8, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
    )  # fmt: skip
    samples = _samples([6, 9])
    packed = hf.packed_model_inputs(samples)
    with torch.no_grad():
        alone = torch.cat([sdpa(input_ids=s[None], use_cache=False).logits for s in samples], 1)
        got = ours(**{k: v for k, v in packed.items() if k != "labels"}, use_cache=False).logits
    torch.testing.assert_close(got, alone, rtol=0, atol=1e-10)
    # and the attention function alone, with a value wider than the query
    q, k, v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 12)
    out, _ = hf.rlhf_attention_forward(torch.nn.Module(), q, k, v, None)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-5, atol=1e-6)


def test_sliding_window_must_be_an_int():
    # the 8th positional parameter is sdpa's is_causal: True used to become a window of 1
    q = torch.randn(1, 2, 5, 8)
    for bad in (True, 2.5):
        with pytest.raises(TypeError, match="sliding_window must be an int or None"):
            hf.rlhf_attention_forward(torch.nn.Module(), q, q, q, None, 0.0, None, bad)


def test_probed_segments_read_packing_off_the_mask_and_refuse_overlays(monkeypatch):
    """Inside a torch.compile trace the segments come from evaluating transformers' mask
    function (``_probed_segments``): packed rows and windows give the exact segments; an overlay
    that shows later keys (image-token blocks) and chunked attention are refused, as eagerly."""
    from transformers import masking_utils as mu

    packed = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3]])
    fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(packed))
    assert torch.equal(hf._probed_segments(fn, 2, 8, 0, "cpu"), packed.int())
    for window in (1, 2, 5):  # one segment per row, or one per token at window 1: same result
        got = hf._probed_segments(mu.sliding_window_causal_mask_function(window), 2, 8, 0, "cpu")
        want = torch.arange(8).expand(2, 8) if window == 1 else torch.zeros(2, 8)
        assert torch.equal(got, want.int())
    blocks = torch.tensor([[-1, 0, 0, 0, -1, -1, -1, -1]])  # image tokens 1-3 see each other
    overlay = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(blocks))
    with pytest.raises(RuntimeError, match="shows queries later keys"):
        hf._probed_segments(overlay, 1, 8, 0, "cpu")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    padded = torch.ones(1, 8, dtype=torch.long)  # padded rows are checked too
    with pytest.raises(RuntimeError, match="shows queries later keys"):
        hf.padding_mask(1, 8, 8, mask_function=overlay, attention_mask=padded)
    got = hf.padding_mask(1, 8, 8, mask_function=mu.causal_mask_function, attention_mask=padded)
    assert torch.equal(got, padded.bool())
    config = transformers.Llama4TextConfig(attention_chunk_size=4)
    with pytest.raises(ValueError, match="chunked attention"):
        hf.padding_mask(1, 8, 8, mask_function=mu.causal_mask_function, config=config)
