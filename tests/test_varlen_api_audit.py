"""varlen_attention's public API: double backward, option types, dropout on every torch path,
the backend choice on CUDA, the lse gradient of keyless rows and flash-attn's window rule."""

import sys
import types
import warnings

import numpy as np
import pytest
import torch

from rlhf_kernels.ops import varlen_attention as va
from rlhf_kernels.ops.varlen_attention import (
    resolve_backend,
    varlen_attention,
    varlen_attention_reference,
)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _leaves(lens_q, lens_k, heads=2, kv_heads=1, dim=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    shapes = ((sum(lens_q), heads, dim), (sum(lens_k), kv_heads, dim), (sum(lens_k), kv_heads, dim))
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def _fake_flash_attn(monkeypatch, flash_attn_varlen_func):
    """Install a stand-in ``flash_attn`` module and make the flash backend look available."""
    monkeypatch.setitem(
        sys.modules,
        "flash_attn",
        types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func),
    )
    monkeypatch.setattr(va, "_is_cuda", lambda t: True)
    monkeypatch.setattr(va, "_flash_attn_available", lambda: True)


# ----------------------------------------------------------------------------- double backward
def test_triton_double_backward_raises_instead_of_dropping_its_terms():
    """The Triton backward is not differentiable: with create_graph=True its gradients had no
    graph, so a gradient penalty through them silently lost the attention's second-order part
    (the torch backend keeps it). A penalty that does not pass through them still works."""
    cu = _cu([3, 4])
    q, k, v = _leaves([3, 4], [3, 4])
    out = varlen_attention(q, k, v, cu, cu, causal=True, backend="triton")
    (gq,) = torch.autograd.grad((out**2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad((gq**2).sum() + (q**2).sum(), q)

    w = torch.randn(8, 8, dtype=torch.float32, requires_grad=True)  # second order in w alone
    for backend in ("torch", "triton"):
        out = varlen_attention(q, k, v, cu, cu, causal=True, backend=backend)
        gw, gq = torch.autograd.grad((out @ w).pow(2).sum(), (w, q), create_graph=True)
        (hw,) = torch.autograd.grad(gw.pow(2).sum(), w)  # gq built a graph, unused here
        if backend == "torch":
            want = hw
    torch.testing.assert_close(hw, want, rtol=1e-4, atol=1e-4)


def test_ring_double_backward_raises_instead_of_dropping_its_terms():
    """Ring attention's backward (block kernels, collectives) is not differentiable either: with
    create_graph=True its gradients were silently wrong in second order (a partial graph through
    the torch tiles)."""
    from rlhf_kernels.ring.attention import ring_varlen_attention
    from rlhf_kernels.ring.plan import RingPlan

    plan = RingPlan.build(_cu([3, 4]), 1)
    q, k, v = _leaves([3, 4], [3, 4])
    out = ring_varlen_attention(q, k, v, plan)
    (gq,) = torch.autograd.grad((out**2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="ring_varlen_attention is differentiable once"):
        torch.autograd.grad((gq**2).sum(), q)
    ref = ring_varlen_attention(q, k, v, plan)  # first order unchanged by create_graph
    (g1,) = torch.autograd.grad((ref**2).sum(), q)
    torch.testing.assert_close(gq.detach(), g1)


# ----------------------------------------------------------------------------- option types
@pytest.mark.parametrize("flag", [True, np.bool_(True), torch.tensor(True)])
def test_max_seqlen_bool_is_refused(flag):
    """A bool is no length: True passed as max_seqlen_q (1) was taken silently."""
    q, k, v = _leaves([1, 1], [1, 1])
    with pytest.raises(TypeError, match="max_seqlen_q must be an int or None, got"):
        varlen_attention(q, k, v, _cu([1, 1]), _cu([1, 1]), max_seqlen_q=flag)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int or None, got"):
        varlen_attention(q, k, v, _cu([1, 1]), _cu([1, 1]), 1, flag)


# ----------------------------------------------------------------------------- dropout
@pytest.mark.parametrize(
    "path", ["fused_sdpa", "explicit_fp32_grad", "per_sequence_lse", "per_sequence_cross"]
)
def test_dropout_applies_on_every_torch_path(path):
    """Each path of the torch backend drops probabilities (unbiased: the mean over draws is the
    output without dropout); before, only the fused path was checked."""
    lens_q, lens_k = ([5, 3], [5, 3]) if path != "per_sequence_cross" else ([3, 2], [5, 4])
    q, k, v = _leaves(lens_q, lens_k)
    kw = dict(causal=True, backend="torch", return_lse=path == "per_sequence_lse")
    grad = path == "explicit_fp32_grad"

    def call(p):
        with torch.set_grad_enabled(grad):
            res = varlen_attention(q, k, v, _cu(lens_q), _cu(lens_k), dropout_p=p, **kw)
        return (res[0] if kw["return_lse"] else res).detach()

    plain = call(0.0)
    torch.manual_seed(0)
    draws = torch.stack([call(0.5) for _ in range(300)])
    assert not torch.allclose(draws[0], plain)
    standard_error = draws.std(0) / 300**0.5
    assert ((draws.mean(0) - plain).abs() <= 5 * standard_error + 1e-4).all()


# ----------------------------------------------------------------------------- backend choice
def test_auto_backend_on_cuda_follows_dtype_and_dropout(monkeypatch):
    monkeypatch.setattr(va, "_is_cuda", lambda t: True)
    monkeypatch.setattr(va, "_WARNED", set())
    f64, f32, f16 = (
        torch.zeros(1, 1, 1, dtype=d) for d in (torch.float64, torch.float32, torch.float16)
    )
    monkeypatch.setattr(va, "_flash_attn_available", lambda: False)
    assert resolve_backend("auto", f64, 0.0) == "torch"  # Triton takes no float64
    assert resolve_backend("auto", f32, 0.0) == "triton"
    assert resolve_backend("auto", f16, 0.0) == "triton"
    with pytest.warns(UserWarning, match="'torch' backend runs"):
        assert resolve_backend("auto", f16, 0.1) == "torch"
    monkeypatch.setattr(va, "_flash_attn_available", lambda: True)
    assert resolve_backend("auto", f16, 0.1) == "flash_attn"
    assert resolve_backend("auto", f32, 0.0) == "triton"  # flash-attn takes no fp32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dropout warning is given once per process
        assert resolve_backend("auto", f32, 0.1) == "torch"


# ----------------------------------------------------------------------------- lse gradient
def test_triton_ignores_a_nan_lse_gradient_on_keyless_rows():
    """A query that sees no key has lse -inf; losses over such lse (logaddexp of two -inf,
    the where(-inf) idiom) give it a NaN gradient. It must not reach dq/dk/dv: the rows have
    no probabilities (the torch backend's autograd drops it too)."""
    lens_q, lens_k = [4, 2, 3], [2, 0, 3]  # causal 4 on 2: two keyless rows; lk = 0: two more
    grads = {}
    for backend in ("torch", "triton"):
        q, k, v = _leaves(lens_q, lens_k, heads=2, kv_heads=2)
        out, lse = varlen_attention(
            q, k, v, _cu(lens_q), _cu(lens_k), causal=True, return_lse=True, backend=backend
        )
        merged = torch.logaddexp(lse, lse)  # NaN gradient where lse is -inf
        keep = torch.where(torch.isinf(merged), 0.0, merged)
        (out.sum() + keep.sum()).backward()
        grads[backend] = [t.grad for t in (q, k, v)]
    assert torch.isneginf(lse).any()
    for name, a, r in zip("qkv", grads["triton"], grads["torch"]):
        assert torch.isfinite(a).all(), f"d{name} has NaN"
        torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4, msg=f"d{name}")


# ----------------------------------------------------------------------------- flash-attn window
def test_flash_attn_gets_a_max_seqlen_k_that_keeps_a_bounded_right_side(monkeypatch):
    """flash-attn unbounds a window side >= its max_seqlen_k. The caller's max_seqlen_k (5)
    keeps right = 2 bounded on 8 queries over 2 keys, so flash-attn must be given more than 2,
    not the longest key sequence (2), or the first 4 rows would see every key."""

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, **kw):
        window = tuple(-1 if w >= max_k else w for w in window_size)  # flash-attn's rule
        out, lse = varlen_attention_reference(
            q, k, v, cu_q, cu_k, kw["softmax_scale"], kw["causal"], window, kw["softcap"], True
        )
        return (out, lse, None) if kw["return_attn_probs"] else out

    _fake_flash_attn(monkeypatch, flash_attn_varlen_func)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 1, 8, generator=g, dtype=torch.float16) for n in (8, 2, 2))
    cu_q, cu_k = _cu([8]), _cu([2])
    kw = dict(window_size=(-1, 2), return_lse=True)
    out, lse = varlen_attention(q, k, v, cu_q, cu_k, 8, 5, backend="flash_attn", **kw)
    ref, ref_lse = varlen_attention(q.float(), k.float(), v.float(), cu_q, cu_k, 8, 5, **kw)
    assert (out[:4] == 0).all() and torch.isneginf(lse[:, :4]).all()
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse, ref_lse, rtol=2e-3, atol=2e-3)


# ----------------------------------------------------------------------------- triton wrapper
def test_triton_takes_non_contiguous_inputs():
    """Views with a head-major layout, a strided last dim and a permuted layout give the
    float64 reference's output and gradients (the kernels assume unit head_dim stride)."""
    from rlhf_kernels.ops.varlen_attention_triton import triton_varlen_attention

    g = torch.Generator().manual_seed(1)
    lens_q, lens_k = [5, 3], [4, 6]
    q = torch.randn(2, 8, 24, generator=g, dtype=torch.float64).transpose(0, 1)
    k = torch.randn(10, 1, 48, generator=g, dtype=torch.float64)[..., ::2]
    v = torch.randn(24, 10, 1, generator=g, dtype=torch.float64).permute(1, 2, 0)
    assert not any(t.is_contiguous() for t in (q, k, v))
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    # fp32 leaves with the same layouts (float() of a view is contiguous)
    qf = torch.zeros(2, 8, 24).transpose(0, 1).copy_(q.float()).requires_grad_()
    kf = torch.zeros(10, 1, 48)[..., ::2].copy_(k.float()).requires_grad_()
    vf = torch.zeros(24, 10, 1).permute(1, 2, 0).copy_(v.float()).requires_grad_()
    assert not any(t.is_contiguous() for t in (qf, kf, vf))
    out, lse = triton_varlen_attention(qf, kf, vf, cu_q, cu_k, 5, 6, 0.3, True, (2, -1), 0.0)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = varlen_attention_reference(*full, cu_q, cu_k, 0.3, True, (2, -1))
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    out.backward(dout.float())
    ref.backward(dout)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    for name, a, r in zip("qkv", (qf, kf, vf), full):
        torch.testing.assert_close(a.grad.double(), r.grad, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("window", [(0, 2**31 - 1), (2**31 - 40, 3), (2**30, 2**30)])
def test_triton_direct_call_treats_huge_window_sides_as_unbounded(window):
    """varlen_attention unbounds sides >= max_seqlen_k before the kernels; direct callers of
    triton_varlen_attention (ring attention's pieces) rely on the wrapper's own cap instead."""
    from rlhf_kernels.ops.varlen_attention_triton import triton_varlen_attention

    g = torch.Generator().manual_seed(0)
    cu = _cu([20, 9])
    q, k, v = (torch.randn(29, 2, 16, generator=g, dtype=torch.float64) for _ in range(3))
    out, lse = triton_varlen_attention(
        q.float(), k.float(), v.float(), cu, cu, 20, 20, 0.25, False, window, 0.0
    )
    unbounded = tuple(-1 if w >= 2**30 else w for w in window)
    ref, ref_lse = varlen_attention_reference(q, k, v, cu, cu, 0.25, False, unbounded)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- window sides
def test_huge_negative_window_side_is_unbounded_on_every_path(monkeypatch):
    """A negative side is unbounded; one below int64 (or int32, flash-attn's argument) crashed
    the traced op with a fake-tensor error and reached flash-attn as is. It becomes -1."""
    window = (-(2**70), 0)
    assert va._window_pair(window) == va._window_pair((-5, 0)) == (-1, 0)
    cu = _cu([3, 4])
    q = torch.randn(7, 2, 8)
    want = varlen_attention(q, q, q, cu, cu, window_size=(-1, 0), backend="torch")
    eager = varlen_attention(q, q, q, cu, cu, window_size=window, backend="torch")
    torch.testing.assert_close(eager, want, rtol=0, atol=0)
    torch._dynamo.reset()
    traced = torch.compile(
        lambda q: varlen_attention(q, q, q, cu, cu, window_size=window, backend="torch"),
        backend="eager",
        fullgraph=True,
    )
    torch.testing.assert_close(traced(q), want, rtol=0, atol=0)

    seen = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size, **kw):
        seen.append(window_size)
        return varlen_attention_reference(q, k, v, cu_q, cu_k, causal=kw["causal"])[0]

    _fake_flash_attn(monkeypatch, flash_attn_varlen_func)
    varlen_attention(q.half(), q.half(), q.half(), cu, cu, causal=True, window_size=window)
    assert seen == [(-1, 0)]


# ------------------------------------------------------------------------ validation, precision
def test_cu_seqlens_on_another_device_is_refused_before_reading_them():
    q = torch.randn(7, 2, 8)
    meta = torch.tensor([0, 3, 7], dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="same device.*cu_seqlens_q on meta"):
        varlen_attention(q, q, q, meta, _cu([3, 4]))
    with pytest.raises(ValueError, match="same device.*cu_seqlens_k on meta"):
        varlen_attention(q, q, q, _cu([3, 4]), meta)


def test_flash_attn_backend_refuses_fp32_before_calling_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace())  # never called
    monkeypatch.setattr(va, "_is_cuda", lambda t: True)
    monkeypatch.setattr(va, "_flash_attn_available", lambda: True)
    q = torch.randn(7, 2, 8)
    with pytest.raises(TypeError, match="backend='flash_attn' needs fp16/bf16, got torch.float32"):
        varlen_attention(q, q, q, _cu([3, 4]), _cu([3, 4]), backend="flash_attn")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_backend_per_sequence_path_computes_half_inputs_in_fp32(dtype):
    """The per-sequence path (lse, softcap, cross lengths) upcasts: its output is the fp32 math
    rounded once, and its lse has fp32 precision, not the input dtype's."""
    lens_q, lens_k = [5, 3], [7, 2]
    q, k, v = (t.detach() for t in _leaves(lens_q, lens_k, dim=16, dtype=torch.float64))
    args = (q.to(dtype), k.to(dtype), v.to(dtype), _cu(lens_q), _cu(lens_k))
    out, lse = varlen_attention(*args, causal=True, softcap=3.0, return_lse=True, backend="torch")
    want, want_lse = varlen_attention_reference(*args, causal=True, softcap=3.0, upcast=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    exact = varlen_attention_reference(
        *(t.double() for t in args[:3]), *args[3:], None, True, (-1, -1), 3.0
    )[1]
    keep = torch.isfinite(exact)
    assert lse.dtype == torch.float32 and torch.equal(keep, torch.isfinite(lse))
    assert (lse[keep].double() - exact[keep]).abs().max() < 1e-5
