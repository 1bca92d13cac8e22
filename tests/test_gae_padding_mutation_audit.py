"""Mutation-audit pins for ``ops/gae.py``, ``ops/advantages.py`` and ``padding.py``.

Each test kills a mutant that survived the existing suite:

- ``reverse_scan(..., backend="triton")`` refuses float64 input (the dtype check in
  ``_pick_backend`` had no test of its own: only ``gae``'s earlier check was pinned).
- The torch scan path on a packed stream with empty sequences (``cu_seqlens`` with repeated
  entries, including an empty stream ``[0, 0]``): an empty sequence must mark no end token.
- The Triton scan's carry between blocks: a segment that ends inside a block ignores the
  value carried from the next block, even a non-finite one (``0 * inf`` would be NaN).
- Dispatch: ``backend="native"`` runs the fused op, ``backend="torch"`` the torch scan (never
  the fused op), and ``backend="native"`` where the op is not built for the device raises.
- ``whiten`` adds ``eps`` to the variance (``(x - mean) / sqrt(var + eps)``, float64 reference).
- ``whiten(shift_only=True)``'s gradient is that of ``x - masked_mean(x)`` (the mean is not a
  constant), whatever the mask.
- The half-precision re-entries of ``whiten`` / ``group_advantages`` (computed in float32) pass
  ``shift_only`` and ``eps`` on.
- ``sequence_to_tokens(values, None)`` is a TypeError (not an AttributeError).
"""

import pytest
import torch

import rlhf_kernels.ops.gae as gae_mod
from rlhf_kernels.ops.advantages import group_advantages, whiten
from rlhf_kernels.ops.gae import (
    discounted_returns,
    discounted_returns_reference,
    gae,
    gae_reference,
    reverse_scan,
    reverse_scan_loop,
)
from rlhf_kernels.padding import sequence_to_tokens

needs_triton = pytest.mark.skipif(gae_mod.triton is None, reason="needs triton")
needs_fused = pytest.mark.skipif(not gae_mod._HAS_FUSED, reason="needs rlhf_kernels._C")


def test_reverse_scan_triton_refuses_float64():
    x = torch.randn(2, 5, dtype=torch.float64)
    c = torch.rand(2, 5, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='triton' supports float32 only"):
        reverse_scan(x, c, backend="triton")


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_packed_empty_sequences_mark_no_end(backend):
    # an empty stream made of one empty sequence: nothing to scan, no index -1 into it
    z = torch.zeros(0, dtype=torch.float64)
    adv, ret = gae(z, z, gamma=0.9, lam=0.8, cu_seqlens=[0, 0], backend=backend)
    assert adv.shape == ret.shape == (0,)
    assert discounted_returns(z, gamma=0.9, cu_seqlens=[0, 0], backend=backend).shape == (0,)
    # empty sequences first, between and last: each real sequence matches the padded loop
    cu = [0, 0, 3, 3, 7, 7]
    r = torch.randn(7, dtype=torch.float64)
    v = torch.randn(7, dtype=torch.float64)
    adv, ret = gae(r, v, gamma=0.9, lam=0.8, cu_seqlens=cu, backend=backend)
    g = discounted_returns(r, gamma=0.9, cu_seqlens=cu, backend=backend)
    for s, e in ((0, 3), (3, 7)):
        one = torch.ones(1, e - s, dtype=torch.float64)
        ref_adv, ref_ret = gae_reference(r[None, s:e], v[None, s:e], one, 0.9, 0.8)
        torch.testing.assert_close(adv[s:e], ref_adv[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ret[s:e], ref_ret[0], rtol=1e-12, atol=1e-12)
        ref_g = discounted_returns_reference(r[None, s:e], one, 0.9)
        torch.testing.assert_close(g[s:e], ref_g[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("eps", [0.5, 3.0])
def test_whiten_adds_eps_to_the_variance(eps):
    x = torch.randn(4, 9, dtype=torch.float64)
    mask = torch.rand(4, 9) > 0.3
    sel = x[mask]
    ref = (x - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + eps)
    torch.testing.assert_close(whiten(x, mask, eps=eps), ref, rtol=1e-12, atol=1e-12)
    ref_all = (x - x.mean()) / torch.sqrt(x.var(unbiased=True) + eps)
    torch.testing.assert_close(whiten(x, eps=eps), ref_all, rtol=1e-12, atol=1e-12)


def test_whiten_shift_only_gradient_is_the_centring_map():
    x = torch.randn(3, 7, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(3, 7) > 0.4
    w = torch.randn(3, 7, dtype=torch.float64)
    out = whiten(x, mask, shift_only=True)
    torch.testing.assert_close(out, (x - x[mask].mean()).detach(), rtol=1e-12, atol=1e-12)
    (g,) = torch.autograd.grad((out * w).sum(), x)
    # d/dx_j of sum_i w_i (x_i - sum_k m_k x_k / n) = w_j - m_j * sum_i w_i / n
    ref = w - mask.double() * w.sum() / mask.sum()
    torch.testing.assert_close(g, ref, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: whiten(t, mask, shift_only=True), (x,))


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_triton_block_carry_does_not_cross_a_segment_end():  # (the interpreter's 0 * inf, dropped)
    # T = 8 in blocks of 4: times 7..4 first, then 3..0 with the carry y[4] = inf; coef[3] = 0
    # ends the segment at time 3, so times 0..3 must not see it
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, float("inf"), 0.5, 0.25, 1.0]])
    c = torch.tensor([[0.5, 0.5, 0.5, 0.0, 0.5, 0.5, 0.5, 0.5]])
    out = gae_mod.reverse_scan_triton(x, c, block=4)
    ref = reverse_scan_loop(x.double(), c.double())
    assert torch.isfinite(out[0, :4]).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)


def _spy(monkeypatch):
    calls = []
    real = gae_mod.reverse_scan

    def spy(x, coef, backend="auto"):
        calls.append(backend)
        return real(x, coef, backend)

    monkeypatch.setattr(gae_mod, "reverse_scan", spy)
    return calls


@needs_fused
def test_native_backend_runs_the_fused_op(monkeypatch):
    calls = _spy(monkeypatch)
    r, v = torch.randn(2, 6), torch.randn(2, 6)
    m = torch.ones(2, 6)
    gae(r, v, gamma=0.9, lam=0.8, mask=m, backend="native")
    discounted_returns(r, gamma=0.9, mask=m, backend="native")
    assert calls == []  # the fused ops: no separate delta + scan


def test_torch_backend_never_runs_the_fused_op(monkeypatch):
    calls = _spy(monkeypatch)
    r, v = torch.randn(2, 6, dtype=torch.float64), torch.randn(2, 6, dtype=torch.float64)
    m = torch.ones(2, 6)
    adv, _ = gae(r, v, gamma=0.9, lam=0.8, mask=m, backend="torch")
    g = discounted_returns(r, gamma=0.9, mask=m, backend="torch")
    assert calls == ["torch", "torch"]
    torch.testing.assert_close(adv, gae_reference(r, v, m, 0.9, 0.8)[0])
    torch.testing.assert_close(g, discounted_returns_reference(r, m, 0.9))


def test_native_backend_without_the_op_raises(monkeypatch):
    monkeypatch.setattr(gae_mod, "_native_supports", lambda *a, **k: False)
    x, c = torch.randn(2, 5), torch.rand(2, 5)
    with pytest.raises(ValueError, match="backend='native' needs rlhf_kernels._C built for cpu"):
        reverse_scan(x, c, backend="native")
    with pytest.raises(ValueError, match="backend='native' needs rlhf_kernels._C"):
        gae(x, x, gamma=0.9, lam=0.9, mask=torch.ones(2, 5), backend="native")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_whiten_keeps_shift_only_and_eps(dtype):
    x = (torch.randn(3, 8) * 2 + 1).to(dtype)
    mask = torch.rand(3, 8) > 0.3
    for kw in ({"shift_only": True}, {"eps": 4.0}, {"shift_only": True, "eps": 4.0}):
        ref = whiten(x.float(), mask, **kw).to(dtype)
        torch.testing.assert_close(whiten(x, mask, **kw), ref, atol=0, rtol=0)
    # shift_only: centred, not scaled (the std of these values is far from 1)
    out = whiten(x, mask, shift_only=True).float()
    torch.testing.assert_close(out, x.float() - x.float()[mask].mean(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("estimator", ["grpo", "reinforce_baseline"])
def test_half_group_advantages_keep_eps(dtype, estimator):
    r = (torch.randn(12) * 0.5).to(dtype)
    for eps in (0.0, 2.0):
        ref = group_advantages(r.float(), 4, estimator, eps=eps).to(dtype)
        torch.testing.assert_close(group_advantages(r, 4, estimator, eps=eps), ref, atol=0, rtol=0)


def test_sequence_to_tokens_none_cu_seqlens_is_a_type_error():
    with pytest.raises(TypeError, match="cu_seqlens must be a tensor or a list of ints"):
        sequence_to_tokens(torch.ones(2), None)
