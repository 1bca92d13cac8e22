"""Every token op takes the packed ``(N, ...)`` and the padded ``(B, T, ...)`` layout with the same
meaning; masks must be 0/1; ``cu_seqlens`` may be a list; a 0 inside a GAE mask is a step with
reward and value 0 (the sequence goes on)."""

import pytest
import torch
import torch.nn.functional as F

import rlhf_kernels as rk
from rlhf_kernels.ops.gae import gae_reference
from rlhf_kernels.ops.losses import policy_loss, value_loss

B, T, H, V = 3, 9, 16, 37
AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _padded(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) * 0.5
    labels = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate((T, 5, 2)):  # right padding, different lengths
        mask[b, :n] = True
    labels[~mask] = -100
    labels[0, 3] = -100  # an ignored token inside a sequence
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    adv = torch.randn(B, T, generator=g, dtype=dtype)
    return hidden, weight, labels, mask, old, adv


def _pack(mask, *tensors):
    """The real tokens of padded tensors, packed, and their cu_seqlens (a Python list)."""
    lens = mask.sum(1).tolist()
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return [t[mask] for t in tensors], cu


def _grads(loss, *xs):
    return torch.autograd.grad(loss, xs)


def test_linear_logprobs_padded_equals_packed():
    hidden, weight, labels, mask, _, _ = _padded()
    hidden.requires_grad_()
    logp, ent = rk.linear_logprobs(hidden, weight, labels, return_entropy=True)
    assert logp.shape == ent.shape == (B, T)
    ref = torch.log_softmax(hidden @ weight.T, -1)
    want = ref.gather(-1, labels.clamp_min(0)[..., None])[..., 0].masked_fill(labels < 0, 0.0)
    assert torch.allclose(logp.double(), want, atol=1e-5)
    assert torch.allclose(ent.double(), -(ref.exp() * ref).sum(-1), atol=1e-5)
    (packed_h, packed_l), _ = _pack(mask, hidden, labels)
    assert torch.equal(rk.linear_logprobs(packed_h, weight, packed_l), logp[mask])
    (g,) = _grads(logp.sum(), hidden)
    (g_ref,) = _grads(want.sum(), hidden)
    assert torch.allclose(g, g_ref, atol=1e-5)


@pytest.mark.parametrize("with_mask", [True, False])
def test_linear_nll_loss_padded(with_mask):
    hidden, weight, labels, mask, _, _ = _padded(1)
    hidden.requires_grad_()
    weight.requires_grad_()
    loss = rk.linear_nll_loss(hidden, weight, labels, mask if with_mask else None)
    ref = F.cross_entropy((hidden @ weight.T).reshape(-1, V), labels.reshape(-1))
    assert torch.allclose(loss.double(), ref, atol=1e-6)
    for a, b in zip(_grads(loss, hidden, weight), _grads(ref, hidden, weight)):
        assert torch.allclose(a.double(), b, atol=1e-6)
    (ph, pl), _ = _pack(mask, hidden, labels)
    assert torch.allclose(rk.linear_nll_loss(ph, weight, pl), loss, atol=1e-7)


@pytest.mark.parametrize("aggregation", AGGS)
def test_linear_policy_loss_padded_equals_packed_and_unfused(aggregation):
    hidden, weight, labels, mask, old, adv = _padded(2)
    hidden.requires_grad_()
    weight.requires_grad_()
    counted = mask & (labels != -100)
    kw = dict(aggregation=aggregation, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    loss = rk.linear_policy_loss(hidden, weight, labels, old, adv, mask, **kw)
    grads = _grads(loss, hidden, weight)
    # unfused: naive log-probs into policy_loss on the padded layout
    logp = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels.clamp_min(0)[..., None])
    ref = policy_loss(logp[..., 0], old, adv, counted, **kw)
    assert torch.allclose(loss.double(), ref, atol=1e-6)
    for a, b in zip(grads, _grads(ref, hidden, weight)):
        assert torch.allclose(a.double(), b, atol=1e-6)
    # packed: the same tokens with cu_seqlens as a list
    (ph, pl, po, pa), cu = _pack(mask, hidden, labels, old, adv)
    if aggregation == "seq-mean-token-sum-norm":  # the padded default: the rows' length
        kw["norm_length"] = labels.shape[-1]
    packed = rk.linear_policy_loss(ph, weight, pl, po, pa, cu_seqlens=cu, **kw)
    assert torch.allclose(packed, loss, atol=1e-7)


def test_linear_policy_loss_padded_needs_mask_for_rows():
    hidden, weight, labels, _, old, adv = _padded(3)
    with pytest.raises(ValueError, match="seq-mean-token-mean.*cu_seqlens|needs mask"):
        rk.linear_policy_loss(hidden, weight, labels, old, adv, aggregation="seq-mean-token-mean")
    with pytest.raises(ValueError, match="old_logp must have labels' shape"):
        rk.linear_policy_loss(hidden, weight, labels, old[:, :-1], adv[:, :-1])


def test_elementwise_ops_padded_equals_packed():
    _, _, _, mask, old, adv = _padded(4)
    ret = torch.randn(B, T, dtype=torch.float64)
    (po, pa, pr), cu = _pack(mask, old, adv, ret)
    for fn in (
        lambda x, y, z, m, c: policy_loss(x, y, z, m, cu_seqlens=c),
        lambda x, y, z, m, c: value_loss(x, y, z, m, clip=0.2, cu_seqlens=c),
    ):
        assert torch.allclose(fn(old, adv, ret, mask, None), fn(po, pa, pr, None, cu))
    assert torch.equal(rk.kl_penalty(old, adv, "k3")[mask], rk.kl_penalty(po, pa, "k3"))
    assert torch.allclose(rk.whiten(adv, mask)[mask], rk.whiten(pa))
    a_pad, r_pad = rk.gae(ret, adv, gamma=0.9, lam=0.8, mask=mask)
    a_pk, r_pk = rk.gae(pr, pa, gamma=0.9, lam=0.8, cu_seqlens=cu)
    assert torch.allclose(a_pad[mask], a_pk) and torch.allclose(r_pad[mask], r_pk)
    g_pad = rk.discounted_returns(ret, gamma=0.9, mask=mask)
    assert torch.allclose(g_pad[mask], rk.discounted_returns(pr, gamma=0.9, cu_seqlens=cu))


def test_gae_zero_inside_mask_is_a_zero_step():
    """A 0 in the middle of a sequence's mask: reward and value 0 there, the recurrence runs on."""
    r = torch.tensor([[0.0, 0.5, 0.0, 0.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[0.2, 0.4, 9.0, 0.6, 0.8]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 0, 1, 1]])
    gamma, lam = 0.9, 0.7
    adv, ret = rk.gae(r, v, gamma=gamma, lam=lam, mask=m)
    # by hand, right to left, with r[2] = v[2] = 0 (the 9.0 is never read)
    rr, vv = r[0] * m[0], v[0] * m[0]
    want, nxt, v_next = [0.0] * 5, 0.0, 0.0
    for t in reversed(range(5)):
        nxt = rr[t] + gamma * v_next - vv[t] + gamma * lam * nxt
        want[t], v_next = nxt, vv[t]
    assert torch.allclose(adv[0], torch.tensor(want, dtype=torch.float64))
    assert torch.allclose(ret, adv + v * m)
    assert adv[0, 2] != 0  # the masked step carries the advantage through
    ref_adv, _ = gae_reference(r, v, m.double(), gamma, lam)
    assert torch.allclose(adv, ref_adv)
    # the same stream packed: the hole does not split the sequence
    a_pk, _ = rk.gae(r[0], v[0], gamma=gamma, lam=lam, cu_seqlens=[0, 5], mask=m[0])
    assert torch.allclose(a_pk, adv[0])


def _bad_mask_calls(m):
    x = torch.randn(B, T)
    h, w = torch.randn(B, T, H), torch.randn(V, H)
    lab = torch.randint(0, V, (B, T))
    return {
        "linear_nll_loss": lambda: rk.linear_nll_loss(h, w, lab, m),
        "linear_policy_loss": lambda: rk.linear_policy_loss(h, w, lab, x, x, m),
        "policy_loss": lambda: policy_loss(x, x, x, m),
        "value_loss": lambda: value_loss(x, x, x, m),
        "gae": lambda: rk.gae(x, x, gamma=1.0, lam=1.0, mask=m),
        "discounted_returns": lambda: rk.discounted_returns(x, gamma=1.0, mask=m),
        "whiten": lambda: rk.whiten(x, m),
        "unpad_input": lambda: rk.unpad_input(h, m),
    }


@pytest.mark.parametrize("op", list(_bad_mask_calls(None)))
@pytest.mark.parametrize("value", [2.0, -1.0, 0.5])
def test_mask_values_outside_0_1_raise(op, value):
    m = torch.ones(B, T)
    m[1, 2] = value
    with pytest.raises(ValueError, match=rf"mask values must be 0 or 1.*\[{value}\]"):
        _bad_mask_calls(m)[op]()
    # the same call with a valid numeric mask runs
    m[1, 2] = 0.0
    _bad_mask_calls(m)[op]()


def test_cu_seqlens_lists_and_tuples():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(7, 2, 8, generator=g) for _ in range(3))
    t = torch.tensor([0, 3, 7], dtype=torch.int32)
    want = rk.varlen_attention(q, k, v, t, t, causal=True)
    assert torch.equal(rk.varlen_attention(q, k, v, [0, 3, 7], (0, 3, 7), causal=True), want)
    x = torch.randn(7, generator=g)
    assert torch.equal(
        rk.gae(x, x, gamma=0.9, lam=0.9, cu_seqlens=[0, 3, 7])[0],
        rk.gae(x, x, gamma=0.9, lam=0.9, cu_seqlens=t)[0],
    )
    assert torch.equal(
        rk.discounted_returns(x, gamma=0.9, cu_seqlens=(0, 3, 7)),
        rk.discounted_returns(x, gamma=0.9, cu_seqlens=t),
    )
    agg = "seq-mean-token-sum"
    assert torch.equal(
        policy_loss(x, x, x, cu_seqlens=[0, 3, 7], aggregation=agg),
        policy_loss(x, x, x, cu_seqlens=t, aggregation=agg),
    )
    assert torch.equal(value_loss(x, x, x, cu_seqlens=[0, 3, 7]), value_loss(x, x, x, cu_seqlens=t))
    spread = rk.sequence_to_tokens(torch.tensor([1.0, 2.0]), [0, 3, 7])
    assert spread.tolist() == [1.0] * 3 + [2.0] * 4
    with pytest.raises(TypeError, match="cu_seqlens_k as a list/tuple must hold Python ints"):
        rk.varlen_attention(q, k, v, t, [0, 3.5, 7])
    with pytest.raises(TypeError, match=r"must hold Python ints, got \['bool True'\]"):
        rk.varlen_attention(q, k, v, t, [0, True, 7])  # named (the list of offenders was empty)
    with pytest.raises(TypeError, match="cu_seqlens must be an int32/int64 tensor or a list"):
        rk.gae(x, x, gamma=0.9, lam=0.9, cu_seqlens="0,3,7")
    with pytest.raises(ValueError, match="non-decreasing"):
        rk.gae(x, x, gamma=0.9, lam=0.9, cu_seqlens=[0, 4, 3, 7])
