"""Peak memory of broadcast_chunked: a 180 MB rollout in 4 MB chunks over 3 gloo ranks.

Every rank measures its own peak RSS above what it held before the stream (the source's inputs
included in that baseline) and must stay within 10% of the payload. Receivers check each sample
bit for bit against a copy regenerated from the seed, then drop it.
"""

from __future__ import annotations

import gc
import os
import threading
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_kernels.comm import broadcast_chunked

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

N_SAMPLES = 180
CHUNK = 4 << 20


def sample_fields(i: int):
    """~1 MB rollout number ``i``, one field at a time: int64 ids, fp32 log-probs, bf16 values,
    metadata (receivers regenerate it field by field to check what they got)."""
    g = torch.Generator().manual_seed(i)
    n = 64_000 + 1499 * (i % 11)  # varied lengths: 0.9-1.1 MB per sample
    yield "input_ids", torch.randint(0, 1 << 40, (n,), generator=g)
    yield "logp", torch.randn(n, generator=g)
    yield "values", torch.randn(n, generator=g).bfloat16()
    yield "reward", torch.tensor(float(i))
    yield "id", i


def make_sample(i: int) -> dict:
    return dict(sample_fields(i))


def sample_bytes(i: int) -> int:
    s = make_sample(i)
    return sum(v.numel() * v.element_size() for v in s.values() if isinstance(v, torch.Tensor))


class PeakRSS:
    """Peak resident set size (bytes) of this process from ``start()``: resets the kernel's
    high-water mark when /proc/self/clear_refs allows it, and samples VmRSS in a thread too."""

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} not in /proc/self/status")

    def start(self) -> int:
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.hwm = True
        except OSError:
            self.hwm = False
        self.base = self._status("VmRSS")
        self.sampled, self.stop = self.base, False
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self.base

    def _sample(self):
        while not self.stop:
            self.sampled = max(self.sampled, self._status("VmRSS"))
            time.sleep(0.002)

    def peak_above_start(self) -> int:
        self.stop = True
        self.thread.join()
        peak = max(self.sampled, self._status("VmHWM") if self.hwm else 0)
        return peak - self.base


def _worker(rank, world, store, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        # warm-up: connections and allocator pools exist before the baseline
        for _ in broadcast_chunked(
            [make_sample(0)] if rank == 0 else None, src=0, max_chunk_bytes=CHUNK
        ):
            pass
        samples = [make_sample(i) for i in range(N_SAMPLES)] if rank == 0 else None
        meter = PeakRSS()
        meter.start()
        seen = 0
        for mb in broadcast_chunked(samples, src=0, max_chunk_bytes=CHUNK):
            for s in mb:
                if rank != 0:
                    assert s["id"] == seen and len(s) == 5
                    for k, ref in sample_fields(s["id"]):
                        got = s[k]
                        if isinstance(ref, torch.Tensor):
                            assert ref.dtype == got.dtype and torch.equal(
                                ref.view(-1).view(torch.uint8), got.view(-1).view(torch.uint8)
                            ), (seen, k)
                        else:
                            assert ref == got
                        del ref, got
                seen += 1
            del mb, s  # the consumer keeps nothing
        peak = meter.peak_above_start()
        assert seen == N_SAMPLES
        queue.put((rank, None, peak))
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, traceback.format_exc(), None))


def test_peak_memory_within_10_percent_of_payload(tmp_path):
    payload = sum(sample_bytes(i) for i in range(N_SAMPLES))
    assert 170e6 < payload < 200e6
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(r, 3, str(tmp_path / "store"), queue)) for r in range(3)
    ]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=280) for _ in range(3)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}:\n{e}" for r, e, _ in results if e]
    assert not errors, "\n".join(errors)
    peaks = {r: peak for r, _, peak in results}
    print(
        f"peak RSS above inputs, MB: { {r: round(p / 1e6, 1) for r, p in peaks.items()} } "
        f"for a {payload / 1e6:.0f} MB payload"
    )
    for rank, peak in peaks.items():
        assert peak <= 0.10 * payload, f"rank {rank}: peak {peak / 1e6:.1f} MB"
