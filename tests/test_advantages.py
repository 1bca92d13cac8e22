import math

import pytest
import torch

from rlhf_kernels import group_advantages, whiten


def _ref_group(r, G, est, eps=1e-6):
    """Per-element Python reference in float64."""
    out = []
    vals = r.tolist()
    centred = [
        v - sum(vals[g : g + G]) / G for g in range(0, len(vals), G) for v in vals[g : g + G]
    ]
    c_mean = sum(centred) / len(centred)  # 0 up to rounding
    batch_std = math.sqrt(sum((c - c_mean) ** 2 for c in centred) / (len(centred) - 1))
    for g0 in range(0, len(vals), G):
        grp = vals[g0 : g0 + G]
        mean = sum(grp) / G
        std = math.sqrt(sum((v - mean) ** 2 for v in grp) / (G - 1)) if G > 1 else 0.0
        for v in grp:
            if est == "grpo":
                out.append((v - mean) / (std + eps))
            elif est == "dr_grpo":
                out.append(v - mean)
            elif est == "rloo":
                out.append(v - (sum(grp) - v) / (G - 1))
            else:
                out.append((v - mean) / (batch_std + eps))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("est", ["grpo", "dr_grpo", "rloo", "reinforce_baseline"])
@pytest.mark.parametrize("G", [2, 5, 7])
def test_group_advantages_match_reference(est, G):
    r = torch.randn(G * 9, dtype=torch.float64)
    torch.testing.assert_close(group_advantages(r, G, est), _ref_group(r, G, est))
    out32 = group_advantages(r.float(), G, est)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), _ref_group(r, G, est), atol=1e-5, rtol=1e-5)


def test_group_advantages_gradient():
    r = torch.randn(12, dtype=torch.float64, requires_grad=True)
    for est in ("grpo", "dr_grpo", "rloo", "reinforce_baseline"):
        assert torch.autograd.gradcheck(lambda x, e=est: group_advantages(x, 4, e), (r,))


def test_reinforce_baseline_std_is_over_centred_rewards():
    """Rewards [0, 1, 10, 11] in groups of 2: the raw std (5.8) also counted the spread between
    prompts and gave +-0.086; the centred rewards' std gives +-0.866 (OpenRLHF, verl)."""
    adv = group_advantages(torch.tensor([0.0, 1.0, 10.0, 11.0]), 2, "reinforce_baseline")
    torch.testing.assert_close(
        adv, torch.tensor([-1.0, 1.0, -1.0, 1.0]) * 0.5 / 0.57735, atol=1e-4, rtol=0
    )


def test_rloo_equals_scaled_dr_grpo():
    # known identity: rloo = G / (G - 1) * (r - mean)
    r = torch.randn(30, dtype=torch.float64)
    torch.testing.assert_close(
        group_advantages(r, 6, "rloo"), 6 / 5 * group_advantages(r, 6, "dr_grpo")
    )


def test_group_advantages_bad_input():
    with pytest.raises(ValueError, match="not a multiple of group_size=4"):
        group_advantages(torch.randn(10), 4)
    with pytest.raises(ValueError, match="estimator must be one of"):
        group_advantages(torch.randn(8), 4, "ppo")
    for estimator in ("rloo", "grpo"):  # grpo: the std of one reward is NaN
        with pytest.raises(ValueError, match=f"estimator '{estimator}' needs group_size >= 2"):
            group_advantages(torch.randn(8), 1, estimator)
    with pytest.raises(ValueError, match="group_size must be a positive int, got 0"):
        group_advantages(torch.randn(8), 0)
    with pytest.raises(ValueError, match="rewards must be 1-D"):
        group_advantages(torch.randn(2, 4), 4)
    with pytest.raises(TypeError, match="rewards must be a float tensor"):
        group_advantages(torch.ones(8, dtype=torch.long), 4)
    for eps in (-1e-6, float("nan"), float("inf"), "1e-6"):  # a negative eps gave NaN silently
        with pytest.raises(ValueError, match="eps must be a finite number >= 0"):
            group_advantages(torch.randn(8), 4, eps=eps)


def test_one_reward_has_a_zero_baseline_advantage():
    """reinforce_baseline over a single response: the centred reward is 0 and so is its
    advantage (the std of one value is NaN in torch; taken as 0 here)."""
    for estimator in ("reinforce_baseline", "dr_grpo"):
        assert group_advantages(torch.tensor([3.0]), 1, estimator).tolist() == [0.0]


def test_whiten_masked():
    x = torch.randn(5, 67, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(5, 67) > 0.4
    sel = x[mask]
    ref = (x - sel.mean()) / torch.sqrt(sel.var() + 1e-8)  # unbiased var
    out = whiten(x, mask)
    torch.testing.assert_close(out, ref)
    gw = torch.randn(5, 67, dtype=torch.float64)
    (g1,) = torch.autograd.grad((out * gw).sum(), x)
    (g2,) = torch.autograd.grad((ref * gw).sum(), x)
    torch.testing.assert_close(g1, g2)
    torch.testing.assert_close(whiten(x, mask, shift_only=True), x - sel.mean())
    torch.testing.assert_close(whiten(x), (x - x.mean()) / torch.sqrt(x.var() + 1e-8))
    # masked entries do not influence the statistics
    x2 = x.detach().clone()
    x2[~mask] = 1e6
    torch.testing.assert_close(whiten(x2, mask)[mask], out.detach()[mask])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_whiten_half_in_fp32(dtype):
    """65k fp16 entries: the count and sums overflowed to inf (all outputs -inf / NaN)."""
    torch.manual_seed(0)
    x = (torch.randn(64, 1024) + 3).to(dtype)
    mask = torch.ones(64, 1024)
    mask[:, -8:] = 0
    for m in (None, mask):
        want = whiten(x.float(), m)
        got = whiten(x, m)
        assert got.dtype == dtype
        plain = want.to(dtype).float()  # the rounding of the fp32 answer to dtype
        assert (got.float() - want).abs().max() <= 2 * (plain - want).abs().max()


def test_whiten_bad_input():
    with pytest.raises(ValueError, match="mask must have x's shape"):
        whiten(torch.randn(3, 4), torch.ones(3, 5))
    with pytest.raises(TypeError, match="x must be a float tensor"):
        whiten(torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="eps must be a finite number >= 0, got -1.0"):
        whiten(torch.ones(4), eps=-1.0)  # all NaN before


def test_whiten_needs_two_selected_entries():
    """0 or 1 selected entries returned x * 1e4 (the variance was 0 + eps)."""
    x = torch.tensor([[1.0, 2.0, 3.0]])
    for mask in ([[0, 0, 0]], [[0, 1, 0]]):
        with pytest.raises(ValueError, match="at least 2 selected entries"):
            whiten(x, torch.tensor(mask))
    nan = torch.tensor([[1.0, 2.0, 3.0, float("nan")]])
    out = whiten(nan, torch.tensor([[1, 1, 1, 0]]))
    torch.testing.assert_close(out[0, :3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-4, rtol=0)


def test_scalar_arguments_checked():
    import numpy as np

    from rlhf_kernels import discounted_returns, gae

    r = torch.randn(8)
    torch.testing.assert_close(group_advantages(r, np.int64(4)), group_advantages(r, 4))
    with pytest.raises(ValueError, match="group_size must be a positive int, got True"):
        group_advantages(r, True)
    with pytest.raises(TypeError, match="gamma must be a number in \\[0, 1\\], got str"):
        gae(r, r, gamma="0.9", lam=0.9, cu_seqlens=[0, 8])
    for bad in (1.5, -0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="gamma must be in \\[0, 1\\]"):
            gae(r, r, gamma=bad, lam=0.9, cu_seqlens=[0, 8])
        with pytest.raises(ValueError, match="lam must be in \\[0, 1\\]"):
            gae(r, r, gamma=0.9, lam=bad, cu_seqlens=[0, 8])
        with pytest.raises(ValueError, match="gamma must be in \\[0, 1\\]"):
            discounted_returns(r, gamma=bad, cu_seqlens=[0, 8])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_group_advantages_half_in_fp32(dtype):
    # rloo of fp16 [0, 1, 2, 2] gave -1.75 for the first response (exact -1.667)
    r = torch.tensor([0.0, 1.0, 2.0, 2.0] * 3)
    for est in ("grpo", "rloo", "dr_grpo", "reinforce_baseline"):
        got = group_advantages(r.to(dtype), 4, est)
        assert got.dtype == dtype
        torch.testing.assert_close(got, group_advantages(r, 4, est).to(dtype), rtol=0, atol=0)
