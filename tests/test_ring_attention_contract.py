"""Ring attention contracts the other ring tests leave open (found by mutation testing):
softmax_scale, a plan reused across windows and tiles, the fused/triton switches, the Triton
block helpers (pure torch, no kernel launch) and NaN pad slots on a real ring."""

import functools

import pytest
import torch

from rlhf_kernels.ring import blocks
from rlhf_kernels.ring.attention import ring_varlen_attention
from rlhf_kernels.ring.plan import RingPlan

LENGTHS = [1, 29, 2, 40, 17]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(heads=4, kv_heads=2, dim=8, seed=0, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    shapes = (heads, kv_heads, kv_heads, heads)
    return [torch.randn(sum(lengths), h, dim, generator=g, dtype=torch.float64) for h in shapes]


def _dense(q, k, v, lengths, causal=True, window=(-1, -1), scale=None, softcap=0.0):
    """Independent float64 reference: one dense masked softmax over the whole packed stream."""
    n = torch.tensor(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), n)
    pos = torch.arange(len(doc)) - torch.repeat_interleave(n.cumsum(0) - n, n)
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i, j = pos[:, None], pos[None, :]
    ok = doc[:, None] == doc[None, :]
    right = 0 if causal else window[1]
    if right >= 0:
        ok &= j <= i + right
    if window[0] >= 0:
        ok &= j >= i - window[0]
    s = s.masked_fill(~ok, float("-inf"))
    return torch.einsum("hij,jhd->ihd", s.softmax(-1), v), s.logsumexp(-1)


def _dense_fn(lengths, **kw):
    return lambda q, k, v: _dense(q, k, v, lengths, **kw)[0]


def _grads(fn, q, k, v, do):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(do.to(out.dtype))
    return [out.detach()] + [t.grad for t in leaves]


def _ring_one(plan, dtype, **kw):
    """Ring of one on full-stream tensors (shard/unshard around the call)."""

    def fn(q, k, v):
        qs, ks, vs = (plan.shard(t, 0).to(dtype) for t in (q, k, v))
        return plan.unshard([ring_varlen_attention(qs, ks, vs, plan, **kw)])

    return fn


@pytest.mark.parametrize(
    "dtype,fused,softcap,window",
    [(torch.float64, False, 1.5, (5, 0)), (torch.float32, True, 0.0, (-1, -1))],
)
def test_softmax_scale_is_used(dtype, fused, softcap, window):
    # every other ring test runs the default 1/sqrt(d): an ignored scale passed them all
    q, k, v, do = _inputs()
    plan = RingPlan.build(_cu(LENGTHS), 1)
    kw = dict(softmax_scale=0.77, softcap=softcap, window_size=window)
    ref = _grads(_dense_fn(LENGTHS, scale=0.77, softcap=softcap, window=window), q, k, v, do)
    got = _grads(_ring_one(plan, dtype, fused=fused, tile=8, **kw), q, k, v, do)
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
        torch.testing.assert_close(a.double(), r, rtol=tol, atol=tol, msg=name)


def test_float64_inputs_get_a_float64_lse_and_its_gradient():
    """As varlen_attention: the lse of float64 inputs is float64 (it was cast to fp32, 1e-7
    off the float64 ground truth), and a loss on it differentiates to the dense reference's."""
    q, k, v, _ = _inputs(seed=2)
    plan = RingPlan.build(_cu(LENGTHS), 1, "zigzag")
    dl = torch.randn(q.shape[1], q.shape[0], dtype=torch.float64)

    def lse_of(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        lse = fn(*leaves)
        (lse * dl).sum().backward()  # the lse does not depend on v: dv is 0 (or None)
        return [lse.detach()] + [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]

    def ring(q, k, v):
        qs, ks, vs = (plan.shard(t, 0) for t in (q, k, v))
        _, lse = ring_varlen_attention(qs, ks, vs, plan, return_lse=True, tile=8)
        assert lse.dtype == torch.float64
        return plan.unshard([lse.T]).T

    ref = lse_of(lambda q, k, v: _dense(q, k, v, LENGTHS)[1])
    for name, a, r in zip(("lse", "dq", "dk", "dv"), lse_of(ring), ref):
        torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12, msg=name)


def test_one_plan_reused_across_windows_causal_and_tiles():
    # tiles are cached on the plan (one plan serves every layer): the cache key must hold every
    # option the tiles depend on, or a later call silently reuses another window's tiles
    q, k, v, do = _inputs(seed=1)
    plan = RingPlan.build(_cu(LENGTHS), 1, "zigzag")
    calls = [
        (True, (-1, -1), 8),
        (True, (4, 0), 8),
        (True, (9, 0), 8),
        (False, (3, 2), 8),
        (False, (3, 5), 8),
        (True, (4, 0), 3),
        (False, (-1, -1), 64),
    ]
    for causal, window, tile in calls:
        ref = _grads(_dense_fn(LENGTHS, causal=causal, window=window), q, k, v, do)
        fn = _ring_one(plan, torch.float64, causal=causal, window_size=window, tile=tile)
        for name, a, r in zip(("out", "dq", "dk", "dv"), _grads(fn, q, k, v, do), ref):
            torch.testing.assert_close(
                a, r, rtol=1e-10, atol=1e-10, msg=f"{name} {causal} {window} {tile}"
            )
        # the tile bounds memory (heads * tile^2): a smaller one is not served larger tiles
        tiles = blocks.tile_pairs(plan, 0, 0, causal, window, tile)
        assert max(max(ta, tb) for _, ta, _, tb, _ in tiles) <= tile


def test_fused_switch_picks_the_tile_kernel(monkeypatch):
    """fused=False (or softcap) keeps the explicit math; fused=True uses the CPU flash kernel
    for all-visible and diagonal tiles, forward and backward (also when the lse is unused)."""
    if blocks.flash_cpu is None or blocks.flash_cpu_backward is None:
        pytest.skip("no fused CPU flash kernel in this torch")
    calls = {"fwd": 0, "bwd": 0}

    def counted(name, fn):
        def wrap(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)

        return wrap

    monkeypatch.setattr(blocks, "flash_cpu", counted("fwd", blocks.flash_cpu))
    monkeypatch.setattr(blocks, "flash_cpu_backward", counted("bwd", blocks.flash_cpu_backward))
    q, k, v, do = _inputs()
    plan = RingPlan.build(_cu(LENGTHS), 1)
    for kw, used in ((dict(fused=False), False), (dict(softcap=2.0), False), ({}, True)):
        calls.update(fwd=0, bwd=0)
        _grads(_ring_one(plan, torch.float32, tile=16, **kw), q, k, v, do)
        assert (calls["fwd"] > 0, calls["bwd"] > 0) == (used, used), (kw, calls)


@pytest.mark.parametrize("which", ["q", "k", "v", "do"])
def test_nan_in_one_input_same_pattern_fused_or_not(which):
    # the backward checks its own inputs: the fused kernel drops part of a query row's NaN
    plan = RingPlan.build(_cu(LENGTHS), 1)
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(plan.local_len, 2, 8, generator=g) for _ in range(4))
    dict(q=q, k=k, v=v, do=do)[which][20, 1, 2] = float("nan")  # inside a 40-token document
    runs = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_varlen_attention(*leaves, plan, fused=fused, tile=16)
        out.backward(do)
        runs.append([out.isnan()] + [t.grad.isnan() for t in leaves])
    assert runs[0][1].any()
    for name, a, b in zip(("out", "dq", "dk", "dv"), *runs):
        assert torch.equal(a, b), name


def test_triton_switch_and_env(monkeypatch):
    x = torch.randn(3, 2, 8, dtype=torch.float64)
    plan = RingPlan.build(_cu([3]), 1)
    monkeypatch.setenv("RLHF_KERNELS_RING_TRITON", "1")  # forces Triton: float64 cannot
    with pytest.raises(ValueError, match=r"triton=True\) needs the triton package"):
        ring_varlen_attention(x, x, x, plan)
    ring_varlen_attention(x, x, x, plan, triton=False)  # an explicit False beats the env
    with pytest.raises(ValueError, match="needs the triton package"):
        ring_varlen_attention(x, x, x, plan, triton=True)
    monkeypatch.setenv("RLHF_KERNELS_RING_TRITON", "0")
    ring_varlen_attention(x, x, x, plan)


def test_merge_rows_matches_sequential_merges():
    """The Triton path's row merge (repeated rows: one query run meets several key runs) equals
    folding each partial result in with logaddexp, one at a time, in float64."""
    g = torch.Generator().manual_seed(3)
    h, n_rows, d = 3, 6, 4
    acc_o = torch.randn(n_rows, h, d, generator=g, dtype=torch.float64)
    acc_lse = torch.randn(h, n_rows, generator=g, dtype=torch.float64)
    acc_lse[:, 0] = float("-inf")  # nothing merged yet
    acc_o[0] = 0.0
    acc_lse[1, 4] = float("-inf")
    acc_o[4, 1] = 0.0
    idx = torch.tensor([0, 2, 2, 5, 0, 2, 4])
    o = torch.randn(len(idx), h, d, generator=g, dtype=torch.float64)
    lse = torch.randn(h, len(idx), generator=g, dtype=torch.float64) * 3
    lse[2, 3] = float("-inf")  # a row that sees no key of this pair
    o[3, 2] = 0.0
    lse[:, idx == 2] += 500.0  # a row met three times: the stabiliser must be a max, not a sum
    want_o, want_lse = acc_o.clone(), acc_lse.clone()
    for n, r in enumerate(idx.tolist()):
        new = torch.logaddexp(want_lse[:, r], lse[:, n])
        safe = torch.where(torch.isinf(new), 0.0, new)
        w_old, w_new = (want_lse[:, r] - safe).exp(), (lse[:, n] - safe).exp()
        want_o[r] = want_o[r] * w_old[:, None] + o[n] * w_new[:, None]
        want_lse[:, r] = new
    got_o, got_lse = acc_o.clone(), acc_lse.clone()
    blocks._merge_rows(got_o, got_lse, idx, o, lse)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_o, want_o, rtol=1e-12, atol=1e-12)
    untouched = [1, 3]
    assert torch.equal(got_o[untouched], acc_o[untouched])


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_segment_pairs_cover_visible_pairs_with_their_offsets(layout):
    """Each "sequence" of a Triton block is (query run, key run) of one document; ``diff`` is the
    key index query 0 sits at, so query ``a`` sees key ``b`` iff the global positions do."""
    world = 3
    plan = RingPlan.build(_cu([37, 1, 50]), world, layout)
    pos, doc = plan.pos, plan.doc
    for left, right in ((-1, 0), (7, 0), (4, 2), (-1, -1)):
        for rank in range(world):
            seen = 0
            for src in range(world):
                pairs = blocks.segment_pairs(plan, rank, src, left, right, "cpu")
                if pairs is None:
                    continue
                idx_q, idx_k, cu_q, cu_k, diff, max_q, max_k = pairs
                assert max_q == int((cu_q[1:] - cu_q[:-1]).max())
                assert max_k == int((cu_k[1:] - cu_k[:-1]).max())
                for s in range(len(diff)):
                    sq = idx_q[cu_q[s] : cu_q[s + 1]]
                    sk = idx_k[cu_k[s] : cu_k[s + 1]]
                    assert (doc[rank, sq] == doc[src, sk[0]]).all()
                    assert (doc[src, sk] == doc[src, sk[0]]).all()
                    a = torch.arange(len(sq))[:, None]
                    b = torch.arange(len(sk))[None, :]
                    # kernel view: key index b vs query index a + diff
                    assert (pos[rank, sq][:, None] - pos[src, sk][None, :]
                            == a + int(diff[s]) - b).all()  # fmt: skip
                    qp, kp = pos[rank, sq][:, None], pos[src, sk][None, :]
                    vis = torch.ones_like(qp - kp, dtype=torch.bool)
                    if right >= 0:
                        vis &= kp <= qp + right
                    if left >= 0:
                        vis &= kp >= qp - left
                    assert vis.any()
                    seen += int(vis.sum())
            assert seen == int(plan.attention_work(right == 0, (left, right))[rank])


def test_token_mean_ignores_non_finite_masked_tokens():
    # pad / ignored tokens may hold NaN or inf (they are outside the mask): a product with the
    # mask made the mean NaN; the losses module masks with a where for the same reason
    from rlhf_kernels.ring.gather import ring_token_mean

    values = torch.tensor([[1.0, float("nan")], [3.0, float("inf")]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    mean = ring_token_mean(values, mask)
    assert mean.item() == 2.0
    mean.backward()
    assert torch.equal(values.grad, mask / 2)
    assert ring_token_mean(values, torch.tensor([1.0, 0.0])).item() == 2.0  # broadcast


# ----------------------------------------------------------------------------- a real ring
MP_LENGTHS = [7, 1, 30, 3, 26]  # pads on two of three ranks (zigzag), one (contiguous)
LAYOUT_COMMS = (("zigzag", "p2p"), ("contiguous", "allgather"))


def _ring_worker(rank, world):
    from rlhf_kernels.ring import attention as ring_attention
    from rlhf_kernels.ring.gather import gather_from_ring

    q, k, v, do = _inputs(seed=4, lengths=MP_LENGTHS)
    kw = dict(softmax_scale=0.6, window_size=(11, 0))
    ref = _grads(_dense_fn(MP_LENGTHS, scale=0.6, window=(11, 0)), q, k, v, do)
    res = {}
    for layout, comm in LAYOUT_COMMS:
        plan = RingPlan.build(_cu(MP_LENGTHS), world, layout)
        pad = ~plan.valid_mask(rank)
        # pad slots may hold anything: NaN there must not leak into real rows or grads
        shards = [plan.shard(t, rank).float().index_fill(0, pad.nonzero()[:, 0], torch.nan)
                  for t in (q, k, v, do)]  # fmt: skip
        leaves = [t.requires_grad_() for t in shards[:3]]
        out = ring_varlen_attention(*leaves, plan, comm=comm, kv_head_stride=1, **kw)
        out.backward(shards[3])
        got = [out, *(t.grad for t in leaves)]
        res[f"{layout}/{comm}/err"] = max(
            (a[~pad].double() - plan.shard(r, rank)[~pad]).abs().max().item()
            for a, r in zip(got, ref)
        )
        res[f"{layout}/{comm}/pads_zero"] = all(bool((a[pad] == 0).all()) for a in got)
    # backends without reduce_scatter (older gloo): all_reduce instead, the same gradients;
    # any other failure is raised, not papered over
    plan = RingPlan.build(_cu(MP_LENGTHS), world)
    real = ring_attention._reduce_scatter_flat
    for name, exc in (("rs_fallback", RuntimeError("gloo does not support reduce_scatter")),
                      ("rs_timeout", RuntimeError("Timed out waiting for peer"))):  # fmt: skip

        def broken(*_, exc=exc, **__):
            raise exc

        ring_attention._reduce_scatter_flat = broken
        try:
            leaves = [plan.shard(t, rank).float().requires_grad_() for t in (q, k, v)]
            out = ring_varlen_attention(*leaves, plan, comm="allgather", kv_head_stride=1, **kw)
            out.backward(plan.shard(do, rank).float())
            got = [out, *(t.grad for t in leaves)]
            res[name] = max(
                (a.double() - plan.shard(r, rank)).abs().max().item() for a, r in zip(got, ref)
            )
        except RuntimeError as e:
            res[name] = str(e)
        finally:
            ring_attention._reduce_scatter_flat = real
    # dst is a group rank: a bool is refused, as plan.check_rank refuses it
    try:
        gather_from_ring(plan.shard(q, rank), plan, dst=True)
        res["dst_bool"] = None
    except ValueError as e:
        res["dst_bool"] = str(e)
    return res


@functools.cache
def _ring_results():
    from rlhf_kernels.ring.spawn import run_gloo

    return run_gloo(_ring_worker, 3, timeout_s=120)


@pytest.mark.multiproc
def test_ring_nan_pads_scale_and_reduce_scatter_fallback():
    for rank, res in enumerate(_ring_results()):
        for layout, comm in LAYOUT_COMMS:
            assert res[f"{layout}/{comm}/err"] < 2e-5, (rank, layout, comm, res)
            assert res[f"{layout}/{comm}/pads_zero"], (rank, layout, comm)
        assert isinstance(res["rs_fallback"], float) and res["rs_fallback"] < 2e-5, res
        assert "Timed out" in str(res["rs_timeout"]), res


@pytest.mark.multiproc
def test_gather_refuses_a_bool_dst():
    for res in _ring_results():
        assert res["dst_bool"] and "dst must be a group rank" in res["dst_bool"], res
