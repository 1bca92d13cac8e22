"""Audit of ring/attention.py's ring loops and of _checks' contracts, in one process.

The ring of several ranks runs in threads whose P2P exchange, all-gather and reduce-scatter are
simulated (a send completes when its receiver has copied it, as a rendezvous), so the real
forward / backward loops of both comm modes (hop order, dK/dV one hop behind, head groups) are
checked against single-device attention without a process group."""

from __future__ import annotations

import queue
import threading

import pytest
import torch

from rlhf_kernels import _checks
from rlhf_kernels._checks import (
    as_cu_seqlens,
    check_cu_seqlens,
    check_mask,
    remember_validated,
)
from rlhf_kernels.ops.varlen_attention import varlen_attention_reference
from rlhf_kernels.ring import attention as ring
from rlhf_kernels.ring.plan import RingPlan

LENGTHS = [1, 23, 2, 40, 9]


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


class _Done:
    def wait(self):
        pass


class _ThreadRing:
    """The collectives of ``ring.attention`` between threads, one thread per rank."""

    def __init__(self, world):
        self.world, self.local = world, threading.local()
        self.boxes = [queue.Queue() for _ in range(world)]
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots = [None] * world

    def exchange(self, spec, send):
        recv, sent = torch.empty_like(send), threading.Event()
        self.boxes[spec.next_peer].put((send, sent))
        box = self.boxes[spec.rank]

        class Req:
            def wait(self):
                got, done = box.get(timeout=60)
                recv.copy_(got)
                done.set()
                assert sent.wait(60)

        return [Req()], recv

    def _collect(self, spec, x):
        self.slots[spec.rank] = x.clone()
        self.barrier.wait()
        every = torch.stack(self.slots)
        self.barrier.wait()
        return every

    def allgather(self, spec, x):
        return _Done(), self._collect(spec, x)

    def reduce_scatter(self, spec, full):
        return self._collect(spec, full).sum(0)[spec.rank]

    def run(self, fn, monkeypatch):
        monkeypatch.setattr(ring, "_exchange", self.exchange)
        monkeypatch.setattr(ring, "_allgather", self.allgather)
        monkeypatch.setattr(ring, "_reduce_scatter", self.reduce_scatter)
        monkeypatch.setattr(ring, "group_rank", lambda group: (self.local.rank, self.world))
        monkeypatch.setattr(ring, "global_rank", lambda group, rank: rank)
        results, errors = [None] * self.world, []

        def work(rank):
            self.local.rank = rank
            try:
                results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("comm", ["p2p", "allgather"])
@pytest.mark.parametrize(
    "world,causal,window,kv_head_stride,use_out",
    [
        (3, True, (-1, -1), None, True),
        (2, False, (4, 7), 1, True),  # GQA in head groups: the groups' slices of q, lse, delta
        (4, True, (5, 0), 2, False),  # only the lse is used: dout None in the backward
    ],
)
def test_simulated_ring_matches_single_device(
    monkeypatch, layout, comm, world, causal, window, kv_head_stride, use_out
):
    g = torch.Generator().manual_seed(world)
    total = sum(LENGTHS)
    q, do = (torch.randn(total, 4, 8, generator=g, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(total, 2, 8, generator=g, dtype=torch.float64) for _ in "kv")
    dlse = torch.randn(4, total, generator=g).double()  # fp32 values: the ring's lse is fp32
    cu = _cu(LENGTHS)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = varlen_attention_reference(*leaves, cu, cu, causal=causal, window_size=window)
    torch.autograd.backward([out, lse] if use_out else [lse], [do, dlse] if use_out else [dlse])
    ref = [out, lse] + [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]
    plan = RingPlan.build(cu, world, layout)

    def rank_work(rank):
        shards = [plan.shard(t, rank).requires_grad_() for t in (q, k, v)]
        o, l_ = ring.ring_varlen_attention(
            *shards, plan, causal=causal, window_size=window, comm=comm,
            kv_head_stride=kv_head_stride, tile=8, return_lse=True, validate=False,
        )  # fmt: skip
        dl = plan.shard(dlse.T, rank).T.float()
        l_ = l_.masked_fill(torch.isneginf(l_), 0.0)
        if use_out:
            torch.autograd.backward([o, l_], [plan.shard(do, rank), dl])
        else:
            l_.backward(dl)
        grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in shards]
        return [o.detach(), l_.detach().T, *grads]

    per_rank = _ThreadRing(world).run(rank_work, monkeypatch)
    got = [plan.unshard([r[i] for r in per_rank]) for i in range(5)]
    got[1] = got[1].T
    seen = torch.isfinite(ref[1])
    got[1], ref[1] = got[1][seen].double(), ref[1][seen]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        tol = 1e-6 if name == "lse" else 1e-9
        torch.testing.assert_close(a, b.detach(), rtol=tol, atol=tol, msg=name)


def _world_one(**kw):
    cu = _cu(LENGTHS)
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(sum(LENGTHS), 4, 8, generator=g, dtype=torch.float64) for _ in "qo")
    k, v = (torch.randn(sum(LENGTHS), 2, 8, generator=g, dtype=torch.float64) for _ in "kv")
    ring_kw = {n: kw.pop(n) for n in ("comm", "kv_head_stride") if n in kw}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, _ = varlen_attention_reference(*leaves, cu, cu, causal=True, **kw)
    out.backward(do)
    plan = RingPlan.build(cu, 1)
    shards = [plan.shard(t, 0).requires_grad_() for t in (q, k, v)]
    got = ring.ring_varlen_attention(*shards, plan, **kw, **ring_kw)
    got.backward(plan.shard(do, 0))
    for a, b in zip([got, *(t.grad for t in shards)], [out, *(t.grad for t in leaves)]):
        torch.testing.assert_close(plan.unshard([a]), b.detach(), rtol=1e-10, atol=1e-10)


def test_world_one_allgather_runs_without_a_process_group():
    _world_one(comm="allgather", kv_head_stride=1)


def test_softmax_scale_zero_is_used_not_the_default():
    _world_one(softmax_scale=0.0)  # uniform weights over the visible keys


# ----------------------------------------------------------------------------- _checks
@pytest.fixture
def as_cuda(monkeypatch):
    monkeypatch.setattr(_checks, "_read_every_time", lambda t: False)
    monkeypatch.setattr(_checks, "_VALIDATED", {})
    return _checks


def test_cached_cu_seqlens_still_checked_against_the_total(as_cuda):
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    assert check_cu_seqlens(cu, 7) == [0, 3, 7]
    assert id(cu) in as_cuda._VALIDATED
    with pytest.raises(ValueError, match=r"\[-1\] must equal the packed length 8, got 7"):
        check_cu_seqlens(cu, 8)


def test_data_replaced_without_a_version_bump_is_read_again(as_cuda):
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    check_cu_seqlens(cu, 7)
    version = cu._version
    cu.data = torch.tensor([0, 9, 7], dtype=torch.int32)  # new storage, same version counter
    assert cu._version == version
    with pytest.raises(ValueError, match="non-decreasing"):
        check_cu_seqlens(cu, 7)


def test_edit_through_a_view_or_detached_alias_is_seen(as_cuda):
    for alias in (lambda t: t[1:], lambda t: t.detach()):
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        check_cu_seqlens(cu, 7)
        alias(cu)[-2] = 9  # shares cu's version counter
        with pytest.raises(ValueError, match="non-decreasing"):
            check_cu_seqlens(cu, 7)


def test_remember_validated_ignores_cpu_tensors(monkeypatch):
    monkeypatch.setattr(_checks, "_VALIDATED", {})
    cu = torch.tensor([0, 9, 7], dtype=torch.int32)
    remember_validated(cu, [0, 3, 7])  # CPU tensors are read every time: no entry, no effect
    assert not _checks._VALIDATED
    with pytest.raises(ValueError, match="non-decreasing"):
        check_cu_seqlens(cu, 7)


def test_check_mask_rejects_nan_and_other_values_passes_bool_as_is():
    for bad in (float("nan"), 2.0, -1.0, 0.5):
        with pytest.raises(ValueError, match="values must be 0 or 1"):
            check_mask(torch.tensor([1.0, bad, 0.0]))
    m = torch.tensor([True, False])
    ok = torch.tensor([1, 0, 1])
    assert check_mask(m) is m and check_mask(ok) is ok and check_mask(None) is None


def test_as_cu_seqlens_refuses_bools_and_numpy_arrays():
    import numpy as np

    with pytest.raises(TypeError, match=r"must hold Python ints, got \['bool True'\]"):
        as_cu_seqlens([0, True, 3], torch.device("cpu"))
    with pytest.raises(TypeError, match="cu_q must be an int32/int64 tensor or a list"):
        as_cu_seqlens(np.array([0, 3]), torch.device("cpu"), "cu_q")
