"""In-process contract of the SFT / reward-model pieces the fast suite did not pin: tokenised
targets and pairs, gradient scaling over several micro-batches, the reward head's read position,
the empty-label loss graph, ``head_logit_args`` refusals, the pinned tiny model and the
warm-start build (its SFT subprocess stubbed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed")

from trainers import common, modeling, rm, sft, tiny, warm_start  # noqa: E402
from trainers.distributed import Layout  # noqa: E402

LAYOUT = Layout(1, 0, 1, 1, 1, torch.device("cpu"))


class StubEngine:
    """``engine(...)`` = ``fn(theta, ...)``, ``backward`` accumulates into the scalar ``theta``."""

    def __init__(self, fn):
        self.theta = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        self.fn = fn

    def __call__(self, *args, **kw):
        return self.fn(self.theta, *args, **kw)

    def set_gradient_accumulation_boundary(self, last):
        pass

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()

    def eval(self):
        pass

    def train(self):
        pass


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.ensure_tiny())


# ----------------------------------------------------------------------------- tokenising
def test_sft_tokenize_targets_only_the_response_and_eos(tok):
    cfg = sft.SFTConfig(max_len=64, input_template="{} =")
    (s,), dropped = sft.tokenize([{"prompt": "abc", "response": "cba"}], tok, cfg)
    n_prompt = len(tok.encode("abc ="))
    ids = s.ids.tolist()
    assert dropped == 0 and ids[-1] == tok.eos_token_id
    want = [-100] * (n_prompt - 1) + ids[n_prompt:] + [-100]  # targets[t] = ids[t + 1]
    assert s.targets.tolist() == want and s.n_targets == len(ids) - n_prompt


def test_rm_tokenize_keeps_chosen_first_and_the_margin_column(tok):
    cfg = rm.RMConfig(max_len=64, margin_key="m")
    rows = [{"prompt": "p", "chosen": "good", "rejected": "bad", "m": 0.75}]
    (p,), dropped = rm.tokenize(rows, tok, cfg)
    enc = rm.data.tokenize_pair(tok, "p", "good", "bad", 64)
    assert dropped == 0 and p.margin == 0.75
    assert p.chosen.tolist() == enc["chosen_ids"] and p.rejected.tolist() == enc["rejected_ids"]


# ----------------------------------------------------------------------------- scaling
def test_sft_gradient_is_the_batch_mean_over_several_micro_batches():
    """One sample per micro-batch: every micro-batch is scaled by the batch's target count,
    not its own (the gradient is d(sum nll) / all targets)."""

    def fwd(theta, input_ids, position_ids, labels, attention_mask=None, **kw):
        return theta * labels[labels != -100].double().sum()

    samples = []
    for ids, n_prompt in (([5, 6, 7, 8, 2], 2), ([9, 3, 2], 1), ([11, 12, 13, 14, 15, 2], 4)):
        ids = torch.tensor(ids)
        mask = torch.tensor([0] * n_prompt + [1] * (len(ids) - n_prompt))
        samples.append(sft.Sample(ids, common.shifted_targets(ids, mask)))
    tot = sum(sum(s.ids[n:].tolist()) for s, n in zip(samples, (2, 1, 4)))
    for no_packing in (False, True):
        cfg = sft.SFTConfig(no_packing=no_packing, micro_batch_tokens=6)
        assert len(common.my_micro_batches([5, 3, 6], cfg, LAYOUT)) > 1
        engine = StubEngine(fwd)
        got = sft.run_batch(engine, samples, cfg, LAYOUT, 0, train=True)
        assert got["nll"] == pytest.approx(tot) and (got["targets"], got["tokens"]) == (7, 14)
        assert engine.theta.grad.item() == pytest.approx(tot / 7)


def test_rm_gradient_is_the_pair_mean_over_several_micro_batches():
    def fwd(theta, input_ids, position_ids, last_index, attention_mask=None, **kw):
        return theta * input_ids.reshape(-1)[last_index].double() / 10

    pairs = [
        rm.Pair(torch.tensor([3, 9, 12]), torch.tensor([3, 9, 5]), margin=0.5),
        rm.Pair(torch.tensor([3, 4]), torch.tensor([3, 7])),
        rm.Pair(torch.tensor([3, 6, 8]), torch.tensor([3, 2, 1])),
    ]
    theta = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    rc, rr, m = torch.tensor([1.2, 0.4, 0.8]), torch.tensor([0.5, 0.7, 0.1]), [0.5, 0, 0]
    want = -F.logsigmoid(theta * (rc - rr) - torch.tensor(m)).mean()
    want.backward()
    for no_packing in (False, True):
        cfg = rm.RMConfig(no_packing=no_packing, micro_batch_tokens=6)
        assert len(common.my_micro_batches([6, 4, 6], cfg, LAYOUT)) > 1
        engine = StubEngine(fwd)
        got = rm.run_batch(engine, pairs, cfg, LAYOUT, 0, train=True)
        assert got["loss"] / 3 == pytest.approx(want.item()) and got["correct"] == 2
        assert engine.theta.grad.item() == pytest.approx(theta.grad.item())


def test_total_steps_refuses_a_batch_larger_than_the_data():
    from types import SimpleNamespace

    cfg = SimpleNamespace(batch_size=5, max_steps=3, epochs=1)
    with pytest.raises(ValueError, match="larger than the training set"):
        common.total_steps(4, cfg)
    assert common.total_steps(5, cfg) == 3


def test_sft_empty_micro_batch_is_one_pad_token_without_target():
    for no_packing in (False, True):
        mb = sft.micro_batch([], sft.SFTConfig(no_packing=no_packing), LAYOUT, pad_id=2)
        assert mb.inputs["input_ids"].tolist() == [[2]]
        assert mb.inputs["labels"].tolist() == [[-100]]


# ----------------------------------------------------------------------------- models
def _tiny_llama(cls, **kw):
    from transformers import LlamaConfig

    from rlhf_kernels.integrations.hf import register

    cfg = LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, **kw,
    )  # fmt: skip
    cfg._attn_implementation = register()
    torch.manual_seed(0)
    return cls(cfg).float().eval()


def test_causal_lm_loss_without_targets_keeps_the_head_in_the_graph():
    """No target token: loss 0, but the lm_head still gets a (zero) gradient (ZeRO hooks)."""
    from transformers import LlamaForCausalLM

    lm = _tiny_llama(LlamaForCausalLM)
    loss = modeling.CausalLMLoss(lm)(
        torch.tensor([[4, 5, 6]]), torch.arange(3)[None], torch.full((1, 3), -100)
    )
    loss.backward()
    head = lm.get_output_embeddings().weight
    assert loss.item() == 0.0 and head.grad is not None and not head.grad.any()


def test_reward_model_reads_the_score_at_each_sequences_last_real_token():
    """``rm.rewards`` through ``RewardModel``, packed and padded: each sequence's score equals
    the HF model's own on that sequence alone (a trailing pad is not read)."""
    from transformers import LlamaForSequenceClassification

    model = _tiny_llama(LlamaForSequenceClassification, num_labels=1)
    pairs = [
        rm.Pair(torch.tensor([3, 9, 12, 7]), torch.tensor([3, 9, 5, 0])),
        rm.Pair(torch.tensor([3, 4]), torch.tensor([3, 7, 8, 11, 2, 0, 0])),
    ]
    seqs = [s for p in pairs for s in (p.chosen, p.rejected)]
    with torch.no_grad():
        want = torch.stack([model(s[s != 0][None]).logits[0, 0] for s in seqs])
        for no_packing in (False, True):
            cfg = rm.RMConfig(no_packing=no_packing)
            got = rm.rewards(modeling.RewardModel(model), pairs, cfg, LAYOUT, 0, None)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_self_check_catches_a_two_percent_logit_scale(monkeypatch):
    """A logit scale ``head_logit_args`` misses by 2% is far above the fp32 tolerance."""
    from transformers import LlamaForCausalLM

    lm = _tiny_llama(LlamaForCausalLM)
    assert modeling.check_head_logits(lm) < 1e-5
    monkeypatch.setattr(
        modeling,
        "head_logit_args",
        lambda lm, temperature=1.0: dict(temperature=1.02, softcap=None),
    )
    with pytest.raises(ValueError, match="does not reproduce"):
        modeling.check_head_logits(lm)


@pytest.mark.parametrize(
    "cfg, err",
    [
        (dict(logit_scale=0.0), ValueError),
        (dict(logits_scaling=-2.0), ValueError),
        (dict(logit_scale="2"), ValueError),
        (dict(logit_scale=float("inf")), ValueError),  # folds into a temperature of 0
        (dict(lm_head_multiplier=True), ValueError),
        (dict(logits_scaling=float("nan")), ValueError),
        (dict(logit_scale=2.0, final_logit_softcapping=30.0), NotImplementedError),
    ],
)
def test_head_logit_args_refuses(cfg, err):
    from types import SimpleNamespace

    with pytest.raises(err):
        modeling.head_logit_args(SimpleNamespace(config=SimpleNamespace(**cfg)))


# ----------------------------------------------------------------------------- tiny model
def test_tiny_model_is_the_pinned_tiny_v1():
    """The cached folder is versioned (``tiny-v1``): its config and seed-0 weights are fixed."""
    from transformers import AutoTokenizer

    model = tiny.build_model(AutoTokenizer.from_pretrained(tiny.ensure_tiny()))
    cfg = model.config
    assert tiny.VOCAB_SIZE == 512 == cfg.vocab_size
    assert sum(p.numel() for p in model.parameters()) == 158_016
    assert not cfg.tie_word_embeddings and cfg.attention_dropout == 0.0
    w = model.model.embed_tokens.weight
    assert w.dtype == torch.float32
    want = torch.tensor([-0.0043330556, 0.0168781616, 0.0062466478])  # seed 0's init
    torch.testing.assert_close(w[7, :3], want, atol=1e-7, rtol=0)


# ----------------------------------------------------------------------------- warm start
def _fake_sft(calls, returncode=0):
    """Stands in for the SFT subprocess: records (cmd, env), writes its run folder."""

    def run(cmd, env, **kw):
        calls.append((cmd, env))
        out = Path(cmd[cmd.index("--output-dir") + 1])
        (out / "model").mkdir(parents=True)
        for f in (*tiny.REQUIRED_FILES, "model.safetensors"):
            (out / "model" / f).write_text("{}")
        (out / "metrics.jsonl").write_text('{"loss": 3.0}\n{"loss": 1.5, "eval_loss": 1.6}\n')
        return subprocess.CompletedProcess(cmd, returncode, "", "boom")

    return run


def test_warm_start_build_is_one_clean_single_process_sft(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(warm_start.subprocess, "run", _fake_sft(calls))
    for k in ("RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(k, "1")
    dst = tmp_path / "warm"
    assert warm_start.ensure_warm_start(dst, steps=7, quiet=True) == str(dst)
    ((cmd, env),) = calls
    assert cmd[1:3] == ["-m", "trainers.sft"] and ["--max-steps", "7"] == cmd[5:7]
    assert cmd[cmd.index("--input-template") + 1] == warm_start.TEMPLATE
    assert not {"RANK", "WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & env.keys()
    marker = json.loads((dst / warm_start.MARKER).read_text())
    assert (marker["steps"], marker["final_loss"], marker["eval_loss"]) == (7, 1.5, 1.6)
    assert warm_start.is_complete(dst) and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    (dst / warm_start.MARKER).unlink()  # a model folder without the marker is not a warm start
    assert not warm_start.is_complete(dst)


def test_warm_start_refuses_a_failed_sft_and_a_foreign_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start.subprocess, "run", _fake_sft([], returncode=1))
    with pytest.raises(RuntimeError, match="boom"):
        warm_start.ensure_warm_start(tmp_path / "w", quiet=True)
    assert not (tmp_path / "w").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(FileExistsError, match="warm_start.json"):
        warm_start.ensure_warm_start(tmp_path / "mine", quiet=True)
