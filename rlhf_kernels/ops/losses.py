"""KL penalties, the PPO clipped policy loss and the clipped value loss, mask- or cu_seqlens-aware.

Token layouts: padded ``(B, T)`` with a ``mask``, or packed ``(N,)`` with ``cu_seqlens``
(sequence ``i`` owns ``cu[i]:cu[i+1]``; an optional ``(N,)`` mask further selects tokens).
Sequence-level aggregations reduce per sequence (rows, or cu_seqlens segments) first.
All functions are plain differentiable torch math (no kernel pays here: each is a few
element-wise passes that torch.compile fuses).
"""

from __future__ import annotations

import math

import torch

from rlhf_kernels._checks import (
    as_cu_seqlens,
    check_mask,
    check_same_device,
    is_scalar,
    sequence_ids,
)

KL_ESTIMATORS = ("k1", "k2", "k3")
AGGREGATIONS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def kl_penalty(
    logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str = "k1", clamp: float | None = None
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate from sampled-token log-probs.

    Args:
        logp: policy log-probs of the sampled tokens, any shape, float.
        ref_logp: reference-model log-probs, logp's shape.
        estimator: ``"k1"`` ``logp - ref``; ``"k2"`` ``0.5 (logp - ref)^2``;
            ``"k3"`` ``exp(ref - logp) - 1 - (ref - logp)`` (unbiased, non-negative; +inf
            where ``logp`` is -inf and ``ref_logp`` finite, without ``clamp``).
        clamp: if given (> 0), the estimate is clamped to ``[-clamp, clamp]``.
    Returns: logp's shape, in the promoted dtype of logp and ref_logp (computed in fp32 at
    least: bf16's ``expm1(x) - x`` cancels to 4% error at typical log-ratios).
    """
    _check_float(logp=logp, ref_logp=ref_logp)
    if ref_logp.shape != logp.shape:
        raise ValueError(
            f"ref_logp must have logp's shape {tuple(logp.shape)}, got {tuple(ref_logp.shape)}"
        )
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if clamp is not None and not (is_scalar(clamp) and clamp > 0):
        raise ValueError(f"clamp must be a number > 0 or None, got {clamp!r}")
    clamp = None if clamp is None else float(clamp)  # (a 0-d tensor, as the policy clips take)
    dtype = torch.promote_types(logp.dtype, ref_logp.dtype)
    cdt = torch.promote_types(dtype, torch.float32)
    d = logp.to(cdt) - ref_logp.to(cdt)
    if estimator == "k1":
        kl = d
    elif estimator == "k2":
        kl = 0.5 * d.square()
    else:
        x = -d  # ref - logp
        if clamp is not None:  # exp(x) finite; f(x) = expm1(x) - x is >= clamp from this bound
            x = x.clamp(max=math.log1p(clamp) + 1.0)  # on, so values and gradients are unchanged
        # logp = -inf (a token the policy cannot give): f(+inf) = +inf, not inf - inf = NaN
        inf = torch.isposinf(x)
        xs = torch.where(inf, 0.0, x)  # (the unselected branch's gradient must stay finite)
        kl = torch.where(inf, math.inf, torch.expm1(xs) - xs)
    return (kl if clamp is None else kl.clamp(-clamp, clamp)).to(dtype)


def _masked(t: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``t`` with 0 where ``m`` is 0 (a where, not a product: NaN * 0 is NaN, and so would be
    the gradient reaching a masked NaN)."""
    return torch.where(m != 0, t, 0)


# ----------------------------------------------------------------------------- layouts
def _check_float(**tensors):
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise TypeError(
                f"{name} must be a float tensor, got {getattr(t, 'dtype', type(t).__name__)}"
            )


def _token_layout(ref_name, ref, mask, cu_seqlens, aggregation=None, **others):
    """Validate; return (mask of ref's shape in fp32 at least (fp16 counts overflow at 65504
    tokens), seq ids (same shape, or None for the padded (B, T) layout, whose sequences are the
    rows), number of sequences).

    A packed 1-D input without ``cu_seqlens`` is fine for token means (``aggregation`` None or
    ``"token-mean"``: one stream); a sequence-level aggregation then needs the boundaries."""
    for name, t in others.items():
        if t.shape != ref.shape:
            raise ValueError(
                f"{name} must have {ref_name}'s shape {tuple(ref.shape)}, got {tuple(t.shape)}"
            )
    if mask is not None and not isinstance(mask, torch.Tensor):  # e.g. a clip given by position
        raise TypeError(f"mask must be a tensor or None, got {type(mask).__name__}: {mask!r}")
    cu_seqlens = as_cu_seqlens(cu_seqlens, ref.device)
    check_same_device(**{ref_name: ref}, mask=mask, cu_seqlens=cu_seqlens, **others)
    if mask is not None and mask.shape != ref.shape:
        raise ValueError(
            f"mask must have {ref_name}'s shape {tuple(ref.shape)}, got {tuple(mask.shape)}"
        )
    mask = check_mask(mask)
    if cu_seqlens is not None:
        if ref.dim() != 1:
            raise ValueError(
                f"with cu_seqlens, {ref_name} must be packed 1-D (N,), got shape {tuple(ref.shape)}"
            )
        ids = sequence_ids
        if torch.compiler.is_compiling():  # a custom op validates cu_seqlens at run time
            from rlhf_kernels.ops.compiled import segment_ids as ids
        seq, n_seq = ids(cu_seqlens, ref.shape[0]), cu_seqlens.shape[0] - 1
    elif ref.dim() == 1 and aggregation in (None, "token-mean"):
        seq = torch.zeros_like(ref, dtype=torch.long)
        n_seq = 1
    elif ref.dim() == 1:
        raise ValueError(
            f"aggregation={aggregation!r} needs sequence boundaries: pass cu_seqlens "
            f"((S + 1,) for the packed 1-D {ref_name}) or use the padded (B, T) layout with a "
            f"mask; only 'token-mean' works without them"
        )
    elif mask is not None:
        if ref.dim() != 2:
            raise ValueError(
                f"with a mask and no cu_seqlens, {ref_name} must be padded 2-D "
                f"(B, T), got shape {tuple(ref.shape)}"
            )
        seq, n_seq = None, ref.shape[0]  # the rows
    else:
        raise ValueError(
            f"{ref_name} of shape {tuple(ref.shape)} needs mask (padded (B, T) layout: which "
            f"tokens count; rows are the sequences of aggregation={aggregation!r}) or "
            f"cu_seqlens (packed (N,) layout); got neither"
        )
    cdt = torch.promote_types(ref.dtype, torch.float32)
    m = torch.ones_like(ref, dtype=cdt) if mask is None else mask.to(cdt)
    return m, seq, n_seq


def _token_weights(m, seq, n_seq, aggregation, norm_length=None):
    """Per-token weights ``w`` with ``aggregate(x) == (x * w).sum()`` (constants: no grad).

    Sequence means run over the sequences with at least one selected token: an empty
    (``cu[i] == cu[i+1]``) or fully masked sequence adds nothing and is not counted.
    ``"seq-mean-token-sum-norm"`` divides by the constant ``n_seq * norm_length`` (every
    sequence counts; ``norm_length`` None: the padded rows' length).
    """
    if aggregation == "token-mean":
        return m / m.sum().clamp_min(1)
    if n_seq == 0:
        return torch.zeros_like(m)
    if aggregation == "seq-mean-token-sum-norm":
        if norm_length is None and seq is not None:
            raise ValueError(
                "aggregation='seq-mean-token-sum-norm' on the packed layout needs norm_length "
                "(Dr. GRPO's constant token budget per sequence, e.g. the generation limit)"
            )
        length = max(m.numel() // n_seq, 1) if norm_length is None else norm_length
        return m / (n_seq * length)
    cdt = m.dtype  # fp32 at least (_token_layout)
    if seq is None:  # padded: sequence i is row i; a row sum (inductor's CPU code generation
        rows = m.reshape(n_seq, m.numel() // n_seq).to(cdt)  # fails on index_add by row ids)
        count = rows.sum(1)
        per_token = count.clamp_min(1)[:, None].expand_as(rows).reshape(m.shape)
    else:
        count = torch.zeros(n_seq, dtype=cdt, device=m.device)
        count = count.index_add(0, seq.reshape(-1), m.reshape(-1).to(cdt))
        per_token = count.clamp_min(1)[seq]
    n_live = (count > 0).sum().clamp_min(1).to(cdt)  # sequences that count, no host sync
    if aggregation == "seq-mean-token-sum":
        return m / n_live
    return m / (per_token * n_live)  # seq-mean-token-mean


# exp of a larger log-ratio overflows fp32 (at 88.7): the ratio stops at e^80, so a token
# clipped there gets gradient 0, not 0 * inf = NaN (the loss is computed in fp32 at least)
MAX_LOG_RATIO = 80.0


def _k3(x: torch.Tensor) -> torch.Tensor:
    """``expm1(x) - x`` with ``x`` capped at ``MAX_LOG_RATIO`` (finite in fp32)."""
    x = x.clamp(max=MAX_LOG_RATIO)
    return torch.expm1(x) - x


def _ratio(logp, old_logp, advantages):
    """``(ratio, log_ratio, advantages)`` in fp32 (fp64 for fp64 inputs), the ratio capped."""
    cdt = torch.promote_types(logp.dtype, torch.float32)
    log_ratio = logp.to(cdt) - old_logp.to(cdt)
    return torch.exp(log_ratio.clamp(max=MAX_LOG_RATIO)), log_ratio, advantages.to(cdt)


def _ppo_token_loss(logp, old_logp, advantages, clip_low, clip_high, dual_clip):
    """Per-token PPO loss and its pieces: (loss, unclipped, clipped, ratio, log_ratio), fp32."""
    ratio, log_ratio, advantages = _ratio(logp, old_logp, advantages)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        capped = torch.minimum(loss, -advantages * dual_clip)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, unclipped, clipped, ratio, log_ratio


def _ppo_token_grad(logp, old_logp, advantages, clip_low, clip_high, dual_clip):
    """``d _ppo_token_loss / d logp`` in closed form, as autograd forms it: ``torch.maximum`` /
    ``torch.minimum`` split a tie's gradient in half, ``clamp`` passes it at its bounds. For the
    fused losses, whose gradients are made where autograd records nothing (a custom op)."""
    ratio, log_ratio, advantages = _ratio(logp, old_logp, advantages)
    capped = (log_ratio > MAX_LOG_RATIO).to(ratio.dtype)  # the clamp passes no gradient there
    unclipped = -advantages * ratio  # also its own derivative in logp
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    inside = (ratio >= 1 - clip_low) & (ratio <= 1 + clip_high)
    tie = (unclipped == clipped).to(ratio.dtype) * 0.5
    to_u = (unclipped > clipped).to(ratio.dtype) + tie
    to_c = ((clipped > unclipped).to(ratio.dtype) + tie) * inside
    grad = unclipped * (to_u + to_c) * (1 - capped)
    if dual_clip is not None:
        loss, cap = torch.maximum(unclipped, clipped), -advantages * dual_clip
        keep = (loss < cap).to(ratio.dtype) + (loss == cap).to(ratio.dtype) * 0.5
        grad = torch.where(advantages < 0, grad * keep, grad)
    return grad


def _check_policy_args(aggregation, clip_low, clip_high, dual_clip, norm_length=None):
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if norm_length is not None:
        if aggregation != "seq-mean-token-sum-norm":
            raise ValueError(
                f"norm_length is for aggregation='seq-mean-token-sum-norm', got "
                f"aggregation={aggregation!r}"
            )
        if not is_scalar(norm_length):  # numpy numbers and 0-d tensors too, as the clips
            raise TypeError(f"norm_length must be a number > 0 or None, got {norm_length!r}")
        norm_length = float(norm_length)
        if not (norm_length > 0 and math.isfinite(norm_length)):  # inf: a zero loss, silently
            raise ValueError(f"norm_length must be a finite number > 0, got {norm_length}")
    if not (is_scalar(clip_low) and is_scalar(clip_high) and 0 <= clip_low < 1 and clip_high >= 0):
        raise ValueError(
            f"need numbers 0 <= clip_low < 1 and clip_high >= 0, got {clip_low!r}, {clip_high!r}"
        )
    if dual_clip is not None and not (is_scalar(dual_clip) and dual_clip > 1):
        raise ValueError(f"dual_clip must be a number > 1 or None, got {dual_clip!r}")


# ----------------------------------------------------------------------------- losses
def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    norm_length: float | None = None,
    return_stats: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``.

    Args:
        logp: ``(B, T)`` or packed ``(N,)`` current log-probs of the taken tokens
            (differentiable).
        old_logp: log-probs under the behaviour policy, logp's shape.
        advantages: per-token advantages, logp's shape.
        mask: 0/1 token mask, logp's shape; required for the padded layout.
        clip_low, clip_high: asymmetric ratio clip ``[1 - clip_low, 1 + clip_high]``.
        dual_clip: if given (> 1), for ``A < 0`` the loss is capped at ``-A * dual_clip``.
        aggregation: ``"token-mean"`` (over all selected tokens), ``"seq-mean-token-mean"``
            (token mean per sequence, then mean over sequences), ``"seq-mean-token-sum"``
            (token sum per sequence, then mean over sequences). The sequence means skip
            sequences without a selected token (empty segments, fully masked rows): they
            neither add to the loss nor to the number of sequences.
            ``"seq-mean-token-sum-norm"`` (Dr. GRPO): the token sum over all sequences divided
            by the constant ``num_sequences * norm_length``, every sequence counted (TRL's
            ``dr_grpo``; verl's mode of that name divides by ``norm_length`` only).
        cu_seqlens: ``(S + 1,)`` boundaries for the packed layout. A packed 1-D input needs
            them only for the ``seq-mean-*`` aggregations (``"token-mean"`` works without).
        norm_length: the constant per-sequence token budget of ``"seq-mean-token-sum-norm"``
            (e.g. the generation limit); required for the packed layout, default for the
            padded one ``T``.
        return_stats: also return a dict of detached scalars: ``clip_frac`` (tokens whose
            clipped term won), ``dual_clip_frac``, ``approx_kl`` (token mean of k3,
            ``r - 1 - log r`` with ``r`` the new / old ratio: an unbiased estimate of
            KL(old || new) on the old policy's samples) and ``ratio_mean``.
    Returns: scalar loss in logp's dtype (and the stats dict).
    """
    _check_float(logp=logp, old_logp=old_logp, advantages=advantages)
    _check_policy_args(aggregation, clip_low, clip_high, dual_clip, norm_length)
    m, seq, n_seq = _token_layout(
        "logp", logp, mask, cu_seqlens, aggregation, old_logp=old_logp, advantages=advantages
    )
    wt = _token_weights(m, seq, n_seq, aggregation, norm_length)
    if mask is not None:  # junk (NaN, inf) at masked tokens must not reach the loss or grads
        logp, old_logp, advantages = (_masked(t, m) for t in (logp, old_logp, advantages))
    loss, unclipped, clipped, ratio, log_ratio = _ppo_token_loss(
        logp, old_logp, advantages, clip_low, clip_high, dual_clip
    )
    out = (loss * wt).sum().to(logp.dtype)
    if not return_stats:
        return out
    with torch.no_grad():
        n = m.sum().clamp_min(1)
        stats = {
            "clip_frac": ((clipped > unclipped).to(m.dtype) * m).sum() / n,
            # k3 estimate of KL(old || new) from the old policy's samples: r - 1 - log r with
            # r = new / old (unbiased: E_old[r] = 1), its exponent capped as the ratio is
            "approx_kl": (_k3(log_ratio) * m).sum() / n,
            "ratio_mean": (ratio * m).sum() / n,
            "dual_clip_frac": torch.zeros((), dtype=m.dtype, device=m.device),
        }
        if dual_clip is not None:
            hit = (advantages < 0) & (torch.maximum(unclipped, clipped) > -advantages * dual_clip)
            stats["dual_clip_frac"] = (hit.to(m.dtype) * m).sum() / n
    return out, stats


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor | None = None,
    clip: float | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Critic loss ``0.5 * max((v - R)^2, (v_clip - R)^2)``, token mean over the mask.

    Args:
        values: ``(B, T)`` or packed ``(N,)`` current value predictions (differentiable).
        old_values: values at rollout time, values' shape.
        returns: regression targets, values' shape.
        mask: 0/1 token mask, values' shape; required for the padded layout.
        clip: if given (> 0), ``v_clip = old + clamp(v - old, -clip, clip)`` enters the max;
            without it the loss is ``0.5 (v - R)^2``.
        cu_seqlens: boundaries for the packed layout (all tokens count unless mask says not).
    Returns: scalar in values' dtype (computed in fp32 at least).
    """
    _check_float(values=values, old_values=old_values, returns=returns)
    if clip is not None and not (is_scalar(clip) and clip > 0):
        raise ValueError(f"clip must be a number > 0 or None, got {clip!r}")
    m, _, _ = _token_layout(
        "values", values, mask, cu_seqlens, old_values=old_values, returns=returns
    )
    dtype = values.dtype
    if mask is not None:  # junk (NaN, inf) at masked tokens must not reach the loss or grads
        values, old_values, returns = (_masked(t, m) for t in (values, old_values, returns))
    values, old_values, returns = (t.to(m.dtype) for t in (values, old_values, returns))
    err = (values - returns).square()
    if clip is not None:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err = torch.maximum(err, (v_clip - returns).square())
    return (0.5 * (err * m).sum() / m.sum().clamp_min(1)).to(dtype)
