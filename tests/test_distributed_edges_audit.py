"""Distributed edge cases found by an audit at world size 3: ring attention on tiny, empty and
uneven streams against single-process attention, and the comm streams from every source rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlhf_kernels.ring.plan import RingPlan
from rlhf_kernels.ring.spawn import run_gloo

# ----------------------------------------------------------------------------- world size 3
LENGTHS = [[0], [1], [1, 0, 1], [100, 1, 1], [0, 40, 0, 1, 2], [13, 0, 1, 90]]
# (heads, kv_heads, causal, window, softcap)
CONFIGS = [
    (4, 2, True, (-1, -1), 0.0),
    (3, 1, False, (-1, -1), 0.0),
    (2, 1, True, (3, 0), 0.0),
    (2, 2, False, (2, 4), 0.0),
    (2, 2, True, (-1, -1), 1.5),
]


def _ring_world3(rank, world):
    """float64 ring attention (both layouts and comms) vs single-process varlen attention on
    streams with fewer tokens than ranks, empty / 1-token documents, one long document."""
    from rlhf_kernels.ops.varlen_attention import varlen_attention_reference
    from rlhf_kernels.ring.attention import ring_varlen_attention

    worst = 0.0
    for lengths in LENGTHS:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        total = int(cu[-1])
        for i, (h, kvh, causal, window, cap) in enumerate(CONFIGS):
            g = torch.Generator().manual_seed(i + 10 * total)
            q, do = (torch.randn(total, h, 4, generator=g, dtype=torch.float64) for _ in "ab")
            k, v = (torch.randn(total, kvh, 4, generator=g, dtype=torch.float64) for _ in "ab")
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref, _ = varlen_attention_reference(
                *ref_in, cu, cu, causal=causal, window_size=window, softcap=cap
            )
            ref.backward(do)
            refs = [ref.detach()] + [t.grad for t in ref_in]
            for layout in ("zigzag", "contiguous"):
                for comm in ("p2p", "allgather"):
                    plan = RingPlan.build(cu, world, layout)
                    mine = [plan.shard(t, rank).clone().requires_grad_() for t in (q, k, v)]
                    out = ring_varlen_attention(
                        *mine, plan, causal=causal, window_size=window, softcap=cap, comm=comm,
                        tile=3,
                    )  # fmt: skip
                    out.backward(plan.shard(do, rank))
                    for a, b in zip([out.detach()] + [t.grad for t in mine], refs):
                        parts = [torch.empty_like(a) for _ in range(world)]
                        dist.all_gather(parts, a.contiguous())
                        whole = plan.unshard(parts)
                        if whole.numel():
                            worst = max(worst, (whole - b).abs().max().item())
    return worst


@pytest.mark.multiproc
def test_ring_attention_world3_tiny_and_uneven_streams_match_single_process():
    for rank, err in enumerate(run_gloo(_ring_world3, 3, timeout_s=120)):
        assert err < 1e-12, (rank, err)


def _comm_world3(rank, world):
    """broadcast_chunked / scatter_for_ring from every source rank: empty lists, zero-length
    samples, samples over one chunk, mixed dtypes, the smallest chunk."""
    from rlhf_kernels.comm.broadcast import broadcast_chunked, scatter_for_ring

    g = torch.Generator().manual_seed(0)
    samples = [
        {
            "ids": torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32),
            "labels": torch.randint(0, 1000, (n,), generator=g),
            "m": torch.rand(n, 2, generator=g).to(torch.bfloat16),
            "i": i,
        }
        for i, n in enumerate([1, 0, 700, 2, 0, 1])
    ]
    bad = []
    for src in range(world):
        for data in ([], samples):
            for chunk in (1024, 1 << 20):
                got = broadcast_chunked(
                    data if rank == src else None, src=src, max_chunk_bytes=chunk, timeout=20
                )
                flat = [s for mb in got for s in mb]
                ok = len(flat) == len(data) and all(
                    torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype
                    for a, b in zip(flat, data)
                    for k in ("ids", "labels", "m")
                )
                bad += [] if ok else [("broadcast", src, len(data), chunk)]
                for layout in ("zigzag", "contiguous"):
                    seen = 0
                    for plan, local, meta in scatter_for_ring(
                        data if rank == src else None, src=src, token_keys=("ids", "labels", "m"),
                        layout=layout, max_chunk_bytes=chunk, timeout=20,
                    ):  # fmt: skip
                        part = data[seen : seen + len(meta)]
                        seen += len(meta)
                        pads = ~plan.valid_mask(rank)
                        for k in ("ids", "labels", "m"):
                            want = plan.shard(torch.cat([s[k] for s in part]), rank)
                            if k == "labels":
                                want = want.masked_fill(pads, -100)
                            if not torch.equal(local[k], want):
                                bad.append(("scatter", src, layout, chunk, k))
                    if seen != len(data):
                        bad.append(("scatter count", src, layout, chunk, seen))
    return bad


@pytest.mark.multiproc
def test_comm_world3_edge_streams_from_every_source():
    for rank, bad in enumerate(run_gloo(_comm_world3, 3, timeout_s=120)):
        assert bad == [], (rank, bad)
