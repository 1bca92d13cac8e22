"""Padded <-> packed conversions with flash-attn's ``bert_padding`` signatures, and spreading
per-sequence values over packed tokens.

``unpad_input`` / ``pad_input`` / ``index_first_axis`` / ``index_put_first_axis`` take and return
what flash-attn 2.7+'s do, so code written for them runs unchanged; all are differentiable
(gradients flow through the gather / scatter).
"""

from __future__ import annotations

import torch

from rlhf_kernels._checks import as_cu_seqlens, check_cu_seqlens, check_mask, is_int


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor, unused_mask=None):
    """``(B, S, ...)`` + 0/1 mask ``(B, S)`` -> the real tokens, packed.

    Args:
        hidden_states: ``(B, S, ...)``.
        attention_mask: ``(B, S)`` bool/int, 1 = real token (any padding side, holes allowed).
        unused_mask: optional ``(B, S)``: tokens that are packed too but not counted as used
            (flash-attn's meaning; the returned ``seqused`` counts only ``attention_mask``).
    Returns:
        ``(hidden (N, ...), indices (N,) int64 into the flattened B*S, cu_seqlens (B+1,) int32,
        max_seqlen int, seqused (B,) int32)``.
    """
    if attention_mask.dim() != 2 or attention_mask.shape != hidden_states.shape[:2]:
        raise ValueError(
            f"attention_mask must be (batch, seqlen) = {tuple(hidden_states.shape[:2])}, got "
            f"{tuple(attention_mask.shape)}"
        )
    attention_mask = check_mask(attention_mask, "attention_mask")
    if unused_mask is not None:
        if unused_mask.shape != attention_mask.shape:
            raise ValueError(
                f"unused_mask must have attention_mask's shape {tuple(attention_mask.shape)}, "
                f"got {tuple(unused_mask.shape)}"
            )
        unused_mask = check_mask(unused_mask, "unused_mask")
    used = attention_mask.bool()
    every = used if unused_mask is None else used | unused_mask.bool()
    seqused = used.sum(-1, dtype=torch.int32)
    lengths = every.sum(-1, dtype=torch.int32)
    indices = every.reshape(-1).nonzero().flatten()
    cu = torch.nn.functional.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu, int(lengths.max()) if lengths.numel() else 0, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int):
    """Packed ``(N, ...)`` + the ``indices`` from :func:`unpad_input` -> ``(batch, seqlen, ...)``
    with zeros at padding."""
    _check_indices(hidden_states, indices, "hidden_states")  # .long() cast float/bool ones
    if hidden_states.shape[0] != indices.shape[0]:
        raise ValueError(
            f"hidden_states has {hidden_states.shape[0]} tokens but indices {indices.shape[0]}"
        )
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    indices = indices.long()  # flash-attn / transformers index with int32 indices too
    return out.index_copy(0, indices, hidden_states).view(batch, seqlen, *hidden_states.shape[1:])


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]`` along the first axis: ``(N0, ...)`` + ``(N,)`` int indices -> ``(N, ...)``
    (flash-attn's gather, e.g. of ``(B*S, ...)`` rows at :func:`unpad_input`'s indices)."""
    _check_indices(input, indices, "input")
    return input.index_select(0, indices.long())


def index_put_first_axis(
    values: torch.Tensor, indices: torch.Tensor, first_axis_dim: int
) -> torch.Tensor:
    """The inverse scatter: ``(N, ...)`` rows into zeros ``(first_axis_dim, ...)`` at
    ``indices`` (flash-attn's ``index_put_first_axis``)."""
    if values.dim() < 1 or indices.dim() != 1 or values.shape[0] != indices.shape[0]:
        raise ValueError(
            f"values (N, ...) and indices (N,) must agree, got {tuple(values.shape)} and "
            f"{tuple(indices.shape)}"
        )
    out = values.new_zeros(first_axis_dim, *values.shape[1:])
    _check_indices(out, indices, "the output")
    return out.index_copy(0, indices.long(), values)


def _check_indices(x: torch.Tensor, indices: torch.Tensor, name: str) -> None:
    if not isinstance(indices, torch.Tensor) or indices.dim() != 1:
        got = tuple(indices.shape) if isinstance(indices, torch.Tensor) else type(indices).__name__
        raise ValueError(f"indices must be a 1-D tensor, got {got}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32/int64, got {indices.dtype}")
    if x.dim() < 1:
        raise ValueError(f"{name} must have a first axis to index, got a 0-d tensor")
    if indices.device != x.device:
        raise ValueError(f"indices are on {indices.device}, {name} on {x.device}")


def sequence_to_tokens(
    values: torch.Tensor, cu_seqlens: torch.Tensor, total: int | None = None
) -> torch.Tensor:
    """Spread per-sequence values (rewards, advantages) over packed tokens.

    Args:
        values: ``(S, ...)``, one entry per sequence.
        cu_seqlens: ``(S + 1,)`` boundaries of the packed stream (tensor or list of ints).
        total: number of tokens, checked against ``cu_seqlens[-1]`` (None: that value).
    Returns: ``(total, ...)``: token ``t`` of sequence ``s`` holds ``values[s]``.

    ``cu_seqlens`` is validated (``[0, ..., total]``, non-decreasing): one host read, skipped
    for a CUDA tensor validated before (see :func:`~rlhf_kernels._checks.check_cu_seqlens`).
    """
    if not isinstance(values, torch.Tensor) or values.dim() < 1:
        got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"values must be a tensor (S, ...) with one entry per sequence, got {got}")
    if total is not None and not is_int(total):
        raise TypeError(f"total must be an int (the number of tokens) or None, got {total!r}")
    cu_seqlens = as_cu_seqlens(cu_seqlens, values.device)
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be a tensor or a list of ints, got {cu_seqlens!r}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() != values.shape[0] + 1:
        raise ValueError(
            f"cu_seqlens must be ({values.shape[0] + 1},) for {values.shape[0]} sequences, got "
            f"{tuple(cu_seqlens.shape)}"
        )
    if total is None and not cu_seqlens.is_floating_point():
        total = int(cu_seqlens[-1])
    cu = check_cu_seqlens(cu_seqlens, -1 if total is None else int(total))
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:])]
    lengths = torch.tensor(lengths, dtype=torch.long, device=values.device)
    return values.repeat_interleave(lengths, dim=0, output_size=cu[-1])
