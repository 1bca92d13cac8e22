"""Wire and protocol contracts of rlhf_kernels.comm that mutation testing found unpinned.

In-process: the stream protocol against a scripted header (a receiver yields a micro-batch only
once its transfers are done, the source drains before its last micro-batch and sends nothing
after END), the handshake's own checks, the receive pool at exactly one piece and the metadata
estimate against the real description. Three gloo ranks: both streams on a subgroup whose group
ranks are not the global ranks.
"""

from __future__ import annotations

import contextlib
import pickle

import pytest
import torch
import torch.distributed as dist

from rlhf_kernels.comm import _protocol, _stream, _wire
from rlhf_kernels.ring.spawn import run_gloo

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- fakes
class _Header:
    """Records what the source sends; replays control words to a receiver."""

    def __init__(self, log: list, script=()):
        self.log, self.script = log, list(script)

    def send(self, status, meta=None):
        self.log.append(("send", status, meta))

    def send_raw(self, status, data, n=0, payload=0):
        self.log.append(("send", status, n))

    def recv(self, who):
        return self.script.pop(0)


class _Work:
    def __init__(self):
        self.done = False

    def wait(self, timeout=None):
        self.done = True


def _source(log, n_batches, fail_at=None):
    """send_loop over ``n_batches`` one-sample batches; ``prepare`` raises at ``fail_at``."""

    def prepare(batch):
        if batch[0] == fail_at:
            raise ValueError(f"bad sample {fail_at}")
        return b"d", 0, lambda: log.append(("start", batch[0])), batch

    batches = iter([[i] for i in range(n_batches)])
    return _protocol.send_loop(_Header(log), batches, prepare, lambda: log.append(("drain",)))


# ----------------------------------------------------------------------------- protocol
def test_receiver_yields_a_micro_batch_only_once_its_transfers_are_done():
    works = {}

    def receive(desc, n, word):
        works[desc] = [_Work(), _Work()]
        return desc, works[desc]

    B = _wire.BATCH
    script = [(B, 1, 0, "a"), (B, 1, 0, "b"), (_wire.END, 0, 0, None)]
    for value in _protocol.recv_loop(_Header([], script), receive, "r", 0):
        assert all(w.done for w in works[value]), f"{value} yielded while still in flight"


def test_source_drains_before_its_last_micro_batch():
    for fail_at in (None, 2):  # END, and ERROR from the source's iterable
        log = []
        stream = _source(log, 3, fail_at)
        got = []
        with pytest.raises(ValueError) if fail_at else contextlib.nullcontext():
            for batch in stream:
                got.append(batch)
                if batch == [fail_at - 1 if fail_at else 2]:  # the last one
                    assert ("drain",) in log, log
        assert got == [[0], [1]] if fail_at else [[0], [1], [2]]


def test_source_closed_after_end_sends_nothing_more():
    """Closing the source on its last micro-batch (after END went out, the receivers have
    returned) must not send an ABORT: an unmatched header puts the group out of step."""
    log = []
    stream = _source(log, 2)
    assert next(stream) == [0] and next(stream) == [1]  # END is out; [1] is held until now
    stream.close()
    sent = [e[1] for e in log if e[0] == "send"]
    assert sent == [_wire.BATCH, _wire.BATCH, _wire.END], sent
    # closed before the end: one ABORT, then the transfers are drained
    log = []
    stream = _source(log, 5)
    next(stream)
    stream.close()
    sent = [e[1] for e in log if e[0] == "send"]
    assert sent[-1] == _wire.ABORT and sent.count(_wire.ABORT) == 1 and log[-1] == ("drain",)


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str")


@pytest.mark.parametrize(
    "exc", [ValueError("x" * (_wire.META_LIMIT + 1)), _Unprintable()], ids=["huge", "unprintable"]
)
def test_an_error_header_goes_out_whatever_the_message(exc):
    """The source's error travels in an ERROR header even when its text is over META_LIMIT or
    cannot be formatted: else no header follows and the receivers wait for the timeout."""
    header = _wire.Header(src=0, group=None, device=CPU, timeout=None)
    sent = []
    header._bcast = lambda t: sent.append(t.clone())

    def batches():
        yield [0]
        raise exc

    prepare = lambda b: (b"", 0, lambda: None, b)  # noqa: E731
    with pytest.raises(type(exc)) as err:
        list(_protocol.send_loop(header, batches(), prepare, lambda: None))
    assert err.value is exc  # the source raises the original error
    words = [t.tolist() for t in sent if t.dtype == torch.int64]
    assert [w[1] for w in words] == [_wire.BATCH, _wire.ERROR], words
    assert type(exc).__name__ in pickle.loads(sent[-1].numpy().tobytes())


# ----------------------------------------------------------------------------- handshake
def test_handshake_raises_the_local_error_and_refuses_too_many_fields(monkeypatch):
    rows = [[_wire.MAGIC, 1] + [0] * _wire.HANDSHAKE_FIELDS] * 2
    monkeypatch.setattr(_wire, "all_gather_rows", lambda row, **kw: rows)
    with pytest.raises(ValueError, match="^bad src here$"):  # its own error, not "rank(s) [..]"
        _wire.handshake({"src": 0}, "bad src here", group=None, device=CPU, who="w")
    fields = {f"f{i}": 0 for i in range(_wire.HANDSHAKE_FIELDS + 1)}
    with pytest.raises(ValueError, match="at most 8 handshake fields"):
        _wire.handshake(fields, None, group=None, device=CPU, who="w")


# ----------------------------------------------------------------------------- budgets
def test_max_chunk_bytes_lower_bound_is_inclusive():
    from rlhf_kernels.comm.broadcast import _common_error

    assert _common_error("n", 2, 0, _wire.MIN_CHUNK_BYTES, None) is None
    assert "max_chunk_bytes" in str(_common_error("n", 2, 0, _wire.MIN_CHUNK_BYTES - 1, None))


def test_token_budget_counts_aligned_bytes_and_refuses_a_0d_tensor():
    from rlhf_kernels.comm.broadcast import _token_budget

    budget = _token_budget(["x", "y"])
    assert budget({"x": torch.ones(3, dtype=torch.uint8), "y": torch.ones(3)}, 0) == 16 + 16
    with pytest.raises(ValueError, match=r"samples\[3\]\['x'\] must have a token dim"):
        _token_budget(["x"])({"x": torch.tensor(1)}, 3)


def test_local_share_refuses_a_rank_outside_the_world():
    from rlhf_kernels.comm import local_share

    for rank in (-1, 4):
        with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
            local_share(list(range(8)), rank, 4)


def test_recv_pool_reuses_its_blocks_for_a_full_piece():
    pool = _stream.RecvPool(1024, CPU)
    a = pool.take(1024)
    assert a.data_ptr() in {b.data_ptr() for b in pool.blocks}
    del a
    assert pool.take(1024).data_ptr() == pool.blocks[0].data_ptr()


def test_broadcast_meta_size_bounds_the_real_description():
    """The per-sample estimate micro_batches budgets with covers the pickled description,
    offsets included (large offsets pickle to more bytes than the 0 of the estimate)."""
    from rlhf_kernels.comm.broadcast import _broadcast_meta_size, _describe

    sample = {f"t{i}": torch.ones(1024, dtype=torch.uint8) for i in range(200)}
    desc, _ = _describe([sample])
    assert _wire.meta_nbytes(desc) <= _broadcast_meta_size(sample)


# ----------------------------------------------------------------------------- subgroup
def _subgroup_case(rank, world):
    """Group [1, 2]: group rank r is global rank r + 1, so every src/dst must be mapped, the
    filler of a failed scatter included; layout and pad_values must agree (checked)."""
    from rlhf_kernels.comm import broadcast, broadcast_chunked, scatter_for_ring

    group = dist.new_group([1, 2])  # called on every rank, rank 0 included
    if rank == 0:
        return None
    me = dist.get_rank(group)
    g = torch.Generator().manual_seed(0)
    samples = [{"x": torch.randn(n, generator=g), "id": i} for i, n in enumerate([700, 30, 900])]
    kw = {"group": group, "max_chunk_bytes": 4096, "timeout": 5}
    out = {"bcast": [], "scatter": []}
    for mb in broadcast_chunked(samples if me == 0 else None, src=0, **kw):
        out["bcast"] += [(s["id"], torch.equal(s["x"], samples[s["id"]]["x"])) for s in mb]
    scatter = lambda src, **more: scatter_for_ring(  # noqa: E731
        samples if me == src else None, src=src, token_keys=["x"], **kw, **more
    )
    for plan, local, meta in scatter(1):
        packed = torch.cat([samples[m["id"]]["x"] for m in meta])
        out["scatter"] += [(m["id"], torch.equal(local["x"], plan.shard(packed, me))) for m in meta]
    for more, name in (
        ({"layout": "zigzag" if me == 0 else "contiguous"}, "layout"),
        ({"pad_values": {"x": 1.0} if me == 0 else None}, "pad_values"),
    ):
        with pytest.raises(ValueError, match=f"every rank must pass the same {name}"):
            list(scatter(0, **more))
    # the source fails building rank 0's shard: rank 0's transfers complete with filler
    orig = broadcast._run_pieces
    if me == 1:
        broadcast._run_pieces = lambda plan, r, *a: orig(plan, r, *a) if r == 1 else 1 / 0
    try:
        with pytest.raises(
            ZeroDivisionError if me == 1 else RuntimeError, match="division by zero"
        ) as err:
            list(scatter(1))
    finally:
        broadcast._run_pieces = orig
    out["failed"] = me == 1 or "failed while sending micro-batch 0" in str(err.value)
    out["after"] = [len(mb) for mb in broadcast_chunked(samples if me == 0 else None, src=0, **kw)]
    return out


@pytest.mark.multiproc
def test_streams_on_a_subgroup_map_group_ranks_to_global_ranks():
    res = run_gloo(_subgroup_case, 3, timeout_s=60)
    want = [(i, True) for i in range(3)]
    assert res[1] == res[2], res
    assert res[1]["bcast"] == res[1]["scatter"] == want, res
    assert res[1]["failed"] and sum(res[1]["after"]) == 3, res  # and the group is in step
