"""``torch.compile`` support: packed attention, fused log-probs and data-dependent helpers as
custom ops.

Under ``torch.compile`` (``torch.compiler.is_compiling()``), :func:`varlen_attention`, the
transformers integration, ``linear_logprobs`` (and the losses built on it), ``policy_loss`` /
``value_loss`` with ``cu_seqlens`` and ``gae`` / ``discounted_returns`` with ``cu_seqlens`` route
their data-dependent parts through the ``torch.library`` custom ops below. Each has a fake
implementation (shapes only), so dynamo traces a model with our attention without a graph break,
forward and backward (as flash-attn registers its own ops). What dynamo cannot trace (reading
``cu_seqlens`` on the host to validate it, finding sample starts in ``position_ids``, the
nonzero of a padding mask) happens inside the ops at run time, exactly as in eager mode:
bad input still raises, before any work.

- ``rlhf_kernels::varlen_attention_fwd`` -> ``(out, lse)``; lse is ``(heads, total_q)`` fp32
  (float64 for float64 inputs) for
  the Triton backend (the backward reuses it) or when the caller asks for it (``with_lse``),
  else empty.
- ``rlhf_kernels::varlen_attention_bwd`` -> ``(dq, dk, dv)``: the Triton backward kernels from the
  saved ``out``/``lse`` (and the lse's gradient), or for the other backends a recomputed forward
  under autograd (through the lse too when it was returned).
- ``rlhf_kernels::segments_from_position_ids`` -> int32 ``cu_seqlens`` of position ids (or, with
  ``step=0``, of segment numbers; data-dependent length).
- ``rlhf_kernels::padded_layout`` -> the real tokens' indices and ``cu_seqlens`` of a padding
  mask (data-dependent lengths).
- ``rlhf_kernels::linear_logprobs_fwd`` / ``_bwd`` -> the fused lm_head + log-prob blocks
  (``(logp, entropy, row stats, aux)`` / ``(dhidden, dweight, dbias)``; ``aux`` is the fused
  cross-entropy's ``(lse, u_y, sum_v a_v u_v)``, with its gradient in the same backward).
- ``rlhf_kernels::linear_loss_fwd`` -> ``linear_nll_loss``'s (label smoothing included) or
  ``linear_policy_loss``'s loss with its gradients made in the forward (3 matmuls, rows that do
  not count skipped at run time), as in eager mode.
- ``rlhf_kernels::checked_mask`` -> a mask after its 0/1 check (run time).
- ``rlhf_kernels::safe_labels`` -> labels clamped for gathering, after the range check.
- ``rlhf_kernels::segment_ids`` -> the sequence index of every packed token (validates
  ``cu_seqlens``); the sequence aggregations and GAE's segment ends are built from it.

Attention dropout is not routed here (it falls back to eager, with a graph break).
"""

from __future__ import annotations

import torch

from rlhf_kernels._checks import device_guard

Tensor = torch.Tensor


def _max_len(cu: Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


@torch.library.custom_op("rlhf_kernels::varlen_attention_fwd", mutates_args=())
def varlen_attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int | None,
    max_k: int | None,
    scale: float,
    causal: bool,
    left: int,
    right: int,
    softcap: float,
    backend: str,
    deterministic: bool,
    with_lse: bool = False,
) -> tuple[Tensor, Tensor]:
    from rlhf_kernels.ops.varlen_attention import varlen_attention

    res = varlen_attention(
        q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=causal,
        window_size=(left, right), softcap=softcap, return_lse=_has_lse(backend, with_lse),
        backend=backend, deterministic=deterministic,
    )  # fmt: skip
    if _has_lse(backend, with_lse):
        return res[0].clone(), res[1].clone()  # outputs must not alias (eager) internals
    return res.clone(), q.new_empty(0, dtype=torch.float32)


def _has_lse(backend: str, with_lse: bool) -> bool:
    return backend == "triton" or with_lse


@varlen_attention_fwd.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, left, right, softcap, backend, det,
      with_lse=False):  # fmt: skip
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    if _has_lse(backend, with_lse):
        f64 = q.dtype == torch.float64  # (the torch backend's lse is float64 then)
        return out, q.new_empty(
            q.shape[1], q.shape[0], dtype=torch.float64 if f64 else torch.float32
        )
    return out, q.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("rlhf_kernels::varlen_attention_bwd", mutates_args=())
def varlen_attention_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    scale: float,
    causal: bool,
    left: int,
    right: int,
    softcap: float,
    backend: str,
    deterministic: bool,
    dlse: Tensor | None = None,
    max_k: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    from rlhf_kernels.ops.varlen_attention import unbounded_window, varlen_attention

    # the forward's window: judged against its max_seqlen_k (None: the longest key sequence)
    left, right = unbounded_window((left, right), _max_len(cu_k) if max_k is None else max_k)
    if backend == "triton":
        from rlhf_kernels.ops.varlen_attention_triton import varlen_attention_triton_backward

        cu_q32, cu_k32 = cu_q.to(torch.int32).contiguous(), cu_k.to(torch.int32).contiguous()
        with device_guard(q):
            return varlen_attention_triton_backward(
                dout, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, cu_q32, cu_k32,
                _max_len(cu_q32), _max_len(cu_k32), scale, causal, (left, right),
                softcap, dlse=dlse,
            )  # fmt: skip

    def fwd(q, k, v):
        return varlen_attention(
            q, k, v, cu_q, cu_k, None, max_k, softmax_scale=scale,
            causal=causal, window_size=(left, right),
            softcap=softcap, return_lse=dlse is not None, backend=backend,
            deterministic=deterministic,
        )  # fmt: skip

    # recompute this backend's forward and differentiate it (torch.func: the op body runs
    # below the autograd dispatch key, where plain autograd would record nothing)
    _, vjp = torch.func.vjp(fwd, q, k, v)
    grads = vjp(dout) if dlse is None else vjp((dout, dlse))
    return tuple(g.contiguous() for g in grads)


@varlen_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_q, cu_k, scale, causal, left, right, softcap, backend, det,
      dlse=None, max_k=None):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, _, max_k, *params = inputs  # scale, causal, ..., deterministic, with_lse
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_q, cu_k)
    ctx.params, ctx.max_k = tuple(params[:-1]), max_k


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    # the lse is differentiable wherever it was returned (triton always, others on request)
    dlse = dlse.contiguous() if dlse is not None and lse.numel() else None
    dq, dk, dv = varlen_attention_bwd(
        dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, *ctx.params, dlse=dlse, max_k=ctx.max_k
    )
    return dq, dk, dv, *(None,) * 12


torch.library.register_autograd(
    "rlhf_kernels::varlen_attention_fwd", _backward, setup_context=_setup
)


@torch.library.custom_op("rlhf_kernels::segments_from_position_ids", mutates_args=())
def segments_from_position_ids(position_ids: Tensor, step: int = 1, refresh: bool = True) -> Tensor:
    from rlhf_kernels.integrations.hf import _segments_from_position_ids

    # refresh (a model's first attention layer; the op alone cannot tell): the eager cache
    # misses writes without a version bump (``dist.broadcast`` into a reused buffer)
    return _segments_from_position_ids(position_ids, refresh=refresh, step=step)[0].clone()


@segments_from_position_ids.register_fake
def _(position_ids, step=1, refresh=True):
    n = torch.library.get_ctx().new_dynamic_size(min=2)  # samples + 1: data-dependent
    return position_ids.new_empty(n, dtype=torch.int32)


@torch.library.custom_op("rlhf_kernels::padded_layout", mutates_args=())
def padded_layout(
    mask: Tensor, s_q: int, s_k: int, windowed: bool, all_queries: bool, pos: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    from rlhf_kernels.integrations.hf import _holes_error, _padded_layout_uncached

    (idx_q, idx_k, cu_q, cu_k, _, _), holes = _padded_layout_uncached(
        mask, s_q, s_k, all_queries, pos
    )
    if pos is not None:
        cu_k = cu_k.clone()  # outputs of an op may not alias each other
    if windowed and holes:
        raise _holes_error()
    return idx_q, idx_k, cu_q, cu_k


@padded_layout.register_fake
def _(mask, s_q, s_k, windowed, all_queries, pos=None):
    ctx = torch.library.get_ctx()
    n_q, n_k = ctx.new_dynamic_size(), ctx.new_dynamic_size()  # real tokens: data-dependent
    # samples: one per row, or (with pos) data-dependent
    n_cu = mask.shape[0] + 1 if pos is None else ctx.new_dynamic_size()
    i64, i32 = dict(dtype=torch.int64), dict(dtype=torch.int32)
    return (
        mask.new_empty(n_q, **i64),
        mask.new_empty(n_k, **i64),
        mask.new_empty(n_cu, **i32),
        mask.new_empty(n_cu, **i32),
    )


def compiled_varlen_attention(
    q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window_size, softcap, return_lse, backend,
    deterministic=False,
):  # fmt: skip
    """The traced path of ``varlen_attention`` (backend already resolved, no dropout)."""
    if return_lse and backend == "flash_attn":  # its lse has no gradient: not traced
        raise ValueError(
            "return_lse under torch.compile needs backend='triton' or 'torch', got "
            "backend='flash_attn'"
        )
    from rlhf_kernels.ops.varlen_attention import as_max_seqlen

    max_q, max_k = as_max_seqlen("max_seqlen_q", max_q), as_max_seqlen("max_seqlen_k", max_k)
    out, lse = varlen_attention_fwd(
        q, k, v, cu_q, cu_k, max_q, max_k, float(scale), bool(causal), int(window_size[0]),
        int(window_size[1]), float(softcap), backend, bool(deterministic), bool(return_lse),
    )  # fmt: skip
    return (out, lse) if return_lse else out


# ----------------------------------------------------------------------------- RL math
@torch.library.custom_op("rlhf_kernels::linear_logprobs_fwd", mutates_args=())
def linear_logprobs_fwd(
    h: Tensor,
    w: Tensor,
    b: Tensor | None,
    safe: Tensor,
    temperature: float,
    want_entropy: bool,
    tc: int,
    vc: int,
    softcap: float | None,
    want_aux: bool = False,
    a: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(logp, entropy or empty, stats, aux or empty)`` for the gatherable labels ``safe``
    (range-checked by ``safe_labels`` before); ``stats`` ``(2, T)`` fp32 is each row's max and
    ``log s``; ``aux`` (``want_aux``) ``(3, T)`` fp32 ``(lse, u_y, sum_v a_v u_v)``, ``a`` fp32
    ``(V,)`` constant column weights or None (ones)."""
    from rlhf_kernels.ops import linear_logprobs as mod

    inv_tau = 1.0 / temperature
    aux = h.new_empty((3, h.shape[0]) if want_aux else (0,), dtype=torch.float32)
    with device_guard(h):
        logp, ent, stats = mod._forward(
            h, w, mod._scaled_bias(b, softcap), safe, inv_tau, tc, vc, want_entropy,
            softcap, aux if want_aux else None, a,
        )  # fmt: skip
    return logp, (ent if want_entropy else logp.new_empty(0)), stats, aux


@linear_logprobs_fwd.register_fake
def _(h, w, b, safe, temperature, want_entropy, tc, vc, softcap, want_aux=False, a=None):
    t = h.new_empty(h.shape[0], dtype=torch.float32)
    ent = torch.empty_like(t) if want_entropy else t.new_empty(0)
    return t, ent, t.new_empty(2, t.shape[0]), t.new_empty((3, t.shape[0]) if want_aux else (0,))


@torch.library.custom_op("rlhf_kernels::linear_logprobs_bwd", mutates_args=())
def linear_logprobs_bwd(
    h: Tensor,
    w: Tensor,
    b: Tensor | None,
    safe: Tensor,
    temperature: float,
    tc: int,
    vc: int,
    stats: Tensor,
    ent: Tensor,
    g_lp: Tensor,
    g_ent: Tensor | None,
    needs: list[bool],
    softcap: float | None,
    g_aux: Tensor | None = None,
    a: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dhidden, dweight, dbias)``; an input whose ``needs`` entry is False gets an empty."""
    from rlhf_kernels.ops import linear_logprobs as mod

    inv_tau = 1.0 / temperature
    with device_guard(h):
        dh, dw, db = mod._backward(
            h, w, mod._scaled_bias(b, softcap), safe, inv_tau, tc, vc, stats, ent,
            g_lp.float(), None if g_ent is None else g_ent.float(), tuple(needs), softcap,
            None if g_aux is None else g_aux.float(), a,
        )  # fmt: skip
    dh, dw, db = mod._cast_grads(dh, dw, db, h, b)
    # one empty per output: outputs of an op may not alias each other
    return tuple(h.new_empty(0) if g is None else g for g in (dh, dw, db))


@linear_logprobs_bwd.register_fake
def _(h, w, b, safe, temperature, tc, vc, stats, ent, g_lp, g_ent, needs, softcap, g_aux=None,
      a=None):  # fmt: skip
    like = (h, w, b if b is not None else h.new_empty(0))
    return tuple(torch.empty_like(t) if n else h.new_empty(0) for t, n in zip(like, needs))


def _llp_setup(ctx, inputs, output):
    h, w, b, safe, temperature, _, tc, vc, softcap, want_aux, a = inputs
    ctx.save_for_backward(h, w, b, safe, output[2], output[1], a)
    ctx.cfg = (temperature, tc, vc, b is not None, softcap, len(inputs))


def _llp_backward(ctx, g_lp, g_ent, g_stats, g_aux):
    del g_stats  # the row stats are not an output of linear_logprobs
    h, w, b, safe, stats, ent, a = ctx.saved_tensors
    temperature, tc, vc, has_b, softcap, n_inputs = ctx.cfg
    ng = ctx.needs_input_grad
    needs = [bool(ng[0]), bool(ng[1]), bool(has_b and ng[2])]
    g_lp = torch.zeros_like(stats[0]) if g_lp is None else g_lp
    g_ent = g_ent if (g_ent is not None and ent.numel()) else None
    g_aux = g_aux if (g_aux is not None and g_aux.numel()) else None
    dh, dw, db = linear_logprobs_bwd(
        h, w, b, safe, temperature, tc, vc, stats, ent, g_lp, g_ent, needs, softcap, g_aux, a
    )
    grads = [g if n else None for g, n in zip((dh, dw, db), needs)]
    return (*grads, *(None,) * (n_inputs - 3))


torch.library.register_autograd(
    "rlhf_kernels::linear_logprobs_fwd", _llp_backward, setup_context=_llp_setup
)


@torch.library.custom_op("rlhf_kernels::segment_ids", mutates_args=())
def segment_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """``_checks.sequence_ids`` as an op: ``cu_seqlens`` is validated here, at run time."""
    from rlhf_kernels._checks import sequence_ids

    return sequence_ids(cu_seqlens, total)


@segment_ids.register_fake
def _(cu_seqlens, total):
    return cu_seqlens.new_empty(total, dtype=torch.int64)


@torch.library.custom_op("rlhf_kernels::checked_mask", mutates_args=())
def checked_mask(mask: Tensor, name: str) -> Tensor:
    """``_checks.check_mask`` at run time (0/1 values); a copy of ``mask`` (outputs of an op may
    not alias its inputs)."""
    from rlhf_kernels._checks import check_mask

    check_mask(mask, name)
    return mask.clone()


@checked_mask.register_fake
def _(mask, name):
    return torch.empty_like(mask)


@torch.library.custom_op("rlhf_kernels::linear_loss_fwd", mutates_args=())
def linear_loss_fwd(
    h: Tensor,
    w: Tensor,
    b: Tensor | None,
    safe: Tensor,
    wt: Tensor,
    ref: Tensor | None,
    adv: Tensor | None,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
    temperature: float,
    softcap: float | None,
    needs: list[bool],
    smooth: float = 0.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A scalar loss over the rows and its gradients ``(dhidden, dweight, dbias)`` made in the
    forward (one pass, 3 matmuls; rows with ``wt == 0`` skip the matmuls): ``-sum(wt * logp)``
    (plus ``smooth * sum(wt * (u_y - mean_v u_v))``, label smoothing), or with ``ref`` /
    ``adv`` (old log-probs, advantages) the PPO loss ``sum(wt * ppo_token)`` clipped by
    ``clip_low`` / ``clip_high`` / ``dual_clip``. An input whose ``needs`` entry is False gets
    an empty gradient."""
    from rlhf_kernels.ops import linear_logprobs as mod

    ppo = None if ref is None else (ref, adv, clip_low, clip_high, dual_clip)
    with device_guard(h):
        loss, dh, dw, db = mod._loss_with_grads(
            h, w, b, safe, wt, temperature, softcap, needs, ppo, smooth
        )
    return loss, *(h.new_empty(0) if g is None else g for g in (dh, dw, db))


@linear_loss_fwd.register_fake
def _(h, w, b, safe, wt, ref, adv, clip_low, clip_high, dual_clip, temperature, softcap, needs,
      smooth=0.0):  # fmt: skip
    dh = h.new_empty(h.shape) if needs[0] else h.new_empty(0)  # contiguous, as the real op's
    dw = torch.empty_like(w) if needs[1] else h.new_empty(0)
    db = torch.empty_like(b) if b is not None and needs[2] else h.new_empty(0)
    return h.new_empty((), dtype=torch.float32), dh, dw, db


def _loss_setup(ctx, inputs, output):
    ctx.needs, ctx.n_inputs = inputs[12], len(inputs)
    ctx.save_for_backward(*output[1:])


def _loss_backward(ctx, g, g_dh, g_dw, g_db):
    dh, dw, db = ctx.saved_tensors
    grads = [d * g.to(d.dtype) if n else None for d, n in zip((dh, dw, db), ctx.needs)]
    return *grads, *(None,) * (ctx.n_inputs - 3)


torch.library.register_autograd(
    "rlhf_kernels::linear_loss_fwd", _loss_backward, setup_context=_loss_setup
)


@torch.library.custom_op("rlhf_kernels::safe_labels", mutates_args=())
def safe_labels(labels: Tensor, vocab: int, ignore_index: int | None, check_cuda: bool) -> Tensor:
    """Flat int64 labels clamped into ``[0, vocab)`` (``ignore_index`` -> 0), after the eager
    range check (run time, so a traced loss still raises on a bad label)."""
    from rlhf_kernels.ops.logprobs import check_label_range

    check_label_range(labels, vocab, ignore_index, check_cuda)
    lab = labels.reshape(-1).long()
    if ignore_index is not None:
        lab = lab.masked_fill(lab == ignore_index, 0)
    return lab.clamp(0, vocab - 1)


@safe_labels.register_fake
def _(labels, vocab, ignore_index, check_cuda):
    return labels.new_empty(labels.numel(), dtype=torch.int64)
