"""Audit of the native GAE / reverse-scan ops (csrc/gae.cpp, csrc/reverse_scan.cpp) and their
fake implementations: fake and real agree on strides, the fused backward selects at masked
tokens as the forward does, and the op-level argument checks hold."""

from __future__ import annotations

import pytest
import torch

from rlhf_kernels.ops import gae as gae_mod
from rlhf_kernels.ops.gae import discounted_returns, gae

ops = torch.ops.rlhf_kernels
needs_native = pytest.mark.skipif(not gae_mod._HAS_NATIVE, reason="rlhf_kernels._C not built")
needs_fused = pytest.mark.skipif(not gae_mod._HAS_FUSED, reason="rlhf_kernels._C not built")
NAN, INF = float("nan"), float("inf")


@needs_native
def test_reverse_scan_fake_is_contiguous_like_the_real_op():
    # the real op returns a contiguous tensor; the fake used empty_like, which keeps a
    # transposed input's strides (opcheck: "Stride mismatch")
    x = torch.randn(6, 5, dtype=torch.float64).t()
    c = torch.rand(6, 5, dtype=torch.float64).t()
    torch.library.opcheck(ops.reverse_scan.default, (x, c), test_utils="test_faketensor")
    assert ops.reverse_scan(x, c).is_contiguous()


@needs_fused
@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float64, torch.int64])
def test_fused_backward_keeps_non_finite_gradients_out_of_masked_tokens(mask_dtype):
    # a NaN / inf upstream gradient at padding: d rewards and d values there are 0 (the forward
    # selects, so the padding does not reach the outputs), as on the delta + scan path; the
    # native backward multiplied by the mask (NaN * 0 = NaN)
    m = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0]]).to(mask_dtype)
    g = torch.tensor([[1.0, 2.0, 3.0, NAN, INF], [1.0, 2.0, 3.0, 4.0, NAN]], dtype=torch.float64)
    grads = {}
    for be in ("native", "torch"):
        r = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
        a, ret = gae(r, v, mask=m, gamma=0.9, lam=0.8, backend=be)
        (a * g).sum().backward()
        r2 = r.detach().clone().requires_grad_()
        (discounted_returns(r2, mask=m, gamma=0.9, backend=be) * g).sum().backward()
        grads[be] = (r.grad, v.grad, r2.grad)
    off = m == 0
    for n, t in zip(("d rewards", "d values", "d returns' rewards"), grads["native"]):
        assert (t[off] == 0).all(), (n, t)
    # row 0 ends in padding: its real tokens' gradients stay finite and match the scan path
    for got, want in zip(grads["native"], grads["torch"]):
        torch.testing.assert_close(got[0], want[0])
    dr, dv = ops.fused_gae_backward(g, None, m, None, 0.9, 0.8)
    assert (dr[off] == 0).all() and (dv[off] == 0).all()


@needs_fused
def test_fused_backward_lam_zero_keeps_an_inf_gradient_local():
    # c = gamma * lam = 0: gx[t] = ga[t] + gr[t], nothing earlier reaches it (0 * inf = NaN)
    g = torch.tensor([[INF, 1.0, 2.0, 3.0]], dtype=torch.float64)
    dr, dv = ops.fused_gae_backward(g, None, None, None, 0.9, 0.0)
    torch.testing.assert_close(dr[0, 1:], g[0, 1:])
    assert dr[0, 0] == INF
    dr = ops.fused_returns_backward(g, None, None, 0.0)
    torch.testing.assert_close(dr, g)


@needs_fused
@pytest.mark.parametrize("gamma,lam", [(0.0, 0.5), (1.0, 1.0), (0.93, 0.0), (0.9, 0.8)])
def test_fused_backward_ops_opcheck_and_match_autograd(gamma, lam):
    torch.manual_seed(0)
    m = torch.rand(5, 9) > 0.3
    ga, gr = torch.randn(5, 9, dtype=torch.float64), torch.randn(5, 9, dtype=torch.float64)
    cu = torch.tensor([0, 0, 4, 5, 5, 12], dtype=torch.int32)
    cases = [
        (ops.fused_gae_backward.default, (ga.t(), None, None, None, gamma, lam)),
        (ops.fused_gae_backward.default, (None, gr, m, None, gamma, lam)),
        (
            ops.fused_gae_backward.default,
            (ga.reshape(-1)[:12], gr.reshape(-1)[:12], m.reshape(-1)[:12], cu, gamma, lam),
        ),
        (ops.fused_returns_backward.default, (ga.t(), m.t(), None, gamma)),
        (ops.fused_returns_backward.default, (ga.reshape(-1)[:12], None, cu, gamma)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    # the backward op is the adjoint of the forward: compare with autograd of the torch path
    for mask, gs in ((m, (ga, gr)), (None, (None, gr)), (m.double(), (ga, None))):
        r = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
        v = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
        mm = torch.ones(5, 9, dtype=torch.bool) if mask is None else mask
        a, ret = gae(r, v, mask=mm, gamma=gamma, lam=lam, backend="torch")
        loss = sum((o * w).sum() for o, w in zip((a, ret), gs) if w is not None)
        loss.backward()
        dr, dv = ops.fused_gae_backward(*gs, mask, None, gamma, lam)
        torch.testing.assert_close(dr, r.grad)
        torch.testing.assert_close(dv, v.grad)


@needs_fused
def test_fused_op_level_checks():
    # the op validates what the Python wrapper would (it is callable directly): no OOB reads
    r = torch.randn(6, dtype=torch.float64)
    with pytest.raises(RuntimeError, match=r"cu_seqlens\[0\] must be 0"):
        ops.fused_gae(r, r, None, torch.tensor([1, 6]), 0.9, 0.9)
    with pytest.raises(RuntimeError, match="int32 or int64"):
        ops.fused_returns(r, None, torch.tensor([0.0, 6.0]), 0.9)
    with pytest.raises(RuntimeError, match="packed 1-D"):
        ops.fused_returns(r[None], None, torch.tensor([0, 6]), 0.9)
    g = torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="grad_ret must have shape"):
        ops.fused_gae_backward(g, g[:, :2], None, None, 0.9, 0.9)
    with pytest.raises(RuntimeError, match="grad_ret dtype"):
        ops.fused_gae_backward(g, g.float(), None, None, 0.9, 0.9)
    with pytest.raises(RuntimeError, match="mask must have"):
        ops.fused_gae_backward(g, None, torch.ones(2, 4), None, 0.9, 0.9)
    with pytest.raises(RuntimeError, match=r"cu_seqlens\[-1\]"):
        ops.fused_returns_backward(r, None, torch.tensor([0, 7]), 0.9)


@needs_fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("mask_dtype", [torch.uint8, torch.int32, torch.float16, torch.float32])
def test_fused_mask_dtypes_read_as_the_bool_mask(dtype, mask_dtype):
    # every mask dtype branch (bool, the input dtype, the compute dtype, converted) is one mask
    torch.manual_seed(1)
    r, v = torch.randn(5, 11).to(dtype), torch.randn(5, 11).to(dtype)
    m = torch.rand(5, 11) > 0.4
    want = ops.fused_gae(r, v, m, None, 0.9, 0.7)
    got = ops.fused_gae(r, v, m.to(mask_dtype), None, 0.9, 0.7)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    g = torch.randn(5, 11).to(dtype)
    for x, y in zip(
        ops.fused_gae_backward(g, g, m.to(mask_dtype), None, 0.9, 0.7),
        ops.fused_gae_backward(g, g, m, None, 0.9, 0.7),
    ):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


@needs_fused
def test_fused_many_rows_in_parallel_match_the_scan_path():
    # enough work for at::parallel_for to split the rows (the 4-row interleave and its tail)
    torch.manual_seed(2)
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        r, v = torch.randn(39, 700, dtype=torch.float64), torch.randn(39, 700, dtype=torch.float64)
        m = torch.rand(39, 700) > 0.2
        a, ret = ops.fused_gae(r, v, m, None, 0.99, 0.95)
        lens = torch.randint(0, 90, (301,))
        cu = torch.cat([lens.new_zeros(1), lens.cumsum(0)])
        rp = torch.randn(int(cu[-1]), dtype=torch.float64)
        g = ops.fused_returns(rp, None, cu, 0.97)
    finally:
        torch.set_num_threads(prev)
    ref_a, ref_r = gae(r, v, mask=m, gamma=0.99, lam=0.95, backend="torch")
    torch.testing.assert_close(a, ref_a)
    torch.testing.assert_close(ret, ref_r)
    torch.testing.assert_close(
        g, discounted_returns(rp, cu_seqlens=cu, gamma=0.97, backend="torch")
    )
