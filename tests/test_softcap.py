"""Logit soft-capping (Gemma 2's ``final_logit_softcapping``, Liger's ``softcap``) in the fused
lm_head ops: ``u = c * tanh(z / c) / tau`` on every path (4-matmul blocks, one-pass losses,
Triton block passes under the interpreter, no-grad), against float64 full-logit references and
a real Gemma 2 model's own loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlhf_kernels import (
    FusedLinearCrossEntropyLoss,
    fused_linear_cross_entropy,
    linear_logprobs,
    linear_nll_loss,
    linear_policy_loss,
)
from rlhf_kernels.ops import linear_logprobs as lp_mod
from rlhf_kernels.ops.linear_logprobs import linear_logprobs_reference
from rlhf_kernels.ops.losses import policy_loss

T, H, V, CAP = 45, 24, 300, 3.0


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, H, generator=g) * 2  # logits well into tanh's bend (|z| ~ 3-10)
    w = torch.randn(V, H, generator=g) / H**0.5
    b = torch.randn(V, generator=g)
    labels = torch.randint(0, V, (T,), generator=g)
    labels[[3, 17]] = -100
    return h, w, b, labels


def _leaves(*ts, double=False):
    return [t.detach().double().requires_grad_() if double else t.detach().clone().requires_grad_()
            for t in ts]  # fmt: skip


@pytest.mark.parametrize("chunks", [(None, None), (16, 128), (45, 70)])
@pytest.mark.parametrize("triton_blocks", [False, True])
def test_linear_logprobs_softcap_matches_float64(chunks, triton_blocks, monkeypatch):
    if triton_blocks:  # the Triton block passes (interpreter on CPU)
        monkeypatch.setenv("RLHF_KERNELS_LINEAR_TRITON", "1")
    h, w, b, labels = _inputs()
    w_lp, w_ent = torch.randn(T), torch.randn(T)
    tc, vc = chunks
    ours, ref = _leaves(h, w, b), _leaves(h, w, b, double=True)
    lp, ent = linear_logprobs(
        *ours[:2], labels, ours[2], 0.7, True, chunk_tokens=tc, chunk_vocab=vc, softcap=CAP
    )
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    rlp, rent = linear_logprobs_reference(*ref[:2], labels, ref[2], 0.7, softcap=CAP)
    ((rlp * w_lp.double()).sum() + (rent * w_ent.double()).sum()).backward()
    torch.testing.assert_close(lp.double(), rlp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), rent, atol=1e-5, rtol=1e-5)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.grad.double(), r.grad, atol=1e-5, rtol=1e-5)
    # the cap changes the answer (the test would catch a path that ignores it)
    plain = linear_logprobs(h, w, labels, b, 0.7)
    assert (plain - lp.detach()).abs().max() > 0.1


@pytest.mark.parametrize("path", ["one_pass", "vocab_chunks", "no_grad"])
def test_scalar_losses_softcap(path, monkeypatch):
    if path == "vocab_chunks":  # vocab split: linear_logprobs (4 matmuls) + autograd
        monkeypatch.setattr(lp_mod, "_MIN_BUDGET", 512)
        monkeypatch.setattr(lp_mod, "_CPU_ROWS", 0)
        assert not lp_mod._fits_one_pass(T, H, V, cpu=True)[0]
    h, w, b, labels = _inputs(1)
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(T, generator=g) * 6 - 2
    adv, mask = torch.randn(T, generator=g), torch.rand(T, generator=g) > 0.2
    ref = _leaves(h, w, b, double=True)
    rlp, _ = linear_logprobs_reference(*ref[:2], labels, ref[2], 1.3, softcap=CAP)
    keep = mask & (labels != -100)
    r_nll = -(rlp * keep).sum() / keep.sum()
    r_ppo = policy_loss(rlp, old.double(), adv.double(), keep, clip_high=0.28)
    kw = dict(bias=None, temperature=1.3, softcap=CAP)
    for loss_fn, r in (
        (lambda a: linear_nll_loss(a[0], a[1], labels, mask, **{**kw, "bias": a[2]}), r_nll),
        (
            lambda a: linear_policy_loss(
                a[0], a[1], labels, old, adv, mask, clip_high=0.28, **{**kw, "bias": a[2]}
            ),
            r_ppo,
        ),
    ):
        for t in ref:
            t.grad = None
        r.backward(retain_graph=True)
        if path == "no_grad":
            with torch.no_grad():
                got = loss_fn([h, w, b])
            torch.testing.assert_close(got.double(), r.detach(), atol=1e-5, rtol=1e-5)
            continue
        ours = _leaves(h, w, b)
        got = loss_fn(ours)
        got.backward()
        torch.testing.assert_close(got.double(), r.detach(), atol=1e-5, rtol=1e-5)
        for o, rr in zip(ours, ref):
            torch.testing.assert_close(o.grad.double(), rr.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_softcap_matches_torch(reduction):
    h, w, b, labels = _inputs(2)
    x = h.view(5, 9, H)
    y = labels.view(5, 9)
    ours, ref = _leaves(x, w, b), _leaves(x, w, b)
    got = FusedLinearCrossEntropyLoss(reduction=reduction, softcap=CAP)(
        ours[1], ours[0], y, ours[2]
    )
    z = F.linear(ref[0], ref[1], ref[2])
    want = F.cross_entropy((CAP * torch.tanh(z / CAP)).view(-1, V), y.view(-1), reduction=reduction)
    want = want.view(y.shape) if reduction == "none" else want
    wts = torch.linspace(0.5, 2, got.numel()).view_as(got)
    (got * wts).sum().backward()
    (want * wts).sum().backward()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.grad, r.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("extra", ["", "class_weights", "z_loss", "small_blocks"])
def test_cross_entropy_softcap_with_label_smoothing(reduction, extra, monkeypatch):
    """Soft cap and label smoothing together (Liger's kernel takes both): the smoothing term
    needs the mean of the capped logits over the vocabulary (a chunked pass of its own); against
    float64 ``F.cross_entropy`` on capped logits, values and gradients, with class weights,
    z-loss or blocks split over tokens and vocabulary (before: NotImplementedError)."""
    if extra == "small_blocks":  # several token x vocabulary blocks in the capped pass
        monkeypatch.setattr(lp_mod, "_chunk_sizes", lambda T, H, V, cpu=False: (7, 128))
    h, w, b, labels = _inputs(4)
    x, y = h.view(5, 9, H), labels.view(5, 9)
    cw = torch.linspace(0.3, 2.0, V) if extra == "class_weights" else None
    z_scale = 1e-2 if extra == "z_loss" else 0.0
    ours, ref = _leaves(x, w, b), _leaves(x, w, b, double=True)
    got = FusedLinearCrossEntropyLoss(
        cw, label_smoothing=0.1, reduction=reduction, softcap=CAP, lse_square_scale=z_scale
    )(ours[1], ours[0], y, ours[2])
    z = F.linear(ref[0], ref[1], ref[2])
    z = CAP * torch.tanh(z / CAP)
    want = F.cross_entropy(
        z.view(-1, V), y.view(-1), label_smoothing=0.1, reduction=reduction,
        weight=None if cw is None else cw.double(),
    )  # fmt: skip
    if z_scale:
        keep = (y.view(-1) != -100).double()
        z_tok = z_scale * torch.logsumexp(z.view(-1, V), -1).square() * keep
        div = keep.sum() if reduction == "mean" else 1.0  # z-loss reduced like the loss
        want = want + (z_tok if reduction == "none" else z_tok.sum() / div)
    want = want.view(y.shape) if reduction == "none" else want
    wts = torch.linspace(0.5, 2, got.numel(), dtype=torch.float64).view(got.shape)
    (got * wts).sum().backward()
    (want * wts).sum().backward()
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.grad.double(), r.grad, atol=1e-5, rtol=1e-5)


def _bf16_case(seed, H, V, w_scale):
    """64 bf16 rows ``x (64, H)``, weight ``(V, H)``, targets ``y``."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(64, H, generator=g) * 2).bfloat16()
    w = (torch.randn(V, H, generator=g) / w_scale).bfloat16()
    return x, w, torch.randint(0, V, (64,), generator=g)


def _assert_within_twice_torch(ours, torch_loss, x, w):
    """``|ours - float64| <= 2 |plain torch in x's dtype (fp32 logits) - float64|``."""
    ref = torch_loss(x.double(), w.double())
    plain = torch_loss(x, w)
    assert abs(ours.double() - ref) <= 2 * abs(plain.double() - ref) + 1e-6


def _logits(x, w):
    z = F.linear(x, w)
    return z if x.dtype == torch.float64 else z.float()


def test_cross_entropy_softcap_smoothing_bf16_within_twice_torch():
    x, w, y = _bf16_case(8, 128, 700, 11)

    def torch_loss(x, w):
        z = CAP * torch.tanh(_logits(x, w) / CAP)
        return F.cross_entropy(z, y, label_smoothing=0.1)

    ours = fused_linear_cross_entropy(x, w, y, label_smoothing=0.1, softcap=CAP)
    _assert_within_twice_torch(ours, torch_loss, x, w)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("variant", ["plain", "softcap", "smoothing"])
def test_cross_entropy_z_loss_matches_torch(reduction, variant):
    """``lse_square_scale`` (z-loss) and ``return_z_loss``, Liger's meaning: ``s * lse^2`` per
    counted token, inside the loss and reduced like it; the returned term is detached."""
    h, w, b, labels = _inputs(3)
    x, y = h.view(5, 9, H), labels.view(5, 9)
    cap = CAP if variant == "softcap" else None
    smooth = 0.1 if variant == "smoothing" else 0.0
    ours, ref = _leaves(x, w, b), _leaves(x, w, b, double=True)
    fn = FusedLinearCrossEntropyLoss(
        lse_square_scale=1e-2, label_smoothing=smooth, reduction=reduction, softcap=cap,
        return_z_loss=True,
    )  # fmt: skip
    out = fn(ours[1], ours[0], y, ours[2])
    z = F.linear(ref[0], ref[1], ref[2])
    z = z if cap is None else cap * torch.tanh(z / cap)
    keep = (y != -100).double()
    ce = F.cross_entropy(z.view(-1, V), y.view(-1), reduction="none", label_smoothing=smooth)
    z_tok = 1e-2 * torch.logsumexp(z, -1).square() * keep
    if reduction == "none":
        want, want_z = ce.view(y.shape) + z_tok, z_tok
    else:
        div = 1.0 if reduction == "sum" else keep.sum()
        want, want_z = (ce.sum() + z_tok.sum()) / div, z_tok.sum() / div
    wts = torch.linspace(0.5, 2, out.loss.numel(), dtype=torch.float64).view(out.loss.shape)
    (out.loss * wts).sum().backward()
    (want * wts).sum().backward()
    torch.testing.assert_close(out.loss.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.z_loss.double(), want_z.detach(), atol=1e-6, rtol=1e-5)
    assert not out.z_loss.requires_grad and out.token_accuracy is None
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o.grad.double(), r.grad, atol=1e-5, rtol=1e-5)
    # the functional form returns the same CrossEntropyOutput; the z term changes the loss
    plain = fused_linear_cross_entropy(x, w, y, b, label_smoothing=smooth, softcap=cap)
    with_z = fused_linear_cross_entropy(
        x, w, y, b, label_smoothing=smooth, reduction="mean", softcap=cap,
        lse_square_scale=1e-2, return_z_loss=True,
    ).loss  # fmt: skip
    assert with_z - plain > 1e-3


def test_z_loss_bf16_within_twice_torch_and_zero_weight():
    x, w, y = _bf16_case(7, 256, 500, 16)

    def torch_loss(x, w):
        z = _logits(x, w)
        return F.cross_entropy(z, y) + 1e-2 * torch.logsumexp(z, -1).square().mean()

    ours = fused_linear_cross_entropy(x, w, y, lse_square_scale=1e-2)
    _assert_within_twice_torch(ours, torch_loss, x, w)
    # weight 0: the one-pass loss, and a zero z term
    out = fused_linear_cross_entropy(x, w, y, return_z_loss=True)
    assert out.z_loss.item() == 0.0
    torch.testing.assert_close(out.loss, fused_linear_cross_entropy(x, w, y))


def test_liger_constructor_order_and_bad_keywords():
    # liger-kernel 0.8.5: (ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction,
    # softcap, return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy, ...)
    cw = torch.ones(V)
    fn = FusedLinearCrossEntropyLoss(cw, -1, 0.0, 0.0, "sum", 5.0, False, torch.float32, True, True)
    assert (fn.ignore_index, fn.reduction, fn.softcap) == (-1, "sum", 5.0)
    assert fn.ce_weight is cw and fn.use_token_scaling and fn.return_token_accuracy
    for name in ("return_z_loss", "use_token_scaling", "return_token_accuracy"):
        with pytest.raises(TypeError, match=f"{name} must be True or False, got 1"):
            FusedLinearCrossEntropyLoss(**{name: 1})
    h, w, _, labels = _inputs()
    with pytest.raises(ValueError, match=rf"ce_weight must be a \({V},\) tensor"):
        fused_linear_cross_entropy(h, w, labels, ce_weight=torch.ones(V + 1))
    with pytest.raises(TypeError, match="ce_weight must be a floating-point tensor"):
        fused_linear_cross_entropy(h, w, labels, ce_weight=torch.ones(V, dtype=torch.long))
    with pytest.raises(ValueError, match="lse_square_scale must be a number >= 0"):
        fused_linear_cross_entropy(h, w, labels, lse_square_scale=-1e-4)
    for bad in (0.0, -1.0, "30", True):
        with pytest.raises(ValueError, match="softcap must be None or"):
            linear_logprobs(h, w, labels, softcap=bad)


LIGER_FUNCTIONAL = (  # liger_kernel.transformers.functional.liger_fused_linear_cross_entropy
    "input", "weight", "target", "bias", "ce_weight", "ignore_index", "lse_square_scale",
    "label_smoothing", "reduction", "softcap", "return_z_loss", "accum_dtype",
    "use_token_scaling", "return_token_accuracy", "return_predicted_tokens", "chunk_mem_const",
)  # fmt: skip


def test_functional_has_liger_signature():
    """``fused_linear_cross_entropy`` takes liger-kernel 0.8.5's functional parameters in its
    positional order (it took ignore_index fifth, where Liger takes ce_weight): a positional
    call written for Liger means the same here."""
    import inspect

    params = tuple(inspect.signature(fused_linear_cross_entropy).parameters)
    assert params == LIGER_FUNCTIONAL
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
    except ImportError:
        pass
    else:  # installed: the same names as the installed version's
        assert params == tuple(inspect.signature(liger_fused_linear_cross_entropy).parameters)
    h, w, b, labels = _inputs()
    labels[::3] = -100
    cw = torch.linspace(0.5, 2.0, V)
    args = (h, w, labels, b, cw, -100, 1e-3, 0.1, "sum", 5.0, True, torch.float32, True, True)
    positional = fused_linear_cross_entropy(*args, True, 2)
    keywords = fused_linear_cross_entropy(
        **dict(zip(LIGER_FUNCTIONAL, args)), return_predicted_tokens=True, chunk_mem_const=2
    )
    module = FusedLinearCrossEntropyLoss(*args[4:])(w, h, labels, b)
    for out in (keywords, module):
        for f in ("loss", "z_loss", "token_accuracy"):
            torch.testing.assert_close(getattr(out, f), getattr(positional, f), rtol=0, atol=0)
    torch.testing.assert_close(keywords.predicted_tokens, positional.predicted_tokens)
    assert module.predicted_tokens is None  # Liger's module has no such flag
    with pytest.raises(ValueError, match=rf"ce_weight must be a \({V},\) tensor"):
        fused_linear_cross_entropy(h, w, labels, b, -100)  # the old order's ignore_index
    with pytest.raises(TypeError, match="accum_dtype must be None or a floating"):
        fused_linear_cross_entropy(h, w, labels, accum_dtype=torch.int32)
    with pytest.raises(ValueError, match="chunk_mem_const must be a positive int"):
        fused_linear_cross_entropy(h, w, labels, chunk_mem_const=0)


def test_gemma2_fused_sft_loss_equals_model_loss(tmp_path):
    """A real Gemma 2 (final_logit_softcapping): the fused loss on its hidden states and
    lm_head weight equals the model's own loss, gradients included."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=211, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=0.3,
        attn_logit_softcapping=None, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    Gemma2ForCausalLM(cfg).save_pretrained(tmp_path)
    model = Gemma2ForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").float()
    ids = torch.randint(0, 211, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    # the model's own loss, with full logits
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    want = [p.grad.clone() for p in (model.lm_head.weight, model.model.norm.weight)]
    model.zero_grad()
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    shift = F.pad(labels[:, 1:], (0, 1), value=-100)  # position t scores token t + 1
    loss = linear_nll_loss(hidden, model.lm_head.weight, shift, softcap=cfg.final_logit_softcapping)
    loss.backward()
    got = [p.grad for p in (model.lm_head.weight, model.model.norm.weight)]
    torch.testing.assert_close(loss, out.loss, atol=1e-5, rtol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["gemma2", "cohere", "granite"])
def test_trainer_loss_follows_the_models_logit_transform(arch, tmp_path):
    """The trainers' fused SFT loss reads Gemma 2's soft cap and Cohere's / Granite's logit scale
    from the config (before: they were ignored and the loss silently differed from the model's)."""
    import transformers

    from trainers.modeling import CausalLMLoss, head_logit_args

    common = dict(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=0.3)
        cls, expect = transformers.Gemma2ForCausalLM, dict(temperature=0.7, softcap=0.3)
    elif arch == "cohere":
        cfg = transformers.CohereConfig(**common, logit_scale=0.5)
        cls, expect = transformers.CohereForCausalLM, dict(temperature=1.4, softcap=None)
    else:
        cfg = transformers.GraniteConfig(**common, logits_scaling=0.25)
        cls, expect = transformers.GraniteForCausalLM, dict(temperature=0.175, softcap=None)
    torch.manual_seed(0)
    cls(cfg).save_pretrained(tmp_path)
    lm = cls.from_pretrained(tmp_path, attn_implementation="eager")
    assert head_logit_args(lm, 0.7) == expect
    ids = torch.randint(0, 97, (1, 10))
    labels = F.pad(ids[:, 1:], (0, 1), value=-100)
    got = CausalLMLoss(lm)(ids, torch.arange(10)[None], labels) / 9
    want = lm(input_ids=ids, labels=ids).loss
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["gemma2", "cohere", "granite"])
def test_startup_self_check_catches_an_unknown_logit_transform(arch, tmp_path, monkeypatch):
    """``check_head_logits`` (run by the trainers when they load a causal LM): passes when the
    fused head reproduces the model's logits, and names the mismatch when it does not (here:
    ``head_logit_args`` made blind to the config, as for a transform it does not know)."""
    import transformers

    from trainers import modeling

    common = dict(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    cfg, cls = {
        "gemma2": (
            lambda: transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=5.0),
            transformers.Gemma2ForCausalLM,
        ),
        "cohere": (lambda: transformers.CohereConfig(**common, logit_scale=0.5), None),
        "granite": (lambda: transformers.GraniteConfig(**common, logits_scaling=4.0), None),
    }[arch]
    cls = cls or {"cohere": transformers.CohereForCausalLM}.get(
        arch, transformers.GraniteForCausalLM
    )
    torch.manual_seed(0)
    model = cls(cfg())
    with torch.no_grad():  # logits of real magnitude (about +-20), where the transform shows
        model.get_output_embeddings().weight.mul_(60.0)
    model.save_pretrained(tmp_path)
    lm = cls.from_pretrained(tmp_path, attn_implementation="eager")
    assert modeling.check_head_logits(lm) < 1e-3
    monkeypatch.setattr(
        modeling, "head_logit_args", lambda lm, temperature=1.0: dict(temperature=1.0, softcap=None)
    )
    with pytest.raises(ValueError, match="does not reproduce .*ForCausalLM's own log-probs"):
        modeling.check_head_logits(lm)


def test_self_check_turns_dropout_off_and_restores_the_mode():
    import transformers

    from trainers.modeling import check_head_logits

    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.5,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        lm.lm_head.weight.mul_(60.0)
    lm.config._attn_implementation = "eager"  # eager attention applies the dropout
    lm.train()
    assert check_head_logits(lm) < 1e-3 and lm.training


@pytest.mark.parametrize("op", ["logprobs", "smoothing_none"])
def test_fp32_saturated_cap_gradients_within_twice_plain_torch(op):
    """Logits deep in tanh's flat part (z / c ~ 2.5): the factor ``1 - tanh^2`` was rebuilt
    from ``u = c tanh / tau``, two roundings more than torch's tanh backward, each magnified by
    ``1 / (1 - tanh^2)``: measured up to 3.5x plain fp32 torch's error (now at most 1.4x)."""
    cap, rows = 10.0, []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(256, 64, generator=g)
        w = torch.randn(500, 64, generator=g) / 64**0.5 * 3
        b = torch.randn(500, generator=g) * 3 + 25
        y = torch.randint(0, 500, (256,), generator=g)
        up = torch.randn(256, generator=g)

        def grads(fn, dtype, x=x, w=w, b=b, up=up):
            leaves = [t.to(dtype).clone().requires_grad_() for t in (x, w, b)]
            (fn(*leaves) * up.to(dtype)).sum().backward()
            return [t.grad.double() for t in leaves]

        def ref(x, w, b, y=y):
            z = cap * torch.tanh(F.linear(x, w, b) / cap)
            if op == "logprobs":
                return torch.log_softmax(z, -1).gather(1, y[:, None])[:, 0]
            return -F.cross_entropy(z, y, reduction="none", label_smoothing=0.1)

        def ours(x, w, b, y=y):
            if op == "logprobs":
                return linear_logprobs(x, w, y, b, softcap=cap)
            return -fused_linear_cross_entropy(
                x, w, y, b, label_smoothing=0.1, reduction="none", softcap=cap
            )

        exact = grads(ref, torch.float64)
        got, plain = grads(ours, torch.float32), grads(ref, torch.float32)
        err = [(a - e).abs().max() / (p - e).abs().max() for a, p, e in zip(got, plain, exact)]
        rows.append(err)
    ratios = [max(r[i] for r in rows).item() for i in range(3)]
    assert max(ratios) <= 2.0, ratios
