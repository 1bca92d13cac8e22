import pytest
import torch

from rlhf_kernels import linear_logprobs
from rlhf_kernels.ops import linear_logprobs as lp_mod
from rlhf_kernels.ops.linear_logprobs import (
    _chunk_sizes,
    linear_logprobs_reference,
    linear_nll_loss,
)

T, H, V = 67, 48, 1003


def _inputs(dtype=torch.float32, bias=True):
    h = torch.randn(T, H, dtype=dtype)
    w = (torch.randn(V, H) / H**0.5).to(dtype)
    b = (torch.randn(V) * 0.1).to(dtype) if bias else None
    labels = torch.randint(0, V, (T,))
    return h, w, b, labels


def _grads(fn, h, w, b, w_lp, w_ent):
    leaves = [t.detach().clone().requires_grad_() for t in (h, w, b) if t is not None]
    if b is None:
        leaves.append(None)
    logp, ent = fn(*leaves)
    ((logp * w_lp.to(logp.dtype)).sum() + (ent * w_ent.to(ent.dtype)).sum()).backward()
    return [logp, ent] + [t.grad for t in leaves if t is not None]


def _ours(labels, tau, **kw):
    return lambda h, w, b: linear_logprobs(h, w, labels, b, tau, return_entropy=True, **kw)


def _ref(labels, tau):
    return lambda h, w, b: linear_logprobs_reference(h, w, labels, b, tau)


@pytest.mark.parametrize("chunks", [(None, None), (16, 256), (29, 1003), (67, 130)])
@pytest.mark.parametrize("bias", [True, False])
def test_fp32_matches_float64(chunks, bias):
    h, w, b, labels = _inputs(bias=bias)
    w_lp, w_ent = torch.randn(T), torch.randn(T)
    tc, vc = chunks
    out = _grads(_ours(labels, 0.8, chunk_tokens=tc, chunk_vocab=vc), h, w, b, w_lp, w_ent)
    ref = _grads(
        _ref(labels, 0.8), h.double(), w.double(), None if b is None else b.double(), w_lp, w_ent
    )
    assert out[0].dtype == torch.float32 and out[1].dtype == torch.float32
    assert len(out) == len(ref)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("triton_blocks", ["0", "1"])
@pytest.mark.parametrize("tau,offset", [(0.7, 0.0), (1.0, 30.0), (0.7, 30.0)])
def test_fp32_within_twice_plain_torch(tau, offset, triton_blocks, monkeypatch):
    """fp32 values and gradients against float64, no worse than twice plain fp32 torch. Were up
    to 8x (dh at tau 0.7: the backward formed u by an addmm with -lse folded in, which CPU BLAS
    rounds unlike the forward's matmul) and 3-6x at a +30 logit offset (``u - lse`` instead of
    ``(u - m) - log s``); entropy 2x (a bmm)."""
    monkeypatch.setenv("RLHF_KERNELS_LINEAR_TRITON", triton_blocks)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(48, 64, generator=g)
    w = torch.randn(1000, 64, generator=g) * 5 / 8
    b = torch.randn(1000, generator=g) + offset
    labels = torch.randint(0, 1000, (48,), generator=g)
    w_lp, w_ent = torch.randn(48, generator=g), torch.randn(48, generator=g)
    out = _grads(_ours(labels, tau, chunk_tokens=16, chunk_vocab=256), h, w, b, w_lp, w_ent)
    plain = _grads(_ref(labels, tau), h, w, b, w_lp, w_ent)  # the same math in fp32
    ref = _grads(_ref(labels, tau), h.double(), w.double(), b.double(), w_lp, w_ent)
    for name, o, p, r in zip(("logp", "entropy", "dh", "dw", "db"), out, plain, ref):
        err, err_plain = ((x.double() - r).abs().max().item() for x in (o, p))
        assert err <= 2 * err_plain, (name, err, err_plain)


def test_bf16_within_twice_torch():
    h, w, b, labels = _inputs(dtype=torch.bfloat16)
    w_lp, w_ent = torch.randn(T), torch.randn(T)
    out = _grads(_ours(labels, 1.0, chunk_tokens=16, chunk_vocab=256), h, w, b, w_lp, w_ent)
    torch_bf16 = _grads(_ref(labels, 1.0), h, w, b, w_lp, w_ent)  # plain torch in bf16
    ref = _grads(_ref(labels, 1.0), h.double(), w.double(), b.double(), w_lp, w_ent)
    for i, (o, t, r) in enumerate(zip(out, torch_bf16, ref)):
        err = (o.double() - r).abs().max()
        err_torch = (t.double() - r).abs().max()
        assert err <= 2 * err_torch, (i, err, err_torch)
    assert out[2].dtype == torch.bfloat16 and out[3].dtype == torch.bfloat16


def test_logp_only_and_hidden_only_grad():
    h, w, _, labels = _inputs(bias=False)
    hh = h.clone().requires_grad_()
    logp = linear_logprobs(hh, w, labels, chunk_tokens=20, chunk_vocab=300)
    assert logp.shape == (T,)
    logp.sum().backward()
    hr = h.double().requires_grad_()
    ref, _ = linear_logprobs_reference(hr, w.double(), labels)
    ref.sum().backward()
    torch.testing.assert_close(logp.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hh.grad.double(), hr.grad, atol=1e-5, rtol=1e-5)


def test_nll_loss_matches_naive_cross_entropy():
    h, w, b, labels = _inputs()
    mask = torch.rand(T) > 0.3
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_nll_loss(hh, ww, labels, mask, bias=b)
    loss.backward()
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    ce = torch.nn.functional.cross_entropy(hr @ wr.T + b.double(), labels, reduction="none")
    ref = (ce * mask).sum() / mask.sum()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hh.grad.double(), hr.grad, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ww.grad.double(), wr.grad, atol=1e-5, rtol=1e-5)


def test_chunk_rule():
    # block budget max(T*H, 2**22) fp32 elements; dweight accumulator (Vc, H) within it
    assert _chunk_sizes(4096, 128, 32768) == (128, 32768)
    tc, vc = _chunk_sizes(32768, 4096, 131072)
    assert vc * 4096 <= 32768 * 4096 and tc * vc <= 32768 * 4096 and vc % 128 == 0
    assert _chunk_sizes(5, 8, 11) == (5, 11)
    # CPU: at least min(T, 256) full-vocabulary rows per block (BLAS re-packs the weight per call)
    assert _chunk_sizes(4096, 128, 32768, cpu=True) == (256, 32768)
    assert _chunk_sizes(2187, 512, 32000, cpu=True) == (512, 16000)
    assert _chunk_sizes(100, 128, 32768, cpu=True) == (100, 32768)  # short input: T rows
    assert lp_mod._fits_one_pass(2187, 512, 32000, cpu=True) == (True, 256)
    assert lp_mod._fits_one_pass(2187, 512, 32000) == (True, 131)
    assert lp_mod._fits_one_pass(60, 512, 32000, cpu=True) == (True, 60)


def test_bad_input():
    h, w, b, labels = _inputs()
    with pytest.raises(ValueError, match="weight must be"):
        linear_logprobs(h, w[:, :5], labels)
    with pytest.raises(ValueError, match=r"labels must have hidden's leading shape \(67,\)"):
        linear_logprobs(h, w, labels[:5])
    with pytest.raises(TypeError, match="weight dtype must equal"):
        linear_logprobs(h, w.half(), labels)
    # float64: computed in fp32, as documented (fp32 out)
    assert linear_logprobs(h.double(), w.double(), labels).dtype == torch.float32
    with pytest.raises(ValueError, match="bias must be"):
        linear_logprobs(h, w, labels, b[:7])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 1003\)"):
        linear_logprobs(h, w, labels.clone().fill_(V))
    with pytest.raises(ValueError, match=r"labels must have hidden's leading shape \(1, 67\)"):
        linear_logprobs(h[None], w, labels)  # padded hidden needs padded labels
    with pytest.raises(ValueError, match=r"hidden must be packed \(T, H\) or padded"):
        linear_logprobs(h[0], w, labels)
    with pytest.raises(ValueError, match="chunk_tokens must be None or an int >= 1"):
        linear_logprobs(h, w, labels, chunk_tokens=0)
    with pytest.raises(ValueError, match="chunk_vocab must be None or an int >= 1, got True"):
        linear_logprobs(h, w, labels, chunk_vocab=True)
    with pytest.raises(TypeError, match="hidden must be a float tensor, got torch.int64"):
        linear_logprobs(h.long(), w, labels)
    for tau in (0.0, -1.0):
        with pytest.raises(ValueError, match="temperature must be a number > 0"):
            linear_logprobs(h, w, labels, temperature=tau)
    with pytest.raises(ValueError, match="hidden, weight, labels, bias must share a device"):
        linear_logprobs(h, w, labels.to("meta"))
    with pytest.raises(ValueError, match="mask must have labels' shape"):
        linear_nll_loss(h, w, labels, torch.ones(3))


@pytest.mark.parametrize("small_budget", [False, True])
def test_nll_loss_paths_temperature_and_bf16(small_budget, monkeypatch):
    if small_budget:  # vocab no longer fits one block: the linear_logprobs path is taken
        monkeypatch.setattr(lp_mod, "_MIN_BUDGET", 2048)
        monkeypatch.setattr(lp_mod, "_CPU_ROWS", 0)
        assert lp_mod._chunk_sizes(T, H, V, cpu=True)[1] < V
    h, w, b, labels = _inputs()
    mask = torch.rand(T) > 0.5
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.detach().to(dtype).clone().requires_grad_() for t in (h, w, b)]
        loss = linear_nll_loss(args[0], args[1], labels, mask, bias=args[2], temperature=0.7)
        (loss * 3).backward()
        ref_args = [t.detach().to(dtype).double().requires_grad_() for t in (h, w, b)]
        lp, _ = linear_logprobs_reference(*ref_args[:2], labels, ref_args[2], 0.7)
        ref = -(lp * mask).sum() / mask.sum()
        (ref * 3).backward()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(loss.double(), ref, atol=tol, rtol=tol)
        for a, r in zip(args, ref_args):
            assert a.grad.dtype == dtype
            torch.testing.assert_close(a.grad.double(), r.grad, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_cuda_bf16_within_twice_torch():
    h, w, b, labels = _inputs(dtype=torch.bfloat16)
    h, w, b, labels = h.cuda(), w.cuda(), b.cuda(), labels.cuda()
    w_lp, w_ent = torch.randn(T, device="cuda"), torch.randn(T, device="cuda")
    out = _grads(_ours(labels, 1.0, chunk_tokens=32, chunk_vocab=512), h, w, b, w_lp, w_ent)
    torch_bf16 = _grads(_ref(labels, 1.0), h, w, b, w_lp, w_ent)
    ref = _grads(_ref(labels, 1.0), h.double(), w.double(), b.double(), w_lp, w_ent)
    for i, (o, t, r) in enumerate(zip(out, torch_bf16, ref)):
        err = (o.double() - r).abs().max()
        assert err <= 2 * (t.double() - r).abs().max(), i


@pytest.mark.parametrize("small_budget", [False, True])
@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_linear_policy_loss_matches_composition(small_budget, agg, monkeypatch):
    from rlhf_kernels.ops.losses import policy_loss

    if small_budget:  # vocab split into chunks: linear_logprobs + policy_loss path
        monkeypatch.setattr(lp_mod, "_MIN_BUDGET", 2048)
        monkeypatch.setattr(lp_mod, "_CPU_ROWS", 0)
        assert not lp_mod._fits_one_pass(T, H, V, cpu=True)[0]
    h, w, b, labels = _inputs()
    old = torch.randn(T) * 0.3 - 7
    adv = torch.randn(T)
    mask = torch.rand(T) > 0.2
    cu = torch.tensor([0, 10, 40, 67])
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, aggregation=agg, cu_seqlens=cu)
    if agg == "seq-mean-token-sum-norm":
        kw["norm_length"] = 48
    args = [t.detach().clone().requires_grad_() for t in (h, w, b)]
    loss = lp_mod.linear_policy_loss(
        args[0], args[1], labels, old, adv, mask, bias=args[2], temperature=0.9, **kw
    )
    loss.backward()
    ref_args = [t.detach().double().requires_grad_() for t in (h, w, b)]
    logp, _ = linear_logprobs_reference(ref_args[0], ref_args[1], labels, ref_args[2], 0.9)
    ref = policy_loss(logp, old.double(), adv.double(), mask, **kw)
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=1e-5)
    for a, r in zip(args, ref_args):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "no_requires_grad"])
def test_fused_losses_forward_only(mode, monkeypatch):
    # without grad the fused losses must not build (or allocate) any gradient buffers
    from contextlib import nullcontext

    made = []
    orig = lp_mod._new_grads
    monkeypatch.setattr(lp_mod, "_new_grads", lambda *a: made.append(a[2]) or orig(*a))
    h, w, b, labels = _inputs()
    old, adv, mask = torch.randn(T) - 7, torch.randn(T), torch.rand(T) > 0.3
    leaves = [t.clone().requires_grad_(mode != "no_requires_grad") for t in (h, w, b)]
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(mode, nullcontext)
    with ctx():
        nll = linear_nll_loss(leaves[0], leaves[1], labels, mask, bias=leaves[2])
        pol = lp_mod.linear_policy_loss(leaves[0], leaves[1], labels, old, adv, mask, bias=b)
    assert made == []
    assert not nll.requires_grad and not pol.requires_grad
    lp, _ = linear_logprobs_reference(h.double(), w.double(), labels, b.double())
    ref = -(lp * mask).sum() / mask.sum()
    torch.testing.assert_close(nll.double(), ref, atol=1e-5, rtol=1e-5)
    from rlhf_kernels.ops.losses import policy_loss

    torch.testing.assert_close(
        pol.double(),
        policy_loss(lp, old.double(), adv.double(), mask, cu_seqlens=torch.tensor([0, T])),
        atol=1e-5,
        rtol=1e-5,
    )


def test_masked_vocab_and_large_offset_entropy():
    # -inf bias masks part of the vocab (several vocab chunks, one all -inf): finite entropy
    # and gradients; a +3000 logit offset keeps entropy accurate (accumulated relative to max)
    h, w, b, labels = _inputs()
    b = b.clone()
    b[256:600] = float("-inf")
    labels = torch.where((labels >= 256) & (labels < 600), labels % 256, labels)
    w_lp, w_ent = torch.randn(T), torch.randn(T)
    out = _grads(_ours(labels, 0.9, chunk_tokens=29, chunk_vocab=256), h, w, b, w_lp, w_ent)
    ref = _grads(_ref(labels, 0.9), h.double(), w.double(), b.double(), w_lp, w_ent)
    for o, r in zip(out[:4], ref[:4]):  # logp, entropy, dhidden, dweight (dbias is -inf-fed)
        assert torch.isfinite(r).all()
        torch.testing.assert_close(o.double(), r, atol=2e-5, rtol=2e-5)
    big = torch.full((V,), 3000.0)
    _, ent = linear_logprobs(h, w, labels, big, return_entropy=True, chunk_vocab=256)
    _, r_ent = linear_logprobs_reference(h.double(), w.double(), labels, big.double())
    _, t_ent = linear_logprobs_reference(h, w, labels, big)  # plain torch fp32, full logits
    err, err_torch = [(e.double() - r_ent).abs().max() for e in (ent, t_ent)]
    assert err <= 2 * err_torch, (err, err_torch)


def test_fused_loss_hands_out_its_gradients_once():
    """The one-pass losses return the gradients they made in forward (scaled in place, no
    second (V, H) copy); a second backward through the same graph is a clear error."""
    h, w, b, labels = _inputs()
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_nll_loss(h, w, labels)
    (3.0 * loss).backward(retain_graph=True)
    ref_h, ref_w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    torch.autograd.backward(3.0 * linear_nll_loss(ref_h, ref_w, labels))
    assert torch.allclose(h.grad, ref_h.grad) and torch.allclose(w.grad, ref_w.grad)
    with pytest.raises(RuntimeError, match="run the loss again"):
        (3.0 * loss).backward()


def test_autocast_casts_the_operands():
    """Under torch.autocast the lm_head operands take the autocast dtype (as the model's own
    lm_head would) and the logit blocks stay fp32: the same as calling with bf16 operands."""
    from rlhf_kernels import linear_logprobs, linear_nll_loss

    g = torch.Generator().manual_seed(0)
    h = torch.randn(5, 8, generator=g, requires_grad=True)
    w = torch.randn(12, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 12, (5,), generator=g)
    b = torch.randn(12, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_logprobs(h, w, y, b)  # bias positional
        loss = linear_nll_loss(hidden=h[None], weight=w, labels=y[None], bias=b)
    want = linear_logprobs(h.bfloat16(), w.bfloat16(), y, b.bfloat16())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(loss, -want.mean(), rtol=1e-6, atol=1e-6)
    loss.backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32


@pytest.mark.parametrize(
    "path,softcap",
    [(p, c) for p in ("fold", "fold_triton", "blocks", "no_grad", "traced", "traced_blocks")
     for c in (None, 3.0) if not (p == "fold_triton" and c)],  # Triton pass: no soft cap
)  # fmt: skip
def test_nll_loss_label_smoothing_matches_cross_entropy(path, softcap, monkeypatch):
    """``label_smoothing`` as ``F.cross_entropy``'s, on logits ``cap(h W^T + b) / tau``, on the
    one pass (torch and Triton gradient blocks), the vocabulary-block path and forward only,
    eager and under torch.compile (the loss op's one pass and its block fallback)."""
    import torch.nn.functional as F

    if path == "fold_triton":
        monkeypatch.setenv("RLHF_KERNELS_LINEAR_TRITON", "1")
    if path.endswith("blocks"):
        monkeypatch.setattr(lp_mod, "_MIN_BUDGET", 2048)
        monkeypatch.setattr(lp_mod, "_CPU_ROWS", 0)
        assert not lp_mod._fits_one_pass(T, H, V, cpu=True)[0]
    nll = linear_nll_loss
    if path.startswith("traced"):
        torch._dynamo.reset()
        nll = torch.compile(linear_nll_loss, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(3)
    h, w = torch.randn(T, H, generator=g), torch.randn(V, H, generator=g) / H**0.5
    b = torch.randn(V, generator=g) * 0.1
    labels = torch.randint(0, V, (T,), generator=g)
    labels[5] = -100
    mask = torch.rand(T, generator=g) > 0.3
    tau, e = 0.7, 0.2

    def run(dtype, ours):
        args = [t.to(dtype).clone().requires_grad_(path != "no_grad") for t in (h, w, b)]
        if ours:
            loss = nll(
                args[0], args[1], labels, mask, bias=args[2], temperature=tau, softcap=softcap,
                label_smoothing=e,
            )  # fmt: skip
        else:
            z = F.linear(*args)
            z = z if softcap is None else softcap * torch.tanh(z / softcap)
            tok = F.cross_entropy(z / tau, labels, reduction="none", label_smoothing=e)
            keep = mask & (labels != -100)
            loss = (tok * keep).sum() / keep.sum()
        if path == "no_grad":
            return [loss]
        (loss * 3).backward()
        return [loss] + [a.grad for a in args]

    with torch.set_grad_enabled(path != "no_grad"):
        got, want = run(torch.float32, True), run(torch.float64, False)
    for a, r in zip(got, want):
        torch.testing.assert_close(a.double(), r, atol=2e-5, rtol=2e-5)
