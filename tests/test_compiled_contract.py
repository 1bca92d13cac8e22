"""The custom ops of ``ops/compiled.py`` called directly (eager, no tracing): fake
implementations against the real ones (``torch.library.opcheck``), autograd through each op
against float64 references, and the run-time checks the traced path must keep."""

from __future__ import annotations

import pytest
import torch

from rlhf_kernels.ops import compiled as C
from rlhf_kernels.ops.varlen_attention import varlen_attention, varlen_attention_reference

ops = torch.ops.rlhf_kernels


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ----------------------------------------------------------------------------- fakes
def _opcheck_cases():
    q, k = _randn(7, 2, 4, seed=0), _randn(7, 1, 4, seed=1)  # GQA: 2 query heads, 1 kv head
    cu = _cu([3, 4])
    attn = (cu, cu, 4, 4, 0.5, True, 2, 0, 0.0)
    h, w, b = _randn(6, 8, seed=2), _randn(11, 8, seed=3), _randn(11, seed=4)
    lab, wt = torch.tensor([1, 0, 10, 4, 4, 7]), torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 1.0])
    stats = C.linear_logprobs_fwd(h, w, b, lab, 0.7, True, 4, 4, None)
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    hb, wb, bb = (t.bfloat16() for t in (h, w, b))
    return {
        # float64: the torch backend's lse is float64 too; (heads, total_q)
        "attn_fwd_f64": (
            ops.varlen_attention_fwd,
            (q.double(), k.double(), k.double(), *attn, "torch", False, True),
        ),
        "attn_fwd_bf16": (
            ops.varlen_attention_fwd,
            (q.bfloat16(), k.bfloat16(), k.bfloat16(), *attn, "torch", False, True),
        ),
        "attn_fwd_triton": (ops.varlen_attention_fwd, (q, k, k, *attn, "triton", False)),
        "attn_bwd_triton": (
            ops.varlen_attention_bwd,
            (q, q, k, k, q, _randn(2, 7, seed=5), cu, cu, 0.5, True, 2, 0, 0.0, "triton", False),
        ),
        "segments": (ops.segments_from_position_ids, (torch.tensor([[0, 1, 2, 0, 1]]),)),
        "padded_layout": (ops.padded_layout, (mask, 3, 3, False, False)),
        "padded_layout_pos": (
            ops.padded_layout,
            (mask, 3, 3, False, False, torch.tensor([[0, 0, 1], [0, 1, 0]])),
        ),
        "llp_fwd": (ops.linear_logprobs_fwd, (h, w, b, lab, 0.7, True, 4, 4, 3.0, True, None)),
        # no bias gradient: an empty
        "llp_bwd": (
            ops.linear_logprobs_bwd,
            (h, w, b, lab, 0.7, 4, 4, stats[2], stats[1], wt, None, [True, True, False], None),
        ),
        "loss_fwd_bf16": (
            ops.linear_loss_fwd,
            (hb, wb, bb, lab, wt, None, None, 0.0, 0.0, None, 1.0, None, [True, True, False]),
        ),
        "segment_ids": (ops.segment_ids, (cu, 7)),
        "checked_mask": (ops.checked_mask, (torch.tensor([1.0, 0.0]), "mask")),
        "safe_labels": (ops.safe_labels, (torch.tensor([[1, -100], [3, 2]]), 5, -100, False)),
    }


@pytest.mark.parametrize("case", list(_opcheck_cases()))
def test_fake_matches_real_op(case):
    """Each fake's outputs match the real op's (shape, dtype; also through AOT autograd):
    inductor sizes its buffers from the fake."""
    op, args = _opcheck_cases()[case]
    torch.library.opcheck(op, args, test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


# ----------------------------------------------------------------------------- attention op
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "lens_q, lens_k, causal, window",
    [
        ([37], [37], True, (6, 0)),  # one sequence: the backward's window bound is its keys
        ([40], [12], False, (-1, -1)),  # more query blocks than key blocks (16-row blocks)
    ],
)
def test_attention_op_gradients_equal_float64_reference(backend, lens_q, lens_k, causal, window):
    """out, lse and dq/dk/dv (through the lse too) of the op with autograd, no max_seqlen
    given, against the float64 reference."""
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    q = _randn(sum(lens_q), 2, 8, seed=0)
    k, v = _randn(sum(lens_k), 1, 8, seed=1), _randn(sum(lens_k), 1, 8, seed=2)
    g_out, g_lse = _randn(sum(lens_q), 2, 8, seed=3), _randn(2, sum(lens_q), seed=4)
    got, want = [], []
    for dt, res in ((torch.float32, got), (torch.float64, want)):
        leaves = [t.detach().to(dt).requires_grad_() for t in (q, k, v)]
        if dt == torch.float32:
            out, lse = C.compiled_varlen_attention(
                *leaves, cu_q, cu_k, None, None, 0.3, causal, window, 0.0, True, backend
            )
        else:
            out, lse = varlen_attention_reference(
                *leaves, cu_q, cu_k, 0.3, causal, window_size=window
            )
        torch.autograd.backward((out, lse), (g_out.to(dt), g_lse.to(dt)))
        res += [out.detach(), lse.detach(), *(t.grad for t in leaves)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, atol=2e-4, rtol=2e-4)


def test_attention_op_still_checks_max_seqlen():
    """Inside the op a max_seqlen of 0 under the longest sequence raises, as in eager mode."""
    q, cu = _randn(5, 2, 4, seed=0), _cu([2, 3])
    with pytest.raises(ValueError, match="max_seqlen_q=0 is smaller"):
        C.compiled_varlen_attention(
            q, q, q, cu, cu, 0, None, 0.5, False, (-1, -1), 0.0, False, "torch"
        )


@pytest.mark.parametrize("max_q, max_k", [(-1, None), (None, -1), (-3, 3)])
def test_traced_attention_refuses_negative_max_seqlen(max_q, max_k):
    """A negative max_seqlen raises in eager mode; the traced path took -1 (the op's None) and
    any negative value as not given, and ran."""
    q, cu = _randn(5, 2, 4, seed=0), _cu([2, 3])

    def f(q):
        return varlen_attention(q, q, q, cu, cu, max_q, max_k, backend="torch")

    torch._dynamo.reset()
    for fn in (f, torch.compile(f, fullgraph=True, backend="eager")):
        with pytest.raises(ValueError, match="is smaller than the longest sequence"):
            fn(q)


@pytest.mark.parametrize("max_q, max_k", [(3.5, None), (None, 3.0), ("3", None)])
def test_traced_attention_refuses_a_non_int_max_seqlen(max_q, max_k):
    """As eager: a TypeError, not a float truncated to an int (fullgraph: dynamo's error
    carries ours)."""
    q, cu = _randn(5, 2, 4, seed=0), _cu([2, 3])

    def f(q):
        return varlen_attention(q, q, q, cu, cu, max_q, max_k, backend="torch")

    torch._dynamo.reset()
    for fn in (f, torch.compile(f, backend="eager")):
        with pytest.raises(TypeError, match="must be an int or None, got"):
            fn(q)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="must be an int or None, got"):
        torch.compile(f, fullgraph=True, backend="eager")(q)


def test_traced_flash_attn_lse_refused_before_any_work():
    """flash-attn's lse has no gradient: the traced path refuses it (no CUDA needed)."""
    q, cu = _randn(5, 2, 4, seed=0), _cu([2, 3])
    with pytest.raises(ValueError, match="return_lse under torch.compile needs"):
        C.compiled_varlen_attention(
            q, q, q, cu, cu, None, None, 0.5, True, (-1, -1), 0.0, True, "flash_attn"
        )


# ----------------------------------------------------------------------------- layout ops
def test_segments_op_position_ids_and_segment_numbers():
    """A sample starts at each row and where ``pos[t] != pos[t - 1] + step`` (step 0: segment
    numbers)."""
    pos = torch.tensor([[3, 3, 5, 5, 5, 1], [0, 1, 2, 2, 2, 5]])
    assert ops.segments_from_position_ids(pos, 0).tolist() == [0, 2, 5, 6, 7, 8, 11, 12]
    assert ops.segments_from_position_ids(pos).tolist() == [0, 1, 2, 3, 4, 5, 6, 9, 10, 11, 12]


def test_segments_op_sees_a_write_the_version_counter_misses():
    """The traced path never refreshed the eager cache (the first layer does in eager mode):
    a position_ids buffer rewritten in place without a version bump (``.data``, a NumPy alias,
    ``dist.broadcast``) kept the old segments at the next forward."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])
    assert ops.segments_from_position_ids(pos).tolist() == [0, 3, 6]
    pos.numpy()[:] = [[0, 1, 0, 1, 2, 3]]
    assert ops.segments_from_position_ids(pos).tolist() == [0, 2, 6]


@pytest.mark.slow
def test_compiled_model_sees_a_position_ids_write_the_version_counter_misses(tmp_path):
    """A compiled model's first attention layer refreshes the segments, the others read the
    cache (before: no layer refreshed, so a reused buffer kept the previous forward's samples)."""
    import transformers

    from rlhf_kernels.integrations import hf

    hf.register()
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path, attn_implementation="rlhf_kernels"
    ).eval()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    ids = torch.randint(1, 50, (1, 12))
    pos, pos2 = torch.arange(12)[None], torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]])
    flags, real = [], hf._segments_from_position_ids

    def spy(p, refresh=False, rows=None, step=1):
        flags.append(refresh)
        return real(p, refresh, rows, step)

    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos2.clone()).logits
        compiled(input_ids=ids, position_ids=pos)
        pos.numpy()[:] = pos2.numpy()  # no version bump
        hf._segments_from_position_ids = spy
        try:
            got = compiled(input_ids=ids, position_ids=pos).logits
        finally:
            hf._segments_from_position_ids = real
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert flags == [True, False, False]  # one rebuild per forward


def test_safe_labels_op_maps_ignored_to_zero():
    """``ignore_index`` -> 0 even where it lies past the vocabulary."""
    labels = torch.tensor([[5, 1], [4, 5]])
    assert ops.safe_labels(labels, 5, 5, False).tolist() == [0, 1, 4, 0]
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\)"):
        ops.safe_labels(labels, 5, None, False)


# ----------------------------------------------------------------------------- RL math ops
def _logits64(h, w, b, tau, cap):
    z = h @ w.T + b
    return (z if cap is None else cap * torch.tanh(z / cap)) / tau


@pytest.mark.parametrize("tau, cap", [(0.7, 3.0), (1.0, None)])
def test_linear_logprobs_op_gradients_equal_float64_reference(tau, cap):
    """logp, entropy and aux ``(lse, u_y, sum_v a_v u_v)`` of the op, and their gradients into
    hidden, weight and bias, against float64 autograd."""
    T, H, V = 6, 8, 11
    h, w, b = _randn(T, H, seed=0), _randn(V, H, seed=1) / H**0.5, _randn(V, seed=2)
    lab, a = torch.tensor([1, 0, 10, 4, 4, 7]), torch.rand(V, generator=torch.Generator())
    g = [_randn(T, seed=3), _randn(T, seed=4), _randn(3, T, seed=5)]
    res = []
    for dt in (torch.float32, torch.float64):
        leaves = [t.detach().to(dt).requires_grad_() for t in (h, w, b)]
        if dt == torch.float32:
            lp, ent, _, aux = ops.linear_logprobs_fwd(*leaves, lab, tau, True, 4, 4, cap, True, a)
        else:
            u = _logits64(*leaves, tau, cap)
            logp_all = u.log_softmax(-1)
            lp, ent = logp_all.gather(1, lab[:, None])[:, 0], -(logp_all.exp() * logp_all).sum(-1)
            aux = torch.stack([u.logsumexp(-1), u.gather(1, lab[:, None])[:, 0], u @ a.double()])
        torch.autograd.backward((lp, ent, aux), [t.to(dt) for t in g])
        res.append([lp.detach(), ent.detach(), aux.detach(), *(t.grad for t in leaves)])
    for x, y in zip(*res):
        torch.testing.assert_close(x.double(), y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_linear_logprobs_op_backward_with_one_gradient(frozen):
    """A frozen lm_head (or hidden) without bias: two inputs need no gradient. Their empties
    were one tensor, two outputs of an op aliasing each other: the backward raised."""
    h, w = _randn(6, 8, seed=0), _randn(11, 8, seed=1)
    lab = torch.tensor([1, 0, 10, 4, 4, 7])
    (h if frozen == "weight" else w).requires_grad_()
    lp = ops.linear_logprobs_fwd(h, w, None, lab, 0.7, False, 4, 4, None)[0]
    lp.sum().backward()
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (h64 @ w64.T / 0.7).log_softmax(-1).gather(1, lab[:, None]).sum().backward()
    got, want = (h.grad, h64.grad) if frozen == "weight" else (w.grad, w64.grad)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def _ppo64(lp, ref, adv, lo, hi, dual):
    ratio = (lp - ref).exp()
    loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - lo, 1 + hi))
    return torch.where(adv < 0, torch.minimum(loss, -adv * dual), loss)


@pytest.mark.parametrize("kind", ["nll_smoothed", "ppo"])
def test_linear_loss_op_and_its_gradients_equal_float64_reference(kind):
    """The one-pass loss op: loss and gradients (scaled by the upstream gradient) against
    float64 autograd; label smoothing with a temperature, or PPO with asymmetric clips."""
    T, H, V = 6, 8, 11
    h, w, b = _randn(T, H, seed=0), _randn(V, H, seed=1) / H**0.5, _randn(V, seed=2)
    lab, wt = torch.tensor([1, 0, 10, 4, 4, 7]), torch.tensor([1.0, 0.0, 0.5, 1.0, 2.0, 1.0])
    ref, adv = _randn(T, seed=3) * 0.3 - 2.5, _randn(T, seed=4)
    tau, smooth = (0.7, 0.1) if kind == "nll_smoothed" else (1.0, 0.0)
    ppo = (ref, adv, 0.1, 0.3, 3.0) if kind == "ppo" else (None, None, 0.0, 0.0, None)
    res = []
    for dt in (torch.float32, torch.float64):
        leaves = [t.detach().to(dt).requires_grad_() for t in (h, w, b)]
        if dt == torch.float32:
            loss = ops.linear_loss_fwd(
                *leaves, lab, wt, *ppo, tau, None, [True, True, True], smooth
            )[0]
        else:
            u = _logits64(*leaves, tau, None)
            lp = u.log_softmax(-1).gather(1, lab[:, None])[:, 0]
            if kind == "ppo":
                tok = _ppo64(lp, ref.double(), adv.double(), 0.1, 0.3, 3.0)
            else:
                tok = -lp + smooth * (u.gather(1, lab[:, None])[:, 0] - u.mean(-1))
            loss = (wt.double() * tok).sum()
        (2.5 * loss).backward()
        res.append([loss.detach(), *(t.grad for t in leaves)])
    for x, y in zip(*res):
        torch.testing.assert_close(x.double(), y, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- flash-attn drop-ins
@pytest.mark.parametrize("dense", [False, True])
def test_drop_ins_pass_dropout_and_deterministic_on(dense, monkeypatch):
    """dropout_p and deterministic reach ``varlen_attention`` from both drop-ins."""
    import rlhf_kernels.ops.flash_compat as fc

    seen = []

    def spy(*args, **kw):
        seen.append((args[7], kw["deterministic"]))
        return varlen_attention(*args, **kw)

    monkeypatch.setattr(fc, "varlen_attention", spy)
    q = _randn(2, 3, 2, 8, seed=0)
    if dense:
        fc.flash_attn_func(q, q, q, 0.25, deterministic=True)
    else:
        cu = _cu([3, 3])
        fc.flash_attn_varlen_func(*(q.view(6, 2, 8),) * 3, cu, cu, 3, 3, 0.25, deterministic=True)
    assert seen == [(0.25, True)]
