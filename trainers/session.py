"""A trainer run's bookkeeping, so the loops in ``sft.py`` / ``rm.py`` show only training:
process groups, model and tokenizer paths, data, engine + resume, progress, metrics, checkpoints
and the final Hugging Face model.

Bad input (a missing column, an unknown split, a sample longer than a micro-batch, sizes that do
not divide) is found identically on every rank from the same files, or through a collective
check, and ends every rank with one ``error:`` line and exit code 2 before the model is built.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainers import common, data
from trainers.checkpoint import (
    OtherRankFailed,
    agree,
    check_complete,
    check_data,
    check_layout,
    latest_checkpoint,
    load_checkpoint,
    read_state,
    save_checkpoint,
)
from trainers.distributed import (
    Layout,
    all_ranks_ok,
    destroy_at_exit,
    init_distributed,
    peak_memory_mb,
)

DEFAULT_DATA = {"sft": "sft_toy.jsonl", "rm": "preference_toy.jsonl", "ppo": "prompts_toy.jsonl"}
DEFAULT_REWARD_FN = "trainers.rewards:reverse_reward"  # scores the bundled prompts' task


def checkpoint_layout(cfg, kind: str, layout: Layout) -> dict:
    """What a checkpoint's shards, optimizer state and per-rank RNG states depend on."""
    sizes = {"processes": layout.world, "dp": layout.dp, "ring": layout.ring, "tp": layout.tp}
    out = {**sizes, "zero_stage": cfg.zero_stage, "dtype": cfg.dtype, "offload": cfg.offload}
    if kind == "ppo":  # the critic's engine is saved and restored beside the actor's
        out["critic"] = cfg.advantage_estimator == "gae"
    return out


# flags that decide which samples each step trains on and how they are scored: a resumed run
# keeps the checkpoint's (model folders may move: not compared)
_DATA_FLAGS = (
    "dataset", "dataset_probs", "split", "eval_dataset", "eval_split", "eval_ratio",
    "max_samples", "input_key", "output_key", "prompt_key", "chosen_key", "rejected_key",
    "margin_key", "input_template", "apply_chat_template", "max_len", "batch_size",
    "rollout_batch_size", "n_samples_per_prompt", "reward_fn", "reward_model", "seed",
)  # fmt: skip


def checkpoint_data(cfg, digests: bool = True) -> dict:
    """This run's data flags (:data:`_DATA_FLAGS` its trainer has), saved in checkpoints; data
    paths are made absolute (``./a.jsonl`` and ``a.jsonl`` are one file), probabilities lose
    their spaces; with ``digests`` also the sha256 of the data files (read once per process:
    rank 0 alone asks for them)."""
    out = {f: getattr(cfg, f) for f in _DATA_FLAGS if hasattr(cfg, f)}
    if out.get("dataset_probs"):  # '0.7, 0.3' is '0.7,0.3'
        out["dataset_probs"] = ",".join(p.strip() for p in out["dataset_probs"].split(","))
    if out.get("reward_model"):
        out["reward_model"] = os.path.abspath(out["reward_model"])
    for key in ("dataset", "eval_dataset"):
        if out.get(key):
            parts = [p.strip() for p in out[key].split(",") if p.strip()]
            out[key] = ",".join(os.path.abspath(p) for p in parts)
            if digests:  # what the files hold: a moved copy is the same data, an edit is not
                out[key + "_sha256"] = ",".join(data_digest(p) for p in out[key].split(","))
    return out


def data_digest(path: str) -> str:
    """sha256 of a data file, or of a ``save_to_disk`` folder's files (names and bytes); '' when
    there is nothing to read (the data loader names the missing path)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return _digest(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _digest(path: str, size: int, mtime_ns: int) -> str:  # size / mtime: the cache key
    import hashlib

    h = hashlib.sha256()
    files = (
        sorted(p for p in Path(path).rglob("*") if p.is_file())
        if os.path.isdir(path)
        else [Path(path)]
    )
    for f in files:
        h.update(str(f.relative_to(path) if f != Path(path) else "").encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def apply_optimizer_flags(engine, lr: float, weight_decay: float) -> None:
    """After a resume: this run's ``--lr`` (or ``--critic-lr``) and ``--weight-decay`` replace
    the checkpoint's, as the schedule flags do (the schedule's factor is a function of the
    flags, its step count comes from the checkpoint)."""
    sched = engine.lr_scheduler
    sched.base_lrs = [lr] * len(sched.base_lrs)
    for group, factor in zip(sched.optimizer.param_groups, sched.lr_lambdas):
        group["lr"] = lr * factor(sched.last_epoch)
        group["weight_decay"] = weight_decay
    sched._last_lr = [group["lr"] for group in sched.optimizer.param_groups]


def _position_table(mcfg) -> int | None:
    """Rows of a learned absolute position table (GPT-2's ``n_positions``, OPT / GPT-Neo's
    ``max_position_embeddings``): a longer sample indexes past it. None for RoPE / ALiBi models,
    whose ``max_position_embeddings`` is no hard limit."""
    if getattr(mcfg, "n_positions", None):
        return int(mcfg.n_positions)
    if getattr(mcfg, "model_type", None) in ("opt", "gpt_neo"):
        return int(mcfg.max_position_embeddings)
    return None


@dataclass
class Session:
    cfg: Any
    kind: str
    layout: Layout
    model_path: str
    tokenizer: Any
    logger: Any = None  # opened by progress(): see _open_outputs
    total: int = 0
    critic: Any = None  # a second engine saved in checkpoints (PPO's critic)

    # ------------------------------------------------------------------------- start
    @classmethod
    def start(cls, cfg, kind: str) -> Session:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        from trainers.prebuild import use_prebuilt_ops

        use_prebuilt_ops()
        try:
            layout = init_distributed(cfg.ring_attn_size, cfg.tp_size, cfg.timeout_s)
        except ValueError as e:
            common.fail(str(e))
        try:
            common.check_output_dir(cfg.output_dir, layout, cfg)
            # every rank reads the same file: all fail together, before config.json or a model
            if cfg.resume and (ckpt := latest_checkpoint(cfg.output_dir)) is not None:
                saved_layout = checkpoint_layout(cfg, kind, layout)
                check_layout(ckpt, saved_layout)
                problem = ""  # rank 0 reads the data files' digests, every rank hears
                if layout.rank == 0:
                    try:
                        check_data(ckpt, checkpoint_data(cfg))
                    except ValueError as e:
                        problem = str(e)
                all_ranks_ok(not problem, problem, layout)
                tags = ["engine"] + (["critic"] if saved_layout.get("critic") else [])
                problem = ""  # this rank's RNG file may be the missing piece: every rank hears
                try:
                    check_complete(ckpt, tags, layout.rank)
                except ValueError as e:
                    problem = str(e)
                all_ranks_ok(not problem, problem, layout)
        except ValueError as e:
            common.fail(str(e))
        common.seed_everything(cfg.seed)
        model_path = cfg.model
        if model_path is None:
            from trainers.tiny import ensure_tiny

            model_path = ensure_tiny()  # race-safe: every rank may build, one folder wins
        from transformers import AutoConfig, AutoTokenizer

        try:
            mcfg = AutoConfig.from_pretrained(model_path)
            tokenizer = AutoTokenizer.from_pretrained(model_path)
        except (OSError, ValueError) as e:
            common.fail(f"--model {model_path!r} is not a local Hugging Face model folder: {e}")
        heads = getattr(mcfg, "num_attention_heads", None)
        kv = getattr(mcfg, "num_key_value_heads", None) or heads
        if cfg.tp_size > 1 and heads and (heads % cfg.tp_size or kv % cfg.tp_size):
            common.fail(
                f"--tp-size {cfg.tp_size} must divide the model's attention heads ({heads}) "
                f"and key/value heads ({kv})"
            )
        if not cfg.no_packing:
            fix = "PPO always packs: it cannot train them" if kind == "ppo" else "use --no-packing"
            _check_attention_interface(mcfg, f"--model {model_path!r}", fix)
        longest = cfg.max_len + getattr(cfg, "max_new_tokens", 0)  # PPO: prompt + response
        table = _position_table(mcfg)
        if table is not None and longest > table:
            what = "--max-len + --max-new-tokens" if kind == "ppo" else "--max-len"
            common.fail(
                f"{what} ({longest}) is longer than the model's {table} learned positions "
                f"(its config's position table): lower it"
            )
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        return cls(cfg, kind, layout, model_path, tokenizer)

    def _open_outputs(self) -> None:
        """When the loop starts (data, model and checkpoint have passed their checks, so a run
        that fails them leaves an earlier run's files alone): ``--overwrite`` deletes the old
        checkpoints, ``metrics.jsonl`` / TensorBoard / wandb open, ``config.json`` is written."""
        from trainers.cli import config_to_dict
        from trainers.logger import MetricsLogger

        cfg = self.cfg
        self.logger = MetricsLogger(
            cfg.output_dir,
            kind=cfg.logger,
            enabled=self.layout.is_main,
            run_name=f"{self.kind}-{Path(cfg.output_dir).name}",
            config=config_to_dict(cfg),
            resume=cfg.resume,
        )
        if cfg.overwrite:  # after the logger opened: a logger that fails keeps them
            try:
                common.clear_checkpoints(cfg.output_dir, self.layout)
            except ValueError as e:  # every rank hears: one error line, no traceback
                self.logger.close()
                common.fail(str(e))
        if self.layout.is_main:
            Path(cfg.output_dir, "config.json").write_text(
                json.dumps(config_to_dict(cfg), indent=1)
            )

    # ------------------------------------------------------------------------- data
    def _rows(self, keys: dict, what: str, check=None):
        """Training and evaluation rows. Evaluation: ``--eval-split`` (default 'train') of
        ``--eval-dataset``; without one, ``--eval-split`` of ``--dataset`` when given; else a
        seeded ``--eval-ratio`` holdout of the training rows (None with ratio 0).
        ``check(rows, name)`` sees each loaded dataset before the holdout is taken."""
        cfg = self.cfg
        path = cfg.dataset
        if path is None:
            path = data.make_default_path(DEFAULT_DATA[self.kind])
        if cfg.eval_dataset is None and cfg.eval_split == cfg.split:
            raise ValueError(
                f"--eval-split {cfg.eval_split!r} is the training split --split: evaluating on "
                "training rows; give another split, --eval-dataset, or --eval-ratio for a holdout"
            )
        rows = data.load_mixture(path, cfg.dataset_probs, cfg.split, cfg.seed, cfg.max_samples)
        data.check_keys(rows, keys, f"{what} dataset")
        # the prompt column may hold chat messages when a chat template renders them
        chat = next(iter(keys)) if cfg.apply_chat_template else None
        data.check_values(rows, keys, f"{what} dataset", chat)
        if check is not None:
            check(rows, f"--dataset (--split {cfg.split!r})")
        eval_rows = None
        if cfg.eval_dataset is not None or cfg.eval_split is not None:
            source = path if cfg.eval_dataset is None else cfg.eval_dataset
            eval_rows = data.load_mixture(source, None, cfg.eval_split or "train", cfg.seed, None)
            data.check_keys(eval_rows, keys, "evaluation dataset")
            data.check_values(eval_rows, keys, "evaluation dataset", chat)
            if check is not None:
                check(eval_rows, f"evaluation data (--eval-split {cfg.eval_split or 'train'!r})")
        read = [c for c in keys.values() if c is not None]  # the columns the trainer reads
        train, held = data.split_train_eval(rows, eval_rows, cfg.eval_ratio, cfg.seed, read)
        held_out = len(held) if eval_rows is None and held is not None else 0  # from rows
        same = len(rows) - len(train) - held_out
        if same:
            self.print(
                f"dropped {same} training rows identical to a held-out row (evaluation stays "
                f"on rows never trained on)"
            )
        return train, held

    def load_data(self, keys: dict, tokenize, lengths, why_empty=None):
        """Rows -> tokenized train and eval samples; every problem is an ``error:`` exit.
        ``why_empty()``: the trainer's reason when no training sample is left (None: its
        prompts fill ``--max-len``)."""
        cfg = self.cfg
        try:
            rows, eval_rows = self._rows(keys, "training")
            train, dropped = tokenize(rows)
            evals, eval_dropped = tokenize(eval_rows) if eval_rows is not None else ([], 0)
            if not train:
                reason = why_empty() if why_empty is not None else None
                raise ValueError(reason or f"no training sample fits --max-len {cfg.max_len}")
            problem = common.check_lengths(
                [lengths(s) for s in train + evals], cfg.micro_batch_tokens, "training/eval"
            )
            if problem:
                raise ValueError(problem)
            self.total = common.total_steps(len(train), cfg)
            self.optimizer_steps = self.total
        except (ValueError, KeyError, FileNotFoundError) as e:
            common.fail(str(e).strip("'\""))
        if dropped or eval_dropped:
            self.print(
                f"dropped {dropped} training / {eval_dropped} eval samples whose prompt fills "
                f"--max-len {cfg.max_len}"
            )
        self.print(
            f"{len(train)} training / {len(evals)} eval samples, {self.total} steps of "
            f"{cfg.batch_size} samples on {self.layout.world} rank(s) "
            f"(dp {self.layout.dp} x ring {self.layout.ring} x tp {self.layout.tp})"
        )
        return train, evals

    def load_prompts(self):
        """PPO: prompt rows for training and held-out evaluation (no tokenization up front);
        prompts longer than ``--max-len`` tokens are an error naming the row."""
        cfg = self.cfg

        def check(ds, what: str) -> None:  # before any holdout: row i is the dataset's row i
            if cfg.reward_model is None:  # the columns go to the reward function as keywords
                for col in ("prompts", "responses"):
                    if col in ds.column_names and col != cfg.input_key:
                        raise ValueError(
                            f"the {what} has a column {col!r}, which the reward function would "
                            f"get twice (it is called with prompts= and responses=): rename it"
                        )
            for i, text in enumerate(ds[cfg.input_key]):
                ids = data.render_prompt(
                    self.tokenizer, text, cfg.input_template, cfg.apply_chat_template
                )
                where = f"prompt row {i} (0-based) of the {what}, {str(text)[:40]!r},"
                if not ids:  # generation needs at least one token to condition on
                    raise ValueError(f"{where} has no tokens (an empty prompt)")
                if len(ids) > cfg.max_len:
                    raise ValueError(
                        f"{where} has {len(ids)} tokens, more than --max-len {cfg.max_len}"
                    )
                if len(ids) + cfg.max_new_tokens > cfg.micro_batch_tokens:
                    raise ValueError(
                        f"{where} {len(ids)} tokens, + --max-new-tokens {cfg.max_new_tokens} "
                        f"exceeds --micro-batch-tokens {cfg.micro_batch_tokens}"
                    )

        try:
            rows, eval_rows = self._rows({"--input-key": cfg.input_key}, "prompt", check)
            rows = [dict(r) for r in rows]
            eval_rows = [dict(r) for r in eval_rows] if eval_rows is not None else []
            if cfg.rollout_batch_size % self.layout.dp:
                raise ValueError(
                    f"--rollout-batch-size {cfg.rollout_batch_size} must be a "
                    f"multiple of the data-parallel size {self.layout.dp}"
                )
            if cfg.batch_size % self.layout.dp:  # each rank trains batch_size / dp of them
                raise ValueError(
                    f"--batch-size {cfg.batch_size} must be a multiple of the data-parallel "
                    f"size {self.layout.dp}"
                )
            if len(rows) < cfg.rollout_batch_size:
                raise ValueError(
                    f"--rollout-batch-size {cfg.rollout_batch_size} is larger than "
                    f"the {len(rows)} training prompts"
                )
            self.total = cfg.max_steps or len(rows) // cfg.rollout_batch_size * cfg.epochs
            # the lr schedule counts optimizer steps: ppo_epochs x mini-batches per rollout step
            per_rollout = cfg.rollout_batch_size * cfg.n_samples_per_prompt // cfg.batch_size
            self.optimizer_steps = self.total * cfg.ppo_epochs * per_rollout
        except (ValueError, KeyError, FileNotFoundError) as e:
            common.fail(str(e).strip("'\""))
        self.print(
            f"{len(rows)} prompts / {len(eval_rows)} held out, {self.total} steps of "
            f"{cfg.rollout_batch_size} x {cfg.n_samples_per_prompt} rollouts on "
            f"{self.layout.world} rank(s) (dp {self.layout.dp} x tp {self.layout.tp})"
        )
        return rows, eval_rows

    def load_reward(self):
        """The reward function (callable) or the reward model (eval, no grad)."""
        cfg = self.cfg
        if cfg.reward_model:
            from transformers import AutoConfig, AutoModelForSequenceClassification

            try:
                rcfg = AutoConfig.from_pretrained(cfg.reward_model)
            except (OSError, ValueError) as e:
                common.fail(f"--reward-model {cfg.reward_model!r} is not a model folder: {e}")
            archs = getattr(rcfg, "architectures", None) or []
            if not (
                getattr(rcfg, "is_reward_model", False)
                or (
                    getattr(rcfg, "num_labels", 0) == 1
                    and any(a.endswith("ForSequenceClassification") for a in archs)
                )
            ):
                common.fail(
                    f"--reward-model {cfg.reward_model!r} is not a reward model (expected a "
                    f"*ForSequenceClassification with one label, as saved by trainers.rm; got "
                    f"architectures {archs})"
                )
            what = f"--reward-model {cfg.reward_model!r}"
            _check_attention_interface(rcfg, what, "not supported as reward models here")
            problem = _tokenizer_mismatch(self.tokenizer, cfg.reward_model, rcfg)
            if problem:
                common.fail(
                    f"--reward-model {cfg.reward_model!r} {problem}: it scores the policy's "
                    f"token ids, so it needs the policy's tokenizer"
                )
            from rlhf_kernels.integrations.hf import register

            model = AutoModelForSequenceClassification.from_pretrained(
                cfg.reward_model, attn_implementation=register(), dtype=torch.float32
            )
            from trainers.engine import build_frozen

            return build_frozen(model, cfg, self.layout)  # --ref-zero-stage / --ref-offload
        from trainers import rewards

        spec = cfg.reward_fn
        if spec is None:
            if cfg.dataset is not None:
                common.fail("give --reward-fn module:function or --reward-model for your data")
            spec = DEFAULT_REWARD_FN
        try:
            return rewards.load_reward_fn(spec)
        except ValueError as e:
            common.fail(str(e))

    # ------------------------------------------------------------------------- models
    def _from_pretrained(self, auto_cls, **kwargs):
        from rlhf_kernels.integrations.hf import register

        # padded: transformers' default (SDPA where the model has it, else eager)
        attn = None if self.cfg.no_packing else register()
        dtype = torch.bfloat16 if self.cfg.dtype == "bf16" else torch.float32
        out = auto_cls.from_pretrained(
            self.model_path, attn_implementation=attn, dtype=dtype, **kwargs
        )
        model = out[0] if isinstance(out, tuple) else out  # output_loading_info=True: a pair
        if self.cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.config.use_cache = False
        return out

    def load_causal_lm(self):
        """The policy / reference model; its fused lm_head is checked against its own logits
        (:func:`trainers.modeling.check_head_logits`) before any training."""
        from transformers import AutoModelForCausalLM

        from trainers.modeling import check_head_logits

        model = self._from_pretrained(AutoModelForCausalLM)
        try:
            check_head_logits(model)
        except (ValueError, NotImplementedError) as e:
            common.fail(f"--model {self.model_path}: {e}")
        return model

    def check_critic_folder(self, path: str) -> None:
        """Fail in one line unless ``path`` (``--critic-model``) is a model folder of a family
        that packs here and reads the policy's token ids (as ``--reward-model`` is checked)."""
        from transformers import AutoConfig

        what = f"--critic-model {path!r}"
        try:
            ccfg = AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as e:
            common.fail(f"{what} is not a model folder: {e}")
        _check_attention_interface(ccfg, what, "not supported as critics here")
        problem = _tokenizer_mismatch(self.tokenizer, path, ccfg)
        if problem:
            common.fail(
                f"{what} {problem}: it reads the policy's token ids, so it needs the policy's "
                f"tokenizer"
            )

    def load_score_model(self, path: str | None = None):
        """``*ForSequenceClassification`` (one label) from a causal LM or reward-model folder.
        A folder without a ``score`` head (a causal LM) gets a fresh one initialised from
        ``--seed``, so every layout starts from the same weights; a saved head is kept."""
        import math

        from transformers import AutoModelForSequenceClassification

        saved = self.model_path
        self.model_path = path or saved
        try:
            model, info = self._from_pretrained(
                AutoModelForSequenceClassification, num_labels=1, output_loading_info=True
            )
        finally:
            self.model_path = saved
        model.config.pad_token_id = self.tokenizer.pad_token_id
        missing = info.get("missing_keys", ())
        if any(k == "score.weight" or k.endswith(".score.weight") for k in missing):
            g = torch.Generator().manual_seed(self.cfg.seed)
            w = model.score.weight
            with torch.no_grad():
                w.copy_(torch.randn(w.shape, generator=g) / math.sqrt(w.shape[1] + 1))
        return model

    def build_critic(self, module: torch.nn.Module):
        """PPO's critic engine (``--critic-lr``), saved and resumed with the actor."""
        from trainers.engine import build_engine, resync_cpu_adam

        self.critic = build_engine(
            module,
            self.cfg,
            self.layout,
            self.optimizer_steps,
            lr=self.cfg.critic_lr,
            check_tp_inputs=False,
        )
        if self.cfg.resume and (ckpt := latest_checkpoint(self.cfg.output_dir)) is not None:
            try:
                load_checkpoint(self.critic, ckpt, tag="critic", rng=False)
            except ValueError as e:
                common.fail(str(e))
            resync_cpu_adam(self.critic)
            apply_optimizer_flags(self.critic, self.cfg.critic_lr, self.cfg.weight_decay)
        return self.critic

    def build(self, module: torch.nn.Module, check_tp_inputs: bool = True):
        """DeepSpeed engine (:func:`trainers.engine.build_engine`); with ``--resume`` restored
        from the newest checkpoint. Returns (engine, steps already done)."""
        from trainers.engine import build_engine, resync_cpu_adam

        ckpt = latest_checkpoint(self.cfg.output_dir) if self.cfg.resume else None  # (checked)
        if ckpt is not None:  # before the engine is built and loaded: no work for a bad resume
            try:
                done = read_state(ckpt)["step"]
            except ValueError as e:
                common.fail(str(e))
            if done > self.total:
                common.fail(
                    f"--resume: {ckpt} is at step {done}, past this run's {self.total} "
                    f"steps: raise --max-steps (without it, --epochs) to continue it, or "
                    f"start a new run"
                )
        engine = build_engine(
            module, self.cfg, self.layout, self.optimizer_steps, check_tp_inputs=check_tp_inputs
        )
        start = 0
        if self.cfg.resume:
            if ckpt is None:
                where = os.path.abspath(self.cfg.output_dir)
                self.print(f"--resume: no checkpoint in {where}, starting fresh")
            else:
                try:
                    start = load_checkpoint(engine, ckpt)["step"]
                except ValueError as e:
                    common.fail(str(e))
                resync_cpu_adam(engine)
                apply_optimizer_flags(engine, self.cfg.lr, self.cfg.weight_decay)
                self.print(f"resumed from {ckpt} (step {start})")
        return engine, start

    # ------------------------------------------------------------------------- the loop
    def progress(self, start: int):
        from tqdm import tqdm

        self._open_outputs()
        self.logger.start_at(start + 1)  # a resumed run drops the records past its checkpoint
        self._bar = tqdm(
            range(start + 1, self.total + 1),
            initial=start,
            total=self.total,
            desc=self.kind,
            unit="step",
            disable=not self.layout.is_main,
            file=sys.stderr,
        )
        return self._bar

    def is_eval_step(self, step: int) -> bool:
        every = self.cfg.eval_steps
        return step == self.total or (every > 0 and step % every == 0)

    def end_step(
        self, step: int, metrics: dict, engine, show=("loss", "eval_loss", "eval_accuracy")
    ) -> None:
        metrics["peak_mem_mb"] = peak_memory_mb(self.layout)
        self.logger.log(metrics, step)
        # the losses are global (reduced over the ranks): every rank stops here together, before
        # a checkpoint or the final model could save non-finite weights over good ones
        keys = ("loss", "policy_loss", "value_loss", "grad_norm")  # NaN gradients: NaN weights
        bad = [k for k in keys if not _finite(metrics.get(k))]
        if bad:
            self.logger.close()
            common.fail(
                f"step {step}: {', '.join(bad)} is {metrics[bad[0]]} (not finite); the earlier "
                f"checkpoints in {self.cfg.output_dir} are kept (lower --lr, check the data)"
            )
        self._bar.set_postfix({k: f"{metrics[k]:.4f}" for k in show if k in metrics})
        every = self.cfg.save_steps
        if every > 0 and step % every == 0:
            engines = {"engine": engine}
            if self.critic is not None:
                engines["critic"] = self.critic
            state = {
                "total_steps": self.total,
                "layout": checkpoint_layout(self.cfg, self.kind, self.layout),
                "data": checkpoint_data(self.cfg, digests=self.layout.rank == 0),  # rank 0 saves
            }
            keep = self.cfg.save_total_limit
            try:
                save_checkpoint(engines, self.cfg.output_dir, step, state, keep)
            except (OSError, OtherRankFailed) as e:  # a full disk: one line, the others kept
                self.logger.close()
                common.fail(
                    f"step {step}: saving the checkpoint failed ({e}); the earlier checkpoints "
                    f"in {self.cfg.output_dir} are kept"
                )

    def sample_line(self, step: int, text, reward: float) -> None:
        """Show one rollout under the progress bar now and then (rank 0)."""
        every = max(1, self.total // 6)
        if step == 1 or step % every == 0 or step == self.total:
            row, response = text
            self._bar.write(
                f"step {step}: {row[self.cfg.input_key]!r} -> {response!r} (reward {reward:.2f})"
            )

    def finish(self, engine, model, prefix: str, plot, extra_config: dict | None = None) -> Path:
        """Gather the full weights, save ``<output_dir>/model`` (HF folder + tokenizer), plot."""
        from trainers.engine import full_state_dict, save_hf_model

        self._bar.close()
        sd = full_state_dict(engine, self.layout)
        out = Path(self.cfg.output_dir) / "model"
        error = None
        if self.layout.is_main:
            try:
                save_hf_model(model, self.tokenizer, sd, out, prefix, extra_config)
            except Exception as e:  # the other ranks must not wait for it at the barrier
                error = e
            else:
                png = self.logger.close(plot_keys=plot, title=f"{self.kind}: {self.cfg.output_dir}")
                self.print(f"model saved to {out}" + (f", plot {png}" if png else ""))
        if error is not None or not self.layout.is_main:
            self.logger.close()
        try:
            agree(error, "saving the model")
        except (OSError, OtherRankFailed) as e:
            common.fail(f"saving the model to {out} failed ({e}); an earlier export there is kept")
        destroy_at_exit()  # gloo groups alive in interpreter finalization can abort (SIGABRT)
        return out

    def on_every_rank(self, fn, *args):
        """``fn(*args)``; a ValueError on any rank ends every rank with that one error line
        (a reward function that raises or breaks its contract on one rank stops them all)."""
        problem = ""
        try:
            out = fn(*args)
        except ValueError as e:
            problem, out = str(e), None
        try:
            all_ranks_ok(not problem, problem, self.layout)
        except ValueError as e:
            common.fail(str(e))
        return out

    def print(self, message: str) -> None:
        if self.layout.is_main:
            print(message, file=sys.stderr, flush=True)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _tokenizer_mismatch(policy_tok, path: str, rcfg) -> str:
    """Why a reward model (or critic) at ``path`` cannot read the policy's token ids ('' when it
    can): its saved tokenizer numbers some policy token differently (extra tokens of its own are
    fine), or (no tokenizer saved) its embedding is smaller than the policy's vocabulary."""
    from transformers import AutoTokenizer

    tok = None
    # without tokenizer files some families (GPT-2, Qwen2) build a near-empty tokenizer
    if any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        try:
            tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:  # a missing sentencepiece / tiktoken, a broken file
            return f"has a tokenizer that does not load ({type(e).__name__}: {e})"
    if tok is not None:
        theirs = tok.get_vocab()
        differ = [t for t, i in policy_tok.get_vocab().items() if theirs.get(t) != i]
        if differ:
            return (
                f"has a tokenizer with another vocabulary than the policy's ({len(differ)} "
                f"policy tokens numbered differently or missing, e.g. {differ[:3]})"
            )
        return ""
    size = getattr(rcfg, "vocab_size", None)
    if isinstance(size, int) and size < len(policy_tok):
        return f"has vocab_size {size}, fewer than the policy tokenizer's {len(policy_tok)} tokens"
    return ""


def _check_attention_interface(config, what: str, fix: str) -> None:
    """Fail unless ``config``'s model computes attention through transformers'
    ``AttentionInterface`` (ours packs samples there; other layers would mix them)."""
    from rlhf_kernels.integrations.hf import uses_attention_interface

    if not uses_attention_interface(type(config)):
        common.fail(
            f"{what}: {config.model_type} models compute attention in their own layers (not "
            f"through transformers' AttentionInterface), so packed samples would attend to "
            f"each other; {fix}"
        )


def _finite(x) -> bool:
    return x is None or math.isfinite(x)
