"""Which tokens of a packed stream each rank of a ring group holds.

A ``RingPlan`` maps the packed stream (documents ``cu_seqlens[d]:cu_seqlens[d+1]``) to
``world_size`` local shards of equal length ``local_len``. Every local slot is either a real token
(its global index, document and position-in-document are recorded) or a pad slot (index -1): pads
are zero in ``shard``, never attend or are attended to, and carry ``ignore_index`` as label.

Layouts:
  ``"zigzag"``: each document is cut into ``2 * world_size`` chunks whose sizes differ by at most
  one token; rank ``r`` holds chunks ``r`` and ``2W - 1 - r`` (head + tail), each padded to
  ``ceil(L / 2W)`` slots. Causal work (a query at position ``p`` sees ``p + 1`` keys) is then the
  same on every rank, for any document length.
  ``"contiguous"``: the stream (padded at its end to a multiple of ``W``) is cut into ``W`` equal
  slices (the llama3 / OpenRLHF split); late ranks do more causal work.

A plan is plain data (ints and int64 CPU tensors): cheap to build, and it pickles as its inputs
(``cu_seqlens``, world size, layout), so sending one costs a few bytes per document.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from rlhf_kernels._checks import check_cu_seqlens

LAYOUTS = ("zigzag", "contiguous")


@dataclass(eq=False)
class RingPlan:
    """Token placement of one packed stream over a ring group (build with ``RingPlan.build``).

    Attributes:
        world_size: ranks in the ring group.
        layout: ``"zigzag"`` or ``"contiguous"``.
        cu_seqlens: document boundaries of the packed stream, ``(0, ..., total)``.
        local_len: slots per rank (real tokens + pads), the same on every rank.
        global_index: int64 ``(world_size, local_len)``; packed index of each slot, -1 for pads.
        doc: int64 ``(world_size, local_len)``; document of each slot, -1 for pads.
        pos: int64 ``(world_size, local_len)``; position inside the document, -1 for pads.
    """

    world_size: int
    layout: str
    cu_seqlens: tuple[int, ...]
    local_len: int
    global_index: torch.Tensor
    doc: torch.Tensor
    pos: torch.Tensor
    _cache: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------------- construction
    @classmethod
    def build(cls, cu_seqlens, world_size: int, layout: str = "zigzag") -> RingPlan:
        """Plan the placement of a packed stream over ``world_size`` ranks.

        Args:
            cu_seqlens: int32/int64 tensor (or list of ints) ``(num_docs + 1,)``,
                ``[0, l0, l0 + l1, ..., total]``; documents may have any length (0 included).
            world_size: number of ranks in the ring group, >= 1.
            layout: ``"zigzag"`` (balanced causal work) or ``"contiguous"`` (equal slices).
        """
        if not isinstance(cu_seqlens, torch.Tensor):
            cu_seqlens = torch.tensor(list(cu_seqlens), dtype=torch.int64)
        if cu_seqlens.numel() < 1:
            raise ValueError("cu_seqlens must have at least one entry, got an empty tensor")
        total = int(cu_seqlens[-1]) if cu_seqlens.dim() == 1 else -1
        cu = check_cu_seqlens(cu_seqlens.cpu(), total, "cu_seqlens")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        cu_t = torch.tensor(cu, dtype=torch.int64)
        build = _build_zigzag if layout == "zigzag" else _build_contiguous
        gidx, doc, pos = build(cu_t, world_size)
        return cls(world_size, layout, tuple(cu), gidx.shape[1], gidx, doc, pos)

    # ------------------------------------------------------------------------- basic facts
    @property
    def total(self) -> int:
        """Tokens in the packed stream."""
        return self.cu_seqlens[-1]

    @property
    def num_docs(self) -> int:
        return len(self.cu_seqlens) - 1

    def check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        return rank

    def valid_mask(self, rank: int) -> torch.Tensor:
        """bool ``(local_len,)``: True for real tokens, False for pad slots."""
        return self.global_index[self.check_rank(rank)] >= 0

    def num_tokens(self, rank: int) -> int:
        """Real (non-pad) tokens held by ``rank``."""
        return int(self.valid_mask(rank).sum())

    def local_seqlens(self, rank: int) -> torch.Tensor:
        """int64 ``(num_docs,)``: how many tokens of each document ``rank`` holds."""
        d = self.doc[self.check_rank(rank)]
        return torch.bincount(d[d >= 0], minlength=self.num_docs)

    def position_ids(self, rank: int) -> torch.Tensor:
        """int64 ``(local_len,)``: position of each local token inside its document (pads: 0)."""
        return self.pos[self.check_rank(rank)].clamp(min=0)

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

    # ------------------------------------------------------------------------- data movement
    def shard(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        """The rank's tokens of ``x`` (first dim = packed length ``total``); pad slots are zero.

        Returns ``(local_len, *x.shape[1:])`` in x's dtype and device; differentiable.
        """
        self.check_rank(rank)
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() < 1 or x.shape[0] != self.total:
            raise ValueError(
                f"x must have the packed length {self.total} as first dim, got shape "
                f"{tuple(x.shape)}"
            )
        idx = self.global_index[rank].to(x.device)
        out = x[idx.clamp(min=0)]
        valid = (idx >= 0).view(-1, *([1] * (x.dim() - 1)))
        return torch.where(valid, out, torch.zeros((), dtype=x.dtype, device=x.device))

    def unshard(self, shards) -> torch.Tensor:
        """Exact inverse of ``shard``: a list of ``world_size`` shards -> ``(total, ...)``.

        Pad slots are dropped. Differentiable.
        """
        shards = list(shards)
        if len(shards) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} shards, got {len(shards)}")
        for r, s in enumerate(shards):
            if not isinstance(s, torch.Tensor):
                raise TypeError(f"shards[{r}] must be a torch.Tensor, got {type(s).__name__}")
            if s.dim() < 1 or s.shape[0] != self.local_len or s.shape[1:] != shards[0].shape[1:]:
                raise ValueError(
                    f"shards[{r}] must have shape ({self.local_len}, "
                    f"{', '.join(map(str, shards[0].shape[1:]))}), got "
                    f"{tuple(s.shape)}"
                )
        inv = self._inverse().to(shards[0].device)
        return torch.cat(shards, 0).index_select(0, inv)

    def next_token_labels(
        self, labels: torch.Tensor, rank: int | None = None, ignore_index: int = -100
    ) -> torch.Tensor:
        """Targets for next-token prediction that stay correct across shard boundaries.

        Args:
            labels: int ``(total,)`` over the whole packed stream (usually ``input_ids``, with
                ``ignore_index`` where no loss is wanted).
            rank: return the shard of this rank; None returns the whole stream.
            ignore_index: target for the last token of every document and for pad slots.

        Returns: int64, the target of the token at packed index ``g`` is ``labels[g + 1]`` when
        ``g + 1`` is in the same document, else ``ignore_index``.
        """
        if (
            not isinstance(labels, torch.Tensor)
            or labels.dim() != 1
            or labels.shape[0] != self.total
        ):
            shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels)
            raise ValueError(f"labels must be a 1-D tensor of length {self.total}, got {shape}")
        cu = torch.tensor(self.cu_seqlens, device=labels.device)
        nxt = torch.full((self.total,), ignore_index, dtype=torch.int64, device=labels.device)
        nxt[:-1] = labels[1:].long()
        last = cu[1:][cu[1:] > cu[:-1]] - 1  # last token of each non-empty document
        nxt[last] = ignore_index
        if rank is None:
            return nxt
        idx = self.global_index[self.check_rank(rank)].to(labels.device)
        return torch.where(idx >= 0, nxt[idx.clamp(min=0)], ignore_index)

    # ------------------------------------------------------------------------- attention facts
    def segments(self, rank: int) -> list[tuple[int, int, int, int]]:
        """Runs of consecutive real tokens of one document on ``rank``.

        Returns ``[(slot_start, length, doc, pos_start), ...]``; slot ``slot_start + i`` holds
        position ``pos_start + i`` of document ``doc``. Cached on the plan.
        """
        key = ("segments", self.check_rank(rank))
        if key not in self._cache:
            d, p = self.doc[rank], self.pos[rank]
            valid = d >= 0
            # a run starts where the previous slot is not (same doc, previous position)
            prev_same = torch.zeros_like(valid)
            prev_same[1:] = (d[1:] == d[:-1]) & (p[1:] == p[:-1] + 1) & valid[:-1]
            starts = torch.nonzero(valid & ~prev_same).flatten()
            run_id = torch.cumsum((valid & ~prev_same).long(), 0) - 1
            lengths = torch.bincount(run_id[valid], minlength=starts.numel())
            self._cache[key] = list(
                zip(starts.tolist(), lengths.tolist(), d[starts].tolist(), p[starts].tolist())
            )
        return self._cache[key]

    def attention_work(self, causal: bool = True, window_size=(-1, -1)) -> torch.Tensor:
        """int64 ``(world_size,)``: visible (query, key) pairs of each rank's queries.

        This is the attention work a rank does in a ring pass (keys may live on any rank).
        ``max / mean`` of it is the load imbalance.
        """
        left, right = int(window_size[0]), int(window_size[1])
        if causal:
            right = 0
        lengths = torch.tensor(self.cu_seqlens[1:]) - torch.tensor(self.cu_seqlens[:-1])
        valid = self.doc >= 0
        p = self.pos.clamp(min=0)
        L = lengths[self.doc.clamp(min=0)]
        hi = torch.minimum(p + right, L - 1) if right >= 0 else L - 1
        lo = (p - left).clamp(min=0) if left >= 0 else torch.zeros_like(p)
        return torch.where(valid, hi - lo + 1, 0).sum(1)

    # ------------------------------------------------------------------------- internals
    def _inverse(self) -> torch.Tensor:
        if "inverse" not in self._cache:
            flat = self.global_index.flatten()
            slots = torch.nonzero(flat >= 0).flatten()
            inv = torch.empty(self.total, dtype=torch.int64)
            inv[flat[slots]] = slots
            self._cache["inverse"] = inv
        return self._cache["inverse"]

    def __reduce__(self):
        # pickles as its inputs (a few ints per document); the tensors are rebuilt on load
        return (RingPlan.build, (list(self.cu_seqlens), self.world_size, self.layout))


def _build_zigzag(cu: torch.Tensor, world: int):
    """Per document: 2W near-equal chunks; rank r holds chunks r and 2W-1-r, each padded to c."""
    n = 2 * world
    lengths = cu[1:] - cu[:-1]
    c = (lengths + n - 1) // n  # slots per chunk
    slots_per_doc = 2 * c
    local_len = int(slots_per_doc.sum())
    doc_of_slot = torch.repeat_interleave(torch.arange(lengths.numel()), slots_per_doc)
    doc_start_slot = torch.cumsum(slots_per_doc, 0) - slots_per_doc
    offset = torch.arange(local_len) - doc_start_slot[doc_of_slot]
    cs, L = c[doc_of_slot], lengths[doc_of_slot]
    second = offset >= cs
    j = offset - second.long() * cs  # index inside the chunk
    gidx, doc, pos = (torch.full((world, local_len), -1, dtype=torch.int64) for _ in range(3))
    for r in range(world):
        chunk = torch.where(second, n - 1 - r, r)
        start = chunk * L // n
        size = (chunk + 1) * L // n - start
        real = j < size
        p = start + j
        pos[r] = torch.where(real, p, -1)
        doc[r] = torch.where(real, doc_of_slot, -1)
        gidx[r] = torch.where(real, cu[doc_of_slot] + p, -1)
    return gidx, doc, pos


def _build_contiguous(cu: torch.Tensor, world: int):
    """Equal contiguous slices of the stream; the stream is padded at its end."""
    total = int(cu[-1])
    local_len = -(-total // world)
    g = torch.arange(world * local_len).view(world, local_len)
    real = g < total
    d = torch.searchsorted(cu, g.clamp(max=max(total - 1, 0)), right=True) - 1
    d = d.clamp(max=cu.numel() - 2)
    pos = torch.where(real, g - cu[d.clamp(min=0)], -1)
    return torch.where(real, g, -1), torch.where(real, d, -1), pos
