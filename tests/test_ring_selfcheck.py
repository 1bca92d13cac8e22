"""The torchrun self-check, run on 4 gloo processes as two rings of 2 (sub-groups side by side)."""

import os
import subprocess
import sys

import pytest
import torch

from rlhf_kernels.ring.selfcheck import check, verdict
from rlhf_kernels.ring.spawn import run_gloo


def _worker(rank, world):
    return [
        check(ring_size=2, total=600, heads=4, kv_heads=2, head_dim=16, comm=comm, iters=1)
        for comm in ("p2p", "allgather")
    ]


@pytest.mark.multiproc
def test_two_rings_of_two_match_single_device():
    for rank, per_comm in enumerate(run_gloo(_worker, 4, timeout_s=240)):
        for res in per_comm:
            assert max(res[k] for k in ("out", "dq", "dk", "dv")) < 1e-5, (rank, res)
            assert res["ok"] and set(res["errors"]) == {"out", "dq", "dk", "dv"}, (rank, res)
            assert res["balance"] <= 1.05
            assert res["ring_s"] > 0 and res["single_s"] > 0


def test_verdict_fails_a_ring_worse_than_twice_single_device():
    g = torch.Generator().manual_seed(0)
    truth = torch.randn(64, 4, 8, generator=g, dtype=torch.float64)
    single = truth.bfloat16()  # rounding error only
    assert verdict(truth.bfloat16(), single, truth, torch.bfloat16)[0]
    wrong = truth.clone()
    wrong[5, 1, 2] += 0.1  # one bad element: a masking or merge bug
    ok, (err, ref_err, tol) = verdict(wrong.bfloat16(), single, truth, torch.bfloat16)
    assert not ok and err > tol > 2 * ref_err
    ok32, (_, _, tol32) = verdict(truth.float() + 1e-3, truth.float(), truth, torch.float32)
    assert not ok32 and tol32 < 1e-4


@pytest.mark.multiproc
def test_torchrun_command_prints_pass_and_exits_0():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["-m", "rlhf_kernels.ring.selfcheck", "--total", "384", "--heads", "4"]
    cmd += ["--kv-heads", "2", "--head-dim", "16", "--iters", "1"]  # default dtype: bf16
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "dk: max abs error ring" in run.stdout and run.stdout.rstrip().endswith("PASS")
