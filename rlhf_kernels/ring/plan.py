"""Which tokens of a packed stream each rank of a ring group holds.

A ``RingPlan`` maps the packed stream (documents ``cu_seqlens[d]:cu_seqlens[d+1]``) to
``world_size`` local shards of equal length ``local_len``. Every local slot is either a real token
(its global index, document and position-in-document are defined) or a pad slot (index -1): pads
are zero in ``shard``, never attend or are attended to, and carry ``ignore_index`` as label.

Layouts:
  ``"zigzag"``: a document of ``L >= 2W`` tokens is cut into ``2W`` chunks whose sizes differ by at
  most one token; pair ``j`` = chunks ``j`` and ``2W - 1 - j`` (head + tail: the same causal work,
  a query at position ``p`` seeing ``p + 1`` keys, up to rounding) and each rank holds one pair,
  the heaviest pair going to the rank with the least work so far (the chunk-to-rank mapping
  rotates from document to document). A document shorter than ``2W`` goes whole to the rank with
  the least work. Documents are placed longest first; each rank's pieces are packed back to back,
  and only the end of a rank is padded to the common ``local_len``. Causal work per rank is then
  equal to within about one short document, whatever the document lengths; pad slots only make
  up the difference in token counts between ranks.
  ``"contiguous"``: the stream (padded at its end to a multiple of ``W``) is cut into ``W`` equal
  slices (the llama3 / OpenRLHF split); late ranks do more causal work.

A plan stores only *runs*: per rank, the maximal stretches of consecutive slots holding
consecutive tokens of one document (at most ``2 * num_docs`` per rank for zigzag,
``num_docs + world_size`` in all for contiguous). Building one takes
O(num_docs * world_size * log(world_size) + num_docs * log(num_docs)) time and
O(num_docs * world_size) memory, whatever the token count. Per-token tables (``global_index``,
``doc``, ``pos``, gather indices) are derived on demand, for the rank that asks. A plan pickles
as its inputs (``cu_seqlens``, world size, layout), so sending one costs a few bytes per document.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from numbers import Integral

import torch

from rlhf_kernels._checks import check_cu_seqlens, is_int

LAYOUTS = ("zigzag", "contiguous")

# columns of a run table: first slot, length, document, first position, first packed index
SLOT, LEN, DOC, POS, GLOBAL = range(5)
# ``shard``/``unshard`` copy one slice per run while runs average at least this many tokens
# (~2 us of Python per slice); below it, one index_select with a lazily built, cached index
# (measured on CPU: slices win at 500-token runs, the index at 250)
_MIN_MEAN_RUN = 384


@dataclass(eq=False)
class RingPlan:
    """Token placement of one packed stream over a ring group (build with ``RingPlan.build``).

    Attributes:
        world_size: ranks in the ring group.
        layout: ``"zigzag"`` or ``"contiguous"``.
        cu_seqlens: document boundaries of the packed stream, ``(0, ..., total)``.
        local_len: slots per rank (real tokens + pads), the same on every rank.
        runs: per rank, int64 ``(num_runs_r, 5)`` sorted by slot; row ``(slot, length, doc, pos,
            global)`` says slots ``slot + i`` (``0 <= i < length``) hold position ``pos + i`` of
            document ``doc``, i.e. packed index ``global + i``. Slots in no run are pads.
    """

    world_size: int
    layout: str
    cu_seqlens: tuple[int, ...]
    local_len: int
    runs: tuple[torch.Tensor, ...]
    _cache: dict = field(default_factory=dict, repr=False)  # O(runs) facts (segments, tiles)
    _per_token: dict = field(default_factory=dict, repr=False)  # lazily built per-token tables

    # ------------------------------------------------------------------------- construction
    @classmethod
    def build(cls, cu_seqlens, world_size: int, layout: str = "zigzag") -> RingPlan:
        """Plan the placement of a packed stream over ``world_size`` ranks.

        O(num_docs * W * log W) time, O(num_docs * W) memory; no per-token table is built.

        Args:
            cu_seqlens: int32/int64 tensor (or list of ints) ``(num_docs + 1,)``,
                ``[0, l0, l0 + l1, ..., total]``; documents may have any length (0 included).
            world_size: number of ranks in the ring group, >= 1.
            layout: ``"zigzag"`` (balanced causal work) or ``"contiguous"`` (equal slices).
        """
        if not isinstance(cu_seqlens, torch.Tensor):
            cu_seqlens = list(cu_seqlens)
            bad = [x for x in cu_seqlens if isinstance(x, bool) or not isinstance(x, Integral)]
            if bad:  # a float would be truncated by the conversion
                raise TypeError(f"cu_seqlens as a sequence must hold ints, got {bad[:3]}")
            cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
        if cu_seqlens.numel() < 1:
            raise ValueError("cu_seqlens must have at least one entry, got an empty tensor")
        total = int(cu_seqlens[-1]) if cu_seqlens.dim() == 1 else -1
        cu = check_cu_seqlens(cu_seqlens.cpu(), total, "cu_seqlens")
        if not is_int(world_size) or world_size < 1:  # NumPy ints too; bools and floats not
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        world_size = int(world_size)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        cu_t = torch.tensor(cu, dtype=torch.int64)
        build = _zigzag_runs if layout == "zigzag" else _contiguous_runs
        local_len, runs = build(cu_t, world_size)
        return cls(world_size, layout, tuple(cu), local_len, tuple(map(_merge, runs)))

    # ------------------------------------------------------------------------- basic facts
    @property
    def total(self) -> int:
        """Tokens in the packed stream."""
        return self.cu_seqlens[-1]

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    def check_rank(self, rank: int) -> int:
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return int(rank)

    def valid_mask(self, rank: int) -> torch.Tensor:
        """bool ``(local_len,)``: True for real tokens, False for pad slots."""
        mask = torch.ones(self.local_len, dtype=torch.bool)
        mask[self._pad_slots(self.check_rank(rank))] = False
        return mask

    def num_tokens(self, rank: int) -> int:
        """Real (non-pad) tokens held by ``rank``."""
        return int(self.runs[self.check_rank(rank)][:, LEN].sum())

    def local_seqlens(self, rank: int) -> torch.Tensor:
        """int64 ``(num_docs,)``: how many tokens of each document ``rank`` holds."""
        runs = self.runs[self.check_rank(rank)]
        return torch.zeros(self.num_docs, dtype=torch.int64).index_add_(
            0, runs[:, DOC], runs[:, LEN]
        )

    def position_ids(self, rank: int) -> torch.Tensor:
        """int64 ``(local_len,)``: position of each local token inside its document (pads: 0)."""
        runs = self.runs[self.check_rank(rank)]
        slots, offs = _expand(runs)
        pos = torch.zeros(self.local_len, dtype=torch.int64)
        pos[slots] = torch.repeat_interleave(runs[:, POS], runs[:, LEN]) + offs
        return pos

    def fingerprint(self) -> list[int]:
        """Small integer summary used to check that every rank holds the same plan."""
        crc = zlib.crc32(torch.tensor(self.cu_seqlens, dtype=torch.int64).numpy().tobytes())
        return [
            self.world_size,
            LAYOUTS.index(self.layout),
            self.total,
            self.local_len,
            self.num_docs,
            crc & 0x7FFFFFFF,
        ]

    # ------------------------------------------------------------------------- per-token tables
    @property
    def global_index(self) -> torch.Tensor:
        """int64 ``(world_size, local_len)``: packed index of each slot, -1 for pads.

        Built from the runs on first use and cached (8 bytes per slot): for inspection and tests;
        ``shard``/``unshard``/``position_ids`` do not need it."""
        return self._tables()[0]

    @property
    def doc(self) -> torch.Tensor:
        """int64 ``(world_size, local_len)``: document of each slot, -1 for pads (cached)."""
        return self._tables()[1]

    @property
    def pos(self) -> torch.Tensor:
        """int64 ``(world_size, local_len)``: position inside the document, -1 for pads (cached)."""
        return self._tables()[2]

    # ------------------------------------------------------------------------- data movement
    def _batch_of_one(self, x) -> bool:
        """``x`` is a Hugging Face style ``(1, total, ...)`` row (``packed_model_inputs``)."""
        return (
            isinstance(x, torch.Tensor)
            and x.dim() >= 2
            and x.shape[0] == 1
            and x.shape[1] == self.total
            and self.total != 1
        )

    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """The rank's tokens of ``x`` (first dim = packed length ``total``); pad slots are zero.

        Returns ``(local_len, *x.shape[1:])`` in x's dtype and device; differentiable. A
        ``(1, total, ...)`` row (HF layout) gives ``(1, local_len, ...)``. Costs one slice copy
        per run (or, for plans of many short runs, one ``index_select``).
        """
        self.check_rank(rank)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if self._batch_of_one(x):
            return self.shard(x[0], rank)[None]
        if x.dim() < 1 or x.shape[0] != self.total:
            raise ValueError(
                f"x must have the packed length {self.total} as first dim, got shape "
                f"{tuple(x.shape)}"
            )
        return self._take(x, rank, 0)

    def unshard(self, shards) -> torch.Tensor:
        """Exact inverse of ``shard``: a list of ``world_size`` shards -> ``(total, ...)``
        (``(1, local_len, ...)`` shards -> ``(1, total, ...)`` when ``local_len > 1``; with one
        slot per rank the two layouts look alike and the packed one is returned).

        Pad slots are dropped. Differentiable.
        """
        shards = list(shards)
        if len(shards) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} shards, got {len(shards)}")
        rows = [isinstance(s, torch.Tensor) and s.dim() >= 2 and s.shape[0] == 1 for s in shards]
        if self.local_len != 1 and all(rows) and all(s.shape[1] == self.local_len for s in shards):
            return self.unshard([s[0] for s in shards])[None]
        for r, s in enumerate(shards):
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"shards[{r}] must be a torch.Tensor, got {type(s).__name__}")
            if s.dim() < 1 or s.shape[0] != self.local_len or s.shape[1:] != shards[0].shape[1:]:
                raise ValueError(
                    f"shards[{r}] must have shape ({self.local_len}, "
                    f"{', '.join(map(str, shards[0].shape[1:]))}), got "
                    f"{tuple(s.shape)}"
                )
        rest = shards[0].shape[1:]
        if self.total == 0:
            return shards[0].new_zeros((0, *rest))
        if self._sliced(sum(r.shape[0] for r in self.runs)):
            # every run of every rank, in packed order: (global, rank, slot, length)
            pieces = sorted(
                (g, r, s, n)
                for r, runs in enumerate(self.runs)
                for s, n, g in runs[:, [SLOT, LEN, GLOBAL]].tolist()
            )
            return torch.cat([shards[r].narrow(0, s, n) for _, r, s, n in pieces])
        inv = self._cached("inverse", self._inverse, True).to(shards[0].device)
        return torch.cat(shards, 0).index_select(0, inv)

    def next_token_labels(
        self, labels: torch.Tensor, rank: int | None = None, ignore_index: int = -100
    ) -> torch.Tensor:
        """Targets for next-token prediction that stay correct across shard boundaries.

        Args:
            labels: int ``(total,)`` over the whole packed stream (usually ``input_ids``, with
                ``ignore_index`` where no loss is wanted), or a ``(1, total)`` row (the result
                then keeps the leading 1).
            rank: return the shard of this rank; None returns the whole stream.
            ignore_index: target for the last token of every document and for pad slots.

        Returns: int64, the target of the token at packed index ``g`` is ``labels[g + 1]`` when
        ``g + 1`` is in the same document, else ``ignore_index``.
        """
        # a 2-D tensor can only be a row (unlike shard's x, so a one-token stream's too)
        if isinstance(labels, torch.Tensor) and tuple(labels.shape) == (1, self.total):
            return self.next_token_labels(labels[0], rank, ignore_index)[None]
        if (
            not isinstance(labels, torch.Tensor)
            or labels.dim() != 1
            or labels.shape[0] != self.total
        ):
            shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels)
            raise ValueError(
                f"labels must be a 1-D tensor of length {self.total} or a (1, {self.total}) "
                f"row, got {shape}"
            )
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise TypeError(f"labels must hold integer token ids, got {labels.dtype}")
        cu = torch.tensor(self.cu_seqlens, device=labels.device)
        nxt = torch.full((self.total,), ignore_index, dtype=torch.int64, device=labels.device)
        nxt[:-1] = labels[1:].long()
        last = cu[1:][cu[1:] > cu[:-1]] - 1  # last token of each non-empty document
        nxt[last] = ignore_index
        if rank is None:
            return nxt
        return self._take(nxt, self.check_rank(rank), ignore_index)

    # ------------------------------------------------------------------------- attention facts
    def segments(self, rank: int) -> list[tuple[int, int, int, int]]:
        """Runs of consecutive real tokens of one document on ``rank``.

        Returns ``[(slot_start, length, doc, pos_start), ...]`` in slot order, maximal (two
        entries never continue each other); slot ``slot_start + i`` holds position
        ``pos_start + i`` of document ``doc``. Cached on the plan.
        """
        key = ("segments", self.check_rank(rank))
        if key not in self._cache:
            self._cache[key] = [tuple(r) for r in self.runs[rank][:, :GLOBAL].tolist()]
        return self._cache[key]

    def attention_work(self, causal: bool = True, window_size=(-1, -1)) -> torch.Tensor:
        """int64 ``(world_size,)``: visible (query, key) pairs of each rank's queries.

        This is the attention work a rank does in a ring pass (keys may live on any rank).
        ``max / mean`` of it is the load imbalance. Closed form per run, O(runs).
        """
        from rlhf_kernels.ops.varlen_attention import _window_pair

        left, right = _window_pair(window_size)  # as the attention takes it: (4.5, 0) refused
        if causal:
            right = 0
        cu = torch.tensor(self.cu_seqlens, dtype=torch.int64)
        lengths = cu[1:] - cu[:-1]
        work = torch.zeros(self.world_size, dtype=torch.int64)
        for r, runs in enumerate(self.runs):
            n, p, last = runs[:, LEN], runs[:, POS], lengths[runs[:, DOC]] - 1
            # a query at position q sees keys max(q - left, 0) ..= min(q + right, L - 1)
            hi = _sum_min(p + right, n, last) if right >= 0 else n * last
            lo = _sum_max0(p - left, n) if left >= 0 else torch.zeros_like(n)
            work[r] = (hi - lo + n).sum()
        return work

    # ------------------------------------------------------------------------- internals
    def _cached(self, key, make, per_token: bool = False):
        cache = self._per_token if per_token else self._cache
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def _sliced(self, num_runs: int) -> bool:
        """Copy run by run (True) or through one lazily built index (False)?"""
        return num_runs <= 16 or num_runs * _MIN_MEAN_RUN <= self.local_len * self.world_size

    def _take(self, x: torch.Tensor, rank: int, fill) -> torch.Tensor:
        """``(local_len, *x.shape[1:])``: ``x[global]`` at real slots, ``fill`` at pads."""
        runs = self.runs[rank]
        rest = x.shape[1:]
        if self._sliced(runs.shape[0] * self.world_size):
            spans = self._cached(("spans", rank), lambda: _spans(runs, self.local_len))
            pad = max((n for g, n in spans if g < 0), default=0)
            pads = x.new_full((pad, *rest), fill) if pad else None
            pieces = [x.narrow(0, g, n) if g >= 0 else pads.narrow(0, 0, n) for g, n in spans]
            if all(g < 0 for g, _ in spans):  # pads only (or nothing): keep the autograd link
                pieces.insert(0, x.narrow(0, 0, 0))
            return torch.cat(pieces)
        idx = self._cached(("index", rank), lambda: self._gather_index(rank), True).to(x.device)
        out = x.index_select(0, idx)
        pad_slots = self._pad_slots(rank)
        if pad_slots.numel():
            out = _index_fill(out, pad_slots.to(x.device), fill)
        return out

    def _gather_index(self, rank: int) -> torch.Tensor:
        """``(local_len,)`` packed index of every slot of ``rank`` (pads: 0); int32 if it fits."""
        runs = self.runs[rank]
        slots, offs = _expand(runs)
        dtype = torch.int32 if self.total < 2**31 else torch.int64
        idx = torch.zeros(self.local_len, dtype=dtype)
        idx[slots] = (torch.repeat_interleave(runs[:, GLOBAL], runs[:, LEN]) + offs).to(dtype)
        return idx

    def _inverse(self) -> torch.Tensor:
        """``(total,)``: row of ``torch.cat(shards)`` holding each packed token."""
        dtype = torch.int32 if self.world_size * self.local_len < 2**31 else torch.int64
        inv = torch.empty(self.total, dtype=dtype)
        for r, runs in enumerate(self.runs):
            slots, offs = _expand(runs)
            inv[torch.repeat_interleave(runs[:, GLOBAL], runs[:, LEN]) + offs] = (
                slots + r * self.local_len
            ).to(dtype)
        return inv

    def _pad_slots(self, rank: int) -> torch.Tensor:
        """int64 slots of ``rank`` that hold no token (zigzag: only at the end)."""

        def make():
            gaps = [[s, n, 0, 0, 0] for s, n in self._gaps(rank)]
            return _expand(torch.tensor(gaps, dtype=torch.int64).view(-1, 5))[0]

        return self._cached(("pads", rank), make)

    def _gaps(self, rank: int) -> list[tuple[int, int]]:
        """``[(slot, length), ...]`` of the pad stretches of ``rank``."""
        runs = self.runs[rank]
        end = (runs[:, SLOT] + runs[:, LEN]).tolist()
        out, prev = [], 0
        for s, e in zip(runs[:, SLOT].tolist() + [self.local_len], end + [self.local_len]):
            if s > prev:
                out.append((prev, s - prev))
            prev = e
        return out

    def _tables(self):
        def make():
            tables = torch.full((3, self.world_size, self.local_len), -1, dtype=torch.int64)
            for r, runs in enumerate(self.runs):
                slots, offs = _expand(runs)
                for t, col in enumerate((GLOBAL, DOC, POS)):
                    step = 0 if col == DOC else offs
                    tables[t, r, slots] = torch.repeat_interleave(runs[:, col], runs[:, LEN]) + step
            return tables.unbind(0)

        return self._cached("tables", make, True)

    def __reduce__(self):
        # pickles as its inputs (a few ints per document); the runs are rebuilt on load
        return (RingPlan.build, (list(self.cu_seqlens), self.world_size, self.layout))


# ----------------------------------------------------------------------------- run tables
def _zigzag_runs(cu: torch.Tensor, world: int) -> tuple[int, list[torch.Tensor]]:
    """Balanced placement: rotated head/tail chunk pairs for long documents, short ones whole.

    A document of ``L >= 2W`` tokens is cut into ``2W`` chunks (sizes differ by at most one);
    pair ``j`` is chunks ``j`` and ``2W - 1 - j`` (same causal work up to rounding), and the
    pairs go one per rank, the heaviest to the rank with the least work so far (so which rank
    gets which pair rotates from document to document). A document shorter than ``2W`` goes
    whole to the rank with the least work. Documents are placed longest first (greedy
    longest-processing-time). Each rank's pieces are packed back to back in packed order; ranks
    with fewer tokens than ``local_len`` end with pad slots (no per-document padding).
    """
    n = 2 * world
    lengths = (cu[1:] - cu[:-1]).tolist()
    starts = cu[:-1].tolist()
    work, tokens = [0] * world, [0] * world
    pieces: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]  # (doc, pos, len)
    order = sorted((d for d, L in enumerate(lengths) if L > 0), key=lambda d: -lengths[d])
    ranks = range(world)
    for d in order:
        length = lengths[d]
        if length < n:
            r = min(ranks, key=lambda r: (work[r], tokens[r], r))
            pieces[r].append((d, 0, length))
            work[r] += length * (length + 1) // 2
            tokens[r] += length
            continue
        b = [i * length // n for i in range(n + 1)]  # chunk i is positions b[i]:b[i+1]
        tri = [p * (p + 1) // 2 for p in b]  # causal work of positions < b[i]
        pair_work = [tri[j + 1] - tri[j] + tri[n - j] - tri[n - 1 - j] for j in range(world)]
        pairs = sorted(range(world), key=lambda j: -pair_work[j])
        for j, r in zip(pairs, sorted(ranks, key=lambda r: (work[r], tokens[r], r))):
            for c in (j, n - 1 - j):
                pieces[r].append((d, b[c], b[c + 1] - b[c]))
                tokens[r] += b[c + 1] - b[c]
            work[r] += pair_work[j]
    runs = []
    for r in ranks:
        p = torch.tensor(sorted(pieces[r]), dtype=torch.int64).view(-1, 3)
        size = p[:, 2]
        slot = torch.cumsum(size, 0) - size
        glob = torch.tensor(starts, dtype=torch.int64)[p[:, 0]] + p[:, 1] if len(p) else size
        runs.append(torch.stack([slot, size, p[:, 0], p[:, 1], glob], 1))
    return max(tokens), runs


def _contiguous_runs(cu: torch.Tensor, world: int) -> tuple[int, list[torch.Tensor]]:
    """Equal contiguous slices of the stream; the stream is padded at its end."""
    total = int(cu[-1])
    local_len = -(-total // world)
    if total == 0:
        return 0, [torch.zeros(0, 5, dtype=torch.int64) for _ in range(world)]
    cuts = torch.arange(world + 1, dtype=torch.int64).mul_(local_len).clamp_(max=total)
    bounds = torch.unique(torch.cat([cu, cuts]))  # sorted; every gap is a non-empty run
    a, b = bounds[:-1], bounds[1:]
    doc = torch.searchsorted(cu, a, right=True) - 1  # the non-empty document starting <= a
    rank = a // local_len
    rows = torch.stack([a - rank * local_len, b - a, doc, a - cu[doc], a], 1)
    return local_len, [rows[rank == r] for r in range(world)]


def _merge(runs: torch.Tensor) -> torch.Tensor:
    """Join runs that continue each other (same document, next slot, next position)."""
    if runs.shape[0] < 2:
        return runs.contiguous()
    end = runs[:-1, SLOT] + runs[:-1, LEN]
    cont = (
        (runs[1:, DOC] == runs[:-1, DOC])
        & (runs[1:, SLOT] == end)
        & (runs[1:, POS] == runs[:-1, POS] + runs[:-1, LEN])
    )
    first = torch.cat([torch.ones(1, dtype=torch.bool), ~cont])
    out = runs[first].clone()
    group = torch.cumsum(first.long(), 0) - 1
    out[:, LEN] = torch.zeros(out.shape[0], dtype=torch.int64).index_add_(0, group, runs[:, LEN])
    return out


def _expand(runs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token of the runs (in run order): its slot and its offset inside its run."""
    n = runs[:, LEN]
    offs = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
    return torch.repeat_interleave(runs[:, SLOT], n) + offs, offs


def _spans(runs: torch.Tensor, local_len: int) -> list[tuple[int, int]]:
    """``[(global or -1, length), ...]`` covering the slots ``0..local_len`` in order."""
    out, prev = [], 0
    for s, n, g in runs[:, [SLOT, LEN, GLOBAL]].tolist():
        if s > prev:
            out.append((-1, s - prev))
        out.append((g, n))
        prev = s + n
    if local_len > prev:
        out.append((-1, local_len - prev))
    return out


def _sum_min(a: torch.Tensor, n: torch.Tensor, cap: torch.Tensor) -> torch.Tensor:
    """``sum_{i < n} min(a + i, cap)`` elementwise."""
    k = (cap - a + 1).clamp(min=0).minimum(n)  # terms below the cap
    return k * a + k * (k - 1) // 2 + (n - k) * cap


def _sum_max0(a: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``sum_{i < n} max(a + i, 0)`` elementwise."""
    m = (-a).clamp(min=0).minimum(n)  # negative terms
    return (n - m) * a + (n * (n - 1) - m * (m - 1)) // 2


def _index_fill(x: torch.Tensor, slots: torch.Tensor, fill) -> torch.Tensor:
    """``x.index_fill(0, slots, fill)``; for dtypes without it (float8) and ``fill == 0``, the
    same on the integer view of x's bits (zero bits are 0.0 in every float format)."""
    try:
        return x.index_fill(0, slots, fill)
    except (NotImplementedError, RuntimeError):
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        if fill != 0 or x.requires_grad or x.element_size() not in bits:
            raise
        return x.view(bits[x.element_size()]).index_fill(0, slots, 0).view(x.dtype)
