"""Numeric edge audit: advantages of constant-reward groups (zero variance) must be exactly 0."""

import pytest
import torch

from rlhf_kernels import group_advantages, whiten


@pytest.mark.parametrize("x", [0.1, 0.7, 7.1, 70.3])
@pytest.mark.parametrize("eps", [1e-6, 0.0])
def test_grpo_constant_group_is_zero(x, eps):
    """fp32 mean of 7 equal rewards rounds; the std (same size) scaled it to 0.31 at 7.1 (eps 0:
    NaN for G = 3, 5)."""
    for G in (3, 5, 7):
        r = torch.cat([torch.full((G,), x), torch.arange(G, dtype=torch.float32)])
        for est in ("grpo", "reinforce_baseline", "dr_grpo"):
            a = group_advantages(r, G, est, eps=eps)
            assert torch.equal(a[:G], torch.zeros(G)), (est, G, a[:G])
            assert torch.isfinite(a).all()


def test_grpo_all_constant_eps0_reinforce_baseline():
    a = group_advantages(torch.ones(8), 4, "reinforce_baseline", eps=0.0)
    assert torch.equal(a, torch.zeros(8))


def test_grpo_values_and_grad_unchanged_float64():
    r = torch.randn(12, dtype=torch.float64, requires_grad=True)
    for est in ("grpo", "reinforce_baseline"):
        assert torch.autograd.gradcheck(lambda t, e=est: group_advantages(t, 4, e), (r,))
    g = r.detach().view(3, 4)
    want = (g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)
    torch.testing.assert_close(group_advantages(r, 4, "grpo"), want.view(-1))


@pytest.mark.parametrize("x", [0.1, 7.1, 70.3])
def test_whiten_constant_is_zero(x):
    """A constant 70.3 (fp32, 7 entries) whitened to 0.076 (rounded mean / rsqrt of tiny var)."""
    out = whiten(torch.full((7,), x))
    assert torch.equal(out, torch.zeros(7)), out
    assert torch.equal(whiten(torch.full((4,), x), eps=0.0), torch.zeros(4))


def test_whiten_grad_unchanged_float64():
    x = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 0]], dtype=torch.bool)
    assert torch.autograd.gradcheck(lambda t: whiten(t, m), (x,))
    xd = x.detach()
    mean = xd[m].mean()
    want = (xd - mean) / torch.sqrt(xd[m].var() + 1e-8)
    torch.testing.assert_close(whiten(x, m), want)
