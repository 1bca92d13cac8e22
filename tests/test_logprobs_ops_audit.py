"""Audit of the log-prob ops: NaN logits, second derivatives, soft-cap range, empty targets."""

import pytest
import torch

from rlhf_kernels import logprobs_from_logits
from rlhf_kernels.ops.fused_linear_ce import (
    FusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
)
from rlhf_kernels.ops.linear_logprobs import (
    linear_logprobs,
    linear_logprobs_reference,
    linear_nll_loss,
)

T, H, V = 5, 4, 9


def _linear(bias=True):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).requires_grad_()
    w = torch.randn(V, H, generator=g).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    return h, w, b, torch.randint(0, V, (T,), generator=g)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nan_logit_gives_nan_on_every_backend(backend):
    # the Triton kernels floored u - max with tl.maximum, which drops NaN: a NaN logit was
    # silently read as -inf (p = 0), finite log-prob, entropy and gradient
    z = torch.randn(2, 3, 9)
    z[0, 1, 4] = float("nan")
    z.requires_grad_()
    labels = torch.tensor([[4, 2, 3], [0, 1, 8]])
    logp, ent = logprobs_from_logits(z, labels, 0.7, return_entropy=True, backend=backend)
    (logp.sum() + ent.sum()).backward()
    nan = torch.zeros(2, 3, dtype=torch.bool)
    nan[0, 1] = True
    assert torch.equal(logp.isnan(), nan) and torch.equal(ent.isnan(), nan)
    assert z.grad[0, 1].isnan().all() and z.grad[~nan].isfinite().all()


@pytest.mark.parametrize("triton_blocks", ["0", "1"])
def test_linear_nan_logit_gives_nan_on_every_path(triton_blocks, monkeypatch):
    # the same floor in the linear op's Triton block passes (stats and gradient kernels)
    monkeypatch.setenv("RLHF_KERNELS_LINEAR_TRITON", triton_blocks)
    h, w, b, y = _linear()
    with torch.no_grad():
        b[4] = float("nan")  # logit 4 of every token is NaN
    logp, ent = linear_logprobs(h, w, y, b, return_entropy=True, chunk_vocab=5)
    (logp.sum() + ent.sum()).backward()
    assert logp.isnan().all() and ent.isnan().all() and h.grad.isnan().all()
    h.grad = None
    loss = linear_nll_loss(h, w, y, bias=b)  # the one pass: gradients made in the forward
    loss.backward()
    assert loss.isnan() and h.grad.isnan().all()


def _second_derivative_cases():
    def logprobs(backend):
        def run():
            z = torch.randn(2, 3, 7, requires_grad=True)
            return logprobs_from_logits(z, torch.randint(0, 7, (2, 3)), backend=backend).sum(), z

        return run

    def linear(fn):
        def run():
            h, w, b, y = _linear()
            return fn(h, w, b, y), h

        return run

    return {
        "logprobs_torch": logprobs("torch"),
        "logprobs_triton": logprobs("triton"),
        "linear_logprobs": linear(lambda h, w, b, y: linear_logprobs(h, w, y, b).sum()),
        "linear_nll_loss": linear(lambda h, w, b, y: linear_nll_loss(h, w, y, bias=b)),
        "cross_entropy_z_loss": linear(
            lambda h, w, b, y: fused_linear_cross_entropy(h, w, y, b, lse_square_scale=0.1)
        ),
    }


@pytest.mark.parametrize("case", list(_second_derivative_cases()))
def test_create_graph_is_refused_clearly(case):
    # before: the torch backends failed deep inside ("exp(): functions with out=... arguments
    # don't support automatic differentiation"), the others returned gradients with no graph,
    # so a gradient penalty built on them silently added nothing
    loss, x = _second_derivative_cases()[case]()
    with pytest.raises(RuntimeError, match="no second derivative.*create_graph=True"):
        torch.autograd.grad(loss, x, create_graph=True)
    loss, x = _second_derivative_cases()[case]()
    (g,) = torch.autograd.grad(loss, x)  # first order, as before
    assert g.isfinite().all() and g.abs().sum() > 0


@pytest.mark.parametrize("cap", [float("inf"), 1e39, 1e300, float("nan"), 0.0])
def test_softcap_beyond_fp32_is_refused(cap):
    # the logit blocks are fp32: a cap past fp32's range made every log-prob NaN, silently
    h, w, b, y = _linear()
    with pytest.raises(ValueError, match="softcap must be None or"):
        linear_logprobs(h, w, y, b, softcap=cap)
    with pytest.raises(ValueError, match="softcap must be None or"):
        fused_linear_cross_entropy(h, w, y, b, softcap=cap)
    with pytest.raises(ValueError, match="softcap must be None or > 0"):
        FusedLinearCrossEntropyLoss(softcap=cap)


def test_largest_fp32_softcap_still_works():
    h, w, b, y = _linear()
    cap = 3e38
    got = linear_logprobs(h, w, y, b, softcap=cap)
    want, _ = linear_logprobs_reference(h.double(), w.double(), y, b.double(), softcap=cap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert FusedLinearCrossEntropyLoss(softcap=cap)(w, h, y, b).isfinite()


def test_infinite_z_loss_scale_and_missing_weight_are_named():
    h, w, b, y = _linear()
    with pytest.raises(ValueError, match="lse_square_scale must be a number >= 0 and finite"):
        fused_linear_cross_entropy(h, w, y, b, lse_square_scale=float("inf"))
    # was an AttributeError ('NoneType' object has no attribute 'shape') on the z-loss path
    for kw in (dict(lse_square_scale=0.1), dict(ce_weight=torch.ones(V)), {}):
        with pytest.raises(ValueError, match=r"weight must be a \(V, H\) tensor, got NoneType"):
            fused_linear_cross_entropy(h, None, y, **kw)
    with pytest.raises(ValueError, match=r"weight must be a \(V, H\) tensor, got \(1, 9, 4\)"):
        fused_linear_cross_entropy(h, w[None], y)


OPTIONS = [
    {},
    dict(label_smoothing=0.1),
    dict(lse_square_scale=0.1, return_z_loss=True),
    dict(ce_weight=torch.rand(V) + 0.5, label_smoothing=0.2),
    dict(use_token_scaling=True),
    dict(return_token_accuracy=True, return_predicted_tokens=True),
]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("kw", OPTIONS, ids=lambda kw: "+".join(kw) or "plain")
def test_every_target_ignored_gives_zero_loss_and_gradients(reduction, kw):
    # a mean over no token is 0 (F.cross_entropy's 0 / 0 = NaN is not wanted here): kills the
    # removal of the clamps of the token counts / weight sums (_reduce, _nonzero, _token_count)
    h, w, b, _ = _linear()
    y = torch.full((T,), -100)
    out = fused_linear_cross_entropy(h, w, y, b, reduction=reduction, **kw)
    loss = out.loss if kw.get("return_z_loss") or kw.get("return_token_accuracy") else out
    loss.sum().backward()
    for t in (loss, h.grad, w.grad, b.grad):
        assert torch.equal(t, torch.zeros_like(t))
    if kw.get("return_z_loss"):
        assert torch.equal(out.z_loss, torch.zeros_like(out.z_loss))
    if kw.get("return_token_accuracy"):
        assert torch.equal(out.token_accuracy, torch.zeros_like(out.token_accuracy))
        assert torch.equal(out.predicted_tokens, torch.full((T,), -1))


def test_nll_loss_bad_mask_is_named():
    # a mask on another device failed inside masked_fill ("Tensor on device meta is not on the
    # expected device cpu!") or .item(); a list failed with an AttributeError on .shape
    h, w, b, y = _linear()
    with pytest.raises(ValueError, match="mask is on meta, labels on cpu"):
        linear_nll_loss(h, w, y, mask=torch.ones(T, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="mask is on meta, labels on cpu"):
        linear_nll_loss(h, w, y, mask=torch.ones(T, device="meta"))
    with pytest.raises(TypeError, match="mask must be a tensor, got list"):
        linear_nll_loss(h, w, y, mask=[1] * T)
