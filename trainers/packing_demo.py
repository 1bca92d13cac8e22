"""``python -m trainers.packing_demo``: one tiny Llama trained with packing and with padding.

Both runs start from the same weights and see the same samples in the same micro-batches:

* packed: each micro-batch is one ``[1, T]`` row through our ``"rlhf_kernels"`` attention
  (``varlen_attention``; no mask, no padding);
* padded: the usual ``[B, max_len]`` batch with an attention mask through transformers' SDPA.

The step losses must agree (same math, different layout); the table shows how much faster the
packed run is and how much of the padded batch was padding. Exits non-zero if a loss differs by
more than ``--tol``. Everything is local: a bundled jsonl corpus and a byte-level tokenizer.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rlhf_kernels.integrations.hf import packed_model_inputs, register
from rlhf_kernels.packing import IGNORE_INDEX, plan_micro_batches

DATA = Path(__file__).parent / "data" / "toy_corpus.jsonl"


class ByteTokenizer:
    """UTF-8 bytes are tokens 0-255; then BOS, EOS and PAD."""

    bos, eos, pad = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, max_len: int) -> torch.Tensor:
        ids = [self.bos, *text.encode("utf-8"), self.eos]
        return torch.tensor(ids[:max_len], dtype=torch.long)

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def load_samples(path: Path, max_len: int) -> list[torch.Tensor]:
    """One sample per non-blank line; ValueError naming the line unless it is a JSON object with
    a text ``"text"``, or when the file has no such line (an empty corpus never fills a batch)."""
    tok = ByteTokenizer()
    samples = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ValueError(
                    f"--data {str(path)!r}: line {n}: expected a JSON object with a text 'text', "
                    f"got {line.strip()[:60]!r}"
                )
            samples.append(tok.encode(row["text"], max_len))
    if not samples:
        raise ValueError(f"--data {str(path)!r}: expected at least one JSON line, got none")
    return samples


def build_model(seed: int, max_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_len,
        pad_token_id=ByteTokenizer.pad,
        bos_token_id=ByteTokenizer.bos,
        eos_token_id=ByteTokenizer.eos,
    )
    return LlamaForCausalLM(cfg)


def padded_model_inputs(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-padded ``[B, max_len]`` batch with attention mask; labels are -100 on padding."""
    width = max(len(s) for s in samples)
    ids = torch.full((len(samples), width), ByteTokenizer.pad, dtype=torch.long)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s)], mask[b, : len(s)] = s, 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": ids.masked_fill(mask == 0, IGNORE_INDEX),
    }


@dataclass
class RunStats:
    losses: list[float] = field(default_factory=list)
    seconds: float = 0.0
    real_tokens: int = 0
    slots: int = 0  # tokens the model actually processed (real + padding)

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / max(self.seconds, 1e-9)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / max(self.slots, 1)


def train_step(model, opt, micro_batches, make_inputs, stats: RunStats, timed: bool = True) -> None:
    """One optimizer step over all micro-batches; the loss is the mean over every target token.

    ``timed=False`` (the warm-up step) records the loss but not time or token counts.
    """
    n_targets = sum(len(s) - 1 for mb in micro_batches for s in mb)
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    step_loss = 0.0
    for mb in micro_batches:
        inputs = make_inputs(mb)
        loss = model(**inputs, num_items_in_batch=n_targets, use_cache=False).loss
        loss.backward()
        step_loss += loss.item()
        if timed:
            stats.slots += inputs["input_ids"].numel()
            stats.real_tokens += sum(len(s) for s in mb)
    opt.step()
    if timed:
        stats.seconds += time.perf_counter() - t0
    stats.losses.append(step_loss)


def loss_differences(packed: RunStats, padded: RunStats) -> list[float]:
    return [abs(a - b) for a, b in zip(packed.losses, padded.losses)]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainers.packing_demo",
        description="Train a tiny Llama on a bundled toy corpus twice from the same weights: "
        "packed through rlhf_kernels' varlen attention and padded through SDPA. "
        "Prints tokens/s, padding fraction and per-step loss difference; exits 1 "
        "if a step's losses differ by more than --tol.",
    )
    p.add_argument("--steps", type=int, default=8, help="optimizer steps (default: 8)")
    p.add_argument(
        "--batch-size", type=int, default=16, help="samples per optimizer step (default: 16)"
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        default=1024,
        help="token budget of one packed micro-batch (default: 1024)",
    )
    p.add_argument(
        "--max-len",
        type=int,
        default=256,
        help="truncate samples to this many tokens (default: 256)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0, help="weights and data order (default: 0)")
    p.add_argument(
        "--tol",
        type=float,
        default=1e-4,
        help="max allowed |packed - padded| step loss (default: 1e-4)",
    )
    p.add_argument(
        "--data",
        type=Path,
        default=DATA,
        help="jsonl file with a 'text' field per line (default: bundled toy corpus)",
    )
    args = p.parse_args(argv)
    for name in ("steps", "batch_size", "max_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_len < 2 or args.max_len > args.max_tokens:
        p.error(f"--max-len must be in [2, --max-tokens={args.max_tokens}], got {args.max_len}")
    if not args.tol >= 0:  # NaN: no difference is ever > NaN, so every run "passed"
        p.error(f"--tol must be >= 0, got {args.tol}")
    if not 0 <= args.lr < math.inf:  # inf trains to NaN losses
        p.error(f"--lr must be a finite number >= 0, got {args.lr}")
    try:  # a bad corpus is refused before the models are built (an empty one hung)
        load_samples(args.data, args.max_len)
    except (OSError, ValueError) as e:
        p.error(str(e))
    return args


def run(args: argparse.Namespace) -> tuple[RunStats, RunStats]:
    from tqdm import tqdm

    register()
    samples = load_samples(args.data, args.max_len)
    base = build_model(args.seed, args.max_len)
    packed_model, padded_model = base, copy.deepcopy(base)
    packed_model.set_attn_implementation("rlhf_kernels")
    padded_model.set_attn_implementation("sdpa")
    packed_model.train(), padded_model.train()
    opts = [torch.optim.AdamW(m.parameters(), lr=args.lr) for m in (packed_model, padded_model)]
    packed, padded = RunStats(), RunStats()
    rng = random.Random(args.seed)
    order: list[int] = []
    bar = tqdm(range(args.steps), desc="training (packed vs padded)", unit="step")
    for step in bar:
        while len(order) < args.batch_size:  # (a batch may outnumber the corpus)
            order += rng.sample(range(len(samples)), len(samples))
        batch, order = [samples[i] for i in order[: args.batch_size]], order[args.batch_size :]
        plan = plan_micro_batches([len(s) for s in batch], args.max_tokens)[0]
        micro = [[batch[i] for i in mb] for mb in plan]
        timed = step > 0 or args.steps == 1  # step 0 warms up (allocator, lazy imports)
        train_step(packed_model, opts[0], micro, packed_model_inputs, packed, timed)
        train_step(padded_model, opts[1], micro, padded_model_inputs, padded, timed)
        bar.set_postfix(
            loss=f"{packed.losses[-1]:.4f}",
            diff=f"{abs(packed.losses[-1] - padded.losses[-1]):.1e}",
        )
    return packed, padded


def report(packed: RunStats, padded: RunStats) -> str:
    rows = ["step  loss (packed)  loss (padded)  |difference|"]
    for i, ((a, b), d) in enumerate(
        zip(zip(packed.losses, padded.losses), loss_differences(packed, padded))
    ):
        rows.append(f"{i:>4}  {a:>13.6f}  {b:>13.6f}  {d:>12.2e}")
    rows += [
        "",
        "run      tokens/s  padding fraction  tokens processed   (timed: steps after the first)",
        f"packed  {packed.tokens_per_s:>9.0f}  {packed.padding_fraction:>16.1%}  "
        f"{packed.slots:>16}",
        f"padded  {padded.tokens_per_s:>9.0f}  {padded.padding_fraction:>16.1%}  "
        f"{padded.slots:>16}",
        f"speed-up of packing: {packed.tokens_per_s / max(padded.tokens_per_s, 1e-9):.2f}x",
    ]
    return "\n".join(rows)


def main(argv=None) -> tuple[RunStats, RunStats]:
    """Run the demo and print the table; ``SystemExit(1)`` if the losses disagree."""
    args = parse_args(argv)
    packed, padded = run(args)
    print(report(packed, padded))
    diffs = loss_differences(packed, padded)  # a NaN loss fails (max() may skip a NaN)
    worst = math.nan if any(math.isnan(d) for d in diffs) else max(diffs)
    if not worst <= args.tol:
        print(
            f"FAIL: packed and padded losses differ by {worst:.2e} > --tol {args.tol:.1e}",
            file=sys.stderr,
        )
        raise SystemExit(1)
    print(f"OK: max |packed - padded| step loss = {worst:.2e} <= {args.tol:.1e}")
    return packed, padded


if __name__ == "__main__":
    main()
