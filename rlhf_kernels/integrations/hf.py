"""transformers integration: packed (varlen) and ring attention through the public registries.

``register()`` adds an attention implementation named ``"rlhf_kernels"`` to transformers'
``AttentionInterface`` and a matching ``AttentionMaskInterface`` entry (so transformers never
builds a dense ``(B, 1, S, S)`` mask for it; it hands over the 2-D padding mask or nothing). Then::

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="rlhf_kernels")
    out = model(**packed_model_inputs(samples))   # one [1, T] stream, no attention mask

``register_ring()`` adds ``"rlhf_kernels_ring"``: the same function, except that it raises
outside ``ring_context`` (so a sharded forward without the context cannot silently attend within
one rank's shard).

The attention function picks, in order:

1. ``ring_context(plan, ...)`` active: ``rlhf_kernels.ring.attention.ring_varlen_attention`` on
   this rank's tokens (batch 1); ``cu_seqlens``/``position_ids`` are ignored (the plan has them).
2. A 2-D padding mask ``(B, kv_len)``: the padded batch is unpadded, run varlen, re-padded.
   Causal layers: queries are the last ``S_q`` keys and padding query rows give 0. Non-causal
   layers (encoders, cross-attention) mask keys only and compute every query row, as SDPA does.
   Each row's real tokens are one sequence, or (causal self-attention with ``position_ids``)
   several: a sample starts where the position is not the previous token's + 1 (as in 4.), and
   across padding inside a row where it does not increase (packed rows padded to a multiple;
   whole-row forwards only: a decode step after a KV cache, with fewer queries than keys, has
   no key positions and sees its whole row). ``cu_seq_lens_q/k`` with a padding mask
   are refused.
3. ``cu_seq_lens_q/k`` (+ ``max_length_q/k``) kwargs, e.g. from :func:`packed_model_inputs`
   (validated at the first attention layer of each forward, cached for the others).
4. ``position_ids``: a new sample starts wherever ``pos[t] != pos[t - 1] + 1`` (transformers'
   own packed-sequence rule). Computed at the first attention layer (smallest ``layer_idx``) of
   each forward and reused by the others.
5. Otherwise every batch row is one sequence (query rows aligned to the end of the keys).

Refused with a clear error (never silently ignored): score modifiers passed by the layer
(T5's ``position_bias``, attention sinks ``s_aux`` / ``sinks``, sparse ``indices``), mask
structures other than causal / bidirectional / sliding window / packing (chunked attention,
image-token block masks, custom overlays; inside a torch.compile trace, where dynamo cannot
read the mask function, chunked attention is refused from the config and an overlay that shows
later keys fails at run time (``_check_no_lookahead``); other parts are not checked there),
static KV caches (keys past the written ones) and paged caches. ``output_attentions=True``
gets no weights (like SDPA) and a warning.

Sliding window: transformers' layers see key ``j`` from query ``i`` when
``i - sliding_window < j <= i``, i.e. ``window_size = (sliding_window - 1, 0)``. Softcap (Gemma-2)
is ``softcap * tanh(scores / softcap)`` before masking, as in transformers' eager path.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import numbers
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_kernels._checks import forget_validated
from rlhf_kernels.ops.varlen_attention import BACKENDS, varlen_attention
from rlhf_kernels.packing import IGNORE_INDEX, pack_sequences

ATTN_NAME = "rlhf_kernels"
RING_ATTN_NAME = "rlhf_kernels_ring"  # register_ring(): refuses to run outside ring_context
# transformers' own implementations: register() must not replace them
_BUILTIN_IMPLEMENTATIONS = (
    "eager",
    "sdpa",
    "flex_attention",
    "paged|eager",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)


# ----------------------------------------------------------------------------- ring contract
@dataclass(frozen=True)
class _RingState:
    plan: Any
    group: Any
    kwargs: dict = field(default_factory=dict)


_RING: contextvars.ContextVar[_RingState | None] = contextvars.ContextVar(
    "rlhf_kernels_ring", default=None
)
# how many ring contexts are open in this process: while 0, attention does not read the
# ContextVar at all (torch.compile cannot trace ContextVar.get; it guards on this int instead)
_RING_OPEN = [0]
# every open ring context of the process (innermost last), for threads that see none: autograd
# runs CUDA backward on its own device threads, which do not inherit the caller's ContextVars,
# and that is where gradient checkpointing recomputes the layers
_RING_STATES: list[_RingState] = []


def _ring_state() -> _RingState | None:
    """This thread's ring context; in a thread without one, the context open elsewhere in the
    process (a RuntimeError if several threads hold different rings)."""
    state = _RING.get()
    if state is None and _RING_STATES:
        state = _RING_STATES[-1]
        for other in _RING_STATES:
            if other.plan is not state.plan or other.group is not state.group:
                raise RuntimeError(
                    "ring attention ran in a thread without ring_context while other threads "
                    "hold different ring contexts: cannot tell which ring it belongs to (run "
                    "one ring per process, or the forward and backward in the context's thread)"
                )
    return state


@contextlib.contextmanager
def ring_context(plan: Any, group: Any = None, **ring_kwargs: Any) -> Iterator[None]:
    """While active, the ``"rlhf_kernels"`` attention runs ring attention on this rank's tokens.

    Every attention layer calls ``ring_varlen_attention(q, k, v, plan, group=group, causal=True,
    softmax_scale=..., window_size=..., softcap=..., **ring_kwargs)`` with q/k/v shaped
    ``(local_tokens, heads, head_dim)``; inputs must be one ``[1, local_tokens]`` row (no mask).
    Keep the context open through ``backward()`` when layers are gradient-checkpointed: their
    recomputation runs ring attention too, also on autograd's CUDA device threads (which see
    the context open in this process when they have none of their own).

    Args:
        plan: the ring plan (``rlhf_kernels.ring.plan.RingPlan``) describing this rank's tokens.
        group: the ring's process group (None: the default group).
        ring_kwargs: passed through to ``ring_varlen_attention``.
    """
    state = _RingState(plan, group, dict(ring_kwargs))
    token = _RING.set(state)
    _RING_STATES.append(state)
    _RING_OPEN[0] += 1
    try:
        yield
    finally:
        _RING_OPEN[0] -= 1
        del _RING_STATES[next(i for i, s in enumerate(_RING_STATES) if s is state)]
        _RING.reset(token)


# ----------------------------------------------------------------------------- segments
_POS_CACHE_LOCK = threading.Lock()
_POS_CACHE: list = [None]  # [(weakref to position_ids, version, shape, (cu_seqlens, max_len))]


def _segments_from_position_ids(
    pos: torch.Tensor, refresh: bool = False, rows: int | None = None, step: int = 1
) -> tuple[torch.Tensor, int]:
    """``(B, S)`` position ids -> (int32 cu_seqlens over the flattened ``B * S`` tokens, max len).
    ``rows``: the batch size when ``pos`` is one row shared by every row (``(1, S)``, expanded
    here so that the cache sees the caller's tensor, not a new expanded view per layer).
    ``step=0``: ``pos`` holds segment numbers (transformers' packed-sequence mask) instead.

    A sample starts at each row start and wherever ``pos[t] != pos[t - 1] + step``. The result for
    the last tensor seen is cached (weak reference + in-place version), so the layers of one
    forward compute it once; ``refresh`` (the first layer, see :func:`_first_layer`) recomputes
    it, so a write the version counter misses (``dist.broadcast`` into a reused buffer) is seen
    at the next forward.
    """
    with _POS_CACHE_LOCK:
        hit = None if refresh else _POS_CACHE[0]
        key = (pos.shape, rows, step)
        if hit is not None and hit[0]() is pos and hit[1] == _version(pos) and hit[2] == key:
            return hit[3]
    seq = pos.shape[-1]
    flat = (pos if rows is None else pos.expand(rows, -1)).reshape(-1)
    start = torch.ones_like(flat, dtype=torch.bool)
    start[1:] = flat[1:] != flat[:-1] + step
    start[::seq] = True
    bounds = torch.cat(
        [start.nonzero().flatten(), torch.tensor([flat.numel()], device=flat.device)]
    )
    cu = bounds.to(torch.int32)
    result = (cu, int(bounds.diff().max()) if len(bounds) > 1 else 0)  # (an empty batch: 0)
    with _POS_CACHE_LOCK:
        _POS_CACHE[0] = (weakref.ref(pos), _version(pos), key, result)
    return result


# (attention class, id(config)) -> (weakref to the config or None, smallest layer_idx seen)
_FIRST_LAYER: dict[tuple[type, int], tuple[Any, int]] = {}


def _first_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a model's first attention layer: the smallest transformers
    ``layer_idx`` seen for its class within its model (the layers of one model share their
    ``config`` object; hybrid models start attention past layer 0; a shared block reused with
    one index refreshes at every call). There a forward's per-forward caches are rebuilt.
    Models without an integer ``layer_idx`` rely on the version counter alone."""
    idx = getattr(module, "layer_idx", None)
    if not isinstance(idx, int):
        return False
    config = getattr(module, "config", None)
    try:
        ref = None if config is None else weakref.ref(config)
    except TypeError:
        ref = None
    key = (type(module), id(config))
    seen = _FIRST_LAYER.get(key)
    if seen is not None and seen[0] is not None and seen[0]() is not config:
        seen = None  # a dead config's id, reused by another model's
    if seen is None or idx <= seen[1]:
        _FIRST_LAYER[key] = (ref, idx)
        return True
    return False


# under torch.compile: run once at trace time, a constant of each layer's graph (the layers are
# traced in order, so the first one traced is the first one run)
_first_layer_traced = torch.compiler.assume_constant_result(_first_layer)


def _version(t: torch.Tensor) -> int | None:
    """``t._version``; None for inference tensors (no version counter: the caches then rely
    on identity and the first-layer refresh)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _window(sliding_window: int | None, causal: bool) -> tuple[int, int]:
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral):
        raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
    if int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
    left = int(sliding_window) - 1  # transformers: key j visible when j > i - sliding_window
    return (left, 0 if causal else left)


@functools.lru_cache(maxsize=64)
def _row_cu_seqlens(bsz: int, s_q: int, s_k: int, device: torch.device):
    """``cu_seqlens`` of a batch whose rows are one sequence each. Cached, so every layer passes
    the same (never modified) tensors and their validation is read from the host only once."""
    rows = torch.arange(0, bsz + 1, device=device, dtype=torch.int32)
    return rows * s_q, rows * s_k


def _cu_from_counts(counts: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(counts.cumsum(0), (1, 0)).to(torch.int32)


# ----------------------------------------------------------------------------- attention
# kwargs some layers pass that change the scores; ignoring one would be a silently wrong result
_SCORE_MODIFIERS = ("position_bias", "s_aux", "sinks", "indices", "block_indices")
_WARNED_ATTENTIONS = [False]
_WARNED_NO_POSITIONS = [False]


def rlhf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    backend: str = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (the parameter order of ``flash_attention_forward``).

    Args:
        module: the attention layer (``module.is_causal`` is the default for ``is_causal``).
        query: ``(B, heads, S_q, head_dim)``; key: ``(B, kv_heads, S_k, head_dim)``; value:
            ``(B, kv_heads, S_k, v_head_dim)`` (MLA models such as DeepSeek-V3 have a narrower
            ``v_head_dim``: the narrower of q/k and v is zero-padded to the wider for the kernel).
        attention_mask: None; the 2-D bool padding mask ``(B, S_k)`` built by
            :func:`padding_mask` (True = real token); or its int32 segment numbers ``(B, S)``
            of packed rows (for layers that do not pass ``position_ids`` on). 4-D is rejected.
        dropout, scaling, sliding_window, softcap: the layer's settings (transformers' meaning).
        kwargs: ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids`` as described in the
            module docstring; score modifiers (``position_bias``, ``s_aux``, ``sinks``,
            ``indices``, ``block_indices``) raise; anything else is ignored.

    Returns:
        ``(out, None)`` with out ``(B, S_q, heads, v_head_dim)``.
    """
    shapes = [tuple(t.shape) for t in (query, key, value)]
    if (
        {len(x) for x in shapes} != {4}
        or shapes[1][0] != shapes[0][0]
        or shapes[2][:3] != shapes[1][:3]
    ):
        raise ValueError(
            f"query must be (batch, heads, S_q, head_dim), key and value (batch, kv_heads, S_k, "
            f"head_dim) with the same batch, kv_heads and S_k; got query {shapes[0]}, key "
            f"{shapes[1]}, value {shapes[2]}"
        )
    dim, v_dim = query.shape[-1], value.shape[-1]
    if key.shape[-1] != dim:
        raise ValueError(
            f"query and key must have the same head_dim, got {query.shape[-1]} and {key.shape[-1]}"
        )
    if v_dim != dim:  # MLA: attend at one width (zero columns change no score), slice back
        width = max(dim, v_dim)
        query, key, value = (
            torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (query, key, value)
        )
        out, _ = rlhf_attention_forward(
            module, query, key, value, attention_mask, dropout,
            dim**-0.5 if scaling is None else scaling,
            sliding_window, softcap, is_causal, backend, **kwargs,
        )  # fmt: skip
        return out[..., :v_dim], None
    segments = None  # packed rows' segment numbers from padding_mask (see its docstring)
    if attention_mask is not None and attention_mask.dtype == torch.int32:
        segments, attention_mask = attention_mask, None
    if kwargs.get("cache") is not None:
        raise ValueError(
            "rlhf_kernels attention does not support paged caches (continuous "
            "batching); use attn_implementation='sdpa' for serving"
        )
    given = [k for k in _SCORE_MODIFIERS if kwargs.get(k) is not None]
    if given:
        raise ValueError(
            f"rlhf_kernels attention cannot apply {given} (attention bias, sinks or sparse "
            f"indices change the scores); use attn_implementation='eager' or 'sdpa' for "
            f"{type(module).__name__}"
        )
    if kwargs.get("output_attentions") and not _WARNED_ATTENTIONS[0]:
        _WARNED_ATTENTIONS[0] = True
        warnings.warn(
            "rlhf_kernels attention never materialises attention weights: "
            "output_attentions=True returns none (use attn_implementation='eager')",
            stacklevel=2,
        )
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    window = _window(sliding_window, causal)
    cap = float(softcap) if softcap is not None else 0.0
    bsz, heads, s_q, dim = query.shape
    s_k = key.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, heads, D)

    ring = _ring_state() if _RING_OPEN[0] else None
    if ring is not None:
        if bsz != 1 or attention_mask is not None or not causal:
            raise ValueError(
                f"ring attention needs one causal [1, local_tokens] row without an "
                f"attention mask, got batch {bsz}, mask "
                f"{attention_mask is not None}, causal {causal}"
            )
        if dropout > 0:
            raise ValueError(
                f"ring attention has no attention dropout, got dropout={dropout} (set the "
                f"config's attention_dropout to 0 or call model.eval())"
            )
        from rlhf_kernels.ring.attention import ring_varlen_attention

        out = ring_varlen_attention(
            q[0],
            k[0],
            v[0],
            ring.plan,
            group=ring.group,
            causal=True,
            softmax_scale=scaling,
            window_size=window,
            softcap=cap,
            **ring.kwargs,
        )
        return out.reshape(1, s_q, heads, out.shape[-1]), None

    # no query rows: the empty output, as SDPA gives (after the ring branch: a ring rank
    # without tokens still joins the exchange)
    if s_q == 0:
        return query.new_empty(bsz, 0, heads, value.shape[-1]), None
    common = dict(
        dropout_p=dropout,
        softmax_scale=scaling,
        causal=causal,
        window_size=window,
        softcap=cap,
        backend=backend,
    )
    if attention_mask is not None:
        if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
            raise ValueError(
                "cu_seq_lens_q/k (packed samples) came with a padding attention_mask: give one "
                "of them (pack without a mask, or pad without cu_seq_lens; position_ids that "
                "restart inside a padded row do split it). An all-ones mask is dropped in eager "
                "mode; under torch.compile leave it out"
            )
        pos = kwargs.get("position_ids") if causal and s_q == s_k else None
        if pos is not None:
            _check_position_ids(pos, bsz, s_q)
        return _padded_attention(q, k, v, attention_mask, window, common, pos), None

    q, k, v = (
        q.reshape(-1, heads, dim),
        k.reshape(-1, k.shape[2], dim),
        v.reshape(-1, v.shape[2], dim),
    )
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is not None or cu_k is not None:
        if bsz != 1 or cu_q is None or cu_k is None:
            raise ValueError(
                f"cu_seq_lens_q/k need a packed batch of one row and both tensors, "
                f"got batch {bsz}, cu_seq_lens_q given {cu_q is not None}, "
                f"cu_seq_lens_k given {cu_k is not None}"
            )
        if _first_layer(module):  # once per forward: re-read reused (device) buffers
            forget_validated(cu_q, cu_k)
        max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
        out = varlen_attention(
            q,
            k,
            v,
            cu_q,
            cu_k,
            None if max_q is None else int(max_q),
            None if max_k is None else int(max_k),
            **common,
        )
    elif kwargs.get("position_ids") is not None and s_q == s_k:
        pos = kwargs["position_ids"]
        _check_position_ids(pos, bsz, s_q)
        rows = bsz if pos.shape[0] != bsz else None  # (1, S) shared by the rows
        if torch.compiler.is_compiling():  # data-dependent: a custom op (rlhf_kernels.ops.compiled)
            from rlhf_kernels.ops.compiled import segments_from_position_ids

            first = _first_layer_traced(module)
            cu = segments_from_position_ids(pos if rows is None else pos.expand(rows, -1), 1, first)
            longest = None
        else:
            cu, longest = _segments_from_position_ids(pos, _first_layer(module), rows)
        out = varlen_attention(q, k, v, cu, cu, longest, longest, **common)
    elif segments is not None:  # packed rows whose layer does not pass position_ids on
        if segments.shape != (bsz, s_q) or s_q != s_k:
            raise ValueError(
                f"packed-row segment numbers must be (batch, S) = ({bsz}, {s_q}) with as many "
                f"keys as queries, got shape {tuple(segments.shape)} and {s_k} keys"
            )
        if torch.compiler.is_compiling():  # data-dependent: a custom op (rlhf_kernels.ops.compiled)
            from rlhf_kernels.ops.compiled import segments_from_position_ids

            cu = segments_from_position_ids(segments, 0, _first_layer_traced(module))
            longest = None
        else:
            cu, longest = _segments_from_position_ids(segments, _first_layer(module), step=0)
        out = varlen_attention(q, k, v, cu, cu, longest, longest, **common)
    else:  # one sequence per row
        if module.training and causal and s_q == s_k and not _WARNED_NO_POSITIONS[0]:
            _WARNED_NO_POSITIONS[0] = True  # (Persimmon, GPTBigCode: packing can go unseen)
            warnings.warn(
                f"{type(module).__name__} does not pass position_ids to the attention function: "
                f"each row is taken as one sample unless transformers marks packed samples, "
                f"which it does only without a KV cache. For packed rows pass cu_seq_lens_q/k "
                f"(packed_model_inputs) or use_cache=False",
                stacklevel=2,
            )
        cu_q, cu_k = _row_cu_seqlens(bsz, s_q, s_k, query.device)
        out = varlen_attention(q, k, v, cu_q, cu_k, s_q, s_k, **common)
    return out.reshape(bsz, s_q, heads, out.shape[-1]), None


def _check_position_ids(pos: torch.Tensor, bsz: int, s_q: int) -> None:
    if pos.dim() != 2 or pos.shape[0] not in (1, bsz) or pos.shape[1] != s_q:
        raise ValueError(
            f"position_ids must be ({bsz}, {s_q}) or (1, {s_q}) for batch {bsz}, {s_q} positions "
            f"per row, got shape {tuple(pos.shape)}"
        )


def _padded_attention(q, k, v, mask, window, common, pos=None) -> torch.Tensor:
    """Unpad a padded batch (q ``(B, S_q, H, D)``, k/v ``(B, S_k, KVH, D)``), run varlen, re-pad.
    ``pos``: causal self-attention's ``position_ids`` ``(B or 1, S)``: a row's real tokens are
    further split at position restarts (samples packed in a padded row, see
    :func:`_padded_layout_uncached`)."""
    bsz, s_q, heads, dim = q.shape
    s_k = k.shape[1]
    if mask.dim() != 2 or mask.shape[0] != bsz or mask.shape[1] < s_k:
        raise ValueError(
            f"rlhf_kernels attention takes a 2-D padding mask (batch, kv_len) = "
            f"({bsz}, {s_k}); got shape {tuple(mask.shape)}. 4-D masks are not "
            f"supported: pass a 2-D mask or packed position_ids"
        )
    windowed = window[0] >= 0
    # causal: the queries are the last s_q keys (self-attention, maybe after a cache), so their
    # mask is the keys' last columns. Non-causal (encoders, cross-attention where the mask is
    # the encoder's): the mask is over keys only and every query row is computed, as in SDPA.
    # A non-causal window needs query i at key i (self-attention, same mask).
    all_queries = not common["causal"] and not windowed
    if not common["causal"] and windowed and s_q != s_k:
        raise ValueError(
            f"a non-causal sliding window needs self-attention (as many queries as keys), got "
            f"{s_q} queries and {s_k} keys"
        )
    if torch.compiler.is_compiling():  # data-dependent: a custom op (rlhf_kernels.ops.compiled)
        from rlhf_kernels.ops.compiled import padded_layout

        pos_b = None if pos is None else pos.expand(bsz, -1)
        idx_q, idx_k, cu_q, cu_k = padded_layout(mask, s_q, s_k, windowed, all_queries, pos_b)
        max_q = max_k = None
    else:
        idx_q, idx_k, cu_q, cu_k, max_q, max_k = _padded_layout(
            mask, s_q, s_k, windowed, all_queries, pos
        )
    out = varlen_attention(
        q.reshape(-1, heads, dim)[idx_q],
        k.reshape(-1, k.shape[2], dim)[idx_k],
        v.reshape(-1, v.shape[2], dim)[idx_k],
        cu_q,
        cu_k,
        max_q,
        max_k,
        **common,
    )
    full = out.new_zeros(bsz * s_q, heads, out.shape[-1]).index_copy(0, idx_q, out)
    return full.reshape(bsz, s_q, heads, out.shape[-1])


_MASK_CACHE_LOCK = threading.Lock()
# [(weakref to mask, version, key, (layout, holes))], newest last: two entries, so the sliding
# and full masks of a model alternating both kinds of layers (Gemma-2) do not evict each other
_MASK_CACHE: list = []


def _padded_layout(mask, s_q: int, s_k: int, windowed: bool, all_queries: bool = False, pos=None):
    """Token indices, ``cu_seqlens`` and max lengths of a padded batch's real tokens (split
    further at position restarts with ``pos``, see :func:`_padded_attention`).

    Every layer of a forward passes the same mask tensor (a model alternating sliding and full
    layers, two): the layout is computed (with its one host read) for the first layer of each
    and read from a two-entry cache (weak reference + in-place version, like the position-ids
    cache) by the others, whose ``cu_seqlens`` are then the same
    tensors, so their validation is a cache hit too. The mask is the one :func:`padding_mask`
    made for this forward (a new tensor each forward), so the cache never outlives a forward.
    """
    key = (s_q, s_k, all_queries, mask.shape)  # not windowed: alternating layers share it
    pos_key = None if pos is None else (weakref.ref(pos), _version(pos))
    with _MASK_CACHE_LOCK:
        for hit in _MASK_CACHE:
            same_pos = (hit[4] is None) == (pos is None) and (
                pos is None or (hit[4][0]() is pos and hit[4][1] == pos_key[1])
            )
            if hit[0]() is mask and hit[1] == _version(mask) and hit[2] == key and same_pos:
                layout, holes = hit[3]
                if windowed and holes:
                    raise _holes_error()
                return layout
    layout, holes = _padded_layout_uncached(mask, s_q, s_k, all_queries, pos)
    with _MASK_CACHE_LOCK:
        _MASK_CACHE[:] = [
            *_MASK_CACHE[-1:],
            (weakref.ref(mask), _version(mask), key, (layout, holes), pos_key),
        ]
    if windowed and holes:
        raise _holes_error()
    return layout


def _holes_error() -> ValueError:
    # unpadding would shrink distances across holes, changing what a window sees
    return ValueError(
        "sliding-window attention needs each row's real tokens to be contiguous (left or right "
        "padding), got padding between tokens"
    )


def _padded_layout_uncached(mask, s_q: int, s_k: int, all_queries: bool = False, pos=None):
    """``((idx_q, idx_k, cu_q, cu_k, max_q, max_k), holes)``: ``holes`` tells whether some row
    has padding between real tokens (sliding windows refuse it). One host read. ``pos``
    (causal self-attention, ``s_q == s_k``): a sample also starts at each real token whose
    position is not the previous token's + 1 (or, across padding inside the row, not above the
    previous real token's)."""
    if mask.dtype != torch.bool and bool(((mask != 0) & (mask != 1)).any()):  # not as a weight
        raise ValueError(
            f"rlhf_kernels attention takes a bool or 0/1 padding mask (1 = real token), got "
            f"{mask.dtype} with other values (an additive 0 / -inf mask?)"
        )
    mask_k = mask[:, -s_k:].bool()
    if all_queries:
        mask_q = torch.ones(mask.shape[0], s_q, dtype=torch.bool, device=mask.device)
    else:
        mask_q = mask_k[:, -s_q:]
    runs = (mask_k[:, 1:] & ~mask_k[:, :-1]).sum(1) + mask_k[:, 0]  # real-token runs per row
    idx_q = mask_q.reshape(-1).nonzero().flatten()
    idx_k = mask_k.reshape(-1).nonzero().flatten()
    n_q, n_k = mask_q.sum(1), mask_k.sum(1)
    cu_q, cu_k = _cu_from_counts(n_q), _cu_from_counts(n_k)
    if pos is not None:  # idx_q == idx_k: one cu_seqlens for both
        p = pos.expand(mask.shape[0], -1).reshape(-1)[idx_q]
        start = torch.ones_like(p, dtype=torch.bool)
        # next to each other: transformers' rule (pos != previous + 1), so an all-ones mask
        # splits as no mask does; across padding inside a row: where the position drops or stays
        beside = idx_q[1:] == idx_q[:-1] + 1
        start[1:] = torch.where(beside, p[1:] != p[:-1] + 1, p[1:] <= p[:-1])
        start[cu_q[:-1][n_q > 0].long()] = True  # every row's first real token
        cu_q = cu_k = torch.cat([start.nonzero().flatten(), cu_q[-1:].long()]).to(torch.int32)
        n_q = n_k = cu_q[1:] - cu_q[:-1]
    max_q, max_k, most_runs = (
        int(x) for x in torch.stack([n_q.max(), n_k.max(), runs.max()]).tolist()
    ) if n_q.numel() else (0, 0, 0)  # fmt: skip
    return (idx_q, idx_k, cu_q, cu_k, max_q, max_k), most_runs > 1


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor | None:
    """``AttentionMaskInterface`` entry: the 2-D bool padding mask, or None when nothing is padded.

    The causal / sliding-window / packed structure is applied by the attention function, so no
    dense 4-D mask is ever built. Packed rows (transformers found several samples in a row from
    ``position_ids``) give their int32 segment numbers ``(B, S)`` instead of None, for layers that
    do not pass ``position_ids`` on to the attention function (Persimmon, GPTBigCode). Inside a
    torch.compile trace the mask function's closures cannot be read: when transformers says rows
    may be packed (``allow_is_causal_skip=False`` without a mask), the segments are read off the
    mask function by evaluating it (:func:`_probed_segments`).
    Anything else raises: models whose modeling module does not call transformers'
    ``AttentionInterface`` (Bloom, CodeGen and others: they would get no causal
    mask), custom overlays
    (``or_mask_function``/``and_mask_function``, flagged ``use_vmap``), mask functions built
    from parts other than transformers' causal, bidirectional, sliding-window and packed-sequence
    ones (chunked attention, image-token blocks), and keys past the queries (a static cache's
    unwritten slots: ``kv_offset + kv_length > q_offset + q_length``).
    """
    if kwargs.get("use_vmap"):
        raise ValueError(
            "rlhf_kernels attention cannot apply custom mask overlays "
            "(or_mask_function/and_mask_function); use another attn_implementation"
        )
    # dynamo cannot read nested functions' names: a compiled forward skips these checks (an
    # eager forward of the same model makes them)
    compiling = torch.compiler.is_compiling()
    config = kwargs.get("config")
    if not compiling and config is not None and not uses_attention_interface(type(config)):
        raise ValueError(
            f"{type(config).__name__}: this model computes attention in its own layers (its "
            f"modeling module never calls transformers' AttentionInterface), so it would run "
            f"without a causal or padding mask; use attn_implementation='sdpa' or 'eager'"
        )
    if compiling and getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError(  # what the eager check below finds in its mask parts (Llama 4)
            f"rlhf_kernels attention does not apply chunked attention "
            f"(attention_chunk_size={config.attention_chunk_size}); use attn_implementation='sdpa'"
        )
    parts = [] if compiling else [name for name, _ in _mask_parts(mask_function)]
    unknown = [p for p in parts if p not in _KNOWN_MASK_PARTS]
    if unknown:
        raise ValueError(
            f"rlhf_kernels attention applies causal, bidirectional, sliding-window and packed "
            f"masks only; this model's mask also has {unknown} (e.g. chunked attention or "
            f"image-token blocks): use attn_implementation='sdpa'"
        )
    # transformers' bidirectional masks (encoders, cross-attention: keys need not end at the
    # last query) pass allow_is_bidirectional_skip; its causal ones do not
    causal = "allow_is_bidirectional_skip" not in kwargs
    if causal and kv_offset + kv_length > q_offset + q_length:
        raise ValueError(
            f"rlhf_kernels attention needs the keys to end at the last query, got "
            f"{kv_offset + kv_length} key slots for queries ending at {q_offset + q_length}: a "
            f"static (pre-allocated) KV cache; generate with the default dynamic cache or "
            f"attn_implementation='sdpa'"
        )
    if attention_mask is None:
        if not compiling:
            return _packed_segments(mask_function)
        # transformers turns the causal skip off when rows may be packed
        maybe_packed = causal and kwargs.get("allow_is_causal_skip") is False
        if not maybe_packed or q_length != kv_length or mask_function is None:
            return None
        return _probed_segments(mask_function, batch_size, q_length, q_offset, kwargs.get("device"))
    mask = attention_mask[:, -kv_length:].bool()
    if torch.compiler.is_compiling():  # no data-dependent shortcut while tracing
        if causal and mask_function is not None:
            _check_no_lookahead(mask_function, batch_size, q_length, q_offset, mask.device)
        return mask
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask


# the parts of transformers' mask functions (``masking_utils``) the attention function applies
# itself: causal / bidirectional, sliding windows (its ``sliding_window`` argument), the
# packed-sequence wrapper (from the same position_ids it reads), padding and index offsets
_KNOWN_MASK_PARTS = {
    f"transformers.masking_utils.{name}"
    for name in (
        "causal_mask_function",
        "bidirectional_mask_function",
        "and_masks.<locals>.and_mask",
        "sliding_window_overlay.<locals>.inner_mask",
        "sliding_window_bidirectional_overlay.<locals>.inner_mask",
        "packed_sequence_mask_function.<locals>.inner_mask",
        "remap_positions_for_packed_sequence.<locals>.inner_mask",
        "padding_mask_function.<locals>.inner_mask",
        "add_offsets_to_mask_function.<locals>.inner_mask",
    )
}


_PACKED_PART = "transformers.masking_utils.packed_sequence_mask_function.<locals>.inner_mask"


def _probed_segments(mask_function, batch: int, length: int, offset, device) -> torch.Tensor:
    """int32 ``(B, S)`` segment numbers read off a causal ``mask_function`` by evaluation (a
    torch.compile trace cannot look into its closures): a segment starts at token ``i`` where
    the mask hides key ``i - 1`` from query ``i``. Exact for packed samples and sliding windows
    (a 1-token window attends to the token itself either way). A mask that shows a query the
    next key is not causal (an overlay such as image-token blocks): a run-time error."""
    b, i = _check_no_lookahead(mask_function, batch, length, offset, device)
    seen = mask_function(b, torch.zeros_like(b), i, i - 1).expand(batch, length - 1)
    starts = torch.cat([torch.zeros_like(b, dtype=torch.int32), (~seen).to(torch.int32)], 1)
    return starts.cumsum(1, dtype=torch.int32)


def _check_no_lookahead(mask_function, batch: int, length: int, offset, device):
    """Run-time error (traceable) if the causal ``mask_function`` shows query ``i - 1`` key
    ``i``: an overlay such as image-token blocks, which the attention cannot apply. Returns the
    probe's ``(batch (B, 1), query (1, S - 1))`` indices."""
    i = torch.arange(1, length, device=device)[None, :] + offset
    b = torch.arange(batch, device=device)[:, None]
    ahead = mask_function(b, torch.zeros_like(b), i - 1, i)
    torch._assert_async(
        ~torch.as_tensor(ahead).any(),
        "rlhf_kernels attention: this causal mask shows queries later keys (an overlay such as "
        "image-token blocks), which it cannot apply; use attn_implementation='sdpa'",
    )
    return b, i


def _packed_segments(mask_function) -> torch.Tensor | None:
    """The int32 ``(B, S)`` segment numbers of the packed-sequence part of ``mask_function``
    (None without one)."""
    for name, f in _mask_parts(mask_function):
        if name == _PACKED_PART:
            cells = dict(zip(f.__code__.co_freevars, f.__closure__ or ()))
            return cells["packed_sequence_mask"].cell_contents.to(torch.int32)
    return None


@functools.cache
def uses_attention_interface(config_cls: type) -> bool:
    """Whether the modeling module beside ``config_cls``'s module (``configuration_x`` ->
    ``modeling_x``) imports transformers' ``ALL_ATTENTION_FUNCTIONS``; True when there is no
    such module to look at (custom code)."""
    module = config_cls.__module__
    if ".configuration_" not in module:
        return True
    try:
        modeling = importlib.import_module(module.replace(".configuration_", ".modeling_"))
    except Exception:  # no such module, or one that fails to import here: do not judge
        return True
    return hasattr(modeling, "ALL_ATTENTION_FUNCTIONS")


def _mask_parts(fn) -> list[tuple[str, Any]]:
    """``(module.qualname, function)`` of every function ``fn`` is built from (through the
    closures of transformers' known combinators); [] for None."""
    found, todo, seen = [], [fn], set()
    while todo:
        f = todo.pop()
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        if isinstance(f, (tuple, list)):
            todo.extend(f)
            continue
        if not callable(f):
            continue
        name = getattr(f, "__module__", "") + "." + getattr(f, "__qualname__", "?")
        found.append((name, f))
        if name not in _KNOWN_MASK_PARTS:  # not looked into
            continue
        for cell in getattr(f, "__closure__", None) or ():
            todo.append(cell.cell_contents)
    return found


TESTED_TRANSFORMERS = "5.23"  # the pyproject floor


def _transformers_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        return "none installed"


def register(name: str = ATTN_NAME, backend: str = "auto") -> str:
    """Register the attention function and its mask function with transformers under ``name``.

    Args:
        name: the ``attn_implementation`` string to register.
        backend: ``varlen_attention`` backend (``"auto"``, ``"torch"``, ``"triton"``,
            ``"flash_attn"``).
    Returns: ``name``, for ``from_pretrained(..., attn_implementation=register())``.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(
            f"rlhf_kernels.integrations.hf needs transformers >= {TESTED_TRANSFORMERS} "
            f"(AttentionMaskInterface), got {_transformers_version()}: pip install "
            f"'rlhf-kernels[hf]'"
        ) from e

    from packaging.version import Version

    if Version(_transformers_version()) < Version(TESTED_TRANSFORMERS):  # older mask kwargs
        warnings.warn(
            f"rlhf_kernels attention is tested with transformers >= {TESTED_TRANSFORMERS}, got "
            f"{_transformers_version()}: bidirectional (encoder) masks may be taken for causal",
            stacklevel=2,
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(name, str) or not name or name in _BUILTIN_IMPLEMENTATIONS:
        raise ValueError(f"name must be a new attn_implementation string, got {name!r}")
    if backend == "auto":
        fn = rlhf_attention_forward
    else:

        def fn(*args, **kwargs):
            return rlhf_attention_forward(*args, backend=backend, **kwargs)

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, padding_mask)
    return name


def register_ring(name: str = RING_ATTN_NAME, backend: str = "auto") -> str:
    """Register a ring-only attention implementation under ``name``: it runs ring attention
    inside ``ring_context`` and raises outside it.

    A model sharded by a ``RingPlan`` but run without ``ring_context`` would attend within the
    local shard only and give a plausible, wrong loss; a model loaded with this name cannot.
    Arguments and return value as :func:`register`.
    """
    if not isinstance(name, str) or not name or name in _BUILTIN_IMPLEMENTATIONS:
        raise ValueError(f"name must be a new attn_implementation string, got {name!r}")

    def ring_only(module, query, *args, **kwargs):
        if not _RING_OPEN[0] or _ring_state() is None:
            raise RuntimeError(
                f"attn_implementation={name!r} runs only inside `with ring_context(plan, "
                f"group):` (this forward has no active ring, so each rank would attend within "
                f"its own shard and the loss would be wrong); wrap the sharded forward in "
                f"ring_context, or load the model with attn_implementation={ATTN_NAME!r} for "
                f"single-device packed attention"
            )
        return rlhf_attention_forward(module, query, *args, backend=backend, **kwargs)

    register(name, backend)  # validates backend, registers the mask function
    from transformers import AttentionInterface

    AttentionInterface.register(name, ring_only)
    return name


# ----------------------------------------------------------------------------- collator
def packed_model_inputs(
    samples: Sequence[torch.Tensor | Sequence[int]],
    labels: Sequence[torch.Tensor | Sequence[int]] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Tokenized samples -> kwargs for a transformers causal LM on the packed path.

    Args:
        samples: ``n`` 1-D token-id sequences.
        labels: optional per-sample labels (same lengths, transformers' unshifted convention,
            ``-100`` = not a target). Default: the tokens themselves.
        device: where to put the tensors (default: the samples' device).

    Returns:
        ``input_ids`` / ``position_ids`` ``(1, T)`` int64, ``cu_seq_lens_q`` = ``cu_seq_lens_k``
        ``(n + 1,)`` int32, ``max_length_q`` = ``max_length_k`` (int), and ``labels`` ``(1, T)``
        with ``-100`` at each sample's first token, so the model's internal shift never makes a
        sample's last token predict the next sample's first token.
    """
    packed = pack_sequences([torch.as_tensor(s, device=device) for s in samples])
    lab = packed.causal_lm_labels()
    if labels is not None:
        lab = packed.pack(
            [torch.as_tensor(x, device=packed.input_ids.device).long() for x in labels]
        )
        lab[packed.cu_seqlens[:-1].long()] = IGNORE_INDEX
    return {
        "input_ids": packed.input_ids.long().unsqueeze(0),
        "position_ids": packed.position_ids.unsqueeze(0),
        "cu_seq_lens_q": packed.cu_seqlens,
        "cu_seq_lens_k": packed.cu_seqlens,
        "max_length_q": packed.max_seqlen,
        "max_length_k": packed.max_seqlen,
        "labels": lab.unsqueeze(0),
    }


class PackedCollator:
    """``DataCollator``-style: a list of ``{"input_ids": ..., ["labels": ...]}`` -> packed kwargs.

    Every feature must have the same keys; see :func:`packed_model_inputs` for the output.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = device

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, Any]:
        if not features:
            raise ValueError("features must hold at least one sample, got an empty list")
        has_labels = ["labels" in f for f in features]
        if any(has_labels) and not all(has_labels):
            raise ValueError("either every feature or none must have 'labels'")
        labels = [f["labels"] for f in features] if all(has_labels) else None
        return packed_model_inputs([f["input_ids"] for f in features], labels, self.device)
