"""Supervised fine-tuning: ``python -m trainers.sft`` or ``torchrun ... -m trainers.sft``.

Loss: the mean of ``-log p(response token)`` over every response token of the global batch
(prompt tokens excluded, EOS included), whatever the number of ranks or micro-batches. It is
computed from the final hidden states by ``linear_nll_loss`` (no ``[tokens x vocab]`` logits),
on packed micro-batches planned by ``plan_micro_batches`` (``--no-packing``: padded ones).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from trainers import common, data
from trainers.config import TrainConfig
from trainers.distributed import Layout, sum_across
from trainers.engine import accumulate, optimizer_step


@dataclass
class SFTConfig(TrainConfig):
    output_key: str = field(default="response", metadata={"help": "column holding the response"})
    output_dir: str = field(
        default="runs/sft",
        metadata={"help": "metrics.jsonl, TensorBoard, plot, checkpoints and the model"},
    )


@dataclass
class Sample:
    ids: torch.Tensor  # (n,) prompt + response + EOS
    targets: torch.Tensor  # (n,) next-token targets, -100 outside the response

    @property
    def n_targets(self) -> int:
        return int((self.targets != -100).sum())


def tokenize(rows, tokenizer, cfg: SFTConfig) -> tuple[list[Sample], int]:
    """Dataset rows -> samples (and the number dropped because the prompt fills --max-len)."""
    out, dropped = [], 0
    for row in rows:
        enc = data.tokenize_sft(
            tokenizer,
            row[cfg.input_key],
            row[cfg.output_key],
            cfg.max_len,
            cfg.input_template,
            cfg.apply_chat_template,
        )
        if enc is None:
            dropped += 1
            continue
        ids = torch.tensor(enc["input_ids"], dtype=torch.long)
        mask = torch.tensor(enc["loss_mask"], dtype=torch.long)
        out.append(Sample(ids, common.shifted_targets(ids, mask)))
    return out, dropped


def micro_batch(samples: list[Sample], cfg: SFTConfig, layout: Layout, pad_id: int):
    """Model inputs (``labels`` = next-token targets aligned with the inputs) for this rank."""
    if not samples:  # an empty micro-batch (fewer samples than ranks): one token, no target
        samples = [Sample(torch.tensor([pad_id]), torch.tensor([-100]))]
    seqs = [s.ids for s in samples]
    if cfg.no_packing:
        mb = common.padded_inputs(seqs, pad_id, layout)
        labels = torch.full_like(mb.inputs["input_ids"], -100)
        for b, s in enumerate(samples):
            labels[b, : len(s.ids)] = s.targets
    else:
        mb, extras, _ = common.packed_inputs(seqs, {"t": [s.targets for s in samples]}, cfg, layout)
        labels = extras["t"][None]
        if mb.ring_plan is not None:
            r = layout.ring_rank
            labels = mb.ring_plan.shard(extras["t"], r).masked_fill(
                ~mb.ring_plan.valid_mask(r), -100
            )[None]
    mb.inputs["labels"] = labels.to(layout.device)
    return mb


def run_batch(engine, samples: list[Sample], cfg, layout, pad_id, train: bool) -> dict:
    """One global batch on this rank: forward (+ backward) of its micro-batches.

    Returns the batch's totals summed over the job: nll, target tokens, real tokens, slots.
    """
    n_targets = sum(s.n_targets for s in samples)
    plan = common.my_micro_batches([len(s.ids) for s in samples], cfg, layout)
    nll_sum, slots = 0.0, 0
    for i, idx in enumerate(plan):
        mb = micro_batch([samples[j] for j in idx], cfg, layout, pad_id)
        # the backward too runs in the ring context: checkpointed layers recompute ring attention
        with mb.context(layout), torch.set_grad_enabled(train):
            nll = engine(**mb.inputs)
            if train:  # DeepSpeed averages over its dp x ring ranks: scale back to a global sum
                scale = layout.ds_dp_size / max(n_targets, 1)
                accumulate(engine, nll * scale, i == len(plan) - 1)
        nll_sum += nll.item()
        slots += mb.slots
    # summed over every rank: tp ranks repeat the same numbers, ring ranks split the tokens
    nll_sum, slots = sum_across([nll_sum / layout.tp, slots / layout.tp], layout)
    tokens = sum(len(s.ids) for s in samples)
    return {"nll": nll_sum, "targets": n_targets, "tokens": tokens, "slots": slots}


def evaluate(engine, samples: list[Sample], cfg, layout, pad_id) -> dict:
    engine.eval()
    nll = targets = 0.0
    for start in range(0, len(samples), cfg.batch_size):
        r = run_batch(engine, samples[start : start + cfg.batch_size], cfg, layout, pad_id, False)
        nll, targets = nll + r["nll"], targets + r["targets"]
    engine.train()
    return {"eval_loss": nll / max(targets, 1)}


def train(cfg: SFTConfig) -> dict:
    from trainers.session import Session

    s = Session.start(cfg, "sft")
    train_set, eval_set = s.load_data(
        {"--input-key": cfg.input_key, "--output-key": cfg.output_key},
        lambda rows: tokenize(rows, s.tokenizer, cfg),
        lengths=lambda sample: len(sample.ids),
    )
    eos = s.tokenizer.eos_token_id
    cut = sum(1 for smp in train_set if int(smp.ids[-1]) != eos)
    if cut:  # the start is kept: the model never sees these samples end
        s.print(f"{cut} training samples are cut at --max-len {cfg.max_len} (no EOS trained)")
    from trainers.modeling import CausalLMLoss

    lm = s.load_causal_lm()
    engine, start = s.build(CausalLMLoss(lm))
    engine.train()  # from_pretrained returns eval mode: the config's dropout applies in training
    pad = s.tokenizer.pad_token_id
    metrics = {}
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
        metrics = {
            "loss": r["nll"] / max(r["targets"], 1),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": r["tokens"],
            "target_tokens": r["targets"],
            "tokens_per_s": r["tokens"] / dt,
            "padding_fraction": 1.0 - r["tokens"] / max(r["slots"], 1),
            "step_s": dt,
        }
        if eval_set and s.is_eval_step(step):
            metrics.update(evaluate(engine, eval_set, cfg, s.layout, pad))
        s.end_step(step, metrics, engine)
    s.finish(engine, lm, prefix="lm.", plot=[("loss", "eval_loss"), ("lr",), ("tokens_per_s",)])
    return metrics


def main(argv=None) -> dict:
    from trainers.cli import parse_config

    cfg = parse_config(
        SFTConfig,
        argv,
        prog="python -m trainers.sft",
        description="Supervised fine-tuning of a Hugging Face causal LM on packed, token-budget "
        "micro-batches (DeepSpeed ZeRO / AutoTP, ring attention). Loss only on response tokens.",
    )
    return train(cfg)


def cli() -> None:
    """The ``rlhf-sft`` command: :func:`main` without its return value (exit code 0)."""
    main()


if __name__ == "__main__":
    main()
