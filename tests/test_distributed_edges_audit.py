"""Distributed edge cases found by an audit (world size 3, tiny or empty streams, teardown).

Trainer teardown: ``python -m trainers.sft`` (and rm, ppo) on gloo never destroyed its process
groups; a run that had trained and saved its model then sometimes aborted in interpreter
finalization ("terminate called without an active exception", SIGABRT on one rank), so torchrun
reported the successful job as FAILED (2 of 7 runs of a 3-process dp run here).
``Session.finish`` now destroys the groups the trainer created, and only those.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from rlhf_kernels.ring.plan import RingPlan
from rlhf_kernels.ring.spawn import run_gloo


def _finish(tmp_path, monkeypatch):
    """``Session.finish`` of a one-process run, the weights gathering and export faked."""
    from types import SimpleNamespace

    from trainers import engine
    from trainers.distributed import Layout
    from trainers.logger import MetricsLogger
    from trainers.session import Session
    from trainers.sft import SFTConfig

    monkeypatch.setattr(engine, "full_state_dict", lambda e, layout: {})
    monkeypatch.setattr(engine, "save_hf_model", lambda *a: None)
    s = SimpleNamespace(
        cfg=SFTConfig(output_dir=str(tmp_path)),
        kind="sft",
        layout=Layout(world=1, rank=0, dp=1, ring=1, tp=1, device=torch.device("cpu")),
        logger=MetricsLogger(str(tmp_path), kind="none"),
        _bar=SimpleNamespace(close=lambda: None),
        tokenizer=None,
        print=lambda message: None,
    )
    Session.finish(s, None, None, "", plot=[])


def test_finish_destroys_at_exit_the_process_group_the_trainer_created(
    tmp_path, monkeypatch, _no_group
):
    from trainers import distributed

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    distributed.init_distributed(1, 1)  # as Session.start: no group yet, so it creates one
    distributed._destroy_groups()  # (interpreter exit) a run that has not finished: left alone
    assert dist.is_initialized()
    _finish(tmp_path, monkeypatch)
    assert dist.is_initialized()  # a second run in this process would join it
    distributed._destroy_groups()  # interpreter exit, the atexit handler
    assert not dist.is_initialized()  # no gloo group left for interpreter finalization


def test_finish_leaves_a_callers_process_group_alone(tmp_path, monkeypatch, _no_group):
    from trainers import distributed

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    distributed.init_distributed(1, 1)  # an earlier run of this process created one ...
    dist.destroy_process_group()  # ... that its caller destroyed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    distributed.init_distributed(1, 1)  # joins the caller's group
    _finish(tmp_path, monkeypatch)
    distributed._destroy_groups()
    assert dist.is_initialized()  # the caller's group: the caller destroys it


_EXIT = """
import sys, torch, torch.distributed as dist
from trainers.distributed import destroy_at_exit, init_distributed
layout = init_distributed(1, 1)
for _ in range(3):  # (an all-gather, as ZeRO-3 and the comm streams do)
    dist.all_gather([torch.empty(64) for _ in range(layout.world)], torch.ones(64))
if sys.argv[1] == "finish":  # as Session.finish
    destroy_at_exit()
"""


@pytest.mark.slow
@pytest.mark.multiproc
def test_three_gloo_ranks_exit_cleanly_after_a_finished_run(tmp_path):
    """The abort itself, without a trainer: 3 torchrun ranks that all-gather and exit with the
    group alive abort ("terminate called without an active exception") in about half the runs
    here (run the script with ``none``); after ``destroy_at_exit`` all 4 runs exit 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exit.py"
    script.write_text(_EXIT)
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    codes, errs = [], []
    for _ in range(4):
        proc = subprocess.run(
            [*cmd, str(script), "finish"], env=env, capture_output=True, text=True, timeout=120
        )
        codes.append(proc.returncode)
        errs.append(proc.stderr[-2000:])
    assert codes == [0] * 4, errs


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
