"""PPO / GRPO / REINFORCE++: ``python -m trainers.ppo`` or ``torchrun ... -m trainers.ppo``.

One step = one rollout batch: ``--rollout-batch-size`` prompts (split over data-parallel ranks)
x ``--n-samples-per-prompt`` responses from the actor, scored by a reward function or a reward
model, turned into packed experience (old / reference log-probs through ``linear_logprobs``,
critic values, KL, advantages through ``gae`` / ``discounted_returns`` / ``group_advantages``),
then ``--ppo-epochs`` passes of clipped policy (and value) updates on token-budget micro-batches.
Every per-token tensor lives on the *actions* (response tokens) of each sample, packed.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlhf_kernels.ops.advantages import group_advantages
from rlhf_kernels.ops.gae import discounted_returns, gae
from rlhf_kernels.ops.linear_logprobs import linear_logprobs
from rlhf_kernels.ops.losses import kl_penalty, policy_loss, value_loss
from rlhf_kernels.packing import plan_micro_batches
from trainers import common, ppo_ring, rewards
from trainers.cli import is_set
from trainers.config import TrainConfig
from trainers.distributed import Layout, all_ranks_ok, max_across, sum_across
from trainers.engine import accumulate, build_frozen, checkpointing, optimizer_step

GROUP_ESTIMATORS = ("reinforce_baseline", "rloo", "grpo", "dr_grpo")


def _f(default, help: str, **meta):
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class PPOConfig(TrainConfig):
    """Defaults: the recipe that raises the reward of the bundled tiny model on a CPU in about a
    minute (``trainers/warm_start.py``)."""

    model: str | None = _f(
        None,
        "local Hugging Face model folder (default: the bundled tiny Llama after an SFT warm "
        "start, built once into a cache folder in about 30 s; see trainers/warm_start.py)",
    )
    dataset: str | None = _f(
        None,
        "comma-separated .jsonl/.json/.parquet/.csv prompt files or save_to_disk folders "
        "(default: 1000 'first letter: <word>' prompts with a 'target' column, written once "
        "into the cache folder)",
    )
    input_template: str | None = _f(
        None,
        "prompt template containing '{}' (default: '{} =' without --model, the format of the "
        "warm start; none with --model)",
    )
    reward_model: str | None = _f(None, "reward model folder saved by trainers.rm")
    reward_fn: str | None = _f(
        None,
        "reward function 'module:function' called with prompts=, responses= and the dataset's "
        "other columns, returning one float per response (default: "
        "trainers.rewards:reverse_reward for the default prompts, else none)",
    )
    critic_model: str | None = _f(None, "critic initialisation (default: --model); gae only")
    advantage_estimator: str = _f(
        "grpo", "advantages", choices=("gae", "reinforce", *GROUP_ESTIMATORS)
    )
    n_samples_per_prompt: int = _f(8, "responses per prompt (group size)")
    max_new_tokens: int = _f(12, "longest response")
    temperature: float = _f(0.7, "sampling temperature (also divides the training logits)")
    top_p: float = _f(1.0, "nucleus sampling")
    rollout_batch_size: int = _f(16, "prompts per step, over all data-parallel ranks")
    ppo_epochs: int = _f(1, "update passes over each rollout batch")
    kl_coef: float = _f(0.0, "KL(actor || reference) coefficient")
    kl_estimator: str = _f("k3", "per-token KL estimator", choices=("k1", "k2", "k3"))
    kl_in_loss: bool = _f(False, "add the KL to the loss instead of subtracting it from rewards")
    kl_clamp: float = _f(
        10.0,
        "clamp each token's KL estimate to [-c, c] (k3 overflows to inf where the actor "
        "gives a sampled token e^-88 of the reference's probability; 0: no clamp)",
    )
    clip_low: float = _f(0.2, "ratio clip below 1 (eps_clip)")
    clip_high: float = _f(0.2, "ratio clip above 1 (clip-higher when larger than --clip-low)")
    dual_clip: float | None = _f(None, "dual-clip bound c > 1 for negative advantages")
    loss_aggregation: str = _f(
        "token-mean",
        "how the step's token losses (KL and entropy terms included) add up: token-mean "
        "(over its action tokens) or seq-mean-token-sum-norm (Dr. GRPO: their sum over the "
        "constant samples x --max-new-tokens)",
        choices=("token-mean", "seq-mean-token-sum-norm"),
    )
    entropy_coef: float = _f(0.0, "entropy bonus")
    value_clip: float = _f(0.2, "value clipping around the rollout values (gae; 0: none)")
    gamma: float = _f(1.0, "discount")
    lam: float = _f(0.95, "GAE lambda")
    critic_lr: float = _f(1e-3, "critic learning rate (gae)")
    ref_zero_stage: int | None = _f(
        None,
        "ZeRO stage of the frozen reference and reward models: 0 (a full copy per rank) or 3 "
        "(partitioned over the ranks, gathered layer by layer in forward) (default: 3 with "
        "--zero-stage 3 or --ref-offload, else 0)",
        choices=(0, 3),
    )
    ref_offload: bool = _f(
        False,
        "keep the reference and reward model weights on the CPU between forwards (ZeRO-3 "
        "parameter offload; implies --ref-zero-stage 3)",
    )
    rollout_distribution: str = _f(
        "scatter", "how ring ranks get rollouts (ring attention)", choices=("scatter", "broadcast")
    )
    # PPO defaults differ from SFT's
    batch_size: int = _f(32, "rollout samples per optimizer step (all ranks together)")
    epochs: int = _f(1, "passes over the prompts (with --max-steps none), reshuffled each")
    input_key: str = _f("prompt", "column holding the prompt")
    eval_ratio: float = _f(0.02, "held-out prompts, evaluated with greedy decoding")
    lr: float = _f(1e-3, "actor AdamW learning rate")
    warmup_steps: int = _f(
        20,
        "linear warm-up in optimizer steps (rollout samples per step / --batch-size of them per "
        "rollout step); without it Adam's first steps can collapse a small policy",
    )
    lr_scheduler: str = _f("constant", "decay after warm-up", choices=("cosine", "constant"))
    max_steps: int | None = _f(60, "rollout steps ('none': --epochs passes over the prompts)")
    max_len: int = _f(128, "longest prompt in tokens")
    output_dir: str = _f("runs/ppo", "metrics.jsonl, TensorBoard, plot, checkpoints, model")

    no_packing: bool = _f(False, "not supported by PPO: its experience is always packed")

    def validate(self) -> None:
        super().validate()
        if self.no_packing:
            raise ValueError(
                "--no-packing is an SFT / reward-model comparison: PPO's rollouts, experience "
                "and updates are always packed (leave the flag out)"
            )
        if self.advantage_estimator in GROUP_ESTIMATORS and self.n_samples_per_prompt < 2:
            raise ValueError(
                f"--advantage-estimator {self.advantage_estimator} compares the responses of one "
                f"prompt: it needs --n-samples-per-prompt >= 2, got {self.n_samples_per_prompt}"
            )
        for name in ("n_samples_per_prompt", "max_new_tokens", "rollout_batch_size", "ppo_epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        # the loss / sampling ranges, checked here rather than after the first rollout
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError(
                f"need 0 <= --clip-low < 1 and --clip-high >= 0, got {self.clip_low}, "
                f"{self.clip_high}"
            )
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"--dual-clip must be > 1 (or left out), got {self.dual_clip}")
        if not self.value_clip >= 0:
            raise ValueError(f"--value-clip must be >= 0 (0: no clipping), got {self.value_clip}")
        if not self.kl_clamp >= 0:
            raise ValueError(f"--kl-clamp must be >= 0 (0: no clamp), got {self.kl_clamp}")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError(
                f"--kl-coef and --entropy-coef must be >= 0, got {self.kl_coef}, "
                f"{self.entropy_coef}"
            )
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise ValueError(f"--gamma and --lam must be in [0, 1], got {self.gamma}, {self.lam}")
        if self.critic_lr <= 0:
            raise ValueError(f"--critic-lr must be > 0, got {self.critic_lr}")
        if self.critic_model and self.advantage_estimator != "gae":
            raise ValueError(
                f"--critic-model is used by --advantage-estimator gae only (it trains the value "
                f"model), got --advantage-estimator {self.advantage_estimator}"
            )
        critic_flags = [n for n in ("critic_lr", "value_clip", "lam") if is_set(self, n)]
        if critic_flags and self.advantage_estimator != "gae":
            given = ", ".join(f"--{n.replace('_', '-')} {getattr(self, n)}" for n in critic_flags)
            raise ValueError(
                f"{given}: used by --advantage-estimator gae only (the critic and GAE), got "
                f"--advantage-estimator {self.advantage_estimator}"
            )
        if self.kl_in_loss and self.kl_coef == 0:
            raise ValueError("--kl-in-loss adds --kl-coef x KL to the loss: give --kl-coef > 0")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
        if (self.rollout_batch_size * self.n_samples_per_prompt) % self.batch_size:
            raise ValueError(
                f"--batch-size ({self.batch_size}) must divide the rollout samples per step "
                f"(--rollout-batch-size x --n-samples-per-prompt = "
                f"{self.rollout_batch_size * self.n_samples_per_prompt})"
            )
        if self.ref_offload and self.tp_size > 1:
            raise ValueError(
                f"--ref-offload (ZeRO-3 for the reference and reward models) cannot be combined "
                f"with --tp-size {self.tp_size} (AutoTP shards the trained model only); drop "
                f"--ref-offload"
            )
        if self.ref_zero_stage is None:
            self.ref_zero_stage = 3 if (self.zero_stage == 3 or self.ref_offload) else 0
        if self.ref_offload and self.ref_zero_stage != 3:
            raise ValueError(
                f"--ref-offload keeps ZeRO-3 partitions on the CPU: it needs --ref-zero-stage 3, "
                f"got {self.ref_zero_stage}"
            )
        if self.ref_zero_stage == 3 and self.tp_size > 1:
            raise ValueError(
                f"--ref-zero-stage 3 cannot be combined with --tp-size {self.tp_size} (AutoTP "
                f"shards the trained model only); use --ref-zero-stage 0"
            )
        if self.reward_fn and self.reward_model:
            raise ValueError("give --reward-fn or --reward-model, not both")
        if self.ring_attn_size > 1 and (
            self.batch_size != self.rollout_batch_size * self.n_samples_per_prompt
        ):
            raise ValueError(
                f"with --ring-attn-size > 1 every PPO epoch is one optimizer step over the "
                f"rollout batch: --batch-size must be {self.rollout_batch_size} x "
                f"{self.n_samples_per_prompt}, got {self.batch_size}"
            )


@dataclass
class Sample:
    """One response and its experience; per-token tensors are over its actions (responses)."""

    ids: torch.Tensor | None  # (n,) prompt + response (None: bookkeeping of a ring sample)
    n_prompt: int
    reward: float = 0.0
    length: int = 0  # len(ids) when ids is None
    old_logp: torch.Tensor | None = None  # (n_act,)
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def n_act(self) -> int:
        return (len(self.ids) if self.ids is not None else self.length) - self.n_prompt

    def targets(self) -> torch.Tensor:
        """``(n,)`` next-token targets: the response tokens, -100 elsewhere."""
        out = torch.full_like(self.ids, -100)
        out[self.n_prompt - 1 : -1] = self.ids[self.n_prompt :]
        return out


# ----------------------------------------------------------------------------- forwards
def action_hidden(model, samples: list[Sample], layout: Layout):
    """Final hidden states at the action positions of a packed micro-batch: ``(n_act, H)``
    and the ``(n_act,)`` action token ids, samples in order."""
    from trainers.modeling import base_model

    if isinstance(samples, ppo_ring.Shard):
        return ppo_ring.hidden(model, samples, layout)
    mb, extras, _ = common.packed_inputs(
        [s.ids for s in samples], {"t": [s.targets() for s in samples]}, None, layout
    )
    out = base_model(model)(**mb.inputs, use_cache=False).last_hidden_state[0]
    sel = extras["t"].to(out.device) != -100
    return out[sel], extras["t"].to(out.device)[sel]


def head(model):
    return model.get_output_embeddings()


def split(x: torch.Tensor, samples: list[Sample]) -> list[torch.Tensor]:
    return list(torch.split(x.detach().float().cpu(), [s.n_act for s in samples]))


class TokenCritic(torch.nn.Module):
    """Per-token values: the reward-model architecture's ``score`` head on every position."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, samples: list[Sample], layout: Layout) -> torch.Tensor:
        h, _ = action_hidden(self.model, samples, layout)
        return self.model.score(h).squeeze(-1).float()


class Actor(torch.nn.Module):
    """Action log-probs and entropy of the causal LM (lm_head fused with the log-softmax)."""

    def __init__(self, lm, temperature: float):
        super().__init__()
        self.lm = lm
        from trainers.modeling import _register_external, head_logit_args

        _register_external(self, list(head(lm).parameters()))
        self.logit_args = head_logit_args(lm, temperature)  # sampling temperature + model's own

    def forward(self, samples: list[Sample], layout: Layout):
        h, labels = action_hidden(self.lm, samples, layout)
        w = head(self.lm)
        return linear_logprobs(h, w.weight, labels, w.bias, return_entropy=True, **self.logit_args)


# ----------------------------------------------------------------------------- rollouts
def rollout_seed(seed: int, step: int, pos: int) -> int:
    """Sampling seed of the prompt at ``pos`` in step ``step``'s rollout batch of a run with
    ``--seed seed``: a 63-bit hash of the three, so distinct triples get unrelated seeds (a
    linear mix, ``seed * 1_000_003 + step * 10_007 + pos``, repeated past 10 007 prompts per
    step and across runs' seeds)."""
    key = f"{int(seed)}:{int(step)}:{int(pos)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def generate(gen, tokenizer, rows, cfg, layout, step: int, positions: list, greedy=False):
    """Responses for ``rows`` (this rank's prompts; ``positions``: their places in the step's
    rollout batch): seeded per prompt, so a prompt gets the same responses whichever rank
    generates it. Collective when ``gen.synced`` (every rank calls it, with or without rows)."""
    from trainers.data import render_prompt

    samples, texts = [], []
    n_samples = 1 if greedy else cfg.n_samples_per_prompt
    # ZeRO-3: ranks step together; one with fewer prompts makes dummy calls after its own
    synced = getattr(gen, "synced", False)  # optional in the GenerationEngine protocol
    missing = max_across(len(rows), layout) - len(rows) if synced else 0
    for pos, row in zip(positions, rows, strict=True):
        p = render_prompt(
            tokenizer, row[cfg.input_key], cfg.input_template, cfg.apply_chat_template
        )
        outs = gen.generate(
            [p],
            n_samples=n_samples,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            greedy=greedy,
            seed=rollout_seed(cfg.seed, step, pos),
        )
        for r in outs:
            samples.append(Sample(torch.tensor(p + r), len(p)))
            texts.append((row, tokenizer.decode(r, skip_special_tokens=True)))
    for _ in range(missing):
        gen.generate([[tokenizer.eos_token_id]], n_samples=n_samples, max_new_tokens=1, greedy=True)
    return samples, texts


def score(reward, tokenizer, samples, texts, cfg: PPOConfig, layout: Layout) -> None:
    """Fill ``sample.reward`` from the reward function or reward model. Collective with a
    reward model: every rank calls it, also one without samples."""
    if not isinstance(reward, torch.nn.Module):  # a reward function
        if not samples:
            return
        cols = [k for k in texts[0][0] if k != cfg.input_key] if texts else []
        vals = rewards.score(
            reward,
            cfg.reward_fn or "trainers.rewards:reverse_reward",
            [row[cfg.input_key] for row, _ in texts],
            [t for _, t in texts],
            {k: [row[k] for row, _ in texts] for k in cols},
        )
    else:
        vals = model_rewards(reward, [s.ids for s in samples], cfg, layout, tokenizer.pad_token_id)
    for s, v in zip(samples, vals):
        s.reward = float(v)


@torch.no_grad()
def model_rewards(model, seqs: list[torch.Tensor], cfg, layout: Layout, pad_id: int) -> list:
    """Reward-model scores of whole ``seqs`` (this rank's, no ring split): the value at each
    sequence's last token that is not the reward model's pad token (where transformers reads
    it), normalised by the model's saved ``reward_mean`` / ``reward_std``.
    Runs in ``--micro-batch-tokens`` micro-batches, the same number on every rank (padded with
    a 2-token dummy), since a ZeRO-3 reward model gathers its weights in each forward."""
    from trainers.modeling import RewardModel

    plain = dataclasses.replace(layout, ring=1, ring_group=None)
    plan = plan_micro_batches([len(x) for x in seqs], cfg.micro_batch_tokens)[0]
    out = [0.0] * len(seqs)
    for m in range(max_across(len(plan), layout)):
        part = [seqs[i] for i in plan[m]] if m < len(plan) else [torch.tensor([pad_id, pad_id])]
        mb, _, packed = common.packed_inputs(part, {}, None, plain)
        at = common.reward_positions(part, getattr(model.config, "pad_token_id", None))
        last = (packed.cu_seqlens[:-1].long() + torch.tensor(at)).to(layout.device)
        r = RewardModel(model)(**mb.inputs, last_index=last).tolist()
        for i, v in zip(plan[m] if m < len(plan) else [], r):
            out[i] = v
    mean = getattr(model.config, "reward_mean", 0.0)
    std = getattr(model.config, "reward_std", 1.0) or 1.0
    return [(v - mean) / std for v in out]


def micro_batches(samples: list[Sample], cfg, layout: Layout) -> list[list[Sample]]:
    """Token-budget micro-batches of this rank's samples; every data-parallel rank gets the
    same count (empty lists pad the shorter plans, so DeepSpeed's collectives line up)."""
    plan = plan_micro_batches([len(s.ids) for s in samples], cfg.micro_batch_tokens)[0]
    n = max_across(len(plan), layout)
    return [[samples[i] for i in mb] for mb in plan] + [[]] * (n - len(plan))


def dummy_sample(pad_id: int) -> Sample:
    """A 2-token sample with one action: the forward of a rank with fewer micro-batches (its
    results count 0), so every rank runs as many forwards as the busiest."""
    z = torch.zeros(1)
    return Sample(
        torch.tensor([pad_id, pad_id]), 1, old_logp=z, ref_logp=z, advantages=z, values=z, returns=z
    )


@torch.no_grad()
def make_experience(
    samples, actor, ref, critic, cfg: PPOConfig, layout: Layout, pad_id: int
) -> dict:
    """Old/reference log-probs, values, KL, advantages and returns (all over actions). Every
    rank runs as many forwards as the busiest (ZeRO-3 gathers weights in each one)."""
    for mb in micro_batches(samples, cfg, layout):
        if not mb:  # padding: the forwards only
            pad = [dummy_sample(pad_id)]
            actor(pad, layout), ref(pad, layout)
            if critic is not None:
                critic(pad, layout)
            continue
        logp, _ = actor(mb, layout)
        for s, x in zip(mb, split(logp, mb)):
            s.old_logp = x
        ref_logp, _ = ref(mb, layout)
        for s, x in zip(mb, split(ref_logp, mb)):
            s.ref_logp = x
        if critic is not None:
            for s, x in zip(mb, split(critic(mb, layout), mb)):
                s.values = x
    return advantages(samples, cfg, layout)


def global_moments(
    x: torch.Tensor, layout: Layout, repeats: int, ddof: int = 1
) -> tuple[float, float]:
    """Mean and variance (unbiased; ``ddof=0``: the population's) of the values of every
    data-parallel rank (each value is held by ``repeats`` ranks). Two passes in float64: the
    global mean, then the squared deviations from it (one pass loses the variance of values far
    from zero)."""
    x = x.double()
    n, tot = sum_across([x.numel() / repeats, x.sum().item() / repeats], layout)
    mean = tot / max(n, 1)
    (sq,) = sum_across([(x - mean).square().sum().item() / repeats], layout)
    return mean, sq / max(n - ddof, 1)


def global_whiten(x: torch.Tensor, layout: Layout, repeats: int) -> torch.Tensor:
    """``whiten`` with the statistics of every data-parallel rank's tokens."""
    mean, var = global_moments(x, layout, repeats)
    return (x - mean) * (var + 1e-8) ** -0.5


def _clamp(cfg: PPOConfig) -> float | None:
    return cfg.kl_clamp or None


def advantages(samples: list[Sample], cfg: PPOConfig, layout: Layout, repeats: int = 0) -> dict:
    """KL, per-token rewards, advantages and returns of whole samples (``old_logp``,
    ``ref_logp``, ``values`` and ``reward`` set); returns the step's statistics. ``repeats``:
    ranks holding each sample (default ``tp``; ring ranks all hold the whole samples here)."""
    repeats = repeats or layout.tp
    old = torch.cat([s.old_logp for s in samples])
    kl = kl_penalty(old, torch.cat([s.ref_logp for s in samples]), cfg.kl_estimator, _clamp(cfg))
    cu = common_cu([s.n_act for s in samples])
    # float64 from the Python floats to the stored results: fp32 rewards of 1e4 +- 1e-3 are
    # rounded to ~1e-3 (their group centring, returns and whitening then work on the rounding)
    scalar = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    if cfg.advantage_estimator == "reinforce_baseline":  # centred, / the global batch's std
        scalar = group_advantages(scalar, cfg.n_samples_per_prompt, "dr_grpo")
        scalar = scalar / (global_moments(scalar, layout, repeats)[1] ** 0.5 + 1e-6)
    elif cfg.advantage_estimator in GROUP_ESTIMATORS:
        scalar = group_advantages(scalar, cfg.n_samples_per_prompt, cfg.advantage_estimator)
    tok_r = torch.zeros_like(old, dtype=torch.float64)
    # the reward lands on the last response token (an empty response has none to carry it)
    has = torch.tensor([s.n_act > 0 for s in samples], dtype=torch.bool)
    tok_r[cu[1:][has] - 1] = scalar[has]
    if not cfg.kl_in_loss:
        tok_r = tok_r - cfg.kl_coef * kl.double()
    if cfg.advantage_estimator == "gae":
        values = torch.cat([s.values for s in samples]).double()
        adv, ret = gae(tok_r, values, gamma=cfg.gamma, lam=cfg.lam, cu_seqlens=cu)
        adv = global_whiten(adv, layout, repeats)
    else:
        ret = discounted_returns(tok_r, gamma=cfg.gamma, cu_seqlens=cu)
        adv = global_whiten(ret, layout, repeats) if cfg.advantage_estimator == "reinforce" else ret
    adv, ret = adv.to(old.dtype), ret.to(old.dtype)  # stored as the log-probs are
    for s, a, r in zip(
        samples, adv.split([s.n_act for s in samples]), ret.split([s.n_act for s in samples])
    ):
        s.advantages, s.returns = a, r
    n, kl_sum = sum_across([adv.numel() / repeats, kl.sum().item() / repeats], layout)
    mean, var = global_moments(adv, layout, repeats, ddof=0)
    return {"kl": kl_sum / max(n, 1), "advantage_mean": mean, "advantage_std": var**0.5}


def common_cu(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.long)


# ----------------------------------------------------------------------------- updates
def _n(mb) -> int:
    return mb.n_local if isinstance(mb, ppo_ring.Shard) else sum(s.n_act for s in mb)


def _batch_n(batch) -> int:
    """Action tokens this rank holds in ``batch`` (``Sample``s or ring shards)."""
    return sum(_n(x if isinstance(x, ppo_ring.Shard) else [x]) for x in batch)


def _cat(mb, name: str) -> torch.Tensor:
    if isinstance(mb, ppo_ring.Shard):
        return getattr(mb, name)
    return torch.cat([getattr(s, name) for s in mb])


def _cu(mb, device) -> torch.Tensor:
    """Sequence boundaries over a micro-batch's actions (a shard: one run of local tokens)."""
    lens = [mb.n_local] if isinstance(mb, ppo_ring.Shard) else [s.n_act for s in mb]
    return common_cu(lens).to(device)


def update_batches(batch, cfg, layout: Layout, pad_id: int):
    """``(micro-batch, counts)`` pairs of one optimizer step: token-budget micro-batches of
    ``Sample``s, or the ring's shards; every rank gets the same number (padding ones count 0)."""
    if batch and isinstance(batch[0], ppo_ring.Shard):
        pads = ppo_ring.padding(len(batch), layout, pad_id, cfg)
        return [(mb, True) for mb in batch] + [(mb, False) for mb in pads]
    pad = [dummy_sample(pad_id)]
    return [(mb, True) if mb else (pad, False) for mb in micro_batches(batch, cfg, layout)]


def _batch_seqs(batch, layout: Layout) -> int:
    """Samples in the optimizer step over all ranks (each one counted once)."""
    if batch and isinstance(batch[0], ppo_ring.Shard):
        mine, rep = sum(len(sh.samples) for sh in batch), layout.tp * layout.ring
    else:
        mine, rep = len(batch), layout.tp
    return round(sum_across([mine / rep], layout)[0])


def train_actor(engine, batch, cfg: PPOConfig, layout: Layout, pad_id: int) -> dict:
    """One optimizer step of the clipped policy loss; the token mean (or Dr. GRPO's constant
    normaliser, ``--loss-aggregation``) runs over the global batch (``batch``: this rank's
    ``Sample``s, or its ring shards)."""
    # (a step of empty responses only has no action token: its losses are 0, not 1 / 0)
    n_global = max(sum_across([_batch_n(batch) / layout.tp], layout)[0], 1)
    norm = n_global  # the loss's denominator; the statistics stay token means
    if cfg.loss_aggregation == "seq-mean-token-sum-norm":
        norm = _batch_seqs(batch, layout) * cfg.max_new_tokens
    # policy_loss: the clipped surrogate alone; actor_loss: what is minimised (with the KL and
    # entropy terms when they are in the loss)
    totals = dict.fromkeys(
        ("policy_loss", "actor_loss", "clip_fraction", "approx_kl", "entropy"), 0.0
    )
    mbs = update_batches(batch, cfg, layout, pad_id)
    for i, (mb, counts) in enumerate(mbs):
        weight = _n(mb) / n_global if counts else 0.0
        loss_weight = _n(mb) / norm if counts else 0.0
        # --gradient-checkpointing in eval mode; a ring shard's backward recomputes ring attention
        with checkpointing(engine.module), ppo_ring.update_scope(mb, layout):
            logp, ent = engine(mb, layout)
            dev = logp.device
            old, adv = _cat(mb, "old_logp").to(dev), _cat(mb, "advantages").to(dev)
            surrogate, stats = policy_loss(
                logp,
                old,
                adv,
                clip_low=cfg.clip_low,
                clip_high=cfg.clip_high,
                dual_clip=cfg.dual_clip,
                return_stats=True,
                cu_seqlens=_cu(mb, dev),
            )
            loss = surrogate
            if cfg.kl_in_loss and cfg.kl_coef:
                ref = _cat(mb, "ref_logp").to(dev)
                kl = kl_penalty(logp, ref, cfg.kl_estimator, _clamp(cfg))
                loss = loss + cfg.kl_coef * kl.sum() / max(kl.numel(), 1)
            # a ring shard may hold no action token: its mean is 0 (weight 0), not NaN
            ent_mean = ent.sum() / max(ent.numel(), 1)
            if cfg.entropy_coef:
                loss = loss - cfg.entropy_coef * ent_mean
            # DeepSpeed averages over its dp x ring ranks: scale back to a sum of global shares
            accumulate(engine, loss * loss_weight * layout.ds_dp_size, i == len(mbs) - 1)
        totals["policy_loss"] += surrogate.item() * loss_weight
        totals["actor_loss"] += loss.item() * loss_weight
        totals["entropy"] += ent_mean.item() * weight
        totals["clip_fraction"] += stats["clip_frac"].item() * weight
        totals["approx_kl"] += stats["approx_kl"].item() * weight
    out = dict(zip(totals, sum_across([v / layout.tp for v in totals.values()], layout)))
    out["grad_norm"] = optimizer_step(engine, layout)
    return out


def train_critic(engine, batch, cfg: PPOConfig, layout: Layout, pad_id: int) -> float:
    n_global = max(sum_across([_batch_n(batch) / layout.tp], layout)[0], 1)
    total, mbs = 0.0, update_batches(batch, cfg, layout, pad_id)
    for i, (mb, counts) in enumerate(mbs):
        weight = _n(mb) / n_global if counts else 0.0
        with checkpointing(engine.module), ppo_ring.update_scope(mb, layout):
            v = engine(mb, layout)
            old, ret = _cat(mb, "values").to(v.device), _cat(mb, "returns").to(v.device)
            clip = cfg.value_clip or None
            loss = value_loss(v, old, ret, clip=clip, cu_seqlens=_cu(mb, v.device))
            accumulate(engine, loss * weight * layout.ds_dp_size, i == len(mbs) - 1)
        total += loss.item() * weight
    optimizer_step(engine, layout)
    return sum_across([total / layout.tp], layout)[0]


# ----------------------------------------------------------------------------- the run
def evaluate(session, gen, reward, rows, cfg) -> dict:
    """Greedy responses to the held-out prompts (split over data-parallel ranks)."""
    layout = session.layout
    mine = rows[layout.dp_rank :: layout.dp]
    samples, texts = generate(
        gen, session.tokenizer, mine, cfg, layout, 0, range(len(mine)), greedy=True
    )
    # every rank passes the collective check, also one without held-out prompts
    session.on_every_rank(score, reward, session.tokenizer, samples, texts, cfg, layout)
    tot, n = sum_across(
        [sum(s.reward for s in samples) / layout.tp, len(samples) / layout.tp], layout
    )
    return {"eval_reward": tot / max(n, 1)}


class PeakMemory:
    """Peak memory growth from construction to ``stop()`` in bytes: the CUDA allocator's peak
    above the start on GPUs, else the process's peak RSS growth (sampled)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
            self.base, self.device = torch.cuda.memory_allocated(device), device
        else:
            from rlhf_kernels.comm._memory import PeakRSS

            self.rss = PeakRSS()

    def stop(self) -> int:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return self.rss.stop()


def ring_share(gen, session, reward, cfg, step, share) -> list[dict]:
    """``distributed_rollouts``' generate: this ring rank's share of ``(position, row)``
    prompts -> scored sample dicts (token ids and targets, plus metadata)."""
    rows, positions = [row for _, row in share], [pos for pos, _ in share]
    tok, layout, problem = session.tokenizer, session.layout, ""
    try:
        samples, texts = generate(gen, tok, rows, cfg, layout, step, positions)
    except Exception as e:  # distributed_rollouts catches it and the rank lives on: the others
        problem = f"generation failed: {type(e).__name__}: {e}"  # must not enter score's
    all_ranks_ok(not problem, problem, layout)  # collectives (a reward model's) alone
    score(reward, tok, samples, texts, cfg, layout)
    return [
        {
            "input_ids": x.ids,
            "targets": x.targets(),
            "reward": x.reward,
            "n_prompt": x.n_prompt,
            "text": t,
        }
        for x, t in zip(samples, texts)
    ]


def prompt_positions(cfg: PPOConfig, layout: Layout) -> list[int]:
    """Places in each step's rollout batch of this rank's prompts. When every mini-batch
    (``--batch-size`` samples) holds whole prompts that split evenly over the data-parallel
    ranks, rank ``r`` takes the ``r``-th slice of each, so an optimizer step updates on the same
    samples whatever the rank count; otherwise each rank takes a contiguous share."""
    n_prompts, n, size = cfg.rollout_batch_size, cfg.n_samples_per_prompt, cfg.batch_size
    dp, r = layout.dp, layout.dp_rank
    per_batch = size // n  # prompts per mini-batch
    if size % n == 0 and per_batch % dp == 0:
        k = per_batch // dp
        return [b * per_batch + r * k + i for b in range(n_prompts // per_batch) for i in range(k)]
    k = n_prompts // dp
    return list(range(r * k, (r + 1) * k))


def mini_batches(samples: list[Sample], cfg: PPOConfig, layout: Layout) -> list[list[Sample]]:
    """This rank's share of each optimizer step's ``--batch-size`` samples (all ranks together),
    in order: with ``prompt_positions``' layout, slice ``b`` is this rank's part of mini-batch
    ``b``."""
    n_batches = len(samples) * layout.dp // cfg.batch_size
    size = len(samples) // n_batches
    return [samples[b * size : (b + 1) * size] for b in range(n_batches)]


def resolve_defaults(cfg: PPOConfig) -> PPOConfig:
    """Fill the defaults that need files: without ``--model`` the warm-started tiny model (built
    once; concurrent ranks wait for one builder) and its prompt template, without ``--dataset``
    the first-letter prompts and, unless a reward is given, their reward function."""
    from trainers import warm_start

    changes: dict = {}
    if cfg.model is None:
        try:
            changes["model"] = warm_start.ensure_warm_start()
        except (OSError, RuntimeError) as e:
            common.fail(f"cannot build the default model (give --model): {e}")
        if cfg.input_template is None:
            changes["input_template"] = warm_start.TEMPLATE
    if cfg.dataset is None:
        changes["dataset"] = warm_start.first_letter_prompts()
        if cfg.reward_fn is None and cfg.reward_model is None:
            changes["reward_fn"] = warm_start.REWARD_FN
    return dataclasses.replace(cfg, **changes)


def train(cfg: PPOConfig) -> dict:
    from trainers.rollout import HFGenerationEngine
    from trainers.session import Session

    cfg = resolve_defaults(cfg)
    s = Session.start(cfg, "ppo")
    rows, eval_rows = s.load_prompts()
    if cfg.critic_model:  # checked before any model is built, as --reward-model
        s.check_critic_folder(cfg.critic_model)
    reward = s.load_reward()
    lm = s.load_causal_lm()
    engine, start = s.build(Actor(lm, cfg.temperature), check_tp_inputs=False)
    # the actor stays in eval mode (dropout off): the ratio to the rollout's log-probs starts at 1
    engine.eval()
    ref = build_frozen(Actor(s.load_causal_lm(), cfg.temperature), cfg, s.layout)
    critic = None
    if cfg.advantage_estimator == "gae":
        critic = s.build_critic(TokenCritic(s.load_score_model(cfg.critic_model)))
    critic_module = critic.module if critic is not None else None
    gen = HFGenerationEngine(lm, s.tokenizer, zero3=cfg.zero_stage == 3)
    pad = s.tokenizer.pad_token_id
    positions = prompt_positions(cfg, s.layout)
    metrics: dict = {}
    # step 1 also logs the greedy reward before any update (eval_reward_before); eval steps
    # (and the last step) log eval_reward after their update
    before = {}
    if eval_rows and start == 0:
        before = {"eval_reward_before": evaluate(s, gen, reward, eval_rows, cfg)["eval_reward"]}
    for step in s.progress(start):
        t0 = time.perf_counter()
        # a seeded shuffle per pass over the prompts; responses are seeded by step and position,
        # so they do not depend on the rank that generates them
        order = common.batch_indices(step, len(rows), cfg.rollout_batch_size, cfg.seed)
        mine = [rows[order[j]] for j in positions]
        peak = PeakMemory(s.layout.device)  # the rollout phase alone
        received = 0
        if s.layout.ring == 1:
            samples, texts = generate(gen, s.tokenizer, mine, cfg, s.layout, step, positions)
            s.on_every_rank(score, reward, s.tokenizer, samples, texts, cfg, s.layout)
            exp = make_experience(samples, engine.module, ref, critic_module, cfg, s.layout, pad)
            batches = mini_batches(samples, cfg, s.layout)
        else:  # each ring rank generates a share and keeps only its token shards
            make = functools.partial(ring_share, gen, s, reward, cfg, step)
            shards, text, received = ppo_ring.rollouts(s, make, list(zip(positions, mine)), cfg)
            exp = ppo_ring.experience(shards, engine.module, ref, critic_module, cfg, s.layout, pad)
            samples = [x for sh in shards for x in sh.samples]
            texts, batches = [text] if text else [], [shards]
        t1 = time.perf_counter()
        rollout_mem = [peak.stop() / 2**20, received / 2**20]
        if s.layout.world > 1:  # the busiest rank
            t = torch.tensor(rollout_mem, device=s.layout.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            rollout_mem = t.tolist()
        lr = engine.get_lr()[0]  # the lr of this step's first update (after them: the next's)
        updates = []  # one dict per optimizer step; the step logs their means
        for _ in range(cfg.ppo_epochs):
            for batch in batches:
                updates.append(train_actor(engine, batch, cfg, s.layout, pad))
                if critic is not None:
                    updates[-1]["value_loss"] = train_critic(critic, batch, cfg, s.layout, pad)
        upd = {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
        t2 = time.perf_counter()
        rep = s.layout.tp * s.layout.ring  # ranks holding each sample's bookkeeping
        n, length, tokens = sum_across(
            [
                len(samples) / rep,
                sum(x.n_act for x in samples) / rep,
                sum(x.n_act + x.n_prompt for x in samples) / rep,
            ],
            s.layout,
        )
        rewards = torch.tensor([x.reward for x in samples], dtype=torch.float64)
        mean, var = global_moments(rewards, s.layout, rep, ddof=0)
        metrics = {
            "reward_mean": mean,
            "reward_std": math.sqrt(var),
            "response_length": length / n,
            **exp,
            **upd,
            "lr": lr,
            "tokens": tokens,
            "tokens_per_s": tokens * cfg.ppo_epochs / max(t2 - t1, 1e-9),
            "rollout_s": t1 - t0,
            "rollout_peak_mb": rollout_mem[0],
            "rollout_received_mb": rollout_mem[1],
            "train_s": t2 - t1,
        }
        if step == 1:
            metrics.update(before)
        if eval_rows and s.is_eval_step(step):
            metrics.update(evaluate(s, gen, reward, eval_rows, cfg))
        show = ("reward_mean", "kl", "eval_reward_before", "eval_reward")
        s.end_step(step, metrics, engine, show=show)
        if s.layout.is_main and texts:
            s.sample_line(step, texts[0], samples[0].reward)
    s.finish(
        engine,
        lm,
        prefix="lm.",
        plot=[
            ("reward_mean", "eval_reward_before", "eval_reward"),
            ("kl",),
            ("policy_loss", "actor_loss"),
            ("entropy",),
        ],
    )
    return metrics


def main(argv=None) -> dict:
    from trainers.cli import parse_config

    cfg = parse_config(
        PPOConfig,
        argv,
        prog="python -m trainers.ppo",
        description="PPO / GRPO / REINFORCE++ on a Hugging Face causal LM: sampled rollouts, "
        "packed experience through rlhf_kernels' fused log-probs, GAE and group advantages, "
        "clipped updates on token-budget micro-batches (DeepSpeed ZeRO / AutoTP).",
    )
    return train(cfg)


def cli() -> None:
    """The ``rlhf-ppo`` command: :func:`main` without its return value (exit code 0)."""
    main()


if __name__ == "__main__":
    main()
