"""Mutation audit of the launch schedules, the flash-attn drop-ins, the once-differentiable
gradient guard, the gloo spawn helpers and the ring self-check (all in-process, no spawning).

Each test kills a mutant the rest of the suite let live:

* ``attention_schedule.schedule``: int32 tables from both branches (rectangle and flat).
* ``flash_compat``: a truthy non-bool ``return_attn_probs`` gives flash-attn's 3-tuple; the dense
  drop-in passes ``deterministic`` and ``backend`` on; a v batch mismatch names all three sizes.
* ``_once.once_differentiable_grads``: the grads come back untouched (same objects) in a plain
  backward or with nothing to tie them to; None entries stay None; every dependency is tied
  (a second derivative in k raises, not only in q).
* ``ring.spawn``: bool counts refused; ``_gone``'s wording by exit code; ``_collect`` stops at the
  first failure, sees a worker gone without a word within a second (not the whole timeout),
  times out on a silent live one; ``_reap`` terminates a straggler; ``_worker`` reports an
  unpicklable result and a ``SystemExit`` and always leaves the group; ``run_gloo`` sets
  ``OMP_NUM_THREADS`` for the workers only and returns values in rank order whatever order they
  arrive in; ``_worker`` gives the group its rank and the collectives' timeout; ``gloo_rank0``
  restores torch's thread count, returns helpers in rank order, names a gone helper by its rank,
  and blames a helper for the block's error only when it failed (after a short wait).
* ``ring.selfcheck``: ``verdict`` passes an error exactly at the tolerance (and the floor is at
  least 64 fp32 epsilons); ``check`` builds at least three documents, leaves the warm-up step out
  of the median and takes its ground truth in float64 for fp32; ``main`` reads ``LOCAL_RANK``,
  passes its defaults on, and every rank exits 1 when any rank failed.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from test_flash_compat import fake_flash

import rlhf_kernels as rk
from rlhf_kernels.ops import _once
from rlhf_kernels.ops import attention_schedule as sch
from rlhf_kernels.ops import varlen_attention_triton as vt
from rlhf_kernels.ring import selfcheck, spawn


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


# ----------------------------------------------------------------------------- schedule
def test_schedule_tables_are_int32_on_both_branches():
    mask = vt._mask_meta(True, (-1, -1))
    uniform = _cu([40, 33, 47])  # the cached rectangle
    rect = sch.schedule(uniform, uniform, None, 16, False, mask, 120, 47)
    skewed = _cu([1] * 9 + [0, 70, 3])  # the flat table
    flat = sch.schedule(skewed, skewed, None, 16, False, mask, 82, 70)
    assert rect.shape == (9, 2) and flat.shape == (18, 2)
    for table in (rect, flat):
        assert table.dtype == torch.int32 and table.is_contiguous()


# ----------------------------------------------------------------------------- flash_compat
def test_a_truthy_return_attn_probs_gives_the_three_tuple():
    """flash-attn takes any truthy ``return_attn_probs``; ``1`` must not give a bare pair."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 8, generator=g)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    res = rk.flash_attn_varlen_func(q, q, q, cu, cu, 4, 4, return_attn_probs=1)
    assert len(res) == 3 and res[2] is None and res[1].shape == (2, 6)
    res = rk.flash_attn_func(q.view(2, 3, 2, 8), q.view(2, 3, 2, 8), q.view(2, 3, 2, 8), 0.0,
                             None, False, (-1, -1), 0.0, None, False, 1)  # fmt: skip
    assert len(res) == 3 and res[2] is None and res[1].shape == (2, 2, 3)


def test_dense_drop_in_passes_deterministic_and_backend_on(monkeypatch):
    calls = fake_flash(monkeypatch)
    q = torch.randn(2, 3, 2, 8, dtype=torch.bfloat16)
    for det in (True, False):
        rk.flash_attn_func(q, q, q, causal=True, deterministic=det)
    assert calls == [True, False]
    rk.flash_attn_func(q, q, q, causal=True, deterministic=True, backend="torch")
    assert calls == [True, False]  # backend="torch" never reaches flash-attn


def test_dense_drop_in_names_every_batch_size_when_only_v_differs():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="the same batch size, got 1, 1, 2"):
        rk.flash_attn_func(q, q, q.expand(2, -1, -1, -1))


# ----------------------------------------------------------------------------- _once
def test_plain_backward_grads_come_back_untouched():
    """No create_graph (grad mode off), or nothing that requires grad: the same tensors, no
    copy and no extra node."""
    q = torch.randn(3, requires_grad=True)
    g = torch.randn(3)
    with torch.no_grad():
        out = _once.once_differentiable_grads("x", (g, None), (q,))
    assert isinstance(out, tuple) and out[0] is g and out[1] is None
    with torch.enable_grad():
        out = _once.once_differentiable_grads("x", (g,), (torch.randn(3), None, 3))
    assert out[0] is g


def test_create_graph_grads_keep_none_and_tie_every_dependency():
    q = torch.randn(3, requires_grad=True)
    k = torch.randn(3, requires_grad=True)
    g = torch.randn(3)
    with torch.enable_grad():
        res = _once.once_differentiable_grads("op", (g, None), (q, None, k))
    assert isinstance(res, tuple)
    tied, none = res
    assert none is None and tied.requires_grad
    torch.testing.assert_close(tied.detach(), g, rtol=0, atol=0)
    for x in (q, k):  # reachable from each dependency, and raising from each
        with pytest.raises(RuntimeError, match="op is differentiable once"):
            torch.autograd.grad(tied.sum(), x)


def test_ring_double_backward_in_k_raises_too():
    from rlhf_kernels.ring.attention import ring_varlen_attention
    from rlhf_kernels.ring.plan import RingPlan

    plan = RingPlan.build(_cu([3, 4]), 1)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(7, 2, 8, generator=g).requires_grad_()
    k, v = (torch.randn(7, 1, 8, generator=g).requires_grad_() for _ in range(2))
    out = ring_varlen_attention(q, k, v, plan)
    (gq,) = torch.autograd.grad((out**2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="ring_varlen_attention is differentiable once"):
        torch.autograd.grad((gq**2).sum(), k)


# ----------------------------------------------------------------------------- spawn
@pytest.mark.parametrize("kw", [dict(world_size=True), dict(threads=True)])
def test_spawn_check_refuses_bool_counts(kw):
    args = dict(world_size=2, timeout_s=1.0, threads=1) | kw
    with pytest.raises(ValueError, match="expected an int >= 1, got True"):
        spawn._check("run_gloo", **args)


def test_gone_says_signal_only_for_a_negative_exit_code():
    assert (
        spawn._gone(2, -9) == "--- rank 2 ---\nkilled by a signal (exit code -9) without a result"
    )
    assert spawn._gone(1, 0) == "--- rank 1 ---\nexited (exit code 0) without a result"


def _proc(exitcode=None):
    return SimpleNamespace(exitcode=exitcode)


class _Results(queue.Queue):
    """A result queue that fails the test instead of letting ``_collect`` poll forever."""

    def __init__(self, *items, polls=10):
        super().__init__()
        self.polls = polls
        for x in items:
            self.put(x)

    def get(self, *a, **k):
        self.polls -= 1
        assert self.polls >= 0, "_collect kept polling"
        return super().get(*a, **k)


def test_collect_stops_at_the_first_failure():
    results = _Results((1, False, "Traceback: boom"))
    t = time.monotonic()
    got, errors = spawn._collect({0: _proc(), 1: _proc()}, results, 3.0)
    assert time.monotonic() - t < 1.5  # not waiting on rank 0 (it may be blocked on rank 1)
    assert got == {} and errors == ["--- rank 1 ---\nTraceback: boom"]


def test_collect_takes_a_result_already_sent_by_an_exited_worker():
    results = _Results((0, True, 5), (1, True, 6))
    got, errors = spawn._collect({0: _proc(0), 1: _proc(0)}, results, 3.0)
    assert got == {0: 5, 1: 6} and errors == []


def test_collect_sees_a_worker_gone_without_a_word_within_a_second_or_so():
    t = time.monotonic()
    got, errors = spawn._collect({0: _proc(), 1: _proc(-11)}, _Results(), 60.0)
    assert time.monotonic() - t < 5  # short polls, not the whole timeout
    assert errors == ["--- rank 1 ---\nkilled by a signal (exit code -11) without a result"]


def test_collect_takes_a_result_that_lands_during_the_grace_wait():
    """A worker exited, its result still in the pipe: not "gone without a result"."""

    class Late(_Results):
        def __init__(self):
            super().__init__()
            self.empties, self.gets = 0, 0

        def empty(self):
            self.empties += 1
            return self.empties == 1  # lands during the 0.2 s wait

        def get(self, *a, **k):
            self.gets += 1
            if self.gets == 1:
                raise queue.Empty
            return (0, True, "late")

    got, errors = spawn._collect({0: _proc(0)}, Late(), 30.0)
    assert got == {0: "late"} and errors == []


def test_collect_times_out_on_a_silent_live_worker():
    t = time.monotonic()
    got, errors = spawn._collect({0: _proc()}, _Results(), 0.2)
    assert time.monotonic() - t < 2
    assert got == {} and errors == ["timed out after 0.2s waiting for the workers"]


def test_reap_terminates_a_worker_still_running():
    log = []

    class P:
        def __init__(self, alive):
            self.alive = alive

        def join(self, timeout=None):
            log.append(("join", self.alive, timeout))

        def is_alive(self):
            return self.alive

        def terminate(self):
            log.append(("terminate", self.alive))
            self.alive = False

    spawn._reap([P(False), P(True)], 0.5)
    assert log == [("join", False, 0.5), ("join", True, 0.5), ("terminate", True),
                   ("join", False, None)]  # fmt: skip


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ret(rank, world, x):
    return (rank, world, x)


def _threads(rank, world):
    return torch.get_num_threads()


def _unpicklable(rank, world):
    return lambda: 0


def _exit(rank, world):
    raise SystemExit(4)


@pytest.fixture
def keep_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "fn, args, want",
    [
        (_ret, ("a",), (True, (0, 1, "a"))),
        (_threads, (), (True, 2)),
        (_unpicklable, (), (False, "pickle")),
        (_exit, (), (False, "SystemExit: 4")),
    ],
)
def test_worker_reports_everything_and_leaves_the_group(keep_threads, fn, args, want):
    results = queue.Queue()
    spawn._worker(fn, 0, 1, _free_port(), results, args, 2, 30.0)
    rank, ok, value = results.get_nowait()
    assert rank == 0 and ok == want[0] and results.empty()
    if ok:
        assert value == want[1]
    else:
        assert want[1] in value  # the traceback, picklable as a string
        pickle.dumps(value)
    assert not dist.is_initialized()


def test_worker_gives_the_group_the_collectives_timeout(monkeypatch):
    seen = []

    def init(backend, **kw):
        seen.append((backend, kw))
        raise ConnectionError("no rendezvous here")

    monkeypatch.setattr(spawn.dist, "init_process_group", init)
    saved = torch.get_num_threads()
    results = queue.Queue()
    try:
        spawn._worker(_ret, 1, 2, 1234, results, (), 1, 7.5)
    finally:
        torch.set_num_threads(saved)
    assert seen == [
        (
            "gloo",
            dict(init_method="tcp://127.0.0.1:1234", rank=1, world_size=2,
                 timeout=datetime.timedelta(seconds=7.5)),
        )
    ]  # fmt: skip
    rank, ok, value = results.get_nowait()
    assert rank == 1 and not ok and "no rendezvous here" in value


class _FakeCtx:
    """``mp.get_context("spawn")`` whose processes run ``fn`` at ``start`` (no gloo) and post
    their results to a LIFO queue: they arrive in reverse rank order."""

    def __init__(self):
        self.env_at_start = []

    def Queue(self):
        return queue.LifoQueue()

    def Process(self, target, args, daemon):
        ctx = self
        fn, rank, world, _, results, fargs = args[:6]

        class P:
            exitcode = None

            def start(self):
                ctx.env_at_start.append(os.environ.get("OMP_NUM_THREADS"))
                results.put((rank, True, fn(rank, world, *fargs)))
                self.exitcode = 0

            def join(self, timeout=None):
                pass

            def is_alive(self):
                return False

        return P()


@pytest.mark.parametrize("before", [None, "7"])
def test_run_gloo_sets_omp_threads_for_the_workers_only_and_keeps_rank_order(monkeypatch, before):
    ctx = _FakeCtx()
    monkeypatch.setattr(spawn.mp, "get_context", lambda how: ctx)
    if before is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", before)
    assert spawn.run_gloo(_ret, 3, "x", threads=2) == [(r, 3, "x") for r in range(3)]
    assert ctx.env_at_start == ["2", "2", "2"]
    assert os.environ.get("OMP_NUM_THREADS") == before


def test_gloo_rank0_world_of_one_restores_the_thread_count(keep_threads):
    torch.set_num_threads(1)
    with spawn.gloo_rank0(_ret, 1, threads=2) as others:
        assert dist.get_world_size() == 1 and torch.get_num_threads() == 2
    assert others == [] and torch.get_num_threads() == 1 and not dist.is_initialized()
    with pytest.raises(KeyError), spawn.gloo_rank0(_ret, 1):  # the block's own error, as is
        raise KeyError("mine")
    assert not dist.is_initialized()


_HELPER_CASES = [
    (None, None, 30.0, KeyError, None),  # silent: a short wait (not 30 s), the block's error
    ((1, False, "Traceback: boom"), None, 30.0, RuntimeError, "rank 1 ---\nTraceback: boom"),
    (None, 3, 0.5, RuntimeError, "rank 1 ---\nexited (exit code 3) without a result"),
]


@pytest.mark.parametrize("post, exitcode, timeout_s, want, text", _HELPER_CASES)
def test_gloo_rank0_blames_a_helper_only_when_it_failed(
    monkeypatch, post, exitcode, timeout_s, want, text
):
    """The block's own error is re-raised unless a helper failed; then the helper's failure,
    named by its rank (1, not its index among the helpers) and chained to the block's error."""
    monkeypatch.setattr(spawn.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(spawn.dist, "is_initialized", lambda: False)

    class Ctx(_FakeCtx):
        def Queue(self):
            return _Results(*[post] if post else [])

        def Process(self, target, args, daemon):
            return SimpleNamespace(start=lambda: None, join=lambda timeout=None: None,
                                   is_alive=lambda: False, exitcode=exitcode)  # fmt: skip

    monkeypatch.setattr(spawn.mp, "get_context", lambda how: Ctx())
    t = time.monotonic()
    with pytest.raises(want) as exc, spawn.gloo_rank0(_ret, 2, timeout_s=timeout_s):
        raise KeyError("mine")
    assert time.monotonic() - t < 10
    if text:
        assert text in str(exc.value) and isinstance(exc.value.__cause__, KeyError)


def test_gloo_rank0_returns_helpers_in_rank_order_and_names_a_gone_one(monkeypatch):
    monkeypatch.setattr(spawn.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(spawn.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(spawn.mp, "get_context", lambda how: _FakeCtx())  # LIFO: 2 before 1
    with spawn.gloo_rank0(_ret, 3, "x") as others:
        pass
    assert others == [(1, 3, "x"), (2, 3, "x")]

    class Gone(_FakeCtx):
        def Process(self, target, args, daemon):
            return SimpleNamespace(start=lambda: None, join=lambda timeout=None: None,
                                   is_alive=lambda: False, exitcode=3)  # fmt: skip

    monkeypatch.setattr(spawn.mp, "get_context", lambda how: Gone())
    with pytest.raises(RuntimeError, match="rank 1 ---\nexited .exit code 3. without a result"):
        with spawn.gloo_rank0(_ret, 2, timeout_s=0.5):
            pass


# ----------------------------------------------------------------------------- selfcheck
def test_verdict_passes_an_error_exactly_at_the_tolerance():
    """``truth`` zero: the floor is 64 fp32 epsilons (at scale 1, not 0); all values exact."""
    truth = torch.zeros(4, dtype=torch.float64)
    single = truth + 2.0**-10
    ring = truth + (2.0**-9 + 64 * 2.0**-23)
    ok, (err, ref_err, tol) = selfcheck.verdict(ring, single, truth, torch.float32)
    assert err == tol == 2.0**-9 + 2.0**-17 and ref_err == 2.0**-10 and ok
    assert not selfcheck.verdict(ring + 2.0**-30, single, truth, torch.float32)[0]


@pytest.fixture
def world_of_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    for name, val in env.items():
        monkeypatch.setenv(name, val)
    dist.init_process_group("gloo")
    yield
    dist.destroy_process_group()


def test_check_documents_median_and_ground_truth(world_of_one, monkeypatch):
    """At least three documents; the untimed warm-up (slow here) and one slow timed step do not
    make the median; the fp32 ground truth is float64 (bf16: float32)."""
    docs, wide = [], []
    build = selfcheck.RingPlan.build

    def spy_build(cu, *a, **kw):
        docs.append(cu.numel() - 1)
        return build(cu, *a, **kw)

    ring, calls = selfcheck.ring_varlen_attention, []

    def slow_ring(*a, **kw):
        calls.append(1)
        if len(calls) in (1, 4):  # the warm-up and the last of three timed steps
            time.sleep(0.2)
        return ring(*a, **kw)

    real_va = selfcheck.varlen_attention

    def spy_va(*a, **kw):
        if kw.get("backend") == "torch":
            wide.append(a[0].dtype)
        return real_va(*a, **kw)

    monkeypatch.setattr(selfcheck.RingPlan, "build", staticmethod(spy_build))
    monkeypatch.setattr(selfcheck, "ring_varlen_attention", slow_ring)
    monkeypatch.setattr(selfcheck, "varlen_attention", spy_va)
    kw = dict(total=48, heads=2, kv_heads=1, head_dim=8)
    res = selfcheck.check(1, dtype="fp32", iters=3, **kw)
    assert res["ok"] and len(calls) == 4 and res["ring_s"] < 0.1, res["ring_s"]
    assert docs == [3] and wide == [torch.float64]
    res = selfcheck.check(1, dtype="bf16", iters=1, **kw)
    assert res["ok"] and wide == [torch.float64, torch.float32]


def _fake_dist(monkeypatch, rank, every_ok):
    monkeypatch.setattr(selfcheck.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(selfcheck.dist, "destroy_process_group", lambda *a, **k: None)
    monkeypatch.setattr(selfcheck.dist, "get_world_size", lambda *a, **k: len(every_ok))
    monkeypatch.setattr(selfcheck.dist, "get_rank", lambda *a, **k: rank)
    errs = {n: (0.0, 0.0, 1.0) for n in ("out", "dq", "dk", "dv")}
    row = dict(ring_s=1e-3, local_len=8, balance=1.0, single_s=1e-3, out=0.0, dq=0.0, dk=0.0,
               dv=0.0, errors=errs)  # fmt: skip

    def gather(out, res):
        out[:] = [dict(row, ok=ok, ring_s=(i + 1) * 1e-3) for i, ok in enumerate(every_ok)]
        out[rank] = res

    monkeypatch.setattr(selfcheck.dist, "all_gather_object", gather)
    got = []
    monkeypatch.setattr(
        selfcheck, "check", lambda *a: got.append(a) or dict(row, ok=every_ok[rank])
    )
    return got


@pytest.mark.parametrize("rank", [0, 1])
def test_main_fails_every_rank_when_one_rank_failed(monkeypatch, capsys, rank):
    _fake_dist(monkeypatch, rank, [False, True])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert selfcheck.main([]) == 1
    out = capsys.readouterr().out
    if rank == 0:  # the slowest rank's time (rank 1: 2 ms)
        assert "ring fwd+bwd 2.0 ms (slowest rank)" in out
        assert out.rstrip().endswith("FAIL: ranks [0] exceed the tolerance")
    else:
        assert not out


def test_main_passes_its_defaults_on(monkeypatch, capsys):
    got = _fake_dist(monkeypatch, 0, [True, True])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert selfcheck.main([]) == 0 and capsys.readouterr().out.rstrip().endswith("PASS")
    assert got == [(2, 16384, 32, 8, 128, "bf16", "zigzag", "p2p", 5, True)]
    got.clear()
    assert selfcheck.main(["--no-reference", "--ring-size", "1", "--dtype", "fp32"]) == 0
    assert got == [(1, 16384, 32, 8, 128, "fp32", "zigzag", "p2p", 5, False)]


def test_main_picks_the_gpu_by_local_rank(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: seen.append(("device", i)))

    def init(backend, *a, **k):
        seen.append(("init", backend))
        raise KeyboardInterrupt  # stop before any collective

    monkeypatch.setattr(selfcheck.dist, "init_process_group", init)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("RANK", "5")
    with pytest.raises(KeyboardInterrupt):
        selfcheck.main([])
    assert seen == [("device", 3), ("init", "nccl")]
