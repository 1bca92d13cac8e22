"""Fused linear + cross-entropy with liger-kernel's interface, on our fused log-prob op.

Switching from Liger is a change of import::

    from rlhf_kernels import FusedLinearCrossEntropyLoss   # was LigerFusedLinearCrossEntropyLoss
    loss = FusedLinearCrossEntropyLoss(ignore_index=-100)(lm_head.weight, hidden, labels)

The ``(tokens, vocab)`` logits never exist: ``reduction="mean"|"sum"`` runs
:func:`~rlhf_kernels.ops.linear_logprobs.linear_nll_loss` (gradients made in the forward, fp32
weight-gradient accumulation), ``reduction="none"`` runs ``linear_logprobs`` (per-token values).
Label smoothing needs no logits either: with ``u = h W^T + b``,
``loss = (1 - e) (lse - u_y) + e (lse - mean_v u_v) = -logp_y + e (u_y - mean_v u_v)``, and
``mean_v u_v = h . mean_v W_v + mean_v b_v`` is one ``(T, H) x (H,)`` product. ``softcap``
(Gemma 2's final logit soft-capping, ``u = c tanh(z / c)``) runs inside the fused op; with it
that mean is no longer linear in ``h``, so soft cap and label smoothing together are refused.
The z-loss (``lse_square_scale * lse^2`` per token, Liger's / PaLM's) needs no logits either:
``lse = u_y - logp_y``, with ``u_y = h . W_y + b_y`` a gather and a row dot product; it takes
the per-token op (4 matmuls) instead of the one-pass loss (3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_kernels.ops.linear_logprobs import _positive_number, linear_logprobs, linear_nll_loss

REDUCTIONS = ("mean", "sum", "none")


@dataclass
class CrossEntropyOutput:
    """What the module returns with ``return_z_loss=True`` (Liger's field names); ``z_loss`` is
    the reduced z-loss term, already inside ``loss``, detached (for logging)."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


def fused_linear_cross_entropy(
    _input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: float | None = None,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``F.cross_entropy(F.linear(_input, weight, bias), target, ...)`` without the logits.

    Args:
        _input: ``(..., H)`` hidden states (any leading shape), fp32/bf16/fp16.
        weight: ``(V, H)`` lm_head weight, ``_input``'s dtype. bias: optional ``(V,)``.
        target: int64 ``(...)`` (``_input``'s leading shape) ids in ``[0, V)`` or
            ``ignore_index``; those tokens count in no reduction (as in ``F.cross_entropy``).
        label_smoothing: in ``[0, 1]``, ``F.cross_entropy``'s meaning.
        reduction: ``"mean"`` (over non-ignored tokens; 0 if none), ``"sum"`` or ``"none"``
            (``target``'s shape, 0 at ignored tokens).
        softcap: ``None`` or ``c > 0``: logits ``c * tanh(z / c)`` (as Liger and Gemma 2).
        lse_square_scale: z-loss weight ``s >= 0``: ``s * logsumexp(logits)^2`` is added per
            counted token (Liger's meaning), reduced like the loss.
        return_z_loss: also return that reduced z-loss term (detached, for logging).
    Returns: float32 loss (``target``'s shape for ``"none"``), or ``(loss, z_loss)``.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if not lse_square_scale >= 0.0:
        raise ValueError(f"lse_square_scale must be >= 0, got {lse_square_scale}")
    if softcap is not None and label_smoothing:
        raise NotImplementedError(
            f"softcap={softcap} with label_smoothing={label_smoothing}: the smoothing term needs "
            "the mean of the capped logits over the vocabulary, which the fused op does not "
            "form; use one of the two"
        )
    if not isinstance(_input, torch.Tensor) or _input.dim() < 1:
        raise ValueError(f"_input must be a (..., H) tensor, got {type(_input).__name__}")
    if not isinstance(target, torch.Tensor) or target.shape != _input.shape[:-1]:
        raise ValueError(
            f"target must have _input's leading shape {tuple(_input.shape[:-1])}, got "
            f"{tuple(getattr(target, 'shape', ()))}"
        )
    h, y = _input.reshape(-1, _input.shape[-1]), target.reshape(-1)
    keep = y != ignore_index
    z_loss = None
    if lse_square_scale:  # per-token log-probs, then lse = u_y - logp_y
        logp = linear_logprobs(h, weight, y, bias, ignore_index=ignore_index, softcap=softcap)
        y_safe = y.masked_fill(~keep, 0).clamp(0, weight.shape[0] - 1)  # bad labels: NaN logp
        lse = (_target_logit(h, weight, y_safe, bias, softcap) - logp) * keep
        z_tok = lse_square_scale * lse.square()
        nll = _reduce(z_tok - logp, keep, reduction)
        z_loss = _reduce(z_tok.detach(), keep, reduction)
    elif reduction == "none":
        nll = -linear_logprobs(h, weight, y, bias, ignore_index=ignore_index, softcap=softcap)
    else:
        # as one padded row: tokens with an ignored target (pads, prompts) skip the matmuls
        nll = linear_nll_loss(
            h[None], weight, y[None], bias=bias, ignore_index=ignore_index, softcap=softcap
        )
        if reduction == "sum":
            nll = nll * keep.sum()
    if return_z_loss and z_loss is None:  # asked for with weight 0: zeros, one-pass loss kept
        z_loss = _reduce(torch.zeros(y.shape, device=h.device), keep, reduction)
    if label_smoothing:
        nll = nll + label_smoothing * _smoothing_term(h, weight, y, bias, keep, reduction)
    if reduction == "none":
        nll = nll.view(target.shape)
        z_loss = None if z_loss is None else z_loss.view(target.shape)
    return (nll, z_loss) if return_z_loss else nll


def _reduce(tok, keep, reduction):
    """Per-token values (0 at ignored tokens) -> ``reduction`` over the counted tokens."""
    if reduction == "none":
        return tok
    total = tok.sum()
    return total if reduction == "sum" else total / keep.sum().clamp_min(1)


def _target_logit(h, w, y_safe, b, softcap):
    """``u_y`` per token, fp32 (capped when ``softcap``): one gathered row dot product, formed
    in fp32 (a bf16 product per term would be off by ~1e-2 at H=2048). Its backward scatters
    into a dense ``(V, H)`` weight gradient."""
    u_y = (h.float() * w[y_safe].float()).sum(-1)
    if b is not None:
        u_y = u_y + b[y_safe].float()
    return u_y if softcap is None else softcap * torch.tanh(u_y / softcap)


def _smoothing_term(h, w, y, b, keep, reduction):
    """``u_y - mean_v u_v`` per token (0 at ignored ones), reduced like the loss; fp32."""
    u_y = _target_logit(h, w, y.masked_fill(~keep, 0).clamp(0, w.shape[0] - 1), b, None)
    u_mean = h.float() @ w.float().mean(0)
    if b is not None:
        u_mean = u_mean + b.float().mean()
    return _reduce((u_y - u_mean) * keep, keep, reduction)


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Drop-in for ``liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss``.

    Same constructor (liger-kernel 0.8.5's keywords, in its positional order) and call
    ``forward(lin_weight, _input, target, bias=None)``; see :func:`fused_linear_cross_entropy`.
    Supported: ``ignore_index``, ``lse_square_scale`` (z-loss), ``label_smoothing``,
    ``reduction``, ``softcap``, ``return_z_loss`` (then a :class:`CrossEntropyOutput`, as Liger)
    and ``accum_dtype`` (accepted; gradients are always accumulated in fp32). The others must
    keep their defaults (``ce_weight=None``, ``use_token_scaling``, ``return_token_accuracy``,
    ``return_predicted_tokens`` False): a NotImplementedError names the one that does not.
    """

    def __init__(
        self,
        ce_weight: torch.Tensor | None = None,
        ignore_index: int = -100,
        lse_square_scale: float = 0.0,
        label_smoothing: float = 0.0,
        reduction: str = "mean",
        softcap: float | None = None,
        return_z_loss: bool = False,
        accum_dtype: torch.dtype | None = None,
        use_token_scaling: bool = False,
        return_token_accuracy: bool = False,
        return_predicted_tokens: bool = False,
    ):
        super().__init__()
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
        unsupported = dict(  # keyword -> (value given, whether it differs from the default)
            ce_weight=(ce_weight, ce_weight is not None),
            use_token_scaling=(use_token_scaling, bool(use_token_scaling)),
            return_token_accuracy=(return_token_accuracy, bool(return_token_accuracy)),
            return_predicted_tokens=(return_predicted_tokens, bool(return_predicted_tokens)),
        )
        for name, (given, changed) in unsupported.items():
            if changed:
                if isinstance(given, torch.Tensor):
                    given = f"<tensor of shape {tuple(given.shape)}>"
                raise NotImplementedError(
                    f"{name}={given!r} is not supported by rlhf_kernels' fused linear "
                    "cross-entropy; leave it at its default"
                )
        if softcap is not None and not _positive_number(softcap):
            raise ValueError(f"softcap must be None or > 0, got {softcap!r}")
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing
        self.reduction, self.softcap, self.accum_dtype = reduction, softcap, accum_dtype
        self.lse_square_scale, self.return_z_loss = lse_square_scale, return_z_loss

    def forward(self, lin_weight, _input, target, bias=None):
        out = fused_linear_cross_entropy(
            _input, lin_weight, target, bias, self.ignore_index, self.label_smoothing,
            self.reduction, self.softcap, self.lse_square_scale, self.return_z_loss,
        )  # fmt: skip
        return CrossEntropyOutput(*out) if self.return_z_loss else out
