"""Trainer numerics against float64 references: ``ppo.advantages`` keeps the rewards' float64
precision through group centring, returns and whitening (they were cast to fp32 first)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from trainers import ppo  # noqa: E402
from trainers.distributed import Layout  # noqa: E402

LAYOUT = Layout(1, 0, 1, 1, 1, torch.device("cpu"))


def _samples(rewards, n_act=4, values=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for r in rewards:
        s = ppo.Sample(torch.randint(3, 50, (2 + n_act,), generator=g), 2, reward=r)
        s.old_logp = -torch.rand(n_act, generator=g) * 3
        s.ref_logp = s.old_logp + 0.01 * torch.randn(n_act, generator=g)
        s.values = values + 0.01 * torch.randn(n_act, generator=g)
        out.append(s)
    return out


def _reference(rewards, estimator, g):
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, g)
    c = r - r.mean(1, keepdim=True)
    if estimator == "grpo":
        return (c / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    if estimator == "dr_grpo":
        return c.view(-1)
    if estimator == "rloo":
        return (r - (r.sum(1, keepdim=True) - r) / (g - 1)).view(-1)
    return (c / (c.std() + 1e-6)).view(-1)  # reinforce_baseline


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
def test_group_advantages_of_large_offset_rewards_match_float64(estimator):
    """Rewards 1e4 + {0, 1, 2, 3} * 1e-3: fp32 spaces them ~9.8e-4 apart, so the GRPO
    advantages were off by 1e-2 and RLOO's 0.0007 became 0 or 0.001 (got [-0.00098, 0, 0.00098,
    0.0029] for [-0.002, -0.00067, 0.00067, 0.002])."""
    rewards = [base + k * 1e-3 for base in (1e4, -3e3) for k in range(4)]
    cfg = ppo.PPOConfig(advantage_estimator=estimator, n_samples_per_prompt=4, kl_coef=0.0)
    samples = _samples(rewards)
    ppo.advantages(samples, cfg, LAYOUT)
    want = _reference(rewards, estimator, 4)
    got = torch.tensor([s.advantages[-1].item() for s in samples], dtype=torch.float64)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 1e-5 * scale, (got.tolist(), want.tolist())
    for s in samples:  # gamma = 1, kl_coef = 0: every token carries the sample's advantage
        assert s.advantages.dtype == torch.float32 and s.returns.dtype == torch.float32
        assert torch.equal(s.advantages, s.advantages[-1].expand(4))


def test_reinforce_whitened_returns_of_large_offset_rewards_match_float64():
    """REINFORCE++ whitens the per-token returns: rewards 1e4 + k * 1e-3 gave whitened values
    [-1.75, -0.88, 0, 0.88] (fp32 grid) for [-1.32, -0.44, 0.44, 1.32]."""
    rewards = [1e4 + k * 1e-3 for k in range(4)] * 2
    cfg = ppo.PPOConfig(advantage_estimator="reinforce", kl_coef=0.0)
    samples = _samples(rewards)
    ppo.advantages(samples, cfg, LAYOUT)
    x = torch.tensor(rewards, dtype=torch.float64).repeat_interleave(4)  # gamma 1: every token
    want = ((x - x.mean()) / (x.var() + 1e-8).sqrt()).view(-1, 4)
    got = torch.stack([s.advantages for s in samples]).double()
    assert (got - want).abs().max().item() < 1e-5


def test_gae_over_long_responses_matches_float64():
    """GAE (gamma = lam = 1) over 16 responses of 4096 tokens with KL in the reward: the
    returns and whitened advantages agree with a float64 reference to fp32 rounding (the fp32
    scan and whitening were off by ~1e-4; values of 1e3 + rewards of 1e3 lose more)."""
    g = torch.Generator().manual_seed(0)
    rewards = [1e3 + float(torch.rand(1, generator=g)) * 1e-2 for _ in range(16)]
    samples = _samples(rewards, n_act=4096, values=1e3, seed=1)
    cfg = ppo.PPOConfig(
        advantage_estimator="gae", gamma=1.0, lam=1.0, kl_coef=0.05, kl_estimator="k1"
    )
    ppo.advantages(samples, cfg, LAYOUT)
    adv, ret = [], []
    for s in samples:
        r = -0.05 * (s.old_logp.double() - s.ref_logp.double())
        r[-1] += s.reward
        rt = r.flip(0).cumsum(0).flip(0)
        adv.append(rt - s.values.double())
        ret.append(rt)
    adv, ret = torch.cat(adv), torch.cat(ret)
    want = (adv - adv.mean()) / (adv.var() + 1e-8).sqrt()
    got = torch.cat([s.advantages for s in samples]).double()
    assert (got - want).abs().max().item() < 1e-5
    got_ret = torch.cat([s.returns for s in samples]).double()
    assert ((got_ret - ret).abs() / ret.abs()).max().item() < 1e-6


def test_constant_large_reward_groups_stay_exactly_zero():
    rewards = [1e4 + 1e-3] * 4 + [7.1] * 4
    for estimator in ("grpo", "dr_grpo", "reinforce_baseline"):
        cfg = ppo.PPOConfig(advantage_estimator=estimator, n_samples_per_prompt=4, kl_coef=0.0)
        samples = _samples(rewards)
        ppo.advantages(samples, cfg, LAYOUT)
        assert all(s.advantages.abs().max().item() == 0.0 for s in samples), estimator
