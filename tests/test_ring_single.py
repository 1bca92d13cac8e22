"""Ring attention pieces that need no process group: world size 1, the tile schedule, checks."""

import pytest
import torch

from rlhf_kernels.ops.varlen_attention import varlen_attention_reference
from rlhf_kernels.ring.attention import ring_varlen_attention
from rlhf_kernels.ring.blocks import tile_pairs
from rlhf_kernels.ring.gather import gather_from_ring, ring_token_mean
from rlhf_kernels.ring.plan import RingPlan

LENGTHS = [1, 47, 2, 31, 67]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _inputs(heads, kv_heads, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(LENGTHS)
    return [
        torch.randn(total, h, dim, generator=g, dtype=torch.float64)
        for h in (heads, kv_heads, kv_heads, heads)
    ]


def _run_ring(plan, q, k, v, do, dtype, **kw):
    q, k, v = (plan.shard(t, 0).to(dtype).requires_grad_() for t in (q, k, v))
    out = ring_varlen_attention(q, k, v, plan, **kw)
    out.backward(plan.shard(do, 0).to(dtype))
    return [plan.unshard([t]) for t in (out, q.grad, k.grad, v.grad)]


def _run_reference(q, k, v, do, dtype, causal, window, softcap):
    q, k, v = (t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v))
    cu = _cu(LENGTHS)
    out, _ = varlen_attention_reference(
        q, k, v, cu, cu, causal=causal, window_size=window, softcap=softcap
    )
    out.backward(do.to(dtype))
    return [out, q.grad, k.grad, v.grad]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize(
    "causal,window,softcap,kv_heads,tile",
    [
        (True, (-1, -1), 0.0, 2, 1024),
        (True, (6, 0), 0.0, 1, 5),
        (False, (4, 9), 0.0, 2, 16),
        (True, (-1, -1), 3.0, 4, 13),
    ],
)
def test_world_one_matches_reference(layout, causal, window, softcap, kv_heads, tile):
    q, k, v, do = _inputs(4, kv_heads)
    plan = RingPlan.build(_cu(LENGTHS), 1, layout)
    ref = _run_reference(q, k, v, do, torch.float64, causal, window, softcap)
    got = _run_ring(
        plan,
        q,
        k,
        v,
        do,
        torch.float64,
        causal=causal,
        window_size=window,
        softcap=softcap,
        tile=tile,
    )
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_bf16_error_within_twice_plain_torch():
    q, k, v, do = _inputs(4, 2, dim=32)
    plan = RingPlan.build(_cu(LENGTHS), 1)
    ref = _run_reference(q, k, v, do, torch.float64, True, (-1, -1), 0.0)
    plain = _run_reference(q, k, v, do, torch.bfloat16, True, (-1, -1), 0.0)
    got = _run_ring(plan, q, k, v, do, torch.bfloat16)
    for name, a, p, r in zip(("out", "dq", "dk", "dv"), got, plain, ref):
        assert a.dtype == torch.bfloat16
        err, plain_err = (a.double() - r).abs().max(), (p.double() - r).abs().max()
        assert err <= 2 * plain_err, (name, err.item(), plain_err.item())


def test_fully_masked_blocks_are_skipped():
    plan = RingPlan.build(_cu([64, 32]), 4, "contiguous")  # 24 slots per rank
    # causal: rank 0's queries never see keys that live on later ranks
    for src in (1, 2, 3):
        assert tile_pairs(plan, 0, src, True, (-1, -1), 1024) == []
    assert tile_pairs(plan, 3, 0, True, (-1, -1), 1024) == []  # other document
    assert tile_pairs(plan, 0, 1, False, (-1, -1), 1024) != []
    # tiles cover every visible pair exactly once, with a tile no larger than asked
    for layout in ("zigzag", "contiguous"):
        plan = RingPlan.build(_cu([37, 1, 50]), 3, layout)
        for window in ((-1, -1), (7, 0)):
            work = plan.attention_work(True, window)
            for rank in range(3):
                seen = 0
                for src in range(3):
                    for qs, ta, ks, tb, mask in tile_pairs(plan, rank, src, True, window, 8):
                        assert ta <= 8 and tb <= 8
                        qp = plan.pos[rank][qs : qs + ta].unsqueeze(1)
                        kp = plan.pos[src][ks : ks + tb].unsqueeze(0)
                        vis = kp <= qp
                        if window[0] >= 0:
                            vis &= kp >= qp - window[0]
                        assert vis.any()
                        assert (mask is not None) or vis.all()
                        seen += int(vis.sum())
                assert seen == int(work[rank])


def test_bad_input_without_process_group():
    plan = RingPlan.build(_cu(LENGTHS), 1)
    x = torch.randn(plan.local_len, 2, 8)
    with pytest.raises(ValueError, match="local_len"):
        ring_varlen_attention(x[:-1], x, x, plan)
    with pytest.raises(ValueError, match="comm"):
        ring_varlen_attention(x, x, x, plan, comm="ring")
    with pytest.raises(TypeError, match="RingPlan"):
        ring_varlen_attention(x, x, x, "plan")
    with pytest.raises(TypeError, match="dtype"):
        ring_varlen_attention(x, x.double(), x, plan)
    with pytest.raises(ValueError, match="kv heads"):
        ring_varlen_attention(
            x, torch.randn(plan.local_len, 3, 8), torch.randn(plan.local_len, 3, 8), plan
        )
    with pytest.raises(ValueError, match="world_size=2"):
        ring_varlen_attention(x, x, x, RingPlan.build(_cu([plan.local_len]), 2))
    with pytest.raises(TypeError, match="window_size must be"):  # was taken as (1, 0)
        ring_varlen_attention(x, x, x, plan, window_size=(True, 0))
    # no heads / head_dim 0: output (L, 0, D) or a ZeroDivisionError before
    for shape in ((plan.local_len, 0, 8), (plan.local_len, 2, 0)):
        y, kv = torch.randn(shape), torch.randn(plan.local_len, 1, shape[2])
        with pytest.raises(ValueError, match="at least one head and head_dim >= 1"):
            ring_varlen_attention(y, kv, kv, plan)
    # an int64 overflow on one rank left the others waiting; a huge side is unbounded
    with pytest.raises(ValueError, match="tile and window sides must be below 2"):
        ring_varlen_attention(x, x, x, plan, tile=2**63)
    full = ring_varlen_attention(x, x, x, plan, causal=False)
    huge = ring_varlen_attention(x, x, x, plan, causal=False, window_size=(2**63, 2**70))
    torch.testing.assert_close(huge, full)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(q=torch.randn(4, 16)), ValueError, r"q must be \(local_tokens, heads, head_dim\)"),
        (dict(k=torch.randint(0, 3, (4, 2, 8))), TypeError, "k must be float32/float16/bfloat16"),
        (dict(v=torch.randn(4, 2, 8).double()), TypeError, "q, k, v must share a dtype"),
        (dict(k=torch.randn(4, 2, 4), v=torch.randn(4, 2, 4)), ValueError, r"k, v must be \(L"),
        (dict(v=torch.randn(4, 1, 8)), ValueError, r"k, v must be \(L, kv_heads, 8\)"),
        (dict(k=torch.randn(4, 0, 8), v=torch.randn(4, 0, 8)), ValueError, r"kv heads \(0\)"),
        (dict(window_size=(3, 0, 1)), ValueError, r"window_size must be \(left, right\)"),
        (dict(kv_head_stride=0), ValueError, "kv_head_stride must be a positive int or None"),
        (dict(tile=0), ValueError, "tile must be a positive int, got 0"),
    ],
)
def test_bad_shapes_and_options_without_process_group(over, exc, match):
    plan = RingPlan.build(_cu([4]), 1)
    args = dict(q=torch.randn(4, 2, 8), k=torch.randn(4, 2, 8), v=torch.randn(4, 2, 8), plan=plan)
    args.update(over)
    with pytest.raises(exc, match=match):
        ring_varlen_attention(**args)


def test_scalar_options_checked_softcap_none_is_off():
    plan = RingPlan.build(_cu(LENGTHS), 1)
    x = torch.randn(plan.local_len, 2, 8)
    for cap in (float("inf"), 1e300):  # inf overflowed the group check's fingerprint
        with pytest.raises(ValueError, match="softcap must be a number in"):
            ring_varlen_attention(x, x, x, plan, softcap=cap)
    with pytest.raises(ValueError, match="softmax_scale must be a finite"):
        ring_varlen_attention(x, x, x, plan, softmax_scale=float("nan"))
    with pytest.raises(TypeError, match="causal must be a bool"):
        ring_varlen_attention(x, x, x, plan, causal="yes")
    off = ring_varlen_attention(x, x, x, plan)
    assert torch.equal(ring_varlen_attention(x, x, x, plan, softcap=None), off)


def test_helpers_need_no_process_group_for_a_ring_of_one():
    plan = RingPlan.build(_cu(LENGTHS), 1, "zigzag")
    full = torch.randn(sum(LENGTHS), 3)
    local = plan.shard(full, 0)
    assert torch.equal(gather_from_ring(local, plan), full)
    assert torch.equal(gather_from_ring(local, plan, dst=0), full)
    mask = torch.rand(plan.local_len) > 0.5
    mean = ring_token_mean(local[:, 0], mask)
    torch.testing.assert_close(mean, local[:, 0][mask].mean())


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_lse_is_differentiable(layout):
    """Gradients through the returned lse match single-device attention's (pads: lse -inf)."""
    q, k, v, do = _inputs(4, 2)
    dlse = torch.randn(sum(LENGTHS), 4, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    cu = _cu(LENGTHS)
    out, lse = varlen_attention_reference(*leaves, cu, cu, causal=True, window_size=(9, 0))
    torch.autograd.backward([out, lse], [do, dlse.T])
    ref = [t.grad for t in leaves]
    plan = RingPlan.build(cu, 1, layout)
    shards = [plan.shard(t, 0).float().requires_grad_() for t in (q, k, v)]
    out, lse = ring_varlen_attention(*shards, plan, window_size=(9, 0), return_lse=True)
    pad = torch.isneginf(lse)
    assert pad.sum() == 4 * (plan.local_len - sum(LENGTHS))
    torch.autograd.backward(
        [out, lse.masked_fill(pad, 0.0)], [plan.shard(do, 0).float(), plan.shard(dlse, 0).T.float()]
    )
    for name, a, r in zip("qkv", shards, ref):
        torch.testing.assert_close(
            plan.unshard([a.grad]).double(), r, rtol=1e-5, atol=1e-5, msg=f"d{name}"
        )


def test_nan_inputs_give_nan_on_fused_tiles_too():
    """The fused CPU tile kernel wrote 0 for a query row with a NaN score; such blocks now take
    the explicit math: the same NaN pattern, forward and backward, as with fused=False."""
    plan = RingPlan.build(_cu(LENGTHS), 1)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(plan.local_len, 2, 8, generator=g) for _ in "qkv")
    q[0, 0, 0] = k[5, 1, 3] = float("nan")
    runs = []
    for fused in (True, False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = ring_varlen_attention(*leaves, plan, fused=fused)
        out.backward(torch.ones_like(out))
        runs.append([out.isnan()] + [t.grad.isnan() for t in leaves])
    assert runs[0][0].any()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_empty_stream():
    plan = RingPlan.build(torch.tensor([0, 0], dtype=torch.int32), 1)
    x = torch.zeros(0, 2, 8, requires_grad=True)
    out = ring_varlen_attention(x, x, x, plan)
    out.sum().backward()
    assert out.shape == (0, 2, 8) and x.grad.shape == (0, 2, 8)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_fp32_fused_and_explicit_tiles(fused, layout):
    q, k, v, do = _inputs(4, 2)
    plan = RingPlan.build(_cu(LENGTHS), 1, layout)
    ref = _run_reference(q, k, v, do, torch.float64, True, (-1, -1), 0.0)
    got = _run_ring(plan, q, k, v, do, torch.float32, fused=fused, tile=16)
    for a, b in zip(got, ref):
        assert (a.double() - b).abs().max() < 1e-5


def _dies_on_rank_one(rank, world, how="exit"):
    import os

    if rank == 1 and how == "exit":
        os._exit(7)  # as a segfault or an OOM kill: no result, no traceback
    if rank == 1:
        return lambda: None  # unpicklable: the queue's feeder thread used to drop it silently
    return rank


@pytest.mark.multiproc
def test_run_gloo_reports_a_worker_that_dies_at_once():
    """A worker killed without reporting used to leave run_gloo waiting its whole timeout."""
    import time

    from rlhf_kernels.ring.spawn import run_gloo

    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="rank 1 ---\nexited \\(exit code 7\\) without a result"):
        run_gloo(_dies_on_rank_one, 2, timeout_s=120)
    with pytest.raises(RuntimeError, match="(?s)rank 1 ---\n.*pickle"):
        run_gloo(_dies_on_rank_one, 2, "result", timeout_s=120)
    assert time.perf_counter() - t0 < 60
    assert run_gloo(_dies_on_rank_one, 1, timeout_s=60) == [0]


def test_gather_and_token_mean_contract_at_world_one():
    plan = RingPlan.build(_cu([3, 2]), 1)
    local = torch.randn(plan.local_len, 2, requires_grad=True)
    out = gather_from_ring(local, plan)
    assert not out.requires_grad and torch.equal(out, local.detach())  # not differentiable
    for bad, exc, match in (
        ([1.0] * 5, TypeError, "local must be a torch.Tensor, got list"),
        (torch.tensor(1.0), ValueError, r"local_len=5 as first dim, got \(\)"),
        (torch.zeros(4, 2), ValueError, r"local_len=5 as first dim, got \(4, 2\)"),
    ):
        with pytest.raises(exc, match=match):
            gather_from_ring(bad, plan)
    for dst, exc in ((1, ValueError), (-1, ValueError), (0.0, ValueError), (True, ValueError)):
        with pytest.raises(exc, match=r"dst must be a group rank in \[0, 1\)"):
            gather_from_ring(local, plan, dst=dst)
    # ring_token_mean: a broadcast mask counts once per broadcast token; fp16 sums in fp32
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    mask = torch.tensor([[1.0], [0.0], [1.0]])
    mean = ring_token_mean(values, mask)
    assert mean.item() == (1 + 2 + 5 + 6) / 4
    mean.backward()
    assert torch.equal(values.grad, torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]) / 4)
    zero = ring_token_mean(values, torch.zeros(3, 2))  # no token: 0, not NaN
    assert zero.item() == 0.0
    big = torch.full((4096,), 60.0, dtype=torch.float16)  # an fp16 sum overflows at 65504
    assert ring_token_mean(big, torch.ones(4096)).item() == 60.0
    with pytest.raises(ValueError, match=r"does not broadcast to values' shape \(3, 2\)"):
        ring_token_mean(values, torch.ones(3, 3))
    with pytest.raises(ValueError, match=r"does not broadcast to values' shape \(3,\)"):
        ring_token_mean(values[:, 0], torch.ones(3, 1))  # would broadcast values up to (3, 3)
    with pytest.raises(ValueError, match="mask values must be 0 or 1"):
        ring_token_mean(values, torch.full((3, 2), 2.0))
