"""The transformers integration on architectures test_hf_integration.py does not build (fp32,
tiny configs): packed rows vs each sample alone (eager), packed gradients, padded batches and
greedy generation with a KV cache vs SDPA. Audited on transformers 5.23: all equal."""

import copy

import pytest
import torch
import transformers

from rlhf_kernels.integrations import hf

VOCAB = 128
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
# model type -> config overrides: each adds something the llama/mistral/qwen2/gemma2 tests do not
ARCHS = {
    "qwen3": dict(use_sliding_window=True, sliding_window=5, max_window_layers=1),  # q/k norms
    "phi3": dict(sliding_window=6),  # fused qkv
    "phi": dict(partial_rotary_factor=0.5),
    "gpt_neox": dict(rotary_pct=0.5),
    "gemma3_text": dict(head_dim=8, sliding_window=5, query_pre_attn_scalar=8),  # local rope
    "cohere2": dict(sliding_window=5),  # no rope on full layers
    "olmo3": dict(sliding_window=5),
    "starcoder2": dict(sliding_window=6),
    "smollm3": dict(no_rope_layer_interval=2),
    "granite": dict(attention_multiplier=0.3, embedding_multiplier=2.0, logits_scaling=2.0),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "stablelm": {},
    "glm": dict(head_dim=8),
    "biogpt": dict(hidden_dropout_prob=0.0),
}
_MODELS = {}


def _models(arch):
    """(sdpa, eager, rlhf_kernels) models of one config with the same weights."""
    if arch not in _MODELS:
        hf.register()
        cfg = transformers.AutoConfig.for_model(arch, **BASE, **ARCHS[arch])
        models = []
        for impl in ("sdpa", "eager", "rlhf_kernels"):
            torch.manual_seed(0)  # from_config sets the implementation on the config it is given
            m = transformers.AutoModelForCausalLM.from_config(
                copy.deepcopy(cfg), attn_implementation=impl, dtype=torch.float32
            )
            assert m.config._attn_implementation == impl
            models.append(m.eval())
        for m in models[1:]:
            m.load_state_dict(models[0].state_dict())
        _MODELS[arch] = tuple(models)
    return _MODELS[arch]


def _samples(lens=(9, 4, 14)):  # longer than the sliding windows above
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g) for n in lens]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_packed_padded_and_generate_match_transformers(arch):
    sdpa, eager, ours = _models(arch)
    samples = _samples()
    inputs = hf.packed_model_inputs(samples)
    with torch.no_grad():
        alone = torch.cat([eager(s[None], use_cache=False).logits[0] for s in samples])
        via_cu = ours(**{k: v for k, v in inputs.items() if k != "labels"}).logits[0]
        via_pos = ours(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"])
    torch.testing.assert_close(via_cu, alone, atol=1e-4, rtol=0)
    torch.testing.assert_close(via_pos.logits[0], alone, atol=1e-4, rtol=0)

    width = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(samples):  # left padding
        ids[b, width - len(s) :], mask[b, width - len(s) :] = s, 1
    with torch.no_grad():
        want = sdpa(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = ours(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-4, rtol=0)

    kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want, got = (m.generate(input_ids=ids, eos_token_id=None, **kw) for m in (sdpa, ours))
    assert want.shape[1] == width + 8 and torch.equal(got, want)


@pytest.mark.parametrize("arch", ["gemma3_text", "mixtral", "smollm3"])
def test_packed_gradients_match_per_sample(arch):
    _, eager, ours = _models(arch)
    samples = _samples()
    n = sum(len(s) - 1 for s in samples)
    eager.zero_grad()
    ours.zero_grad()
    for s in samples:
        (eager(s[None], labels=s[None], use_cache=False).loss * (len(s) - 1) / n).backward()
    ours(**hf.packed_model_inputs(samples)).loss.backward()
    ref = dict(eager.named_parameters())
    checked = 0
    for name, p in ours.named_parameters():
        if ref[name].grad is None:
            assert p.grad is None, name
            continue
        torch.testing.assert_close(p.grad, ref[name].grad, atol=1e-5, rtol=1e-4, msg=name)
        checked += 1
    assert checked > 10
