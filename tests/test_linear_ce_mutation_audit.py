"""Mutation audit of ``ops/fused_linear_ce.py`` and ``ops/linear_logprobs.py`` (CPU / torch paths).

Each test kills a small mutation of the code that the rest of the suite let survive. Pinned:
boundary values (``label_smoothing=1``, a soft cap of fp32's maximum, ``tc == min(T, 32)`` for
the one pass); a non-negative ``ignore_index`` (a real token id) on every path, and its type
check; the argmax of the *capped* logits where tanh saturates; fp32 results with float64 class
weights; the ``z_loss`` field only when asked for; one-wide last token / vocabulary blocks and a
``-inf``-masked first vocabulary block; ``log p = (u - m) - log s`` at a large logit offset;
the ``mean_v u_v`` divisor of the block-path smoothing; chunk overrides and the chunk rule;
and junk at tokens that do not count (out-of-range labels on the unchecked path, NaN hidden
states, NaN / -inf ``old_logp``) staying out of losses and gradients.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf_kernels import FusedLinearCrossEntropyLoss, fused_linear_cross_entropy
from rlhf_kernels.ops import linear_logprobs as lp_mod


def _problem(T=10, H=8, V=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) / 3
    b = torch.randn(V, generator=g, dtype=torch.float64) * 0.3
    y = torch.randint(0, V, (T,), generator=g)
    return x, w, b, y


def _leaves(*ts, dtype=torch.float32):
    return [t.detach().to(dtype).clone().requires_grad_() for t in ts]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_one_is_accepted_and_matches_torch(reduction):
    """``label_smoothing=1`` lies in the documented ``[0, 1]`` (``F.cross_entropy`` takes it):
    the loss is then the uniform cross-entropy alone."""
    x, w, b, y = _problem()
    y[0] = -100
    got = fused_linear_cross_entropy(
        *_leaves(x, w), y, _leaves(b)[0], label_smoothing=1.0, reduction=reduction
    )
    want = F.cross_entropy(F.linear(x, w, b), y, label_smoothing=1.0, reduction=reduction)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    "kw", [{}, dict(label_smoothing=0.1), dict(ce_weight=True), dict(lse_square_scale=1e-2)]
)
def test_non_negative_ignore_index_is_a_token_id(reduction, kw):
    """``ignore_index`` may be a real token id (a pad id): targets equal to it count nowhere,
    the others (ids below and above it) count, on every path, as in ``F.cross_entropy``."""
    x, w, b, y = _problem()
    y[[1, 4, 7]] = 3
    kw = dict(kw)
    cw = torch.linspace(0.5, 2.0, w.shape[0], dtype=torch.float64)
    cw = cw if kw.pop("ce_weight", None) else None
    xs, ws, bs = _leaves(x, w, b)
    got = fused_linear_cross_entropy(
        xs, ws, y, bs, None if cw is None else cw.float(), ignore_index=3, reduction=reduction,
        **kw,
    )  # fmt: skip
    xr, wr, br = _leaves(x, w, b, dtype=torch.float64)
    z = F.linear(xr, wr, br)
    want = F.cross_entropy(
        z, y, weight=cw, ignore_index=3, reduction="none",
        label_smoothing=kw.get("label_smoothing", 0.0),
    )  # fmt: skip
    keep = y != 3
    if kw.get("lse_square_scale"):
        want = want + kw["lse_square_scale"] * torch.logsumexp(z, -1).square() * keep
    denom = keep.sum() if cw is None else cw[y][keep].sum()
    if reduction != "none":
        want = want.sum() if reduction == "sum" else want.sum() / denom
    up = torch.linspace(0.5, 2.0, got.numel()).view(got.shape)
    (got * up).sum().backward()
    (want * up.double()).sum().backward()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for a, r in zip((xs, ws, bs), (xr, wr, br)):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-5, rtol=1e-5)


def test_predictions_are_the_argmax_of_the_capped_logits():
    """Where tanh saturates, capped logits tie (fp32 ``tanh(20) == tanh(30) == 1``): the
    prediction is the argmax of the capped logits (the first of the tie, as the model's own
    capped logits give), not of the raw ones."""
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    w = torch.tensor([[20.0, 0.0], [30.0, 0.0], [-5.0, 0.0]])  # raw logits 20, 30, -5
    out = fused_linear_cross_entropy(
        x, w, torch.tensor([0, 1]), softcap=1.0, return_predicted_tokens=True,
        return_token_accuracy=True,
    )  # fmt: skip
    capped = torch.tanh(x @ w.T)
    assert capped[0, 0] == capped[0, 1]  # the premise: a tie after the cap
    assert torch.equal(out.predicted_tokens, capped.argmax(-1))
    assert torch.equal(out.predicted_tokens, torch.tensor([0, 0]))
    assert out.token_accuracy.item() == 0.5


@pytest.mark.parametrize(
    "kw",
    [dict(ce_weight=True), dict(ce_weight=True, label_smoothing=0.1), dict(use_token_scaling=True)],
)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_unchecked_out_of_range_target_gives_nan_not_an_index_error(kw, reduction, monkeypatch):
    """Where the label range is not checked (CUDA without ``RLHF_KERNELS_DEBUG=1``), an
    out-of-range target makes the loss NaN (its token's, for ``"none"``), also with class
    weights (gathered at a clamped target) and token scaling; the other tokens stay finite."""
    monkeypatch.setattr(lp_mod, "check_label_range", lambda *a, **k: None)  # as on CUDA
    x, w, b, _ = _problem(T=6)
    y = torch.tensor([1, 2, 50, 3, -100, 4])
    kw = dict(kw)
    cw = torch.linspace(0.5, 2.0, w.shape[0]) if kw.pop("ce_weight", None) else None
    loss = fused_linear_cross_entropy(
        x.float(), w.float(), y, b.float(), cw, reduction=reduction, **kw
    )
    if reduction == "none":
        assert torch.equal(loss.isnan(), y == 50)
    else:
        assert loss.isnan()


def test_module_softcap_up_to_fp32_max():
    """The module takes a soft cap up to fp32's largest value (as the function does; the logit
    blocks are fp32), where the cap is a no-op; above it (inf included) it refuses."""
    x, w, b, y = _problem()
    xs, ws, bs = (t.float() for t in (x, w, b))
    loss = FusedLinearCrossEntropyLoss(softcap=lp_mod._F32_MAX)(ws, xs, y, bs)
    want = F.cross_entropy(F.linear(x, w, b), y)
    torch.testing.assert_close(loss.double(), want, atol=1e-4, rtol=1e-4)
    for cap in (float("inf"), 1e39):
        with pytest.raises(ValueError, match="softcap must be None or > 0"):
            FusedLinearCrossEntropyLoss(softcap=cap)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_float64_class_weights_give_a_float32_loss(reduction):
    """Class weights of any floating dtype are constants taken in fp32: the loss stays float32
    (as documented) with float64 ``ce_weight``, and matches float64 torch."""
    x, w, b, y = _problem()
    cw = torch.linspace(0.5, 2.0, w.shape[0], dtype=torch.float64)
    loss = fused_linear_cross_entropy(
        x.float(), w.float(), y, b.float(), cw, label_smoothing=0.1, reduction=reduction
    )
    want = F.cross_entropy(F.linear(x, w, b), y, cw, label_smoothing=0.1, reduction=reduction)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ignore_index", [-100.0, None, "pad"])
def test_ignore_index_must_be_an_int(ignore_index):
    """``ignore_index`` is a target id: a float (which would compare equal to ``-100``), None or
    a string is refused by name, not silently used."""
    x, w, b, y = _problem()
    with pytest.raises(TypeError, match="ignore_index must be an int"):
        fused_linear_cross_entropy(x.float(), w.float(), y, ignore_index=ignore_index)


@pytest.mark.parametrize("return_entropy", [False, True])
def test_blocks_with_a_one_wide_last_chunk(return_entropy):
    """``T`` and ``V`` one more than a multiple of the block shape: the last token block and the
    last vocabulary block are one row / one column wide, and count (forward and backward),
    against float64; labels include the last vocabulary id."""
    x, w, b, y = _problem(T=13, H=8, V=13, seed=2)
    y[[0, 5, 12]] = 12
    up_lp, up_ent = torch.linspace(0.5, 2.0, 13), torch.linspace(-1.0, 1.0, 13)
    xs, ws, bs = _leaves(x, w, b)
    out = lp_mod.linear_logprobs(xs, ws, y, bs, 0.8, return_entropy, chunk_tokens=4, chunk_vocab=4)
    xr, wr, br = _leaves(x, w, b, dtype=torch.float64)
    ref = lp_mod.linear_logprobs_reference(xr, wr, y, br, 0.8)
    got = out if return_entropy else (out,)
    want = ref if return_entropy else ref[:1]
    sum(g_ * u for g_, u in zip(got, (up_lp, up_ent))).sum().backward()
    sum(r * u.double() for r, u in zip(want, (up_lp, up_ent))).sum().backward()
    for a, r in zip((*got, xs.grad, ws.grad, bs.grad), (*want, xr.grad, wr.grad, br.grad)):
        torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=1e-5)


def test_first_vocab_block_masked_by_minus_inf_bias():
    """A ``-inf`` bias over the whole *first* vocabulary block: the running max is still
    ``-inf`` after it, and ``u - m`` must not become ``-inf - (-inf) = NaN``; log-probs, entropy
    and gradients match float64 (the masked ids get probability 0)."""
    x, w, b, y = _problem(T=9, H=8, V=13, seed=3)
    b[:4] = float("-inf")
    y = y.clamp(min=4)
    up_lp, up_ent = torch.linspace(0.5, 2.0, 9), torch.linspace(-1.0, 1.0, 9)
    xs, ws = _leaves(x, w)
    got = lp_mod.linear_logprobs(
        xs, ws, y, b.float(), return_entropy=True, chunk_tokens=4, chunk_vocab=4
    )
    xr, wr = _leaves(x, w, dtype=torch.float64)
    want = lp_mod.linear_logprobs_reference(xr, wr, y, b)
    (got[0] * up_lp + got[1] * up_ent).sum().backward()
    (want[0] * up_lp.double() + want[1] * up_ent.double()).sum().backward()
    for a, r in zip((*got, xs.grad, ws.grad), (*want, xr.grad, wr.grad)):
        torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=1e-5)


def _exact_offset_problem(T=8, H=6, V=40, offset=30000.0):
    """fp32-exact logits near ``offset`` (dyadic operands): any error is the op's own."""
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-3, 4, (T, H), generator=g).double()
    w = torch.randint(-8, 9, (V, H), generator=g).double() / 8
    b = offset + torch.randint(-16, 17, (V,), generator=g).double() / 8
    y = torch.randint(0, V, (T,), generator=g)
    return x, w, b, y


@pytest.mark.parametrize("op", ["linear_logprobs", "blocks", "nll_sum", "ce_none"])
def test_log_probs_at_a_large_common_logit_offset(op):
    """Logits near 30000 (exact in fp32): ``log p = (u - m) - log s``, as ``log_softmax``
    rounds it, is exact to ~1e-6; ``u - (m + log s)`` would round ``log s`` to fp32's spacing
    at 30000 (0.002)."""
    x, w, b, y = _exact_offset_problem()
    xs, ws, bs = (t.float() for t in (x, w, b))
    want = torch.log_softmax(F.linear(x, w, b), -1).gather(1, y[:, None])[:, 0]
    if op in ("linear_logprobs", "blocks"):
        kw = dict(chunk_tokens=3, chunk_vocab=16) if op == "blocks" else {}
        got = lp_mod.linear_logprobs(xs, ws, y, bs, **kw)
    elif op == "nll_sum":  # the one pass with gradients made in the forward
        xs.requires_grad_()
        got, want = lp_mod.linear_nll_loss(xs, ws, y, bias=bs), -want.mean()
    else:
        got = -fused_linear_cross_entropy(xs, ws, y, bs, reduction="none")
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_one_pass_loss_with_a_one_row_last_token_block(smoothing, monkeypatch):
    """The one pass (gradients made in the forward) over token blocks of 32 with ``T = 33``:
    the one-row last block counts in the loss and its hidden-state gradient."""
    monkeypatch.setattr(lp_mod, "_MIN_BUDGET", 32 * 40)
    monkeypatch.setattr(lp_mod, "_CPU_ROWS", 0)
    assert lp_mod._fits_one_pass(33, 6, 40, cpu=True) == (True, 32)
    x, w, b, y = _problem(T=33, H=6, V=40, seed=5)
    xs, ws, bs = _leaves(x, w, b)
    loss = lp_mod.linear_nll_loss(xs, ws, y, bias=bs, label_smoothing=smoothing)
    xr, wr, br = _leaves(x, w, b, dtype=torch.float64)
    want = F.cross_entropy(F.linear(xr, wr, br), y, label_smoothing=smoothing)
    loss.backward()
    want.backward()
    for a, r in zip((loss, xs.grad, ws.grad, bs.grad), (want, xr.grad, wr.grad, br.grad)):
        torch.testing.assert_close(a.double(), r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", ["grad", "no_grad"])
def test_block_path_label_smoothing_mean_of_the_vocabulary(path, monkeypatch):
    """``linear_nll_loss`` with the vocabulary over several blocks (and forward only): the
    smoothing term is ``u_y - sum_v u_v / V``; logits with a common offset of 5 and ``V = 13``
    make a wrong divisor show."""
    monkeypatch.setattr(lp_mod, "_MIN_BUDGET", 256)
    monkeypatch.setattr(lp_mod, "_CPU_ROWS", 0)
    assert not lp_mod._fits_one_pass(40, 6, 13, cpu=True)[0]
    x, w, b, y = _problem(T=40, H=6, V=13, seed=6)
    b = b + 5.0
    xs, ws, bs = _leaves(x, w, b)
    with torch.set_grad_enabled(path == "grad"):
        loss = lp_mod.linear_nll_loss(xs, ws, y, bias=bs, label_smoothing=0.3)
    want = F.cross_entropy(F.linear(x, w, b), y, label_smoothing=0.3)
    torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-5)


def test_small_batches_take_the_one_pass():
    """Up to 32 tokens whose whole-vocabulary block fits the budget take the one pass
    (gradients made in the forward, 3 matmuls): ``tc == min(T, 32)`` qualifies."""
    assert lp_mod._fits_one_pass(20, 6, 40, cpu=True) == (True, 20)
    assert lp_mod._fits_one_pass(32, 6, 40, cpu=True) == (True, 32)
    assert lp_mod._fits_one_pass(1, 4096, 256000) == (True, 1)


def test_chunk_overrides_set_the_block_shape(monkeypatch):
    """``chunk_tokens`` / ``chunk_vocab`` override the token and vocabulary block sizes (in
    that order), in the forward and the backward."""
    seen = []
    for name in ("_forward", "_backward"):
        orig = getattr(lp_mod, name)

        def spy(*args, _orig=orig, _name=name, **kw):
            seen.append((_name, args[5], args[6]))  # (h, w, b_s, labels, inv_tau, tc, vc, ...)
            return _orig(*args, **kw)

        monkeypatch.setattr(lp_mod, name, spy)
    x, w, b, y = _problem(T=10, H=8, V=12)
    xs, ws = _leaves(x, w)
    lp_mod.linear_logprobs(xs, ws, y, chunk_tokens=3, chunk_vocab=5).sum().backward()
    assert seen == [("_forward", 3, 5), ("_backward", 3, 5)]


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_policy_loss_masked_token_with_non_finite_old_logp_stays_out(bad):
    """A masked-out token whose ``old_logp`` is junk (NaN, -inf: e.g. a pad position) adds
    exactly nothing to the one-pass PPO loss or to any gradient: the loss and gradients equal
    those with that token removed, and its hidden-state gradient is 0."""
    x, w, b, y = _problem(T=10, H=8, V=12, seed=7)
    g = torch.Generator().manual_seed(8)
    old = -torch.rand(10, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(10, generator=g, dtype=torch.float64)
    mask = torch.ones(10, dtype=torch.bool)
    mask[4], old[4] = False, bad
    xs, ws, bs = _leaves(x, w, b)
    loss = lp_mod.linear_policy_loss(xs, ws, y, old.float(), adv.float(), mask, bias=bs)
    loss.backward()
    keep = mask.nonzero()[:, 0]
    xr, wr, br = _leaves(x[keep], w, b)
    want = lp_mod.linear_policy_loss(xr, wr, y[keep], old[keep].float(), adv[keep].float(), bias=br)
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(xs.grad[keep], xr.grad)
    assert torch.equal(xs.grad[4], torch.zeros(8))
    torch.testing.assert_close(ws.grad, wr.grad)
    torch.testing.assert_close(bs.grad, br.grad)


def test_unchecked_out_of_range_label_counts_only_where_the_token_counts(monkeypatch):
    """Unchecked labels (as on CUDA): an out-of-range label makes ``linear_nll_loss`` NaN where
    its token counts; under a 0 mask it is left out like the token (the loss of the others)."""
    monkeypatch.setattr(lp_mod, "check_label_range", lambda *a, **k: None)  # as on CUDA
    x, w, b, y = (t.float() if t.is_floating_point() else t for t in _problem(T=6))
    y[2] = 50
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    loss = lp_mod.linear_nll_loss(x, w, y, mask, bias=b)
    keep = mask.nonzero()[:, 0]
    torch.testing.assert_close(loss, lp_mod.linear_nll_loss(x[keep], w, y[keep], bias=b))
    assert lp_mod.linear_nll_loss(x, w, y, bias=b).isnan()


@pytest.mark.parametrize("path", ["one_pass", "blocks", "no_grad"])
def test_smoothing_term_of_a_non_finite_masked_token_stays_out(path, monkeypatch):
    """Packed ``linear_nll_loss`` with label smoothing: a masked token whose hidden state is NaN
    (its logits, ``u_y`` and ``mean_v u_v`` NaN) adds nothing to the loss, on the one pass,
    the vocabulary-block path and forward only (a product with its 0 weight would be NaN)."""
    if path == "blocks":
        monkeypatch.setattr(lp_mod, "_MIN_BUDGET", 64)
        monkeypatch.setattr(lp_mod, "_CPU_ROWS", 0)
        assert not lp_mod._fits_one_pass(6, 8, 12, cpu=True)[0]
    x, w, b, y = (t.float() if t.is_floating_point() else t for t in _problem(T=6))
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    keep = mask.nonzero()[:, 0]
    want = F.cross_entropy(F.linear(x[keep].double(), w.double(), b.double()), y[keep],
                           label_smoothing=0.1)  # fmt: skip
    x[2] = float("nan")
    xs, ws = _leaves(x, w)
    with torch.set_grad_enabled(path != "no_grad"):
        loss = lp_mod.linear_nll_loss(xs, ws, y, mask, bias=b, label_smoothing=0.1)
    torch.testing.assert_close(loss.double(), want, atol=1e-5, rtol=1e-5)


def test_block_budget_follows_the_hidden_states_size():
    """The chunk rule of the module docstring: a budget of ``max(T * H, 2**22)`` fp32 elements
    (at most ``2**27``), ``Vc`` a multiple of 128 filling it, ``Tc = clamp(B // Vc, 16, T)``."""
    assert lp_mod._budget(8192, 4096, 32000) == 8192 * 4096
    assert lp_mod._budget(10**6, 4096, 32000) == 2**27
    assert lp_mod._budget(8, 4096, 128256) == 2**22
    assert lp_mod._chunk_sizes(8192, 4096, 32000) == (4096, 8192)
    assert lp_mod._chunk_sizes(8, 4096, 128256) == (8, 1024)
    assert lp_mod._chunk_sizes(8, 3000, 50000) == (8, 1280)  # 1398 rounded down to 128s
    assert lp_mod._chunk_sizes(300, 64, 50000, cpu=True) == (256, 50000)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_z_loss_field_only_when_asked_for(reduction):
    """``CrossEntropyOutput.z_loss`` is filled only with ``return_z_loss`` (a z-loss weight with
    another ``return_*`` flag leaves it None); asked for with weight 0 it is zeros reduced like
    the loss (``target``'s shape for ``"none"``)."""
    x, w, b, y = (t.float() if t.is_floating_point() else t for t in _problem())
    y = y.view(2, 5)
    out = fused_linear_cross_entropy(
        x.view(2, 5, -1), w, y, b, lse_square_scale=1e-2, reduction=reduction,
        return_token_accuracy=True,
    )  # fmt: skip
    assert out.z_loss is None and out.token_accuracy is not None
    out = fused_linear_cross_entropy(
        x.view(2, 5, -1), w, y, b, reduction=reduction, return_z_loss=True
    )
    shape = y.shape if reduction == "none" else ()
    assert torch.equal(out.z_loss, torch.zeros(shape))
    assert out.loss.shape == shape


def test_token_block_floor_of_16(monkeypatch):
    """``Tc`` is at least 16 rows (``clamp(B // Vc, 16, T)``) where a small budget would give
    fewer (reachable here only with a lowered minimum budget)."""
    monkeypatch.setattr(lp_mod, "_MIN_BUDGET", 1024)
    assert lp_mod._chunk_sizes(40, 16, 300) == (16, 128)
    assert lp_mod._chunk_sizes(10, 16, 300) == (10, 128)
