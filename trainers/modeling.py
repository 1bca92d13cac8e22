"""The trainers' models: a Hugging Face model plus the loss or head read inside ``forward``.

The loss runs inside the wrapper's forward, so under ZeRO-3 the lm_head weight it reads is
gathered there (registered as an external parameter of the wrapper) instead of being an empty
shard. Inputs are one packed ``[1, T]`` row (``cu_seq_lens_*`` / ring context) or a padded
``[B, S]`` batch with ``attention_mask``.
"""

from __future__ import annotations

import torch
from torch import nn

from rlhf_kernels._checks import is_real
from rlhf_kernels.ops.linear_logprobs import linear_nll_loss
from rlhf_kernels.packing import IGNORE_INDEX


def base_model(model: nn.Module) -> nn.Module:
    """The transformer body of an HF ``*ForCausalLM`` / ``*ForSequenceClassification``."""
    return getattr(model, model.base_model_prefix)


def _hidden(model: nn.Module, input_ids, position_ids, attention_mask, attn_kwargs) -> torch.Tensor:
    out = base_model(model)(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=False,
        **attn_kwargs,
    )
    return out.last_hidden_state  # (B, S, H)


def head_logit_args(lm: nn.Module, temperature: float = 1.0) -> dict:
    """``temperature`` / ``softcap`` keywords for the fused lm_head ops that reproduce the
    model's own logits. transformers models that change the logits after ``lm_head``:
    Gemma 2/3/4 ``final_logit_softcapping`` (``c * tanh(z / c)``), Cohere ``logit_scale``
    (``z * s``), Granite ``logits_scaling`` (``z / s``), Falcon-H1 ``lm_head_multiplier``
    (``z * s``); the scales fold into the temperature. Without them a fused loss on such a model
    would silently score other logits than the model's."""
    cfg = getattr(lm, "config", None)
    cfg = getattr(cfg, "text_config", None) or cfg
    softcap = getattr(cfg, "final_logit_softcapping", None)
    scale = 1.0  # logits = scale * z
    for name, power in (("logit_scale", 1), ("lm_head_multiplier", 1), ("logits_scaling", -1)):
        v = getattr(cfg, name, None)
        if v is None:
            continue
        if not is_real(v, finite=True, positive=True):
            raise ValueError(f"config.{name} must be a finite number > 0, got {v!r}")
        scale *= float(v) ** power
    if scale != 1.0 and softcap is not None:
        raise NotImplementedError("a model with both a logit scale and final_logit_softcapping")
    return dict(
        temperature=float(temperature) / scale,
        softcap=None if softcap is None else float(softcap),
    )


def check_head_logits(lm: nn.Module, tokens: int = 4) -> float:
    """Start-up self-check: the fused lm_head with :func:`head_logit_args` must reproduce the
    model's own log-probs on a few tokens, else the trainers would score other logits than the
    model's (a model that transforms its logits in a way ``head_logit_args`` does not know).

    Runs the whole model (its own ``forward``, logits included) and the body alone on
    ``tokens`` ids, and compares the log-probs of the most and least likely next token. Returns
    the largest difference; raises ValueError above ``tol = c * (1 + max |logit|)``, with ``c``
    1e-4 for fp32 and 2^-6 for bf16/fp16 (a few roundings of a logit in that dtype). Catches
    transforms that change logits of real magnitude (a soft cap, a scale); on a model whose
    logits are all tiny a soft cap is invisible and passes.
    """
    head = lm.get_output_embeddings()
    device = head.weight.device
    n = min(tokens, head.weight.shape[0])
    training = lm.training
    lm.eval()  # dropout off: both forwards must see the same hidden states
    try:
        return _check_head_logits(lm, head, device, n)
    finally:
        lm.train(training)


@torch.no_grad()
def _check_head_logits(lm, head, device, n):
    from rlhf_kernels.ops.linear_logprobs import linear_logprobs

    ids = torch.arange(1, n + 1, device=device)[None] % head.weight.shape[0]
    pos = torch.arange(n, device=device)[None]
    z = lm(input_ids=ids, position_ids=pos, use_cache=False).logits[0].float()  # (n, V)
    hidden = _hidden(lm, ids, pos, None, {})[0]
    labels = torch.cat([z.argmax(-1), z.argmin(-1)])
    ref = z.log_softmax(-1).repeat(2, 1).gather(1, labels[:, None])[:, 0]
    ours = linear_logprobs(
        hidden.repeat(2, 1), head.weight, labels, head.bias, **head_logit_args(lm)
    ).float()
    diff = (ours - ref).abs().max().item()
    c = 1e-4 if head.weight.dtype == torch.float32 else 2.0**-6
    tol = c * (1.0 + z.abs().max().item())
    if not diff <= tol:
        raise ValueError(
            f"the fused lm_head does not reproduce {type(lm).__name__}'s own log-probs: max "
            f"|difference| {diff:.3g} > {tol:.3g} on {n} tokens. The model changes its logits "
            "after lm_head in a way rlhf_kernels does not read from its config (it knows "
            "final_logit_softcapping, logit_scale, logits_scaling, lm_head_multiplier); the "
            "trainers would train on other logits than the model's"
        )
    return diff


def _register_external(module: nn.Module, params) -> None:
    try:
        from deepspeed.zero import register_external_parameter
    except ImportError:
        return
    for p in params:
        register_external_parameter(module, p)


class CausalLMLoss(nn.Module):
    """``forward(...) -> sum of -log p(label)`` over tokens whose label is not -100 (fp32).

    Labels are next-token targets aligned with the inputs (``labels[t]`` is predicted at ``t``).
    The lm_head runs fused with the log-softmax (``linear_nll_loss``): no ``(T, V)`` logits,
    and only target tokens go through it.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        head = lm.get_output_embeddings()
        _register_external(self, [p for p in head.parameters()])
        self.logit_args = head_logit_args(lm)

    def forward(self, input_ids, position_ids, labels, attention_mask=None, **attn_kwargs):
        hidden = _hidden(self.lm, input_ids, position_ids, attention_mask, attn_kwargs)
        head = self.lm.get_output_embeddings()
        sel = labels != IGNORE_INDEX
        h = hidden[sel]  # (n, H)
        n = h.shape[0]
        if n == 0:  # keep every parameter in the graph (ZeRO hooks expect a gradient)
            return hidden.sum() * 0.0 + head.weight.sum() * 0.0
        return linear_nll_loss(h, head.weight, labels[sel], bias=head.bias, **self.logit_args) * n


class RewardModel(nn.Module):
    """``forward(..., last_index) -> (n,)`` fp32 rewards read at each sequence's last token.

    ``model`` is an HF ``*ForSequenceClassification`` with ``num_labels == 1`` (its ``score``
    head, saved with the model, so ``from_pretrained`` reloads the reward model by path).
    ``last_index``: indices into the flattened ``(B * S)`` hidden states.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, last_index, attention_mask=None, **attn_kwargs):
        hidden = _hidden(self.model, input_ids, position_ids, attention_mask, attn_kwargs)
        h = hidden.reshape(-1, hidden.shape[-1])[last_index]
        return self.model.score(h).squeeze(-1).float()
