"""Outcome-reward advantages for groups of samples, and masked whitening.

``group_advantages`` takes one scalar reward per response, laid out as consecutive groups of
``group_size`` responses to the same prompt (``rewards[i * G : (i + 1) * G]`` is group ``i``):

- ``"grpo"``: ``(r - mean_g) / (std_g + eps)`` (unbiased std over the group).
- ``"dr_grpo"``: ``r - mean_g`` (Dr. GRPO: no std scaling).
- ``"rloo"``: ``r - (sum_g - r) / (G - 1)`` (leave-one-out baseline).
- ``"reinforce_baseline"``: ``(r - mean_g) / (std_batch + eps)`` (REINFORCE++-baseline: group
  mean baseline, then one std over the whole batch of the centred scalar rewards, one number per
  response; the raw rewards' std would also count the spread between prompts). OpenRLHF instead
  whitens the per-token returns (KL penalty included) over all response tokens, which also
  subtracts their mean and weighs long responses more.

All math is vectorised over groups: ``(N,) -> (N / G, G)``.
"""

from __future__ import annotations

import math
import operator

import torch

from rlhf_kernels._checks import check_mask, check_same_device, is_scalar

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_baseline")


def group_advantages(
    rewards: torch.Tensor, group_size: int, estimator: str = "grpo", eps: float = 1e-6
) -> torch.Tensor:
    """Per-response advantages from group statistics.

    Args:
        rewards: ``(N,)`` float scalar reward per response, ``N`` a multiple of ``group_size``,
            groups contiguous.
        group_size: responses per prompt ``G`` (>= 2 for ``"grpo"`` and ``"rloo"``; with 1,
            ``"dr_grpo"`` and ``"reinforce_baseline"`` give all zeros: each reward is its
            group's mean).
        estimator: one of ``"grpo"``, ``"dr_grpo"``, ``"rloo"``, ``"reinforce_baseline"``.
        eps: added to the std before dividing.
    Returns: ``(N,)`` advantages in rewards' dtype (half inputs are computed in fp32;
        differentiable, though rewards rarely are).
    """
    if not isinstance(rewards, torch.Tensor) or not rewards.is_floating_point():
        raise TypeError(
            f"rewards must be a float tensor, got "
            f"{getattr(rewards, 'dtype', type(rewards).__name__)}"
        )
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    try:  # int or numpy int; not a bool
        size = None if isinstance(group_size, bool) else operator.index(group_size)
    except TypeError:
        size = None
    if size is None or size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    group_size = size
    if rewards.numel() % group_size:
        raise ValueError(
            f"the reward count {rewards.numel()} is not a multiple of group_size={group_size}"
        )
    _check_eps(eps)
    if estimator in ("grpo", "rloo") and group_size < 2:
        raise ValueError(f"estimator {estimator!r} needs group_size >= 2, got {group_size}")
    if rewards.dtype in (torch.float16, torch.bfloat16):  # group sums and stds in fp32
        return group_advantages(rewards.float(), group_size, estimator, eps).to(rewards.dtype)
    r = rewards.view(-1, group_size)  # (groups, G)
    if estimator == "rloo":
        return (r - (r.sum(1, keepdim=True) - r) / (group_size - 1)).view(-1)
    # shifted by each group's first reward (detached: the same function, the same gradient) so
    # a constant group centres to exactly 0: its rounded mean left ~eps * |r| that the std (of
    # the same size) scaled up to O(1) advantages (fp32 reward 7.1, G = 7: 0.31 each, not 0)
    d = r - r[:, :1].detach()
    centred = d - d.mean(1, keepdim=True)
    if estimator == "dr_grpo":
        return centred.view(-1)
    if estimator == "grpo":
        return (centred / _nonzero(d.std(1, keepdim=True) + eps)).view(-1)
    std = centred.std() if centred.numel() > 1 else centred.new_zeros(())
    return (centred / _nonzero(std + eps)).view(-1)  # reinforce_baseline


def _nonzero(den: torch.Tensor) -> torch.Tensor:
    """``den`` with 1 where it is 0 (``eps = 0`` and no spread: the centred values are exactly 0
    there, and 0 / 0 would be NaN)."""
    return torch.where(den == 0, 1.0, den)


def whiten(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    shift_only: bool = False,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Masked normalisation ``(x - mean) / sqrt(var + eps)`` with statistics over ``mask``.

    Args:
        x: float tensor of any shape (e.g. per-token advantages ``(B, T)`` or packed ``(N,)``).
        mask: x's shape, 0/1 (bool or numeric); statistics use only the selected entries
            (default: all; at least 2), whatever the others hold. Unselected entries are
            transformed the same way (callers mask them).
        shift_only: subtract the masked mean but do not divide by the std.
        eps: added to the (unbiased) masked variance.
    Returns: x's shape and dtype (half inputs are computed in fp32).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a float tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask is not None and mask.shape != x.shape:
        raise ValueError(f"mask must have x's shape {tuple(x.shape)}, got {tuple(mask.shape)}")
    check_same_device(x=x, mask=mask)
    _check_eps(eps)
    if x.dtype in (torch.float16, torch.bfloat16):  # fp16 sums of 65k entries overflow
        return whiten(x.float(), mask, shift_only=shift_only, eps=eps).to(x.dtype)
    m = torch.ones_like(x) if mask is None else check_mask(mask).to(x.dtype)
    n = m.sum()
    if not torch.compiler.is_compiling() and n < 2:  # one host read
        raise ValueError(f"whiten needs at least 2 selected entries, got {int(n)}")
    keep = m != 0  # junk (NaN) at unselected entries stays out of the statistics
    # two passes: the first mean (detached, so the gradient is unchanged) rounds by ~eps * |x|,
    # which the rsqrt of a tiny variance scaled up (a constant 70.3 whitened to 0.076, not 0)
    x = x - (torch.where(keep, x, 0).sum() / n).detach()
    mean = torch.where(keep, x, 0).sum() / n
    centred = x - mean
    if shift_only:
        return centred
    var = torch.where(keep, centred.square(), 0).sum() / (n - 1)  # unbiased
    return centred * torch.rsqrt(_nonzero(var + eps))  # (eps = 0, no spread: 0, not NaN)


def _check_eps(eps) -> None:
    """A finite number >= 0 (a 0-d tensor too, as the losses' options)."""
    if not (is_scalar(eps) and math.isfinite(float(eps)) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
