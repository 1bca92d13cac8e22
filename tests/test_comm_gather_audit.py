"""Audit of the ring gather helpers, the group-wide argument check and the comm entry points.

The group-wide checks run on two threads playing ring ranks (a fake all_gather / all_reduce);
the stream entry points on an in-process gloo world of one; one test on two gloo processes.
"""

import math

import pytest
import torch
import torch.distributed as dist

from rlhf_kernels.ring import gather
from rlhf_kernels.ring.plan import RingPlan
from rlhf_kernels.ring.spawn import free_port, run_gloo


@pytest.fixture
def ring(thread_ring):
    return thread_ring


def _plan(cu=(0, 5, 9)):
    return RingPlan.build(list(cu), 2)


@pytest.mark.parametrize(
    "what",
    ["dtype", "trailing", "dst", "plan"],
)
def test_gather_check_raises_on_every_rank_when_ranks_disagree(ring, what):
    """Shards that differ beyond their values would make the gather's buffers differ in size
    (or its dst differ), so every rank raises first. Each fact is needed: dropping one from the
    fingerprint lets that disagreement through."""
    base = _plan()

    def call(rank):
        plan, local, dst = base, torch.zeros(base.local_len, 3), 0
        if rank == 1:
            if what == "dtype":
                local = local.double()
            elif what == "trailing":
                local = torch.zeros(base.local_len, 4)
            elif what == "dst":
                dst = 1
            else:  # the same local length, another layout of documents
                plan = _plan((0, 4, 9))
                assert plan.local_len == base.local_len
        return gather._check_gather(local, plan, None, dst)

    for r, got in enumerate(ring.run(call)):
        assert isinstance(got, ValueError) and "disagree" in str(got), (r, got)


def test_gather_check_passes_when_ranks_agree(ring):
    plan = _plan()
    got = ring.run(lambda r: gather._check_gather(torch.zeros(plan.local_len, 3), plan, None, 1))
    assert got == [0, 1]


def test_ring_token_mean_refuses_integer_values():
    # the mean of ints was cast back to int: 2/3 came back as 0 with no error
    for values in (torch.tensor([1, 1, 0]), torch.tensor([True, True, False])):
        with pytest.raises(TypeError, match="floating"):
            gather.ring_token_mean(values, torch.ones(3))
    mean = gather.ring_token_mean(torch.tensor([1.0, 1.0, 0.0]), torch.ones(3))
    assert mean.item() == pytest.approx(2 / 3)


def test_ring_token_mean_integer_values_on_one_rank_raise_on_every_rank(ring):
    def call(rank):
        values = torch.tensor([1, 2]) if rank == 1 else torch.tensor([1.0, 2.0])
        return gather.ring_token_mean(values, torch.ones(2))

    got = ring.run(call)
    assert isinstance(got[1], TypeError) and "floating" in str(got[1])
    assert isinstance(got[0], ValueError) and "other rank" in str(got[0])


def _conj_gather(rank, world):
    plan = RingPlan.build([0, 5, 12, 13], world)
    g = torch.Generator().manual_seed(rank)
    local = torch.randn(plan.local_len, 2, 2, generator=g).view(torch.complex64)[..., 0]
    res = {}
    for dst in (None, 1):
        want = gather.gather_from_ring(local.conj().resolve_conj(), plan, dst=dst)
        got = gather.gather_from_ring(local.conj(), plan, dst=dst)  # a conjugate view
        res[dst] = got is None if want is None else torch.equal(got, want)
    return res


@pytest.mark.multiproc
def test_gather_from_ring_takes_a_conjugate_view():
    # view_as_real refused the unresolved conjugate bit on every path ("doesn't work on
    # unresolved conjugated tensors"), and a rank alone with one left the others in the gather
    for res in run_gloo(_conj_gather, 2, timeout_s=120):
        assert res == {None: True, 1: True}, res


# ----------------------------------------------------------------- comm: a gloo world of one
@pytest.fixture
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_timeout_must_be_finite_and_fit_a_timedelta():
    from rlhf_kernels.comm.broadcast import _common_error, _timeout_ok

    for bad in (math.inf, 1e300, math.nan, 0, -1.0, True, "5"):
        assert not _timeout_ok(bad), bad
    for good in (None, 1e-3, 5, 3600.0, 1e9):
        assert _timeout_ok(good), good
    err = _common_error("x", 2, 0, 4096, math.inf)
    assert isinstance(err, ValueError) and "finite" in str(err)


def test_infinite_timeout_is_refused_at_call_time(world_of_one):
    # inf passed the check, then timedelta(seconds=inf) raised OverflowError on the first
    # next() of that rank alone (before the handshake: the other ranks waited for it)
    from rlhf_kernels.comm import broadcast_chunked, distributed_rollouts, scatter_for_ring

    with pytest.raises(ValueError, match=r"seconds > 0 \(finite\)"):
        broadcast_chunked([{"x": torch.ones(2)}], src=0, timeout=math.inf)
    with pytest.raises(ValueError, match=r"seconds > 0 \(finite\)"):
        scatter_for_ring([{"x": torch.ones(2)}], src=0, token_keys=["x"], timeout=math.inf)
    with pytest.raises(RuntimeError, match="timeout"):
        list(distributed_rollouts([1], lambda s: [{"x": torch.ones(2)}], timeout=math.inf))
    # the group is still in step
    got = list(broadcast_chunked([{"x": torch.ones(2)}], src=0, timeout=30))
    assert torch.equal(got[0][0]["x"], torch.ones(2))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_chunk_bytes=10), "max_chunk_bytes"),
        (dict(token_keys="ids"), "token_keys"),
        (dict(token_keys=["ids"], layout="striped"), "layout"),
    ],
)
def test_distributed_rollouts_refuses_stream_arguments_before_generating(
    world_of_one, kwargs, match
):
    # they were refused only by the stream, after every rank had run generate
    from rlhf_kernels.comm import distributed_rollouts

    calls = []

    def generate(share):
        calls.append(list(share))
        return [{"ids": torch.arange(3)} for _ in share]

    with pytest.raises(RuntimeError, match=match):
        list(distributed_rollouts([1, 2], generate, **kwargs))
    assert calls == []
    got = list(distributed_rollouts([1, 2], generate, token_keys=["ids"]))
    assert calls == [[1, 2]] and torch.equal(got[0][1]["ids"], torch.arange(3).repeat(2))


# --------------------------------------------------------------------------------- selfcheck
def test_selfcheck_refuses_ring_size_0_before_starting(monkeypatch, capsys):
    # "--ring-size 0" ran as one ring of the whole world (``0 or world``)
    from rlhf_kernels.ring import selfcheck

    def no_init(*_, **__):
        raise AssertionError("the process group must not be started for bad arguments")

    monkeypatch.setattr(selfcheck.dist, "init_process_group", no_init)
    with pytest.raises(SystemExit) as exc:
        selfcheck.main(["--ring-size", "0"])
    assert exc.value.code == 2 and "--ring-size must be >= 1" in capsys.readouterr().err


def test_selfcheck_refuses_an_empty_stream():
    from rlhf_kernels.ring.selfcheck import check

    with pytest.raises(ValueError, match="total must be >= 1"):
        check(ring_size=1, total=0)


def test_ring_validation_cache_keys_on_every_tensors_device():
    # a passed call is cached on the plan; the key held q's device only, so k on another
    # device skipped the checks and failed (on one rank only) inside the attention
    from rlhf_kernels.ring.attention import ring_varlen_attention

    plan = RingPlan.build(torch.tensor([0, 5, 12], dtype=torch.int32), 1)
    x = torch.randn(plan.local_len, 2, 8)
    ring_varlen_attention(x, x, x, plan)
    with pytest.raises(ValueError, match="device"):
        ring_varlen_attention(x, x.to("meta"), x, plan)
