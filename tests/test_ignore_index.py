"""ignore_index (-100 by default) in every log-prob op and backend, out-of-range labels, the
fp32 logits of ``linear_logprobs`` and its Triton block passes (under the interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf_kernels.ops import linear_logprobs as llp_mod
from rlhf_kernels.ops import logprobs as lp_mod
from rlhf_kernels.ops.linear_logprobs import (
    linear_logprobs,
    linear_logprobs_reference,
    linear_nll_loss,
    linear_policy_loss,
)
from rlhf_kernels.ops.logprobs import logprobs_from_logits, logprobs_reference
from rlhf_kernels.ops.losses import policy_loss


def _labels(T, V, ignored, seed=0):
    g = torch.Generator().manual_seed(seed)
    lab = torch.randint(0, V, (T,), generator=g)
    lab[ignored] = -100
    return lab


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logprobs_ignore_index(backend, dtype):
    if dtype == torch.float64 and backend == "triton":
        pytest.skip("float64 always takes the reference path")
    T, V = 12, 50
    ignored = torch.tensor([0, 3, 4, 11])
    lab = _labels(T, V, ignored)
    z = torch.randn(T, V, dtype=dtype, requires_grad=True)
    logp, ent = logprobs_from_logits(z, lab, 0.8, True, backend=backend)
    keep = lab != -100
    ref_lp, ref_ent = logprobs_reference(z.detach().double(), lab, 0.8)
    assert (logp[~keep] == 0).all()
    torch.testing.assert_close(logp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
    logp.sum().backward()
    # no gradient at ignored rows from logp; the others get onehot - p
    assert (z.grad[~keep] == 0).all()
    p = torch.softmax(z.detach().double() / 0.8, -1)
    want = (F.one_hot(lab[keep], V).double() - p[keep]) / 0.8
    torch.testing.assert_close(z.grad[keep].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_logprobs_other_labels_refused_or_nan(backend, monkeypatch):
    z = torch.randn(4, 10)
    with pytest.raises(ValueError, match=r"\[0, 10\) or ignore_index=-100; got 1 other"):
        logprobs_from_logits(z, torch.tensor([1, 2, 10, -100]), backend=backend)
    with pytest.raises(ValueError, match="got 1 other"):  # -100 is a label when not ignored
        logprobs_from_logits(z, torch.tensor([1, 2, 3, -100]), ignore_index=None)
    # where the check is off (CUDA without RLHF_KERNELS_DEBUG): NaN, never an out-of-row read
    monkeypatch.setattr(lp_mod, "check_label_range", lambda *a: None)
    out = logprobs_from_logits(z, torch.tensor([1, -7, 10, -100]), backend=backend)
    assert torch.isfinite(out[0]) and out[1].isnan() and out[2].isnan() and out[3] == 0


def test_logprobs_custom_ignore_index():
    z = torch.randn(3, 5)
    out = logprobs_from_logits(z, torch.tensor([4, 0, 2]), ignore_index=0)
    assert out[1] == 0 and out[0] != 0


@pytest.fixture(params=["torch", "triton"])
def linear_path(request, monkeypatch):
    monkeypatch.setenv("RLHF_KERNELS_LINEAR_TRITON", "1" if request.param == "triton" else "0")
    return request.param


def _linear_problem(T=40, H=16, V=70, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) / 2).to(dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(dtype).requires_grad_()
    return h, w, b


def test_linear_logprobs_ignore_index_and_paths(linear_path):
    h, w, b = _linear_problem()
    lab = _labels(40, 70, torch.tensor([0, 5, 6, 39]))
    g = torch.Generator().manual_seed(3)
    g_lp, g_ent = torch.randn(40, generator=g), torch.randn(40, generator=g)
    # small chunks: several token and vocab blocks, label in a later vocab chunk
    logp, ent = linear_logprobs(h, w, lab, b, 0.7, True, chunk_tokens=16, chunk_vocab=32)
    ((logp * g_lp).sum() + (ent * g_ent).sum()).backward()
    got = [logp, ent, h.grad, w.grad, b.grad]
    leaves = [t.detach().double().requires_grad_() for t in (h, w, b)]
    r_lp, r_ent = linear_logprobs_reference(leaves[0], leaves[1], lab, leaves[2], 0.7)
    ((r_lp * g_lp.double()).sum() + (r_ent * g_ent.double()).sum()).backward()
    want = [r_lp, r_ent] + [t.grad for t in leaves]
    for a, r in zip(got, want):
        torch.testing.assert_close(a.double(), r, atol=2e-5, rtol=2e-5)
    assert (logp[lab == -100] == 0).all()


def test_linear_losses_ignore_index_match_cross_entropy(linear_path):
    h, w, b = _linear_problem()
    lab = _labels(40, 70, torch.tensor([1, 2, 30]))
    loss = linear_nll_loss(h, w, lab, bias=b)
    loss.backward()
    leaves = [t.detach().clone().requires_grad_() for t in (h, w, b)]
    ref = F.cross_entropy(F.linear(*leaves), lab, ignore_index=-100)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for a, r in zip((h, w, b), leaves):
        torch.testing.assert_close(a.grad, r.grad, atol=1e-5, rtol=1e-5)
    # policy loss: a -100 label counts as masked
    old, adv = torch.randn(40) - 4, torch.randn(40)
    cu = torch.tensor([0, 10, 25, 40])
    got = linear_policy_loss(
        h, w, lab, old, adv, bias=b, aggregation="seq-mean-token-mean", cu_seqlens=cu
    )
    with torch.no_grad():
        logp = linear_logprobs_reference(h, w, lab, b)[0]
    want = policy_loss(
        logp, old, adv, mask=lab != -100, aggregation="seq-mean-token-mean", cu_seqlens=cu
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_linear_unchecked_out_of_range_label_is_nan(monkeypatch):
    monkeypatch.setattr(llp_mod, "check_label_range", lambda *a: None)
    h, w, b = _linear_problem()
    lab = _labels(40, 70, torch.tensor([2]))
    lab[7] = 70
    assert linear_logprobs(h, w, lab)[7].isnan()
    assert linear_nll_loss(h, w, lab).isnan()
    lab[7] = -100  # ignored: finite again
    assert torch.isfinite(linear_nll_loss(h, w, lab))


def test_linear_bf16_logits_accumulate_in_fp32(linear_path):
    """Logits near 30: rounding them to bf16 (as a bf16 matmul output would) costs up to 0.125
    in logp; fp32 logits keep the error at the level of the bf16 inputs' own products."""
    T, H, V = 32, 64, 96
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, H, generator=g).bfloat16()
    w = (torch.randn(V, H, generator=g) * 0.05).bfloat16()
    w[:, 0] = 30.0 / h[:, 0].float().abs().mean()  # a large common logit offset
    lab = torch.randint(0, V, (T,), generator=g)
    ref = linear_logprobs_reference(h.double(), w.double(), lab)[0]
    got = linear_logprobs(h, w, lab)
    rounded = torch.log_softmax((h @ w.T).float(), -1).gather(1, lab[:, None])[:, 0]
    err = (got.double() - ref).abs().max().item()
    err_rounded = (rounded.double() - ref).abs().max().item()
    assert err < 1e-4 < err_rounded, (err, err_rounded)


def test_chunk_budget_is_capped():
    tc, vc = llp_mod._chunk_sizes(131072, 8192, 131072)
    assert tc * vc <= llp_mod._MAX_BUDGET and vc * 8192 <= llp_mod._MAX_BUDGET


@pytest.mark.gpu
def test_cuda_ignore_index_and_out_of_range():
    """Compiled kernels: -100 gives 0 / no gradient, an unchecked out-of-range label NaN
    (before: an out-of-bounds read and garbage log-probs)."""
    T, V = 64, 1000
    lab = _labels(T, V, torch.tensor([0, 9, 63])).cuda()
    lab[5] = V + 123  # out of range, not ignored: the CUDA path does not sync to check it
    z = torch.randn(T, V, device="cuda", requires_grad=True)
    logp = logprobs_from_logits(z, lab, backend="triton")
    assert (logp[[0, 9, 63]] == 0).all() and logp[5].isnan()
    keep = torch.ones(T, dtype=torch.bool, device="cuda")
    keep[[0, 5, 9, 63]] = False
    ref = logprobs_reference(z.detach().double(), lab.clamp(max=V - 1), 1.0)[0]
    torch.testing.assert_close(logp[keep].double(), ref[keep], atol=1e-5, rtol=1e-5)
    logp[keep].sum().backward()
    assert (z.grad[[0, 9, 63]] == 0).all()
    h, w, _ = (t.cuda().bfloat16() for t in _linear_problem(T=256, H=64, V=V))
    lab2 = _labels(256, V, torch.tensor([3, 4])).cuda()
    got = linear_logprobs(h, w, lab2)
    ref2 = linear_logprobs_reference(h.double(), w.double(), lab2)[0]
    assert (got[[3, 4]] == 0).all()
    assert (got.double() - ref2).abs().max().item() < 1e-3  # fp32 logits from bf16 inputs


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_launch_on_tensor_device_not_current_device():
    from rlhf_kernels.ops.varlen_attention import varlen_attention

    dev = torch.device("cuda", 1)
    assert torch.cuda.current_device() == 0
    z = torch.randn(8, 100, device=dev)
    lab = torch.randint(0, 100, (8,), device=dev)
    ref = logprobs_reference(z.double(), lab)[0]
    torch.testing.assert_close(
        logprobs_from_logits(z, lab, backend="triton").double(), ref, atol=1e-5, rtol=1e-5
    )
    q = torch.randn(32, 2, 64, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, 10, 32], device=dev, dtype=torch.int32)
    out = varlen_attention(q, q, q, cu, cu, 22, 22, causal=True, backend="triton")
    want = varlen_attention(q.cpu().float(), q.cpu().float(), q.cpu().float(), cu.cpu(),
                            cu.cpu(), 22, 22, causal=True, backend="torch")  # fmt: skip
    torch.testing.assert_close(out.float().cpu(), want, atol=2e-2, rtol=2e-2)
