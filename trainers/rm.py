"""Reward model: ``python -m trainers.rm`` or ``torchrun ... -m trainers.rm``.

A scalar ``score`` head on the causal LM (``AutoModelForSequenceClassification``,
``num_labels=1``), trained on preference pairs with ``-logsigmoid(r_chosen - r_rejected
[- margin])``. Each pair's chosen and rejected sequences are packed together in one micro-batch;
the reward is read at each sequence's last token (its EOS). The saved folder reloads with
``AutoModelForSequenceClassification.from_pretrained`` and carries ``reward_mean`` /
``reward_std`` (over the evaluation rewards) in its config for normalisation.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainers import common, data
from trainers.config import TrainConfig
from trainers.distributed import Layout, sum_across
from trainers.engine import accumulate, optimizer_step


@dataclass
class RMConfig(TrainConfig):
    prompt_key: str | None = field(
        default=None, metadata={"help": "column holding the prompt (default: --input-key)"}
    )
    chosen_key: str = field(default="chosen", metadata={"help": "column of preferred responses"})
    rejected_key: str = field(default="rejected", metadata={"help": "column of rejected ones"})
    margin_key: str | None = field(
        default=None,
        metadata={"help": "optional column of margins: loss -logsigmoid(r_c - r_r - margin)"},
    )
    lr: float = field(default=1e-3, metadata={"help": "AdamW peak learning rate"})
    output_dir: str = field(
        default="runs/rm",
        metadata={"help": "metrics.jsonl, TensorBoard, plot, checkpoints and the model"},
    )


@dataclass
class Pair:
    chosen: torch.Tensor  # (n_c,) prompt + chosen + EOS
    rejected: torch.Tensor  # (n_r,)
    margin: float = 0.0


def tokenize(rows, tokenizer, cfg: RMConfig, same: list | None = None):
    """Rows -> ``(pairs, dropped)``: ``dropped`` counts prompts filling --max-len; pairs whose
    chosen and rejected tokenize the same are left out, their count appended to ``same``."""
    out, dropped, equal = [], 0, 0
    pk = cfg.prompt_key or cfg.input_key
    for row in rows:
        enc = data.tokenize_pair(
            tokenizer,
            row[pk],
            row[cfg.chosen_key],
            row[cfg.rejected_key],
            cfg.max_len,
            cfg.input_template,
            cfg.apply_chat_template,
        )
        if enc is None:
            dropped += 1
            continue
        if enc["chosen_ids"] == enc["rejected_ids"]:  # no preference to learn (maybe cut short)
            equal += 1
            continue
        margin = float(row[cfg.margin_key]) if cfg.margin_key else 0.0
        out.append(Pair(torch.tensor(enc["chosen_ids"]), torch.tensor(enc["rejected_ids"]), margin))
    if same is not None:
        same.append(equal)
    return out, dropped


def equal_pairs_reason(same: list[int], max_len: int) -> str | None:
    """Why no training pair is left when the training rows' (first) count of equal pairs says so
    (the error used to blame --max-len alone)."""
    if not same or not same[0]:
        return None
    return (
        f"no pair to learn from: {same[0]} training pairs have chosen and rejected of the same "
        f"tokens (maybe cut to --max-len {max_len}), the others' prompts fill --max-len"
    )


class _RingSum(torch.autograd.Function):
    """All-reduce-sum over the ring whose backward is the identity: every rank seeds the
    gradient of its own contributions only (ring attention carries the rest)."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


def rewards(
    engine, pairs: list[Pair], cfg, layout: Layout, pad_id: int, scope: contextlib.ExitStack
) -> torch.Tensor:
    """``(2 * n,)`` rewards of ``pairs`` (chosen, rejected interleaved) from one forward.

    A ring shard's ``ring_context`` is entered on ``scope``: keep it open through the backward
    (gradient checkpointing recomputes ring attention there)."""
    seqs = [s for p in pairs for s in (p.chosen, p.rejected)]
    # where the saved model's AutoModelForSequenceClassification reads (pad == EOS included)
    at = common.reward_positions(seqs, pad_id)
    if cfg.no_packing:
        mb = common.padded_inputs(seqs, pad_id, layout)
        width = mb.inputs["input_ids"].shape[1]
        last = torch.tensor([b * width + a for b, a in enumerate(at)])
        return engine(**mb.inputs, last_index=last.to(layout.device))
    mb, _, packed = common.packed_inputs(seqs, {}, cfg, layout)
    last = packed.cu_seqlens[:-1].long() + torch.tensor(at)
    if mb.ring_plan is None:
        return engine(**mb.inputs, last_index=last.to(layout.device))
    # ring: each sequence's last token lives on one rank; the others add zeros
    plan, r = mb.ring_plan, layout.ring_rank
    gidx = plan.shard(torch.arange(plan.total), r)
    slots = (plan.valid_mask(r) & torch.isin(gidx, last)).nonzero().flatten()
    docs = torch.searchsorted(last, gidx[slots])
    scope.enter_context(mb.context(layout))
    local = engine(**mb.inputs, last_index=slots.to(layout.device))
    full = local.new_zeros(len(seqs)).index_add(0, docs.to(local.device), local)
    return _RingSum.apply(full, layout.ring_group)


def run_batch(engine, pairs: list[Pair], cfg, layout, pad_id, train: bool) -> dict:
    """One global batch on this rank; returns totals over the job (loss sum, correct, ...)."""
    n_pairs = len(pairs)
    plan = common.my_micro_batches([len(p.chosen) + len(p.rejected) for p in pairs], cfg, layout)
    loss_sum = correct = r_sum = r_sq = 0.0
    for i, idx in enumerate(plan):
        mine = [pairs[j] for j in idx] or [Pair(torch.tensor([pad_id]), torch.tensor([pad_id]))]
        with contextlib.ExitStack() as scope, torch.set_grad_enabled(train):
            r = rewards(engine, mine, cfg, layout, pad_id, scope).view(-1, 2)
            margin = torch.tensor([p.margin for p in mine], device=r.device)
            loss = -F.logsigmoid(r[:, 0] - r[:, 1] - margin)
            if not idx:  # padding micro-batch: graph for the ZeRO hooks, no contribution
                loss = loss * 0.0
            if train:
                scale = layout.ds_dp_size / n_pairs
                accumulate(engine, loss.sum() * scale, i == len(plan) - 1)
        if idx:
            r = r.detach().double()
            loss_sum += loss.sum().item()
            correct += (r[:, 0] > r[:, 1]).sum().item()  # a tie counts as wrong
            r_sum, r_sq = r_sum + r.sum().item(), r_sq + (r * r).sum().item()
    # tp ranks repeat the same numbers, ring ranks all hold the ring-summed rewards
    rep = layout.tp * layout.ring
    totals = sum_across([x / rep for x in (loss_sum, correct, r_sum, r_sq)], layout)
    return dict(zip(("loss", "correct", "r_sum", "r_sq"), totals), pairs=n_pairs)


def evaluate(engine, pairs: list[Pair], cfg, layout, pad_id) -> dict:
    engine.eval()
    tot = {"loss": 0.0, "correct": 0.0, "r_sum": 0.0, "r_sq": 0.0, "pairs": 0}
    for start in range(0, len(pairs), cfg.batch_size):
        r = run_batch(engine, pairs[start : start + cfg.batch_size], cfg, layout, pad_id, False)
        tot = {k: tot[k] + r[k] for k in tot}
    engine.train()
    n = max(tot["pairs"], 1)
    mean = tot["r_sum"] / (2 * n)
    std = math.sqrt(max(tot["r_sq"] / (2 * n) - mean * mean, 0.0))
    return {
        "eval_loss": tot["loss"] / n,
        "eval_accuracy": tot["correct"] / n,
        "eval_reward_mean": mean,
        "eval_reward_std": std,
    }


def train(cfg: RMConfig) -> dict:
    from trainers.modeling import RewardModel
    from trainers.session import Session

    s = Session.start(cfg, "rm")
    keys = {
        "--prompt-key" if cfg.prompt_key else "--input-key": cfg.prompt_key or cfg.input_key,
        "--chosen-key": cfg.chosen_key,
        "--rejected-key": cfg.rejected_key,
        "--margin-key": cfg.margin_key,
    }
    same: list[int] = []  # per dataset (train, eval): pairs of equal tokens, dropped
    train_set, eval_set = s.load_data(
        keys,
        lambda rows: tokenize(rows, s.tokenizer, cfg, same),
        lengths=lambda p: len(p.chosen) + len(p.rejected),
        why_empty=lambda: equal_pairs_reason(same, cfg.max_len),
    )
    if sum(same):
        s.print(f"dropped {sum(same)} pairs whose chosen and rejected are the same tokens")
    model = s.load_score_model()  # *ForSequenceClassification, seeded fresh score head
    engine, start = s.build(RewardModel(model))
    engine.train()  # from_pretrained returns eval mode: the config's dropout applies in training
    pad = s.tokenizer.pad_token_id
    metrics, last_eval = {}, {}
    for step in s.progress(start):
        t0 = time.perf_counter()
        batch = [
            train_set[i]
            for i in common.batch_indices(step, len(train_set), cfg.batch_size, cfg.seed)
        ]
        r = run_batch(engine, batch, cfg, s.layout, pad, train=True)
        lr = engine.get_lr()[0]
        grad_norm = optimizer_step(engine, s.layout)
        dt = time.perf_counter() - t0
        tokens = sum(len(p.chosen) + len(p.rejected) for p in batch)
        metrics = {
            "loss": r["loss"] / r["pairs"],
            "accuracy": r["correct"] / r["pairs"],
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "tokens_per_s": tokens / dt,
            "step_s": dt,
        }
        if eval_set and s.is_eval_step(step):
            last_eval = evaluate(engine, eval_set, cfg, s.layout, pad)
            metrics.update(last_eval)
        s.end_step(step, metrics, engine)
    # the saved reward statistics are the evaluation set's (computed now when no eval step ran in
    # this process, e.g. a resume with no steps left); without one, the first training pairs'
    source = "evaluation" if eval_set else f"training (first {4 * cfg.batch_size} pairs)"
    stats = last_eval or evaluate(
        engine, eval_set or train_set[: 4 * cfg.batch_size], cfg, s.layout, pad
    )
    extra = {
        "is_reward_model": True,
        "reward_mean": stats["eval_reward_mean"],
        "reward_std": stats["eval_reward_std"],
        "reward_stats_from": source,
    }
    s.finish(
        engine,
        model,
        prefix="model.",
        extra_config=extra,
        plot=[("loss", "eval_loss"), ("accuracy", "eval_accuracy"), ("lr",)],
    )
    return metrics


def main(argv=None) -> dict:
    from trainers.cli import parse_config

    cfg = parse_config(
        RMConfig,
        argv,
        prog="python -m trainers.rm",
        description="Pairwise reward-model training (Bradley-Terry loss) of a scalar head on a "
        "Hugging Face causal LM, chosen and rejected sequences packed together.",
    )
    return train(cfg)


def cli() -> None:
    """The ``rlhf-rm`` command: :func:`main` without its return value (exit code 0)."""
    main()


if __name__ == "__main__":
    main()
