"""Packed (varlen) attention: many sequences in one stream, attention never crosses a boundary.

Layout (flash-attn's): q ``(total_q, heads, head_dim)``, k/v ``(total_k, kv_heads, head_dim)``,
``cu_seqlens_*`` int32 ``[0, l0, l0+l1, ...]``; sequence ``i`` owns rows
``cu[i]:cu[i+1]``. The log-sum-exp is ``(heads, total_q)`` fp32.

Masks follow flash-attn: with ``lq`` queries and ``lk`` keys in a sequence, query ``i`` sits at
key coordinate ``i + lk - lq`` (bottom-right alignment). Key ``j`` is visible when
``j <= i + lk - lq + right`` (``right = 0`` when causal) and ``j >= i + lk - lq - left``; a negative
window side is unbounded. A query that sees no key gets output 0 and lse ``-inf``.

Backends: ``torch`` (this file: readable, memory bounded by the longest sequence),
``triton`` (``varlen_attention_triton.py``), ``flash_attn`` (CUDA, when installed).
"""

from __future__ import annotations

import importlib.util
import math
import operator
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from rlhf_kernels._checks import (
    all_finite,
    as_cu_seqlens,
    check_cu_seqlens,
    check_same_device,
    is_real,
    is_scalar,
)

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
BACKENDS = ("auto", "torch", "triton", "flash_attn")
# query-key pairs per batched SDPA call of equal-length sequences (torch backend)
_SDPA_BATCH_SCORES = 1 << 22


# ----------------------------------------------------------------------------- reference math
def attention_mask(
    lq: int, lk: int, causal: bool, window_size: tuple[int, int], device=None
) -> torch.Tensor | None:
    """Boolean ``(lq, lk)`` visibility mask of one sequence, or None when everything is visible."""
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    i = torch.arange(lq, device=device).unsqueeze(1) + (lk - lq)  # query -> key coordinate
    j = torch.arange(lk, device=device).unsqueeze(0)
    ok = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if right >= 0:
        ok &= j <= i + right
    if left >= 0:
        ok &= j >= i - left
    return ok


def _sequence_attention(q, k, v, scale, causal, window_size, softcap, dropout_p=0.0):
    """One sequence, explicit math. q ``(H, lq, D)``, k/v ``(H, lk, D)`` (kv heads expanded).

    Returns out ``(H, lq, D)`` and lse ``(H, lq)`` in q's dtype (callers upcast first if wanted).
    """
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # (H, lq, lk)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = attention_mask(q.shape[1], k.shape[1], causal, window_size, q.device)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see no key
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse).unsqueeze(-1))
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    return torch.matmul(p, v), lse


def _dense_attention(q, k, v, scale, mask, dropout_p):
    """Explicit batched attention, ``(..., heads, len, head_dim)``; every query must see a key."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    if dropout_p > 0:
        p = F.dropout(p, dropout_p)
    return torch.matmul(p, v)


def _empty_like_attention(q, k, v) -> torch.Tensor:
    """The output of a pack without sequences (q has 0 rows), still a function of q, k and v:
    their gradients are zero-size tensors, not None (DDP counts a None as an unused parameter;
    the Triton backend's output is connected too)."""
    return q.new_zeros(q.shape) + q * 0 + (k.sum() + v.sum()).to(q.dtype) * 0


def varlen_attention_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    upcast=False,
):
    """Readable reference: a loop over sequences with dense per-sequence math.

    Computes in q's dtype unless ``upcast`` (then fp32 for half types). Used as the float64 ground
    truth in tests (pass float64 tensors) and as "plain torch in low precision" for tolerances.
    Returns ``(out, lse)``: out ``(total_q, heads, head_dim)`` in q's dtype, lse
    ``(heads, total_q)`` fp32 (float64 for float64 inputs).
    """
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(dim)
    cdt = torch.float32 if (upcast and q.dtype in (torch.float16, torch.bfloat16)) else q.dtype
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outs, lses = [], []
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1).to(cdt)
        ks = k[cu_k[b] : cu_k[b + 1]].transpose(0, 1).to(cdt)
        vs = v[cu_k[b] : cu_k[b + 1]].transpose(0, 1).to(cdt)
        if kv_heads != heads:
            ks = ks.repeat_interleave(heads // kv_heads, dim=0)
            vs = vs.repeat_interleave(heads // kv_heads, dim=0)
        o, lse = _sequence_attention(qs, ks, vs, scale, causal, tuple(window_size), softcap)
        outs.append(o.transpose(0, 1))
        lses.append(lse)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.cat(outs, 0) if outs else _empty_like_attention(q, k, v)
    lse = torch.cat(lses, 1) if lses else q.new_zeros(heads, 0) + out.sum() * 0
    return out.to(q.dtype), lse.to(lse_dtype)


def fold_lse_grad(delta, dlse, lse):
    """The backward's ``delta = rowsum(dO * O)`` ``(H, T)`` with the lse's gradient folded in.

    ``d lse_i / d s_ij = P_ij``, so a gradient ``dlse`` on the lse adds ``P_ij * dlse_i`` to the
    score gradient ``P_ij * (dP_ij - delta_i)``: the same as ``delta - dlse``. Rows that see no
    key (lse ``-inf``, P = 0) take none of it (a non-finite ``dlse`` there would give NaN)."""
    if dlse is None:
        return delta
    return delta - dlse.to(delta.dtype).masked_fill(torch.isneginf(lse), 0.0)


# ----------------------------------------------------------------------------- torch backend
def _torch_varlen_attention(
    q, k, v, cu_q, cu_k, scale, causal, window_size, softcap, dropout_p, return_lse
):
    """Per-sequence math. Memory is bounded by the longest sequence, never by the whole pack.

    Without lse or softcap, SDPA (fused on CPU and CUDA) handles full attention, causal
    self-attention and sliding windows over self-attention (``lq == lk``: every query sees its
    own key, so no row is empty); sequences of equal length share one batched SDPA call (at most
    ``_SDPA_BATCH_SCORES`` query-key pairs per call, or one sequence if it is longer). Everything
    else uses the explicit fp32 math of the reference, one sequence at a time.

    On CPU, inputs holding NaN or inf skip SDPA (its fused kernel turns a NaN row into zeros)
    and give NaN as plain attention does.

    Precision: fp16/bf16 GQA expands K/V before SDPA (SDPA's own ``enable_gqa`` backward sums a
    group's dK/dV in low precision: 2-4x plain torch's error). fp32 on CPU with gradients wanted
    runs the batches as explicit matmul/softmax instead of SDPA (the CPU fused kernel's fp32
    backward has 2-4x plain torch's error): 1.1-1.4x the fused time on typical packs, up to
    3.4x for one long causal sequence (full scores), and the probabilities are kept for the
    backward, as on the per-sequence path. Without gradients the fused kernel runs.
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    low = q.dtype in (torch.float16, torch.bfloat16)
    cdt = torch.float32 if low else q.dtype
    explicit = (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    )
    # the fused CPU kernel writes 0 for a row with NaN scores: inputs with NaN/inf take the
    # explicit path, which propagates them like plain torch (CPU only: a check costs no sync)
    fused = softcap == 0 and not return_lse and (q.device.type != "cpu" or all_finite(q, k, v))
    windowed = tuple(window_size) != (-1, -1)
    n_seq = len(cu_q) - 1
    pieces: list[torch.Tensor | None] = [None] * n_seq  # (lq, heads, head_dim) per sequence
    buckets: dict[tuple[int, int], list[int]] = {}
    lses = []
    for b in range(n_seq):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        if fused and lk > 0 and (lq == lk or not (causal or windowed)):
            buckets.setdefault((lq, lk), []).append(b)
            continue
        qs = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)
        ks = k[cu_k[b] : cu_k[b + 1]].transpose(0, 1)
        vs = v[cu_k[b] : cu_k[b + 1]].transpose(0, 1)
        if group > 1:
            ks, vs = ks.repeat_interleave(group, dim=0), vs.repeat_interleave(group, dim=0)
        o, lse = _sequence_attention(
            qs.to(cdt), ks.to(cdt), vs.to(cdt), scale, causal, window_size, softcap, dropout_p
        )
        pieces[b] = o.transpose(0, 1).to(q.dtype)
        lses.append(lse.to(_lse_dtype(q)))
    for (lq, lk), seqs in buckets.items():
        # SDPA's is_causal is top-left aligned: only used where lq == lk makes it agree
        mask = (
            attention_mask(lq, lk, causal, window_size, q.device) if windowed or explicit else None
        )
        # the explicit path materializes the scores of every head: bound those, not the pairs
        step = max(1, _SDPA_BATCH_SCORES // max(lq * lk * (heads if explicit else 1), 1))
        for i in range(0, len(seqs), step):
            part = seqs[i : i + step]
            adjacent = part[-1] - part[0] == len(part) - 1  # one contiguous token range: a view
            qs, ks, vs = (
                (
                    t[cu[part[0]] : cu[part[-1] + 1]].unflatten(0, (len(part), -1))
                    if adjacent
                    else torch.stack([t[cu[b] : cu[b + 1]] for b in part])
                ).transpose(1, 2)
                for t, cu in ((q, cu_q), (k, cu_k), (v, cu_k))
            )  # (n, heads, len, head_dim)
            if group > 1 and (low or explicit):
                ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
            if explicit:
                o = _dense_attention(qs, ks, vs, scale, mask, dropout_p)
            else:
                o = F.scaled_dot_product_attention(
                    qs,
                    ks,
                    vs,
                    attn_mask=mask,
                    dropout_p=dropout_p,
                    is_causal=causal and not windowed and lq > 0,
                    scale=scale,
                    enable_gqa=ks.shape[1] != heads,
                )
            o = o.transpose(1, 2)
            for j, b in enumerate(part):
                pieces[b] = o[j]
    out = torch.cat(pieces, 0) if n_seq else _empty_like_attention(q, k, v)
    if not return_lse:
        return out
    if lses:
        return out, torch.cat(lses, 1)
    return out, torch.zeros(heads, 0, dtype=_lse_dtype(q), device=q.device) + out.sum() * 0


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    """fp32, or float64 for float64 inputs (a float64 ground truth keeps its precision)."""
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------------- validation
def _window_pair(window_size) -> tuple[int, int]:
    """``window_size`` as two Python ints; any length-2 sequence or integer tensor/array is fine."""
    given = window_size
    if not isinstance(window_size, Sequence) and hasattr(window_size, "tolist"):
        window_size = window_size.tolist()  # torch tensor or numpy array
    expected = "window_size must be a pair of ints (left, right)"
    if isinstance(window_size, (str, bytes)) or not isinstance(window_size, Sequence):
        raise TypeError(f"{expected}, got {type(given).__name__} {given!r}")
    if len(window_size) != 2:
        raise ValueError(f"{expected}, got {len(window_size)} entries: {given!r}")
    pair = []
    for w in window_size:
        if isinstance(w, bool) or (isinstance(w, torch.Tensor) and w.dtype == torch.bool):
            raise TypeError(f"{expected}, got a bool entry: {given!r}")
        try:
            w = operator.index(w)  # int, numpy int, 0-d integer tensor
        except TypeError:
            raise TypeError(f"{expected}, got a {type(w).__name__} entry: {given!r}") from None
        pair.append(window_side(w))
    return pair[0], pair[1]


def window_side(w: int) -> int:
    """A negative side, or one past any int32 ``cu_seqlens`` position, is unbounded: -1 (so it
    fits the int32/int64 arguments of flash-attn and the traced op)."""
    return -1 if w < 0 or w >= 2**31 else w


def scalar_problem(softmax_scale, causal, softcap, dtype: torch.dtype) -> str:
    """What is wrong with the scalar options ('' when nothing): ``softmax_scale`` None or a
    finite number, ``causal`` a bool (NumPy's too), ``softcap`` a number in ``[0, max]`` of the
    dtype the scores are computed in (fp32, fp64 for fp64 inputs; larger caps overflow to NaN
    there)."""
    if softmax_scale is not None and not is_real(softmax_scale, finite=True):
        return f"softmax_scale must be a finite number or None, got {softmax_scale!r}"
    if not isinstance(causal, (bool, np.bool_)):  # not truthy values: a 0/1 tensor is refused
        return f"causal must be a bool, got {type(causal).__name__} {causal!r}"
    big = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).max
    if not (is_real(softcap) and 0 <= softcap <= big):  # also rejects NaN and inf
        return f"softcap must be a number in [0, {big:.4g}] (0: off), got {softcap!r}"
    return ""


def as_max_seqlen(name: str, given) -> int | None:
    """``max_seqlen_q/k`` as given: an int (numpy int, 0-d integer tensor) or None; 3.5 is a
    TypeError, not 3, and a bool is no length (the eager checks and the traced path share it)."""
    if given is None:
        return None
    try:
        if isinstance(given, (bool, np.bool_)) or getattr(given, "dtype", None) == torch.bool:
            raise TypeError
        return operator.index(given)
    except TypeError:
        raise TypeError(
            f"{name} must be an int or None, got {type(given).__name__} {given!r}"
        ) from None


def _check_inputs(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, window_size, softcap
):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(
                f"{name} must be (total_tokens, heads, head_dim), got shape {tuple(t.shape)}"
            )
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32/float16/bfloat16/float64, got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"head_dim of q ({q.shape[2]}) and k ({k.shape[2]}) must match")
    if not 0 < q.shape[2] <= 256:
        raise ValueError(f"head_dim must be in [1, 256], got {q.shape[2]}")
    if q.shape[1] == 0:
        raise ValueError(f"q must have at least one head, got shape {tuple(q.shape)}")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"heads of q ({q.shape[1]}) must be a multiple of kv heads of k ({k.shape[1]})"
        )
    cu_q = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q")
    cu_k = check_cu_seqlens(cu_seqlens_k, k.shape[0], "cu_seqlens_k")
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of "
            f"sequences, got {len(cu_q) - 1} and {len(cu_k) - 1}"
        )
    longest_q, longest_k = _longest(cu_q), _longest(cu_k)
    bound = longest_k  # flash-attn's: the max_seqlen_k given, else the longest key sequence
    for name, given, longest in (
        ("max_seqlen_q", max_seqlen_q, longest_q),
        ("max_seqlen_k", max_seqlen_k, longest_k),
    ):
        given = as_max_seqlen(name, given)
        if given is not None and given < longest:
            raise ValueError(f"{name}={given} is smaller than the longest sequence ({longest})")
        bound = given if name == "max_seqlen_k" and given is not None else bound
    if not (is_scalar(dropout_p) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    return cu_q, cu_k, longest_q, longest_k, unbounded_window(_window_pair(window_size), bound)


def unbounded_window(window: tuple[int, int], bound: int) -> tuple[int, int]:
    """flash-attn's rule: a side reaching ``bound`` (``max_seqlen_k``: as given, else the longest
    key sequence) is unbounded, -1 (with more queries than keys plus the right side, a bounded
    right side would leave the first rows without keys)."""
    return tuple(-1 if w >= bound else w for w in window)


def _longest(cu: list[int]) -> int:
    """The longest sequence of a validated ``cu_seqlens`` list."""
    return max(map(operator.sub, cu[1:], cu[:-1]), default=0)


def _flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _is_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


_WARNED: set[str] = set()


def resolve_backend(backend: str, q: torch.Tensor, dropout_p: float) -> str:
    """The backend that runs the call; raises, naming the backend, if a requested one cannot.

    ``"auto"``: ``flash_attn`` for fp16/bf16 CUDA tensors when flash-attn is installed, else
    ``triton`` on CUDA (``torch`` for float64, which Triton does not take), else ``torch``.
    Triton has no dropout, so ``"auto"`` with ``dropout_p > 0`` on CUDA without flash-attn runs
    ``torch`` (SDPA) and warns once per process (``backend="torch"`` chooses it silently).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    cuda = _is_cuda(q)
    if backend == "auto":
        if cuda and q.dtype in (torch.float16, torch.bfloat16) and _flash_attn_available():
            return "flash_attn"
        if cuda and dropout_p > 0:
            if "dropout" not in _WARNED:
                _WARNED.add("dropout")
                warnings.warn(
                    f"varlen_attention(backend='auto', dropout_p={dropout_p}): the 'triton' "
                    f"backend has no dropout and flash-attn cannot run ({q.dtype}, installed: "
                    f"{_flash_attn_available()}), so the 'torch' backend runs; pass "
                    f"backend='torch' to choose it explicitly",
                    stacklevel=3,
                )
            return "torch"
        return "triton" if cuda and q.dtype != torch.float64 else "torch"
    if backend == "flash_attn" and not (cuda and _flash_attn_available()):
        raise ValueError("backend='flash_attn' needs CUDA tensors and the flash-attn package")
    if backend == "triton" and dropout_p > 0:
        raise ValueError(f"backend='triton' does not support dropout, got dropout_p={dropout_p}")
    return backend


# ----------------------------------------------------------------------------- public API
def varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    return_lse=False,
    backend="auto",
    deterministic=False,
):
    """Attention over packed sequences; a drop-in for ``flash_attn_varlen_func``.

    Args:
        q: ``(total_q, heads, head_dim)``, fp32/fp16/bf16 (fp64 on the torch backend).
        k, v: ``(total_k, kv_heads, head_dim)``; ``heads % kv_heads == 0`` (GQA/MQA: query head
            ``h`` reads kv head ``h // (heads // kv_heads)``). head_dim <= 256, any value.
        cu_seqlens_q, cu_seqlens_k: int32 ``(batch + 1,)``, ``[0, ..., total]``, non-decreasing
            (int64 and Python lists/tuples of ints are accepted and converted).
        max_seqlen_q, max_seqlen_k: longest sequence (used for the kernel grid); None computes it.
        dropout_p: attention dropout (torch and flash_attn backends only; ``"auto"`` on CUDA
            without flash-attn then runs torch and warns once, see :func:`resolve_backend`).
        softmax_scale: defaults to ``1 / sqrt(head_dim)``.
        causal: bottom-right aligned causal mask (a bool).
        window_size: ``(left, right)`` sliding window, any length-2 sequence or integer tensor;
            -1 means unbounded, and so does a side >= ``max_seqlen_k`` (flash-attn's rule) or
            >= 2**31.
        softcap: if > 0, scores become ``softcap * tanh(scores / softcap)`` (Gemma-2); 0 or None
            is off.
        return_lse: also return the log-sum-exp ``(heads, total_q)`` fp32, float64 for float64
            inputs (natural log of the
            masked, scaled, capped scores' exp-sum; ``-inf`` for a query that sees no key).
        backend: ``"auto"`` | ``"torch"`` | ``"triton"`` | ``"flash_attn"``.
        deterministic: flash-attn's flag (a deterministic, slower backward) for the
            ``flash_attn`` backend; ``triton``'s backward is always deterministic, ``torch``'s
            follows ``torch.use_deterministic_algorithms``.

    Returns:
        out ``(total_q, heads, head_dim)`` in q's dtype, or ``(out, lse)``. Differentiable in
        q, k, v through ``out`` and the lse (so partial results merged by their lse get exact
        gradients) on the torch and triton backends; flash-attn drops the lse's gradient, so on
        the ``flash_attn`` backend a backward through the lse raises instead. ``triton``'s
        gradients are not differentiable again: a double backward through them raises.
    """
    softcap = 0.0 if softcap is None else softcap  # None: off (as transformers passes it)
    problem = scalar_problem(
        softmax_scale, causal, softcap, q.dtype if isinstance(q, torch.Tensor) else None
    )
    if problem:
        raise (TypeError if problem.startswith("causal") else ValueError)(problem)
    causal = bool(causal)
    if isinstance(q, torch.Tensor):  # lists are converted; other types fail in the checks
        cu_seqlens_q = as_cu_seqlens(cu_seqlens_q, q.device, "cu_seqlens_q")
        cu_seqlens_k = as_cu_seqlens(cu_seqlens_k, q.device, "cu_seqlens_k")
    if torch.compiler.is_compiling() and not dropout_p:
        # traced: a custom op (fake shapes for dynamo); it validates at run time, inside
        from rlhf_kernels.ops.compiled import compiled_varlen_attention

        scale = float(softmax_scale) if softmax_scale is not None else q.shape[2] ** -0.5
        return compiled_varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal,
            _window_pair(window_size), softcap, return_lse, resolve_backend(backend, q, dropout_p),
            bool(deterministic),
        )  # fmt: skip
    cu_q, cu_k, max_seqlen_q, max_seqlen_k, window_size = _check_inputs(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        window_size,
        softcap,
    )
    backend = resolve_backend(backend, q, dropout_p)
    if backend == "flash_attn" and q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"backend='flash_attn' needs fp16/bf16, got {q.dtype}")
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[2])
    # _check_inputs gave the window as two ints and the real longest sequences: grids are sized
    # by those (validation read cu_seqlens anyway), so an oversized max_seqlen_* (a fixed
    # constant, as flash-attn callers often pass) costs nothing

    if backend == "torch":
        return _torch_varlen_attention(
            q, k, v, cu_q, cu_k, scale, causal, window_size, float(softcap), dropout_p, return_lse
        )
    if backend == "triton":
        from rlhf_kernels.ops.varlen_attention_triton import triton_varlen_attention

        out, lse = triton_varlen_attention(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            int(max_seqlen_q),
            int(max_seqlen_k),
            scale,
            causal,
            window_size,
            float(softcap),
        )
        return (out, lse) if return_lse else out
    return _flash_attn_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_q,
        cu_k,
        dropout_p,
        scale,
        causal,
        window_size,
        float(softcap),
        return_lse,
        bool(deterministic),
    )


# ----------------------------------------------------------------------------- flash-attn
def _keyless_rows(cu_q, cu_k, causal, window_size) -> list[tuple[int, int]]:
    """Token ranges ``[start, stop)`` of the queries that see no key (module docstring's mask)."""
    right = 0 if causal else window_size[1]
    rows = []
    for b in range(len(cu_q) - 1):
        lq, lk = cu_q[b + 1] - cu_q[b], cu_k[b + 1] - cu_k[b]
        # query i sees keys j <= i + lk - lq + right (a left bound never empties a row)
        n = lq if lk == 0 else (min(lq, max(0, lq - lk - right)) if right >= 0 else 0)
        if n:
            rows.append((cu_q[b], cu_q[b] + n))
    return rows


def _flash_attn_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_q,
    cu_k,
    dropout_p,
    scale,
    causal,
    window_size,
    softcap,
    return_lse,
    deterministic,
):
    """flash-attn's ``flash_attn_varlen_func``, its lse brought to this module's convention.

    The lse comes back ``(heads, total_q)`` (older flash-attn pads it to ``(batch, heads,
    max_seqlen_q)``); queries that see no key get output 0 and lse ``-inf`` (flash-attn 2
    writes ``+inf`` there).
    """
    from flash_attn import flash_attn_varlen_func

    lens_q = [b - a for a, b in zip(cu_q[:-1], cu_q[1:])]
    lens_k = [b - a for a, b in zip(cu_k[:-1], cu_k[1:])]
    res = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q.int(),
        cu_seqlens_k.int(),
        max(lens_q, default=0),
        # flash-attn unbounds a side >= this: a right side kept bounded (below the caller's
        # max_seqlen_k, see unbounded_window) must stay below it (an int32 argument)
        min(max(max(lens_k, default=0), window_size[1] + 1), 2**31 - 1),
        dropout_p=dropout_p,
        softmax_scale=scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        deterministic=deterministic,
        return_attn_probs=return_lse,
    )
    out, lse = (res[0], res[1]) if return_lse else (res, None)
    if lse is not None and lse.dim() == 3:  # padded: keep each sequence's real rows
        lse = torch.cat(
            [lse.new_empty(lse.shape[1], 0)] + [lse[b, :, :n] for b, n in enumerate(lens_q)], 1
        )
    rows = _keyless_rows(cu_q, cu_k, causal, window_size)
    if rows:
        empty = torch.zeros(q.shape[0], dtype=torch.bool)
        for a, b in rows:
            empty[a:b] = True
        empty = empty.to(q.device)
        # out of place: flash-attn saved its out/lse for the backward
        out = out.masked_fill(empty[:, None, None], 0.0)
        if lse is not None:
            lse = lse.masked_fill(empty, float("-inf"))
    return (out, _NoLseGrad.apply(lse.float())) if return_lse else out


class _NoLseGrad(torch.autograd.Function):
    """Identity on flash-attn's lse; a gradient reaching it raises (flash-attn would drop it)."""

    @staticmethod
    def forward(ctx, lse):
        ctx.set_materialize_grads(False)
        return lse.clone()

    @staticmethod
    def backward(ctx, dlse):
        if dlse is not None:
            raise RuntimeError(
                "varlen_attention(backend='flash_attn'): the lse has no gradient (flash-attn "
                "drops it, so the result would be silently wrong); use backend='triton' or "
                "'torch' to differentiate through the lse, or detach it"
            )
        return None
