"""Audit of padding.py, ring/blocks.py and ops/losses.py: bad input refused before any work,
empty / fully masked edge cases, and the block math of a ring simulated in one process."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlhf_kernels import (
    index_put_first_axis,
    kl_penalty,
    pad_input,
    policy_loss,
    sequence_to_tokens,
    unpad_input,
    value_loss,
)
from rlhf_kernels.ops.varlen_attention import varlen_attention_reference
from rlhf_kernels.ring import blocks
from rlhf_kernels.ring.plan import RingPlan

AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


# ----------------------------------------------------------------------------- padding
def test_pad_input_refuses_indices_that_are_not_1d_integers():
    """pad_input cast float / bool indices with .long(): bool ones scattered every row to
    slot 0 or 1 (data lost, no error), as index_first_axis / index_put_first_axis refuse."""
    h = torch.arange(6.0).reshape(3, 2)
    idx = torch.tensor([0, 2, 3])
    for bad in (idx.float(), torch.tensor([True, False, True])):
        with pytest.raises(TypeError, match=rf"indices must be int32/int64, got {bad.dtype}"):
            pad_input(h, bad, 2, 2)
    with pytest.raises(ValueError, match=r"indices must be a 1-D tensor, got \(3, 1\)"):
        pad_input(h, idx[:, None], 2, 2)
    with pytest.raises(ValueError, match="hidden_states must have a first axis"):
        pad_input(torch.tensor(1.0), idx[:0], 1, 1)  # was IndexError: tuple index out of range
    assert pad_input(h, idx.int(), 2, 2).reshape(4, 2)[[0, 2, 3]].equal(h)


def test_index_put_first_axis_refuses_float_indices_and_0d_values():
    with pytest.raises(TypeError, match="indices must be int32/int64"):
        index_put_first_axis(torch.ones(2, 3), torch.tensor([0.0, 1.0]), 4)
    with pytest.raises(ValueError, match=r"values \(N, ...\) and indices \(N,\) must agree"):
        index_put_first_axis(torch.tensor(1.0), torch.tensor([0]), 4)


def test_sequence_to_tokens_total_must_be_an_int():
    cu = torch.tensor([0, 1, 3])
    for bad in (3.0, True):  # passed the cu_seqlens check, then torch's unclear TypeError
        with pytest.raises(TypeError, match="total must be an int"):
            sequence_to_tokens(torch.ones(2), cu, total=bad)
    out = sequence_to_tokens(torch.tensor([1.0, 2.0]), cu, total=np.int64(3))
    assert out.tolist() == [1.0, 2.0, 2.0]


def test_unpad_input_of_an_empty_batch():
    h, idx, cu, max_len, used = unpad_input(torch.randn(0, 4, 2), torch.ones(0, 4))
    assert h.shape == (0, 2) and idx.shape == (0,) and cu.tolist() == [0]
    assert max_len == 0 and used.shape == (0,)
    assert pad_input(h, idx, 0, 4).shape == (0, 4, 2)


# ----------------------------------------------------------------------------- losses
def test_norm_length_must_be_finite():
    """norm_length=inf divided every token by inf: a zero loss and zero gradients, silently."""
    x, m = torch.randn(2, 5), torch.ones(2, 5)
    with pytest.raises(ValueError, match="norm_length must be a finite number > 0, got inf"):
        policy_loss(x, x, x, m, aggregation="seq-mean-token-sum-norm", norm_length=float("inf"))


@pytest.mark.parametrize("agg", AGGS)
def test_fully_masked_batch_gives_zero_loss_and_zero_gradients(agg):
    g = torch.Generator().manual_seed(0)
    logp = torch.randn(3, 6, generator=g, requires_grad=True)
    old, adv = torch.randn(3, 6, generator=g), torch.randn(3, 6, generator=g)
    mask = torch.zeros(3, 6)
    packed = dict(mask=mask.view(-1), cu_seqlens=[0, 6, 18])
    if agg == "seq-mean-token-sum-norm":
        packed["norm_length"] = 6
    for flat, kw in ((False, dict(mask=mask)), (True, packed)):
        lp, o, a = (t.view(-1) if flat else t for t in (logp, old, adv))
        out = policy_loss(lp, o, a, aggregation=agg, **kw)
        (grad,) = torch.autograd.grad(out, logp)
        assert out.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad)), (out, grad)
    v = torch.randn(3, 6, generator=g, requires_grad=True)
    loss = value_loss(v, old, adv, mask, clip=0.2)
    (grad,) = torch.autograd.grad(loss, v)
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("agg", AGGS)
def test_no_sequences_at_all(agg):
    e = torch.zeros(0, 5, requires_grad=True)
    assert policy_loss(e, e, e, torch.zeros(0, 5), aggregation=agg).item() == 0.0
    p = torch.zeros(0, requires_grad=True)
    kw = dict(norm_length=4) if agg == "seq-mean-token-sum-norm" else {}
    assert policy_loss(p, p, p, cu_seqlens=[0], aggregation=agg, **kw).item() == 0.0


def test_option_bounds():
    x, m = torch.randn(2, 5), torch.ones(2, 5)
    with pytest.raises(ValueError, match="0 <= clip_low < 1"):  # ratio clipped at <= 0
        policy_loss(x, x, x, m, clip_low=1.0)
    with pytest.raises(ValueError, match="clamp must be a number > 0"):  # a zero KL
        kl_penalty(x, x + 1, "k3", clamp=0.0)


def test_losses_name_a_device_mismatch():
    x, m = torch.randn(2, 5), torch.ones(2, 5)
    with pytest.raises(ValueError, match="same device.*old_logp on meta"):
        policy_loss(x, x.to("meta"), x, m)
    with pytest.raises(ValueError, match="same device.*mask on meta"):
        value_loss(x, x, x, m.to("meta"))


def test_fp16_value_loss_squares_in_fp32():
    """A value error of 256 squares to 65536, past fp16's 65504: inf if squared in fp16."""
    v = torch.full((1, 4), 256.0, dtype=torch.float16, requires_grad=True)
    zero = torch.zeros(1, 4, dtype=torch.float16)
    loss = value_loss(v, zero, zero, torch.ones(1, 4))
    loss.backward()
    assert loss.dtype == torch.float16 and loss.item() == 32768.0
    assert torch.isfinite(v.grad).all()


# ----------------------------------------------------------------------------- ring blocks
LENGTHS = [1, 23, 2, 40, 9]


def _simulated_ring(plan, q, k, v, do, causal, window, softcap, fused, tile):
    """forward_block / backward_block of every (rank, src) of a ring, in one process."""
    spec = SimpleNamespace(
        scale=q.shape[-1] ** -0.5,
        softcap=softcap,
        left=window[0],
        right=0 if causal else window[1],
        fused=fused,
    )
    world = plan.world_size
    qs, ks, vs, dos = ([plan.shard(t, r) for r in range(world)] for t in (q, k, v, do))
    outs, lses = [], []
    for r in range(world):
        acc_o = torch.zeros_like(qs[r])
        acc_lse = torch.full((q.shape[1], plan.local_len), float("-inf"), dtype=q.dtype)
        for src in range(world):
            pairs = blocks.tile_pairs(plan, r, src, causal, window, tile)
            blocks.forward_block(spec, qs[r], ks[src], vs[src], pairs, acc_o, acc_lse)
        outs.append(acc_o)
        lses.append(acc_lse)
    dq = [torch.zeros_like(t) for t in qs]
    dk = [torch.zeros_like(t) for t in ks]
    dv = [torch.zeros_like(t) for t in vs]
    for r in range(world):
        delta = (dos[r] * outs[r]).sum(-1).T.contiguous()
        for src in range(world):
            pairs = blocks.tile_pairs(plan, r, src, causal, window, tile)
            args = (qs[r], ks[src], vs[src], outs[r], dos[r], lses[r], delta, pairs)
            blocks.backward_block(spec, *args, dq[r], dk[src], dv[src])
    return [plan.unshard(t) for t in (outs, dq, dk, dv)]


@pytest.mark.parametrize("world,layout", [(3, "zigzag"), (2, "contiguous")])
@pytest.mark.parametrize(
    "causal,window,softcap,fused,dtype",
    [
        (True, (-1, -1), 0.0, True, torch.float32),  # fused diagonal and all-visible tiles
        (True, (5, 0), 0.0, True, torch.float32),
        (False, (4, 7), 0.0, False, torch.float64),
        (True, (-1, -1), 2.0, False, torch.float64),
    ],
)
def test_blocks_of_a_simulated_ring_match_single_device(
    world, layout, causal, window, softcap, fused, dtype
):
    """Every rank's tiles of a simulated ring, fused or not, give single-device attention.
    (The tiling never makes an equal-size causal tile off the diagonal, so the fused kernel's
    top-left-mask guard is pinned directly, in test_packing_blocks_mutation_audit.py.)"""
    g = torch.Generator().manual_seed(1)
    total = sum(LENGTHS)
    q, do = (torch.randn(total, 4, 8, generator=g, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(total, 2, 8, generator=g, dtype=torch.float64) for _ in "kv")
    cu = torch.tensor([0, *np.cumsum(LENGTHS).tolist()], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = varlen_attention_reference(
        *leaves, cu, cu, causal=causal, window_size=window, softcap=softcap
    )
    ref.backward(do)
    plan = RingPlan.build(cu, world, layout)
    got = _simulated_ring(
        plan, *(t.to(dtype) for t in (q, k, v, do)), causal, window, softcap, fused, 4
    )
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, [ref, *(t.grad for t in leaves)]):
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol, msg=name)


def test_merge_rows_of_a_row_that_sees_nothing_yet_stays_empty():
    """A query row with no key in the pair (lse -inf) merged into an empty accumulator
    (lse -inf): out stays 0 and lse -inf, not NaN (exp(-inf - -inf))."""
    acc_o = torch.zeros(3, 2, 4, dtype=torch.float64)
    acc_lse = torch.full((2, 3), float("-inf"), dtype=torch.float64)
    idx = torch.tensor([0, 1, 1])
    o = torch.randn(3, 2, 4, dtype=torch.float64)
    lse = torch.randn(2, 3, dtype=torch.float64)
    lse[:, 0] = float("-inf")  # row 0 sees no key of this pair
    o[0] = 0.0
    blocks._merge_rows(acc_o, acc_lse, idx, o, lse)
    assert torch.equal(acc_o[0], torch.zeros(2, 4, dtype=torch.float64))
    assert torch.isneginf(acc_lse[:, 0]).all() and torch.isneginf(acc_lse[:, 2]).all()
    w = torch.softmax(lse[:, 1:], -1)  # row 1: both partials, weighted by their lse
    torch.testing.assert_close(acc_o[1], (o[1:] * w.T[..., None]).sum(0))
    torch.testing.assert_close(acc_lse[:, 1], torch.logsumexp(lse[:, 1:], -1))


def test_policy_loss_cu_seqlens_on_another_device_refused():
    # was torch's index_add device error from inside the seq-mean aggregation
    lp = torch.zeros(5, device="meta")
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens on cpu"):
        policy_loss(lp, lp, lp, cu_seqlens=cu, aggregation="seq-mean-token-mean")
