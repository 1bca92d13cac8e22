"""Drop-in audit: options a Liger call site passes are refused clearly when they are not what
Liger (and ``F.cross_entropy``) take, never silently read as something else; a flash-attn call
site's ``causal=1`` runs as it does on flash-attn."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import rlhf_kernels as rk
from rlhf_kernels import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy

FLAGS = ("return_z_loss", "use_token_scaling", "return_token_accuracy", "return_predicted_tokens")


def _problem():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(12, 8, generator=g), torch.randn(20, 8, generator=g)
    y = torch.randint(0, 20, (12,), generator=g)
    y[::4] = -100
    return h, w, y


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("value", ["False", 1])
def test_functional_refuses_non_bool_flags_as_the_module_does(flag, value):
    # a truthy "False" from a config turned token scaling on (another loss) or returned a
    # CrossEntropyOutput instead of the loss tensor; Liger asserts bools, our module refuses them
    h, w, y = _problem()
    with pytest.raises(TypeError, match=f"{flag} must be True or False, got {value!r}"):
        fused_linear_cross_entropy(h, w, y, **{flag: value})
    with pytest.raises(TypeError, match=f"{flag} must be True or False"):
        FusedLinearCrossEntropyLoss(**{flag: value})


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [None, -100.0, "-100"])
def test_non_int_ignore_index_is_refused_on_every_path(reduction, ignore_index):
    ii = ignore_index
    # None ran "mean" ignoring nothing but crashed inside torch ('bool' object has no attribute
    # 'sum', masked_fill(...) invalid arguments) for "sum", class weights, smoothing, z-loss
    h, w, y = _problem()
    y = y.clamp(min=0)
    options = ({}, {"ce_weight": torch.rand(20)}, {"label_smoothing": 0.1}, {"return_z_loss": True})
    for kw in options:
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            fused_linear_cross_entropy(h, w, y, ignore_index=ii, reduction=reduction, **kw)
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        FusedLinearCrossEntropyLoss(ignore_index=ignore_index, reduction=reduction)(w, h, y)


def test_integer_ignore_index_of_any_int_type_still_works():
    h, w, y = _problem()
    y = y.masked_fill(y == -100, 7)
    want = F.cross_entropy(h.double() @ w.double().T, y, ignore_index=7, reduction="sum")
    for ii in (7, np.int64(7)):
        got = fused_linear_cross_entropy(h, w, y, ignore_index=ii, reduction="sum")
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
        out = FusedLinearCrossEntropyLoss(ignore_index=ii, return_token_accuracy=True)(w, h, y)
        assert 0.0 <= float(out.token_accuracy) <= 1.0


@pytest.mark.parametrize("flag", [1, 0])
def test_flash_drop_ins_take_an_int_causal_as_flash_attn_does(flag):
    # flash-attn's op schema casts causal to bool, so `causal=1` call sites ran there and raised
    # "causal must be a bool" here; other non-bools keep varlen_attention's strict refusal
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 5, 2, 8, generator=g) for _ in range(3))
    want = rk.flash_attn_func(q, k, v, causal=bool(flag))
    torch.testing.assert_close(rk.flash_attn_func(q, k, v, 0.0, None, flag), want)
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    got = rk.flash_attn_varlen_func(*flat, cu, cu, 5, 5, causal=flag)
    torch.testing.assert_close(got.view_as(want), want)
    assert not torch.allclose(want, rk.flash_attn_func(q, k, v, causal=not flag))  # it matters
    for bad in ("yes", 2, None):
        with pytest.raises(TypeError, match="causal must be a bool"):
            rk.flash_attn_func(q, k, v, causal=bad)
