"""The PPO trainer: experience log-probs in-process, and the trainer as a program (the default
run raises the reward, every advantage estimator runs, data parallelism and ring attention
reproduce the 1-process run, bad input is one error). Rollout engine and reward functions:
test_trainer_rollout.py."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from test_trainers import ROOT, _bad, metrics, run_trainer

pytest.importorskip("deepspeed")

FAST = [
    "--max-steps",
    "2",
    "--rollout-batch-size",
    "4",
    "--n-samples-per-prompt",
    "2",
    "--max-new-tokens",
    "6",
    "--batch-size",
    "8",
    "--logger",
    "none",
    "--eval-ratio",
    "0.01",
    "--seed",
    "1",
]


# ----------------------------------------------------------------------------- rollouts
@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlhf_kernels.integrations.hf import register
    from trainers.tiny import ensure_tiny

    path = ensure_tiny()
    tok = AutoTokenizer.from_pretrained(path)
    ours = AutoModelForCausalLM.from_pretrained(path, attn_implementation=register())
    sdpa = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    return tok, ours, sdpa


def test_action_logprobs_match_the_model(tiny):
    """The experience's log-probs are those of the sampled response tokens under the model."""
    from trainers import ppo
    from trainers.distributed import Layout
    from trainers.rollout import HFGenerationEngine

    tok, ours, _ = tiny
    prompt = tok("reverse: hello").input_ids
    outs = HFGenerationEngine(ours, tok).generate([prompt], n_samples=3, max_new_tokens=6, seed=1)
    samples = [ppo.Sample(torch.tensor(prompt + r), len(prompt)) for r in outs]
    layout = Layout(1, 0, 1, 1, 1, torch.device("cpu"))
    with torch.no_grad():
        logp, ent = ppo.Actor(ours, 1.0)(samples, layout)
        ref = []
        for s in samples:
            lp = ours(s.ids[None]).logits[0].float().log_softmax(-1)
            ref.append(lp[s.n_prompt - 1 : -1].gather(-1, s.ids[s.n_prompt :, None])[:, 0])
    assert torch.allclose(logp, torch.cat(ref), atol=1e-4)
    assert logp.shape == ent.shape == (sum(s.n_act for s in samples),)


@pytest.mark.parametrize(
    "estimator", ["gae", "reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo"]
)
def test_advantages_match_a_per_token_loop(estimator):
    """``advantages()`` against a plain loop per sample: the scalar reward on the LAST response
    token, the KL penalty on every token, the estimator's baseline, discounting / GAE and the
    whitening. (The trainer runs only checked that these came out finite: a reward moved to
    the first token, or one estimator's baseline swapped for another's, went unseen.)"""
    import statistics

    from trainers import ppo
    from trainers.distributed import Layout

    g = torch.Generator().manual_seed(0)
    n_act, rewards = [3, 1, 2, 4], [1.0, 0.0, 0.6, 0.2]  # 2 prompts x 2 samples
    samples = []
    for n, r in zip(n_act, rewards):
        s = ppo.Sample(torch.randint(3, 50, (2 + n,), generator=g), 2, reward=r)
        s.old_logp, s.ref_logp = -torch.rand(n, generator=g) * 2, -torch.rand(n, generator=g) * 2
        s.values = torch.randn(n, generator=g)
        samples.append(s)
    cfg = ppo.PPOConfig(
        advantage_estimator=estimator, n_samples_per_prompt=2, kl_coef=0.1, kl_estimator="k1",
        gamma=0.9, lam=0.8,
    )  # fmt: skip
    ppo.advantages(samples, cfg, Layout(1, 0, 1, 1, 1, torch.device("cpu")))

    groups = [rewards[0:2], rewards[2:4]]
    owner = [groups[0], groups[0], groups[1], groups[1]]  # each sample's group
    centred = [r - statistics.mean(grp) for r, grp in zip(rewards, owner)]
    scalar = {
        "gae": rewards,
        "reinforce": rewards,
        "dr_grpo": centred,
        "grpo": [c / (statistics.stdev(grp) + 1e-6) for c, grp in zip(centred, owner)],
        "rloo": [r - (sum(grp) - r) / (len(grp) - 1) for grp in groups for r in grp],
        "reinforce_baseline": [c / (statistics.stdev(centred) + 1e-6) for c in centred],
    }[estimator]
    want_adv, want_ret = [], []
    for s, r in zip(samples, scalar):
        kl = (s.old_logp - s.ref_logp).double().tolist()
        tok = [-0.1 * k for k in kl]
        tok[-1] += r  # the last response token
        v = s.values.double().tolist()
        adv, ret, carry, later = [0.0] * len(tok), [0.0] * len(tok), 0.0, 0.0
        for t in reversed(range(len(tok))):
            if estimator == "gae":
                v_next = v[t + 1] if t + 1 < len(tok) else 0.0
                carry = tok[t] + 0.9 * v_next - v[t] + 0.9 * 0.8 * carry
                adv[t], ret[t] = carry, carry + v[t]
            else:
                later = tok[t] + 0.9 * later
                adv[t] = ret[t] = later
        want_adv += adv
        want_ret += ret
    if estimator in ("gae", "reinforce"):  # whitened over every token
        mean, sd = statistics.mean(want_adv), statistics.variance(want_adv)
        want_adv = [(a - mean) / (sd + 1e-8) ** 0.5 for a in want_adv]
    got_adv = torch.cat([s.advantages for s in samples]).double()
    got_ret = torch.cat([s.returns for s in samples]).double()
    torch.testing.assert_close(
        got_adv, torch.tensor(want_adv, dtype=torch.float64), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(
        got_ret, torch.tensor(want_ret, dtype=torch.float64), atol=1e-5, rtol=1e-5
    )


def test_an_engine_without_synced_attribute_still_generates(tiny):
    """``synced`` is optional in the GenerationEngine protocol: a user's engine without it
    generates as before (no collectives)."""
    from trainers import ppo
    from trainers.distributed import Layout

    tok = tiny[0]

    class Echo:  # every response is the EOS token
        def generate(self, prompts, *, n_samples, max_new_tokens, **kw):
            return [[tok.eos_token_id] for _ in prompts for _ in range(n_samples)]

    cfg = ppo.PPOConfig(n_samples_per_prompt=2)
    layout = Layout(1, 0, 1, 1, 1, torch.device("cpu"))
    rows = [{cfg.input_key: "reverse: ab"}, {cfg.input_key: "reverse: cd"}]
    samples, texts = ppo.generate(Echo(), tok, rows, cfg, layout, 0, [0, 1])
    assert len(samples) == len(texts) == 4 and all(s.n_act == 1 for s in samples)


def test_global_moments_of_values_far_from_zero():
    """Whitening statistics stay exact for rewards with a large offset (the one-pass float32
    formula was 10% off at offset 100, std 0.1)."""
    from trainers import ppo
    from trainers.distributed import Layout

    x = 100 + 0.1 * torch.randn(4096, generator=torch.Generator().manual_seed(0))
    layout = Layout(1, 0, 1, 1, 1, torch.device("cpu"))
    mean, var = ppo.global_moments(x, layout, repeats=1)
    ref = x.double()
    assert abs(mean - ref.mean().item()) < 1e-9 and abs(var / ref.var().item() - 1) < 1e-9
    white = ppo.global_whiten(x, layout, repeats=1).double()
    assert abs(white.mean().item()) < 1e-4 and abs(white.std().item() - 1) < 1e-4


# ----------------------------------------------------------------------------- the program
@pytest.mark.slow
def test_default_run_raises_the_reward(tmp_path, monkeypatch):
    """``python -m trainers.ppo --seed 1`` and nothing else, on a fresh cache (so the SFT warm
    start is built here): the mean sampled reward of the last 3 steps is at least 0.2 above
    that of the first 3, in a few minutes on a 2-core CPU."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("RLHF_KERNELS_TINY", str(cache / "tiny-v1"))
    monkeypatch.delenv("RLHF_KERNELS_WARM_START", raising=False)
    t0 = time.perf_counter()
    proc = run_trainer("ppo", ["--seed", "1"], tmp_path / "run")
    took = time.perf_counter() - t0
    m = metrics(tmp_path / "run")
    assert len(m) >= 6 and all("reward_mean" in x for x in m)
    first = sum(x["reward_mean"] for x in m[:3]) / 3
    last = sum(x["reward_mean"] for x in m[-3:]) / 3
    print(f"default run: {len(m)} steps, reward {first:.3f} -> {last:.3f}, {took:.0f} s")
    assert last - first >= 0.2, (first, last)
    assert "building the default PPO model once" in proc.stderr
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["model"] == str(cache / "tiny-v1-sft-v1")
    assert cfg["input_template"] == "{} =" and cfg["reward_fn"] == "trainers.rewards:reverse_reward"
    assert took < 600


def test_with_a_model_only_the_prompts_are_defaulted(tmp_path, monkeypatch):
    """With --model, only the prompts (and their reward) are defaulted: no template, no build."""
    from trainers.ppo import PPOConfig, resolve_defaults

    monkeypatch.setenv("RLHF_KERNELS_TINY", str(tmp_path / "tiny-v1"))
    cfg = resolve_defaults(PPOConfig(model="mine"))
    assert cfg.model == "mine" and cfg.input_template is None
    assert cfg.reward_fn == "trainers.rewards:reverse_reward"
    rows = [json.loads(x) for x in open(cfg.dataset)]
    assert len(rows) == 1000 and rows[0]["prompt"].startswith("first letter: ")
    assert not (tmp_path / "tiny-v1-sft-v1").exists()
    cfg = resolve_defaults(PPOConfig(model="mine", reward_model="rm"))
    assert cfg.reward_fn is None
    cfg = resolve_defaults(PPOConfig(model="mine", dataset="d.jsonl"))
    assert cfg.dataset == "d.jsonl" and cfg.reward_fn is None


@pytest.mark.slow
def test_concurrent_warm_start_builds_once(tmp_path):
    """Several processes (e.g. torchrun ranks) asking for the warm start: one builds, the
    others wait for it and get the same complete folder; no temporary folder is left."""
    code = (
        "import sys; from trainers.warm_start import ensure_warm_start; "
        "print(ensure_warm_start(sys.argv[1], steps=3))"
    )
    dst = tmp_path / "warm"
    env = dict(os.environ, OMP_NUM_THREADS="1", RLHF_KERNELS_TINY=str(tmp_path / "tiny-v1"))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(dst)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    assert [o.strip() for o, _ in outs] == [str(dst)] * 3
    assert sum("building the default PPO model once" in e for _, e in outs) == 1
    from trainers.warm_start import is_complete

    assert is_complete(dst)
    assert json.loads((dst / "warm_start.json").read_text())["steps"] == 3
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "estimator", ["gae", "reinforce", "reinforce_baseline", "rloo", "grpo", "dr_grpo"]
)
def test_every_advantage_estimator_trains(estimator, tmp_path):
    extra = ["--kl-coef", "0.01"] + (
        ["--kl-in-loss", "--dual-clip", "3"] if estimator == "rloo" else []
    )
    if estimator == "reinforce":
        extra += ["--warmup-steps", "2"]
    run_trainer("ppo", FAST + ["--advantage-estimator", estimator, *extra], tmp_path)
    m = metrics(tmp_path)
    assert [x["step"] for x in m] == [1, 2]
    if estimator == "reinforce":  # each step logs the lr its update used: 1/3, 2/3 of 1e-3
        assert [x["lr"] for x in m] == pytest.approx([1e-3 / 3, 2e-3 / 3], rel=1e-9)
    for key in (
        "reward_mean",
        "reward_std",
        "response_length",
        "kl",
        "entropy",
        "clip_fraction",
        "approx_kl",
        "policy_loss",
        "advantage_mean",
        "tokens_per_s",
        "rollout_s",
        "train_s",
        "peak_mem_mb",
        "eval_reward",
    ):
        assert key in m[0] or key in m[-1], key
    assert all(math.isfinite(x["policy_loss"]) for x in m)
    if estimator == "gae":
        assert all(math.isfinite(x["value_loss"]) for x in m)
    assert (tmp_path / "model" / "config.json").is_file()


@pytest.mark.slow
def test_dr_grpo_loss_aggregation_is_the_constant_normaliser(tmp_path):
    """``--loss-aggregation seq-mean-token-sum-norm``: on the same first rollouts the loss
    (and its gradient) is the token-mean one times action tokens / (samples x max new
    tokens); entropy and clip statistics stay token means."""
    base = FAST + ["--max-steps", "1", "--advantage-estimator", "dr_grpo"]
    run_trainer("ppo", base, tmp_path / "mean")
    norm = ["--loss-aggregation", "seq-mean-token-sum-norm"]
    run_trainer("ppo", base + norm, tmp_path / "norm")
    a, b = metrics(tmp_path / "mean")[0], metrics(tmp_path / "norm")[0]
    factor = a["response_length"] * 8 / (8 * 6)  # 8 samples, --max-new-tokens 6
    assert 0 < factor < 1
    for key in ("reward_mean", "response_length", "entropy", "clip_fraction", "approx_kl"):
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), key
    for key in ("policy_loss", "grad_norm"):
        assert b[key] == pytest.approx(a[key] * factor, rel=1e-4, abs=1e-8), key


@pytest.mark.slow
def test_policy_loss_is_the_surrogate_and_one_step_runs_evaluate_after_it(tmp_path):
    """``policy_loss`` logs the clipped surrogate alone (it used to include the entropy bonus
    and the in-loss KL); ``actor_loss`` is what is minimised. A one-step run logs the greedy
    reward before (``eval_reward_before``) and after (``eval_reward``) its update."""
    base = FAST + ["--max-steps", "1", "--ppo-epochs", "1", "--advantage-estimator", "rloo"]
    run_trainer("ppo", base, tmp_path / "plain")
    extra = ["--entropy-coef", "0.5", "--kl-coef", "0.1", "--kl-in-loss"]
    run_trainer("ppo", base + extra, tmp_path / "bonus")
    a, b = metrics(tmp_path / "plain")[0], metrics(tmp_path / "bonus")[0]
    assert a["reward_mean"] == pytest.approx(b["reward_mean"])  # the same rollouts
    assert b["policy_loss"] == pytest.approx(a["policy_loss"], rel=1e-5, abs=1e-7)
    assert a["actor_loss"] == pytest.approx(a["policy_loss"], rel=1e-6, abs=1e-9)
    # at step 1 the actor is the reference: the in-loss KL is 0
    want = b["policy_loss"] - 0.5 * b["entropy"]
    assert b["actor_loss"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert b["entropy"] > 0.1
    for m in (a, b):
        assert math.isfinite(m["eval_reward_before"]) and math.isfinite(m["eval_reward"])


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory):
    """``run(args) -> output folder`` of a 1-process run, each argument list run once."""
    runs: dict = {}

    def run(args: list[str]):
        if tuple(args) not in runs:
            out = tmp_path_factory.mktemp("ppo-one")
            run_trainer("ppo", args, out)
            runs[tuple(args)] = out
        return runs[tuple(args)]

    return run


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory):
    """A reward model folder saved by trainers.rm (a short run)."""
    from test_trainers import SHORT

    out = tmp_path_factory.mktemp("rm")
    run_trainer("rm", SHORT, out)
    return out / "model"


def assert_same_step(a: dict, b: dict, keys, rel: float = 1e-4) -> None:
    for key in keys:
        assert abs(a[key] - b[key]) <= rel * abs(a[key]) + 1e-6, (key, a[key], b[key])


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "common,extra",
    [
        (["--kl-coef", "0.05"], ["--zero-stage", "2"]),
        # the reference model defaults to ZeRO-3 too
        (["--kl-coef", "0.05"], ["--zero-stage", "3"]),
        # reference partitioned and kept on the CPU
        (["--kl-coef", "0.05"], ["--zero-stage", "2", "--ref-offload"]),
        # two optimizer steps per rollout step: each holds the same prompts on 1 and 2 ranks,
        # and the REINFORCE++-baseline std is the global batch's
        (["--batch-size", "4", "--advantage-estimator", "reinforce_baseline"], []),
        # AutoTP shards the actor and the critic over both ranks (dp 1)
        (["--kl-coef", "0.05", "--advantage-estimator", "gae"], ["--tp-size", "2"]),
        # bf16 at ZeRO 0: the trainer computes the norm over both TP shards and clips itself
        (["--dtype", "bf16"], ["--tp-size", "2"]),
    ],
    ids=[
        "zero2",
        "zero3",
        "zero2-ref-offload",
        "mini-batches-reinforce-baseline",
        "tp2-gae",
        "tp2-bf16",
    ],
)
def test_data_parallel_reproduces_the_first_step(common, extra, one_process_run, tmp_path):
    """Prompts are seeded individually, so 2 ranks generate the rollouts of 1 rank; the frozen
    reference model gives the same KL whether replicated, ZeRO-3 partitioned or offloaded."""
    one = one_process_run(FAST + common)
    run_trainer("ppo", FAST + common + extra, tmp_path / "two", nproc=2)
    a, b = metrics(one)[0], metrics(tmp_path / "two")[0]
    keys = ("reward_mean", "response_length", "policy_loss", "entropy", "kl", "grad_norm")
    keys += ("advantage_std",) + (("value_loss",) if "gae" in common else ())
    if "bf16" in common:  # TP splits the matmuls' sums (DeepSpeed's own norm was 10% low here)
        assert_same_step(a, b, [k for k in keys if k != "kl"], rel=5e-3)
        assert b["kl"] < 1e-4  # the sharded actor vs the whole reference: bf16 rounding only
    else:
        assert_same_step(a, b, keys)
    assert all(math.isfinite(x["reward_mean"]) for x in metrics(tmp_path / "two"))


@pytest.mark.slow
def test_gradient_checkpointing_recomputes_the_update_forwards(one_process_run, tmp_path):
    """``--gradient-checkpointing`` with the actor and critic kept in eval mode (dropout off):
    their layers are checkpointed in the update forwards only (not in generation, whose KV cache
    it would drop, nor in no-grad experience), and the run is unchanged."""
    args = FAST + ["--kl-coef", "0.05", "--advantage-estimator", "gae"]
    script = tmp_path / "count_checkpoints.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        import torch
        import torch.utils.checkpoint as C

        grad_enabled = []
        original = C.checkpoint

        def counting(*args, **kwargs):
            grad_enabled.append(torch.is_grad_enabled())
            return original(*args, **kwargs)

        C.checkpoint = counting  # before transformers binds it
        from trainers import ppo

        ppo.main(sys.argv[1:])
        print("CHECKPOINTED", len(grad_enabled), all(grad_enabled), file=sys.stderr)
    """)
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = tmp_path / "gc"
    cmd = [sys.executable, str(script), *args, "--gradient-checkpointing", "--output-dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    n, all_grad = proc.stderr.split("CHECKPOINTED")[-1].split()[:2]
    # 2 steps x (actor + critic) x >= 1 micro-batch x 2 layers
    assert int(n) >= 8 and all_grad == "True", proc.stderr[-2000:]
    keys = ("reward_mean", "response_length", "policy_loss", "value_loss", "kl", "grad_norm")
    for a, b in zip(metrics(one_process_run(args)), metrics(out), strict=True):
        assert_same_step(a, b, keys)


@pytest.mark.slow
@pytest.mark.multiproc
def test_zero3_ranks_with_uneven_work_stay_in_step(reward_model, one_process_run, tmp_path):
    """ZeRO-3 gathers the weights in every forward, so every rank must run as many as the
    busiest: here the rank with the long prompt (46 tokens) needs at least 2 micro-batches of
    56 tokens for its samples, the other 1 (old / reference log-probs, reward-model scores);
    responses end at different lengths; the one held-out prompt leaves a rank nothing to
    evaluate. The run equals the 1-process run."""
    short, long = "first letter: a", "first letter: " + " ".join(["word"] * 40)
    data, held = tmp_path / "prompts.jsonl", tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [long] + [short] * 3))
    held.write_text(json.dumps({"prompt": short}) + "\n")
    args = FAST + ["--dataset", str(data), "--eval-dataset", str(held), "--eval-steps", "1"]
    args += ["--reward-model", str(reward_model), "--micro-batch-tokens", "56"]
    one = one_process_run(args)
    run_trainer("ppo", args + ["--zero-stage", "3"], tmp_path / "two", nproc=2, timeout=300)
    a, b = metrics(one), metrics(tmp_path / "two")
    assert [x["step"] for x in b] == [1, 2]
    keys = ("reward_mean", "reward_std", "eval_reward", "policy_loss", "kl", "grad_norm")
    assert_same_step(a[0], b[0], keys)
    assert math.isfinite(b[1]["eval_reward"])


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize(
    "extra,untrained",
    [
        (["--rollout-distribution", "scatter"], True),
        # each ring rank scores its own whole samples with the reward model (no ring split);
        # ZeRO-3 over the ring ranks: their generation steps and forwards stay in step
        (["--rollout-distribution", "scatter", "--reward-model", "RM", "--zero-stage", "3"], False),
        (
            [
                "--rollout-distribution",
                "broadcast",
                "--advantage-estimator",
                "gae",
                "--kl-coef",
                "0.05",
            ],
            False,
        ),
    ],
    ids=["scatter-grpo", "scatter-reward-model-zero3", "broadcast-gae"],
)
def test_ring_rollouts_reproduce_the_single_process_run(extra, untrained, request, tmp_path):
    """Ring ranks generate shares and keep only token shards; both steps (rollouts, KL,
    advantages, losses, gradient norms, critic) equal the 1-process run. broadcast-gae runs
    the default (warm-started) model, whose 2-token answers leave some ring ranks without an
    action token; scatter-grpo the untrained one on the "reverse" prompts: with GRPO the
    warm model's paired answers cancel many gradient entries to rounding noise, which Adam's
    first step turns into full-size updates of either sign, so step 2 would compare noise."""
    if "RM" in extra:
        extra = [str(request.getfixturevalue("reward_model")) if x == "RM" else x for x in extra]
    if untrained:
        from trainers.data import make_default_path
        from trainers.tiny import ensure_tiny

        extra = extra + [
            "--model",
            ensure_tiny(),
            "--dataset",
            make_default_path("prompts_toy.jsonl"),
            "--reward-fn",
            "trainers.rewards:reverse_reward",
        ]
    run_trainer("ppo", FAST + extra, tmp_path / "one")
    # broadcast-gae also checkpoints the actor's and critic's layers: their backward recomputes
    # ring attention (under the shard's ring_context), and the numbers do not change
    ring = ["--ring-attn-size", "2"] + (["--gradient-checkpointing"] if "gae" in extra else [])
    run_trainer("ppo", FAST + extra + ring, tmp_path / "ring", nproc=2)
    one, ring = metrics(tmp_path / "one"), metrics(tmp_path / "ring")
    assert len(one) == len(ring) == 2
    for a, b in zip(one, ring):
        for key in (
            "reward_mean",
            "tokens",
            "kl",
            "advantage_std",
            "policy_loss",
            "entropy",
            "grad_norm",
            "value_loss",
        ):
            # kl at step 2 (~1e-3) measures how far step 1's Adam update moved the actor from
            # the reference: gradient entries that cancel to rounding noise get full-size steps
            # of either sign from Adam, so it differs by up to ~0.5% between layouts (measured
            # 0.49% with scatter-reward-model-zero3 while the step-1 gradient norms agreed to
            # 1.2e-8; 1.2e-6 absolute with other seeds)
            rtol, atol = (1e-2, 5e-6) if key == "kl" else (1e-4, 1e-6)
            if key in a:
                assert abs(a[key] - b[key]) <= rtol * abs(a[key]) + atol, (key, a, b)


@pytest.mark.slow
def test_ppo_bad_input_is_one_clear_error(tmp_path):
    mod = tmp_path / "my_rewards.py"
    mod.write_text(
        textwrap.dedent("""
        def boom(prompts, responses, **_):
            raise RuntimeError("reward server down")

        def short(prompts, responses, **_):
            return [0.0]
    """)
    )
    from trainers.tiny import ensure_tiny

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "a b c"}] * 4 + [{"prompt": " ".join("abcdefghijklmnopqrst")}] * 2
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # a tokenizer that adds no BOS (GPT-2, Qwen) renders an empty prompt to no tokens at all
    nobos = tmp_path / "nobos"
    shutil.copytree(ensure_tiny(), nobos)
    tok = json.loads((nobos / "tokenizer.json").read_text())
    tok["post_processor"] = None
    (nobos / "tokenizer.json").write_text(json.dumps(tok))
    # a reward model whose tokenizer numbers the tokens differently (two ids swapped)
    from transformers import AutoConfig, AutoModelForSequenceClassification

    other_rm = tmp_path / "other_rm"
    rcfg = AutoConfig.from_pretrained(ensure_tiny(), num_labels=1)
    AutoModelForSequenceClassification.from_config(rcfg).save_pretrained(other_rm)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(nobos / f, other_rm / f)
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other_rm / "tokenizer.json").write_text(json.dumps(tok))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a b", "c d", "", "e"]))
    clash = tmp_path / "clash.jsonl"  # a column the reward function gets as its responses=
    clash.write_text("".join(json.dumps({"prompt": p, "responses": p}) + "\n" for p in "abcdef"))
    cases = {
        "one sample per prompt": (
            ["--advantage-estimator", "grpo", "--n-samples-per-prompt", "1"],
            1,
            "needs --n-samples",
        ),
        "raising reward": (["--reward-fn", "my_rewards:boom"], 2, "raised RuntimeError"),
        "wrong count": (["--reward-fn", "my_rewards:short"], 1, "returned 1 rewards"),
        "not a reward model": (["--reward-model", ensure_tiny()], 1, "is not a reward model"),
        "long prompt": (["--max-len", "3"], 1, "more than --max-len 3"),
        # the row of the file, not of what the --eval-ratio holdout leaves
        "long prompt row": (
            ["--dataset", str(prompts), "--max-len", "12", "--eval-ratio", "0.5"],
            1,
            "prompt row 4 (0-based) of the --dataset",
        ),
        "empty prompt": (
            ["--model", str(nobos), "--dataset", str(empty), "--eval-ratio", "0"],
            1,
            "prompt row 2 (0-based) of the --dataset (--split 'train'), '', has no tokens",
        ),
        "reward model tokenizer": (
            ["--reward-model", str(other_rm)],
            1,
            "has a tokenizer with another vocabulary than the policy's",
        ),
        "critic tokenizer": (  # the critic folder went unchecked: it trained silently
            ["--advantage-estimator", "gae", "--critic-model", str(other_rm)],
            1,
            "--critic-model '" + str(other_rm) + "' has a tokenizer with another vocabulary",
        ),
        "critic folder": (  # a traceback after the actor and reference were built
            ["--advantage-estimator", "gae", "--critic-model", str(tmp_path / "nowhere")],
            1,
            "is not a model folder",
        ),
        "no packing": (["--no-packing"], 1, "always packed"),
        "reward keyword column": (
            ["--dataset", str(clash), "--eval-ratio", "0"],
            1,
            "has a column 'responses', which the reward function would get twice",
        ),
        "ring batch": (
            ["--ring-attn-size", "2", "--batch-size", "4"],
            1,
            "every PPO epoch is one optimizer step",
        ),
    }
    t0 = time.perf_counter()
    procs = {}
    for name, (args, nproc, _) in cases.items():
        procs[name] = _bad(
            "ppo", FAST + args, nproc, tmp_path / name.replace(" ", "-"), pythonpath=tmp_path
        )
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        args, nproc, expected = cases[name]
        assert proc.returncode != 0, name
        assert err.count(expected) >= nproc, (name, err[-3000:])
        assert "[rank0]: Traceback" not in err, (name, err[-3000:])
    assert time.perf_counter() - t0 < 240


def test_ppo_help_lists_the_rl_flags():
    out = subprocess.run(
        [sys.executable, "-m", "trainers.ppo", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for flag in (
        "--reward-model",
        "--reward-fn",
        "--critic-model",
        "--advantage-estimator",
        "--n-samples-per-prompt",
        "--max-new-tokens",
        "--temperature",
        "--top-p",
        "--rollout-batch-size",
        "--ppo-epochs",
        "--kl-coef",
        "--kl-estimator",
        "--kl-in-loss",
        "--clip-low",
        "--clip-high",
        "--dual-clip",
        "--entropy-coef",
        "--rollout-distribution",
        "--zero-stage",
        "--tp-size",
    ):
        assert flag in out, flag


@pytest.mark.slow
def test_reward_model_from_trainers_rm_scores_rollouts(reward_model, tmp_path):
    """A reward model saved by trainers.rm loads by path and scores the rollouts (normalised
    by its saved reward_mean / reward_std)."""
    run_trainer("ppo", FAST + ["--reward-model", str(reward_model)], tmp_path / "p")
    m = metrics(tmp_path / "p")
    assert len(m) == 2 and all(math.isfinite(x["reward_mean"]) for x in m)
    assert m[0]["reward_std"] > 0  # real scores, not a constant


# ----------------------------------------------------------------------------- resume
@pytest.mark.slow
def test_resume_repeats_the_run(tmp_path):
    """A crash after the step-2 checkpoint: --resume continues from it (actor, critic, optimizer,
    scheduler, RNG, prompt position) and logs the same steps 3-4 as the uninterrupted run."""
    import shutil

    args = FAST[:]
    args[args.index("--max-steps") + 1] = "4"
    args += ["--advantage-estimator", "gae", "--save-steps", "2", "--kl-coef", "0.01"]
    run_trainer("ppo", args, tmp_path)
    full = metrics(tmp_path)
    assert [m["step"] for m in full] == [1, 2, 3, 4]
    shutil.rmtree(tmp_path / "checkpoints" / "step-000004")  # died before / during this save
    proc = run_trainer("ppo", args + ["--resume"], tmp_path)
    assert "resumed from" in proc.stderr and "step 2" in proc.stderr
    resumed = metrics(tmp_path)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4]
    for a, b in zip(full[2:], resumed[2:]):
        for key in ("reward_mean", "response_length", "policy_loss", "value_loss", "kl", "lr"):
            assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]) + 1e-7, (key, a, b)
    # the checkpoint holds a critic: resuming without one is refused before any training
    args[args.index("--advantage-estimator") + 1] = "reinforce"
    proc = run_trainer("ppo", args + ["--resume"], tmp_path, check=False)
    assert proc.returncode != 0 and "(the checkpoint holds a critic)" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_reference_memory_flags_are_checked():
    from trainers.ppo import PPOConfig

    with pytest.raises(ValueError, match="--tp-size 2 cannot be combined with --zero-stage 3"):
        PPOConfig(tp_size=2, zero_stage=3, ref_zero_stage=0).validate()

    cfg = PPOConfig(zero_stage=3)
    cfg.validate()
    assert cfg.ref_zero_stage == 3  # follows the actor's ZeRO-3 by default
    cfg = PPOConfig(ref_offload=True)
    cfg.validate()
    assert cfg.ref_zero_stage == 3  # offloading partitions implies them
    with pytest.raises(ValueError, match="--ref-offload .* needs --ref-zero-stage 3, got 0"):
        PPOConfig(ref_offload=True, ref_zero_stage=0).validate()
    with pytest.raises(ValueError, match="--ref-zero-stage 3 cannot be combined with --tp-size 2"):
        PPOConfig(ref_zero_stage=3, tp_size=2).validate()


@pytest.mark.parametrize("kl_clamp", [10.0, 0.0])
def test_k3_kl_far_from_the_reference_is_clamped_not_inf(kl_clamp):
    """A sampled token the actor finds e^-100 times less likely than the reference: k3's
    exp(ref - logp) overflows fp32, so the reward became -inf and the advantages NaN; the
    default --kl-clamp 10 bounds each token's KL (0 turns the clamp off)."""
    from trainers import ppo
    from trainers.distributed import Layout

    samples = []
    for r in (1.0, 0.0):
        s = ppo.Sample(torch.arange(3, 8), 2, reward=r)
        s.old_logp = torch.tensor([-0.1, -120.0, -0.2])
        s.ref_logp = torch.tensor([-0.2, -20.0, -0.3])  # (a k3 of e^100: inf in fp32)
        samples.append(s)
    cfg = ppo.PPOConfig(
        advantage_estimator="grpo", n_samples_per_prompt=2, kl_coef=0.1, kl_clamp=kl_clamp
    )
    cfg.validate()
    stats = ppo.advantages(samples, cfg, Layout(1, 0, 1, 1, 1, torch.device("cpu")))
    adv = torch.cat([s.advantages for s in samples])
    if kl_clamp:
        k3 = [math.expm1(-0.1) + 0.1, 10.0, math.expm1(-0.1) + 0.1]
        assert stats["kl"] == pytest.approx(sum(k3) / 3, rel=1e-6)
        assert torch.isfinite(adv).all()
    else:  # no clamp: the overflow is there (the run stops at the non-finite loss)
        assert not math.isfinite(stats["kl"])


@pytest.mark.parametrize(
    "kw,expected",
    [
        (dict(kl_coef=float("nan")), "--kl-coef must be a finite number, got nan"),
        (dict(lr=float("nan")), "--lr must be a finite number"),
        (dict(weight_decay=float("inf")), "--weight-decay must be a finite number"),
        (dict(kl_coef=-1.0), "--kl-coef and --entropy-coef must be >= 0"),
        (dict(entropy_coef=-0.1), "--kl-coef and --entropy-coef must be >= 0"),
        (dict(gamma=1.5), r"--gamma and --lam must be in \[0, 1\], got 1.5"),
        (dict(lam=-1.0), r"--gamma and --lam must be in \[0, 1\]"),
        (dict(critic_lr=0.0), "--critic-lr must be > 0"),
        (dict(max_grad_norm=-1.0), "--weight-decay and --max-grad-norm must be >= 0"),
        (dict(critic_model="x"), "--critic-model is used by --advantage-estimator gae only"),
        # flags that would change nothing: they used to be accepted and ignored
        (dict(lam=0.5, critic_lr=5.0), "--critic-lr 5.0, --lam 0.5: used by --advantage-est"),
        (dict(value_clip=0.5, advantage_estimator="rloo"), "got --advantage-estimator rloo"),
        (dict(kl_in_loss=True), "--kl-in-loss adds --kl-coef x KL to the loss"),
        (dict(kl_clamp=-1.0), "--kl-clamp must be >= 0 .0: no clamp., got -1.0"),
        (dict(eval_steps=2, eval_ratio=0.0), "--eval-steps 2 evaluates held-out data"),
        # --ref-offload implies --ref-zero-stage 3: the advice names the flag the user gave
        (dict(ref_offload=True, tp_size=2), "with --tp-size 2 .*drop --ref-offload"),
    ],
)
def test_rl_hyper_parameters_are_checked(kw, expected):
    # before any model is built: NaN coefficients used to train silently on NaN
    from trainers.ppo import PPOConfig

    with pytest.raises(ValueError, match=expected):
        PPOConfig(**kw).validate()


def test_critic_flags_given_at_their_default_are_refused_without_gae(tmp_path, capsys):
    # `--lam 0.95` is the default value: comparing with the default let it pass silently
    from trainers.cli import config_to_dict, parse_config
    from trainers.ppo import PPOConfig

    for argv in (["--lam", "0.95"], ["--critic-lr", "1e-3"], ["--value-clip", "0.2"]):
        with pytest.raises(SystemExit):
            parse_config(PPOConfig, ["--advantage-estimator", "grpo", *argv])
        assert "used by --advantage-estimator gae only" in capsys.readouterr().err
    cfg = parse_config(PPOConfig, ["--advantage-estimator", "gae", "--lam", "0.95"])
    assert cfg.lam == 0.95
    # a run's config.json (every field, at its value) is a valid --config for the same run
    dump = tmp_path / "config.json"
    dump.write_text(json.dumps(config_to_dict(PPOConfig(advantage_estimator="rloo"))))
    assert parse_config(PPOConfig, ["--config", str(dump)]).advantage_estimator == "rloo"
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("advantage_estimator: rloo\nlam: 0.5\n")  # away from the default
    with pytest.raises(SystemExit):
        parse_config(PPOConfig, ["--config", str(yaml_file)])
    assert "--lam 0.5: used by --advantage-estimator gae only" in capsys.readouterr().err


def test_gae_flags_and_evaluation_sources_are_accepted():
    from trainers.ppo import PPOConfig

    PPOConfig(advantage_estimator="gae", lam=0.5, critic_lr=5.0, value_clip=0.0).validate()
    PPOConfig(kl_in_loss=True, kl_coef=0.1, ring_attn_size=2, batch_size=128).validate()
    PPOConfig(rollout_distribution="broadcast").validate()  # one command line for any ring
    for source in (dict(eval_dataset="x.jsonl"), dict(eval_split="test")):
        PPOConfig(eval_steps=2, eval_ratio=0.0, **source).validate()


def test_reward_model_tokenizer_check(tmp_path):
    """The reward model scores the policy's ids: its tokenizer must number every policy token
    the same (tokens of its own are fine); without a saved tokenizer its vocab_size must cover
    the policy's (GPT-2 / Qwen2 folders without tokenizer files used to be refused)."""
    from transformers import AutoConfig, AutoTokenizer, GPT2Config

    from trainers.session import _tokenizer_mismatch
    from trainers.tiny import ensure_tiny

    policy = AutoTokenizer.from_pretrained(ensure_tiny())
    bare = tmp_path / "bare"
    GPT2Config(vocab_size=len(policy)).save_pretrained(bare)  # config.json only
    assert _tokenizer_mismatch(policy, str(bare), AutoConfig.from_pretrained(bare)) == ""
    small = GPT2Config(vocab_size=len(policy) - 1)
    assert "fewer than the policy tokenizer's" in _tokenizer_mismatch(policy, str(bare), small)
    extra = tmp_path / "extra"
    tok = AutoTokenizer.from_pretrained(ensure_tiny())
    tok.add_special_tokens({"additional_special_tokens": ["<|rm-pad|>"]})
    tok.save_pretrained(extra)
    assert _tokenizer_mismatch(policy, str(extra), None) == ""
    swapped = json.loads((extra / "tokenizer.json").read_text())
    vocab = swapped["model"]["vocab"]
    a, b = list(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (extra / "tokenizer.json").write_text(json.dumps(swapped))
    assert "2 policy tokens numbered differently" in _tokenizer_mismatch(policy, str(extra), None)


def _ring_share_worker(rank, world, use_model, fail, micro_batch_tokens):
    """ppo_ring.rollouts + ppo.ring_share on stub tokenizer / generator (rank 1 may fail)."""
    import functools
    import types

    import torch.distributed as dist

    from trainers import ppo, ppo_ring
    from trainers.distributed import Layout

    layout = Layout(world, rank, 1, world, 1, torch.device("cpu"))
    layout.ring_group = dist.new_group(list(range(world)))

    class Tok:
        pad_token_id, eos_token_id = 0, 1

        def encode(self, s):
            return [3, 4, 5]

        def decode(self, ids, skip_special_tokens=True):
            return "x"

    class Gen:
        synced = False

        def generate(self, prompts, **kw):
            if fail and rank == 1:
                raise MemoryError("generation OOM on rank 1")
            return [[7, 8]]

    cfg = types.SimpleNamespace(
        input_key="prompt", input_template=None, apply_chat_template=False,
        n_samples_per_prompt=1, max_new_tokens=2, temperature=1.0, top_p=1.0, seed=0,
        micro_batch_tokens=micro_batch_tokens, reward_fn=None, rollout_distribution="scatter",
        ring_layout="zigzag",
    )  # fmt: skip
    session = types.SimpleNamespace(tokenizer=Tok(), layout=layout)
    if use_model:
        reward = torch.nn.Linear(1, 1)
    else:
        reward = lambda prompts, responses, **kw: [0.0] * len(responses)  # noqa: E731
    make = functools.partial(ppo.ring_share, Gen(), session, reward, cfg, 1)
    try:
        shards, _, _ = ppo_ring.rollouts(
            session, make, [(i, {"prompt": "p"}) for i in range(4)], cfg
        )
        return len(shards)
    except SystemExit:
        return "exit"


@pytest.mark.multiproc
def test_ring_generation_failure_with_a_reward_model_ends_every_rank():
    """Generation failing on one ring rank: the others went on into the reward model's
    world-wide collectives while it waited in the ring's status exchange (a hang until the
    group timeout); now every rank ends with the error. A micro-batch budget under 64 tokens
    used to be refused by the stream (max_chunk_bytes < 1024) after generation."""
    from rlhf_kernels.ring.spawn import run_gloo

    assert run_gloo(_ring_share_worker, 2, True, True, 256, timeout_s=25) == ["exit", "exit"]
    assert run_gloo(_ring_share_worker, 2, False, False, 32, timeout_s=25) == [2, 2]  # owners
