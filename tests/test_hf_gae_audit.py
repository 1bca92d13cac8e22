"""Audit of the transformers attention function's input checks and of GAE / returns / whiten
edge cases: bad input raises a clear error, settings are applied, not dropped. Fast: torch
backend, float64, a stand-in attention module (no model)."""

import pytest
import torch

from rlhf_kernels.integrations import hf
from rlhf_kernels.ops.advantages import whiten
from rlhf_kernels.ops.gae import discounted_returns, gae
from rlhf_kernels.ops.varlen_attention import varlen_attention_reference

HEADS, KV_HEADS, DIM = 4, 2, 8


def _module(causal=True):
    module = torch.nn.Module()
    module.is_causal = causal
    return module.eval()  # (training: a warning about position_ids)


def _qkv(bsz, s, v_dim=DIM, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, HEADS, s, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(bsz, KV_HEADS, s, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(bsz, KV_HEADS, s, v_dim, generator=g, dtype=torch.float64)
    return q, k, v


def _forward(q, k, v, mask=None, **kwargs):
    kwargs.setdefault("scaling", 0.25)
    return hf.rlhf_attention_forward(_module(), q, k, v, mask, backend="torch", **kwargs)[0]


def _want(q, k, v, lens_per_row, scale=0.25):
    """(B, S, heads, v_dim): each row split into causal samples of the given lengths."""
    out = []
    for b, lens in enumerate(lens_per_row):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        qs, ks, vs = (t[b].transpose(0, 1) for t in (q, k, v))
        ref, _ = varlen_attention_reference(qs, ks, vs, cu, cu, softmax_scale=scale, causal=True)
        out.append(ref)
    return torch.stack(out)


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("padded", [False, True])
def test_position_ids_of_another_batch_size_refused(padded):
    """(2, S) position ids for a batch of 3 used to fail inside ``expand`` (RuntimeError about
    sizes); 3-D (multimodal RoPE) ids gave a cu_seqlens error or were flattened as tokens."""
    q, k, v = _qkv(3, 6)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 0] = False
    for pos in (torch.arange(6).expand(2, 6), torch.arange(6).expand(3, 3, 6)):
        with pytest.raises(ValueError, match=r"position_ids must be \(3, 6\) or \(1, 6\)"):
            _forward(q, k, v, mask if padded else None, position_ids=pos)


def test_additive_float_padding_mask_refused():
    """A 0 / -inf additive mask was read with ``.bool()``: real tokens taken for padding and
    padding for real tokens, silently. 0/1 masks of any dtype still work as the bool one."""
    q, k, v = _qkv(2, 5)
    keep = torch.tensor([[True] * 5, [False, False, True, True, True]])
    with pytest.raises(ValueError, match="bool or 0/1 padding mask"):
        _forward(q, k, v, torch.where(keep, 0.0, float("-inf")))
    want = _forward(q, k, v, keep)
    for mask in (keep.long(), keep.double()):
        torch.testing.assert_close(_forward(q, k, v, mask), want, rtol=0, atol=0)


def test_key_value_batch_mismatch_refused():
    q, k, v = _qkv(3, 6)
    with pytest.raises(ValueError, match="same batch, kv_heads and S_k"):
        _forward(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="same batch, kv_heads and S_k"):
        _forward(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="same batch, kv_heads and S_k"):
        _forward(q[0], k[0], v[0])


def test_rows_of_shared_position_ids_stay_separate():
    """Positions that continue across a row boundary (row 1 = 6..11) must not join the rows:
    every row starts a sample, whatever its first position."""
    q, k, v = _qkv(2, 6)
    pos = torch.arange(12).view(2, 6)
    want = _want(q, k, v, [[6], [6]])
    torch.testing.assert_close(_forward(q, k, v, position_ids=pos), want, rtol=0, atol=1e-12)
    mask = torch.ones(2, 6, dtype=torch.bool)  # the padded path: row 0 left-padded by one
    mask[0, 0] = False
    out = _forward(q, k, v, mask, position_ids=pos)
    row0 = _want(*(t[:1, :, 1:] for t in (q, k, v)), [[5]])
    torch.testing.assert_close(out[:1, 1:], row0, rtol=0, atol=1e-12)
    torch.testing.assert_close(out[1:], want[1:], rtol=0, atol=1e-12)


def test_one_token_sample_before_a_hole_in_a_padded_row():
    """Across padding a sample starts where the position does not increase, equal included:
    ``[a0, pad, b0, b1]`` at positions ``0, 0, 0, 1`` is two samples."""
    q, k, v = _qkv(1, 4)
    mask = torch.tensor([[True, False, True, True]])
    out = _forward(q, k, v, mask, position_ids=torch.tensor([[0, 0, 0, 1]]))
    real = mask[0]
    want = _want(*(t[:, :, real] for t in (q, k, v)), [[1, 2]])
    torch.testing.assert_close(out[:, real], want, rtol=0, atol=1e-12)
    assert bool((out[:, ~real] == 0).all())


def test_value_heads_narrower_default_scale_is_the_query_width():
    """MLA (v_head_dim < head_dim) without a scaling: 1 / sqrt(head_dim), not of the padded
    width or None."""
    q, k, _ = _qkv(2, 5)
    v = _qkv(2, 5, v_dim=DIM // 2, seed=1)[2]
    out = hf.rlhf_attention_forward(_module(), q, k, v, None, backend="torch")[0]
    assert out.shape == (2, 5, HEADS, DIM // 2)
    torch.testing.assert_close(out, _want(q, k, v, [[5], [5]], DIM**-0.5), rtol=0, atol=1e-12)
    q2, k2, v2 = _qkv(2, 5, v_dim=2 * DIM)  # v wider than q/k: the same rule
    out = hf.rlhf_attention_forward(_module(), q2, k2, v2, None, backend="torch")[0]
    torch.testing.assert_close(out, _want(q2, k2, v2, [[5], [5]], DIM**-0.5), rtol=0, atol=1e-12)


@pytest.mark.parametrize("padded", [False, True])
def test_attention_dropout_is_applied(padded):
    """The layer's ``dropout`` reaches the kernel (training forwards): outputs change with it
    and are reproducible under a fixed seed."""
    q, k, v = _qkv(2, 6)
    mask = torch.tensor([[True] * 6, [False] + [True] * 5]) if padded else None
    plain = _forward(q, k, v, mask)
    torch.manual_seed(3)
    a = _forward(q, k, v, mask, dropout=0.5)
    torch.manual_seed(3)
    b = _forward(q, k, v, mask, dropout=0.5)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not torch.allclose(a, plain)


# ----------------------------------------------------------------------------- gae / whiten
def test_mask_that_is_not_a_tensor_is_a_type_error():
    """A list mask used to fail with ``AttributeError: 'list' object has no attribute ...``."""
    r = torch.randn(2, 3)
    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got list"):
        gae(r, r, gamma=0.9, lam=0.9, mask=[[1, 1, 1], [1, 1, 0]])
    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got list"):
        discounted_returns(r, gamma=0.9, mask=[[1, 1, 1], [1, 1, 0]])
    with pytest.raises(TypeError, match="mask must be a torch.Tensor, got list"):
        whiten(r, [[1, 1, 1], [1, 1, 0]])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_torch_backend_half_precision_matches_the_fused_op(dtype):
    """The torch path computes half inputs in float32 (delta included) and returns them in the
    input dtype, as the fused op does."""
    g = torch.Generator().manual_seed(0)
    r, v = (torch.randn(4, 300, generator=g).to(dtype) for _ in range(2))
    mask = torch.rand(4, 300, generator=g) > 0.2
    fused = gae(r, v, gamma=0.99, lam=0.95, mask=mask)
    ref = gae(r.double(), v.double(), gamma=0.99, lam=0.95, mask=mask)
    for got, want, exact in zip(
        gae(r, v, gamma=0.99, lam=0.95, mask=mask, backend="torch"), fused, ref
    ):
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)  # one ulp near 0
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=0.05)
    got = discounted_returns(r, gamma=0.99, mask=mask, backend="torch")
    assert got.dtype == dtype
    torch.testing.assert_close(got, discounted_returns(r, gamma=0.99, mask=mask))


def test_triton_backend_on_cpu_without_the_interpreter_refused(monkeypatch):
    """CPU tensors without TRITON_INTERPRET used to reach the kernel launch and fail there with
    ``RuntimeError: 0 active drivers``; now a ValueError before any work, as varlen_attention."""
    from rlhf_kernels.ops import gae as gae_mod

    if gae_mod.triton is None:
        pytest.skip("needs triton")
    monkeypatch.setattr(gae_mod.triton.knobs.runtime, "interpret", False)
    r = torch.randn(2, 5)
    with pytest.raises(ValueError, match="needs CUDA tensors .* got rewards on cpu"):
        gae(r, r, gamma=0.9, lam=0.9, mask=torch.ones(2, 5), backend="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors .* got rewards on cpu"):
        discounted_returns(r, gamma=0.9, mask=torch.ones(2, 5), backend="triton")
    with pytest.raises(ValueError, match="needs CUDA tensors .* got x on cpu"):
        gae_mod.reverse_scan(r, r, backend="triton")


def test_is_causal_argument_overrides_the_module():
    """A layer may pass ``is_causal`` explicitly (shared modules used both ways): it wins over
    ``module.is_causal``."""
    q, k, v = _qkv(1, 5)
    qs, ks, vs = (t[0].transpose(0, 1) for t in (q, k, v))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    for module_causal, arg in ((True, False), (False, True)):
        out = hf.rlhf_attention_forward(
            _module(module_causal), q, k, v, None, scaling=0.25, is_causal=arg, backend="torch"
        )[0]
        want, _ = varlen_attention_reference(qs, ks, vs, cu, cu, softmax_scale=0.25, causal=arg)
        torch.testing.assert_close(out[0], want, rtol=0, atol=1e-12)


def test_whiten_mask_on_another_device_refused():
    """Used to fail reading the mask's values (``Tensor.item() cannot be called on meta
    tensors``; on a GPU machine inside torch.where); now named before any work, as gae."""
    for mask in (torch.ones(4, device="meta"), torch.ones(4, dtype=torch.bool, device="meta")):
        with pytest.raises(ValueError, match="same device, got x on cpu, mask on meta"):
            whiten(torch.randn(4), mask)


def test_logprobs_triton_backend_on_cpu_without_the_interpreter_refused(monkeypatch):
    # the same launch on CPU tensors as gae's: "0 active drivers" from inside Triton before
    triton = pytest.importorskip("triton")
    from rlhf_kernels.ops.logprobs import logprobs_from_logits

    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    with pytest.raises(ValueError, match="needs CUDA tensors .* got logits on cpu"):
        logprobs_from_logits(torch.randn(4, 10), torch.tensor([1, 2, 3, 4]), backend="triton")
