import math

import pytest
import torch

from rlhf_kernels import kl_penalty, policy_loss, value_loss

B, T = 3, 67


def _data(dtype=torch.float64):
    logp = (torch.randn(B, T, dtype=dtype) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(B, T, dtype=dtype) * 0.3
    adv = torch.randn(B, T, dtype=dtype)
    lens = [67, 20, 1]
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lens):
        mask[i, :n] = True
    return logp, old, adv, mask, lens


def _ref_policy(logp, old, adv, mask, lo, hi, dual, agg):
    """Per-token loop reference."""
    per_seq, tot, cnt = [], 0.0, 0
    for b in range(logp.shape[0]):
        s, n = 0.0, 0
        for t in range(logp.shape[1]):
            if not mask[b, t]:
                continue
            r = torch.exp(logp[b, t] - old[b, t])
            a = adv[b, t]
            loss = torch.maximum(-a * r, -a * torch.clamp(r, 1 - lo, 1 + hi))
            if dual is not None and a < 0:
                loss = torch.minimum(loss, -a * dual)
            s, n = s + loss, n + 1
        tot, cnt = tot + s, cnt + n
        if n:  # sequences without a selected token are left out of the sequence mean
            per_seq.append(s / n if agg == "seq-mean-token-mean" else s)
    if agg == "token-mean":
        return tot / cnt
    if agg == "seq-mean-token-sum-norm":  # Dr. GRPO: a constant, every row counts
        return tot / (logp.shape[0] * logp.shape[1])
    return sum(per_seq) / len(per_seq)


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
@pytest.mark.parametrize("lo,hi,dual", [(0.2, 0.2, None), (0.1, 0.28, 3.0)])
def test_policy_loss_padded_and_packed(agg, lo, hi, dual):
    logp, old, adv, mask, lens = _data()
    kw = dict(clip_low=lo, clip_high=hi, dual_clip=dual, aggregation=agg)
    ours = policy_loss(logp, old, adv, mask, **kw)
    ref = _ref_policy(logp, old, adv, mask, lo, hi, dual, agg)
    torch.testing.assert_close(ours, ref)
    (g1,) = torch.autograd.grad(ours, logp)
    (g2,) = torch.autograd.grad(ref, logp)
    torch.testing.assert_close(g1, g2)
    # packed layout: same tokens back to back
    cu = torch.tensor([0, 67, 87, 88])
    pk = [torch.cat([x[i, :n] for i, n in enumerate(lens)]) for x in (logp, old, adv)]
    if agg == "seq-mean-token-sum-norm":  # the padded default T, given explicitly
        kw["norm_length"] = T
    packed = policy_loss(*pk, cu_seqlens=cu, **kw)
    torch.testing.assert_close(packed, ref)


def test_dr_grpo_norm_is_a_constant():
    """``seq-mean-token-sum-norm`` divides by ``num_sequences * norm_length`` whatever the
    mask: a fully masked row still counts (unlike the sequence means), and the loss of one
    row does not change when another row's length does."""
    logp, old, adv, mask, lens = _data()
    mask[1] = False
    agg = "seq-mean-token-sum-norm"
    ours = policy_loss(logp, old, adv, mask, aggregation=agg, norm_length=100)
    want = _ref_policy(logp, old, adv, mask, 0.2, 0.2, None, "token-mean") * mask.sum() / 300
    torch.testing.assert_close(ours, want)
    torch.testing.assert_close(
        torch.autograd.grad(ours, logp)[0], torch.autograd.grad(want, logp)[0]
    )
    shorter = mask.clone()
    shorter[2] = False
    g_short = torch.autograd.grad(policy_loss(logp, old, adv, shorter, aggregation=agg), logp)[0]
    g_full = torch.autograd.grad(policy_loss(logp, old, adv, mask, aggregation=agg), logp)[0]
    torch.testing.assert_close(g_short[0], g_full[0], rtol=0, atol=0)
    x, cu = logp.detach().flatten(), torch.tensor([0, 100, B * T])
    half = policy_loss(x, x * 0.9, x, cu_seqlens=cu, aggregation=agg, norm_length=0.5)
    one = policy_loss(x, x * 0.9, x, cu_seqlens=cu, aggregation=agg, norm_length=1)
    torch.testing.assert_close(half, 2 * one)  # any positive budget, not rounded up to 1
    with pytest.raises(ValueError, match="packed layout needs norm_length"):
        policy_loss(x, x, x, cu_seqlens=cu, aggregation=agg)
    with pytest.raises(
        ValueError, match="norm_length is for aggregation='seq-mean-token-sum-norm'"
    ):
        policy_loss(x, x, x, cu_seqlens=cu, norm_length=10)
    for bad, err in ((0, ValueError), (-2.0, ValueError), (True, TypeError), ("8", TypeError)):
        with pytest.raises(err, match="norm_length must be"):
            policy_loss(x, x, x, cu_seqlens=cu, aggregation=agg, norm_length=bad)


def test_policy_loss_fp32_and_stats():
    logp, old, adv, mask, _ = _data()
    out, stats = policy_loss(
        logp.float(),
        old.float(),
        adv.float(),
        mask,
        clip_low=0.2,
        clip_high=0.2,
        dual_clip=2.0,
        return_stats=True,
    )
    ref = _ref_policy(logp, old, adv, mask, 0.2, 0.2, 2.0, "token-mean")
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-6, rtol=1e-5)
    r = torch.exp(logp - old).detach()[mask]
    a = adv[mask]
    clipped = (-a * r.clamp(0.8, 1.2)) > (-a * r)
    torch.testing.assert_close(
        stats["clip_frac"].double(), clipped.double().mean(), atol=1e-6, rtol=0
    )
    kl = r - 1 - r.log()  # k3 of KL(old || new), samples from old: E_old[r] = 1
    torch.testing.assert_close(stats["approx_kl"].double(), kl.mean(), atol=1e-6, rtol=1e-5)
    assert 0 < stats["clip_frac"] < 1 and 0 <= stats["dual_clip_frac"] < 1
    assert not mask.all()  # ratio_mean counts the masked-in tokens only
    torch.testing.assert_close(stats["ratio_mean"].double(), r.mean(), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss(clip):
    v = torch.randn(B, T, dtype=torch.float64, requires_grad=True)
    old = v.detach() + 0.3 * torch.randn(B, T, dtype=torch.float64)
    ret = torch.randn(B, T, dtype=torch.float64)
    _, _, _, mask, lens = _data()
    out = value_loss(v, old, ret, mask, clip)
    terms = []
    for b in range(B):
        for t in range(T):
            if mask[b, t]:
                e = (v[b, t] - ret[b, t]) ** 2
                if clip is not None:
                    vc = old[b, t] + torch.clamp(v[b, t] - old[b, t], -clip, clip)
                    e = torch.maximum(e, (vc - ret[b, t]) ** 2)
                terms.append(0.5 * e)
    ref = sum(terms) / len(terms)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out, v)[0], torch.autograd.grad(ref, v)[0])
    cu = torch.tensor([0, 67, 87, 88])
    pk = [torch.cat([x[i, :n] for i, n in enumerate(lens)]) for x in (v, old, ret)]
    torch.testing.assert_close(value_loss(*pk, clip=clip, cu_seqlens=cu), ref)


@pytest.mark.parametrize("est", ["k1", "k2", "k3"])
def test_kl_penalty(est):
    logp = (torch.randn(7, 31, dtype=torch.float64) - 1).requires_grad_()
    ref_logp = torch.randn(7, 31, dtype=torch.float64) - 1
    out = kl_penalty(logp, ref_logp, est)
    d = logp - ref_logp
    expect = {"k1": d, "k2": 0.5 * d**2, "k3": torch.exp(-d) - 1 + d}[est]
    torch.testing.assert_close(out, expect)
    torch.testing.assert_close(
        torch.autograd.grad(out.sum(), logp)[0], torch.autograd.grad(expect.sum(), logp)[0]
    )
    clamped = kl_penalty(logp, ref_logp, est, clamp=0.1)
    torch.testing.assert_close(clamped, expect.clamp(-0.1, 0.1))
    if est == "k3":
        assert (out >= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_k3_clamp_keeps_gradients_finite(dtype):
    """exp(ref - logp) overflowed for a far-off token: forward clamped, gradient NaN (0 * inf)."""
    logp = torch.tensor([-100.0, -1.0, -2.0, -0.5], dtype=dtype, requires_grad=True)
    ref = torch.tensor([-0.5, -1.02, -1.0, -3.0], dtype=dtype)
    kl = kl_penalty(logp, ref, "k3", clamp=10.0)
    kl.sum().backward()
    assert torch.isfinite(logp.grad).all(), logp.grad
    d = (logp.detach() - ref).double()
    expect = (torch.exp(-d) - 1 + d).clamp(max=10.0)
    torch.testing.assert_close(kl.double(), expect, rtol=1e-2, atol=1e-3)
    grad = torch.where(expect < 10.0, 1 - torch.exp(-d), 0.0)  # clamped: no gradient
    torch.testing.assert_close(logp.grad.double(), grad, rtol=1e-2, atol=1e-3)


def test_kl_k3_of_an_impossible_token_is_inf_not_nan():
    """Without a clamp, a token the policy gives probability 0 (logp = -inf) has k3 = +inf; it
    was exp(inf) - 1 - inf = NaN. The other tokens keep their values and finite gradients."""
    logp = torch.tensor([-math.inf, -1.0, -2.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-1.0, -math.inf, -1.5], dtype=torch.float64)
    kl = kl_penalty(logp, ref, "k3")
    assert kl[0] == math.inf and kl[1] == math.inf
    torch.testing.assert_close(kl[2], torch.tensor(math.exp(0.5) - 1.5, dtype=torch.float64))
    (grad,) = torch.autograd.grad(kl[1:].sum(), logp)
    assert torch.isfinite(grad).all(), grad
    torch.testing.assert_close(grad[2], torch.tensor(1 - math.exp(0.5), dtype=torch.float64))


def test_bad_input():
    x = torch.randn(2, 5)
    m = torch.ones(2, 5)
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="ref_logp must have logp's shape"):
        kl_penalty(x, x[:, :3])
    with pytest.raises(ValueError, match="aggregation must be one of"):
        policy_loss(x, x, x, m, aggregation="seq-sum")
    with pytest.raises(ValueError, match="advantages must have logp's shape"):
        policy_loss(x, x, x[:, :2], m)
    with pytest.raises(ValueError, match="got neither"):
        policy_loss(x, x, x)
    for dual in (0.5, 1.0):  # 1 would cap every negative-advantage token at -A
        with pytest.raises(ValueError, match="dual_clip must be a number > 1"):
            policy_loss(x, x, x, m, dual_clip=dual)
    for clip in (0.0, -0.1):  # 0 would freeze the clipped value term at old_values
        with pytest.raises(ValueError, match="clip must be a number > 0 or None"):
            value_loss(x, x, x, m, clip)
    with pytest.raises(ValueError, match="clip_low < 1 and clip_high >= 0, got None, 0.2"):
        policy_loss(x, x, x, m, clip_low=None)  # a named error, not Python's '<=' TypeError
    torch.testing.assert_close(  # a 0-d tensor option is a number
        policy_loss(x, x, x, m, clip_low=torch.tensor(0.2)), policy_loss(x, x, x, m, clip_low=0.2)
    )
    y = x + torch.randn(2, 5)
    torch.testing.assert_close(  # so is the KL clamp (refused before)
        kl_penalty(x, y, "k3", clamp=torch.tensor(0.5)), kl_penalty(x, y, "k3", clamp=0.5)
    )
    with pytest.raises(ValueError, match="clamp must be a number > 0"):
        kl_penalty(x, y, clamp=torch.tensor(float("nan")))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]"):
        value_loss(x.view(-1), x.view(-1), x.view(-1), cu_seqlens=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="mask must have values's shape"):
        value_loss(x, x, x, torch.ones(2, 4))
    with pytest.raises(TypeError, match="returns must be a float tensor"):
        value_loss(x, x, x.long(), m)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
def test_seq_mean_skips_empty_and_fully_masked_sequences(agg):
    # padded: row 1 fully masked; packed: an empty segment and a fully masked segment
    logp, old, adv, mask, lens = _data()
    mask[1] = False
    ours = policy_loss(logp, old, adv, mask, aggregation=agg)
    ref = _ref_policy(logp, old, adv, mask, 0.2, 0.2, None, agg)  # 2 live rows
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(
        torch.autograd.grad(ours, logp)[0], torch.autograd.grad(ref, logp)[0]
    )
    # packed: [row0 (67), empty, row1 (20, all masked), row2 (1)]
    cu = torch.tensor([0, 67, 67, 87, 88])
    pk = [torch.cat([x[i, :n] for i, n in enumerate(lens)]) for x in (logp, old, adv)]
    pmask = torch.cat([mask[i, :n] for i, n in enumerate(lens)])
    packed = policy_loss(*pk, pmask, cu_seqlens=cu, aggregation=agg)
    torch.testing.assert_close(packed, ref)


def test_dual_clip_branch_is_hit():
    # negative advantages with ratio > dual_clip: the loss is capped at -A * dual_clip there
    logp, old, adv, mask, _ = _data()
    old = old.clone()
    old[0, :30] = logp.detach()[0, :30] - 2.0  # ratio e^2 ~ 7.4 > 3
    adv = adv.clone()
    adv[0, :30] = -adv[0, :30].abs() - 0.1
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    out, stats = policy_loss(logp, old, adv, mask, return_stats=True, **kw)
    ref = _ref_policy(logp, old, adv, mask, 0.2, 0.28, 3.0, "token-mean")
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out, logp)[0], torch.autograd.grad(ref, logp)[0])
    r = torch.exp(logp - old).detach()
    hit = ((adv < 0) & (r > 3.0) & mask).sum() / mask.sum()
    assert stats["dual_clip_frac"] > 0
    torch.testing.assert_close(stats["dual_clip_frac"], hit.double())
    # without the cap the loss is larger: the branch changes the value
    assert policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28) > out + 1e-3


def test_packed_token_mean_needs_no_cu_seqlens():
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(12, generator=g) for _ in range(3))
    mask = torch.rand(12, generator=g) > 0.3
    got = policy_loss(logp, old, adv, mask)  # token-mean: no boundaries needed
    want = policy_loss(logp, old, adv, mask, cu_seqlens=torch.tensor([0, 5, 12]))
    torch.testing.assert_close(got, want)
    for agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        with pytest.raises(ValueError, match=f"aggregation='{agg}' needs sequence boundaries"):
            policy_loss(logp, old, adv, mask, aggregation=agg)


@pytest.mark.parametrize("dual", [None, 2.5])
def test_ppo_token_grad_closed_form_equals_autograd(dual):
    """The fused losses' closed-form ``d loss / d logp`` (made where autograd records nothing)
    is autograd's, ties included: ratio exactly at a clip bound, advantage 0, the ratio's cap,
    and the dual-clip cap hit exactly (``maximum`` / ``minimum`` split a tie's gradient in half)."""
    from rlhf_kernels.ops.losses import _ppo_token_grad, _ppo_token_loss

    g = torch.Generator().manual_seed(3)
    old = torch.randn(400, dtype=torch.float64, generator=g)
    logp = old + torch.randn(400, dtype=torch.float64, generator=g) * 0.6
    adv = torch.randn(400, dtype=torch.float64, generator=g)
    lo, hi = 0.2, 0.28
    logp[:4] = old[:4] + torch.tensor([0.8, 1.28, 1.0, 1.5], dtype=torch.float64).log()
    adv[2], adv[3] = 0.0, -1.0
    cap = 1.5 if dual is None else dual  # token 3: -A r == -A dual exactly
    old[3], logp[3] = 0.0, torch.tensor(cap, dtype=torch.float64).log()  # exp(log(2.5)) == 2.5
    # tokens 4, 5: A < 0 and a log-ratio past / exactly at MAX_LOG_RATIO (the unclipped term
    # wins; the cap passes no gradient past it, all of it at it)
    old[4:6], logp[4:6], adv[4:6] = 0.0, torch.tensor([100.0, 80.0], dtype=torch.float64), -1.0
    ratio = torch.exp(logp[:4] - old[:4])
    assert ratio[0] == 0.8 and ratio[1] == 1.28, ratio  # at the bounds exactly
    if dual is not None:
        assert -adv[3] * ratio[3] == -adv[3] * dual
    lp = logp.clone().requires_grad_()
    _ppo_token_loss(lp, old, adv, lo, hi, dual)[0].sum().backward()
    got = _ppo_token_grad(logp, old, adv, lo, hi, dual)
    torch.testing.assert_close(got, lp.grad, rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_overflowing_ratio_of_a_clipped_token_gives_zero_gradient(dtype):
    """exp(logp - old) past the dtype's range (fp32 88.7, fp16 11.1): the token is clipped, its
    gradient was 0 * inf = NaN and poisoned the batch; the loss now runs in fp32 with the
    ratio capped at exp(MAX_LOG_RATIO)."""
    from rlhf_kernels import linear_logprobs, linear_policy_loss

    big = 100.0 if dtype == torch.float32 else 12.0
    adv = torch.tensor([1.0, 1.0, -1.0])
    for dual in (None, 3.0):
        lp = torch.tensor([-1.0, -1.0, -1.0], dtype=dtype, requires_grad=True)
        old = torch.tensor([-1.0 - big, -1.1, -1.1], dtype=dtype)
        loss = policy_loss(lp, old, adv.to(dtype), cu_seqlens=[0, 3], dual_clip=dual)
        (g,) = torch.autograd.grad(loss, lp)
        assert loss.dtype == dtype and torch.isfinite(g).all(), g
        assert g[0] == 0 and abs(float(g[1]) + 0.3684) < 1e-3, g
    h = torch.randn(3, 8, requires_grad=True)
    w, lab = torch.randn(16, 8), torch.randint(0, 16, (3,))
    old = linear_logprobs(h.detach(), w, lab) - torch.tensor([100.0, 0.1, 0.1])
    linear_policy_loss(h, w, lab, old, adv).backward()
    assert torch.isfinite(h.grad).all()


def test_junk_at_masked_tokens_stays_out():
    """NaN / inf at masked positions (torch.empty pads) leaked through x * mask (NaN * 0)."""
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    lp = torch.zeros(1, 5, requires_grad=True)
    old, adv = torch.zeros(1, 5), torch.ones(1, 5)
    old[0, 4] = float("nan")
    loss = policy_loss(lp, old, adv, mask)
    loss.backward()
    assert loss.item() == -1.0 and torch.isfinite(lp.grad).all()
    ret = adv.masked_fill(mask == 0, float("inf"))
    assert value_loss(lp, old, ret, mask).item() == 0.5


@pytest.mark.parametrize("layout", ["mask", "cu_seqlens", "packed"])
def test_fp16_losses_past_65504_tokens(layout):
    """The token count was summed in fp16: inf past 65504 tokens, so the token-mean loss and
    its gradient were 0 and value_loss was NaN."""
    g = torch.Generator().manual_seed(0)
    n = 70_000
    logp = (-torch.rand(n, generator=g)).half().requires_grad_()
    old = (logp.detach().float() + 0.1 * torch.randn(n, generator=g)).half()
    adv = torch.randn(n, generator=g).half()
    kw = dict(mask=torch.ones(n, dtype=torch.bool)) if layout == "mask" else {}
    if layout == "cu_seqlens":
        kw = dict(cu_seqlens=torch.tensor([0, 30_000, n]))
    out = policy_loss(logp, old, adv, **kw)
    out.backward()
    want = policy_loss(logp.detach().float(), old.float(), adv.float(), **kw)
    torch.testing.assert_close(out.float(), want, rtol=2e-3, atol=1e-5)
    assert logp.grad.abs().max() > 0
    v = logp.detach()
    got = value_loss(v, old, adv, **kw, clip=0.2)
    torch.testing.assert_close(
        got.float(),
        value_loss(v.float(), old.float(), adv.float(), **kw, clip=0.2),
        rtol=2e-3,
        atol=0,
    )


def test_bf16_k3_is_computed_in_fp32():
    # expm1(x) - x cancels in bf16 at typical log-ratios: 3.7e-2 relative L1 error before
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4096, generator=g) * 3).bfloat16()
    ref = (logp.float() + 0.05 * torch.randn(4096, generator=g)).bfloat16()
    exact = kl_penalty(logp.double(), ref.double(), "k3")
    got = kl_penalty(logp, ref, "k3")
    assert got.dtype == torch.bfloat16
    rel = ((got.double() - exact).abs().sum() / exact.abs().sum()).item()
    assert rel < 5e-3, rel  # bf16 rounding of the result only


def test_approx_kl_stat_stays_finite_after_a_large_drop():
    logp = torch.tensor([-100.0, -1.0], requires_grad=True)
    old = torch.tensor([-1.0, -1.1])
    loss, stats = policy_loss(logp, old, torch.ones(2), torch.ones(2), return_stats=True)
    assert torch.isfinite(stats["approx_kl"]) and torch.isfinite(loss)


def test_scalar_options_take_numpy_and_clip_by_position_is_named():
    import numpy as np

    logp, old, adv, mask, _ = _data()
    kw = dict(aggregation="seq-mean-token-sum-norm")
    a = policy_loss(logp, old, adv, mask, norm_length=np.int64(3), **kw)
    torch.testing.assert_close(a, policy_loss(logp, old, adv, mask, norm_length=3, **kw))
    with pytest.raises(TypeError, match="mask must be a tensor or None, got float"):
        value_loss(logp, old, adv, 0.2)  # clip is the 5th argument
    with pytest.raises(ValueError, match="clamp must be a number > 0"):
        kl_penalty(logp, old, "k3", clamp="x")
