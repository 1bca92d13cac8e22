"""In-process contract of the trainers' RL math and bookkeeping, against hand computations on
tiny tensors with stub engines (no process spawning): PPO's actor / critic updates and their
metrics, the step statistics of ``advantages``, config validation, the reward / target positions
of ``common``, and the SFT / reward-model loss helpers."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from trainers import common, ppo, rm, sft  # noqa: E402
from trainers.distributed import Layout  # noqa: E402

LAYOUT = Layout(1, 0, 1, 1, 1, torch.device("cpu"))


class StubEngine:
    """What the trainers use of a DeepSpeed engine: ``engine(...)``, ``backward``, ``step``.
    ``fn(theta, *args, **kw)`` is the forward; ``theta`` a scalar parameter (starts at 1)."""

    def __init__(self, fn):
        self.module = torch.nn.Module()
        self.module.theta = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        self.fn, self.optimizer, self.steps, self.losses = fn, None, 0, []

    def __call__(self, *args, **kw):
        return self.fn(self.module.theta, *args, **kw)

    def set_gradient_accumulation_boundary(self, last):
        pass

    def backward(self, loss, scale_wrt_gas=False):
        self.losses.append(loss.item())
        loss.backward()

    def zero_optimization_stage(self):
        return 0

    def step(self):
        self.steps += 1

    def eval(self):
        pass

    def train(self):
        pass

    @property
    def grad(self) -> float:
        return self.module.theta.grad.item()


# ----------------------------------------------------------------------------- PPO updates
def _rollout(n_act, seed=0, n_prompt=3):
    """Samples with old / ref log-probs, advantages, values, returns and, for the stub actor,
    a per-token log-prob shift (``logp = old + theta * shift``) and entropy."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in n_act:
        s = ppo.Sample(torch.randint(3, 50, (n_prompt + n,), generator=g), n_prompt)
        s.old_logp = -torch.rand(n, generator=g, dtype=torch.float64) * 2
        s.ref_logp = -torch.rand(n, generator=g, dtype=torch.float64) * 2
        s.advantages = torch.randn(n, generator=g, dtype=torch.float64)
        s.values = torch.randn(n, generator=g, dtype=torch.float64)
        s.returns = torch.randn(n, generator=g, dtype=torch.float64)
        s.shift = torch.randn(n, generator=g, dtype=torch.float64) * 0.5  # ratios ~ e^+-0.5
        s.ent = torch.rand(n, generator=g, dtype=torch.float64)
        out.append(s)
    return out


def _actor(theta, mb, layout):
    logp = torch.cat([s.old_logp + theta * s.shift for s in mb])
    return logp, torch.cat([s.ent for s in mb]) * theta


def _hand_actor(samples, cfg, norm):
    """The documented actor objective by hand, as a differentiable function of theta."""
    theta = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    old = torch.cat([s.old_logp for s in samples])
    ref = torch.cat([s.ref_logp for s in samples])
    adv = torch.cat([s.advantages for s in samples])
    logp = old + theta * torch.cat([s.shift for s in samples])
    ent = torch.cat([s.ent for s in samples]) * theta
    ratio = (logp - old).exp()
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    tok = torch.maximum(-adv * ratio, -adv * ratio.clamp(lo, hi))
    clipped = (-adv * ratio.clamp(lo, hi) > -adv * ratio).double()
    if cfg.dual_clip is not None:
        tok = torch.where(adv < 0, torch.minimum(tok, -adv * cfg.dual_clip), tok)
    n = len(old)
    surrogate = tok.sum() / norm
    d = ref - logp  # k3 of (logp || ref)
    kl = (d.exp() - 1 - d).sum() / n
    total = surrogate + cfg.kl_coef * kl * cfg.kl_in_loss - cfg.entropy_coef * ent.sum() / n
    total.backward()
    x = (logp - old).detach()  # approx_kl: k3 of KL(old || new), r = new / old
    return {
        "policy_loss": surrogate.item(),
        "actor_loss": total.item(),
        "entropy": ent.detach().mean().item(),
        "clip_fraction": clipped.mean().item(),
        "approx_kl": (x.exp() - 1 - x).mean().item(),
        "grad": theta.grad.item(),
    }


@pytest.mark.parametrize("mbt", [10_000, 9])  # one micro-batch; one sample per micro-batch
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(kl_coef=0.3, kl_in_loss=True, entropy_coef=0.05),
        dict(clip_low=0.1, clip_high=0.4, dual_clip=1.5),
        dict(loss_aggregation="seq-mean-token-sum-norm", max_new_tokens=7),
    ],
)
def test_train_actor_loss_metrics_and_gradient_match_a_hand_computation(kw, mbt):
    """policy_loss: the clipped surrogate (token mean over the step, or Dr. GRPO's sum over
    samples x --max-new-tokens); actor_loss adds --kl-coef x the k3 KL(actor || ref)
    (--kl-in-loss) and subtracts --entropy-coef x the entropy, both aggregated as the surrogate
    is; entropy, clip_fraction and approx_kl are token means over the step; the gradient is that
    of actor_loss."""
    samples = _rollout([4, 2, 5])
    cfg = ppo.PPOConfig(micro_batch_tokens=mbt, **kw)
    n = sum(s.n_act for s in samples)
    norm = len(samples) * cfg.max_new_tokens if "loss_aggregation" in kw else n
    want = _hand_actor(samples, cfg, norm)
    engine = StubEngine(_actor)
    got = ppo.train_actor(engine, samples, cfg, LAYOUT, pad_id=0)
    assert engine.steps == 1 and len(engine.losses) == (1 if mbt > 100 else 3)
    for k in ("policy_loss", "actor_loss", "entropy", "clip_fraction", "approx_kl"):
        assert got[k] == pytest.approx(want[k], rel=1e-6, abs=1e-9), k
    assert engine.grad == pytest.approx(want["grad"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(abs(want["grad"]), rel=1e-6)


def test_train_critic_is_the_clipped_value_loss_token_mean():
    """0.5 max((v - R)^2, (v_clip - R)^2), v_clip = old + clamp(v - old, +-value_clip), token
    mean over the step (over all micro-batches)."""
    samples = _rollout([3, 4, 2], seed=1)
    for s in samples:
        s.delta = torch.tensor([0.5, -0.05, 0.3, -0.6][: s.n_act], dtype=torch.float64)

    def critic(theta, mb, layout):
        return torch.cat([s.values + theta * s.delta for s in mb])

    for clip, mbt in ((0.2, 10_000), (0.2, 8), (0.0, 8)):
        cfg = ppo.PPOConfig(advantage_estimator="gae", value_clip=clip, micro_batch_tokens=mbt)
        errs = []
        for s in samples:
            for v0, d, r in zip(s.values.tolist(), s.delta.tolist(), s.returns.tolist()):
                e = (v0 + d - r) ** 2
                if clip:
                    e = max(e, (v0 + max(-clip, min(clip, d)) - r) ** 2)
                errs.append(0.5 * e)
        got = ppo.train_critic(StubEngine(critic), samples, cfg, LAYOUT, pad_id=0)
        assert got == pytest.approx(sum(errs) / len(errs), rel=1e-9), (clip, mbt)


# ----------------------------------------------------------------------------- experience
def _experience(estimator="grpo", **kw):
    g = torch.Generator().manual_seed(3)
    rewards = [1.0, 0.0, 0.5, 0.25]
    samples = []
    for n, r in zip([3, 1, 2, 4], rewards):
        s = ppo.Sample(torch.randint(3, 50, (2 + n,), generator=g), 2, reward=r)
        s.old_logp = -torch.rand(n, generator=g) * 2
        s.ref_logp = -torch.rand(n, generator=g) * 2
        s.values = torch.randn(n, generator=g)
        samples.append(s)
    cfg = ppo.PPOConfig(advantage_estimator=estimator, n_samples_per_prompt=2, **kw)
    return samples, ppo.advantages(samples, cfg, LAYOUT)


@pytest.mark.parametrize("adv_est,estimator", [("grpo", "k1"), ("reinforce", "k2"), ("gae", "k3")])
def test_step_statistics_are_token_means_of_the_chosen_kl_and_of_the_advantages(adv_est, estimator):
    samples, stats = _experience(adv_est, kl_coef=0.1, kl_estimator=estimator)
    d = torch.cat([s.old_logp - s.ref_logp for s in samples]).double()
    kl = {"k1": d, "k2": 0.5 * d**2, "k3": (-d).exp() - 1 + d}[estimator]
    adv = torch.cat([s.advantages for s in samples]).double()
    assert stats["kl"] == pytest.approx(kl.mean().item(), rel=1e-5)
    assert stats["advantage_mean"] == pytest.approx(adv.mean().item(), rel=1e-5, abs=1e-7)
    assert stats["advantage_std"] == pytest.approx(adv.std(unbiased=False).item(), rel=1e-5)


def test_kl_in_loss_leaves_the_rewards_without_the_kl():
    """--kl-in-loss: the KL goes to the loss *instead of* the rewards (grpo: the group-normalised
    reward on the last token, 0 elsewhere, gamma 1)."""
    samples, _ = _experience(kl_coef=0.5, kl_in_loss=True)
    plain, _ = _experience(kl_coef=0.0)
    for s, p in zip(samples, plain):
        torch.testing.assert_close(s.returns, p.returns)
        torch.testing.assert_close(s.advantages, p.advantages)
    # and without it, the KL is subtracted from the rewards at every token
    penalised, _ = _experience(kl_coef=0.5, kl_estimator="k1")
    for s, p in zip(penalised, plain):
        kl = s.old_logp - s.ref_logp
        want = p.returns - 0.5 * kl.flip(0).cumsum(0).flip(0)
        torch.testing.assert_close(s.returns, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "kw,text",
    [
        (dict(clip_low=1.0), "need 0 <= --clip-low < 1"),
        (dict(clip_high=-0.1), "need 0 <= --clip-low < 1"),
        (dict(dual_clip=1.0), "--dual-clip must be > 1"),
        (dict(value_clip=-0.1, advantage_estimator="gae"), "--value-clip must be >= 0"),
        (dict(n_samples_per_prompt=1, rollout_batch_size=32), "needs --n-samples-per-prompt >= 2"),
        (dict(max_new_tokens=0), "--max-new-tokens must be >= 1"),
        (dict(ppo_epochs=0), "--ppo-epochs must be >= 1"),
        (dict(temperature=0.0), "--temperature must be > 0"),
        (dict(top_p=0.0), r"--top-p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"--top-p must be in \(0, 1\]"),
        (dict(batch_size=24), r"--batch-size \(24\) must divide the rollout samples per step"),
        (dict(reward_fn="a:b", reward_model="m"), "give --reward-fn or --reward-model, not both"),
        (dict(no_packing=True), "--no-packing is an SFT / reward-model comparison"),
        (dict(ring_attn_size=2), "--batch-size must be 16 x 8, got 32"),
    ],
)
def test_ppo_config_refuses(kw, text):
    with pytest.raises(ValueError, match=text):
        ppo.PPOConfig(**kw).validate()


def test_ppo_config_accepts_the_edges():
    ppo.PPOConfig(clip_low=0.0, clip_high=0.0, dual_clip=1.01, top_p=1.0, gamma=0.0).validate()
    ppo.PPOConfig(advantage_estimator="gae", value_clip=0.0, lam=0.0).validate()
    ppo.PPOConfig(advantage_estimator="reinforce", n_samples_per_prompt=1, batch_size=16).validate()


# ----------------------------------------------------------------------------- positions
def test_sample_targets_and_shifted_targets_are_next_token_targets():
    s = ppo.Sample(torch.tensor([7, 8, 9, 10, 11]), 2)
    assert s.n_act == 3
    assert s.targets().tolist() == [-100, 9, 10, 11, -100]
    ids, mask = torch.tensor([1, 2, 3, 4, 5]), torch.tensor([0, 0, 1, 1, 0])
    assert common.shifted_targets(ids, mask).tolist() == [-100, 3, 4, -100, -100]


def test_padded_inputs_mask_the_right_padding():
    mb = common.padded_inputs([torch.tensor([4, 5, 6]), torch.tensor([7])], 0, LAYOUT)
    assert mb.inputs["input_ids"].tolist() == [[4, 5, 6], [7, 0, 0]]
    assert mb.inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert mb.inputs["position_ids"].tolist() == [[0, 1, 2], [0, 1, 2]] and mb.slots == 6


def test_reward_positions_are_the_last_non_pad_tokens():
    seqs = [torch.tensor([5, 6, 0, 0]), torch.tensor([0, 4, 0]), torch.tensor([0, 0])]
    assert common.reward_positions(seqs, 0) == [1, 1, 1]  # all pad: the last token
    assert common.reward_positions(seqs, None) == [3, 2, 1]
    assert common.reward_positions([torch.tensor([3, 4, 5])], 0) == [2]


def test_steps_batches_and_length_checks():
    from types import SimpleNamespace

    cfg = SimpleNamespace(batch_size=4, max_steps=None, epochs=3)
    assert common.total_steps(10, cfg) == 6  # 2 full batches per epoch, tail dropped
    cfg.max_steps = 5
    assert common.total_steps(10, cfg) == 5
    first = torch.randperm(10, generator=torch.Generator().manual_seed(7 * 1000003)).tolist()
    second = torch.randperm(10, generator=torch.Generator().manual_seed(7 * 1000003 + 1)).tolist()
    assert common.batch_indices(1, 10, 4, 7) == first[:4]
    assert common.batch_indices(2, 10, 4, 7) == first[4:8]
    assert common.batch_indices(3, 10, 4, 7) == second[:4]
    assert common.check_lengths([3, 5, 4], 5, "x") == ""
    msg = common.check_lengths([3, 6, 9, 4], 5, "training")
    assert msg.startswith("2 training sample(s)") and "#2, has 9 tokens" in msg


# ----------------------------------------------------------------------------- SFT / RM
def _reward_engine():
    """Reward = theta x (the token id read at last_index) / 10: a reward at the wrong token or
    from the wrong row shows."""

    def fwd(theta, input_ids, position_ids, last_index, attention_mask=None, **kw):
        return theta * input_ids.reshape(-1)[last_index].double() / 10

    return StubEngine(fwd)


@pytest.mark.parametrize("no_packing", [False, True])
def test_rm_loss_accuracy_and_gradient(no_packing):
    """loss -logsigmoid(r_c - r_r - margin), mean over pairs (also the gradient); a tie counts
    as wrong; the reward is read at the last non-pad token of each sequence."""
    pad = 0
    pairs = [
        rm.Pair(torch.tensor([3, 9, 12]), torch.tensor([3, 9, 5, 8, pad]), margin=0.5),
        rm.Pair(torch.tensor([3, 4, pad, pad]), torch.tensor([3, 7]), margin=0.0),
        rm.Pair(torch.tensor([3, 6]), torch.tensor([3, 2, 6]), margin=1.0),  # a tie
    ]
    cfg = rm.RMConfig(no_packing=no_packing, micro_batch_tokens=10_000)
    rc, rr = [1.2, 0.4, 0.6], [0.8, 0.7, 0.6]
    theta = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
    want = sum(
        -torch.nn.functional.logsigmoid(theta * (c - r) - m)
        for c, r, m in zip(rc, rr, [0.5, 0.0, 1.0])
    )
    (want / 3).backward()
    engine = _reward_engine()
    got = rm.run_batch(engine, pairs, cfg, LAYOUT, pad, train=True)
    assert got["loss"] == pytest.approx(want.item(), rel=1e-9)
    assert got["correct"] == 1 and got["pairs"] == 3
    assert engine.grad == pytest.approx(theta.grad.item(), rel=1e-9)
    ev = rm.evaluate(_reward_engine(), pairs, cfg, LAYOUT, pad)
    r = torch.tensor(rc + rr, dtype=torch.float64)
    assert ev["eval_loss"] == pytest.approx(want.item() / 3, rel=1e-9)
    assert ev["eval_accuracy"] == pytest.approx(1 / 3)
    assert ev["eval_reward_mean"] == pytest.approx(r.mean().item())
    assert ev["eval_reward_std"] == pytest.approx(r.std(unbiased=False).item())


@pytest.mark.parametrize("no_packing", [False, True])
def test_sft_labels_loss_normalisation_and_eval_loss(no_packing):
    """labels[t] is the next token ids[t + 1] on target tokens; the gradient is that of the
    nll sum / target tokens of the batch; eval_loss is nll per target token."""
    seen = []

    def fwd(theta, input_ids, position_ids, labels, attention_mask=None, **kw):
        seen.append((input_ids.clone(), labels.clone()))
        sel = labels != -100
        return theta * labels[sel].double().sum()  # an 'nll' that depends on the labels

    pad = 0
    samples = []
    for ids, n_prompt in (([5, 6, 7, 8, 2], 2), ([9, 3, 4, 2], 1), ([11, 12, 2], 2)):
        ids = torch.tensor(ids)
        mask = torch.tensor([0] * n_prompt + [1] * (len(ids) - n_prompt))
        samples.append(sft.Sample(ids, common.shifted_targets(ids, mask)))
    cfg = sft.SFTConfig(no_packing=no_packing, micro_batch_tokens=10_000)
    engine = StubEngine(fwd)
    got = sft.run_batch(engine, samples, cfg, LAYOUT, pad, train=True)
    tot = sum(sum(s.ids[n:].tolist()) for s, n in zip(samples, (2, 1, 2)))
    n_targets = 3 + 3 + 1
    assert got["targets"] == n_targets and got["nll"] == pytest.approx(tot)
    assert engine.grad == pytest.approx(tot / n_targets)
    for ids, labels in seen:
        sel = labels[:, :-1] != -100
        assert torch.equal(labels[:, :-1][sel], ids[:, 1:][sel])
        assert int((labels != -100).sum()) == n_targets
    ev = sft.evaluate(StubEngine(fwd), samples, cfg, LAYOUT, pad)
    assert ev["eval_loss"] == pytest.approx(tot / n_targets)


# ----------------------------------------------------------------------------- the models
@pytest.fixture(scope="module")
def tiny_path():
    from trainers.tiny import ensure_tiny

    return ensure_tiny()


def test_causal_lm_loss_is_the_nll_sum_over_labels(tiny_path):
    from transformers import AutoModelForCausalLM

    from rlhf_kernels.integrations.hf import register
    from trainers.modeling import CausalLMLoss

    lm = AutoModelForCausalLM.from_pretrained(tiny_path, attn_implementation=register()).float()
    ids = torch.tensor([[4, 9, 13, 7, 21, 5]])
    labels = torch.tensor([[-100, 13, 7, 21, -100, -100]])
    with torch.no_grad():
        got = CausalLMLoss(lm)(ids, torch.arange(6)[None], labels).item()
        lp = lm(ids).logits[0].float().log_softmax(-1)
    want = -sum(lp[t, labels[0, t]].item() for t in (1, 2, 3))
    assert got == pytest.approx(want, rel=1e-4)


def test_model_rewards_read_the_last_non_pad_token_and_normalise(tiny_path):
    """Reward-model scores: the score head at the last non-pad token, (r - reward_mean) /
    reward_std with the model's saved statistics."""
    from transformers import AutoModelForSequenceClassification

    from rlhf_kernels.integrations.hf import register

    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_path, num_labels=1, attn_implementation=register()
    ).float()
    pad = model.config.pad_token_id
    assert pad is not None
    seqs = [torch.tensor([4, 9, 13, 7]), torch.tensor([4, 21, 5, pad, pad]), torch.tensor([8, 3])]
    with torch.no_grad():
        raw = [
            model(s[: common.reward_positions([s], pad)[0] + 1][None]).logits[0, 0] for s in seqs
        ]
    raw = torch.tensor(raw)
    cfg = ppo.PPOConfig(micro_batch_tokens=10_000)
    got = torch.tensor(ppo.model_rewards(model, seqs, cfg, LAYOUT, pad))
    torch.testing.assert_close(got, raw, atol=1e-4, rtol=1e-4)
    model.config.reward_mean, model.config.reward_std = 0.3, 2.5
    got = torch.tensor(ppo.model_rewards(model, seqs, cfg, LAYOUT, pad))
    torch.testing.assert_close(got, (raw - 0.3) / 2.5, atol=1e-4, rtol=1e-4)
