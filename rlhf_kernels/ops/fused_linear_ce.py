"""Fused linear + cross-entropy with liger-kernel's interface, on our fused log-prob op.

Switching from Liger is a change of import::

    from rlhf_kernels import FusedLinearCrossEntropyLoss   # was LigerFusedLinearCrossEntropyLoss
    loss = FusedLinearCrossEntropyLoss(ignore_index=-100)(lm_head.weight, hidden, labels)

The ``(tokens, vocab)`` logits never exist: ``reduction="mean"|"sum"`` runs
:func:`~rlhf_kernels.ops.linear_logprobs.linear_nll_loss` (gradients made in the forward, fp32
weight-gradient accumulation), ``reduction="none"`` runs ``linear_logprobs`` (per-token values).
With ``u = h W^T + b`` (capped under ``softcap``, Gemma 2's ``u = c tanh(z / c)``):

- label smoothing: ``loss = (1 - e) (lse - u_y) + e (lse - mean_v u_v) = -logp_y +
  e (u_y - mean_v u_v)``;
- the z-loss (Liger's / PaLM's ``lse_square_scale * lse^2`` per token);
- class weights ``ce_weight`` (``F.cross_entropy``'s ``weight``): token ``i`` counts
  ``w_{y_i} (1 - e) (-logp_y) + e / V sum_v w_v (lse - u_v)``; ``"mean"`` divides by the summed
  weight of the counted targets (the z-loss stays unweighted, as in Liger);
- ``use_token_scaling``: each token's loss times its detached target probability ``exp(logp_y)``.

All of them are made of ``lse``, ``u_y`` and ``sum_v w_v u_v`` per token, which the log-prob op
reads from its own fp32 logits blocks (``linear_logprobs._logprobs_aux``; for plain smoothing
with ``"mean"``/``"sum"``, ``linear_nll_loss``'s one pass), their gradients joining the
log-prob's in one backward, so the weight gradient is rounded once (as plain torch's), in eager
mode and under torch.compile (the same blocks inside custom ops). The z-loss, class weights,
token scaling and ``"none"`` with smoothing take the per-token op (4 matmuls instead of 3).
``return_token_accuracy`` / ``return_predicted_tokens`` take one more no-grad pass of
row-chunked logits (argmax of the capped logits; memory bounded like the loss).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_kernels._checks import is_int, is_real, is_scalar
from rlhf_kernels.ops import linear_logprobs as lse_mod
from rlhf_kernels.ops.linear_logprobs import linear_logprobs, linear_nll_loss, under_autocast

REDUCTIONS = ("mean", "sum", "none")


@dataclass
class CrossEntropyOutput:
    """What the module returns with ``return_z_loss=True`` (Liger's field names); ``z_loss`` is
    the reduced z-loss term, already inside ``loss``, detached (for logging)."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


@under_autocast
def fused_linear_cross_entropy(
    input: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None = None,
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
    chunk_mem_const: int = 1,
) -> torch.Tensor | CrossEntropyOutput:
    """``F.cross_entropy(F.linear(input, weight, bias), target, ...)`` without the logits.

    A drop-in for ``liger_kernel.transformers.functional.liger_fused_linear_cross_entropy``:
    liger-kernel 0.8.5's parameters, in its positional order.

    Args:
        input: ``(..., H)`` hidden states (any leading shape), fp32/bf16/fp16.
        weight: ``(V, H)`` lm_head weight, ``input``'s dtype. bias: optional ``(V,)``.
        target: int64/int32 ``(...)`` (``input``'s leading shape) ids in ``[0, V)`` or
            ``ignore_index``; those tokens count in no reduction (as in ``F.cross_entropy``).
        ce_weight: optional floating ``(V,)`` class weights, ``F.cross_entropy``'s ``weight``.
        lse_square_scale: z-loss weight ``s >= 0``: ``s * logsumexp(logits)^2`` is added per
            counted token (Liger's meaning), reduced like the loss (``"mean"``: over tokens).
        label_smoothing: in ``[0, 1]``, ``F.cross_entropy``'s meaning.
        reduction: ``"mean"`` (over non-ignored tokens; 0 if none), ``"sum"`` or ``"none"``
            (``target``'s shape, 0 at ignored tokens).
        softcap: ``None`` or ``c > 0``: logits ``c * tanh(z / c)`` (as Liger and Gemma 2).
        return_z_loss: also return that reduced z-loss term (detached, for logging).
        accum_dtype: ``None`` or a floating dtype; accepted for Liger's signature: gradients
            are always accumulated in fp32.
        use_token_scaling: scale each token's loss (and z-loss) by its detached target
            probability (Liger's meaning).
        return_token_accuracy: also return whether the argmax logit is the target (mean over
            counted tokens; per token, 0 at ignored ones, for ``"none"``).
        return_predicted_tokens: also return the argmax token per position (-1 at ignored ones).
        chunk_mem_const: a positive int; accepted for Liger's signature: chunk sizes here
            follow a fixed memory bound (``linear_logprobs``'s ``_chunk_sizes``).
    Returns: float32 loss (``target``'s shape for ``"none"``); with any ``return_*`` flag a
        :class:`CrossEntropyOutput` (Liger's), whose unrequested fields are None.
    """
    _check_flags(
        return_z_loss=return_z_loss, use_token_scaling=use_token_scaling,
        return_token_accuracy=return_token_accuracy,
        return_predicted_tokens=return_predicted_tokens,
    )  # fmt: skip
    if not is_int(ignore_index):
        raise TypeError(f"ignore_index must be an int (a target id), got {ignore_index!r}")
    if accum_dtype is not None and not (
        isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point
    ):
        raise TypeError(f"accum_dtype must be None or a floating torch.dtype, got {accum_dtype!r}")
    if isinstance(chunk_mem_const, bool) or not isinstance(chunk_mem_const, int):
        raise TypeError(f"chunk_mem_const must be a positive int, got {chunk_mem_const!r}")
    if chunk_mem_const < 1:
        raise ValueError(f"chunk_mem_const must be a positive int, got {chunk_mem_const!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not (is_scalar(label_smoothing) and 0.0 <= label_smoothing <= 1.0):
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if not (is_scalar(lse_square_scale) and 0.0 <= lse_square_scale < float("inf")):
        raise ValueError(
            f"lse_square_scale must be a number >= 0 and finite, got {lse_square_scale!r}"
        )
    if not isinstance(input, torch.Tensor) or input.dim() < 1:
        raise ValueError(f"input must be a (..., H) tensor, got {type(input).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"weight must be a (V, H) tensor, got {got}")
    if not isinstance(target, torch.Tensor) or target.shape != input.shape[:-1]:
        raise ValueError(
            f"target must have input's leading shape {tuple(input.shape[:-1])}, got "
            f"{tuple(getattr(target, 'shape', ()))}"
        )
    _check_ce_weight(ce_weight, weight)
    h, y = input.reshape(-1, input.shape[-1]), target.reshape(-1)
    keep = y != ignore_index
    z_loss = None
    per_token = lse_square_scale or ce_weight is not None or use_token_scaling
    if per_token or (reduction == "none" and label_smoothing):  # per-token values
        nll, z_loss = _per_token_loss(
            h, weight, y, bias, keep, ignore_index, label_smoothing, reduction, softcap,
            lse_square_scale, ce_weight, use_token_scaling,
        )  # fmt: skip
    elif reduction == "none":
        nll = -linear_logprobs(h, weight, y, bias, ignore_index=ignore_index, softcap=softcap)
    else:
        # as one padded row: tokens with an ignored target (pads, prompts) skip the matmuls;
        # label smoothing inside its one pass (the weight gradient rounded once, as torch's)
        nll = linear_nll_loss(
            h[None], weight, y[None], bias=bias, ignore_index=ignore_index, softcap=softcap,
            label_smoothing=label_smoothing,
        )  # fmt: skip
        if reduction == "sum":
            nll = nll * keep.sum()
    if return_z_loss and z_loss is None:  # asked for with weight 0: zeros, one-pass loss kept
        z_loss = _reduce(torch.zeros(y.shape, device=h.device), keep, reduction)
    if reduction == "none":
        nll = nll.view(target.shape)
        z_loss = None if z_loss is None else z_loss.view(target.shape)
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return nll
    accuracy = predicted = None
    if return_token_accuracy or return_predicted_tokens:
        pred = _predictions(h, weight, bias, softcap).masked_fill(~keep, -1)
        if return_token_accuracy:  # a mean over counted tokens for "sum" too (as Liger)
            hit = ((pred == y) & keep).float()
            accuracy = _reduce(hit, keep, "none" if reduction == "none" else "mean")
            accuracy = accuracy.view(target.shape) if reduction == "none" else accuracy
        if return_predicted_tokens:
            predicted = pred.view(target.shape)
    return CrossEntropyOutput(nll, z_loss if return_z_loss else None, accuracy, predicted)


def _check_flags(**flags):
    """On/off options must be bools (as Liger asserts): a truthy string such as ``"False"`` from a
    config would silently turn one on."""
    for name, flag in flags.items():
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")


def _check_ce_weight(ce_weight, weight):
    if ce_weight is None:
        return
    v = weight.shape[0]
    if not isinstance(ce_weight, torch.Tensor) or ce_weight.shape != (v,):
        got = tuple(ce_weight.shape) if isinstance(ce_weight, torch.Tensor) else type(ce_weight)
        raise ValueError(f"ce_weight must be a ({v},) tensor (one weight per class), got {got}")
    if not ce_weight.is_floating_point():
        raise TypeError(f"ce_weight must be a floating-point tensor, got {ce_weight.dtype}")
    if ce_weight.device != weight.device:
        raise ValueError(f"ce_weight is on {ce_weight.device}, the weight on {weight.device}")


def _per_token_loss(
    h, w, y, b, keep, ignore_index, eps, reduction, softcap, z_scale, cw, scaling
):  # fmt: skip
    """Loss and z-loss, reduced, from per-token values (class weights, token scaling, z-loss,
    label smoothing; see the module docstring). fp32. ``logp``, ``lse``, ``u_y`` and
    ``sum_v cw_v u_v`` all come from the log-prob op's blocks, with one backward (the weight
    gradient rounded once)."""
    V = w.shape[0]
    cw = None if cw is None else cw.detach().float()  # constants (torch refuses their gradient)
    y_safe = _safe_targets(y, keep, V)
    logp, lse, u_y, wsum = lse_mod._logprobs_aux(
        h, w, y, b, ignore_index, softcap, cw if eps else None
    )  # fmt: skip
    # where, not a product: a non-finite hidden state at an ignored token must not reach it
    lse = torch.where(keep, lse, 0.0)
    if cw is None:
        tok = -logp
        if eps:  # e (u_y - mean_v u_v)
            tok = tok + eps * torch.where(keep, u_y - wsum / V, 0.0)
        denom = keep.sum()
    else:
        w_y = cw[y_safe] * keep
        tok = (1.0 - eps) * w_y * -logp
        if eps:  # e / V * (lse * sum_v w_v - sum_v w_v u_v)
            tok = tok + torch.where(keep, eps / V * (lse * cw.sum() - wsum), 0.0)
        denom = w_y.sum()
    z_tok = z_scale * lse.square() if z_scale else torch.zeros_like(tok)
    if scaling:  # the target probability, detached
        scale = logp.detach().exp() * keep
        tok, z_tok = tok * scale, z_tok * scale
    if reduction == "none":
        return tok + z_tok, z_tok.detach()
    z = _reduce(z_tok, keep, reduction)
    loss = tok.sum() if reduction == "sum" else tok.sum() / _nonzero(denom)
    return loss + z, z.detach()


def _nonzero(x):
    """``x``, or 1 where it is 0 (a mean over nothing is 0, as the unweighted loss); negative
    weight sums stay (``F.cross_entropy`` allows negative class weights)."""
    return torch.where(x != 0, x, torch.ones_like(x))


# rows of logits per chunk of the no-grad prediction pass: about 64 MiB of fp32 logits
_PREDICT_ELEMS = 1 << 24


@torch.no_grad()
def _predictions(h, w, b, softcap):
    """Argmax of the (capped) logits per row, int64 ``(N,)``, in row chunks (no ``(N, V)``)."""
    rows = max(1, _PREDICT_ELEMS // max(1, w.shape[0]))
    out = []
    for i in range(0, h.shape[0], rows):
        z = h[i : i + rows] @ w.T
        z = z.float() if b is None else z.float() + b.float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        out.append(z.argmax(-1))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long, device=h.device)


def _reduce(tok, keep, reduction):
    """Per-token values (0 at ignored tokens) -> ``reduction`` over the counted tokens."""
    if reduction == "none":
        return tok
    total = tok.sum()
    return total if reduction == "sum" else total / keep.sum().clamp_min(1)


def _safe_targets(y, keep, vocab):
    """Targets fit for gathering: ignored ones -> 0, out-of-range ones clamped (their logp is
    NaN, so the loss shows them anyway)."""
    return y.masked_fill(~keep, 0).clamp(0, vocab - 1)


class FusedLinearCrossEntropyLoss(torch.nn.Module):
    """Drop-in for ``liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss``.

    Same constructor (liger-kernel 0.8.5's keywords, in its positional order) and call
    ``forward(lin_weight, _input, target, bias=None)``; see :func:`fused_linear_cross_entropy`.
    Every keyword works: ``ce_weight``, ``ignore_index``, ``lse_square_scale`` (z-loss),
    ``label_smoothing``, ``reduction``, ``softcap``, ``use_token_scaling`` and the ``return_*``
    flags (then a :class:`CrossEntropyOutput`, as Liger); ``accum_dtype`` is accepted (gradients
    are always accumulated in fp32).
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
        if softcap is not None and not (
            is_real(softcap, positive=True) and softcap <= lse_mod._F32_MAX
        ):
            raise ValueError(
                f"softcap must be None or > 0 and <= {lse_mod._F32_MAX:.4g}, got {softcap!r}"
            )
        _check_flags(
            return_z_loss=return_z_loss, use_token_scaling=use_token_scaling,
            return_token_accuracy=return_token_accuracy,
            return_predicted_tokens=return_predicted_tokens,
        )  # fmt: skip
        self.ce_weight = ce_weight
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing
        self.reduction, self.softcap, self.accum_dtype = reduction, softcap, accum_dtype
        self.lse_square_scale, self.return_z_loss = lse_square_scale, return_z_loss
        self.use_token_scaling = use_token_scaling
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens

    def forward(self, lin_weight, _input, target, bias=None):
        return fused_linear_cross_entropy(
            _input, lin_weight, target, bias, self.ce_weight, self.ignore_index,
            self.lse_square_scale, self.label_smoothing, self.reduction, self.softcap,
            self.return_z_loss, self.accum_dtype, self.use_token_scaling,
            self.return_token_accuracy, self.return_predicted_tokens,
        )  # fmt: skip
