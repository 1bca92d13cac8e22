"""The trainers' models: a Hugging Face model plus the loss or head read inside ``forward``.

The loss runs inside the wrapper's forward, so under ZeRO-3 the lm_head weight it reads is
gathered there (registered as an external parameter of the wrapper) instead of being an empty
shard. Inputs are one packed ``[1, T]`` row (``cu_seq_lens_*`` / ring context) or a padded
``[B, S]`` batch with ``attention_mask``.
"""

from __future__ import annotations

import torch
from torch import nn

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
        if not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"config.{name} must be a number > 0, got {v!r}")
        scale *= float(v) ** power
    if scale != 1.0 and softcap is not None:
        raise NotImplementedError("a model with both a logit scale and final_logit_softcapping")
    return dict(
        temperature=float(temperature) / scale,
        softcap=None if softcap is None else float(softcap),
    )


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
