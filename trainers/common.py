"""Pieces the SFT and RM loops share: start-up checks, batches, micro-batch inputs, evaluation
reduction. Each trainer's loop stays in its own file."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rlhf_kernels.packing import IGNORE_INDEX, pack_sequences, plan_micro_batches
from trainers.distributed import Layout, all_ranks_ok


def fail(message: str, code: int = 2) -> None:
    """One clear line on stderr and a non-zero exit (every rank calls it with the same error)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_output_dir(path: str, layout: Layout | None, cfg=None) -> None:
    """Collective: every rank learns whether ``path`` is a writable folder before heavy work.
    A fresh run (no ``--resume``) refuses a folder holding an earlier run's checkpoints, which a
    later ``--resume`` would take for its own, unless ``--overwrite`` (then
    :func:`clear_checkpoints` deletes them once the run's inputs have passed their checks)."""
    from trainers.checkpoint import checkpoint_root, latest_checkpoint
    from trainers.logger import METRICS_FILE

    message = ""
    resume, overwrite = bool(getattr(cfg, "resume", False)), bool(getattr(cfg, "overwrite", False))
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        root, metrics = checkpoint_root(path), Path(path) / METRICS_FILE
        for folder in (Path(path), root) if root.exists() else (Path(path),):
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=folder)  # a unique name:
            os.close(fd)  # ranks of several nodes (same pids in containers) share the folder
            os.unlink(probe)
        old = latest_checkpoint(path)
        if metrics.exists() and not metrics.is_file():
            message = f"--output-dir {path!r}: {metrics} is not a file"
        elif resume and overwrite:
            message = "give --resume or --overwrite, not both"
        elif old is not None and not resume and not overwrite:
            message = (
                f"--output-dir {path!r} holds checkpoints of an earlier run (newest: {old.name}); "
                "pass --resume to continue it, or --overwrite to start fresh and delete them"
            )
    except OSError as e:
        message = f"--output-dir {path!r} is not a writable folder ({e.strerror or e})"
    all_ranks_ok(not message, message, layout)


def clear_checkpoints(path: str, layout: Layout | None) -> None:
    """Collective: rank 0 deletes ``path``'s checkpoints (``--overwrite``): first one atomic
    rename out of the way (a kill midway cannot leave a half-deleted checkpoint that a later
    ``--resume`` would take), then the deletion; every rank fails if the rename does."""
    from trainers.checkpoint import checkpoint_root

    root, message = checkpoint_root(path), ""
    if (layout is None or layout.rank == 0) and root.exists():
        trash = root.with_name(f".deleting-checkpoints-{os.getpid()}-{time.time_ns()}")
        try:
            os.replace(root, trash)
        except OSError as e:
            message = f"--overwrite: cannot move {root} out of the way ({e.strerror or e})"
        else:
            shutil.rmtree(trash, ignore_errors=True)
            if trash.exists():  # out of the way already: only disk space is lost
                print(f"warning: --overwrite could not delete all of {trash}", file=sys.stderr)
    all_ranks_ok(not message, message, layout)  # also: nobody saves before rank 0 is done


# ----------------------------------------------------------------------------- batches
def reward_positions(seqs: list[torch.Tensor], pad_id: int | None) -> list[int]:
    """Per sequence, the index of the token a reward model reads: the last one that is not
    ``pad_id``, as transformers' ``*ForSequenceClassification`` does (with pad == EOS: the
    token before a final EOS); the last token when ``pad_id`` is None or every token is pad."""
    out = []
    for s in seqs:
        keep = (s != pad_id).nonzero() if pad_id is not None else None
        out.append(int(keep[-1]) if keep is not None and len(keep) else len(s) - 1)
    return out


def total_steps(n_train: int, cfg) -> int:
    per_epoch = n_train // cfg.batch_size
    if per_epoch == 0:
        raise ValueError(
            f"--batch-size ({cfg.batch_size}) is larger than the training set ({n_train} samples)"
        )
    # --max-steps replaces --epochs (as in HF's Trainer and our PPO): past the data's end the
    # steps take further seeded epochs (batch_indices)
    return cfg.max_steps if cfg.max_steps else per_epoch * cfg.epochs


def batch_indices(step: int, n_train: int, batch_size: int, seed: int) -> list[int]:
    """Sample indices of optimizer step ``step`` (1-based): a seeded permutation per epoch, the
    incomplete tail dropped. Depends only on its arguments, so a resumed run sees the same data."""
    per_epoch = n_train // batch_size
    epoch, i = divmod(step - 1, per_epoch)
    g = torch.Generator().manual_seed(seed * 1000003 + epoch)
    order = torch.randperm(n_train, generator=g)
    return order[i * batch_size : (i + 1) * batch_size].tolist()


def check_lengths(lengths: list[int], budget: int, what: str) -> str:
    """'' or the error for samples longer than one micro-batch."""
    long = [(i, n) for i, n in enumerate(lengths) if n > budget]
    if not long:
        return ""
    i, n = max(long, key=lambda x: x[1])
    return (
        f"{len(long)} {what} sample(s) are longer than --micro-batch-tokens {budget} (the "
        f"longest, #{i}, has {n} tokens): raise --micro-batch-tokens or lower --max-len"
    )


def my_micro_batches(lengths: list[int], cfg, layout: Layout) -> list[list[int]]:
    """This rank's micro-batches (indices into ``lengths``). Every rank of a ring or TP group gets
    the same ones; every data-parallel rank gets the same count (some may be empty)."""
    return plan_micro_batches(lengths, cfg.micro_batch_tokens, layout.dp)[layout.dp_rank]


# ----------------------------------------------------------------------------- inputs
@dataclass
class MicroBatch:
    """Model inputs for one micro-batch, plus what the loop needs to know about them."""

    inputs: dict
    slots: int  # token slots processed on this rank (real + padding)
    ring_plan: object = None  # RingPlan when the micro-batch is split over a ring

    def context(self, layout: Layout):
        if self.ring_plan is None:
            return contextlib.nullcontext()
        from rlhf_kernels.integrations.hf import ring_context

        return ring_context(self.ring_plan, layout.ring_group)


def packed_inputs(
    seqs: list[torch.Tensor], per_token: dict[str, list[torch.Tensor]], cfg, layout: Layout
) -> tuple[MicroBatch, dict[str, torch.Tensor], object]:
    """Pack ``seqs`` into one ``[1, T]`` row (or this rank's ring shard of it).

    ``per_token``: other per-token tensors to pack alongside (``name -> n tensors``); they come
    back packed over the whole stream (not sharded). Returns (micro-batch, packed extras,
    PackedBatch).
    """
    packed = pack_sequences(seqs)
    extras = {k: packed.pack(v) for k, v in per_token.items()}
    dev = layout.device
    if layout.ring == 1:
        inputs = {
            "input_ids": packed.input_ids.long()[None].to(dev),
            "position_ids": packed.position_ids[None].to(dev),
            "cu_seq_lens_q": packed.cu_seqlens.to(dev),
            "cu_seq_lens_k": packed.cu_seqlens.to(dev),
            "max_length_q": packed.max_seqlen,
            "max_length_k": packed.max_seqlen,
        }
        return MicroBatch(inputs, packed.num_tokens), extras, packed
    from rlhf_kernels.ring.plan import RingPlan

    plan = RingPlan.build(packed.cu_seqlens, layout.ring, cfg.ring_layout)
    r = layout.ring_rank
    inputs = {
        "input_ids": plan.shard(packed.input_ids.long(), r)[None].to(dev),
        "position_ids": plan.position_ids(r)[None].to(dev),
    }
    return MicroBatch(inputs, plan.local_len, plan), extras, packed


def padded_inputs(seqs: list[torch.Tensor], pad_id: int, layout: Layout) -> MicroBatch:
    """Right-padded ``[B, S]`` batch with attention mask (``--no-packing``)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)], mask[b, : len(s)] = s, 1
    pos = torch.arange(width).expand(len(seqs), -1)
    inputs = {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
    return MicroBatch({k: v.to(layout.device) for k, v in inputs.items()}, ids.numel())


def shifted_targets(ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Next-token targets of one sample: ``out[t] = ids[t + 1]`` where ``loss_mask[t + 1]``."""
    out = torch.full_like(ids, IGNORE_INDEX)
    out[:-1] = ids[1:].masked_fill(loss_mask[1:] == 0, IGNORE_INDEX)
    return out
