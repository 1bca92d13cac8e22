"""Contract checks of trainers.rollout, trainers.distributed and the two demos that the other
tests left open (found by mutation testing). Single process: collectives are monkeypatched."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from test_trainer_rollout import _biased
from torch import nn

from trainers import distributed as D
from trainers import packing_demo
from trainers.distributed import Layout
from trainers.rollout import HFGenerationEngine, split_responses

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tokenizer, model with our attention) of the bundled tiny Llama."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_kernels.integrations.hf import register
    from trainers.tiny import ensure_tiny

    path = ensure_tiny(tmp_path_factory.mktemp("tiny") / "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    return tok, AutoModelForCausalLM.from_pretrained(path, attn_implementation=register()).eval()


# ----------------------------------------------------------------------------- rollout
def test_split_responses_shape_edges():
    """``prompt_width`` may be the whole width (no new tokens); only 2-D input is accepted."""
    seqs = torch.tensor([[3, 4], [5, 6]])
    assert split_responses(seqs, 2, 1, 2) == [[], []]
    assert split_responses(seqs, 0, 1, 2) == [[3, 4], [5, 6]]
    for bad in (torch.tensor([3, 4, 1]), seqs[None], torch.tensor(5)):
        with pytest.raises(ValueError, match="prompt_width"):
            split_responses(bad, 0, 1, 2)


def test_a_pad_that_is_the_eos_is_not_suppressed(tiny):
    """Without a pad token the pad is the EOS: suppressing it would never let a response end."""
    tok, model = tiny
    eos = tok.eos_token_id
    no_pad = SimpleNamespace(eos_token_id=eos, pad_token_id=None)
    gen = HFGenerationEngine(_biased(model, eos), no_pad)
    assert gen.generate([[5, 6], [7]], n_samples=2, max_new_tokens=4, seed=1) == [[eos]] * 4


def test_engine_refuses_a_tokenizer_without_eos_and_text_prompts(tiny):
    tok, model = tiny
    with pytest.raises(ValueError, match="expected an eos_token_id, got None"):
        HFGenerationEngine(model, SimpleNamespace(eos_token_id=None, pad_token_id=0))
    with pytest.raises(ValueError, match="prompts: expected a non-empty list"):
        HFGenerationEngine(model, tok).generate("abc", n_samples=1, max_new_tokens=1)


def test_zero3_in_a_world_of_one_is_not_synced(tiny, monkeypatch):
    tok, model = tiny
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert not HFGenerationEngine(model, tok, zero3=True).synced


def test_a_static_cache_in_the_generation_config_is_overridden(tiny):
    """Hub configs may ask for a static ("hybrid") cache, which our attention refuses."""
    tok, model = tiny
    static = copy.deepcopy(model)
    static.generation_config.cache_implementation = "static"
    kw = dict(n_samples=1, max_new_tokens=4, greedy=True)
    want = HFGenerationEngine(model, tok).generate([[5, 6, 7]], **kw)
    assert HFGenerationEngine(static, tok).generate([[5, 6, 7]], **kw) == want


def test_generation_seed_depends_on_the_run_seed():
    from trainers import ppo

    class Gen:
        seeds: list = []

        def generate(self, prompts, *, seed=None, n_samples, **_):
            self.seeds.append(seed)
            return [[1]] * n_samples

    class Tok:
        eos_token_id = 1

        def encode(self, text):
            return [3, 4]

        def decode(self, ids, skip_special_tokens=False):
            return "x"

    one = Layout(1, 0, 1, 1, 1, CPU)
    for s in (0, 1):
        cfg = ppo.PPOConfig(seed=s, n_samples_per_prompt=1)
        ppo.generate(Gen(), Tok(), [{"prompt": "ab"}], cfg, one, 3, [2])
    assert len(set(Gen.seeds)) == 2


# ----------------------------------------------------------------------------- distributed
def test_layout_rank_arithmetic():
    """``rank = (dp_rank * ring + ring_rank) * tp + tp_rank`` (TP groups consecutive)."""
    dp, ring, tp = 2, 3, 2
    seen = set()
    for rank in range(dp * ring * tp):
        lay = Layout(dp * ring * tp, rank, dp, ring, tp, CPU)
        assert (lay.dp_rank * ring + lay.ring_rank) * tp + lay.tp_rank == rank
        assert 0 <= lay.dp_rank < dp and 0 <= lay.ring_rank < ring and 0 <= lay.tp_rank < tp
        assert lay.ds_dp_size == dp * ring and lay.is_main == (rank == 0)
        seen.add((lay.dp_rank, lay.ring_rank, lay.tp_rank))
    assert len(seen) == dp * ring * tp


def test_check_sizes_needs_ring_times_tp_to_divide_the_world():
    D.check_sizes(12, 3, 2)
    for world, ring, tp in ((6, 2, 2), (4, 1, 3), (4, 3, 1)):
        with pytest.raises(ValueError, match=f"= {ring * tp} must divide"):
            D.check_sizes(world, ring, tp)


@pytest.mark.parametrize("rank", [0, 5, 11])
def test_init_distributed_builds_every_ring_group_in_order(monkeypatch, rank):
    """Every rank creates the same ring groups (stride ``tp``) and keeps its own."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "12")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda: rank)
    groups = []
    monkeypatch.setattr(dist, "new_group", lambda ranks: groups.append(ranks) or tuple(ranks))
    lay = D.init_distributed(ring=3, tp=2)
    assert (lay.world, lay.rank, lay.dp, lay.ring, lay.tp) == (12, rank, 2, 3, 2)
    assert groups == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert rank in lay.ring_group
    assert [Layout(12, r, 2, 3, 2, CPU).ring_rank for r in lay.ring_group] == [0, 1, 2]
    groups.clear()
    assert D.init_distributed(ring=1, tp=2).ring_group is None and groups == []
    assert rank in D.init_distributed(ring=2, tp=3).ring_group and len(groups) == 6


def test_reductions_use_the_right_op_and_group(monkeypatch):
    calls = []

    def fake(t, op=dist.ReduceOp.SUM, group=None):
        calls.append((op, group))
        t.mul_(2)  # as if two equal ranks

    monkeypatch.setattr(dist, "all_reduce", fake)
    two = Layout(2, 0, 2, 1, 1, CPU)
    assert D.sum_across([1.5, 2.0], two, group="g") == [3.0, 4.0]
    assert D.max_across(7, two) == 14
    assert D.peak_memory_mb(two) > 0
    assert calls == [(dist.ReduceOp.SUM, "g"), (dist.ReduceOp.MAX, None)] + [
        (dist.ReduceOp.MAX, None)
    ]
    calls.clear()
    one = Layout(1, 0, 1, 1, 1, CPU)
    assert D.sum_across([1.5], one) == [1.5] and D.max_across(7, one) == 7 and calls == []
    assert 50 < D.peak_memory_mb(one) < 2**20  # MiB: torch alone is over 50


def test_all_ranks_ok_raises_the_first_bad_ranks_message(monkeypatch):
    with pytest.raises(ValueError, match="^bad$"):
        D.all_ranks_ok(False, "bad", None)
    with pytest.raises(ValueError, match="^bad$"):
        D.all_ranks_ok(False, "bad", Layout(1, 0, 1, 1, 1, CPU))
    D.all_ranks_ok(True, "bad", None)

    def gather(out, obj):
        out[:] = [None, "r1 bad", "r2 bad"]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    with pytest.raises(ValueError, match=r"^r1 bad \(on rank 1\)$"):
        D.all_ranks_ok(True, "mine", Layout(3, 0, 3, 1, 1, CPU))


# ----------------------------------------------------------------------------- packing demo
def test_packing_demo_step_loss_is_the_mean_over_every_target_token():
    """``train_step``'s loss is the token mean over the whole step, padding excluded."""
    from rlhf_kernels.integrations.hf import packed_model_inputs, register

    register()
    model = packing_demo.build_model(0, 16).eval()
    model.set_attn_implementation("rlhf_kernels")
    g = torch.Generator().manual_seed(0)
    mbs = [[torch.randint(0, 256, (n,), generator=g)] for n in (5, 9)] + [
        [torch.randint(0, 256, (3,), generator=g)]
    ]
    with torch.no_grad():
        per_token = [
            nn.functional.cross_entropy(model(s[None]).logits[0, :-1], s[1:], reduction="sum")
            for mb in mbs
            for s in mb
        ]
    want = float(sum(per_token)) / sum(len(s) - 1 for mb in mbs for s in mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = packing_demo.RunStats()
    packing_demo.train_step(model, opt, mbs, packed_model_inputs, stats)
    assert stats.losses == [pytest.approx(want, rel=1e-4)]
    assert stats.real_tokens == stats.slots == 17 and stats.padding_fraction == 0.0
    padded = packing_demo.RunStats()
    packing_demo.train_step(model, opt, [mbs[0] + mbs[1]], packing_demo.padded_model_inputs, padded)
    assert padded.real_tokens == 14 and padded.slots == 18
    assert padded.padding_fraction == pytest.approx(4 / 18)


def test_packing_demo_cli_edges():
    args = packing_demo.parse_args(["--tol", "0", "--max-len", "2", "--max-tokens", "2"])
    assert args.tol == 0 and args.max_len == 2
    for bad in (["--tol", "-0.5"], ["--max-len", "1"], ["--batch-size", "0"]):
        with pytest.raises(SystemExit):
            packing_demo.parse_args(bad)


def test_packing_demo_tolerance_is_inclusive(monkeypatch, capsys):
    same = (packing_demo.RunStats(losses=[1.0]), packing_demo.RunStats(losses=[1.0]))
    monkeypatch.setattr(packing_demo, "run", lambda args: same)
    assert packing_demo.main(["--tol", "0"]) == same
    assert "OK" in capsys.readouterr().out


class _Stub(nn.Linear):
    """Stands in for the tiny Llama: ``run``'s loop without a model."""

    def __init__(self, *_):
        super().__init__(1, 1)

    def set_attn_implementation(self, name):
        pass


def _stub_run(monkeypatch, argv) -> list:
    """``packing_demo.run`` without training: ``(sample ids, timed)`` of each packed step."""
    seen = []

    def fake_step(model, opt, micro, make_inputs, stats, timed=True):
        if make_inputs is packing_demo.packed_model_inputs:
            seen.append(([id(s) for mb in micro for s in mb], timed))
        stats.losses.append(0.0)

    monkeypatch.setattr(packing_demo, "train_step", fake_step)
    monkeypatch.setattr(packing_demo, "build_model", _Stub)
    packing_demo.run(packing_demo.parse_args(argv))
    return seen


def test_packing_demo_steps_take_fresh_samples_and_time_all_but_the_warm_up(monkeypatch):
    seen = _stub_run(monkeypatch, ["--steps", "3", "--batch-size", "5"])
    assert [t for _, t in seen] == [False, True, True]  # step 0 warms up
    batches = [ids for ids, _ in seen]
    assert all(len(ids) == 5 for ids in batches) and len({i for b in batches for i in b}) == 15
    seen = _stub_run(monkeypatch, ["--steps", "1", "--batch-size", "2"])
    assert [t for _, t in seen] == [True]  # a one-step run times its only step


def test_packing_demo_batch_may_outnumber_the_corpus(monkeypatch):
    """--batch-size 100 on the 70-sample corpus ran steps of 70 samples."""
    seen = _stub_run(monkeypatch, ["--steps", "2", "--batch-size", "100"])
    assert [len(ids) for ids, _ in seen] == [100, 100]


# ----------------------------------------------------------------------------- demo
def test_demo_main_passes_rl_steps_and_judges_the_gain(tmp_path, monkeypatch, capsys):
    from trainers import demo

    cmds = []
    monkeypatch.setattr(demo, "run", lambda module, args: cmds.append((module, args)) or 1.0)
    m = [{"reward_mean": r} for r in (0.0, 0.5, 1.0, 1.0)]
    m[0]["eval_reward_before"], m[-1]["eval_reward"] = 0.25, 0.5
    monkeypatch.setattr(demo, "read", lambda path: m)
    out = demo.main(
        ["--output-dir", str(tmp_path), "--rl-steps", "4", "--min-gain", "0.75"]
    )  # exactly
    assert out["evals"] == [0.25, 0.5] and out["last"] - out["first"] == 0.75
    ppo_args = cmds[1][1]
    assert cmds[1][0] == "ppo" and ppo_args[ppo_args.index("--max-steps") + 1] == "4"
    with pytest.raises(SystemExit):
        demo.main(["--output-dir", str(tmp_path), "--min-gain", "0.76"])
    assert "--max-steps" not in cmds[-1][1]  # no --rl-steps: trainers.ppo's default
    assert demo.parse_args(["--seed", str(2**32 - 1)]).seed == 2**32 - 1
    with pytest.raises(SystemExit):
        demo.parse_args(["--seed", str(2**32)])
