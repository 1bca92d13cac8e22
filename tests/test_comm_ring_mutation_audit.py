"""Mutation audit of the ring plan, gather / validate helpers and the comm streams.

Each test pins a behaviour that a small mutation of the code (an off-by-one, a dropped check, a
dropped argument) changed without any other test failing.
"""

import pytest
import torch

from rlhf_kernels.ring.plan import RingPlan


# ----------------------------------------------------------------------------- gloo, 3 ranks
def _subgroup_gather(rank, world):
    import torch.distributed as dist

    from rlhf_kernels.ring.gather import gather_from_ring

    sub = dist.new_group([1, 2])
    if rank == 0:
        return None
    plan = RingPlan.build([0, 5, 9], 2)
    full = torch.arange(9.0).view(9, 1) * 10
    local = plan.shard(full, dist.get_rank(sub))
    got = gather_from_ring(local, plan, group=sub, dst=1)  # group rank 1 = global rank 2
    # complex values travel as real pairs (gloo has no complex): the dst gets complex back
    z = torch.complex(full, -full)
    got_z = gather_from_ring(plan.shard(z, dist.get_rank(sub)), plan, group=sub, dst=1)
    if got is None:
        return None, got_z
    return got.tolist(), (got_z.dtype, tuple(got_z.shape), torch.equal(got_z, z))


@pytest.mark.multiproc
def test_gather_to_a_dst_of_a_subgroup_maps_ranks_and_keeps_complex_values():
    from rlhf_kernels.ring.spawn import run_gloo

    res = run_gloo(_subgroup_gather, 3, timeout_s=60)
    assert res[1] == (None, None), res
    assert res[2][0] == (torch.arange(9.0).view(9, 1) * 10).tolist(), res
    assert res[2][1] == (torch.complex64, (9, 1), True), res


# ----------------------------------------------------------------------------- two thread ranks
_OPTIONS = dict(
    comm="p2p", window_size=(-1, -1), softcap=0.0, kv_head_stride=None, tile=64, causal=True,
    softmax_scale=None,
)  # fmt: skip
# what rank 1 passes differently; every one is a fact the group-wide check compares
_DIFFERENT = {
    "causal": dict(causal=False),
    "window": dict(window_size=(3, 0)),
    "softcap": dict(softcap=5.0),
    "comm": dict(comm="allgather"),
    "kv_head_stride": dict(kv_head_stride=1),
    "tile": dict(tile=32),
    "softmax_scale": dict(softmax_scale=0.5),
    "dtype": dict(dtype=torch.float64),
    "q_heads": dict(q_heads=2),
    "kv_heads": dict(kv_heads=1),
}


@pytest.mark.parametrize("what", sorted(_DIFFERENT))
def test_ring_call_check_catches_every_option_the_ranks_disagree_on(thread_ring, what):
    """Ranks that pass different options (each valid alone) would run different attentions (or
    mismatched collectives): every rank raises. Each option is one fact of the check."""
    from rlhf_kernels.ring.validate import validate_ring_call

    def call(rank):
        plan = RingPlan.build([0, 5, 9], 2)  # a fresh plan per rank, as separate processes
        opts = dict(_OPTIONS, dtype=torch.float32, q_heads=4, kv_heads=2)
        if rank == 1:
            opts.update(_DIFFERENT[what])
        dtype, hq, hk = opts.pop("dtype"), opts.pop("q_heads"), opts.pop("kv_heads")
        q = torch.zeros(plan.local_len, hq, 8, dtype=dtype)
        k = torch.zeros(plan.local_len, hk, 8, dtype=dtype)
        validate_ring_call(
            q, k, k, plan, None, 2, opts["comm"], opts["window_size"], opts["softcap"],
            opts["kv_head_stride"], opts["tile"], opts["causal"], opts["softmax_scale"],
        )  # fmt: skip
        return "passed"

    for r, got in enumerate(thread_ring.run(call)):
        assert isinstance(got, ValueError) and "disagree" in str(got), (what, r, got)


def test_ring_call_check_passes_when_ranks_agree(thread_ring):
    from rlhf_kernels.ring.validate import validate_ring_call

    def call(rank):
        plan = RingPlan.build([0, 5, 9], 2)
        q = torch.zeros(plan.local_len, 4, 8)
        k = torch.zeros(plan.local_len, 2, 8)
        validate_ring_call(q, k, k, plan, None, 2, "p2p", (3, 0), 1.0, 1, 32, True, 0.5)
        return "passed"

    assert thread_ring.run(call) == ["passed", "passed"]


def test_a_passed_call_does_not_let_a_bad_softmax_scale_skip_the_check():
    """The 'validated' memo of a plan is keyed by every option, softmax_scale included: a call
    with a NaN scale after a good one with the same plan and tensors still raises."""
    from rlhf_kernels.ring.validate import validate_ring_call

    plan = RingPlan.build([0, 5, 9], 1)
    q = torch.zeros(plan.local_len, 2, 8)
    args = (q, q, q, plan, None, 1, "p2p", (-1, -1), 0.0, None, 64, True)
    validate_ring_call(*args, None)
    validate_ring_call(*args, 0.5)
    with pytest.raises(ValueError, match="softmax_scale"):
        validate_ring_call(*args, float("nan"))


# ----------------------------------------------------------------------------- gloo world of one
@pytest.fixture
def world_of_one():
    import torch.distributed as dist

    from rlhf_kernels.ring.spawn import free_port

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("token_keys", [None, ("ids",)])
def test_distributed_rollouts_passes_count_objects_on(world_of_one, token_keys):
    """``count_objects=False`` budgets bytes only: 12 samples of 128 token bytes fit a few
    1 KiB micro-batches, not one per sample as with the objects counted (it was dropped on the
    way to the stream, silently giving ~10x more micro-batches)."""
    from rlhf_kernels.comm import distributed_rollouts

    def generate(share):
        return [{"ids": torch.full((16,), int(p), dtype=torch.int64)} for p in share]

    def sizes(count_objects):
        out = []
        stream = distributed_rollouts(
            list(range(12)), generate, token_keys=token_keys, max_chunk_bytes=1024,
            count_objects=count_objects,
        )  # fmt: skip
        for item in stream:
            out.append(len(item) if token_keys is None else len(item[0].cu_seqlens) - 1)
        return out

    counted, bytes_only = sizes(True), sizes(False)
    assert sum(counted) == sum(bytes_only) == 12
    assert counted == [1] * 12
    assert len(bytes_only) <= 4, bytes_only


def test_scatter_refuses_a_dtype_change_inside_one_micro_batch(world_of_one):
    """Sample 1 of a micro-batch with another dtype than sample 0 is refused by name (its bytes
    would not match the shard stream the receivers size from sample 0's dtype); it is not
    silently promoted by the concatenation."""
    from rlhf_kernels.comm import scatter_for_ring

    samples = [
        {"ids": torch.arange(5, dtype=torch.int64)},
        {"ids": torch.arange(5, dtype=torch.int32)},
    ]
    with pytest.raises(ValueError, match="like the first sample"):
        for _ in scatter_for_ring(samples, src=0, token_keys=["ids"], max_chunk_bytes=1 << 20):
            pass


# ----------------------------------------------------------------------------- RingPlan
def test_unshard_refuses_row_and_packed_shards_mixed():
    """Only when every shard is a ``(1, local_len, ...)`` row is the HF layout assumed: a
    packed shard ``(local_len, local_len, ...)`` among rows is refused, not read as a row (its
    first token's values would be taken for the rank's whole shard)."""
    plan = RingPlan.build([0, 5, 9], 2)
    n = plan.local_len
    x = torch.randn(plan.total, n, 2)
    shards = [plan.shard(x, r) for r in range(2)]  # (n, n, 2) each
    assert torch.equal(plan.unshard(shards), x)
    assert torch.equal(plan.unshard([s[None] for s in shards]), x[None])
    with pytest.raises(ValueError, match=r"shards\[0\] must have shape"):
        plan.unshard([shards[0][None], shards[1]])


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [(0, 0), (0, 2), (2, 0), (0, -1), (-1, 0), (1, 1)])
def test_attention_work_with_a_zero_window_side(layout, causal, window):
    """A window side of 0 (a query sees itself only on that side) is a bound, not "unbounded":
    the closed form matches a brute-force count of the visible (query, key) pairs."""
    lengths = [7, 1, 4]
    cu = [0, 7, 8, 12]
    plan = RingPlan.build(cu, 2, layout)
    left, right = window
    want = torch.zeros(2, dtype=torch.int64)
    for r in range(2):
        for d, p in zip(plan.doc[r].tolist(), plan.pos[r].tolist()):
            if d < 0:
                continue
            hi = p if causal else (lengths[d] - 1 if right < 0 else min(p + right, lengths[d] - 1))
            lo = 0 if left < 0 else max(p - left, 0)
            want[r] += hi - lo + 1
    assert torch.equal(plan.attention_work(causal=causal, window_size=window), want)


def test_target_keys_pad_with_the_ignore_index():
    """Signed integer keys named like labels *or targets* pad with -100 by default."""
    from rlhf_kernels.comm.broadcast import pad_value

    assert pad_value("targets", torch.int64, {}) == -100
    assert pad_value("next_target_ids", torch.int32, {}) == -100
    assert pad_value("targets", torch.float32, {}) == 0
    assert pad_value("targets", torch.uint8, {}) == 0


def test_a_bad_call_with_new_options_joins_the_group_check():
    """After a passed call, a rank with a bad tensor raises alone only for options that passed
    before (the others skip the check then); with new options the others check too, so it must
    join them (the group-wide error, not the "earlier calls" shortcut)."""
    from rlhf_kernels.ring.validate import validate_ring_call

    plan = RingPlan.build([0, 5, 9], 1)
    q = torch.zeros(plan.local_len, 2, 8)
    bad = torch.zeros(plan.local_len + 1, 2, 8)
    opts = ("p2p", (-1, -1), 0.0, None, 64)
    validate_ring_call(q, q, q, plan, None, 1, *opts, True)
    with pytest.raises(ValueError, match="earlier calls"):
        validate_ring_call(bad, bad, bad, plan, None, 1, *opts, True)
    with pytest.raises(ValueError, match="local_len") as err:
        validate_ring_call(bad, bad, bad, plan, None, 1, *opts, False)
    assert "earlier calls" not in str(err.value)


def test_scatter_refuses_a_repeated_token_key(world_of_one):
    from rlhf_kernels.comm import scatter_for_ring

    samples = [{"ids": torch.arange(5)}]
    with pytest.raises(ValueError, match="non-empty and unique"):
        scatter_for_ring(samples, src=0, token_keys=["ids", "ids"])
    got = list(scatter_for_ring(samples, src=0, token_keys=["ids"]))
    assert len(got) == 1 and torch.equal(got[0][1]["ids"], torch.arange(5))


def test_distributed_rollouts_passes_the_layout_on(world_of_one):
    from rlhf_kernels.comm import distributed_rollouts

    def generate(share):
        return [{"ids": torch.arange(3 + int(p))} for p in share]

    for layout in ("contiguous", "zigzag"):
        got = list(distributed_rollouts([0, 1], generate, token_keys=["ids"], layout=layout))
        assert [plan.layout for plan, _, _ in got] == [layout], layout
        assert torch.equal(got[0][1]["ids"], torch.cat([torch.arange(3), torch.arange(4)]))
