"""FusedLinearCrossEntropyLoss (Liger's interface) equals F.cross_entropy(F.linear(...)):
values and gradients, every reduction, ignore_index, label smoothing, any leading shape."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf_kernels import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy


def _problem(shape=(3, 7), H=16, V=50, dtype=torch.float32, bias=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / 3).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_() if bias else None
    y = torch.randint(0, V, shape, generator=g)
    y.view(-1)[[0, 4, 5]] = -100
    return x, w, b, y


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_torch_cross_entropy(reduction, smoothing, bias):
    x, w, b, y = _problem(bias=bias)
    loss_fn = FusedLinearCrossEntropyLoss(label_smoothing=smoothing, reduction=reduction)
    got = loss_fn(w, x, y, b)
    weights = torch.linspace(0.5, 2, got.numel()).view_as(got)
    (got * weights).sum().backward()
    leaves = [t.detach().clone().requires_grad_() for t in (x, w) + ((b,) if bias else ())]
    logits = F.linear(leaves[0], leaves[1], leaves[2] if bias else None)
    want = F.cross_entropy(
        logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=-100,
        label_smoothing=smoothing, reduction=reduction,
    )  # fmt: skip
    want = want.view(y.shape) if reduction == "none" else want
    (want * weights).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for a, r in zip((x, w, b), leaves):
        torch.testing.assert_close(a.grad, r.grad, atol=1e-5, rtol=1e-5)


def test_bf16_within_twice_torch():
    x, w, b, y = _problem(shape=(64,), H=64, V=300, dtype=torch.bfloat16)
    ref = F.cross_entropy(F.linear(x.double(), w.double(), b.double()), y)
    ours = fused_linear_cross_entropy(x, w, y, b)
    plain = F.cross_entropy(F.linear(x, w, b).float(), y)
    assert abs(ours.double() - ref) <= 2 * abs(plain.double() - ref) + 1e-6


def test_clear_errors():
    x, w, b, y = _problem()
    with pytest.raises(ValueError, match="reduction must be one of"):
        FusedLinearCrossEntropyLoss(reduction="avg")
    with pytest.raises(ValueError, match="softcap must be None or > 0"):
        FusedLinearCrossEntropyLoss(softcap=0.0)
    with pytest.raises(ValueError, match="target must have _input's leading shape"):
        fused_linear_cross_entropy(x, w, y.view(-1))
    with pytest.raises(ValueError, match="labels must lie in"):
        fused_linear_cross_entropy(x, w, y.clamp(min=0) + 1000)
