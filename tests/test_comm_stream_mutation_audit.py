"""Mutation audit of the chunked streams (``broadcast_chunked``, ``scatter_for_ring``) and their
wire, protocol, staging and memory helpers.

The streams run end to end on three threads playing ranks of one process: a fake
``torch.distributed`` (collectives matched by call order, point-to-point by (src, dst) order,
a transfer done once every side posted it) stands in for gloo, so each test takes milliseconds.
Each test pins a behaviour that a small mutation (an off-by-one in a chunk bound, a swapped
destination, a dropped header field, a wrong status) changed without any faster test failing.

Pinned: bit-identical delivery and piece sizes of both streams (3 ranks, zigzag and contiguous,
view and packed paths); the partial micro-batch before a source error; FAILED / ABORT dropping
the in-flight micro-batch and the micro-batch counts in the receivers' errors; filler that
completes every owed rank exactly once after a failed scatter send; the inclusive limits
(``META_BUDGET``, ``META_LIMIT``, ``ERROR_TEXT``, ``HANDSHAKE_FIELDS``); staging buffers reused
when full; receive blocks not pinned by empty tensors and sized for zigzag pads; the scatter
budget's cu and object terms; receivers' samples and ``allow_early_stop`` checked on every rank;
and ``_memory``'s KiB parsing, HWM reset and baseline.
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
import torch.distributed as dist
from conftest import run_on_threads

from rlhf_kernels.comm import _protocol, _stream, _wire
from rlhf_kernels.comm.broadcast import broadcast_chunked, scatter_for_ring
from rlhf_kernels.ring.plan import RingPlan


# ----------------------------------------------------------------------------- fake dist
class _Work:
    def __init__(self):
        self.event, self.error = threading.Event(), None

    def done(self, error=None):
        self.error = error
        self.event.set()

    def is_completed(self):
        return self.event.is_set()

    def wait(self, timeout=None):
        secs = 10.0 if timeout is None else timeout.total_seconds()
        if not self.event.wait(secs):
            raise RuntimeError("fake transfer timed out")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True


class _FakeDist:
    """Threads as ranks: ``broadcast`` / ``all_gather`` / ``isend`` / ``irecv`` between them."""

    def __init__(self, world):
        self.world, self.local, self.lock = world, threading.local(), threading.Lock()
        self.coll, self.p2p, self.closed = {}, {}, False
        self.log = []  # (kind, src, dst, nbytes) of every payload-sized transfer, in post order

    @property
    def rank(self):
        return self.local.rank

    def _next(self, key):
        counts = self.local.counts
        counts[key] = counts.get(key, -1) + 1
        return counts[key]

    def _collective(self, op, tensor, extra):
        if self.closed:
            raise RuntimeError("fake group closed")
        seq = self._next("coll")
        work = _Work()
        with self.lock:
            entry = self.coll.setdefault(seq, {})
            entry[self.rank] = (op, tensor, extra, work)
            if len(entry) < self.world:
                return work
            del self.coll[seq]
        ops = {v[0] for v in entry.values()}
        error = None if len(ops) == 1 else f"mismatched collectives {ops}"
        if error is None and op == "broadcast":
            src = {v[2] for v in entry.values()}
            if len(src) != 1:
                error = f"mismatched broadcast src {src}"
            else:
                data = entry[src.pop()][1]
                for _, t, _, _ in entry.values():
                    if t.shape != data.shape or t.dtype != data.dtype:
                        error = f"broadcast size mismatch {tuple(t.shape)} {tuple(data.shape)}"
                        break
                else:
                    for _, t, _, _ in entry.values():
                        if t is not data:
                            t.copy_(data)
        elif error is None:  # all_gather
            if len({tuple(v[1].shape) for v in entry.values()}) > 1:
                error = "all_gather of mismatched sizes"
            else:
                for r in range(self.world):
                    for _, _, out, _ in entry.values():
                        out[r].copy_(entry[r][1])
        for v in entry.values():
            v[3].done(error)
        return work

    def broadcast(self, tensor, src, group=None, async_op=False):
        if self.rank == src:
            self.log.append(("bcast", src, None, tensor.numel() * tensor.element_size()))
        work = self._collective("broadcast", tensor, src)
        return work if async_op else work.wait()

    def all_gather(self, out, tensor, group=None, async_op=False):
        work = self._collective("all_gather", tensor, out)
        return work if async_op else work.wait()

    def _p2p(self, src, dst, side, tensor):
        if self.closed:
            raise RuntimeError("fake group closed")
        seq = self._next(("p2p", src, dst))
        work = _Work()
        with self.lock:
            entry = self.p2p.setdefault((src, dst, seq), {})
            entry[side] = (tensor, work)
            if len(entry) < 2:
                return work
            del self.p2p[(src, dst, seq)]
        (sent, w1), (into, w2) = entry["send"], entry["recv"]
        error = None
        if sent.numel() != into.numel() or sent.dtype != into.dtype:
            error = f"p2p size mismatch {sent.numel()} -> {into.numel()}"
        else:
            into.copy_(sent)
        w1.done(error)
        w2.done(error)
        return work

    def isend(self, tensor, dst, group=None):
        self.log.append(("send", self.rank, dst, tensor.numel() * tensor.element_size()))
        return self._p2p(self.rank, dst, "send", tensor)

    def irecv(self, tensor, src, group=None):
        return self._p2p(src, self.rank, "recv", tensor)

    def run(self, fn):
        def start(rank):
            self.local.rank, self.local.counts = rank, {}

        return run_on_threads(self.world, fn, start)


def _fake(monkeypatch, world):
    fake = _FakeDist(world)
    for name in ("broadcast", "all_gather", "isend", "irecv"):
        monkeypatch.setattr(dist, name, getattr(fake, name))
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: fake.rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: fake.world)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "get_global_rank", lambda group, r: r)
    return fake


@pytest.fixture
def ring3(monkeypatch):
    fake = _fake(monkeypatch, 3)
    yield fake
    fake.closed = True  # streams left open by a failing test end here, not on a real group
    gc.collect()


@pytest.fixture
def ring2(monkeypatch):
    fake = _fake(monkeypatch, 2)
    yield fake
    fake.closed = True
    gc.collect()


def _mixed(n=12):
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        z = torch.complex(
            torch.randn(5 + i, generator=g).double(), torch.randn(5 + i, generator=g).double()
        )
        out.append(
            {
                "ids": torch.randint(0, 1000, (17 + 13 * i,), generator=g),
                "mask": torch.rand(7 + i, generator=g) > 0.5,
                "z": z.conj() if i % 2 else z,
                "h": torch.randn(3, 9 + i, generator=g).bfloat16().t(),
                "r": torch.tensor(float(i)),
                "e": torch.empty(0, 3),
                "u8": torch.randint(0, 255, (i + 1,), dtype=torch.uint8, generator=g),
                "text": f"sample {i}",
            }
        )
    return out


def _bits(t):
    t = t.resolve_conj().resolve_neg().contiguous()
    return (t.dtype, tuple(t.shape), t.reshape(-1).view(torch.uint8).tolist() if t.numel() else [])


def _snap(batches):
    return [
        [{k: _bits(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in b]
        for b in batches
    ]


@pytest.mark.parametrize("chunk", [1024, 1500, 4096])
def test_broadcast_delivers_every_micro_batch_bit_identical_on_every_rank(ring3, chunk):
    samples = _mixed()

    def call(rank):
        stream = broadcast_chunked(samples if rank == 1 else None, src=1, max_chunk_bytes=chunk)
        return _snap(list(stream))

    out = ring3.run(call)
    assert not any(isinstance(o, Exception) for o in out), out
    assert out[0] == out[1] == out[2]
    assert sum(len(b) for b in out[0]) == len(samples)
    piece = _stream.piece_size(chunk)
    sizes = [n for kind, *_, n in ring3.log if kind == "bcast" and n > 48]
    assert sizes and max(sizes) <= piece


def _token_samples(lengths, seed=2):
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(1, 1000, (n,), generator=g),
            "labels": torch.randint(1, 1000, (n,), generator=g),
            "h": torch.randn(n, 3, generator=g),
            "reward": float(i),
        }
        for i, n in enumerate(lengths)
    ]


def _expected_shards(batches, rank, world, layout, keys):
    out = []
    for batch in batches:
        cu = [0]
        for s in batch:
            cu.append(cu[-1] + s[keys[0]].shape[0])
        plan = RingPlan.build(cu, world, layout)
        local = {}
        for k in keys:
            t = plan.shard(torch.cat([s[k] for s in batch]), rank)
            if k == "labels":
                pads = ~plan.valid_mask(rank)
                t = t.masked_fill(pads.view(-1, *[1] * (t.dim() - 1)), -100)
            local[k] = t
        out.append((cu, local, [{"reward": s["reward"]} for s in batch]))
    return out


# long samples stream from views of their runs; many short ones are packed first
@pytest.mark.parametrize("lengths", [[700, 45, 1300, 3], [5, 9, 3, 11, 7, 2, 13] * 5])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_scatter_sends_each_rank_exactly_its_shard(ring3, lengths, layout):
    samples, keys = _token_samples(lengths), ("input_ids", "labels", "h")
    chunk = 6000

    def call(rank):
        stream = scatter_for_ring(
            samples if rank == 0 else None, src=0, token_keys=keys, layout=layout,
            max_chunk_bytes=chunk,
        )  # fmt: skip
        got = []
        for plan, local, meta in stream:
            got.append((list(plan.cu_seqlens), {k: _bits(v) for k, v in local.items()}, meta))
        return got

    out = ring3.run(call)
    assert not any(isinstance(o, Exception) for o in out), out
    batches, pos = [], 0
    for cu, _, _ in out[0]:
        batches.append(samples[pos : pos + len(cu) - 1])
        pos += len(cu) - 1
    assert pos == len(samples) and len(batches) > 1
    for rank in range(3):
        want = _expected_shards(batches, rank, 3, layout, keys)
        assert len(out[rank]) == len(want)
        for (cu, local, meta), (wcu, wlocal, wmeta) in zip(out[rank], want):
            assert cu == wcu and meta == wmeta
            assert local == {k: _bits(v) for k, v in wlocal.items()}, rank
    piece = _stream.piece_size(max(chunk // 3, _wire.MIN_CHUNK_BYTES))
    assert max(n for kind, *_, n in ring3.log if kind == "send") <= piece


def _numbered(n, size=300):
    return [{"x": torch.full((size,), float(i)), "i": i} for i in range(n)]


def _ids(batches):
    return [[s["i"] for s in b] for b in batches]


def _collect(stream, got):
    for batch in stream:
        got.append([s["i"] for s in batch])


def test_source_error_delivers_the_samples_before_it_then_raises_everywhere(ring3):
    """The samples pulled before the source's iterable raised still reach every rank (the
    partial micro-batch included), then every rank raises with the source's message."""

    def gen():
        yield from _numbered(5)
        raise ValueError("generation broke")

    def call(rank):
        got = []
        stream = broadcast_chunked(gen() if rank == 0 else None, src=0, max_chunk_bytes=4096)
        with pytest.raises((ValueError, RuntimeError), match="generation broke"):
            _collect(stream, got)
        return got

    out = ring3.run(call)
    assert out[0] == out[1] == out[2], out
    assert sum(out[0], []) == [0, 1, 2, 3, 4] and len(out[0]) > 1


def _fail_slot(monkeypatch, call_no):
    real, calls = _stream.Sender._slot, [0]

    def slot(self, need):
        calls[0] += 1
        if calls[0] == call_no:
            raise MemoryError("no staging memory")
        return real(self, need)

    monkeypatch.setattr(_stream.Sender, "_slot", slot)


def test_a_failed_send_drops_that_micro_batch_on_every_rank(ring3, monkeypatch):
    """Sending micro-batch 2 fails on the source: every rank yields micro-batches 0 and 1 only
    (never the filler of 2) and the receivers name the micro-batch that failed."""
    _fail_slot(monkeypatch, 3)  # one piece per micro-batch: the third is micro-batch 2's

    def call(rank):
        got = []
        stream = broadcast_chunked(
            _numbered(6) if rank == 0 else None, src=0, max_chunk_bytes=2048, count_objects=False
        )
        with pytest.raises((MemoryError, RuntimeError), match="no staging memory") as info:
            _collect(stream, got)
        return got, str(info.value)

    out = ring3.run(call)
    assert [o[0] for o in out] == [[[0], [1]]] * 3, out
    for rank in (1, 2):
        assert "while sending micro-batch 2" in out[rank][1], out[rank][1]


@pytest.mark.parametrize("early", [False, True])
def test_an_early_close_stops_every_rank_at_the_same_micro_batch(ring3, early):
    def call(rank):
        got = []
        stream = broadcast_chunked(
            _numbered(6) if rank == 0 else None, src=0, max_chunk_bytes=2048,
            count_objects=False, allow_early_stop=early,
        )  # fmt: skip
        if rank == 0:
            for batch in stream:
                got.append([s["i"] for s in batch])
                if len(got) == 2:
                    stream.close()
                    break
            return got, None
        try:
            _collect(stream, got)
        except RuntimeError as exc:
            return got, str(exc)
        return got, None

    out = ring3.run(call)
    assert [o[0] for o in out] == [[[0], [1]]] * 3, out
    for rank in (1, 2):
        if early:
            assert out[rank][1] is None
        else:
            assert "stopped the stream early, after 2 micro-batch(es)" in out[rank][1]


# ----------------------------------------------------------------------------- exact limits
def test_a_sample_with_metadata_of_exactly_the_budget_is_accepted():
    budget = lambda s, i: 0  # noqa: E731
    fits = list(_wire.micro_batches([{}], budget, 1024, lambda s: _wire.META_BUDGET))
    assert fits == [[{}]]
    with pytest.raises(ValueError, match="non-tensor fields"):
        list(_wire.micro_batches([{}], budget, 1024, lambda s: _wire.META_BUDGET + 1))


def test_a_description_of_exactly_the_meta_limit_is_accepted():
    import pickle

    probe = 1 << 20
    overhead = len(pickle.dumps(b"x" * probe, protocol=pickle.HIGHEST_PROTOCOL)) - probe
    blob = b"x" * (_wire.META_LIMIT - overhead)
    assert len(_wire.dumps_meta(blob, "t")) == _wire.META_LIMIT
    with pytest.raises(ValueError, match="over the"):
        _wire.dumps_meta(blob + b"x", "t")


def test_an_error_message_of_exactly_the_limit_is_not_cut():
    exc = ValueError("m" * (_protocol.ERROR_TEXT - len("ValueError: ")))
    assert _protocol._error_text(exc) == f"ValueError: {exc}"
    longer = _protocol._error_text(ValueError("m" * _protocol.ERROR_TEXT))
    assert longer.endswith(" ... (cut)") and len(longer) == _protocol.ERROR_TEXT + 10


def test_the_handshake_takes_exactly_its_field_count(ring2):
    fields = {f"f{i}": i for i in range(_wire.HANDSHAKE_FIELDS)}

    def call(rank, fields=fields):
        _wire.handshake(fields, None, group=None, device=torch.device("cpu"), who="t")
        return "ok"

    assert ring2.run(call) == ["ok", "ok"]
    with pytest.raises(ValueError, match="at most"):
        _wire.handshake(dict(fields, extra=1), None, group=None, device=None, who="t")


# ----------------------------------------------------------------------------- staging, pool
class _Done:
    def wait(self, timeout=None):
        return True


def test_full_staging_buffers_are_reused_not_reallocated():
    """In steady state (every piece full) the two staging buffers are the same tensors from
    piece to piece and from stream to stream: no allocation per piece."""
    sender = _stream.Sender(1024, torch.device("cpu"))
    t = torch.arange(8192, dtype=torch.uint8)
    sender.send([t], [0], 8192, [lambda buf: _Done()])
    bufs = list(sender.bufs)
    assert all(b is not None and b.numel() == 1024 for b in bufs)
    sender.send([t], [0], 8192, [lambda buf: _Done()])
    assert all(a is b for a, b in zip(bufs, sender.bufs))


def test_a_kept_empty_tensor_does_not_pin_a_receive_block():
    """A received empty tensor owns no bytes of the block: keeping it (a receiver keeps an
    empty field) leaves the block free for the next micro-batch."""
    pool = _stream.RecvPool(256, torch.device("cpu"))
    flat = pool.take(64)
    kept = _stream.view_tensor(flat, 16, torch.complex128, (0, 3))
    assert kept.shape == (0, 3) and kept.dtype == torch.complex128
    ptr = flat.data_ptr()
    del flat
    again = pool.take(64)
    assert again.data_ptr() == ptr and len(pool.blocks) == 1


def test_scatter_receives_a_padded_shard_into_a_pool_block(ring3, monkeypatch):
    """Zigzag pads make a shard longer than 1/world of a micro-batch within the budget: the
    receive blocks leave room for them, so such a shard (11 tokens of 520 bytes: 4 slots, 2080
    bytes; pieces of 2048) is still received into a recycled block, not a fresh buffer."""
    served = []

    class Pool(_stream.RecvPool):
        def take(self, total):
            flat = super().take(total)
            ptrs = {b.untyped_storage().data_ptr() for b in self.blocks}
            served.append((total, flat.untyped_storage().data_ptr() in ptrs))
            return flat

    monkeypatch.setattr(_stream, "RecvPool", Pool)
    samples = [{"ids": torch.full((11, 130), i, dtype=torch.int32)} for i in range(3)]

    def call(rank):
        stream = scatter_for_ring(
            samples if rank == 0 else None, src=0, token_keys=["ids"], max_chunk_bytes=6144,
            count_objects=False,
        )  # fmt: skip
        return [(plan.local_len, local["ids"].clone()) for plan, local, _ in stream]

    out = ring3.run(call)
    assert not any(isinstance(o, Exception) for o in out), out
    assert [n for n, _ in out[1]] == [4, 4, 4]
    assert served == [(2080, True)] * 6, served


# ----------------------------------------------------------------------------- _memory
def test_rss_bytes_reads_kib_fields_and_0_for_a_missing_one():
    from rlhf_kernels.comm._memory import rss_bytes

    with open("/proc/self/status") as f:
        kib = {ln.split(":")[0]: int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:")}
    assert rss_bytes("VmHWM") >= kib["VmHWM"] * 1024 > 0
    assert rss_bytes("VmHWM") % 1024 == 0 and rss_bytes("NoSuchField") == 0


def test_peak_rss_counts_a_short_peak_above_the_start_only():
    """A 64 MiB buffer allocated and freed between two samples still counts (the kernel's
    high-water mark, reset at start), and nothing from before the start does (neither the
    resident baseline nor an earlier, larger peak)."""
    from rlhf_kernels.comm._memory import PeakRSS

    big = torch.ones(48 << 20, dtype=torch.uint8)  # an earlier peak: 48 MiB, freed
    del big
    probe = PeakRSS(interval_s=0.2)
    if not probe.hwm:
        probe.stop()
        pytest.skip("/proc/self/clear_refs is not writable: the peak is only sampled")
    idle = probe.stop()
    assert idle < 16 << 20, idle
    probe = PeakRSS(interval_s=0.2)
    buf = torch.ones(64 << 20, dtype=torch.uint8)
    del buf
    peak = probe.stop()
    assert 60 << 20 <= peak < 100 << 20, peak


# ----------------------------------------------------------------------------- scatter failures
@pytest.mark.parametrize("where", ["first_rank_send", "second_rank_send", "second_rank_views"])
def test_a_failed_scatter_send_keeps_every_rank_in_step(ring3, monkeypatch, where):
    """Micro-batch 1 fails on the source while sending to rank 1 or rank 2 (packing a piece, or
    cutting the rank's views): every rank's transfers are completed exactly once with filler,
    so all ranks yield micro-batch 0 only and the receivers raise with the source's message."""
    from rlhf_kernels.comm import broadcast

    if where == "second_rank_views":
        real, calls = broadcast._run_pieces, [0]

        def run_pieces(plan, rank, *args):
            calls[0] += 1
            if calls[0] > 3 and rank == 2:  # micro-batch 1 (own shard first, one key)
                raise MemoryError("no staging memory")
            return real(plan, rank, *args)

        monkeypatch.setattr(broadcast, "_run_pieces", run_pieces)
    else:  # one piece per rank per micro-batch: slot calls 3 and 4 are micro-batch 1's
        _fail_slot(monkeypatch, 3 if where == "first_rank_send" else 4)
    samples = [{"ids": torch.arange(300) + 1000 * i, "i": i} for i in range(4)]

    def call(rank):
        got = []
        stream = scatter_for_ring(
            samples if rank == 0 else None, src=0, token_keys=["ids"], max_chunk_bytes=3000,
            count_objects=False, timeout=5,
        )  # fmt: skip
        with pytest.raises((MemoryError, RuntimeError), match="no staging memory") as info:
            for _, local, meta in stream:
                got.append(([m["i"] for m in meta], local["ids"].tolist()))
        return got, str(info.value)

    out = ring3.run(call)
    plan = RingPlan.build([0, 300], 3)
    for rank in range(3):
        got, msg = out[rank]
        assert got == [([0], plan.shard(samples[0]["ids"], rank).tolist())], (rank, got)
        if rank:
            assert "while sending micro-batch 1" in msg, msg


@pytest.mark.parametrize("objects", [False, True])
@pytest.mark.parametrize("spare", [0, -1])
def test_scatter_budget_counts_each_samples_cu_entry_and_objects_exactly(ring2, objects, spare):
    """A sample of scatter_for_ring costs its aligned token bytes, its pickled metadata and
    16 bytes (its cu_seqlens entry), plus ``_SAMPLE_OBJ_BYTES`` and the plan's per-document
    tables with ``count_objects``: two samples fit a budget of exactly twice that, not one
    byte less."""
    from rlhf_kernels.comm import broadcast

    per = 128 * 8 + _wire.meta_nbytes({}) + 16
    if objects:
        # the plan's run tables and lists: ~128 bytes per rank + 384 per document
        per += broadcast._SAMPLE_OBJ_BYTES + (128 * 2 + 384) - 16
    samples = [{"ids": torch.arange(128)} for _ in range(2)]

    def call(rank):
        stream = scatter_for_ring(
            samples if rank == 0 else None, src=0, token_keys=["ids"],
            max_chunk_bytes=2 * per + spare, count_objects=objects,
        )  # fmt: skip
        return [len(meta) for _, _, meta in stream]

    assert ring2.run(call) == [[2] if spare == 0 else [1, 1]] * 2


# ----------------------------------------------------------------------------- argument checks
def test_samples_on_a_receiver_are_refused_on_every_rank(ring3):
    def call(rank):
        stream = broadcast_chunked(_numbered(2) if rank in (0, 2) else None, src=0)
        return list(stream)

    out = ring3.run(call)
    assert isinstance(out[2], ValueError) and "must be None on rank 2" in str(out[2]), out
    for rank in (0, 1):
        assert isinstance(out[rank], ValueError) and "rank(s) [2]" in str(out[rank]), out


@pytest.mark.parametrize("scatter", [False, True])
def test_ranks_that_disagree_on_allow_early_stop_all_raise(ring3, scatter):
    def call(rank):
        kw = dict(src=0, allow_early_stop=rank == 1)
        samples = _numbered(2) if rank == 0 else None
        if scatter:
            return list(scatter_for_ring(samples, token_keys=["x"], **kw))
        return list(broadcast_chunked(samples, **kw))

    out = ring3.run(call)
    for o in out:
        assert isinstance(o, ValueError) and "same allow_early_stop" in str(o), out
