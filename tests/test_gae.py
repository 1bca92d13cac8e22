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


def test_reverse_scan_half_precision_and_bad_input():
    """Half inputs are scanned in float32 and returned in their dtype (as documented: the torch
    backend used to scan in fp16, auto refused it in C++); bad input names the argument."""
    g = torch.Generator().manual_seed(3)
    x, c = torch.randn(3, 64, generator=g), torch.rand(3, 64, generator=g)
    ref = gae_mod.reverse_scan_loop(x.double(), c.double())
    for dtype in (torch.float16, torch.bfloat16):
        xh, ch = x.to(dtype), c.to(dtype)
        exact = gae_mod.reverse_scan_loop(xh.double(), ch.double())  # the rounded inputs' scan
        for backend in ("auto", "torch"):
            y = reverse_scan(xh, ch, backend=backend)
            assert y.dtype == dtype
            # only the output rounding remains: within one ulp of the exact scan
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(y.double(), exact, atol=1e-6, rtol=eps)
            assert (y.double() - ref).abs().max() < 0.1
    for args, match in (
        ((x[0], c[0]), r"x must be a \(B, T\) float tensor, got torch.float32 tensor of shape"),
        ((x, c[:, :3]), "coef must have x's shape"),
        ((x, c.double()), "and dtype torch.float32, got"),
        ((x.long(), c), "x must be a"),
    ):
        with pytest.raises(ValueError, match=match):
            reverse_scan(*args)


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


def test_mixed_dtypes_compute_in_the_wider_one():
    r, v, mask = _padded(B=3, T=29)
    r = r.float().double()  # float32-representable rewards
    ref_a, ref_r = gae(r, v, gamma=0.99, lam=0.95, mask=mask)
    for backend in ("auto", "torch"):
        a, ret = gae(r.float(), v, gamma=0.99, lam=0.95, mask=mask, backend=backend)
        assert a.dtype == ret.dtype == torch.float32
        # float64 values are not rounded to float32 before the recurrence: only the outputs are
        assert torch.equal(a, ref_a.float()) and torch.equal(ret, ref_r.float())
        a16, _ = gae(r.float(), v.half(), gamma=0.99, lam=0.95, mask=mask, backend=backend)
        want, _ = gae(r, v.half().double(), gamma=0.99, lam=0.95, mask=mask)
        torch.testing.assert_close(a16, want.float())


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
    with pytest.raises(
        ValueError, match=r"values must have rewards's shape \(2, 5\), got \(5, 2\)"
    ):
        gae(r.view(2, 5), r.view(5, 2), gamma=1.0, lam=1.0, mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="all tensors must be on the same device"):
        gae(r, r.to("meta"), gamma=1.0, lam=1.0, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="all tensors must be on the same device"):
        reverse_scan(r.view(2, 5), r.view(2, 5).to("meta"))


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


# ----------------------------------------------------------------------------- fused native op
def _fused_built(device="cpu"):
    return gae_mod._native_supports(torch.device(device), "fused_gae")


needs_fused = pytest.mark.skipif(not _fused_built(), reason="rlhf_kernels._C without fused_gae")


def _packed(lens, dtype=torch.float64, cu_dtype=torch.int64):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=cu_dtype)
    N = sum(lens)
    return torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype), cu


def _packed_reference(r, v, m, cu, gamma, lam):
    """Per-sequence loop reference on the packed layout (mask applied like the padded one)."""
    a, ret, g = torch.zeros_like(r), torch.zeros_like(r), torch.zeros_like(r)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        if e > s:
            ms = m[None, s:e] if m is not None else torch.ones(1, e - s, dtype=r.dtype)
            ra, rr = loop_gae(r[None, s:e], v[None, s:e], ms, gamma, lam)
            a[s:e], ret[s:e] = ra[0], rr[0]
            g[s:e] = loop_returns(r[None, s:e], ms, gamma)[0]
    return a, ret, g


@needs_fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_dtype", [torch.bool, "same", torch.float64, torch.int64])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0)])
def test_fused_padded_matches_loop(dtype, mask_dtype, gamma, lam):
    # B=7: two rows after the four-row interleaved block; holes in the mask too
    r, v, mask = _padded(B=7, T=61, dtype=dtype)
    mask[2, 5:9] = 0.0
    m = mask.to(dtype if mask_dtype == "same" else mask_dtype)
    ref_a, ref_r = loop_gae(r, v, mask, gamma, lam)
    a, ret = torch.ops.rlhf_kernels.fused_gae(r, v, m, None, gamma, lam)
    a2, ret2 = gae(r, v, gamma=gamma, lam=lam, mask=m)  # auto picks the fused op on CPU
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    for out in (a, ret, a2, ret2):
        assert out.dtype == dtype and out.shape == r.shape
    torch.testing.assert_close(a, ref_a, **tol)
    torch.testing.assert_close(ret, ref_r, **tol)
    torch.testing.assert_close(a2, a, atol=0, rtol=0)
    torch.testing.assert_close(ret2, ret, atol=0, rtol=0)
    g = discounted_returns(r, gamma=gamma, mask=m)
    torch.testing.assert_close(g, loop_returns(r, mask, gamma), **tol)
    g2 = torch.ops.rlhf_kernels.fused_returns(r, m, None, gamma)
    torch.testing.assert_close(g2, g, atol=0, rtol=0)


@needs_fused
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_mask", [False, True])
def test_fused_packed_matches_loop(dtype, cu_dtype, with_mask):
    r, v, cu = _packed([7, 1, 0, 300, 29, 0], dtype, cu_dtype)
    m = (torch.rand(r.shape[0]) > 0.2).to(dtype) if with_mask else None
    ref_a, ref_r, ref_g = _packed_reference(r, v, m, cu, 0.98, 0.9)
    a, ret = gae(r, v, gamma=0.98, lam=0.9, cu_seqlens=cu, mask=m, backend="native")
    g = discounted_returns(r, gamma=0.98, cu_seqlens=cu, mask=m, backend="native")
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(a, ref_a, **tol)
    torch.testing.assert_close(ret, ref_r, **tol)
    torch.testing.assert_close(g, ref_g, **tol)
    # the delta + scan path (torch backend) means the same thing
    a_t, ret_t = gae(r, v, gamma=0.98, lam=0.9, cu_seqlens=cu, mask=m, backend="torch")
    torch.testing.assert_close(a, a_t, **tol)
    torch.testing.assert_close(ret, ret_t, **tol)


@needs_fused
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_fused_gradients_match_loop(layout):
    if layout == "padded":
        r, v, mask = _padded(B=5, T=37)
        cu, m = None, mask
    else:
        r, v, cu = _packed([5, 0, 40, 1, 17])
        m = (torch.rand(r.shape[0]) > 0.3).double()
    w1, w2 = torch.randn_like(r), torch.randn_like(r)

    def loss(f, r, v):
        a, ret = f(r, v)
        return (a * w1).sum() + (ret * w2).sum(), (a * w1).sum()

    def ref(r, v):
        if cu is None:
            return loop_gae(r, v, m, 0.95, 0.9)
        a, ret = [], []
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            if e > s:
                ra, rr = loop_gae(r[None, s:e], v[None, s:e], m[None, s:e], 0.95, 0.9)
                a.append(ra[0])
                ret.append(rr[0])
        return torch.cat(a), torch.cat(ret)

    def ours(r, v):
        return gae(r, v, gamma=0.95, lam=0.9, cu_seqlens=cu, mask=m, backend="native")

    for which in (0, 1):  # both outputs used; only the advantages (returns' gradient is None)
        r1, v1 = r.clone().requires_grad_(), v.clone().requires_grad_()
        r2, v2 = r.clone().requires_grad_(), v.clone().requires_grad_()
        loss(ref, r1, v1)[which].backward()
        loss(ours, r2, v2)[which].backward()
        torch.testing.assert_close(r2.grad, r1.grad, atol=1e-12, rtol=1e-12)
        torch.testing.assert_close(v2.grad, v1.grad, atol=1e-12, rtol=1e-12)
    # discounted returns
    r1, r2 = r.clone().requires_grad_(), r.clone().requires_grad_()
    if cu is None:
        (loop_returns(r1, m, 0.9) * w1).sum().backward()
    else:
        g = torch.cat(
            [
                loop_returns(r1[None, s:e], m[None, s:e], 0.9)[0]
                for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())
                if e > s
            ]
        )
        (g * w1).sum().backward()
    (discounted_returns(r2, gamma=0.9, cu_seqlens=cu, mask=m) * w1).sum().backward()
    torch.testing.assert_close(r2.grad, r1.grad, atol=1e-12, rtol=1e-12)


@needs_fused
def test_fused_opcheck_and_compile():
    # schema, fake (meta) implementation, autograd registration, torch.compile tracing
    r, v, mask = _padded(B=3, T=20, dtype=torch.float32)
    r.requires_grad_()
    v.requires_grad_()
    cu = torch.tensor([0, 5, 5, 20], dtype=torch.int32)
    ops = torch.ops.rlhf_kernels
    cases = [
        (ops.fused_gae.default, (r, v, mask.bool(), None, 0.9, 0.8)),
        (ops.fused_gae.default, (r[0], v[0], None, cu, 0.9, 0.8)),
        (ops.fused_returns.default, (r, mask, None, 0.9)),
        (ops.fused_returns.default, (r[0], None, cu, 0.9)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)
    f = torch.compile(
        lambda r, v, m: gae(r, v, gamma=0.9, lam=0.8, mask=m), backend="eager", fullgraph=True
    )
    a, ret = f(r, v, mask)
    ref_a, ref_r = loop_gae(r.detach().double(), v.detach().double(), mask.double(), 0.9, 0.8)
    torch.testing.assert_close(a.detach().double(), ref_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.detach().double(), ref_r, atol=1e-5, rtol=1e-5)


@needs_fused
def test_fused_half_noncontiguous_and_fallbacks():
    r, v, mask = _padded(B=6, T=33, dtype=torch.float32)
    # half precisions: read as they are, computed in float32, rounded once at the end
    for dt in (torch.bfloat16, torch.float16):
        rh, vh = r.to(dt), v.to(dt)
        ref_a, ref_r = loop_gae(rh.float(), vh.float(), mask, 0.99, 0.95)
        for m in (mask, mask.bool(), mask.to(dt)):
            a, ret = gae(rh, vh, gamma=0.99, lam=0.95, mask=m)
            assert a.dtype == ret.dtype == dt
            # (bit-equal on x86-64; the tolerance allows an FMA-contracting compiler one ulp)
            torch.testing.assert_close(a, ref_a.to(dt))
            torch.testing.assert_close(ret, ref_r.to(dt))
    # non-contiguous inputs (a transposed view)
    rt, vt = r.t().contiguous().t(), v.t().contiguous().t()
    assert not rt.is_contiguous()
    torch.testing.assert_close(
        gae(rt, vt, gamma=0.9, lam=0.9, mask=mask), gae(r, v, gamma=0.9, lam=0.9, mask=mask)
    )
    # values in another dtype, or a mask that wants a gradient: the delta + scan path
    a, _ = gae(r, v.double(), gamma=0.9, lam=0.9, mask=mask)
    torch.testing.assert_close(a, gae(r, v, gamma=0.9, lam=0.9, mask=mask)[0])
    mg = mask.clone().requires_grad_()
    a, ret = gae(r, v, gamma=0.9, lam=0.9, mask=mg)
    (a.sum() + ret.sum()).backward()
    # the mask's gradient is the product's (r * m, v * m), as the loop on masked inputs gives
    m64 = mask.double().requires_grad_()
    r64, v64 = r.detach().double(), v.detach().double()
    ref_a, ref_r = loop_gae(r64 * m64, v64 * m64, torch.ones_like(m64), 0.9, 0.9)
    (ref_a.sum() + ref_r.sum()).backward()
    assert m64.grad.abs().max() > 0
    torch.testing.assert_close(mg.grad.double(), m64.grad, atol=1e-4, rtol=1e-4)


@needs_fused
def test_fused_op_errors():
    ops = torch.ops.rlhf_kernels
    r = torch.randn(2, 5)
    with pytest.raises(RuntimeError, match="values must have shape"):
        ops.fused_gae(r, torch.randn(2, 6), None, None, 0.9, 0.9)
    with pytest.raises(RuntimeError, match="padded 2-D"):
        ops.fused_gae(r[0], r[0], None, None, 0.9, 0.9)
    with pytest.raises(RuntimeError, match="mask must have"):
        ops.fused_returns(r, torch.ones(2, 4), None, 0.9)
    with pytest.raises(RuntimeError, match=r"cu_seqlens\[-1\]"):
        ops.fused_returns(r[0], None, torch.tensor([0, 4]), 0.9)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        ops.fused_returns(r[0], None, torch.tensor([0, 4, 3, 5]), 0.9)


@pytest.mark.gpu
def test_fused_cuda_matches_cpu():
    if not _fused_built("cuda"):
        pytest.skip("rlhf_kernels._C built without the CUDA fused ops")
    ops = torch.ops.rlhf_kernels
    # padded: short rows, rows over several 1024-token tiles, and the bench shape
    for B, T in [(6, 301), (3, 5003), (64, 1024), (1, 40000)]:
        r, v, mask = _padded(B=B, T=T)
        mask[0, 3:7] = 0.0
        for dt, tol in [(torch.float64, 1e-10), (torch.float32, 2e-4)]:
            ref_a, ref_r = loop_gae(r, v, mask, 0.99, 0.95) if T < 2000 else (None, None)
            if ref_a is None:
                ref_a, ref_r = ops.fused_gae(r, v, mask, None, 0.99, 0.95)
            for m in (mask.cuda(), mask.bool().cuda()):
                a, ret = gae(r.to(dt).cuda(), v.to(dt).cuda(), gamma=0.99, lam=0.95, mask=m)
                torch.testing.assert_close(a.double().cpu(), ref_a, atol=tol, rtol=tol)
                torch.testing.assert_close(ret.double().cpu(), ref_r, atol=tol, rtol=tol)
            g = discounted_returns(r.to(dt).cuda(), gamma=0.99, mask=mask.cuda())
            ref_g = ops.fused_returns(r, mask, None, 0.99)
            torch.testing.assert_close(g.double().cpu(), ref_g, atol=tol * 10, rtol=tol)
    # packed: empty, one-token and multi-tile sequences, int32 and int64 cu_seqlens, a mask
    for cu_dtype in (torch.int32, torch.int64):
        r, v, cu = _packed([7, 1, 0, 3000, 29, 0, 1025, 1024], cu_dtype=cu_dtype)
        m = (torch.rand(r.shape[0]) > 0.2).double()
        ref_a, ref_r = ops.fused_gae(r, v, m, cu, 0.98, 0.9)
        ref_g = ops.fused_returns(r, m, cu, 0.98)
        a, ret = gae(r.cuda(), v.cuda(), gamma=0.98, lam=0.9, cu_seqlens=cu.cuda(), mask=m.cuda())
        g = discounted_returns(r.cuda(), gamma=0.98, cu_seqlens=cu.cuda(), mask=m.cuda())
        torch.testing.assert_close(a.cpu(), ref_a, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ret.cpu(), ref_r, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(g.cpu(), ref_g, atol=1e-10, rtol=1e-10)
        # gradients against the CPU op, both outputs and advantages only
        w = torch.randn_like(r)
        for both in (True, False):
            grads = []
            for dev in ("cpu", "cuda"):
                rr = r.detach().to(dev).requires_grad_()
                vv = v.detach().to(dev).requires_grad_()
                a, ret = gae(rr, vv, gamma=0.98, lam=0.9, cu_seqlens=cu.to(dev), mask=m.to(dev))
                wd = w.to(dev)
                ((a * wd).sum() + ((ret * wd).sum() if both else 0)).backward()
                grads.append((rr.grad.cpu(), vv.grad.cpu()))
            torch.testing.assert_close(grads[1], grads[0], atol=1e-10, rtol=1e-10)
        rr = r.cuda().requires_grad_()
        discounted_returns(rr, gamma=0.98, cu_seqlens=cu.cuda(), mask=m.cuda()).mul(
            w.cuda()
        ).sum().backward()
        r0 = r.clone().requires_grad_()
        (ops.fused_returns(r0, m, cu, 0.98) * w).sum().backward()
        torch.testing.assert_close(rr.grad.cpu(), r0.grad, atol=1e-10, rtol=1e-10)
    # half precision: the same rounded result as the CPU op (both compute in float32)
    r, v, mask = _padded(B=4, T=2100, dtype=torch.float32)
    rb, vb = r.bfloat16(), v.bfloat16()
    a_c, _ = ops.fused_gae(rb, vb, mask.bool(), None, 0.99, 0.95)
    a_g, _ = gae(rb.cuda(), vb.cuda(), gamma=0.99, lam=0.95, mask=mask.bool().cuda())
    torch.testing.assert_close(a_g.cpu().float(), a_c.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_junk_at_masked_tokens_stays_out(backend):
    """NaN / inf at pads (torch.empty buffers) made every valid advantage NaN (NaN * 0)."""
    mask = torch.tensor([[1, 1, 1, 0, 0]])
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0, float("nan")]])
    v = torch.tensor([[0.1, 0.2, 0.3, float("inf"), 0.0]])
    adv, ret = gae(r, v, gamma=1.0, lam=1.0, mask=mask, backend=backend)
    torch.testing.assert_close(adv[0, :3], torch.tensor([0.9, 0.8, 0.7]))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    g = discounted_returns(r, gamma=1.0, mask=mask, backend=backend)
    assert g[0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    ref_adv, _ = loop_gae(r, v, mask, 1.0, 1.0)
    torch.testing.assert_close(ref_adv, adv)


@pytest.mark.parametrize("backend", ["auto", *_backends()])
def test_a_non_finite_sample_stays_in_its_sequence(backend):
    """An inf reward in one packed sequence made the one before it NaN on the scan paths
    (its boundary is a 0 coefficient, and 0 * inf is NaN); the fused op kept it out."""
    r, v, cu = torch.tensor([1.0, 2.0, float("inf"), 3.0]), torch.zeros(4), [0, 2, 3, 4]
    for dtype in (torch.float32, torch.float64)[: 1 if backend == "triton" else 2]:
        rr, vv = r.to(dtype), v.to(dtype)
        adv, ret = gae(rr, vv, gamma=0.9, lam=0.9, cu_seqlens=cu, backend=backend)
        g = discounted_returns(rr, gamma=0.9, cu_seqlens=cu, backend=backend)
        for out, first in ((adv, 1 + 0.81 * 2), (ret, 1 + 0.81 * 2), (g, 1 + 0.9 * 2)):
            assert out[[0, 1, 3]].tolist() == pytest.approx([first, 2.0, 3.0]), out
            assert out[2] == float("inf")
    # lam = 0 / gamma = 0 inside one sequence: the fused op gave NaN (0 * inf), the scan not
    r = torch.tensor([1.0, 2.0, float("inf"), 4.0])
    adv, _ = gae(r, torch.zeros(4), gamma=0.9, lam=0.0, cu_seqlens=[0, 4], backend=backend)
    g = discounted_returns(r[None], gamma=0.0, mask=torch.ones(1, 4), backend=backend)[0]
    assert adv.tolist() == g.tolist() == r.tolist()
    x = torch.tensor([[1.0, 2.0, float("nan"), 4.0]] * 2)
    c = torch.tensor([[0.5, 0.0, 0.5, 0.0]] * 2)
    want = torch.tensor([2.0, 2.0, float("nan"), 4.0])
    scans = [gae_mod.reverse_scan_loop, gae_mod.reverse_scan_torch]
    scans += [lambda x, c, b=b: gae_mod._split_scan(x, c, b, 2) for b in _backends()]
    scans += [lambda x, c, b=b: reverse_scan(x, c, b) for b in _backends()]
    for scan in scans:
        torch.testing.assert_close(scan(x, c)[0], want, equal_nan=True)


@pytest.mark.parametrize("backend", ["auto", *_backends()])
def test_empty_streams(backend):
    """Padded (B, 0) crashed the scan path (IndexError); compiled, an empty packed stream
    failed to trace (its end marker had length 1)."""
    with pytest.raises(ValueError, match="backend='triton' scans in float32"):
        gae(
            torch.zeros(3).double(),
            torch.zeros(3),
            gamma=1,
            lam=1,
            cu_seqlens=[0, 3],
            backend="triton",
        )
    z, m = torch.zeros(2, 0), torch.ones(2, 0)
    adv, ret = gae(z, z, gamma=0.9, lam=0.9, mask=m, backend=backend)
    assert adv.shape == ret.shape == (2, 0)
    assert discounted_returns(z, gamma=0.9, mask=m, backend=backend).shape == (2, 0)
    if backend != "auto":
        return
    torch._dynamo.reset()
    f = torch.compile(
        lambda r, cu: gae(r, r, gamma=0.9, lam=0.8, cu_seqlens=cu)[0], backend="eager",
        fullgraph=True,
    )  # fmt: skip
    assert f(torch.zeros(0), torch.tensor([0, 0])).shape == (0,)
