"""flash-attn 2's entry points, by name and signature, on ``varlen_attention``.

Swapping flash-attn out (a CPU box, a GPU it does not build for) is a change of import::

    from rlhf_kernels import flash_attn_func, flash_attn_varlen_func  # was: from flash_attn ...

Every flash-attn 2 parameter is accepted in its positional order. ALiBi (``alibi_slopes``) and
the paged KV cache (``block_table``) are not implemented: passing one raises. With
``return_attn_probs=True`` the third value, flash-attn's dropout-mask debugging tensor
``S_dmask``, is None. Beyond flash-attn: fp32 inputs, CPU tensors, and a keyword-only
``backend`` (``varlen_attention``'s: ``"auto"`` runs flash-attn itself on CUDA when installed).
"""

from __future__ import annotations

import torch

from rlhf_kernels._checks import is_int, remember_validated
from rlhf_kernels.ops.varlen_attention import varlen_attention


def _causal(causal):
    """flash-attn's op casts ``causal`` to bool, so ``causal=1`` / ``0`` call sites run there: take
    those ints too (anything else goes to ``varlen_attention``'s strict check)."""
    if is_int(causal) and causal in (0, 1):
        return bool(causal)
    return causal


def _refuse(alibi_slopes, block_table=None):
    if alibi_slopes is not None:
        raise ValueError("alibi_slopes (ALiBi) is not supported by rlhf_kernels; got a value")
    if block_table is not None:
        raise ValueError("block_table (a paged KV cache) is not supported by rlhf_kernels")


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    *,
    backend="auto",
):
    """flash-attn's ``flash_attn_varlen_func``: q ``(total_q, heads, head_dim)``, k/v
    ``(total_k, kv_heads, head_dim)``, ``cu_seqlens_*`` ``(batch + 1,)``.

    Returns ``out`` in q's layout and dtype; with ``return_attn_probs`` ``(out, lse, None)``,
    lse ``(heads, total_q)`` fp32 (float64 for float64 inputs), ``-inf`` for a query that sees
    no key (flash-attn 2 writes ``+inf`` there). See
    :func:`~rlhf_kernels.ops.varlen_attention.varlen_attention`.
    """
    _refuse(alibi_slopes, block_table)
    res = varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        softmax_scale, _causal(causal), window_size, softcap, return_lse=bool(return_attn_probs),
        backend=backend, deterministic=deterministic,
    )  # fmt: skip
    return (*res, None) if return_attn_probs else res


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    backend="auto",
):
    """flash-attn's ``flash_attn_func``: q ``(batch, seqlen_q, heads, head_dim)``, k/v
    ``(batch, seqlen_k, kv_heads, head_dim)``; each batch row is one sequence (no padding).

    Returns ``out`` ``(batch, seqlen_q, heads, head_dim)``; with ``return_attn_probs``
    ``(out, lse, None)``, lse ``(batch, heads, seqlen_q)`` fp32 (float64 for float64 inputs).
    """
    _refuse(alibi_slopes)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be (batch, seqlen, heads, head_dim), got {got}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        raise ValueError(
            f"q, k, v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, {v.shape[0]}"
        )
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
    rows = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    cu_q, cu_k = rows * sq, rows * sk
    # valid by construction: no device -> host read to check them on CUDA
    remember_validated(cu_q, [i * sq for i in range(b + 1)])
    remember_validated(cu_k, [i * sk for i in range(b + 1)])
    res = varlen_attention(
        q.reshape(b * sq, *q.shape[2:]), k.reshape(b * sk, *k.shape[2:]),
        v.reshape(b * sk, *v.shape[2:]), cu_q, cu_k, sq, sk, dropout_p, softmax_scale,
        _causal(causal), window_size, softcap, return_lse=bool(return_attn_probs),
        backend=backend, deterministic=deterministic,
    )  # fmt: skip
    out, lse = res if return_attn_probs else (res, None)
    out = out.view(b, sq, *out.shape[1:])
    if not return_attn_probs:
        return out
    return out, lse.view(lse.shape[0], b, sq).transpose(0, 1).contiguous(), None  # as flash-attn
