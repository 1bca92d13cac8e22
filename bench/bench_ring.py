"""Ring attention: per-rank time and peak memory vs total length, world sizes 1/2/4, p2p vs
allgather, against single-device ``varlen_attention`` on the same packed stream.

pytest-benchmark (group ``ring-fwd_bwd-<total>``): this process is rank 0 of a gloo group and
``world - 1`` spawned helpers run the same steps in lockstep; the timed call is one synchronised
forward + backward (barrier, step, barrier), so the time is the ring's step time. ``extra_info``
holds rank 0's peak RSS growth, bytes each rank sends per step, and the zigzag/contiguous causal
load balance (max/mean of per-rank visible q-k pairs).

Script (``python -m bench.bench_ring [--quick]``): the whole sweep in fresh processes, written to
``bench/results/ring-cpu-<date>.json`` + ``.png`` with machine info. On CPU every rank is a
1-thread process; on a 2-core machine world 4 oversubscribes the cores, so its times measure the
algorithm's overheads, not a speed-up.
"""

from __future__ import annotations

import datetime
import json
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from rlhf_kernels.comm._memory import PeakRSS
from rlhf_kernels.ops.varlen_attention import varlen_attention
from rlhf_kernels.ring.attention import ring_varlen_attention
from rlhf_kernels.ring.plan import RingPlan
from rlhf_kernels.ring.spawn import gloo_rank0, run_gloo

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
WORLDS = (1, 2, 4)
COMMS = ("p2p", "allgather")


def doc_lengths(total: int, seed: int = 0) -> list[int]:
    """Uneven documents summing to ``total`` (about one per 1024 tokens, at least 3)."""
    g = torch.Generator().manual_seed(seed)
    n = max(3, total // 1024)
    cuts = sorted(torch.randperm(total - 1, generator=g)[: n - 1].add(1).tolist())
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def bytes_sent_per_step(plan: RingPlan, comm: str, elem: int = 4) -> int:
    """Bytes one rank sends in forward + backward (K/V in the input dtype, dK/dV in fp32)."""
    w = plan.world_size
    kv = 2 * plan.local_len * KV_HEADS * HEAD_DIM
    if w == 1:
        return 0
    if comm == "p2p":  # K/V: w-1 hops fwd, w-1 bwd; dK/dV: w hops
        return (2 * (w - 1) * kv * elem) + w * kv * 4
    # all-gather sends the local K/V to w-1 ranks, twice; reduce-scatter sends (w-1) slices
    return 2 * (w - 1) * kv * elem + (w - 1) * kv * 4


def make_step(rank: int, world: int, total: int, comm: str, layout: str = "zigzag"):
    """A closure running one ring forward + backward on this rank's shard (fp32)."""
    plan = RingPlan.build(_cu(doc_lengths(total)), world, layout)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(total, h, HEAD_DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS)]
    q, k, v = (plan.shard(t, rank).requires_grad_() for t in full)
    do = plan.shard(torch.randn(total, HEADS, HEAD_DIM, generator=g), rank)

    def step():
        q.grad = k.grad = v.grad = None
        out = ring_varlen_attention(q, k, v, plan, comm=comm)
        out.backward(do)

    return step, plan


def _synced(step, world):
    def run():
        if world > 1:
            dist.barrier()
        step()
        if world > 1:
            dist.barrier()

    return run


def ring_worker(rank, world, total, comm, layout, warmup, iters):
    """Run warmup + iters synchronised steps; returns this rank's times and peak RSS growth."""
    step, plan = make_step(rank, world, total, comm, layout)
    run = _synced(step, world)
    mem, times = PeakRSS(), []  # from before the first step: the allocator keeps freed pages
    for _ in range(warmup):
        run()
    for _ in range(iters):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return {
        "time_s": statistics.median(times),
        "peak_rss_bytes": mem.stop(),
        "local_len": plan.local_len,
        "real_tokens": plan.num_tokens(rank),
    }


def single_worker(rank, world, total, warmup, iters):
    """Single-device baseline: ``varlen_attention`` (torch backend) on the whole stream."""
    cu = _cu(doc_lengths(total))
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(total, h, HEAD_DIM, generator=g).requires_grad_()
        for h in (HEADS, KV_HEADS, KV_HEADS)
    )
    do = torch.randn(total, HEADS, HEAD_DIM, generator=g)

    def step():
        q.grad = k.grad = v.grad = None
        varlen_attention(q, k, v, cu, cu, causal=True, backend="torch").backward(do)

    mem, times = PeakRSS(), []
    for _ in range(warmup):
        step()
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"time_s": statistics.median(times), "peak_rss_bytes": mem.stop()}


def balance(total: int, world: int = 4) -> dict:
    """max/mean of per-rank causal attention work (visible q-k pairs), both layouts."""
    cu = _cu(doc_lengths(total))
    out = {}
    for layout in ("zigzag", "contiguous"):
        work = RingPlan.build(cu, world, layout).attention_work(causal=True).double()
        out[layout] = round(float(work.max() / work.mean()), 4)
    return out


def balance_mixes(worlds=(2, 4, 8)) -> dict:
    """Causal max/mean work and slots per token on document mixes with short documents."""
    g = torch.Generator().manual_seed(0)
    mixes = {
        "docs_1_7_x200": torch.randint(1, 8, (200,), generator=g).tolist(),
        "len3_x100": [3] * 100,
        "len9_x100": [9] * 100,
        "rlhf_20_300_x64": torch.randint(20, 300, (64,), generator=g).tolist(),
        "uneven_1_4000_x16": torch.randint(1, 4000, (16,), generator=g).tolist(),
    }
    out = {}
    for name, lengths in mixes.items():
        for world in worlds:
            row = {}
            for layout in ("zigzag", "contiguous"):
                plan = RingPlan.build(_cu(lengths), world, layout)
                work = plan.attention_work(causal=True).double()
                row[layout] = round(float(work.max() / work.mean()), 4)
                row[f"{layout}_slots_per_token"] = round(plan.local_len * world / sum(lengths), 4)
            out[f"{name}/W{world}"] = row
    return out


# ----------------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("comm", COMMS)
@pytest.mark.parametrize("world", WORLDS)
def test_ring_fwd_bwd(benchmark, quick, world, comm):
    if world == 1 and comm == "allgather":
        pytest.skip("world 1 has no communication")
    total = 1024 if quick else 4096
    rounds = 2 if quick else 3
    benchmark.group = f"ring-fwd_bwd-{total}"  # before the timed call, which copies it
    with gloo_rank0(ring_worker, world, total, comm, "zigzag", 1, rounds, timeout_s=300) as others:
        step, plan = make_step(0, world, total, comm)
        mem = PeakRSS()  # covers the warm-up round too
        # helpers run 1 warm-up + `rounds` steps: the same count as this pedantic call
        benchmark.pedantic(_synced(step, world), rounds=rounds, warmup_rounds=1, iterations=1)
        peak = mem.stop()
    benchmark.extra_info.update(
        world=world,
        comm=comm,
        layout="zigzag",
        total=total,
        heads=HEADS,
        kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        local_len=plan.local_len,
        rank0_peak_rss_bytes=peak,
        helper_peak_rss_bytes=[v["peak_rss_bytes"] for v in others],
        bytes_sent_per_rank=bytes_sent_per_step(plan, comm),
        causal_balance_world4=balance(total),
    )


# ----------------------------------------------------------------------------- sweep script
def sweep(lengths, iters=3) -> dict:
    rows = []
    for total in lengths:
        single = run_gloo(single_worker, 1, total, 1, iters)[0]
        rows.append({"method": "single_device_varlen", "world": 1, "total": total, **single})
        print(f"single  T={total}: {single['time_s']:.3f}s", flush=True)
        for world in WORLDS:
            for comm in COMMS if world > 1 else ("p2p",):
                per_rank = run_gloo(
                    ring_worker, world, total, comm, "zigzag", 1, iters, timeout_s=900
                )
                step_time = max(r["time_s"] for r in per_rank)
                plan = RingPlan.build(_cu(doc_lengths(total)), world)
                rows.append(
                    {
                        "method": f"ring_{comm}",
                        "world": world,
                        "total": total,
                        "time_s": step_time,
                        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in per_rank],
                        "local_len": per_rank[0]["local_len"],
                        "bytes_sent_per_rank": bytes_sent_per_step(plan, comm),
                        "fraction_of_single_throughput": single["time_s"] / step_time,
                    }
                )
                print(
                    f"ring {comm:9s} W={world} T={total}: {step_time:.3f}s "
                    f"(single/ring {single['time_s'] / step_time:.2f})",
                    flush=True,
                )
    return {
        "rows": rows,
        "causal_balance_world4": {t: balance(t) for t in lengths},
        "causal_balance_mixes": balance_mixes(),
    }


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(r["method"], r["world"]) for r in rows})
    for method, world in series:
        pts = sorted((r["total"], r) for r in rows if (r["method"], r["world"]) == (method, world))
        xs = [t for t, _ in pts]
        label = f"{method} W={world}"
        ax_t.plot(xs, [r["time_s"] for _, r in pts], marker="o", label=label)
        mem = [
            max(r.get("peak_rss_bytes_per_rank", [r.get("peak_rss_bytes", 0)])) / 2**20
            for _, r in pts
        ]
        ax_m.plot(xs, mem, marker="o", label=label)
    ax_t.set(
        xlabel="total tokens",
        ylabel="fwd+bwd step time (s)",
        xscale="log",
        yscale="log",
        title="ring attention step time (gloo, CPU)",
    )
    ax_m.set(
        xlabel="total tokens",
        ylabel="peak RSS growth per rank (MiB)",
        xscale="log",
        title="per-rank peak memory",
    )
    ax_t.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    from bench.report import results_stem, script_args

    cli = script_args(argv, __doc__)
    quick = cli.quick
    out = str(results_stem("ring-cpu", quick, cli.force))
    lengths = (512, 1024) if quick else (1024, 2048, 4096, 8192)
    from bench.report import collect_machine_info

    data = sweep(lengths, iters=2 if quick else 3)
    date = datetime.date.today().isoformat()
    data.update(
        machine=collect_machine_info(),
        date=date,
        quick=quick,
        note="2-core CPU sandbox, shared with other jobs; 1 thread per rank; fp32; "
        f"heads={HEADS}, kv_heads={KV_HEADS}, head_dim={HEAD_DIM}; causal zigzag",
    )
    with open(out + ".json", "w") as f:
        json.dump(data, f, indent=1)
    _plot(data["rows"], out + ".png")
    print("wrote", out + ".json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
