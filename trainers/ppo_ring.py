"""PPO with ring attention (``--ring-attn-size N``): rollouts that no rank holds whole.

Every rank of a ring group generates (and scores) its contiguous share of the group's prompts
(``distributed_rollouts``); the owners then stream their samples in bounded micro-batches of
about ``--micro-batch-tokens`` tokens. With ``--rollout-distribution scatter`` each ring rank
receives only its ``RingPlan`` shard of the token ids and targets (``scatter_for_ring``); with
``broadcast`` every ring rank receives whole samples (``broadcast_chunked``) and shards them
itself (the OpenRLHF-style baseline). Each micro-batch is then a ``Shard``: forwards run under
``ring_context``. Advantages need whole sequences, so the per-token log-probs / values of a
shard are gathered (floats only, ``gather_from_ring``), the math of ``ppo.advantages`` runs on
whole samples, and each rank keeps its own slots of the result.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from rlhf_kernels.ring.gather import gather_from_ring
from rlhf_kernels.ring.plan import RingPlan
from trainers import common
from trainers.distributed import Layout

TOKEN_KEYS = ("input_ids", "targets")


@dataclass
class Shard:
    """One ring micro-batch as this rank holds it; experience over its local action slots."""

    plan: RingPlan
    ids: torch.Tensor  # (local_len,)
    targets: torch.Tensor  # (local_len,) next-token targets, -100 off actions and at pads
    samples: list = field(default_factory=list)  # ppo.Sample bookkeeping (no token ids)
    old_logp: torch.Tensor | None = None  # (local actions,)
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def actions(self) -> torch.Tensor:
        return self.targets != -100

    @property
    def n_local(self) -> int:
        return int(self.actions.sum())


def update_scope(mb, layout: Layout):
    """Where an update micro-batch's forward AND backward run: a ring shard's ``ring_context``
    (gradient checkpointing recomputes ring attention in backward), else nothing."""
    if not isinstance(mb, Shard):
        return contextlib.nullcontext()
    from rlhf_kernels.integrations.hf import ring_context

    return ring_context(mb.plan, layout.ring_group)


def hidden(model, shard: Shard, layout: Layout):
    """``(local actions, H)`` final hidden states and the action ids, under ``ring_context``."""
    from rlhf_kernels.integrations.hf import ring_context
    from trainers.modeling import base_model

    dev = layout.device
    with ring_context(shard.plan, layout.ring_group):
        out = base_model(model)(
            input_ids=shard.ids[None].to(dev),
            position_ids=shard.plan.position_ids(layout.ring_rank)[None].to(dev),
            use_cache=False,
        ).last_hidden_state[0]
    sel = shard.actions.to(dev)
    return out[sel], shard.targets.to(dev)[sel]


def _shard(plan: RingPlan, ids, targets, samples, layout: Layout) -> Shard:
    pads = ~plan.valid_mask(layout.ring_rank)
    return Shard(plan, ids.long(), targets.long().masked_fill(pads, -100), samples)


def _bookkeeping(meta: list[dict], plan: RingPlan) -> list:
    from trainers.ppo import Sample

    cu = plan.cu_seqlens
    return [
        Sample(None, m["n_prompt"], reward=m["reward"], length=cu[i + 1] - cu[i])
        for i, m in enumerate(meta)
    ]


def rollouts(session, make, prompts: list, cfg) -> tuple[list[Shard], object, int]:
    """Generate on every ring rank, stream to the group; returns this rank's shards, the first
    sample's text (for the progress line) and the token-tensor bytes this rank received."""
    from rlhf_kernels.comm._wire import MIN_CHUNK_BYTES
    from rlhf_kernels.comm.distributed import distributed_rollouts

    layout = session.layout
    scatter = cfg.rollout_distribution == "scatter"
    stream = distributed_rollouts(
        prompts,
        make,
        group=layout.ring_group,
        token_keys=TOKEN_KEYS if scatter else None,
        layout=cfg.ring_layout,
        # the stream's micro-batches are the training micro-batches: two int64 per token (at
        # least the wire's smallest chunk), objects not counted, so --micro-batch-tokens holds
        max_chunk_bytes=max(cfg.micro_batch_tokens * 16, MIN_CHUNK_BYTES),
        count_objects=False,
    )
    shards, first_text, received = [], None, 0
    try:
        for item in stream:
            if scatter:
                plan, local, meta = item
                ids, targets = local["input_ids"], local["targets"]
                received += sum(t.numel() * t.element_size() for t in (ids, targets))
            else:  # whole samples on every ring rank: shard them here
                meta = item
                received += sum(
                    m[k].numel() * m[k].element_size() for m in meta for k in TOKEN_KEYS
                )
                packed = common.pack_sequences([m["input_ids"] for m in meta])
                plan = RingPlan.build(packed.cu_seqlens, layout.ring, cfg.ring_layout)
                r = layout.ring_rank
                ids = plan.shard(packed.input_ids, r)
                targets = plan.shard(torch.cat([m["targets"] for m in meta]), r)
            if first_text is None and meta:
                first_text = meta[0]["text"]
            shards.append(_shard(plan, ids, targets, _bookkeeping(meta, plan), layout))
    except RuntimeError as e:  # generate / the reward function failed on some ring rank
        common.fail(str(e))
    return shards, first_text, received


def experience(shards: list[Shard], actor, ref, critic, cfg, layout: Layout, pad_id: int) -> dict:
    """Forwards on the shards (plus padding ones: ring groups may stream different counts, and
    ZeRO-3 gathers weights in every forward), whole-sample advantages, local slots back."""
    from trainers.ppo import advantages

    with torch.no_grad():
        for sh in shards:
            sh.old_logp = actor(sh, layout)[0].float().cpu()
            sh.ref_logp = ref(sh, layout)[0].float().cpu()
            if critic is not None:
                sh.values = critic(sh, layout).float().cpu()
        for sh in padding(len(shards), layout, pad_id, cfg):
            actor(sh, layout), ref(sh, layout)
            if critic is not None:
                critic(sh, layout)
    samples = []
    for sh in shards:  # gather each per-token field over the ring, cut into samples
        cu = sh.plan.cu_seqlens
        for name in ("old_logp", "ref_logp", "values"):
            local = getattr(sh, name)
            if local is None:
                continue
            full = torch.zeros(sh.plan.local_len)
            full[sh.actions] = local
            whole = gather_from_ring(full.to(layout.device), sh.plan, layout.ring_group).cpu()
            for i, s in enumerate(sh.samples):
                setattr(s, name, whole[cu[i] + s.n_prompt - 1 : cu[i + 1] - 1])
        samples += sh.samples
    stats = advantages(samples, cfg, layout, repeats=layout.tp * layout.ring)
    for sh in shards:  # each rank keeps its own slots
        cu = sh.plan.cu_seqlens
        for name in ("advantages", "returns"):
            whole = torch.zeros(sh.plan.total)
            for i, s in enumerate(sh.samples):
                whole[cu[i] + s.n_prompt - 1 : cu[i + 1] - 1] = getattr(s, name)
            setattr(sh, name, sh.plan.shard(whole, layout.ring_rank)[sh.actions])
    return stats


def padding(n: int, layout: Layout, pad_id: int, cfg) -> list[Shard]:
    """Dummy shards that bring this rank's ``n`` micro-batches up to the busiest rank's."""
    from trainers.distributed import max_across

    return [dummy(layout, pad_id, cfg) for _ in range(max_across(n, layout) - n)]


def dummy(layout: Layout, pad_id: int, cfg) -> Shard:
    """A 2-token micro-batch with one action, for ranks whose plan is shorter (weight 0)."""
    from trainers.ppo import Sample

    plan = RingPlan.build([0, 2], layout.ring, cfg.ring_layout)
    r = layout.ring_rank
    ids = plan.shard(torch.tensor([pad_id, pad_id]), r)
    targets = plan.shard(torch.tensor([pad_id, -100]), r)
    sh = _shard(plan, ids, targets, [Sample(None, 1, length=2)], layout)
    n = sh.n_local
    sh.old_logp = sh.ref_logp = sh.advantages = sh.values = sh.returns = torch.zeros(n)
    return sh
