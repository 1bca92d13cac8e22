import pytest
import torch

from rlhf_kernels.ops import gae as gae_mod
from rlhf_kernels.ops.gae import discounted_returns, gae, reverse_scan
from rlhf_kernels.ops.gae import discounted_returns_reference as loop_returns
from rlhf_kernels.ops.gae import gae_reference as loop_gae


def _backends():
    out = ["torch", "triton"]
    if gae_mod._native_supports(torch.device("cpu")):
        out.append("native")
    return out


def _padded(B=5, T=67, dtype=torch.float64):
    r = torch.randn(B, T, dtype=dtype)
    v = torch.randn(B, T, dtype=dtype)
    lens = torch.randint(1, T + 1, (B,))
    mask = (torch.arange(T)[None] < lens[:, None]).to(dtype)
    return r, v, mask


@pytest.mark.parametrize("backend", _backends())
def test_reverse_scan_matches_loop(backend):
    x = torch.randn(3, 131)
    c = torch.rand(3, 131)
    c[:, 40] = 0.0
    ref = gae_mod.reverse_scan_loop(x.double(), c.double())
    out = reverse_scan(x, c, backend=backend)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_padded_matches_loop(backend, gamma, lam):
    r, v, mask = _padded()
    ref_a, ref_r = loop_gae(r, v, mask, gamma, lam)
    a, ret = gae(r.float(), v.float(), gamma=gamma, lam=lam, mask=mask.bool(), backend=backend)
    assert a.dtype == torch.float32
    torch.testing.assert_close(a.double(), ref_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.double(), ref_r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.8, 0.3)])
def test_gae_packed_matches_loop(backend, gamma, lam):
    lens = [7, 1, 30, 0, 29]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    N = sum(lens)
    r, v = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)
    a, ret = gae(r.float(), v.float(), gamma=gamma, lam=lam, cu_seqlens=cu, backend=backend)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e == s:
            continue
        one = torch.ones(1, e - s, dtype=torch.float64)
        ref_a, ref_r = loop_gae(r[None, s:e], v[None, s:e], one, gamma, lam)
        torch.testing.assert_close(a[s:e].double(), ref_a[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ret[s:e].double(), ref_r[0], atol=1e-5, rtol=1e-5)
    # discounted returns on the same layout
    g = discounted_returns(r.float(), gamma=gamma, cu_seqlens=cu, backend=backend)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e > s:
            ref = loop_returns(r[None, s:e], torch.ones(1, e - s, dtype=torch.float64), gamma)
            torch.testing.assert_close(g[s:e].double(), ref[0], atol=1e-5, rtol=1e-5)


def test_packed_with_mask_and_padded_agree():
    r, v, mask = _padded(B=4, T=23)
    lens = mask.sum(1).long()
    # right-padded rows packed back to back: same result on valid tokens
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    pr = torch.cat([r[i, : lens[i]] for i in range(4)])
    pv = torch.cat([v[i, : lens[i]] for i in range(4)])
    a_pad, _ = gae(r, v, gamma=0.97, lam=0.9, mask=mask)
    a_pack, _ = gae(pr, pv, gamma=0.97, lam=0.9, cu_seqlens=cu)
    torch.testing.assert_close(a_pack, torch.cat([a_pad[i, : lens[i]] for i in range(4)]))
    # an all-ones mask on the packed layout changes nothing; a zero mask zeroes the inputs
    a_m, _ = gae(pr, pv, gamma=0.97, lam=0.9, cu_seqlens=cu, mask=torch.ones_like(pr))
    torch.testing.assert_close(a_m, a_pack)


def test_discounted_returns_padded():
    r, _, mask = _padded()
    for backend in _backends():
        g = discounted_returns(r.float(), gamma=0.9, mask=mask, backend=backend)
        torch.testing.assert_close(g.double(), loop_returns(r, mask, 0.9), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends())
def test_gae_gradients_match_loop(backend):
    r, v, mask = _padded(B=3, T=31)
    r1, v1 = r.clone().requires_grad_(), v.clone().requires_grad_()
    r2, v2 = r.float().requires_grad_(), v.float().requires_grad_()
    w = torch.randn(3, 31, dtype=torch.float64)
    a, ret = loop_gae(r1, v1, mask, 0.95, 0.9)
    ((a + 0.5 * ret) * w).sum().backward()
    a2, ret2 = gae(r2, v2, gamma=0.95, lam=0.9, mask=mask, backend=backend)
    ((a2 + 0.5 * ret2) * w.float()).sum().backward()
    torch.testing.assert_close(r2.grad.double(), r1.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v2.grad.double(), v1.grad, atol=1e-5, rtol=1e-5)


def test_reverse_scan_coef_gradient():
    x = torch.randn(2, 19, dtype=torch.float64, requires_grad=True)
    c = (torch.rand(2, 19, dtype=torch.float64) * 0.9).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: reverse_scan(a, b, backend="torch"), (x, c))


def test_bf16_within_twice_torch_loop():
    r, v, mask = _padded(B=2, T=47, dtype=torch.float32)
    r, v = r.bfloat16(), v.bfloat16()  # the same rounded inputs for everyone
    a, ret = gae(r, v, gamma=0.99, lam=0.95, mask=mask)
    assert a.dtype == torch.bfloat16
    ref_a, ref_r = loop_gae(r.double(), v.double(), mask.double(), 0.99, 0.95)
    t_a, t_r = loop_gae(r, v, mask.bfloat16(), 0.99, 0.95)  # plain torch loop in bf16
    for ours, torch_bf16, ref in ((a, t_a, ref_a), (ret, t_r, ref_r)):
        err = (ours.double() - ref).abs().max()
        assert err <= 2 * (torch_bf16.double() - ref).abs().max()


def test_bad_input():
    r = torch.randn(10)
    with pytest.raises(ValueError, match="neither"):
        gae(r, r, gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\]"):
        gae(r, r, gamma=1.0, lam=1.0, cu_seqlens=torch.tensor([0, 4, 9]))
    with pytest.raises(ValueError, match="values must have rewards's shape"):
        gae(r, torch.randn(11), gamma=1.0, lam=1.0, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="mask must have"):
        gae(r.view(2, 5), r.view(2, 5), gamma=1.0, lam=1.0, mask=torch.ones(2, 6))
    with pytest.raises(ValueError, match="padded 2-D"):
        gae(r, r, gamma=1.0, lam=1.0, mask=torch.ones(10))
    with pytest.raises(ValueError, match="packed 1-D"):
        discounted_returns(r.view(2, 5), gamma=1.0, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(TypeError, match="rewards must be a float tensor"):
        discounted_returns(torch.ones(3, dtype=torch.long), gamma=1.0, mask=torch.ones(3))
    with pytest.raises(ValueError, match="backend must be one of"):
        discounted_returns(r, gamma=1.0, cu_seqlens=torch.tensor([0, 10]), backend="cuda")


@pytest.mark.gpu
def test_cuda_backends_match_loop():
    backends = ["torch", "triton"]
    if gae_mod._native_supports(torch.device("cuda")):
        backends.append("native")
    for B, T in [(3, 5003), (1, 40000)]:  # long rows: many blocks / many chunks per thread
        x = torch.randn(B, T, dtype=torch.float64)
        c = torch.rand(B, T, dtype=torch.float64) * 0.999
        c[:, ::997] = 0.0  # segment ends
        ref = gae_mod.reverse_scan_loop(x, c)
        for b in backends:
            out = reverse_scan(x.float().cuda(), c.float().cuda(), backend=b)
            torch.testing.assert_close(out.double().cpu(), ref, atol=1e-4, rtol=1e-4, msg=b)
    r, v, mask = _padded(B=6, T=301)
    ref_a, ref_r = loop_gae(r, v, mask, 0.99, 0.95)
    a, ret = gae(r.float().cuda(), v.float().cuda(), gamma=0.99, lam=0.95, mask=mask.cuda())
    torch.testing.assert_close(a.double().cpu(), ref_a, atol=1e-5, rtol=1e-5)


def _segmented(B, T, ends):
    x = torch.randn(B, T)
    c = torch.rand(B, T) * 0.5 + 0.5
    c[:, ends] = 0.0  # segment ends, inside and on the edges of 16-wide blocks
    return x, c


def test_triton_scan_carries_across_blocks():
    # block=16 on T=100: the row is walked in 7 blocks, segments cross block boundaries
    x, c = _segmented(3, 100, [5, 16, 37, 38, 83])
    ref = gae_mod.reverse_scan_loop(x.double(), c.double())
    out = gae_mod.reverse_scan_triton(x, c, block=16)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", _backends())
def test_split_scan_matches_loop(backend):
    # the chunked (many independent rows + carries) form used for long packed rows on CUDA
    x, c = _segmented(2, 101, [5, 15, 16, 37, 63, 64])
    ref = gae_mod.reverse_scan_loop(x.double(), c.double())
    out = gae_mod._split_scan(x, c, backend, 16)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    x, c = x[:1, :96], c[:1, :96]  # one row, T a multiple of the chunk
    ref = gae_mod.reverse_scan_loop(x.double(), c.double())
    out = gae_mod._split_scan(x, c, backend, 16)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
