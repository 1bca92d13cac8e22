import pytest
import torch

from rlhf_kernels import logprobs_from_logits
from rlhf_kernels.ops import logprobs as lp_mod
from rlhf_kernels.ops.logprobs import logprobs_reference

BACKENDS = ["torch", "triton"]


def _run(logits, labels, tau, backend, w_lp, w_ent):
    x = logits.detach().clone().requires_grad_()
    logp, ent = logprobs_from_logits(x, labels, tau, return_entropy=True, backend=backend)
    ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return logp, ent, x.grad


def _ref(logits, labels, tau, w_lp, w_ent):
    x = logits.detach().double().requires_grad_()
    logp, ent = logprobs_reference(x, labels, tau)
    ((logp * w_lp.double()).sum() + (ent * w_ent.double()).sum()).backward()
    return logp, ent, x.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tau", [1.0, 0.7])
def test_fp32_matches_float64(backend, tau, monkeypatch):
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMS", 20 * 1003)  # several row chunks (67 rows)
    logits = torch.randn(67, 1003) * 3
    labels = torch.randint(0, 1003, (67,))
    w_lp, w_ent = torch.randn(67), torch.randn(67)
    out = _run(logits, labels, tau, backend, w_lp, w_ent)
    ref = _ref(logits, labels, tau, w_lp, w_ent)
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_logp_only(backend):
    logits = torch.randn(3, 5, 31)
    labels = torch.randint(0, 31, (3, 5))
    x = logits.clone().requires_grad_()
    logp = logprobs_from_logits(x, labels, backend=backend)
    assert logp.shape == (3, 5)
    logp.sum().backward()
    xr = logits.double().requires_grad_()
    ref, _ = logprobs_reference(xr, labels)
    ref.sum().backward()
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale,offset", [(2.0, 0.0), (5.0, 0.0), (3.0, 30.0)])
def test_fp32_within_twice_plain_torch(backend, scale, offset, monkeypatch):
    """fp32 log-probs, entropy and gradient against float64, no worse than twice plain fp32
    torch. Were: entropy 2.4-5.5x (a bmm's accumulation), gradient 2.0-3.6x (``u - lse``
    instead of ``(u - m) - log s``: ``|lse| * eps`` lost per element)."""
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMS", 20 * 4001)  # several row chunks
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 4001, generator=g) * scale + offset
    labels = torch.randint(0, 4001, (64,), generator=g)
    w_lp, w_ent = torch.randn(64, generator=g), torch.randn(64, generator=g)
    out = _run(logits, labels, 0.9, backend, w_lp, w_ent)
    ref = _ref(logits, labels, 0.9, w_lp, w_ent)
    xt = logits.clone().requires_grad_()  # plain fp32 torch: the same math in fp32
    t_logp, t_ent = logprobs_reference(xt, labels, 0.9)
    ((t_logp * w_lp).sum() + (t_ent * w_ent).sum()).backward()
    for name, o, t, r in zip(("logp", "entropy", "grad"), out, (t_logp, t_ent, xt.grad), ref):
        err, err_torch = ((x.double() - r).abs().max().item() for x in (o, t))
        assert err <= 2 * err_torch, (name, err, err_torch)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_within_twice_torch(backend, dtype):
    logits = (torch.randn(47, 1003) * 2).to(dtype)
    labels = torch.randint(0, 1003, (47,))
    w_lp, w_ent = torch.randn(47), torch.randn(47)
    out = _run(logits, labels, 1.0, backend, w_lp, w_ent)
    ref = _ref(logits, labels, 1.0, w_lp, w_ent)  # exact math on the same rounded inputs
    # plain torch in this dtype: log_softmax on the low-precision logits
    xt = logits.clone().requires_grad_()
    lpt = torch.log_softmax(xt, -1)
    t_logp = lpt.gather(-1, labels[:, None]).squeeze(-1)
    t_ent = -(lpt.exp() * lpt).sum(-1)
    ((t_logp * w_lp.to(dtype)).sum() + (t_ent * w_ent.to(dtype)).sum()).backward()
    torch_out = (t_logp, t_ent, xt.grad)
    for o, t, r in zip(out, torch_out, ref):
        err = (o.double() - r).abs().max()
        err_torch = (t.double() - r).abs().max()
        assert err <= 2 * err_torch + 1e-6, (err, err_torch)
    assert out[2].dtype == dtype


def test_float64_path_differentiable():
    x = torch.randn(7, 13, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (7,))
    assert torch.autograd.gradcheck(
        lambda z: logprobs_from_logits(z, labels, 0.9, return_entropy=True), (x,)
    )


def test_only_entropy_used_in_loss():
    logits = torch.randn(9, 21)
    labels = torch.randint(0, 21, (9,))
    x = logits.clone().requires_grad_()
    _, ent = logprobs_from_logits(x, labels, return_entropy=True)
    ent.sum().backward()
    xr = logits.double().requires_grad_()
    logprobs_reference(xr, labels)[1].sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, atol=1e-6, rtol=1e-5)


def test_bad_input():
    z = torch.randn(4, 10)
    with pytest.raises(ValueError, match=r"labels must have shape logits.shape\[:-1\]"):
        logprobs_from_logits(z, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must have shape logits.shape\[:-1\]=\(2, 3\)"):
        logprobs_from_logits(torch.randn(2, 3, 10), torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="labels on meta but logits on cpu"):
        logprobs_from_logits(z, torch.zeros(4, dtype=torch.long, device="meta"))
    with pytest.raises(TypeError, match="labels must be an int64"):
        logprobs_from_logits(z, torch.zeros(4))
    with pytest.raises(TypeError, match="logits must be a float tensor"):
        logprobs_from_logits(z.long(), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 10\)"):
        logprobs_from_logits(z, torch.tensor([0, 1, 10, 2]))
    with pytest.raises(ValueError, match="temperature must be a number > 0"):
        logprobs_from_logits(z, torch.zeros(4, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="temperature must be a number > 0, got None"):
        logprobs_from_logits(z, torch.zeros(4, dtype=torch.long), temperature=None)
    with pytest.raises(ValueError, match="backend must be one of"):
        logprobs_from_logits(z, torch.zeros(4, dtype=torch.long), backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton(dtype):
    R, V = 67, 50257  # several vocab blocks per row
    logits = (torch.randn(R, V) * 2).to(dtype)
    labels = torch.randint(0, V, (R,))
    w_lp, w_ent = torch.randn(R), torch.randn(R)
    out = _run(logits.cuda(), labels.cuda(), 0.9, "auto", w_lp.cuda(), w_ent.cuda())
    ref = _ref(logits, labels, 0.9, w_lp, w_ent)
    for o, r in zip(out, ref):
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(o.double().cpu(), r, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_labels_and_logits(backend):
    # labels[::2] and a row-strided logits view: the kernels must not read them as contiguous
    logits = torch.randn(12, 50)[::2]
    labels = torch.randint(0, 50, (12,))[::2]
    w_lp, w_ent = torch.randn(6), torch.randn(6)
    out = _run(logits, labels, 0.8, backend, w_lp, w_ent)
    ref = _ref(logits, labels.contiguous(), 0.8, w_lp, w_ent)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, atol=2e-5, rtol=2e-5)
    logits = torch.randn(50, 6).t()  # vocab stride 6: the kernels index the vocab with stride 1
    out = _run(logits, labels, 0.8, backend, w_lp, w_ent)
    ref = _ref(logits.contiguous(), labels.contiguous(), 0.8, w_lp, w_ent)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shifted_slice_is_not_copied(backend, monkeypatch):
    # the standard shift logits[:, :-1] (B > 1) must be read in place: every saved tensor as
    # large as the logits shares the input's storage, and results match the reference
    monkeypatch.setattr(lp_mod, "_CHUNK_ELEMS", 3 * 37)  # row chunks within each sequence
    full = torch.randn(3, 9, 37, requires_grad=True)
    labels = torch.randint(0, 37, (3, 8))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, ent = logprobs_from_logits(full[:, :-1], labels, 0.7, True, backend=backend)
    big = [t for t in saved if t.numel() >= 3 * 8 * 37]
    assert big, "logits not saved for backward?"
    for t in big:
        assert t.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
    w_lp, w_ent = torch.randn(3, 8), torch.randn(3, 8)
    ((logp * w_lp).sum() + (ent * w_ent).sum()).backward()
    xr = full.detach().double().requires_grad_()
    r_lp, r_ent = logprobs_reference(xr[:, :-1], labels, 0.7)
    ((r_lp * w_lp.double()).sum() + (r_ent * w_ent.double()).sum()).backward()
    for o, r in zip((logp, ent, full.grad), (r_lp, r_ent, xr.grad)):
        torch.testing.assert_close(o.double(), r, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_vocab_minus_inf(backend, monkeypatch):
    # -inf logits (masked vocabulary), incl. a whole -inf vocab block on Triton: finite
    # entropy and gradients equal to the reference (p log p = 0 where p = 0)
    monkeypatch.setattr(lp_mod, "_MAX_BLOCK_V", 16, raising=False)
    logits = torch.randn(5, 67)
    logits[:, 3:40] = float("-inf")
    logits[1, 50:] = float("-inf")
    labels = torch.tensor([0, 1, 2, 45, 60])
    w_lp, w_ent = torch.randn(5), torch.randn(5)
    out = _run(logits, labels, 0.9, backend, w_lp, w_ent)
    ref = _ref(logits, labels, 0.9, w_lp, w_ent)
    assert torch.isfinite(ref[1]).all() and torch.isfinite(ref[2]).all()
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_entropy_relative_to_max(backend):
    # large common offset: entropy accumulated relative to the running max stays accurate
    logits = torch.randn(7, 1003) + 3000
    labels = torch.randint(0, 1003, (7,))
    _, ent = logprobs_from_logits(logits, labels, return_entropy=True, backend=backend)
    _, r_ent = logprobs_reference(logits.double(), labels)
    assert (ent.double() - r_ent).abs().max() < 5e-6


@pytest.mark.parametrize("dtype,scale,tau", [(torch.bfloat16, 4.0, 0.7), (torch.float16, 4e4, 0.5)])
def test_low_precision_logits_divided_by_temperature_in_fp32(dtype, scale, tau):
    """z / tau was divided in bf16/fp16, then upcast: 1.7e-2 log-prob error for bf16 at tau 0.7
    (plain torch 6e-7), NaN for fp16 logits past its range / tau."""
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(3, 5, 50, generator=g) * scale).clamp(-6e4, 6e4).to(dtype)  # finite
    labels = torch.randint(0, 50, (3, 5), generator=g)
    ours = logprobs_from_logits(z, labels, temperature=tau, backend="torch")
    truth = torch.log_softmax(z.double() / tau, -1).gather(-1, labels[..., None])[..., 0]
    plain = torch.log_softmax(z.float() / tau, -1).gather(-1, labels[..., None])[..., 0]
    err, err_plain = ((t.double() - truth).abs().max().item() for t in (ours, plain))
    assert err <= 2 * err_plain + 1e-6, (err, err_plain)
