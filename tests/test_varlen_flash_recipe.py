"""The flash_attn backend's post-processing and the backend choice, on CPU.

flash-attn is CUDA-only, so a fake ``flash_attn`` module stands in for it: it computes the right
answer but reports queries that see no key the way flash-attn 2 does (lse ``+inf``) or worse.
"""

import sys
import types
import warnings

import pytest
import torch

from rlhf_kernels.ops import varlen_attention as va
from rlhf_kernels.ops.varlen_attention import (
    attention_mask,
    resolve_backend,
    varlen_attention,
    varlen_attention_reference,
)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [(-1, -1), (2, -1), (-1, 0), (3, 1), (0, 0), (-1, 2)])
def test_keyless_rows_match_the_mask(causal, window):
    lens_q, lens_k = [4, 1, 6, 3, 5, 2, 0], [2, 0, 6, 7, 1, 2, 3]
    cu_q, cu_k = _cu(lens_q).tolist(), _cu(lens_k).tolist()
    expect = []
    for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        m = attention_mask(lq, lk, causal, window)
        seen = torch.ones(lq, dtype=torch.bool) if m is None else m.any(1)
        if lk == 0:
            seen[:] = False
        expect += [cu_q[b] + i for i in range(lq) if not seen[i]]
    got = [i for a, b in va._keyless_rows(cu_q, cu_k, causal, window) for i in range(a, b)]
    assert got == expect


def _fake_flash_attn(lse_fill, out_fill, padded, calls):
    """A flash_attn module whose varlen function is right except where a query sees no key."""

    def flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        return_attn_probs=False,
        **_,
    ):
        calls.append(dict(cu_dtype=cu_seqlens_q.dtype, max_q=max_seqlen_q, window=window_size))
        out, lse = varlen_attention_reference(
            q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, window_size, softcap, True
        )
        keyless = torch.isneginf(lse[0])
        out = out.masked_fill(keyless[:, None, None], out_fill)
        lse = lse.masked_fill(keyless, lse_fill)
        if padded:  # flash-attn < 2.5 layout: (batch, heads, max_seqlen_q), junk past the end
            cu = cu_seqlens_q.tolist()
            pad = lse.new_full((len(cu) - 1, lse.shape[0], max_seqlen_q), 123.0)
            for b in range(len(cu) - 1):
                pad[b, :, : cu[b + 1] - cu[b]] = lse[:, cu[b] : cu[b + 1]]
            lse = pad
        calls[-1]["lse"] = lse
        return (out, lse, None) if return_attn_probs else out

    return types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


@pytest.fixture
def fake_cuda(monkeypatch):
    """CPU tensors look like CUDA ones to the backend choice; flash-attn counts as installed."""
    monkeypatch.setattr(va, "_is_cuda", lambda t: True)
    monkeypatch.setattr(va, "_flash_attn_available", lambda: True)
    monkeypatch.setattr(va, "_WARNED", set())


@pytest.mark.parametrize("padded", [False, True], ids=["flat_lse", "padded_lse"])
@pytest.mark.parametrize(
    "lse_fill,out_fill", [(float("inf"), 0.0), (1e30, 0.0), (0.0, 0.0), (float("inf"), 7.0)]
)
def test_flash_attn_keyless_rows_get_minus_inf_and_zero(
    monkeypatch, fake_cuda, lse_fill, out_fill, padded
):
    calls = []
    monkeypatch.setitem(
        sys.modules, "flash_attn", _fake_flash_attn(lse_fill, out_fill, padded, calls)
    )
    lens_q, lens_k = [4, 3, 5, 2], [2, 3, 0, 6]  # lq > lk causal and lk == 0: keyless queries
    q = torch.randn(sum(lens_q), 4, 16, dtype=torch.float16, requires_grad=True)
    k = torch.randn(sum(lens_k), 2, 16, dtype=torch.float16, requires_grad=True)
    v = torch.randn(sum(lens_k), 2, 16, dtype=torch.float16, requires_grad=True)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    out, lse = varlen_attention(
        q, k, v, cu_q, cu_k, 4096, 4096, causal=True, window_size=torch.tensor([-1, -1]),
        return_lse=True,
    )  # fmt: skip
    assert calls[0]["cu_dtype"] == torch.int32 and calls[0]["max_q"] == 5
    assert calls[0]["window"] == (-1, -1) and all(type(w) is int for w in calls[0]["window"])

    ref, ref_lse = varlen_attention_reference(q, k, v, cu_q, cu_k, causal=True, upcast=True)
    keyless = torch.isneginf(ref_lse[0])
    assert keyless.sum() == 2 + 5  # 2 queries of sequence 0, all of sequence 2
    assert lse.shape == (4, sum(lens_q)) and lse.dtype == torch.float32
    assert torch.isneginf(lse[:, keyless]).all()
    torch.testing.assert_close(lse[:, ~keyless], ref_lse[:, ~keyless], rtol=0, atol=0)
    assert (out[keyless] == 0).all()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    if not padded:  # flash-attn's own lse (saved for its backward) is left as it was
        assert not torch.isneginf(calls[0]["lse"]).any()
    out.float().sum().backward()  # differentiable through the post-processing
    assert torch.isfinite(q.grad).all() and (q.grad[keyless] == 0).all()


def test_flash_attn_lse_gradient_raises_instead_of_being_dropped(monkeypatch, fake_cuda):
    """flash-attn's backward ignores the lse's gradient; the torch and triton backends use it,
    so a merge by lse would be silently wrong on flash_attn alone: it raises."""
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(float("inf"), 0.0, False, []))
    q = torch.randn(6, 2, 8, dtype=torch.float16, requires_grad=True)
    cu = _cu([2, 4])
    out, lse = varlen_attention(q, q, q, cu, cu, causal=True, return_lse=True)
    out.float().sum().backward()  # the lse unused: fine
    assert torch.isfinite(q.grad).all()
    out, lse = varlen_attention(q, q, q, cu, cu, causal=True, return_lse=True)
    with pytest.raises(RuntimeError, match="lse has no gradient"):
        (out.float().sum() + lse.sum()).backward()
    out, lse = varlen_attention(q, q, q, cu, cu, causal=True, return_lse=True)
    (out.float().sum() + lse.detach().sum()).backward()  # detached: fine


def test_flash_attn_without_lse_still_zeroes_keyless_output(monkeypatch, fake_cuda):
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(1.0, 5.0, False, []))
    q = torch.randn(4, 2, 8, dtype=torch.bfloat16)
    k = v = torch.randn(2, 2, 8, dtype=torch.bfloat16)
    out = varlen_attention(q, k, v, _cu([4]), _cu([2]), causal=True)  # auto -> flash_attn
    assert (out[:2] == 0).all() and (out[2:] != 5.0).all()


# ----------------------------------------------------------------------------- backend choice
def _q(dtype=torch.float16):
    return torch.zeros(3, 2, 8, dtype=dtype)


def test_auto_with_dropout_on_cuda_without_flash_attn_runs_torch_and_warns_once(
    monkeypatch, fake_cuda
):
    monkeypatch.setattr(va, "_flash_attn_available", lambda: False)
    assert resolve_backend("auto", _q(), 0.0) == "triton"
    with pytest.warns(UserWarning, match=r"dropout_p=0.1.*'triton'.*'torch' backend runs"):
        assert resolve_backend("auto", _q(), 0.1) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process, not once per call site
        assert resolve_backend("auto", _q(torch.float32), 0.2) == "torch"
        assert resolve_backend("torch", _q(), 0.1) == "torch"  # explicit: silent


def test_auto_with_dropout_prefers_flash_attn_and_fp32_falls_back(monkeypatch, fake_cuda):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend("auto", _q(torch.bfloat16), 0.1) == "flash_attn"
    with pytest.warns(UserWarning, match="float32"):  # flash-attn has no fp32
        assert resolve_backend("auto", _q(torch.float32), 0.1) == "torch"


def test_auto_on_cpu_with_dropout_is_torch_without_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend("auto", _q(), 0.1) == "torch"


def test_explicit_backend_that_cannot_run_raises_naming_it(monkeypatch, fake_cuda):
    with pytest.raises(ValueError, match="backend='triton' does not support dropout"):
        resolve_backend("triton", _q(), 0.1)
    monkeypatch.setattr(va, "_flash_attn_available", lambda: False)
    with pytest.raises(ValueError, match="backend='flash_attn' needs CUDA tensors and the flash"):
        resolve_backend("flash_attn", _q(), 0.0)


def test_dropout_on_cuda_through_varlen_attention_warns(monkeypatch, fake_cuda):
    monkeypatch.setattr(va, "_flash_attn_available", lambda: False)
    q = torch.randn(6, 2, 8)
    with pytest.warns(UserWarning, match="'torch' backend runs"):
        out = varlen_attention(q, q, q, _cu([6]), _cu([6]), dropout_p=0.5)
    assert out.shape == q.shape
