"""Audit of the Triton varlen attention kernels: edge masks against float64 math.

Tiny shapes for the CPU interpreter (16 x 16 blocks): windows at 0, at a sequence's length and
past it, cross-attention both ways, softcap with windows and GQA, odd head dims, the lse's own
gradient, and explicit per-sequence query offsets (``diff``, the ring attention path).
"""

from __future__ import annotations

import pytest
import torch

from rlhf_kernels.ops.varlen_attention import varlen_attention_reference
from rlhf_kernels.ops.varlen_attention_triton import (
    triton_varlen_attention,
    varlen_attention_triton_backward,
    varlen_attention_triton_forward,
)


def _cu(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _inputs(lens_q, lens_k, heads, kv_heads, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lens_q), heads, dim, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lens_k), kv_heads, dim, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lens_k), kv_heads, dim, generator=g, dtype=torch.float64)
    dout = torch.randn(sum(lens_q), heads, dim, generator=g, dtype=torch.float64)
    dlse = torch.randn(heads, sum(lens_q), generator=g, dtype=torch.float64)
    return q, k, v, dout, dlse


def _assert_close(got, ref, names=("out", "lse", "dq", "dk", "dv")):
    for name, a, r in zip(names, got, ref):
        assert a.shape == r.shape, name
        if name == "lse":  # keyless rows: -inf in both, the rest close
            assert torch.equal(torch.isneginf(a), torch.isneginf(r)), name
            keep = torch.isfinite(r)
            a, r = a[keep], r[keep]
        torch.testing.assert_close(a.double(), r, rtol=1e-5, atol=1e-5, msg=name)


# (lens_q, lens_k (None = self), heads, kv_heads, head_dim, causal, window, softcap)
EDGE_CASES = {
    # window (0, 0) with more queries than keys: rows see one key or none (one block each side)
    "cross_diag_only_softcap_gqa_d12": ([33, 5, 17], [16, 40, 1], 4, 2, 12, False, (0, 0), 1.5),
    # left side equal to a sequence's length (16) and past the others' lengths
    "left_eq_len_right_1_mqa_d20": ([16, 3, 33], None, 2, 1, 20, False, (16, 1), 0.0),
    # causal, fewer queries than keys, left window just past a block edge, softcap + GQA
    "cross_causal_left17_softcap_d24": ([5, 18, 1], [37, 20, 16], 4, 2, 24, True, (17, -1), 2.0),
    # right-only window with more queries than keys: the first rows of a sequence see nothing
    "right_only_cross_d8": ([40, 2], [17, 0], 2, 2, 8, False, (-1, 0), 0.0),
}


@pytest.mark.parametrize("case", EDGE_CASES.values(), ids=EDGE_CASES.keys())
def test_edge_masks_with_lse_gradient_match_float64(case):
    lens_q, lens_k, heads, kv_heads, dim, causal, window, softcap = case
    lens_k = lens_q if lens_k is None else lens_k
    q, k, v, dout, dlse = _inputs(lens_q, lens_k, heads, kv_heads, dim)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    results = []
    for dtype in (torch.float32, torch.float64):
        leaves = [t.clone().to(dtype).requires_grad_() for t in (q, k, v)]
        if dtype == torch.float32:
            out, lse = triton_varlen_attention(
                *leaves, cu_q, cu_k, max(lens_q), max(lens_k), dim**-0.5, causal, window, softcap
            )
        else:
            out, lse = varlen_attention_reference(
                *leaves, cu_q, cu_k, dim**-0.5, causal, window, softcap
            )
        # the lse's gradient too (0 on keyless rows, whose lse has no gradient)
        dl = dlse.masked_fill(torch.isneginf(lse.detach()), 0.0).to(lse.dtype)
        torch.autograd.backward([out, lse], [dout.to(dtype), dl])
        results.append([out.detach(), lse.detach()] + [t.grad for t in leaves])
    _assert_close(*results)


def _reference_with_diff(q, k, v, lens_q, lens_k, diffs, scale, window, softcap):
    """float64 attention where query ``i`` of sequence ``b`` sits at key ``i + diffs[b]``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    cq, ck = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    outs, lses = [], []
    for b, d in enumerate(diffs):
        qs = q[cq[b] : cq[b + 1]].transpose(0, 1)
        ks, vs = (
            t[ck[b] : ck[b + 1]].transpose(0, 1).repeat_interleave(heads // kv_heads, 0)
            for t in (k, v)
        )
        s = qs @ ks.transpose(-1, -2) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(lens_q[b])[:, None] + d
        j = torch.arange(lens_k[b])[None, :]
        ok = torch.ones(lens_q[b], lens_k[b], dtype=torch.bool)
        if window[1] >= 0:
            ok &= j <= i + window[1]
        if window[0] >= 0:
            ok &= j >= i - window[0]
        s = s.masked_fill(~ok, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
        outs.append((p @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs, 0), torch.cat(lses, 1)


@pytest.mark.parametrize("window,softcap", [((3, 0), 0.0), ((17, 16), 2.0)])
def test_explicit_query_offsets_match_float64(window, softcap):
    """``diff`` (ring attention tiles): offsets below 0, past the keys and inside them."""
    lens_q, lens_k, diffs = [19, 11, 6, 20], [13, 17, 5, 33], [-9, 40, 2, 13]
    q, k, v, dout, _ = _inputs(lens_q, lens_k, 4, 2, 24, seed=3)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _reference_with_diff(*leaves, lens_q, lens_k, diffs, 0.3, window, softcap)
    ref[0].backward(dout)
    cu_q, cu_k, diff = _cu(lens_q), _cu(lens_k), torch.tensor(diffs, dtype=torch.int32)
    f32 = [t.float() for t in (q, k, v)]
    args = (cu_q, cu_k, max(lens_q), max(lens_k), 0.3, False, window, softcap)
    out, lse = varlen_attention_triton_forward(*f32, *args, diff=diff)
    grads = varlen_attention_triton_backward(dout.float(), *f32, out, lse, *args, diff=diff)
    _assert_close([out, lse, *grads], [ref[0].detach(), ref[1].detach()] + [t.grad for t in leaves])
