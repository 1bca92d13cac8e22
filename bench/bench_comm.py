"""Rollout distribution: time and peak memory of four ways to get a rollout to every ring rank.

Methods (rank 0 owns the rollout, a list of ~1 MB samples: int64 ids, fp32 log-probs, bf16
values, metadata):
  ``whole_list``     ``broadcast_object_list([samples])``: what OpenRLHF did (the baseline).
  ``pickled_micro``  one ``broadcast_object_list`` per micro-batch (the never-merged attempt).
  ``chunked``        ``broadcast_chunked``: raw bytes through fixed buffers, bounded memory.
  ``scatter``        ``scatter_for_ring``: each rank receives only its ring shard (~1/world).

pytest-benchmark (group ``comm-<payload>MB``): this process is rank 0 of a gloo group, the other
ranks are spawned helpers running the same rounds in lockstep; the timed call is one barrier-
synchronised distribution of the whole rollout. ``extra_info`` holds every rank's peak RSS growth
and the bytes each rank received.

Script (``python -m bench.bench_comm [--quick]``): the sweep (payloads 100 MB - 1 GB, world sizes
2-4) in fresh processes, written to ``bench/results/comm-cpu-<date>.json`` + ``.png``. Every rank
is a 1-thread process on the same host (loopback TCP), so times measure memory copies and
serialisation, not a network.
"""

from __future__ import annotations

import datetime
import gc
import json
import statistics
import time

import pytest
import torch
import torch.distributed as dist

from rlhf_kernels.comm import broadcast_chunked, scatter_for_ring
from rlhf_kernels.comm._memory import PeakRSS, trim
from rlhf_kernels.comm._wire import micro_batches
from rlhf_kernels.ring.spawn import gloo_rank0, run_gloo

METHODS = ("chunked", "scatter", "pickled_micro", "whole_list")
TOKEN_KEYS = ("input_ids", "logp", "values")
SAMPLE_TOKENS = 74_000  # 14 bytes per token: ~1.04 MB per sample


def make_rollout(payload_mb: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(max(1, round(payload_mb * 1e6 / (14 * SAMPLE_TOKENS)))):
        n = SAMPLE_TOKENS - 1000 + 97 * (i % 21)
        out.append(
            {
                "input_ids": torch.randint(0, 1 << 17, (n,), generator=g),
                "logp": torch.randn(n, generator=g),
                "values": torch.randn(n, generator=g).bfloat16(),
                "reward": float(i % 7),
                "id": i,
            }
        )
    return out


def tensor_bytes(samples) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in samples
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )


# ----------------------------------------------------------------------------- the methods
def distribute(method: str, samples, rank: int, chunk: int) -> int:
    """Run one distribution from rank 0; consume and drop; return tensor bytes received here."""
    src_samples = samples if rank == 0 else None
    got = 0
    if method == "whole_list":
        box = [src_samples]
        dist.broadcast_object_list(box, src=0)
        got = tensor_bytes(box[0])
        del box
    elif method == "pickled_micro":
        batches = (
            micro_batches(samples, lambda s, i: tensor_bytes([s]), chunk) if rank == 0 else None
        )
        while True:
            box = [next(batches, None) if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None:
                break
            got += tensor_bytes(box[0])
            del box
    elif method == "chunked":
        for mb in broadcast_chunked(src_samples, src=0, max_chunk_bytes=chunk):
            got += tensor_bytes(mb)
            del mb
    elif method == "scatter":
        for _, local, _ in scatter_for_ring(
            src_samples, src=0, token_keys=TOKEN_KEYS, max_chunk_bytes=chunk
        ):
            got += sum(t.numel() * t.element_size() for t in local.values())
            del local
    else:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return got


def measure(method, samples, rank, chunk, rounds):
    """Barrier-synchronised rounds: median time, peak RSS growth, bytes received."""
    times = []
    mem = PeakRSS()
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        got = distribute(method, samples, rank, chunk)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return {"time_s": statistics.median(times), "peak_rss_bytes": mem.stop(), "received": got}


def sweep_worker(rank, world, payload_mb, chunk, rounds, methods):
    samples = make_rollout(payload_mb) if rank == 0 else None
    out = {"payload_bytes": tensor_bytes(samples) if rank == 0 else None}
    for method in methods:
        out[method] = measure(method, samples, rank, chunk, rounds)
        gc.collect()
        trim()
    return out


def helper_worker(rank, world, payload_mb, chunk, method, rounds):
    """A non-source rank of the pytest-benchmark run: warm-up + ``rounds`` rounds."""
    distribute(method, None, rank, chunk)
    return measure(method, None, rank, chunk, rounds)


# ----------------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("world", (2, 3))
def test_rollout_distribution(benchmark, quick, world, method):
    payload_mb, chunk, rounds = (20, 4 << 20, 2) if quick else (100, 16 << 20, 3)
    benchmark.group = f"comm-{payload_mb}MB"  # before the timed call, which copies it
    with gloo_rank0(
        helper_worker, world, payload_mb, chunk, method, rounds, timeout_s=600
    ) as others:
        samples = make_rollout(payload_mb)
        distribute(method, samples, 0, chunk)  # warm-up, as the helpers do

        def run():
            dist.barrier()
            distribute(method, samples, 0, chunk)
            dist.barrier()

        mem = PeakRSS()
        benchmark.pedantic(run, rounds=rounds, warmup_rounds=0, iterations=1)
        peak = mem.stop()
    payload = tensor_bytes(samples)
    benchmark.extra_info.update(
        label=f"{method} W={world}",
        method=method,
        world=world,
        payload_bytes=payload,
        max_chunk_bytes=chunk,
        source_peak_rss_bytes=peak,
        receiver_peak_rss_bytes=[v["peak_rss_bytes"] for v in others],
        received_bytes_per_rank=[v["received"] for v in others],
    )


# ----------------------------------------------------------------------------- sweep script
def sweep(payloads, worlds, chunk, rounds, baseline_limit_mb) -> list[dict]:
    rows = []
    for payload_mb in payloads:
        for world in worlds:
            methods = [
                m
                for m in METHODS
                if m in ("chunked", "scatter") or payload_mb * world <= baseline_limit_mb
            ]
            per_rank = run_gloo(
                sweep_worker, world, payload_mb, chunk, rounds, methods, timeout_s=1800
            )
            for method in methods:
                r = [p[method] for p in per_rank]
                rows.append(
                    {
                        "method": method,
                        "world": world,
                        "payload_mb": payload_mb,
                        "max_chunk_bytes": chunk,
                        "time_s": max(x["time_s"] for x in r),
                        "source_peak_rss_bytes": r[0]["peak_rss_bytes"],
                        "receiver_peak_rss_bytes": [x["peak_rss_bytes"] for x in r[1:]],
                        "received_bytes_per_receiver": [x["received"] for x in r[1:]],
                        "payload_bytes": per_rank[0]["payload_bytes"],
                    }
                )
                row = rows[-1]
                print(
                    f"{method:14s} W={world} {payload_mb:5d} MB: {row['time_s']:7.3f} s, "
                    f"peak src {row['source_peak_rss_bytes'] / 1e6:7.1f} MB, recv max "
                    f"{max(row['receiver_peak_rss_bytes']) / 1e6:7.1f} MB",
                    flush=True,
                )
    return rows


def overlap_worker(rank, world, payload_mb, chunk, work_s):
    """Does the next micro-batch's transfer overlap the consumer's work? Times the stream with
    no work, the work alone (``work_s`` of sleep per micro-batch, standing in for GPU compute
    that leaves the CPU free) and both together."""
    samples = make_rollout(payload_mb) if rank == 0 else None
    out = {}
    for name, work in (("transfer_only", 0.0), ("transfer_and_work", work_s)):
        dist.barrier()
        t0, n = time.perf_counter(), 0
        for _mb in broadcast_chunked(samples if rank == 0 else None, src=0, max_chunk_bytes=chunk):
            n += 1
            time.sleep(work)
        dist.barrier()
        out[name] = time.perf_counter() - t0
    out["work_only"] = n * work_s
    out["micro_batches"] = n
    return out


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for method in METHODS:
        for world, style in zip((2, 3, 4), ("-", "--", ":")):
            pts = sorted(
                (r["payload_mb"], r) for r in rows if r["method"] == method and r["world"] == world
            )
            if not pts:
                continue
            xs = [p for p, _ in pts]
            kw = {
                "marker": "o",
                "linestyle": style,
                "label": f"{method} W={world}",
                "color": f"C{METHODS.index(method)}",
            }
            axes[0].plot(xs, [r["time_s"] for _, r in pts], **kw)
            axes[1].plot(xs, [r["source_peak_rss_bytes"] / 1e6 for _, r in pts], **kw)
            axes[2].plot(xs, [max(r["receiver_peak_rss_bytes"]) / 1e6 for _, r in pts], **kw)
    titles = (
        "time to distribute (s)",
        "source peak RSS growth (MB)",
        "receiver peak RSS growth, max over ranks (MB)",
    )
    for ax, title in zip(axes, titles):
        ax.set(xlabel="rollout payload (MB)", title=title, xscale="log", yscale="log")
    axes[0].legend(fontsize=7)
    fig.suptitle(
        "rollout distribution over gloo (loopback), 2-core CPU sandbox, shared", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    from bench.report import collect_machine_info, results_stem, script_args

    args = script_args(argv, __doc__)
    quick = args.quick
    stem = str(results_stem("comm-cpu", quick, args.force))
    payloads = (20, 50) if quick else (100, 400, 1000)
    worlds = (2, 3) if quick else (2, 3, 4)
    chunk = 16 << 20
    # whole-list baselines hold ~2-3 copies per rank: keep payload * world under this on 24 GB
    limit = 1 << 30 if quick else 2000
    rows = sweep(payloads, worlds, chunk, rounds=1, baseline_limit_mb=limit)
    overlap = run_gloo(overlap_worker, 2, 50 if quick else 200, chunk, 0.02)[1]
    print(f"overlap (receiver, W=2): {overlap}", flush=True)
    date = datetime.date.today().isoformat()
    report = {
        "topic": "comm",
        "machine": {**collect_machine_info(), "note": "2-core CPU sandbox, shared"},
        "date": date,
        "quick": quick,
        "setup": "rank 0 owns the rollout; every rank a 1-thread process; gloo over loopback",
        "rows": rows,
        "overlap_receiver_w2": overlap,
    }
    with open(stem + ".json", "w") as f:
        json.dump(report, f, indent=1)
    _plot(rows, stem + ".png")
    print(f"wrote {stem}.json/.png")


if __name__ == "__main__":
    main()
