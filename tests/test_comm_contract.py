"""Contract checks of rlhf_kernels.comm that mutation testing found unpinned.

In-process: the source's staging buffers (two, never larger than a transfer, reused only once
their transfer is done, filler after a failure drawn from them), the split copies it frees as
it goes, the receive pool (at most three blocks, never handing out memory the caller still
holds), the budget and alignment arithmetic, the header's and handshake's protocol checks. Two
gloo ranks: every transfer of both streams fits its documented size (``max_chunk_bytes``,
``/ world`` for ``scatter_for_ring``), a receiver that drops each micro-batch recycles its
block, and ``distributed_rollouts`` lets the source's sent samples go.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from rlhf_kernels.comm import _stream, _wire
from rlhf_kernels.ring.spawn import run_gloo

CPU = torch.device("cpu")
ROOT = str(Path(__file__).resolve().parents[1])


# ----------------------------------------------------------------------------- fake transfers
class _Transfer:
    """An async send that reads its buffer as late as a real one may: when it is waited."""

    def __init__(self, log: list, buf: torch.Tensor, keep: bool):
        self.log, self.buf, self.keep, self.done = log, buf, keep, False
        self.index = len(log)
        log.append(None)

    def wait(self, timeout=None):
        if not self.done:
            self.done = True
            self.log[self.index] = (self.buf.clone() if self.keep else None, self.buf.data_ptr())
            self.buf = None


def _recorder(keep: bool = True):
    log, works = [], []

    def send(buf):
        work = _Transfer(log, buf, keep)
        works.append(work)
        return work

    return send, log, works


def _tensors():
    """Every layout the sender handles: strided, conjugate and negative views, 0-d, empty, odd
    byte counts, complex128 (16-byte elements), large ones split over several pieces."""
    g = torch.Generator().manual_seed(0)
    z = torch.complex(torch.randn(300, generator=g, dtype=torch.float64), torch.randn(300).double())
    return [
        torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        torch.randn(40, 30, generator=g).t(),  # 4.8 kB, non-contiguous: split
        torch.tensor(2.5),
        z.conj(),  # 9.6 kB complex128 conjugate view: split
        torch.empty(0, 4),
        torch.randn(7, generator=g).bfloat16(),
        z[:20].conj().imag,  # a negative view
        torch.randint(-(2**40), 2**40, (5, 3), generator=g)[:, 1],
        torch.randn(1000, generator=g),
    ]


def _stream_bytes(tensors, offsets, total):
    out = torch.zeros(total, dtype=torch.uint8)
    for t, off in zip(tensors, offsets):
        flat = t.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        out[off : off + flat.numel()] = flat
    return out


# ----------------------------------------------------------------------------- Sender
def test_sender_sends_the_exact_stream_in_full_pieces():
    tensors = _tensors()
    offsets, total = _stream.layout([_stream.nbytes(t) for t in tensors])
    piece = _stream.piece_size(1000)
    assert piece == 992
    sender = _stream.Sender(piece, CPU)
    send, log, works = _recorder()
    sender.send(tensors, offsets, total, [send])
    sender.wait()
    # every transfer completed (a reused buffer's transfer included), so nothing was lost
    assert all(w.done for w in works) and None not in log
    sizes = [buf.numel() for buf, _ in log]
    assert sum(sizes) == total and all(n == piece for n in sizes[:-1]), sizes
    got = torch.cat([buf for buf, _ in log])
    want = _stream_bytes(tensors, offsets, total)
    for t, off in zip(tensors, offsets):
        n = _stream.nbytes(t)
        assert torch.equal(got[off : off + n], want[off : off + n]), (off, t.dtype)


def test_sender_reuses_two_staging_buffers_capped_at_a_piece():
    """ "the source holds two staging buffers of max_chunk_bytes": a buffer grown from a small
    stream to a large one never exceeds the piece size, and there are never more than two."""
    piece = _stream.piece_size(4096)
    sender = _stream.Sender(piece, CPU)
    send, log, _ = _recorder(keep=False)
    for total in (600, 3000, 2500, 40_000, 100, 9000):
        t = torch.arange(total, dtype=torch.uint8)
        sender.send([t], [0], _wire.align(total), [send])
        assert len(sender.bufs) == 2
        sizes = [b.numel() for b in sender.bufs if b is not None]
        assert sizes and max(sizes) <= piece, (total, sizes)
    sender.wait()


_SPLIT_COPIES = """
import torch
from rlhf_kernels.comm import _stream
from rlhf_kernels.comm._memory import PeakRSS

class Done:
    def wait(self, timeout=None):
        pass

tensors = [torch.randn(4096, 1024).t() for _ in range(4)]  # 16 MB each, 64 MB in all
offsets, total = _stream.layout([_stream.nbytes(t) for t in tensors])
sender = _stream.Sender(_stream.piece_size(256 << 10), torch.device("cpu"))
meter = PeakRSS()
sender.send(tensors, offsets, total, [lambda buf: Done()])
print(meter.stop())
"""


def test_sender_frees_each_split_copy_once_sent():
    """A non-contiguous tensor split over pieces is made flat once; the flat copy must go as
    soon as its last piece is packed, or the source holds a copy of the whole payload (64 MB
    here), and no second name may keep it until the next copy exists (32 MB: two at once). In a
    child whose large allocations are mmapped, so a free shows in RSS at once."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, "-c", _SPLIT_COPIES], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    peak = int(run.stdout.split()[-1])
    assert peak < 26e6, f"{peak / 1e6:.1f} MB of copies for 16 MB tensors (64 MB in all)"


def test_sender_fills_the_rest_from_its_staging_buffers_after_a_failure(monkeypatch):
    """Packing piece 3 fails (a simulated OOM): the rest of the stream goes out as filler,
    byte for byte, from a staging buffer (no new allocation), and drain waits for it all."""
    tensors = [torch.randn(2000)]  # 8 kB: 8 pieces of 1 kB
    offsets, total = _stream.layout([8000])
    piece = _stream.piece_size(1024)
    sender = _stream.Sender(piece, CPU)
    orig, calls = _stream.Sender._slot, [0]

    def slot(self, need):
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("simulated staging OOM")
        return orig(self, need)

    monkeypatch.setattr(_stream.Sender, "_slot", slot)
    send, log, works = _recorder()
    with pytest.raises(torch.OutOfMemoryError, match="simulated"):
        sender.send(tensors, offsets, total, [send])
    sender.wait()
    assert all(w.done for w in works)
    sizes = [buf.numel() for buf, _ in log]
    assert sum(sizes) == total and all(n <= piece for n in sizes), sizes
    staging = {b.data_ptr() for b in sender.bufs if b is not None}
    assert all(ptr in staging for _, ptr in log[2:]), "filler allocated a new buffer"
    flat = tensors[0].view(torch.uint8)
    assert torch.equal(log[0][0], flat[:piece]) and torch.equal(log[1][0], flat[piece : 2 * piece])


# ----------------------------------------------------------------------------- RecvPool
def test_recv_pool_never_hands_out_memory_the_caller_holds():
    pool = _stream.RecvPool(1024, CPU)
    held = []
    for i in range(6):  # the caller keeps every micro-batch
        buf = pool.take(1000)
        assert buf.numel() == 1000
        buf.fill_(i)
        held.append(buf)
    assert len(pool.blocks) <= 3  # "a pool of at most three such blocks"
    for i, buf in enumerate(held):
        assert (buf == i).all(), f"micro-batch {i} was overwritten"
    big = pool.take(5000)  # an oversize sample: a fresh buffer of its own size
    assert big.numel() == 5000
    big.fill_(9)
    assert all((buf == i).all() for i, buf in enumerate(held))


def test_recv_pool_recycles_a_dropped_block():
    pool = _stream.RecvPool(1024, CPU)
    a = pool.take(800)
    ptr = a.data_ptr()
    views = [a[:16].view(torch.float32), a[16:32]]  # what the caller is handed
    del a
    b = pool.take(800)
    assert b.data_ptr() != ptr  # a view of the block is still held
    del views, b
    c = pool.take(100)
    assert c.data_ptr() in {blk.data_ptr() for blk in pool.blocks}
    assert len(pool.blocks) <= 2  # nothing allocated in steady state


# ----------------------------------------------------------------------------- arithmetic
def test_layout_and_piece_size_are_16_byte_aligned():
    assert _stream.layout([1, 3, 16, 17, 0, 8]) == ([0, 16, 32, 48, 80, 80], 96)
    assert [_stream.piece_size(n) for n in (1024, 1030, 4095, 5)] == [1024, 1024, 4080, 16]
    z = torch.complex(torch.arange(3.0), -torch.arange(3.0)).to(torch.complex128)
    offsets, total = _stream.layout([1, _stream.nbytes(z)])
    flat = torch.zeros(total, dtype=torch.uint8)
    flat[offsets[1] : offsets[1] + 48] = z.view(torch.uint8)
    assert torch.equal(_stream.view_tensor(flat, offsets[1], torch.complex128, (3,)), z)


def test_micro_batches_fill_the_budget_exactly():
    one = lambda s, i: 100  # noqa: E731
    split = lambda samples, **kw: [len(b) for b in _wire.micro_batches(samples, one, 300, **kw)]  # noqa: E731
    samples = [{"i": i} for i in range(7)]
    assert split(samples) == [3, 3, 1]  # 300 of 300 bytes fits
    # the pickled descriptions of one micro-batch stay within META_BUDGET as well
    meta = lambda s: _wire.META_BUDGET // 2  # noqa: E731
    big = lambda s, i: 0  # noqa: E731
    assert [len(b) for b in _wire.micro_batches(samples, big, 1 << 40, meta)] == [2, 2, 2, 1]
    # one sample's own metadata over META_BUDGET (even under META_LIMIT) is refused by name
    over = lambda s: _wire.META_BUDGET + 1  # noqa: E731
    with pytest.raises(ValueError, match=r"samples\[0\]: its non-tensor fields pickle to"):
        list(_wire.micro_batches(samples, big, 1 << 40, over))


def test_sample_budget_counts_aligned_bytes_and_objects():
    from rlhf_kernels.comm.broadcast import _SAMPLE_OBJ_BYTES, _TENSOR_OBJ_BYTES, _sample_bytes

    s = {"x": torch.ones(1, dtype=torch.uint8), "y": torch.ones(5), "id": 3}
    assert _sample_bytes(s, 0, objects=False) == 16 + 32
    assert _sample_bytes(s, 0) == 48 + 2 * _TENSOR_OBJ_BYTES + _SAMPLE_OBJ_BYTES


def test_bad_tensors_and_oversize_headers_are_refused():
    with pytest.raises(TypeError, match="dense strided tensor"):
        _wire.check_tensor(torch.eye(3).to_sparse(), "samples[0]['x']")
    with pytest.raises(ValueError, match="over the .*-byte limit"):
        _wire.dumps_meta("x" * (_wire.META_LIMIT + 10), "header")
    _wire.dumps_meta("x" * 1000, "header")
    text = "é" * 400  # 800 utf-8 bytes: cut at MESSAGE_BYTES
    row = _wire.encode_message(text)
    assert len(row) == _wire.MESSAGE_BYTES
    assert _wire.decode_message(_wire.encode_message("a" * 600)) == "a" * _wire.MESSAGE_BYTES


def test_local_share_covers_every_item_once():
    from rlhf_kernels.comm import local_share

    for n, world in ((10, 4), (3, 2), (7, 3), (2, 4)):
        shares = [list(local_share(list(range(n)), r, world)) for r in range(world)]
        assert sum(shares, []) == list(range(n)), (n, world)
        assert max(map(len, shares)) - min(map(len, shares)) <= 1


# ----------------------------------------------------------------------------- two gloo ranks
CHUNK = 4096


def _record_transfers():
    """Wrap the transfer functions of this process: (kind, bytes) of every transfer."""
    sizes = []

    def wrap(name):
        orig = getattr(_stream, name)

        def make(*args):
            fn = orig(*args)

            def call(buf):
                sizes.append((name, buf.numel()))
                return fn(buf)

            return call

        setattr(_stream, name, make)

    for name in ("bcast_fn", "isend_fn", "irecv_fn"):
        wrap(name)
    return sizes


def _transfers_and_recycling(rank, world):
    from rlhf_kernels.comm import broadcast_chunked, scatter_for_ring

    sizes = _record_transfers()
    g = torch.Generator().manual_seed(1)
    samples = [{"x": torch.randn(n, generator=g), "id": i} for i, n in enumerate([300] * 12)]
    samples.insert(5, {"x": torch.randn(5000, generator=g), "id": -1})  # 20 kB: oversize
    out, ptrs = {}, []
    for mb in broadcast_chunked(samples if rank == 0 else None, src=0, max_chunk_bytes=CHUNK):
        if rank == 1:
            for s in mb:
                want = next(w for w in samples if w["id"] == s["id"])
                assert torch.equal(s["x"], want["x"]), s["id"]
            del s
            if len(mb[0]["x"]) == 300:
                ptrs.append(mb[0]["x"].untyped_storage().data_ptr())
        del mb  # the caller drops each micro-batch before asking for the next
    out["broadcast"], out["blocks"] = list(sizes), ptrs
    sizes.clear()
    long = [{"x": torch.randn(n, generator=g), "id": i} for i, n in enumerate([3000, 900, 700])]
    got = []
    for plan, local, meta in scatter_for_ring(
        long if rank == 0 else None, src=0, token_keys=["x"], max_chunk_bytes=CHUNK
    ):
        packed = torch.cat([long[m["id"]]["x"] for m in meta])
        assert torch.equal(local["x"], plan.shard(packed, rank))
        got += [m["id"] for m in meta]
    assert got == [0, 1, 2]
    out["scatter"] = list(sizes)
    return out


def _source_lets_sent_samples_go(rank, world):
    from rlhf_kernels.comm import distributed_rollouts

    refs = []

    def generate(prompts):
        for p in prompts:
            t = torch.full((500,), float(p))
            refs.append(weakref.ref(t))
            yield {"x": t, "p": p}

    alive_after_own, seen = None, []
    for mb in distributed_rollouts(list(range(8)), generate, max_chunk_bytes=CHUNK):
        seen += [s["p"] for s in mb]
        if alive_after_own is None and mb[0]["p"] >= 4:  # the first micro-batch of rank 1
            del mb
            gc.collect()
            alive_after_own = sum(r() is not None for r in refs)
    assert seen == list(range(8))
    return alive_after_own


def _audit_cases(rank, world):
    return {
        "transfers": _transfers_and_recycling(rank, world),
        "alive": _source_lets_sent_samples_go(rank, world),
    }


@pytest.mark.multiproc
def test_transfers_staging_and_recycling_on_two_ranks():
    res = run_gloo(_audit_cases, 2, timeout_s=120)
    piece = _stream.piece_size(CHUNK)
    for rank, r in enumerate(res):
        t = r["transfers"]
        # broadcast: every transfer (so each staging buffer and receive block) within the chunk
        assert t["broadcast"] and max(n for _, n in t["broadcast"]) <= piece, (rank, t)
        # scatter_for_ring: "transfers and the source's two staging buffers are
        # max_chunk_bytes / world"
        assert t["scatter"] and max(n for _, n in t["scatter"]) <= CHUNK // 2, (rank, t)
    # the receiver's blocks: one being yielded, one in flight, and the one the caller dropped
    # is taken again for the micro-batch after next (a pool of three never frees a block it
    # still holds a view of itself)
    ptrs = res[1]["transfers"]["blocks"]
    recycled = sum(ptrs[i] == ptrs[i - 2] for i in range(2, len(ptrs)))
    # (at least 4 of 10 recycled: a gloo work object may still hold a block for a moment)
    assert len(ptrs) == 12 and recycled >= 4, ptrs
    # rank 0's own samples are all gone once rank 1's stream starts (it keeps none of them)
    assert res[0]["alive"] == 0, res[0]["alive"]


def test_header_refuses_a_control_word_out_of_step():
    header = _wire.Header(src=0, group=None, device=CPU, timeout=None)

    def arrives(*ctrl):
        header._bcast = lambda t: t.copy_(torch.tensor(ctrl, dtype=torch.int64))

    arrives(_wire.MAGIC, _wire.END, 0, 0, 0, 0)
    assert header.recv("r") == (_wire.END, 0, 0, None)
    arrives(_wire.MAGIC, _wire.END, 0, 0, 0, 5)  # micro-batch 5 where 1 is expected
    with pytest.raises(RuntimeError, match="r: stream out of step .*micro-batch 5, expected 1"):
        header.recv("r")
    arrives(0x1234, _wire.END, 0, 0, 0, 1)
    with pytest.raises(RuntimeError, match="out of step .magic 0x1234"):
        header.recv("r")


def test_handshake_names_ranks_outside_the_protocol(monkeypatch):
    """A rank whose row lacks the magic (another collective of the same size) or says it was
    called with bad arguments is named; a mismatched field lists every rank's value."""
    fields = {"kind": 1, "src": 0, "keys": "('a',)"}
    mine = [_wire.MAGIC, 1, 1, 0, _wire.fingerprint("('a',)")] + [0] * 5
    rows = {"rows": [mine, [7, 1] + mine[2:]]}
    monkeypatch.setattr(_wire, "all_gather_rows", lambda row, **kw: rows["rows"])
    handshake = lambda: _wire.handshake(fields, None, group=None, device=CPU, who="w")  # noqa: E731
    with pytest.raises(ValueError, match=r"w: rank\(s\) \[1\] of the group were called with inv"):
        handshake()
    rows["rows"] = [mine, [_wire.MAGIC, 1, 1, 2] + mine[4:]]
    with pytest.raises(ValueError, match=r"every rank must pass the same src, got \{0: 0, 1: 2\}"):
        handshake()
    rows["rows"] = [mine, mine]
    handshake()
