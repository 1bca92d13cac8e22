"""Typed configs shared by the trainers. The CLI and ``--config FILE.yaml`` both fill them
(``trainers.cli.parse_config``); ``--help`` is generated from the ``help`` metadata below."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields


def _f(default, help: str, **meta):
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class TrainConfig:
    """Flags every trainer shares (model, data, batching, parallelism, checkpoints, logging)."""

    # model
    model: str | None = _f(
        None, "local Hugging Face model folder (default: the bundled tiny Llama)"
    )
    # data (OpenRLHF's prompt_split / eval_split are --split / --eval-split)
    dataset: str | None = _f(
        None,
        "comma-separated .jsonl/.json/.parquet/.csv files or save_to_disk folders "
        "(default: the bundled toy set of this trainer)",
    )
    dataset_probs: str | None = _f(None, "comma-separated mixing probabilities, one per dataset")
    split: str = _f("train", "split of --dataset that trains (plain files have only 'train')")
    eval_dataset: str | None = _f(None, "separate evaluation data (same formats as --dataset)")
    eval_split: str | None = _f(
        None,
        "split that evaluates: of --eval-dataset ('train' when unset), else of --dataset "
        "(must differ from --split)",
    )
    eval_ratio: float = _f(
        0.05,
        "without --eval-dataset or --eval-split, hold out this seeded fraction of --dataset "
        "for evaluation (never trained on); 0 disables evaluation",
    )
    max_samples: int | None = _f(
        None, "use at most this many rows of --dataset (an --eval-ratio holdout comes out of them)"
    )
    input_key: str = _f(
        "prompt",
        "column holding the prompt (text, or chat messages with --apply-chat-template)",
    )
    input_template: str | None = _f(
        None,
        "prompt template for str.format with one '{}' where the prompt goes, e.g. $'Q: {}\\nA: ' "
        "in bash for a newline (literal braces: '{{' '}}')",
    )
    apply_chat_template: bool = _f(False, "wrap the prompt with the tokenizer's chat template")
    max_len: int = _f(
        512,
        "truncate each sample (prompt + response + EOS) to this many tokens (one whose prompt "
        "alone fills it is dropped; the run counts both)",
    )
    # batching
    batch_size: int = _f(
        32, "global batch in samples per optimizer step, whatever the number of ranks"
    )
    micro_batch_tokens: int = _f(
        2048,
        "token budget of one packed micro-batch (per ring group: the ring splits it); "
        "micro-batches are planned by plan_micro_batches and balanced across data-parallel ranks",
    )
    no_packing: bool = _f(
        False,
        "padded micro-batches (each to its longest sample; same samples and plan) with the "
        "model's default attention (SDPA or eager), for comparison, or for models whose layers "
        "do not call transformers' AttentionInterface (Bloom, CodeGen)",
    )
    # parallelism
    ring_attn_size: int = _f(1, "ranks per ring-attention (sequence-parallel) group")
    ring_layout: str = _f("zigzag", "token placement on the ring", choices=("zigzag", "contiguous"))
    zero_stage: int = _f(0, "DeepSpeed ZeRO stage", choices=(0, 1, 2, 3))
    offload: bool = _f(False, "optimizer states on the CPU (DeepSpeed offload; --zero-stage 1-3)")
    tp_size: int = _f(1, "DeepSpeed AutoTP tensor-parallel size")
    dtype: str = _f(
        "fp32", "training dtype (bf16: bf16 weights, fp32 master copy)", choices=("fp32", "bf16")
    )
    gradient_checkpointing: bool = _f(False, "recompute activations in the backward pass")
    # optimisation
    lr: float = _f(5e-4, "AdamW peak learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    warmup_steps: int = _f(0, "linear warm-up steps")
    lr_scheduler: str = _f(
        "cosine",
        "decay after warm-up (cosine: toward 10% of --lr, reached after the last step)",
        choices=("cosine", "constant"),
    )
    max_grad_norm: float = _f(1.0, "gradient clipping by global norm (0 disables)")
    epochs: int = _f(1, "passes over the training data")
    max_steps: int | None = _f(
        None,
        "train this many optimizer steps, replacing --epochs (more than one pass takes further "
        "seeded passes; default: --epochs passes)",
    )
    seed: int = _f(0, "seed for data order, held-out split and initialisation")
    # outputs
    output_dir: str = _f("runs/sft", "metrics.jsonl, TensorBoard, plot, checkpoints and the model")
    save_steps: int = _f(
        0,
        "save a resumable checkpoint every N steps (0: none; the final weights always go to "
        "<output-dir>/model)",
    )
    save_total_limit: int = _f(
        0,
        "keep only the newest N checkpoints, deleting older ones after each save (0: keep all; "
        "needs --save-steps)",
    )
    eval_steps: int = _f(0, "evaluate every N steps (0: only at the end)")
    resume: bool = _f(
        False,
        "continue from the newest checkpoint in --output-dir (one whose save finished; an "
        "unreadable one stops the run with what to delete)",
    )
    overwrite: bool = _f(
        False,
        "start fresh in an --output-dir holding an earlier run's checkpoints, deleting them "
        "(without it, or --resume, such a folder is refused)",
    )
    logger: str = _f(
        "tensorboard",
        "metrics sink besides metrics.jsonl",
        choices=("tensorboard", "wandb", "none"),
    )
    timeout_s: int = _f(600, "seconds a collective may wait before the job fails")

    def validate(self) -> None:
        """Local checks (no model or data needed): ValueError naming the flag."""
        for f in fields(self):  # argparse's float() takes 'nan' and 'inf'
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, got {v}")
        positive = (
            "batch_size",
            "micro_batch_tokens",
            "max_len",
            "ring_attn_size",
            "tp_size",
            "epochs",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}"
                )
        for name in ("max_steps", "max_samples"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        for name in ("save_steps", "save_total_limit", "eval_steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}"
                )
        if self.save_total_limit and not self.save_steps:  # it prunes after each save only
            raise ValueError(
                f"--save-total-limit {self.save_total_limit} needs --save-steps N (no "
                f"checkpoint is saved without it)"
            )
        for f in fields(self):  # an unset shell variable: --dataset "$DATA"
            v = getattr(self, f.name)
            if isinstance(v, str) and not v.replace(",", "").strip():
                raise ValueError(
                    f"--{f.name.replace('_', '-')} is empty ({v!r}); leave the flag out for the "
                    f"default"
                )
        if not 0.0 <= self.eval_ratio < 1.0:
            raise ValueError(f"--eval-ratio must be in [0, 1), got {self.eval_ratio}")
        if self.logger == "wandb":  # here: not after the model is built and outputs are opened
            try:
                import wandb  # noqa: F401
            except ImportError as e:
                raise ValueError(
                    f"--logger wandb needs the wandb package ({e}): `pip install wandb`, or use "
                    f"--logger tensorboard"
                ) from None
        if not 0 <= self.seed < 2**32:  # numpy's seed range
            raise ValueError(f"--seed must be in [0, 2**32), got {self.seed}")
        if self.timeout_s < 1:
            raise ValueError(f"--timeout-s must be >= 1 (seconds), got {self.timeout_s}")
        no_eval = self.eval_ratio == 0 and self.eval_dataset is None and self.eval_split is None
        if self.eval_steps and no_eval:
            raise ValueError(
                f"--eval-steps {self.eval_steps} evaluates held-out data, and this run has none: "
                f"give --eval-ratio > 0, --eval-dataset or --eval-split"
            )
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError(
                f"--weight-decay and --max-grad-norm must be >= 0, got {self.weight_decay}, "
                f"{self.max_grad_norm}"
            )
        if self.offload and self.zero_stage == 0:
            raise ValueError(
                "--offload keeps ZeRO's optimizer partitions on the CPU: it needs --zero-stage "
                "1, 2 or 3, got 0"
            )
        if self.tp_size > 1 and self.zero_stage == 3:
            raise ValueError(
                f"--tp-size {self.tp_size} cannot be combined with --zero-stage 3 (DeepSpeed "
                "0.19.8 rejects the batch sizes of AutoTP under ZeRO-3); use --zero-stage 0, 1 or 2"
            )
        from trainers.data import check_template

        check_template(self.input_template, "--input-template")
        if self.no_packing and self.ring_attn_size > 1:
            raise ValueError(
                "--no-packing cannot be combined with --ring-attn-size > 1 "
                "(the ring splits one packed stream)"
            )
