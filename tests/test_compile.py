"""torch.compile: our attention traces without graph breaks (fullgraph=True), forward and
backward, as custom ops with fake implementations; results equal eager mode.

``backend="aot_eager"`` runs dynamo + AOT autograd (where graph breaks and missing fake
implementations show) without inductor's code generation, which would only add minutes on CPU.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from rlhf_kernels.integrations import hf
from rlhf_kernels.ops.varlen_attention import varlen_attention


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, fullgraph=True, backend="aot_eager")


def _assert_eager_equals_compiled(f, q, k, v):
    """Output and q/k/v gradients of ``f`` equal eager vs fullgraph-compiled (aot_eager)."""
    results = []
    for fn in (f, _compiled(f)):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("return_lse", [False, True])
def test_varlen_attention_fullgraph_fwd_bwd(backend, return_lse):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(37, 4, 16, generator=g)
    k, v = torch.randn(37, 2, 16, generator=g), torch.randn(37, 2, 16, generator=g)
    cu = torch.tensor([0, 9, 10, 37], dtype=torch.int32)

    def f(q, k, v):
        out = varlen_attention(
            q, k, v, cu, cu, 27, 27, causal=True, window_size=(6, 0), return_lse=return_lse,
            backend=backend,
        )  # fmt: skip
        # the lse enters the loss too: its gradient must survive the compiled backward
        return out[0] + 0.3 * out[1].T[..., None] if return_lse else out

    _assert_eager_equals_compiled(f, q, k, v)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("max_k", [None, 4])
def test_compiled_backward_takes_the_forwards_window(backend, max_k):
    """A right side >= max_seqlen_k is unbounded (flash-attn's rule); the compiled backward
    judged the raw window (triton) or against the longest keys (torch), not the forward's
    max_seqlen_k: its gradients were 0.26-0.78 off eager's."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(8, 2, 4, generator=g)
    k, v = torch.randn(3, 2, 4, generator=g), torch.randn(3, 2, 4, generator=g)
    cu_q, cu_k = (
        torch.tensor([0, 2, 8], dtype=torch.int32),
        torch.tensor([0, 1, 3], dtype=torch.int32),
    )

    def f(q, k, v):
        return varlen_attention(
            q, k, v, cu_q, cu_k, None, max_k, causal=False, window_size=(-1, 2), backend=backend
        )

    _assert_eager_equals_compiled(f, q, k, v)


def test_compiled_bad_input_still_raises():
    """Validation moved inside the op: it runs (and raises) at run time, before any work."""
    q = torch.randn(10, 2, 8)
    bad = torch.tensor([0, 7, 4, 10], dtype=torch.int32)  # not non-decreasing
    f = _compiled(lambda q: varlen_attention(q, q, q, bad, bad, 7, 7, backend="torch"))
    with pytest.raises(Exception, match="cu_seqlens"):
        f(q)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "packed_position_ids", "cu_seq_lens", "padded"])
def test_hf_model_fullgraph(layout, tmp_path):
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, attn_implementation=hf.register()
    )
    g = torch.Generator().manual_seed(1)
    if layout == "padded":
        ids = torch.randint(1, 97, (2, 12), generator=g)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[0, :4] = 0
        kw = dict(input_ids=ids, attention_mask=mask)
    else:
        samples = [torch.randint(1, 97, (n,), generator=g) for n in (9, 14, 5)]
        kw = dict(hf.packed_model_inputs(samples))
        kw.pop("labels", None)
        if layout == "single":
            kw = dict(input_ids=kw["input_ids"])
        elif layout == "packed_position_ids":
            kw = dict(input_ids=kw["input_ids"], position_ids=kw["position_ids"])
    results = []
    for fn in (lambda **a: model(**a, use_cache=False).logits, None):
        model.zero_grad()
        fn = fn or _compiled(lambda **a: model(**a, use_cache=False).logits)
        logits = fn(**kw)
        logits.float().square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
        results.append([logits.detach()] + grads)
    assert len(results[0]) == len(results[1]) > 1
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- RL math
N, H, V = 40, 16, 53
_CU = torch.tensor([0, 11, 11, 30, N])  # an empty sequence included


def _rl_inputs():
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[5] = -100
    return dict(
        labels=labels,
        old=-torch.rand(N, generator=g) * 3,
        adv=torch.randn(N, generator=g),
        mask=(torch.rand(N, generator=g) > 0.2).float(),
        rewards=torch.randn(N, generator=g),
    )


def _rl_cases():
    import rlhf_kernels as rk
    from rlhf_kernels.ops.losses import policy_loss

    d = _rl_inputs()
    lab, old, adv, m, cu = d["labels"], d["old"], d["adv"], d["mask"], _CU
    wts = torch.linspace(-1, 1, N)
    return {
        "linear_logprobs": lambda h, w: (rk.linear_logprobs(h, w, lab) * wts).sum(),
        "linear_logprobs_entropy": lambda h, w: sum(
            (t * wts).sum() for t in rk.linear_logprobs(h, w, lab, return_entropy=True)
        ),
        "linear_nll_loss": lambda h, w: rk.linear_nll_loss(h, w, lab, m),
        "linear_logprobs_softcap": lambda h, w: sum(
            (t * wts).sum() for t in rk.linear_logprobs(h, w, lab, return_entropy=True, softcap=2.0)
        ),
        "cross_entropy_softcap": lambda h, w: rk.FusedLinearCrossEntropyLoss(softcap=2.0)(
            w, h, lab
        ),
        "cross_entropy_softcap_smoothing": lambda h, w: rk.FusedLinearCrossEntropyLoss(
            label_smoothing=0.1, softcap=2.0
        )(w, h, lab),
        "cross_entropy_z_loss": lambda h, w: rk.FusedLinearCrossEntropyLoss(
            lse_square_scale=1e-2, label_smoothing=0.1
        )(w, h, lab),
        "linear_policy_loss": lambda h, w: rk.linear_policy_loss(
            h, w, lab, old, adv, m, clip_high=0.28, dual_clip=3.0
        ),
        "linear_policy_loss_seq": lambda h, w: rk.linear_policy_loss(
            h, w, lab, old, adv, m, aggregation="seq-mean-token-mean", cu_seqlens=cu
        ),
        "cross_entropy": lambda h, w: rk.FusedLinearCrossEntropyLoss(label_smoothing=0.1)(
            w, h, lab
        ),
        "cross_entropy_weighted_scaled": lambda h, w: (
            rk.FusedLinearCrossEntropyLoss(
                torch.linspace(0.5, 2.0, V),
                label_smoothing=0.1,
                use_token_scaling=True,
                return_token_accuracy=True,
            )(w, h, lab).loss
        ),  # fmt: skip
        "policy_loss": lambda h, w: policy_loss(
            h[:, 0] - 2, old, adv, m, aggregation="seq-mean-token-sum", cu_seqlens=cu
        ),
        "gae": lambda h, w: sum(
            (t * wts).sum()
            for t in rk.gae(h[:, 0], h[:, 1], gamma=0.9, lam=0.8, cu_seqlens=cu, mask=m)
        ),
        "gae_padded": lambda h, w: sum(
            (t * wts.view(4, 10)).sum()
            for t in rk.gae(
                h[:, 0].view(4, 10), h[:, 1].view(4, 10), gamma=0.9, lam=0.8, mask=m.view(4, 10)
            )
        ),
        "discounted_returns": lambda h, w: (
            rk.discounted_returns(h[:, 0], gamma=0.9, cu_seqlens=cu) * wts
        ).sum(),
    }


@pytest.mark.parametrize("case", list(_rl_cases()))
def test_rl_ops_fullgraph_no_breaks_and_equal_eager(case):
    """0 graph breaks (dynamo.explain), then fullgraph compile: loss and grads equal eager."""
    f = _rl_cases()[case]
    g = torch.Generator().manual_seed(4)
    h0, w0 = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(h0.clone().requires_grad_(), w0.clone().requires_grad_())
    assert explained.graph_break_count == 0, explained.break_reasons
    results = []
    for fn in (f, _compiled(f)):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        results.append((loss.detach(), h.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_rl_ops_compiled_bad_input_still_raises():
    import rlhf_kernels as rk

    h, w = torch.randn(N, H), torch.randn(V, H)
    bad = torch.full((N,), V)  # out of range: checked inside the custom op, at run time
    f = _compiled(lambda h, w: rk.linear_nll_loss(h, w, bad))
    with pytest.raises(Exception, match=r"labels must lie in \[0, 53\)"):
        f(h, w)
    cu_bad = torch.tensor([0, 30, 20, N])
    x = torch.randn(N)
    f = _compiled(lambda x: rk.gae(x, x, gamma=1.0, lam=1.0, cu_seqlens=cu_bad)[0])
    with pytest.raises(Exception, match="non-decreasing"):
        f(x)


@pytest.mark.parametrize("loss", ["nll", "policy"])
def test_compiled_scalar_loss_is_one_pass_skips_pads_and_checks_the_mask(loss, monkeypatch):
    """Under torch.compile ``linear_nll_loss`` and ``linear_policy_loss`` keep eager's one pass
    (gradients made in the forward: 1 logits block per token chunk, none in backward), skip
    pad rows (masked out) at run time, and still refuse a mask value that is not 0/1 (before:
    all three were off for both; then the policy loss took 2 block passes over every row)."""
    import rlhf_kernels as rk
    from rlhf_kernels.ops import linear_logprobs as mod

    g = torch.Generator().manual_seed(5)
    h0 = torch.randn(4, 10, H, generator=g)
    w0 = torch.randn(V, H, generator=g) * 0.3
    lab = torch.randint(0, V, (4, 10), generator=g)
    old = torch.randn(4, 10, generator=g) * 0.2 - 4.0
    adv = torch.randn(4, 10, generator=g)
    mask = torch.ones(4, 10)
    mask[1:, 6:] = 0  # pads
    rows = []
    real = mod._block
    monkeypatch.setattr(
        mod,
        "_block",
        lambda buf, hc, *a, **k: (rows.append(hc.shape[0]), real(buf, hc, *a, **k))[1],
    )
    if loss == "nll":
        f = lambda h, w, m: rk.linear_nll_loss(h, w, lab, m)  # noqa: E731
    else:
        f = lambda h, w, m: rk.linear_policy_loss(  # noqa: E731
            h, w, lab, old, adv, m, clip_high=0.28, dual_clip=3.0
        )
    torch._dynamo.reset()
    explained = torch._dynamo.explain(f)(h0.clone().requires_grad_(), w0.clone(), mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    results = []
    for fn in (f, _compiled(f)):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        rows.clear()
        out = fn(h, w, mask)
        out.backward()
        assert sum(rows) == int(mask.sum()), rows  # only counted rows, one block pass in all
        results.append((out.detach(), h.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert (results[1][1][1:, 6:] == 0).all()
    with pytest.raises(Exception, match="mask values must be 0 or 1"):
        _compiled(f)(h0.clone().requires_grad_(), w0.clone(), mask * 2)


@pytest.mark.parametrize("loss", ["nll", "policy"])
def test_loss_op_fallback_matches_one_pass(loss, monkeypatch):
    """The compiled loss op's fallback (vocabulary too large for one block: blocks, then the
    backward) gives the one-pass loss and gradients, PPO clipping included."""
    from rlhf_kernels.ops import linear_logprobs as mod

    g = torch.Generator().manual_seed(7)
    h, w = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    lab = torch.randint(0, V, (N,), generator=g)
    wt = (torch.rand(N, generator=g) > 0.3).float() / N
    ppo = None
    if loss == "policy":  # ratios on both sides of the clip range
        logp = torch.log_softmax(h @ w.T, -1).gather(1, lab[:, None])[:, 0]
        ref = logp + torch.randn(N, generator=g) * 0.5
        ppo = (ref, torch.randn(N, generator=g), 0.2, 0.28, 3.0)
    needs = [True, True, False]
    want = mod._loss_with_grads(h, w, None, lab, wt, 1.0, None, needs, ppo)
    monkeypatch.setattr(mod, "_fits_one_pass", lambda *a: (False, 1))
    got = mod._loss_with_grads(h, w, None, lab, wt, 1.0, None, needs, ppo)
    for a, b in zip(got[:3], want[:3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_policy_loss_masked_nan_and_constant_inputs_on_every_path(monkeypatch):
    """A NaN at a masked token (old log-prob or advantage of a pad) never leaks, whether a path
    skips the row (compiled op, padded eager) or not (packed eager); old log-probs and
    advantages are constants (no gradient) on every path: one pass, blocks, forward only."""
    import rlhf_kernels as rk
    from rlhf_kernels.ops import linear_logprobs as mod

    g = torch.Generator().manual_seed(9)
    h0, w0 = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    lab = torch.randint(0, V, (N,), generator=g)
    m = torch.ones(N)
    m[-5:] = 0
    old = torch.randn(N, generator=g) * 0.2 - 4.0
    old[-5:] = float("nan")
    adv = torch.randn(N, generator=g)
    adv[-3:] = float("nan")
    f = lambda h, w, a: rk.linear_policy_loss(h, w, lab, old, a, m)  # noqa: E731
    results = []
    for fn in (f, _compiled(f)):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        a = adv.clone().requires_grad_()
        loss = fn(h, w, a)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(h.grad).all() and a.grad is None
        results.append((loss.detach(), h.grad, w.grad))
    for x, y in zip(*results):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(mod, "_fits_one_pass", lambda *a: (False, 1))  # blocks + autograd
    h, w, a = h0.clone().requires_grad_(), w0.clone(), adv.clone().requires_grad_()
    loss = f(h, w, a)
    loss.backward()
    torch.testing.assert_close(loss.detach(), results[0][0], atol=1e-5, rtol=1e-5)
    assert a.grad is None
    assert not f(h0, w0, adv.clone().requires_grad_()).requires_grad  # forward only


def test_compiled_ops_still_check_the_mask():
    """Traced, the 0/1 check runs in an op whose output the caller must use (else the graph
    drops it as dead code): policy loss, whiten, GAE / returns (padded and packed), unpad."""
    from rlhf_kernels.ops.advantages import whiten
    from rlhf_kernels.ops.gae import discounted_returns, gae
    from rlhf_kernels.ops.losses import policy_loss
    from rlhf_kernels.padding import unpad_input

    x = torch.randn(3, 5)
    bad = torch.ones(3, 5)
    bad[0, 0] = 2.0
    cu = torch.tensor([0, 4, 15], dtype=torch.int32)
    for fn in (
        lambda x, m: policy_loss(x, x.detach(), x.detach(), m),
        lambda x, m: whiten(x, m),
        lambda x, m: gae(x, x * 0.5, gamma=0.9, lam=0.8, mask=m, backend="torch"),
        lambda x, m: gae(
            x.flatten(),
            x.flatten(),
            gamma=0.9,
            lam=0.8,
            cu_seqlens=cu,  # packed
            mask=m.flatten(),
            backend="torch",
        ),
        lambda x, m: discounted_returns(x, gamma=0.9, mask=m, backend="torch"),
        lambda x, m: unpad_input(x[..., None], m)[0],
        lambda x, m: unpad_input(x[..., None], m.clamp(max=1), unused_mask=m)[0],
    ):
        torch.testing.assert_close(_compiled(fn)(x, bad.clamp(max=1)), fn(x, bad.clamp(max=1)))
        with pytest.raises(Exception, match="mask values must be 0 or 1"):
            _compiled(fn)(x, bad)


def test_compiled_padded_layout_matches_eager_and_refuses_window_holes():
    """The traced unpadding op returns eager's indices and cu_seqlens; a sliding window still
    refuses padding between real tokens (it would shrink distances)."""
    from rlhf_kernels.ops.compiled import padded_layout

    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    holes = torch.tensor([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    for all_queries in (False, True):
        want = hf._padded_layout_uncached(mask, 5, 5, all_queries)[0][:4]
        got = _compiled(lambda m, a=all_queries: padded_layout(m, 5, 5, True, a))(mask)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)
    assert _compiled(lambda m: padded_layout(m, 5, 5, False, False))(holes)[2].tolist() == [0, 4, 9]
    with pytest.raises(Exception, match="contiguous"):
        _compiled(lambda m: padded_layout(m, 5, 5, True, False))(holes)


def test_nll_op_without_gradients_runs_no_backward_pass(monkeypatch):
    """The compiled NLL op's fallback (vocabulary too large for one block) makes no gradient
    pass when nothing needs a gradient (no_grad, evaluation)."""
    from rlhf_kernels.ops import linear_logprobs as mod

    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(N, H, generator=g), torch.randn(V, H, generator=g)
    lab, wt = torch.randint(0, V, (N,), generator=g), torch.full((N,), 1.0 / N)
    monkeypatch.setattr(mod, "_fits_one_pass", lambda *a: (False, 1))
    want = mod._loss_with_grads(h, w, None, lab, wt, 1.0, None, [True, True, False])
    monkeypatch.setattr(mod, "_backward", lambda *a: pytest.fail("gradient pass without need"))
    loss, dh, dw, db = mod._loss_with_grads(h, w, None, lab, wt, 1.0, None, [False] * 3)
    assert dh is None and dw is None and db is None
    torch.testing.assert_close(loss, want[0])
    ref = -(wt * torch.log_softmax(h @ w.T, -1).gather(1, lab[:, None])[:, 0]).sum()
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_padded_rl_math_compiles_under_inductor():
    """The default backend (inductor, CPU code generation), padded (B, T) layout: sequence
    means over rows compiled to an index_add by row ids that inductor's CPU code generation
    failed on (AssertionError in CppKernel.store); they are row sums now. Values and
    gradients equal eager for the policy losses, value loss, whitening and GAE."""
    import rlhf_kernels as rk

    g = torch.Generator().manual_seed(11)
    B, T = 4, 10
    lab = torch.randint(0, V, (B, T), generator=g)
    old = -torch.rand(B, T, generator=g) * 3
    adv = torch.randn(B, T, generator=g)
    m = (torch.rand(B, T, generator=g) > 0.2).float()
    m[2] = 0  # a fully masked row: not counted by the sequence means
    h0, w0 = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) * 0.3
    cases = {
        f"linear_policy_loss/{agg}": lambda h, w, agg=agg: rk.linear_policy_loss(
            h, w, lab, old, adv, m, aggregation=agg, clip_high=0.28
        )
        for agg in ("seq-mean-token-mean", "seq-mean-token-sum")
    }
    cases.update({
        f"policy_loss/{agg}": lambda h, w, agg=agg: rk.policy_loss(
            h[..., 0] - 3, old, adv, m, aggregation=agg, dual_clip=3.0
        )
        for agg in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
    })  # fmt: skip
    cases["value_loss+whiten+gae"] = lambda h, w: (
        rk.value_loss(h[..., 0], old, rk.whiten(h[..., 1], m), m, clip=0.2)
        + sum(t.square().mean() for t in rk.gae(h[..., 2], h[..., 3], gamma=0.9, lam=0.8, mask=m))
    )
    for name, f in cases.items():
        torch._dynamo.reset()
        results = []
        for fn in (f, torch.compile(f, fullgraph=True)):
            h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
            loss = fn(h, w)
            loss.backward()
            results.append((loss.detach(), h.grad, w.grad))
        for a, b in zip(*results):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
