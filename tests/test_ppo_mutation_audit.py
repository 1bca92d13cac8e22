"""Mutation-testing audit of ``trainers.ppo``, ``trainers.ppo_ring`` and ``trainers.rewards``:
pins what small code changes left the other fast tests passing. The README's default recipe
(GRPO, 8 x 16 samples, lr 1e-3 after 20 warm-up steps, temperature 0.7, 60 steps, k3 KL
clamped to 10, scatter rollouts); the float32 CPU experience ``make_experience`` stores;
every sampling setting ``generate`` hands the engine and its dummy calls' settings; the
reward function's name in ``score``'s errors; and the remaining arithmetic of the step
(covered below per function). Stub engines and tiny tensors only (no model, no process group).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from trainers import ppo, ppo_ring, rewards  # noqa: E402
from trainers.distributed import Layout  # noqa: E402

CPU = torch.device("cpu")
ONE = Layout(1, 0, 1, 1, 1, CPU)


# ----------------------------------------------------------------------------- defaults
def test_defaults_are_the_readme_recipe():
    """README, "Trainer: PPO / GRPO / REINFORCE++": GRPO with 8 samples for each of 16 prompts,
    32 samples per optimizer step, lr 1e-3 after 20 warm-up steps, temperature 0.7, 60 steps;
    each token's KL clamped to [-10, 10] by default; ``--rollout-distribution scatter``
    (default). The clip is symmetric unless asked (clip-higher: ``--clip-high`` larger)."""
    cfg = ppo.PPOConfig()
    assert cfg.advantage_estimator == "grpo"
    assert (cfg.n_samples_per_prompt, cfg.rollout_batch_size, cfg.batch_size) == (8, 16, 32)
    assert (cfg.lr, cfg.warmup_steps, cfg.temperature, cfg.max_steps) == (1e-3, 20, 0.7, 60)
    assert (cfg.kl_estimator, cfg.kl_clamp) == ("k3", 10.0)
    assert cfg.rollout_distribution == "scatter"
    assert cfg.clip_low == cfg.clip_high == 0.2
    assert (cfg.lam, cfg.value_clip, cfg.gamma) == (0.95, 0.2, 1.0)


# ----------------------------------------------------------------------------- experience
class _DtypeModel(torch.nn.Module):
    """Per-action outputs in ``dtype`` (a bf16 / float64 model), with gradients."""

    def __init__(self, dtype, pair=True):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor(0.5, dtype=dtype))
        self.pair = pair

    def forward(self, mb, layout):
        n = sum(s.n_act for s in mb)
        out = -self.w * torch.arange(1, n + 1, dtype=self.w.dtype) / 8
        return (out, out.detach()) if self.pair else out


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_experience_is_stored_as_cpu_float32_whatever_the_models_dtype(dtype):
    """``split``: the stored old / ref log-probs and values are detached float32 CPU tensors
    (a bf16 or float64 model's outputs are cast), so the advantages are float32 too."""
    cfg = ppo.PPOConfig(advantage_estimator="gae", n_samples_per_prompt=2)
    samples = [ppo.Sample(torch.arange(2 + n), 2, reward=r) for n, r in ((3, 1.0), (2, 0.0))]
    ppo.make_experience(
        samples, _DtypeModel(dtype), _DtypeModel(dtype), _DtypeModel(dtype, False), cfg, ONE, 0
    )
    for s in samples:
        for name in ("old_logp", "ref_logp", "values", "advantages", "returns"):
            t = getattr(s, name)
            assert t.dtype == torch.float32 and t.device == CPU and not t.requires_grad, name


# ----------------------------------------------------------------------------- generation
class _Tok:
    eos_token_id, pad_token_id = 1, 0

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 1))


class _RecGen:
    """Records every call's keyword arguments; ``synced``: a ZeRO-3 engine."""

    synced = True

    def __init__(self):
        self.calls = []

    def generate(self, prompts, **kw):
        self.calls.append((prompts, kw))
        return [[ord("x"), 1] for _ in prompts for _ in range(kw["n_samples"])]


def test_generate_hands_the_engine_every_sampling_setting(monkeypatch):
    """Each prompt's call carries --n-samples-per-prompt, --max-new-tokens, --temperature,
    --top-p and its seed; a synced rank's dummy calls (fewer prompts than the busiest rank) are
    one-token greedy calls on an EOS prompt (no sampling, no seed to draw)."""
    monkeypatch.setattr(ppo, "max_across", lambda n, layout: 3)
    cfg = ppo.PPOConfig(
        n_samples_per_prompt=2, max_new_tokens=5, temperature=0.9, top_p=0.8, seed=4
    )
    gen = _RecGen()
    ppo.generate(gen, _Tok(), [{"prompt": "ab"}], cfg, ONE, 2, [7])
    (p, kw), *dummies = gen.calls
    assert kw == dict(
        n_samples=2,
        max_new_tokens=5,
        temperature=0.9,
        top_p=0.8,
        greedy=False,
        seed=ppo.rollout_seed(4, 2, 7),
    )
    assert [(d, k) for d, k in dummies] == [
        ([[1]], dict(n_samples=2, max_new_tokens=1, greedy=True))
    ] * 2


def test_score_names_the_default_reward_function_in_its_errors():
    """Without --reward-fn (the default prompts' reward), a failing reward function is reported
    as trainers.rewards:reverse_reward, not as None."""

    def boom(prompts, responses, **cols):
        raise RuntimeError("no")

    samples = [ppo.Sample(torch.arange(4), 2)]
    texts = [({"prompt": "a", "target": "x"}, "ab")]
    with pytest.raises(ValueError, match="reward function trainers.rewards:reverse_reward raised"):
        ppo.score(boom, None, samples, texts, ppo.PPOConfig(), ONE)


def test_score_of_no_samples_does_not_call_the_reward_function():
    """A rank without samples (fewer held-out prompts than data-parallel ranks) has no column
    to pass: the reward function is not called (``reverse_reward`` would miss ``target``)."""
    calls = []

    def fn(prompts, responses, target):
        calls.append(prompts)
        return []

    ppo.score(fn, None, [], [], ppo.PPOConfig(), ONE)
    ppo.score(rewards.reverse_reward, None, [], [], ppo.PPOConfig(), ONE)
    assert calls == []


class _StubRM:
    """``RewardModel(model)``: reads the token id at ``last_index`` as the score; counts the
    forwards on ``model.calls``."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, last_index, **_):
        self.model.calls += 1
        return input_ids[0, last_index].double()


def _rm(mean, std):
    from types import SimpleNamespace

    cfg = SimpleNamespace(pad_token_id=0, reward_mean=mean, reward_std=std)
    return SimpleNamespace(config=cfg, calls=0)


def test_model_rewards_of_a_constant_reward_model_are_centred_not_divided_by_zero(monkeypatch):
    """A reward model saved with ``reward_std`` 0 (every training reward equal) is centred on
    its mean and not scaled (``std or 1``): no ZeroDivisionError."""
    monkeypatch.setattr("trainers.modeling.RewardModel", _StubRM)
    seqs = [torch.tensor([5, 9, 7]), torch.tensor([4, 12, 0])]  # reads 7, and 12 before the pad
    cfg = ppo.PPOConfig(micro_batch_tokens=100)
    assert ppo.model_rewards(_rm(2.0, 0.0), seqs, cfg, ONE, 0) == [5.0, 10.0]
    assert ppo.model_rewards(_rm(2.0, 4.0), seqs, cfg, ONE, 0) == [1.25, 2.5]


def test_model_rewards_run_the_busiest_ranks_micro_batch_count(monkeypatch):
    """ZeRO-3 reward models gather weights in each forward: a rank with fewer micro-batches
    runs dummy forwards up to the busiest rank's count, and they change no score."""
    monkeypatch.setattr("trainers.modeling.RewardModel", _StubRM)
    seqs = [torch.tensor([5, 9, 7]), torch.tensor([4, 12, 0])]
    cfg = ppo.PPOConfig(micro_batch_tokens=3)  # one sequence per micro-batch
    model = _rm(0.0, 1.0)
    assert ppo.model_rewards(model, seqs, cfg, ONE, 0) == [7.0, 12.0] and model.calls == 2
    monkeypatch.setattr(ppo, "max_across", lambda n, layout: n + 3)
    model = _rm(0.0, 1.0)
    assert ppo.model_rewards(model, seqs, cfg, ONE, 0) == [7.0, 12.0] and model.calls == 5


# ----------------------------------------------------------------------------- actor update
class _Engine:
    """A DeepSpeed-engine stand-in for ``train_actor``: ``fn(theta, mb)`` is the forward."""

    def __init__(self, fn):
        self.module = torch.nn.Module()
        self.module.theta = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        self.fn, self.optimizer = fn, None

    def __call__(self, mb, layout):
        return self.fn(self.module.theta, mb)

    def set_gradient_accumulation_boundary(self, last):
        pass

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()

    def zero_optimization_stage(self):
        return 0

    def step(self):
        pass

    def eval(self):
        pass

    def train(self):
        pass


def _sample(n_act, old, ref, adv):
    s = ppo.Sample(torch.arange(2 + n_act), 2)
    s.old_logp = torch.full((n_act,), old, dtype=torch.float64)
    s.ref_logp = torch.full((n_act,), ref, dtype=torch.float64)
    s.advantages = torch.full((n_act,), adv, dtype=torch.float64)
    return s


def test_kl_in_the_loss_is_clamped_as_in_the_rewards():
    """--kl-in-loss: each token's k3 estimate is clamped to [-kl_clamp, kl_clamp] in the loss as
    in the rewards (the reference 30 nats above the actor: e^30 would swamp the loss)."""
    samples = [_sample(2, -31.0, -1.0, 0.0)]

    def actor(theta, mb):
        logp = torch.cat([s.old_logp for s in mb]) * theta
        return logp, torch.zeros_like(logp)

    for clamp in (10.0, 3.0):
        cfg = ppo.PPOConfig(kl_coef=0.5, kl_in_loss=True, kl_clamp=clamp)
        out = ppo.train_actor(_Engine(actor), samples, cfg, ONE, pad_id=0)
        assert out["actor_loss"] == pytest.approx(0.5 * clamp), clamp


def test_a_step_of_empty_responses_has_entropy_zero_not_nan():
    """No action token in the step: the entropy (and the entropy term of the loss) is 0, not
    the NaN of an empty mean."""
    samples = [_sample(0, 0.0, 0.0, 0.0), _sample(0, 0.0, 0.0, 0.0)]

    def actor(theta, mb):
        z = torch.zeros(0, dtype=torch.float64) * theta
        return z, z

    cfg = ppo.PPOConfig(entropy_coef=0.1)
    out = ppo.train_actor(_Engine(actor), samples, cfg, ONE, pad_id=0)
    assert out["entropy"] == 0.0 and out["actor_loss"] == 0.0


# ----------------------------------------------------------------------------- ring rollouts
def _ring_meta(lens, text):
    out = []
    for i, (n_prompt, n) in enumerate(lens):
        s = ppo.Sample(torch.arange(3, 3 + n_prompt + n), n_prompt, reward=float(i))
        out.append(
            {
                "input_ids": s.ids,
                "targets": s.targets(),
                "reward": s.reward,
                "n_prompt": n_prompt,
                "text": (text, i),
            }
        )
    return out


@pytest.mark.parametrize("mode", ["scatter", "broadcast"])
def test_ring_rollouts_stream_settings_first_text_and_received_bytes(monkeypatch, mode):
    """``ppo_ring.rollouts`` streams with chunks of 16 bytes per --micro-batch-tokens token (two
    int64 tensors; at least the wire's smallest chunk), scatters only the token tensors in
    scatter mode, keeps the FIRST sample's text for the progress line and counts the token
    bytes (ids and targets, int64) this rank received."""
    from types import SimpleNamespace

    import rlhf_kernels.comm.distributed as cd
    from rlhf_kernels.comm._wire import MIN_CHUNK_BYTES
    from rlhf_kernels.ring.plan import RingPlan

    items = [_ring_meta([(2, 3), (1, 2)], "a"), _ring_meta([(3, 1)], "b")]
    seen = {}

    def fake(prompts, make, **kw):
        seen.update(kw)
        for meta in items:
            if mode == "broadcast":
                yield meta
                continue
            packed = ppo.common.pack_sequences([m["input_ids"] for m in meta])
            plan = RingPlan.build(packed.cu_seqlens, 1, "zigzag")
            targets = torch.cat([m["targets"] for m in meta])
            yield plan, {"input_ids": packed.input_ids.long(), "targets": targets.long()}, meta

    monkeypatch.setattr(cd, "distributed_rollouts", fake)
    for mbt in (4, 1000):
        cfg = ppo.PPOConfig(micro_batch_tokens=mbt, rollout_distribution=mode)
        shards, text, received = ppo_ring.rollouts(SimpleNamespace(layout=ONE), None, [], cfg)
        assert seen["max_chunk_bytes"] == max(16 * mbt, MIN_CHUNK_BYTES)
        assert seen["token_keys"] == (ppo_ring.TOKEN_KEYS if mode == "scatter" else None)
        assert seen["count_objects"] is False
        assert text == ("a", 0)
        assert received == 2 * 8 * (5 + 3 + 4)  # int64 ids and targets of 12 tokens
        assert [len(sh.samples) for sh in shards] == [len(m) for m in items]


# ----------------------------------------------------------------------------- the run
def test_the_actor_engine_is_put_in_eval_mode_before_the_first_rollout(monkeypatch):
    """``train``: the actor engine runs in eval mode (dropout off), set once before any rollout
    or update, so the ratio to the rollout's log-probs starts at 1."""
    import test_ppo_train_metrics_audit as m

    events = []
    monkeypatch.setattr(m.FakeEngine, "eval", lambda self: events.append("eval"))
    real = m._fake_generate

    def generate(session):
        fn = real(session)

        def wrapped(*a, **kw):
            events.append("generate")
            return fn(*a, **kw)

        return wrapped

    monkeypatch.setattr(m, "_fake_generate", generate)
    m._run(monkeypatch, total=1, eval_at=())
    assert events[0] == "eval" and events.count("eval") == 1 and "generate" in events
