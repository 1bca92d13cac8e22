"""``linear_nll_loss`` / ``linear_policy_loss`` with ``group=`` on 2 gloo ranks: the ranks'
shares add up to the one-device loss and gradients, and a bad input on one rank raises on every
rank (it used to raise on that rank only, leaving the other waiting in the token count's
all-reduce until the collective timeout)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlhf_kernels.ops.linear_logprobs import linear_nll_loss, linear_policy_loss
from rlhf_kernels.ring.spawn import run_gloo

T, H, V = 10, 8, 17


def _data():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[3] = -100  # ignored: counts on no rank
    old = -torch.rand(T, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(T, generator=g, dtype=torch.float64)
    return hidden, weight, labels, old, adv


def _losses(hidden, weight, labels, old, adv, group):
    nll = linear_nll_loss(hidden, weight, labels, group=group)
    pol = linear_policy_loss(hidden, weight, labels, old, adv, group=group)
    return nll, pol


def _shares(rank, world):
    hidden, weight, labels, old, adv = _data()
    part = slice(0, 4) if rank == 0 else slice(4, T)  # uneven shards
    h = hidden[part].clone().requires_grad_()
    w = weight.clone().requires_grad_()
    nll, pol = _losses(h, w, labels[part], old[part], adv[part], dist.group.WORLD)
    (nll + pol).backward()
    dist.all_reduce(w.grad)
    both = torch.stack([nll.detach(), pol.detach()]).double()
    dist.all_reduce(both)
    return both, w.grad


@pytest.mark.multiproc
def test_group_shares_add_up_to_the_one_device_loss():
    hidden, weight, labels, old, adv = _data()
    w = weight.clone().requires_grad_()
    nll, pol = _losses(hidden, w, labels, old, adv, None)
    (nll + pol).backward()
    for both, grad in run_gloo(_shares, 2, timeout_s=120):
        assert torch.allclose(both, torch.stack([nll, pol]).detach().double(), rtol=1e-5)
        assert torch.allclose(grad, w.grad, rtol=1e-5, atol=1e-7)


def _one_bad(rank, world, which):
    hidden, weight, labels, old, adv = _data()
    if rank == 1:  # this rank's mask / old_logp does not fit its labels
        old = old[:-1]
        mask = torch.ones(T - 1)
    else:
        mask = torch.ones(T)
    try:
        if which == "nll":
            linear_nll_loss(hidden, weight, labels, mask, group=dist.group.WORLD)
        else:
            linear_policy_loss(hidden, weight, labels, old, adv, group=dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.multiproc
@pytest.mark.parametrize("which", ["nll", "policy"])
def test_a_bad_input_on_one_rank_raises_on_every_rank(which):
    # the timeout is the collectives' too: before, rank 0 waited for it in the all-reduce
    errors = run_gloo(_one_bad, 2, which, timeout_s=60)
    assert "1 other rank(s) of the group passed invalid input" in errors[0]
    assert "must have labels' shape" in errors[1]
