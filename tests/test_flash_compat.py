"""flash-attn 2's ``flash_attn_varlen_func`` / ``flash_attn_func`` drop-ins: flash-attn's
signatures, results equal to ``varlen_attention`` and to a float64 reference, clear refusals."""

from __future__ import annotations

import inspect
import sys
import types

import pytest
import torch

import rlhf_kernels as rk
from rlhf_kernels.ops import varlen_attention as va
from rlhf_kernels.ops.varlen_attention import varlen_attention, varlen_attention_reference

# flash-attn 2.6+ (flash_attn/flash_attn_interface.py), in its positional order
FA_VARLEN = (
    "q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
    "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
    "return_attn_probs", "block_table",
)  # fmt: skip
FA_DENSE = (
    "q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap",
    "alibi_slopes", "deterministic", "return_attn_probs",
)  # fmt: skip


def _positional(fn):
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY)
    return tuple(n for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds)


def test_signatures_are_flash_attns():
    assert _positional(rk.flash_attn_varlen_func) == FA_VARLEN
    assert _positional(rk.flash_attn_func) == FA_DENSE
    try:
        import flash_attn
    except ImportError:
        return
    assert _positional(flash_attn.flash_attn_varlen_func) == FA_VARLEN  # the installed one
    assert _positional(flash_attn.flash_attn_func) == FA_DENSE


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def test_varlen_drop_in_equals_varlen_attention_positionally():
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 5, 5, 13, 20], dtype=torch.int32)
    q0, k0, v0 = (torch.randn(20, h, 16, generator=g) for h in (4, 2, 2))
    args = (cu, cu, 8, 8, 0.0, 0.3, True, (4, 0), 5.0)  # scale, causal, window, softcap
    q, k, v = _leaves(q0, k0, v0)
    out, lse, s_dmask = rk.flash_attn_varlen_func(q, k, v, *args, None, True, True, None)
    assert s_dmask is None
    q2, k2, v2 = _leaves(q0, k0, v0)
    want, want_lse = varlen_attention(q2, k2, v2, *args, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    gout = torch.randn(out.shape, generator=g)
    out.backward(gout)
    want.backward(gout)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
    plain = rk.flash_attn_varlen_func(q0, k0, v0, *args)
    assert isinstance(plain, torch.Tensor)
    torch.testing.assert_close(plain, want.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)), (True, (3, 0))])
def test_dense_drop_in_equals_float64_reference(causal, window):
    """``(batch, seqlen, heads, head_dim)``, GQA, more keys than queries (bottom-right causal
    alignment, as flash-attn), non-contiguous inputs; forward, lse and gradients."""
    g = torch.Generator().manual_seed(1)
    b, sq, sk, hq, hk, d = 3, 5, 7, 4, 2, 8
    q0 = torch.randn(b, hq, sq, d, generator=g).transpose(1, 2)  # a strided view, as from HF
    k0, v0 = (torch.randn(b, sk, hk, d, generator=g) for _ in range(2))
    q, k, v = _leaves(q0, k0, v0)
    out, lse, none = rk.flash_attn_func(q, k, v, 0.0, None, causal, window, 0.0, None, False, True)
    assert none is None and out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq)
    assert lse.is_contiguous()  # flash-attn's is a fresh tensor: lse.view(b, -1) works
    qr, kr, vr = _leaves(*(t.double().flatten(0, 1) for t in (q0, k0, v0)))
    cu_q = torch.arange(b + 1, dtype=torch.int32) * sq
    cu_k = torch.arange(b + 1, dtype=torch.int32) * sk
    ref, ref_lse = varlen_attention_reference(
        qr, kr, vr, cu_q, cu_k, None, causal, window, 0.0, True
    )
    torch.testing.assert_close(out.double(), ref.view(b, sq, hq, d), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        lse.double(), ref_lse.view(hq, b, sq).transpose(0, 1), rtol=1e-5, atol=1e-5
    )
    gout = torch.randn(out.shape, generator=g)
    out.backward(gout)
    ref.backward(gout.double().flatten(0, 1))
    for a, r in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad.double(), r.grad.view(a.shape), rtol=1e-5, atol=1e-5)


def test_dense_drop_in_empty_shapes():
    q = torch.randn(0, 4, 2, 8)
    assert rk.flash_attn_func(q, q, q).shape == (0, 4, 2, 8)
    q = torch.randn(2, 0, 2, 8)
    out, lse, _ = rk.flash_attn_func(q, q, q, causal=True, return_attn_probs=True)
    assert out.shape == (2, 0, 2, 8) and lse.shape == (2, 2, 0)


def test_refusals_are_clear():
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="alibi_slopes .ALiBi. is not supported"):
        rk.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match="block_table .a paged KV cache. is not supported"):
        rk.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, block_table=torch.zeros(1, 1))
    with pytest.raises(ValueError, match="alibi_slopes"):
        rk.flash_attn_func(q[None], q[None], q[None], alibi_slopes=torch.ones(2))
    with pytest.raises(ValueError, match=r"q must be \(batch, seqlen, heads, head_dim\), got"):
        rk.flash_attn_func(q, q, q)
    with pytest.raises(ValueError, match="the same batch size, got 1, 2, 2"):
        rk.flash_attn_func(q[None], q[None].expand(2, -1, -1, -1), q[None].expand(2, -1, -1, -1))
    with pytest.raises(
        ValueError, match=r"k and v must have the same shape, got \(1, 6, 2, 8\) and \(1, 5"
    ):
        rk.flash_attn_func(q[None], q[None], q[None, :5])  # the caller's shapes, not flattened


def fake_flash(monkeypatch) -> list:
    """A stand-in ``flash_attn`` module (the torch reference behind flash-attn's varlen
    signature) taken as present on "CUDA"; returns the list of ``deterministic`` flags it got."""
    calls = []

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, *, deterministic, return_attn_probs, **kw):
        calls.append(deterministic)
        out, lse = varlen_attention_reference(
            q, k, v, cu_q, cu_k, kw["softmax_scale"], kw["causal"], kw["window_size"]
        )
        return (out, lse, None) if return_attn_probs else out

    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake)
    )
    monkeypatch.setattr(va, "_is_cuda", lambda t: True)
    monkeypatch.setattr(va, "_flash_attn_available", lambda: True)
    return calls


def test_deterministic_reaches_flash_attn(monkeypatch):
    """The flag reaches flash-attn's own call, eager and compiled (the op carries it)."""
    calls = fake_flash(monkeypatch)
    q = torch.randn(6, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    for det in (True, False):
        rk.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, causal=True, deterministic=det)
    assert calls == [True, False]
    torch._dynamo.reset()
    f = torch.compile(
        lambda q: rk.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, deterministic=True),
        fullgraph=True,
        backend="aot_eager",
    )
    f(q).float().sum().backward()
    assert calls[2:] and all(calls[2:]) and q.grad is not None


def test_dense_drop_in_reads_no_cu_seqlens_back(monkeypatch):
    """flash_attn_func's cu_seqlens are valid by construction: on a device (here: the cache's
    CPU exemption turned off) the check takes the known list, with no device -> host read."""
    from rlhf_kernels import _checks

    monkeypatch.setattr(_checks, "_read_every_time", lambda t: False)
    reads = []
    real = torch.Tensor.tolist

    def counting(t):
        if t.dim() == 1 and t.dtype == torch.int32:
            reads.append(t)
        return real(t)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    q, k = torch.randn(2, 5, 2, 8), torch.randn(2, 7, 1, 8)
    out = rk.flash_attn_func(q, k, k, causal=True, backend="torch")
    _checks._VALIDATED.clear()
    assert not reads, f"{len(reads)} cu_seqlens read(s) back"
    rows = torch.arange(3, dtype=torch.int32)
    ref = varlen_attention(
        q.flatten(0, 1), k.flatten(0, 1), k.flatten(0, 1), rows * 5, rows * 7, 5, 7,
        causal=True, backend="torch",
    )  # fmt: skip
    torch.testing.assert_close(out.flatten(0, 1), ref, rtol=0, atol=0)
