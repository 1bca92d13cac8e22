"""The torchrun self-check, run on 4 gloo processes as two rings of 2 (sub-groups side by side)."""

import pytest

from rlhf_kernels.ring.selfcheck import check
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
            assert res["balance"] <= 1.05
            assert res["ring_s"] > 0 and res["single_s"] > 0
