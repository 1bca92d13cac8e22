"""broadcast_chunked / scatter_for_ring / distributed_rollouts on real gloo ranks.

One 3-rank spawn (``run_gloo``) runs every correctness case (each rank checks what it received
against samples it regenerates from the seed); three 2-rank spawns check that a dead or stalled
source, or a rank that never joins the handshake, makes the others raise instead of hang (they
break the group on purpose, so they use a harness whose workers skip the shutdown handshake).
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rlhf_kernels.comm import broadcast_chunked, distributed_rollouts, scatter_for_ring
from rlhf_kernels.comm._wire import META_LIMIT
from rlhf_kernels.ring.spawn import run_gloo

pytestmark = pytest.mark.multiproc

BUDGET = 16384  # a few small samples each (tensor bytes + ~1 kB of objects per tensor)
BIG = 9000  # fp32 elements of the oversize sample: 36 kB, over two budgets


# ----------------------------------------------------------------------------- harness
# for the cases that break the group on purpose (run_gloo shuts every worker down cleanly)
def _entry(fn, rank, world, store, queue, clean_exit):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        queue.put((rank, None, fn(rank, world)))
    except BaseException:
        queue.put((rank, traceback.format_exc(), None))
    queue.close()
    queue.join_thread()  # flush the result before a hard exit
    if clean_exit:
        dist.destroy_process_group()
    else:
        os._exit(0)  # the group may be broken on purpose: skip the shutdown handshake


def _spawn(fn, world, tmp_path, clean_exit=True, timeout=240):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = str(tmp_path / f"store-{fn.__name__}")
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, store, queue, clean_exit))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, err, res = queue.get(timeout=timeout)
            if err:
                errors.append(f"rank {rank}:\n{err}")
            results[rank] = res
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return results


# ----------------------------------------------------------------------------- samples
def _mixed_samples(seed: int, n: int) -> list[dict]:
    """Deterministic rollouts: every dtype of interest, 0-d, empty, non-contiguous, metadata."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(0, 47, (1,), generator=g))
        out.append(
            {
                "input_ids": torch.randint(-(2**40), 2**40, (length,), generator=g),
                "logp": torch.randn(length, generator=g),
                "hidden": torch.randn(length, 3, generator=g).bfloat16(),
                "mask": torch.rand(length, generator=g) > 0.5,
                "reward": torch.tensor(float(i) / 7),  # 0-d
                "empty": torch.empty(0, 5, dtype=torch.float16),
                "strided": torch.randn(6, 4, generator=g).t(),  # non-contiguous
                "id": i,
                "info": {"prompt": f"p{i // 3}", "tags": [i, None]},
            }
        )
        if i % 11 == 5:
            out[-1] = {"id": i, "note": "metadata only"}
    out.insert(13, {"id": -1, "big": torch.randn(BIG, generator=g), "small": torch.arange(5)})
    return out


def _same(a, b, where=""):
    assert type(a) is type(b), where
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert (
            torch.equal(
                a.reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)
            )
            if a.numel()
            else True
        ), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, where


def _tensor_bytes(sample):
    return sum(
        -(-v.numel() * v.element_size() // 16) * 16
        for v in sample.values()
        if isinstance(v, torch.Tensor)
    )


def _token_samples(seed: int, n: int, big_at: int | None = None, long: bool = False) -> list[dict]:
    """Short samples (one of them 701 tokens), or ``long`` ones (1600-2900 tokens: zigzag runs of
    267+ tokens on 3 ranks, so the source sends views of them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = [0, 1, 47, 31, 67, 2, 123][i % 7] if i != big_at else 701
        if long:
            length = 1601 + 97 * (i % 13)
        out.append(
            {
                "input_ids": torch.randint(0, 50_000, (length,), generator=g),
                "logp": torch.randn(length, generator=g),
                "hidden": torch.randn(length, 3, generator=g).bfloat16(),
                "id": i,
                "reward": torch.tensor(0.5 * i),
            }
        )
    return out


# ----------------------------------------------------------------------------- 3-rank cases
def _case_broadcast(rank, world):
    expected = _mixed_samples(seed=1, n=40)
    got, sizes = [], []
    src_samples = expected if rank == 1 else None
    for mb in broadcast_chunked(src_samples, src=1, max_chunk_bytes=BUDGET):
        sizes.append(len(mb))
        # a micro-batch fits the budget, or is one oversize sample
        assert len(mb) == 1 or sum(map(_tensor_bytes, mb)) <= BUDGET
        got.extend(mb)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        _same(a, b, f"sample {i}")
    assert max(sizes) > 1  # several samples share a micro-batch
    return sizes


def _case_source_raises(rank, world):
    def failing():
        for i, s in enumerate(_mixed_samples(seed=2, n=30)):
            if i == 17:
                raise ValueError("generation failed at sample 17")
            yield s

    got = []
    stream = broadcast_chunked(failing() if rank == 0 else None, src=0, max_chunk_bytes=BUDGET)
    with pytest.raises(ValueError if rank == 0 else RuntimeError, match="sample 17"):
        for mb in stream:
            got.extend(s["id"] for s in mb)
    # everything before the failure arrived, on every rank
    assert got == [s["id"] for s in _mixed_samples(seed=2, n=30)[:17]]
    return got


def _case_bad_arguments(rank, world):
    chunk = BUDGET if rank != 2 else 2 * BUDGET
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        list(
            broadcast_chunked(
                [{"x": torch.ones(3)}] if rank == 0 else None, src=0, max_chunk_bytes=chunk
            )
        )
    samples = [{"x": torch.ones(3)}]  # wrongly given on every rank, not only the source
    with pytest.raises(ValueError, match="samples must be None|invalid arguments"):
        list(broadcast_chunked(samples, src=0, max_chunk_bytes=BUDGET))
    keys = ["input_ids", "logp"] if rank != 1 else ["input_ids"]
    with pytest.raises(ValueError, match="token_keys") as err:
        list(
            scatter_for_ring(
                _token_samples(3, 4) if rank == 0 else None,
                src=0,
                token_keys=keys,
                max_chunk_bytes=BUDGET,
            )
        )
    # the keys themselves, per rank (not their CRCs)
    assert "1: \"('input_ids',)\"" in str(err.value), str(err.value)
    assert "0: \"('input_ids', 'logp')\"" in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="allow_early_stop"):
        list(
            broadcast_chunked(
                [{"x": torch.ones(3)}] if rank == 0 else None, src=0, allow_early_stop=rank == 1
            )
        )
    # an invalid argument on the last rank only: it raises its own error, every other rank
    # raises too (the bad rank joins their handshake) instead of waiting there until the timeout
    last = rank == world - 1
    others = rf"rank\(s\) \[{world - 1}\] of the group were called with invalid arguments"
    for kwargs, own in (
        ({"max_chunk_bytes": 512 if last else BUDGET}, "max_chunk_bytes must be an int"),
        ({"src": world if last else 0}, "src must be a rank"),
        ({"timeout": -1.0 if last else None}, "timeout must be None or seconds"),
    ):
        with pytest.raises(ValueError, match=own if last else others):
            kwargs = {"src": 0, "max_chunk_bytes": BUDGET, **kwargs}
            list(broadcast_chunked([{"x": torch.ones(3)}] if rank == 0 else None, **kwargs))
    samples = _token_samples(3, 4) if rank == 0 else None
    for kwargs, err, own in (
        ({"layout": "zz" if last else "zigzag"}, ValueError, "layout must be one of"),
        ({"token_keys": "input_ids" if last else ["input_ids"]}, TypeError, "sequence of keys"),
    ):
        with pytest.raises(err if last else ValueError, match=own if last else others):
            list(scatter_for_ring(samples, src=0, **{"token_keys": ["input_ids"], **kwargs}))
    with pytest.raises(ValueError, match="max_chunk_bytes"):
        broadcast_chunked(None, src=0, max_chunk_bytes=10)  # on every rank
    with pytest.raises(ValueError, match="src"):
        broadcast_chunked(None, src=3)
    with pytest.raises(ValueError, match="layout"):
        scatter_for_ring(None, src=0, token_keys=["a"], layout="ring")


def _case_views(rank, world):
    """Conjugate and negative views split over several pieces arrive resolved; a meta tensor is
    refused before anything is sent (every rank raises)."""
    z = torch.complex(torch.arange(2000.0), torch.arange(2000.0) + 0.5)  # 16 kB: 4 pieces
    sample = {"conj": z.conj(), "neg": z.conj().imag, "small": z[:8].conj()}
    got = list(broadcast_chunked([sample] if rank == 0 else None, src=0, max_chunk_bytes=BUDGET))
    assert [len(mb) for mb in got] == [1]
    for key, want in sample.items():
        assert torch.equal(got[0][0][key].resolve_conj().resolve_neg(), want.resolve_conj()), key
    meta = [{"x": torch.empty(3000, device="meta")}] if rank == 0 else None
    with pytest.raises(TypeError if rank == 0 else RuntimeError, match="meta tensor"):
        list(broadcast_chunked(meta, src=0, max_chunk_bytes=BUDGET))


def _case_source_stops_early(rank, world):
    expected = _mixed_samples(seed=4, n=40)
    out = {}
    for allow in (True, False):
        stream = broadcast_chunked(
            expected if rank == 2 else None, src=2, max_chunk_bytes=BUDGET, allow_early_stop=allow
        )
        got = []
        if rank == 2 or allow:
            for mb in stream:
                got.append([s["id"] for s in mb])
                if rank == 2 and len(got) == 3:
                    stream.close()  # the source's trainer stops: receivers end at the same point
                    break
        else:  # not opted in: an early stop is an error on the receivers
            with pytest.raises(RuntimeError, match="stopped the stream early, after 3 micro"):
                for mb in stream:
                    got.append([s["id"] for s in mb])
        assert len(got) == 3
        out[allow] = got
    assert out[True] == out[False]
    return out[True]


def _case_source_loop_raises(rank, world):
    """The source's own loop body fails after 3 micro-batches: receivers must not mistake the
    dropped generator for the end of the rollout."""
    samples = _mixed_samples(seed=7, n=40) if rank == 0 else None
    got = []

    def consume():
        for mb in broadcast_chunked(samples, src=0, max_chunk_bytes=BUDGET):
            got.append([s["id"] for s in mb])
            if rank == 0 and len(got) == 3:
                raise KeyError("trainer step failed on the source")

    match = "trainer step" if rank == 0 else "source rank 0 stopped the stream early, after 3"
    with pytest.raises(KeyError if rank == 0 else RuntimeError, match=match):
        consume()
    assert len(got) == 3
    return got


def _case_metadata_heavy(rank, world):
    """~18 MB of per-sample text (over META_LIMIT in one header) under the default budget, and
    metadata-only samples under a small budget: both must stream in several micro-batches."""
    n, width = 6000, 3000
    assert n * width > META_LIMIT
    text = [{"id": i, "text": f"{i:>{width}}", "e": torch.empty(0)} for i in range(n)]
    sizes = []
    for mb in broadcast_chunked(text if rank == 0 else None, src=0):
        assert [s["id"] for s in mb] == list(range(sum(sizes), sum(sizes) + len(mb)))
        assert all(s["text"] == f"{s['id']:>{width}}" and s["e"].shape == (0,) for s in mb)
        sizes.append(len(mb))
    assert sum(sizes) == n and len(sizes) >= 3
    meta_only = [
        {"id": i, "info": {"prompt": "x" * 100, "tags": list(range(20))}} for i in range(200)
    ]
    counts = [
        len(mb)
        for mb in broadcast_chunked(meta_only if rank == 1 else None, src=1, max_chunk_bytes=BUDGET)
    ]
    assert sum(counts) == 200 and len(counts) > 1  # metadata counts toward the budget
    return sizes, counts


def _failing_generate(prompts):
    if dist.get_rank() == 1:
        raise MemoryError("vllm OOM on rank 1")
    return list(_generate(prompts))


def _case_generate_raises(rank, world):
    """generate fails on rank 1 only: every rank raises with rank 1's message (nobody waits in
    a collective), and the group stays usable."""
    with pytest.raises(
        RuntimeError, match=r"rank\(s\) \[1\].*MemoryError: vllm OOM on rank 1"
    ) as e:
        list(distributed_rollouts(list(range(6)), _failing_generate, timeout=30))
    assert (rank == 1) == isinstance(e.value.__cause__, MemoryError)
    dist.barrier()


def _check_shards(rank, world, plan, local, meta, expected, keys):
    batch = [expected[m["id"]] for m in meta]
    packed = {k: torch.cat([s[k] for s in batch]) for k in keys}
    assert list(plan.cu_seqlens) == [0, *torch.tensor([len(s["logp"]) for s in batch]).cumsum(0)]
    for k in keys:
        _same(local[k], plan.shard(packed[k], rank), k)
        # the shards of all ranks add up exactly to the packed micro-batch
        shards = [None] * world
        dist.all_gather_object(shards, local[k])
        _same(plan.unshard(shards), packed[k], f"unshard {k}")
    for m in meta:
        assert m["reward"] == torch.tensor(0.5 * m["id"]) and "logp" not in m


def _case_scatter(rank, world):
    keys = ["input_ids", "logp", "hidden"]
    out = {}
    # short samples (packed on the source), long ones (sent from views of their runs)
    for layout, long, budget in (
        ("zigzag", False, BUDGET),
        ("contiguous", False, BUDGET),
        ("zigzag", True, 24 * BUDGET),
        ("contiguous", True, 24 * BUDGET),
    ):
        expected = _token_samples(seed=5, n=29, big_at=9, long=long)
        ids, got_bytes, full_bytes, sizes = [], 0, 0, []
        src_samples = expected if rank == 0 else None
        stream = scatter_for_ring(
            src_samples, src=0, token_keys=keys, layout=layout, max_chunk_bytes=budget
        )
        for plan, local, meta in stream:
            sizes.append(len(meta))
            assert plan.layout == layout and plan.world_size == world
            _check_shards(rank, world, plan, local, meta, expected, keys)
            ids.extend(m["id"] for m in meta)
            got_bytes += sum(t.numel() * t.element_size() for t in local.values())
            full_bytes += sum(
                expected[m["id"]][k].numel() * expected[m["id"]][k].element_size()
                for m in meta
                for k in keys
            )
        assert ids == list(range(29))
        assert max(sizes) > 1
        # about 1/world of the token bytes (plus zigzag pads)
        assert got_bytes < 0.5 * full_bytes
        out[layout, long] = (got_bytes, full_bytes)
    return out


@pytest.mark.parametrize("value", [1000, -129, float("inf"), float("nan"), 2.5])
def test_pad_value_outside_an_integer_key_is_named(value):
    from rlhf_kernels.comm.broadcast import _check_specs

    with pytest.raises(ValueError, match=r"pad_values\['ids'\]=.* does not fit 'ids'"):
        _check_specs("scatter_for_ring", [("ids", torch.int8, ())], [], {"ids": value})
    _check_specs("scatter_for_ring", [("ids", torch.int8, ())], [], {"ids": -128})


def test_default_pad_values():
    """-100 only for signed integer label-like keys; a bool or uint8 mask named like a label
    pads with 0 (it was filled with -100 cast: True / 156, so pads counted as tokens)."""
    from rlhf_kernels.comm.broadcast import pad_value

    for dtype in (torch.int64, torch.int32, torch.int8):
        assert pad_value("labels", dtype, {}) == -100
    for dtype in (torch.bool, torch.uint8, torch.float32, torch.bfloat16, torch.complex64):
        assert pad_value("target_mask", dtype, {}) == 0, dtype
    assert pad_value("input_ids", torch.int64, {}) == 0
    assert pad_value("label_mask", torch.bool, {"label_mask": 1}) == 1


def _case_scatter_pad_values(rank, world):
    """Pad slots: -100 for label-like integer keys by default, 0 otherwise, overridable."""
    samples = _token_samples(seed=8, n=10)
    for smp in samples:
        smp["labels"] = smp["input_ids"].clone()
    pads_seen = 0
    for layout in ("zigzag", "contiguous"):
        stream = scatter_for_ring(
            samples if rank == 0 else None, src=0, token_keys=["input_ids", "labels", "logp"],
            layout=layout, max_chunk_bytes=BUDGET, pad_values={"logp": -1.5},
        )  # fmt: skip
        for plan, local, meta in stream:
            valid = plan.valid_mask(rank)
            batch = [samples[m["id"]] for m in meta]
            for key, pad in (("input_ids", 0), ("labels", -100), ("logp", -1.5)):
                want = plan.shard(torch.cat([b[key] for b in batch]), rank)
                _same(local[key][valid], want[valid], key)
                assert (local[key][~valid] == pad).all(), key
            pads_seen += int((~valid).sum())
    return pads_seen


def _case_scatter_bad_sample(rank, world):
    samples = _token_samples(seed=6, n=12)
    samples[8]["logp"] = samples[8]["logp"][:-1]  # lengths disagree inside one sample
    got = []
    stream = scatter_for_ring(
        samples if rank == 1 else None,
        src=1,
        token_keys=["input_ids", "logp"],
        max_chunk_bytes=BUDGET,
    )
    with pytest.raises(ValueError if rank == 1 else RuntimeError, match="same length"):
        for _, _, meta in stream:
            got.extend(m["id"] for m in meta)
    return got


def _generate(prompts):
    """Per-prompt deterministic rollouts: 3 samples per prompt."""
    for p in prompts:
        for j in range(3):
            g = torch.Generator().manual_seed(1000 * p + j)
            length = int(torch.randint(1, 60, (1,), generator=g))
            yield {
                "input_ids": torch.randint(0, 100, (length,), generator=g),
                "logp": torch.randn(length, generator=g),
                "prompt": p,
                "j": j,
            }


def _case_distributed(rank, world):
    prompts = list(range(10))
    everything = list(_generate(prompts))  # what one rank generating alone produces
    got = [s for mb in distributed_rollouts(prompts, _generate, max_chunk_bytes=BUDGET) for s in mb]
    assert len(got) == len(everything)
    for a, b in zip(got, everything):
        _same(a, b)
    keys = ["input_ids", "logp"]
    ids = []
    for plan, local, meta in distributed_rollouts(
        prompts, _generate, token_keys=keys, max_chunk_bytes=BUDGET, timeout=60
    ):
        by_id = {(s["prompt"], s["j"]): s for s in everything}
        ids.extend((m["prompt"], m["j"]) for m in meta)
        batch = [by_id[(m["prompt"], m["j"])] for m in meta]
        for k in keys:
            _same(local[k], plan.shard(torch.cat([s[k] for s in batch]), rank), k)
    assert ids == [(s["prompt"], s["j"]) for s in everything]


def _case_review_fixes(rank, world):
    """From review: per-sample views, mixed APIs, pad_values, dtypes across micro-batches,
    distributed_rollouts' prompt counts and timeout."""
    out = {}
    # a per-sample view (rewards[i]) travelled with its whole base tensor, once per sample
    rewards = torch.randn(20_000)
    samples = [{"input_ids": torch.ones(3, dtype=torch.long), "r": rewards[i]} for i in range(60)]
    nbytes, n_batches = set(), 0
    for _, _, meta in scatter_for_ring(
        samples if rank == 0 else None, src=0, token_keys=["input_ids"], max_chunk_bytes=BUDGET
    ):
        n_batches += 1
        nbytes |= {m["r"].untyped_storage().nbytes() for m in meta}
    out["view_nbytes"], out["view_batches"] = nbytes, n_batches
    # one rank in broadcast_chunked, the others in scatter_for_ring: the same error everywhere
    with pytest.raises(ValueError, match="every rank must pass the same kind"):
        if rank == 0:
            list(broadcast_chunked([{"x": torch.ones(3)}], src=0))
        else:
            list(scatter_for_ring(None, src=0, token_keys=["x"]))
    # a misspelt pad_values key on one rank: its own error there, every rank raises
    toks = _token_samples(seed=3, n=4)
    with pytest.raises(ValueError, match="not one of the token_keys|invalid arguments"):
        list(
            scatter_for_ring(
                toks if rank == 0 else None, src=0, token_keys=["input_ids"],
                pad_values={"input_id": -1} if rank == 1 else None,
            )
        )  # fmt: skip
    # a fractional pad for an integer key: the source refuses before sending
    with pytest.raises(ValueError if rank == 0 else RuntimeError, match="does not fit"):
        list(
            scatter_for_ring(
                toks if rank == 0 else None, src=0, token_keys=["input_ids"],
                pad_values={"input_ids": 2.7},
            )
        )  # fmt: skip
    # a pad outside the key's integer range: refused before sending (was torch's overflow error
    # on every rank after every micro-batch had travelled)
    small = [{"input_ids": torch.ones(5, dtype=torch.int8)} for _ in range(2)]
    with pytest.raises(ValueError if rank == 0 else RuntimeError, match=r"\[-128, 127\]"):
        list(
            scatter_for_ring(
                small if rank == 0 else None, src=0, token_keys=["input_ids"],
                pad_values={"input_ids": 1000},
            )
        )  # fmt: skip
    # int64 ids, then int32 ids in a later micro-batch
    mixed = [{"input_ids": torch.ones(400, dtype=torch.long)} for _ in range(6)]
    mixed += [{"input_ids": torch.ones(400, dtype=torch.int32)} for _ in range(6)]
    with pytest.raises(ValueError if rank == 0 else RuntimeError, match="keep one dtype"):
        list(
            scatter_for_ring(
                mixed if rank == 0 else None, src=0, token_keys=["input_ids"],
                max_chunk_bytes=4096,  # one sample per micro-batch
            )
        )  # fmt: skip
    # distributed_rollouts: prompt lists of different lengths lost a share silently
    prompts = list(range(4 if rank == 0 else 6))
    with pytest.raises(ValueError, match="same prompts"):
        list(distributed_rollouts(prompts, _generate))
    with pytest.raises(RuntimeError, match="timeout must be a number"):
        list(distributed_rollouts([1, 2], _generate, timeout=-1 if rank == 1 else 30))
    # prompts without a length on one rank: every rank hears it at once (the others used to
    # wait for the timeout)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[0\]: rank 0: TypeError"):
        list(distributed_rollouts(iter([1, 2]) if rank == 0 else [1, 2], _generate, timeout=60))
    out["iterator_s"] = time.perf_counter() - t0
    return out


def _all_cases(rank, world):
    out = {}
    for case in (
        _case_broadcast,
        _case_source_raises,
        _case_bad_arguments,
        _case_views,
        _case_source_stops_early,
        _case_source_loop_raises,
        _case_metadata_heavy,
        _case_generate_raises,
        _case_scatter,
        _case_scatter_pad_values,
        _case_scatter_bad_sample,
        _case_distributed,
        _case_review_fixes,
    ):
        out[case.__name__] = case(rank, world)
    return out


def test_three_ranks_all_cases():
    res = run_gloo(_all_cases, 3, timeout_s=240)
    # micro-batch boundaries and delivered samples agree across ranks
    for name in (
        "_case_broadcast",
        "_case_source_raises",
        "_case_source_stops_early",
        "_case_source_loop_raises",
        "_case_scatter_bad_sample",
    ):
        assert res[0][name] == res[1][name] == res[2][name], name
    assert res[0]["_case_scatter_bad_sample"] == list(range(8))
    assert sum(res[r]["_case_scatter_pad_values"] for r in range(3)) > 0  # pads were checked
    for r in range(3):  # a per-sample view travels as one element (it was 80 kB each)
        assert res[r]["_case_review_fixes"]["view_nbytes"] == {4}, res[r]["_case_review_fixes"]
        assert res[r]["_case_review_fixes"]["iterator_s"] < 30  # not the 60 s timeout
    # each rank receives ~1/3 of the token bytes; together ~all of them (pads only)
    for key in res[0]["_case_scatter"]:
        full = res[0]["_case_scatter"][key][1]
        total = sum(res[r]["_case_scatter"][key][0] for r in range(3))
        assert full <= total < 1.3 * full


# ----------------------------------------------------------------------------- failures
def _source_dies(rank, world):
    def dying():
        for i in range(100):
            if i == 20:
                os._exit(3)  # the source process crashes mid-stream
            yield {"x": torch.randn(500), "id": i}

    got = []
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        for mb in broadcast_chunked(dying() if rank == 0 else None, src=0, max_chunk_bytes=BUDGET):
            got.extend(s["id"] for s in mb)
    return time.monotonic() - start, got


def test_source_death_raises_on_receivers(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    store = str(tmp_path / "store")
    procs = [
        ctx.Process(target=_entry, args=(_source_dies, r, 2, store, queue, False)) for r in range(2)
    ]
    for p in procs:
        p.start()
    rank, err, res = queue.get(timeout=120)  # only the receiver reports
    for p in procs:
        p.join(30)
    assert rank == 1 and err is None, err
    elapsed, got = res
    assert elapsed < 30 and got == list(range(len(got))) and len(got) < 20
    assert procs[0].exitcode == 3


def _source_stalls(rank, world):
    def slow():
        for i in range(10):
            if i == 4:
                time.sleep(4)
            yield {"x": torch.randn(500), "id": i}

    got = []
    with pytest.raises(RuntimeError, match="timeout|closed|reset"):
        # the receiver gives up after 0.5 s and exits; the source then sees a closed peer
        for mb in broadcast_chunked(
            slow() if rank == 0 else None,
            src=0,
            max_chunk_bytes=BUDGET,
            timeout=0.5 if rank == 1 else None,
        ):
            got.extend(s["id"] for s in mb)
    return got


def test_stalled_source_times_out(tmp_path):
    res = _spawn(_source_stalls, 2, tmp_path, clean_exit=False)
    assert res[1] == res[0][: len(res[1])]


def _rank_never_joins(rank, world):
    """Rank 1 never starts the stream (e.g. it failed before it, process alive): the handshake
    on rank 0 must honour ``timeout``."""
    if rank == 1:
        time.sleep(6)
        return None
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="handshake did not finish within"):
        list(broadcast_chunked([{"x": torch.ones(3)}], src=0, timeout=1.0))
    return time.monotonic() - start


def test_handshake_honours_timeout(tmp_path):
    res = _spawn(_rank_never_joins, 2, tmp_path, clean_exit=False)
    assert res[0] < 4, res[0]


def test_wait_names_a_dead_peer_instead_of_a_timeout():
    """Every failed wait read "did not finish within ... (timeout)", also when a peer had died
    0.2 s in."""
    from rlhf_kernels.comm import _wire

    class Work:
        def __init__(self, message):
            self.message = message

        def wait(self, timeout=None):
            raise RuntimeError(self.message)

    with pytest.raises(RuntimeError, match=r"x failed \(.*closed by peer.*\): a rank left"):
        _wire.wait(Work("Connection closed by peer [127.0.0.1]:1"), timedelta(seconds=5), "x")
    with pytest.raises(RuntimeError, match="x did not finish within 0:00:05 .timeout."):
        _wire.wait(Work("Timed out waiting 5000ms for recv"), timedelta(seconds=5), "x")


# ----------------------------------------------------------------------------- review B
def _ids(stream, got, scatter=False):
    for item in stream:
        got.append([m["id"] for m in item[2]] if scatter else [s["id"] for s in item])


def _fail_slot_at(n):
    """Make the n-th staging-buffer request of this process raise (a simulated OOM)."""
    from rlhf_kernels.comm import _stream

    orig, calls = _stream.Sender._slot, [0]

    def slot(self, need):
        calls[0] += 1
        if calls[0] == n:
            raise torch.OutOfMemoryError("simulated staging OOM")
        return orig(self, need)

    _stream.Sender._slot = slot
    return lambda: setattr(_stream.Sender, "_slot", orig)


def _still_in_step(rank):
    """A stream after a failed one works: the failure left the group in step."""
    small = [{"x": torch.full((3,), float(i)), "id": i} for i in range(5)]
    got = [s["id"] for mb in broadcast_chunked(small if rank == 0 else None, src=0, timeout=5)
           for s in mb]  # fmt: skip
    assert got == list(range(5)), got


def _case_send_fails(rank, world):
    """An error raised while the source sends a micro-batch (after its header went out) reached
    no receiver: they waited for the timeout and read "stalled". Now it travels in a header at
    once, no rank yields the failed micro-batch, and the group stays in step."""
    out = {}
    # broadcast: a 1000-element sample spans 4 pieces; the 2nd of them fails, 1 is in flight
    samples = [{"x": torch.randn(n), "id": i} for i, n in enumerate([100, 100, 1000, 100])]
    undo = _fail_slot_at(3) if rank == 0 else (lambda: None)
    got, t0 = [], time.monotonic()
    stream = broadcast_chunked(
        samples if rank == 0 else None, src=0, max_chunk_bytes=1024, timeout=5
    )
    with pytest.raises(
        torch.OutOfMemoryError if rank == 0 else RuntimeError, match="simulated staging OOM"
    ):
        _ids(stream, got)
    undo()
    out["bcast"], out["bcast_s"] = got, time.monotonic() - t0
    _still_in_step(rank)
    # scatter_for_ring, views path (one long sample per micro-batch): fails inside a shard
    long = [{"x": torch.randn(3000), "id": i} for i in range(3)]
    undo = _fail_slot_at(4) if rank == 0 else (lambda: None)
    got, t0 = [], time.monotonic()
    stream = scatter_for_ring(
        long if rank == 0 else None, src=0, token_keys=["x"], max_chunk_bytes=8192, timeout=5
    )
    with pytest.raises(
        torch.OutOfMemoryError if rank == 0 else RuntimeError, match="simulated staging OOM"
    ):
        _ids(stream, got, scatter=True)
    undo()
    out["scatter"], out["scatter_s"] = got, time.monotonic() - t0
    _still_in_step(rank)
    # scatter_for_ring, packed path: plan.shard of float8 ids for the other rank raises
    # (index_fill has no float8 kernel) before any byte of that rank's shard is sent
    lengths = [2, 2, 1, 2, 3, 2, 2, 2, 2, 2, 3, 1, 3, 1, 2, 1, 1, 3, 2, 3, 1]  # pads on rank 0 only
    fp8 = [{"x": torch.ones(n).to(torch.float8_e4m3fn), "id": i} for i, n in enumerate(lengths)]
    got, t0 = [], time.monotonic()
    stream = scatter_for_ring(
        fp8 if rank == 1 else None, src=1, token_keys=["x"], max_chunk_bytes=1 << 16, timeout=5
    )
    try:
        _ids(stream, got, scatter=True)
        out["fp8"] = "sent"  # a torch with the kernel: nothing to check
    except (NotImplementedError, RuntimeError) as exc:
        out["fp8"] = f"{type(exc).__name__}: {exc}"
    out["fp8_s"] = time.monotonic() - t0
    _still_in_step(rank)
    return out


def _case_float_pads(rank, world):
    """A float pad that overflows its key's float16 passed the checks, then every rank raised
    in the pad fill, the source's ABORT left unmatched: the group was out of step."""
    samples = [{"logp": torch.randn(n).half(), "id": i} for i, n in enumerate([301, 7, 291])]
    with pytest.raises(ValueError if rank == 0 else RuntimeError, match=r"\[-65504.0, 65504.0\]"):
        list(
            scatter_for_ring(
                samples if rank == 0 else None, src=0, token_keys=["logp"],
                max_chunk_bytes=1024, pad_values={"logp": -1e9}, timeout=5,
            )
        )  # fmt: skip
    _still_in_step(rank)
    fills = 0
    for plan, local, _ in scatter_for_ring(
        samples if rank == 0 else None, src=0, token_keys=["logp"], max_chunk_bytes=1024,
        pad_values={"logp": float("-inf")}, timeout=5,
    ):  # fmt: skip
        assert (local["logp"][~plan.valid_mask(rank)] == float("-inf")).all()
        fills += int((~plan.valid_mask(rank)).sum())
    return fills


def _case_nested_views(rank, world):
    """A per-sample view nested in metadata pickled its whole base, once per sample (and in
    broadcast_chunked even a top-level one inside a list)."""
    rewards = torch.randn(20_000, generator=torch.Generator().manual_seed(0))
    samples = [
        {"ids": torch.ones(4, dtype=torch.long), "info": {"r": rewards[i], "l": [rewards[i]]}}
        for i in range(6)
    ]
    out = []
    for mb in broadcast_chunked(samples if rank == 0 else None, src=0, timeout=5):
        out += [(s["info"]["r"], s["info"]["l"][0]) for s in mb]
    for _, _, meta in scatter_for_ring(
        samples if rank == 0 else None, src=0, token_keys=["ids"], timeout=5
    ):
        out += [(m["info"]["r"], m["info"]["l"][0]) for m in meta]
    assert len(out) == 12
    for i, pair in enumerate(out):
        for t in pair:
            assert torch.equal(t, rewards[i % 6]), i
    if rank != 0:
        return sorted({t.untyped_storage().nbytes() for pair in out for t in pair})
    return [4]


def _case_closing(rank, world):
    """The documented way to stop early: close the stream (contextlib.closing), also when the
    loop body raises while the caller still holds the stream."""
    import contextlib

    samples = [{"x": torch.randn(300), "id": i} for i in range(10)] if rank == 0 else None
    got, t0 = [], time.monotonic()
    with pytest.raises(KeyError if rank == 0 else RuntimeError, match="trainer|stopped the"):
        with contextlib.closing(
            broadcast_chunked(samples, src=0, max_chunk_bytes=2048, timeout=5)
        ) as stream:
            for mb in stream:
                got.append([s["id"] for s in mb])
                if rank == 0 and len(got) == 2:
                    raise KeyError("trainer step failed on the source")
    return got, time.monotonic() - t0


def _run_case(rank, world, name):
    return globals()[name](rank, world)


def test_send_failure_reaches_receivers_at_once():
    send = run_gloo(_run_case, 2, "_case_send_fails", timeout_s=120)
    # one sample per micro-batch (400 bytes + ~1.3 kB of objects each, 1024-byte budget); the
    # failed micro-batch: on none
    assert send[0]["bcast"] == send[1]["bcast"] == [[0], [1]]
    assert send[0]["scatter"] == send[1]["scatter"] == [[0]]
    assert send[1]["bcast_s"] < 4 and send[1]["scatter_s"] < 4  # not the 5 s timeout
    if not send[1]["fp8"].startswith("sent"):  # the receiver has the source's own message
        assert "source rank 1 failed while sending" in send[0]["fp8"], send[0]["fp8"]
        assert "float8" in send[0]["fp8"].lower() and send[0]["fp8_s"] < 4, send[0]


def test_float_pad_that_overflows_is_refused_and_group_stays_in_step():
    assert sum(run_gloo(_run_case, 2, "_case_float_pads", timeout_s=120)) > 0


def test_views_nested_in_metadata_travel_alone():
    res = run_gloo(_run_case, 2, "_case_nested_views", timeout_s=120)
    assert res[1] == [4], res[1]  # one float each, not 80 kB


def test_closing_the_stream_stops_the_receivers():
    res = run_gloo(_run_case, 2, "_case_closing", timeout_s=120)
    assert res[0][0] == res[1][0] == [[0], [1]]
    assert res[1][1] < 4


@pytest.mark.parametrize(
    "dtype, value, ok",
    [
        (torch.float16, -1e9, False),
        (torch.float16, 65504.5, False),
        (torch.bfloat16, 1e39, False),
        (torch.float32, 10**40, False),  # an int over the max
        (torch.complex32, 1e6, False),
        (torch.float8_e4m3fn, 1.0, False),  # no masked_fill kernel: only the default 0
        (torch.uint16, 3, False),
        (torch.float16, -65504, True),
        (torch.float16, float("-inf"), True),
        (torch.float16, float("nan"), True),
        (torch.bfloat16, -1e30, True),
        (torch.float8_e4m3fn, 0, True),
    ],
)
def test_pad_value_must_fit_a_floating_key(dtype, value, ok):
    from rlhf_kernels.comm.broadcast import _check_specs

    check = lambda: _check_specs("scatter_for_ring", [("k", dtype, ())], [], {"k": value})  # noqa: E731
    if ok:
        check()
    else:
        with pytest.raises(ValueError, match=r"pad_values\['k'\]=.*'k''s"):
            check()


def _case_count_objects(rank, world):
    """The budget counts ~1.3 kB of objects per 1-tensor sample by default; count_objects=False
    counts tensor and metadata bytes only (micro-batches as a token budget)."""
    samples = [{"x": torch.full((100,), float(i))} for i in range(12)]
    out = {}
    for flag in (True, False):
        sizes = []
        stream = broadcast_chunked(
            samples if rank == 0 else None, src=0, max_chunk_bytes=2048, count_objects=flag
        )
        for mb in stream:
            sizes.append(len(mb))
        plans = []
        stream = scatter_for_ring(
            samples if rank == 0 else None, src=0, token_keys=["x"], max_chunk_bytes=2048,
            count_objects=flag,
        )  # fmt: skip
        for plan, _, _ in stream:
            plans.append(len(plan.cu_seqlens) - 1)
        out[flag] = (sizes, plans)
    return out


def test_count_objects_false_budgets_bytes_only():
    res = run_gloo(_run_case, 2, "_case_count_objects", timeout_s=120)
    assert res[0] == res[1]
    (bc_obj, sc_obj), (bc_bytes, sc_bytes) = res[0][True], res[0][False]
    assert bc_obj == [1] * 12 and sc_obj == [1] * 12  # 400 bytes + objects: alone in 2 kB
    assert sum(bc_bytes) == sum(sc_bytes) == 12
    assert max(bc_bytes) >= 4 and max(sc_bytes) >= 4  # 4-5 samples of 400 bytes per 2 kB
