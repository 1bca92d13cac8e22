"""trainers.rollout (HF generation engine) and trainers.rewards (reward-fn loading, checking,
the toy task's rewards), in-process on the bundled tiny model."""

from __future__ import annotations

import copy
import json
import logging
import math

import numpy as np
import pytest
import torch
from torch import nn

from trainers import rewards
from trainers.rollout import GenerationEngine, HFGenerationEngine, cut_at_eos, split_responses


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tokenizer, model with our attention, model with sdpa), built in a private folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_kernels.integrations.hf import register
    from trainers.tiny import ensure_tiny

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLHF_KERNELS_TINY", str(tmp_path_factory.mktemp("tiny") / "tiny"))
        path = ensure_tiny()
    tok = AutoTokenizer.from_pretrained(path)
    ours = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register())
    sdpa = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    return tok, ours.eval(), sdpa.eval()


@pytest.fixture(scope="module")
def prompts(tiny):
    tok = tiny[0]
    texts = ["reverse: abc", "reverse: hello world", "sort: dcba", "x"]  # different lengths
    out = [tok(t).input_ids for t in texts]
    assert len({len(p) for p in out}) > 1  # left padding is exercised
    return out


def _biased(model, token: int) -> nn.Module:
    """A copy of ``model`` whose ``lm_head`` adds +50 to ``token``'s logit."""
    m = copy.deepcopy(model)
    old = m.lm_head
    m.lm_head = nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        m.lm_head.weight.copy_(old.weight)
        m.lm_head.bias.zero_()
        m.lm_head.bias[token] = 50.0
    return m


# a hub generation_config.json's sampling defaults (exaggerated so that they show on the random
# tiny model), which the engine must override
HUB_DEFAULTS = dict(
    do_sample=True, temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=5.0, min_p=0.5,
    forced_eos_token_id=5, exponential_decay_length_penalty=(1, 3.0),  # (were left on)
    encoder_repetition_penalty=50.0, max_time=1e-9,
)  # fmt: skip


def _check_shape(out, n, max_new, eos):
    assert len(out) == n
    for r in out:
        assert 1 <= len(r) <= max_new and all(isinstance(t, int) for t in r)
        assert (r[-1] == eos and eos not in r[:-1]) or (len(r) == max_new and eos not in r)


# ----------------------------------------------------------------------------- rollouts
def test_counts_and_prompt_major_order(tiny, prompts):
    tok, ours, _ = tiny
    gen = HFGenerationEngine(ours, tok, batch_size=3)  # 3 does not divide 8: a short last chunk
    assert isinstance(gen, GenerationEngine)
    out = gen.generate(prompts, n_samples=2, max_new_tokens=4, greedy=True)
    _check_shape(out, 8, 4, tok.eos_token_id)
    # greedy: both samples of prompt i equal prompt i's own answer, in prompt order
    alone = [gen.generate([p], n_samples=1, max_new_tokens=4, greedy=True)[0] for p in prompts]
    assert len({tuple(a) for a in alone}) == len(prompts)  # distinguishable prompts
    assert out == [a for a in alone for _ in range(2)]
    sampled = gen.generate(prompts, n_samples=3, max_new_tokens=4, seed=1)
    _check_shape(sampled, 12, 4, tok.eos_token_id)
    assert all(tok.pad_token_id not in r for r in sampled)


def test_generate_call_settings_and_mode_restored(tiny, prompts, monkeypatch):
    tok, ours, _ = tiny
    model = copy.deepcopy(ours).train()
    model.config.use_cache = False  # as during training
    calls = []
    real = model.generate

    def spy(**kw):
        calls.append((model.training, torch.is_grad_enabled(), kw))
        return real(**kw)

    monkeypatch.setattr(model, "generate", spy)
    gen = HFGenerationEngine(model, tok, batch_size=4)
    out = gen.generate(prompts[:3], n_samples=3, max_new_tokens=4, temperature=0.7, top_p=0.9)
    assert len(out) == 9 and model.training  # train mode is back
    assert [kw["input_ids"].shape[0] for _, _, kw in calls] == [4, 4, 1]
    for training, grad, kw in calls:
        assert not training and not grad
        assert kw["use_cache"] is True and kw["do_sample"] is True and kw["top_k"] == 0
        assert (kw["temperature"], kw["top_p"], kw["max_new_tokens"]) == (0.7, 0.9, 4)
        assert (kw["pad_token_id"], kw["eos_token_id"]) == (tok.pad_token_id, [tok.eos_token_id])
        ids, mask = kw["input_ids"], kw["attention_mask"]
        assert torch.equal(mask.bool(), ids != tok.pad_token_id)  # the prompts hold no pad
        assert bool((mask[:, -1] == 1).all())  # padded on the left
    first = calls[0][2]
    lens = first["attention_mask"].sum(1).tolist()
    assert lens == [len(prompts[0])] * 3 + [len(prompts[1])]  # prompt-major rows
    calls.clear()
    model.eval()
    gen.generate(prompts[:1], n_samples=1, max_new_tokens=2, greedy=True)
    assert not model.training and calls[0][2]["do_sample"] is False


def test_greedy_sets_no_conflicting_flags(tiny, prompts, caplog):
    """transformers warns (once per message) about sampling flags given to greedy decoding."""
    from transformers.utils import logging as hf_logging

    tok, ours, _ = tiny
    model = copy.deepcopy(ours)
    model.generation_config.update(**HUB_DEFAULTS)
    ids = torch.tensor([prompts[0]])
    hf_logging.enable_propagation()
    try:
        with caplog.at_level(logging.WARNING, logger="transformers"):
            logging.Logger.warning_once.cache_clear()
            HFGenerationEngine(model, tok).generate(
                prompts, n_samples=1, max_new_tokens=3, greedy=True
            )
            ours_records = [r.getMessage() for r in caplog.records]
            logging.Logger.warning_once.cache_clear()
            model.generate(input_ids=ids, do_sample=False, temperature=0.5, max_new_tokens=2)
            harness = [r.getMessage() for r in caplog.records]
    finally:
        hf_logging.disable_propagation()
    assert ours_records == []
    assert any("temperature" in m for m in harness)  # the harness does see such warnings


def test_generation_config_defaults_do_not_change_samples(tiny, prompts):
    tok, ours, _ = tiny
    hub = copy.deepcopy(ours)
    hub.generation_config.update(**HUB_DEFAULTS)
    for kw in (dict(seed=5, top_p=0.95, temperature=1.2), dict(greedy=True)):
        a = HFGenerationEngine(ours, tok).generate(prompts, n_samples=2, max_new_tokens=6, **kw)
        b = HFGenerationEngine(hub, tok).generate(prompts, n_samples=2, max_new_tokens=6, **kw)
        assert a == b
    # and the harness can tell: transformers applies them when called directly
    ids = torch.tensor([prompts[1]])
    torch.manual_seed(0)
    direct = ours.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=2)
    assert not torch.equal(hub.generate(input_ids=ids, max_new_tokens=6, pad_token_id=2), direct)


def test_eos_is_cut_and_kept(tiny, prompts):
    tok, ours, _ = tiny
    eos = tok.eos_token_id
    always_eos = HFGenerationEngine(_biased(ours, eos), tok, batch_size=2)
    assert always_eos.generate(prompts, n_samples=2, max_new_tokens=5, seed=3) == [[eos]] * 8
    # a model that wants the pad token never emits it: responses never hold padding
    pad = tok.pad_token_id
    wants_pad = HFGenerationEngine(_biased(ours, pad), tok)
    out = wants_pad.generate(prompts, n_samples=2, max_new_tokens=5, seed=3)
    _check_shape(out, 8, 5, eos)
    assert all(pad not in r for r in out)


def test_split_responses_post_processing():
    E, P = 1, 2
    seqs = torch.tensor(
        [
            [P, P, 7, 8, 9, E, P, P],  # left-padded prompt; EOS then padding
            [P, 5, 6, 9, 9, 9, 9, 9],  # no EOS: all max_new_tokens kept
            [4, 5, 6, E, E, P, P, P],  # EOS first: cut after the first EOS
            [P, P, 6, 9, 9, E, 9, 9],  # tokens after EOS dropped
        ]
    )
    assert split_responses(seqs, 3, E, P) == [
        [8, 9, E],
        [9, 9, 9, 9, 9],
        [E],
        [9, 9, E],
    ]
    assert split_responses(torch.tensor([[3, 4, E, E, E]]), 2, E, E) == [[E]]  # pad == eos
    assert cut_at_eos([5, 6, E, 7, E], E) == [5, 6, E] and cut_at_eos([5, 6], E) == [5, 6]
    # several stop ids (EOS and an end-of-turn id): the first of any ends the response
    assert split_responses(seqs, 3, [E, 9], P) == [[8, 9], [9], [E], [9]]
    assert cut_at_eos([5, E, 6], np.int64(E)) == [5, E]
    assert split_responses(torch.tensor([[3, 4, 7, P, P]]), 2, [E, P], P) == [[7, P]]
    with pytest.raises(ValueError, match="prompt_width"):
        split_responses(seqs, 9, E, P)


def test_stops_at_the_models_end_of_turn_ids(tiny, prompts):
    """generation_config.eos_token_id (Llama-3's <|eot_id|>, Gemma's <end_of_turn>) ends a
    response as the tokenizer's EOS does; passing only the tokenizer's EOS used to override it."""
    tok, ours, _ = tiny
    free = HFGenerationEngine(ours, tok).generate(
        prompts[:1], n_samples=1, max_new_tokens=8, greedy=True
    )[0]
    stop = next(t for t in free[1:] if t != tok.eos_token_id)
    model = copy.deepcopy(ours)
    model.generation_config.eos_token_id = [tok.eos_token_id, stop]
    gen = HFGenerationEngine(model, tok)
    assert gen.stop_ids == [tok.eos_token_id, stop]
    out = gen.generate(prompts[:1], n_samples=1, max_new_tokens=8, greedy=True)[0]
    assert out == free[: free.index(stop) + 1]


def test_seeded_sampling_and_caller_rng(tiny, prompts):
    tok, ours, _ = tiny
    gen = HFGenerationEngine(ours, tok)
    kw = dict(n_samples=3, max_new_tokens=6, temperature=1.0)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = gen.generate(prompts, seed=7, **kw)
    assert torch.equal(torch.get_rng_state(), state)  # caller's RNG untouched
    torch.manual_seed(456)  # a different global state: the seed alone decides
    assert gen.generate(prompts, seed=7, **kw) == a
    b = gen.generate(prompts, seed=8, **kw)
    assert b != a
    assert len({tuple(r) for r in a[:3]}) > 1  # the samples of one prompt differ
    # greedy ignores the seed
    g = dict(n_samples=1, max_new_tokens=4, greedy=True)
    assert gen.generate(prompts, seed=1, **g) == gen.generate(prompts, seed=2, **g)


def test_our_attention_matches_sdpa_greedy(tiny, prompts):
    tok, ours, sdpa = tiny
    assert ours.config._attn_implementation != sdpa.config._attn_implementation
    kw = dict(n_samples=1, max_new_tokens=8, greedy=True)
    a = HFGenerationEngine(ours, tok, batch_size=3).generate(prompts, **kw)
    b = HFGenerationEngine(sdpa, tok, batch_size=3).generate(prompts, **kw)
    assert a == b and all(len(r) > 1 for r in a)


def test_zero3_decoding_steps_are_synced_over_ranks(tiny, prompts, monkeypatch):
    """ZeRO-3 gathers weights in every forward, so with more than one process each decoding
    step is synced (transformers' synced_gpus: a rank whose responses ended keeps stepping with
    the others); without ZeRO-3 or with one process nothing is synced. The multi-rank run:
    test_ppo.py::test_zero3_ranks_with_uneven_work_stay_in_step."""
    tok, ours, _ = tiny
    synced = []
    real = ours.generate

    def spy(**kw):
        synced.append(kw["synced_gpus"])
        return real(**{**kw, "synced_gpus": False})  # one process here: nobody to sync with

    monkeypatch.setattr(ours, "generate", spy)
    kw = dict(n_samples=1, max_new_tokens=2, greedy=True)
    assert not HFGenerationEngine(ours, tok, zero3=True).synced  # a world of one
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    plain, zero3 = HFGenerationEngine(ours, tok), HFGenerationEngine(ours, tok, zero3=True)
    assert not plain.synced and zero3.synced
    assert plain.generate(prompts, **kw) == zero3.generate(prompts, **kw)
    assert synced == [False, True]


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(prompts=[]), "prompts: expected a non-empty"),
        (dict(prompts=[[5], []]), r"prompts\[1\]: expected a non-empty"),
        (dict(n_samples=0), "n_samples: expected an int >= 1, got 0"),
        (dict(max_new_tokens=0), "max_new_tokens: expected an int >= 1, got 0"),
        (dict(temperature=0.0), "temperature: expected a float > 0"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), r"top_p: expected a float in \(0, 1\], got 0.0"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=math.nan), "top_p"),
        (dict(top_p=0.0, greedy=True), "top_p"),
        (dict(temperature=True), "temperature: expected a float > 0"),  # not 1.0
        (dict(temperature=math.inf), "temperature: expected a float > 0"),
        (dict(top_p=True), r"top_p: expected a float in \(0, 1\], got True"),
    ],
)
def test_generate_validation(tiny, kwargs, text):
    tok, ours, _ = tiny
    args = dict(prompts=[[5, 6]], n_samples=1, max_new_tokens=2) | kwargs
    with pytest.raises(ValueError, match=text):
        HFGenerationEngine(ours, tok).generate(args.pop("prompts"), **args)


def test_greedy_allows_zero_temperature_and_bad_batch_size(tiny):
    tok, ours, _ = tiny
    out = HFGenerationEngine(ours, tok).generate(
        [[5, 6]], n_samples=1, max_new_tokens=2, temperature=0.0, greedy=True
    )
    assert len(out) == 1
    with pytest.raises(ValueError, match="batch_size: expected an int >= 1, got 0"):
        HFGenerationEngine(ours, tok, batch_size=0)


# ----------------------------------------------------------------------------- rewards
def test_load_reward_fn(tmp_path, monkeypatch):
    assert rewards.load_reward_fn("trainers.rewards:reverse_reward") is rewards.reverse_reward
    (tmp_path / "my_rw.py").write_text(
        "class Task:\n    @staticmethod\n    def score(prompts, responses, **_):\n"
        "        return [1.0] * len(responses)\n"
    )
    (tmp_path / "needs_dep.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "broken_rw.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert rewards.load_reward_fn("my_rw:Task.score")(prompts=[], responses=["a"]) == [1.0]
    cases = {
        "nocolon": "expected 'module:function', got 'nocolon'",
        ":f": "expected 'module:function'",
        "trainers.rewards:": "expected 'module:function'",
        "no_such_mod:f": "--reward-fn 'no_such_mod:f': module 'no_such_mod' not found",
        "trainers.no_such:f": "module 'trainers.no_such' not found",
        "needs_dep:f": "cannot import module 'needs_dep': ModuleNotFoundError",
        "broken_rw:f": "cannot import module 'broken_rw': RuntimeError: boom",
        "trainers.rewards:nope": "--reward-fn 'trainers.rewards:nope': 'trainers.rewards' has no",
        "my_rw:Task.nope": "'my_rw.Task' has no 'nope'",
        "trainers.rewards:math": "not callable",
    }
    for spec, text in cases.items():
        with pytest.raises(ValueError) as e:
            rewards.load_reward_fn(spec)
        assert text in str(e.value), (spec, str(e.value))


def _const(values):
    return lambda prompts, responses, **_: values


def test_score_accepts_numbers_and_passes_columns():
    seen = {}

    def fn(prompts, responses, target):
        seen.update(prompts=prompts, responses=responses, target=target)
        return [1, True, np.float32(0.5), torch.tensor(-2.0)]

    got = rewards.score(fn, "f", ["p"] * 4, ["a", "b", "c", "d"], {"target": list("wxyz")})
    assert got == [1.0, 1.0, 0.5, -2.0] and all(type(v) is float for v in got)
    assert seen == {"prompts": ["p"] * 4, "responses": list("abcd"), "target": list("wxyz")}
    assert rewards.score(_const(torch.tensor([0.25, 3])), "t", ["p", "q"], ["a", "b"], {}) == [
        0.25,
        3,
    ]
    assert rewards.score(_const(np.array([1, 2])), "n", ["p", "q"], ["a", "b"], {}) == [1.0, 2.0]
    assert rewards.score(_const((0.5, np.int64(2))), "n", ["p", "q"], ["a", "b"], {}) == [0.5, 2.0]


@pytest.mark.parametrize(
    "out, text",
    [
        ([1.0], "returned 1 rewards for 2 responses"),
        ([1.0, 2.0, 3.0], "returned 3 rewards for 2 responses"),
        ([None, 1.0], "returned None for response #0"),
        ([1.0, math.nan], "returned nan for response #1"),
        ([1.0, -math.inf], "returned -inf for response #1"),
        ([1.0, "1.0"], "returned '1.0' for response #1"),
        ([1.0, 1 + 2j], "for response #1"),
        ([1.0, torch.tensor(math.nan)], "tensor(nan) for response #1"),
        ([1.0, [2.0]], "returned [2.0] for response #1"),
        (3.0, "must return a sequence of 2 numbers, got float"),
        (None, "must return a sequence of 2 numbers, got NoneType"),
        ("ab", "must return a sequence of 2 numbers, got str"),
        (torch.zeros(2, 1), "got Tensor of shape (2, 1)"),
        ({0.5, 0.1}, "got set"),  # no order: rewards could land on the wrong responses
        ({"a": 1.0, "b": 2.0}, "got dict"),
    ],
)
def test_score_rejects_bad_results(out, text):
    with pytest.raises(ValueError, match="reward function my.fn") as e:
        rewards.score(_const(out), "my.fn", ["p", "q"], ["a", "b"], {})
    assert text in str(e.value)


def test_score_reports_a_raising_function_and_bad_columns():
    def boom(prompts, responses, **_):
        raise KeyError("target")

    def lazy(prompts, responses, **_):  # a generator: its code runs when the result is read
        yield 1 / 0

    with pytest.raises(ValueError, match="reward function pkg:lazy raised ZeroDivisionError"):
        rewards.score(lazy, "pkg:lazy", ["p"], ["a"], {})
    with pytest.raises(ValueError, match="reward function pkg:map raised ValueError"):
        rewards.score(lambda responses, **_: map(float, responses), "pkg:map", ["p"], ["a"], {})
    with pytest.raises(ValueError, match=r"returned 1000\d+ for response #0: expected a finite"):
        rewards.score(_const([10**400]), "pkg:huge", ["p"], ["a"], {})  # no float: OverflowError

    with pytest.raises(ValueError, match="reward function pkg:boom raised KeyError: 'target'"):
        rewards.score(boom, "pkg:boom", ["p"], ["a"], {})
    with pytest.raises(ValueError, match="column 'target': expected one entry per response"):
        rewards.score(_const([1.0, 1.0]), "f", ["p", "q"], ["a", "b"], {"target": ["x"]})


def test_reverse_reward_values():
    got = rewards.reverse_reward(
        None, ["dcba", "dcbx", "dc", "", " dcba \n", "dcbaaa", "abcd", "xdcba"], ["dcba"] * 8
    )
    assert got == [1.0, 0.75, 0.5, 0.0, 1.0, 4 / 6, 0.0, 0.0]
    assert rewards.reverse_reward(["p"], ["", "a"], ["", " a "]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="reverse_reward: target: expected one entry"):
        rewards.reverse_reward(None, ["a", "b"], ["a"])


def test_letters_reward_values():
    got = rewards.letters_reward(
        None, ["abcd", "dcba", "zzzz", "", "dcbz", "dd", "dcbaxxxx"], ["dcba"] * 7
    )
    # overlap/max + position/max, halved
    want = [0.5, 1.0, 0.0, 0.0, 0.5 * 3 / 4 + 0.5 * 3 / 4, 0.5 * 1 / 4 + 0.5 * 1 / 4, 0.5]
    assert got == pytest.approx(want, abs=1e-12)
    assert got[0] > rewards.reverse_reward(None, ["abcd"], ["dcba"])[0]  # smoother
    with pytest.raises(ValueError, match="letters_reward: target"):
        rewards.letters_reward(None, ["a"], [])


def test_bundled_prompts_are_scored_by_reverse_reward():
    from trainers.data import make_default_path

    with open(make_default_path("prompts_toy.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert rows and all(r["prompt"] == f"reverse: {r['target'][::-1]}" for r in rows)
    targets = [r["target"] for r in rows]
    assert rewards.reverse_reward(None, targets, targets) == [1.0] * len(rows)
    assert rewards.letters_reward(None, targets, targets) == [1.0] * len(rows)
