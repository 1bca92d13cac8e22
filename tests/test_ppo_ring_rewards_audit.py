"""Audit of ``trainers.ppo_ring`` (experience on a ring of two, simulated in-process with two
threads and a fake ``gather_from_ring``), ``trainers.rewards`` (the toy rewards' argument
checks), ``trainers.rollout`` (prompt ids and seeds of ``HFGenerationEngine``) and
``rlhf_kernels.ring.spawn`` (argument checks; a helper's failure under ``gloo_rank0``)."""

from __future__ import annotations

import math
import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from rlhf_kernels.ring.spawn import gloo_rank0, run_gloo
from trainers import rewards
from trainers.rollout import HFGenerationEngine

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- ppo_ring
def _ring_layout(rank: int, ring: int = 2):
    from trainers.distributed import Layout

    return Layout(ring, rank, 1, ring, 1, CPU)


class _FakeRing:
    """``gather_from_ring`` for two threads playing ring ranks 0 and 1 (the n-th call of each
    thread meets the n-th call of the other)."""

    def __init__(self):
        self.barrier, self.slots, self.me = threading.Barrier(2, timeout=20), {}, threading.local()

    def gather(self, local, plan, group=None):
        k = self.me.calls
        self.me.calls += 1
        self.slots[k, self.me.rank] = local.clone()
        self.barrier.wait()
        out = plan.unshard([self.slots[k, 0], self.slots[k, 1]])
        self.barrier.wait()
        return out


@pytest.mark.parametrize("estimator, layout", [("gae", "zigzag"), ("reinforce", "contiguous")])
def test_ring_experience_on_a_ring_of_two_gives_each_rank_its_own_slots(
    monkeypatch, estimator, layout
):
    """Each ring rank of two gets, at each of its local action slots, the advantage / return of
    that token in the plain (whole-sample) experience, and the same statistics; a ring of one
    cannot tell rank 0's slots from rank 1's."""
    pytest.importorskip("deepspeed")
    from test_ppo_trainer_contract import StubModel, _samples

    from trainers import common, ppo, ppo_ring

    cfg = ppo.PPOConfig(advantage_estimator=estimator, n_samples_per_prompt=2, kl_coef=0.1)
    cfg.ring_layout = layout
    gae = estimator == "gae"
    samples = _samples(lens=(3, 1, 2, 4, 2, 3))
    crit = StubModel(0.1, 0, False) if gae else None
    want = ppo.make_experience(samples, StubModel(-0.01, -1), StubModel(-0.02, -0.5), crit, cfg,
                               _ring_layout(0, 1), 0)  # fmt: skip
    # world of two ring ranks holding the same samples: sums over the world double
    monkeypatch.setattr(ppo, "sum_across", lambda vals, layout, group=None: [2 * v for v in vals])
    monkeypatch.setattr("trainers.distributed.max_across", lambda n, layout: n)
    fake = _FakeRing()
    monkeypatch.setattr(ppo_ring, "gather_from_ring", fake.gather)
    parts = (samples[:4], samples[4:])
    shards = {0: [], 1: []}
    for part in parts:
        packed = common.pack_sequences([s.ids for s in part])
        plan = ppo_ring.RingPlan.build(packed.cu_seqlens, 2, cfg.ring_layout)
        targets = torch.cat([s.targets() for s in part])
        meta = [{"n_prompt": s.n_prompt, "reward": s.reward} for s in part]
        for r in (0, 1):
            book = ppo_ring._bookkeeping(meta, plan)
            ids, tg = plan.shard(packed.input_ids, r), plan.shard(targets, r)
            shards[r].append(ppo_ring._shard(plan, ids, tg, book, _ring_layout(r)))
    got = {}

    def run(r):
        fake.me.rank, fake.me.calls = r, 0
        try:
            crit = StubModel(0.1, 0, False) if gae else None
            got[r] = ppo_ring.experience(shards[r], StubModel(-0.01, -1), StubModel(-0.02, -0.5),
                                         crit, cfg, _ring_layout(r), 0)  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - reported below
            got[r] = e
            fake.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in (0, 1):
        assert not isinstance(got[r], BaseException), got[r]
        assert got[r] == pytest.approx(want, rel=1e-6, abs=1e-9)
    for part, sh0, sh1 in zip(parts, shards[0], shards[1]):
        plan, cu = sh0.plan, sh0.plan.cu_seqlens
        for x, s in zip(sh0.samples, part):  # the gathered per-sample fields
            torch.testing.assert_close(x.old_logp, s.old_logp)
            torch.testing.assert_close(x.ref_logp, s.ref_logp)
        for r, sh in enumerate((sh0, sh1)):
            assert 0 < sh.n_local < sum(s.n_act for s in part)  # both ranks hold actions
            idx = plan.global_index[r][sh.actions].tolist()  # packed index of each local action
            adv, ret = [], []
            for g in idx:
                i = max(d for d in range(len(part)) if cu[d] <= g)
                j = g - cu[i] - (part[i].n_prompt - 1)  # action j of sample i
                adv.append(part[i].advantages[j])
                ret.append(part[i].returns[j])
            torch.testing.assert_close(sh.advantages, torch.stack(adv).float(), msg=f"rank {r}")
            torch.testing.assert_close(sh.returns, torch.stack(ret).float(), msg=f"rank {r}")


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("ring", [2, 3, 4])
def test_ring_dummy_shard_has_one_action_over_the_ring(ring, layout):
    """The padding shard is a 2-token sample with one action: over the ring's ranks exactly
    one slot is an action, and each rank's experience tensors match its local actions."""
    pytest.importorskip("deepspeed")
    from trainers import ppo, ppo_ring

    cfg = ppo.PPOConfig(ring_layout=layout)
    shards = [ppo_ring.dummy(_ring_layout(r, ring), 7, cfg) for r in range(ring)]
    assert sum(sh.n_local for sh in shards) == 1
    for sh in shards:
        for name in ("old_logp", "ref_logp", "values", "advantages", "returns"):
            assert getattr(sh, name).shape == (sh.n_local,)
        assert sh.samples[0].n_act == 1 and sh.ids[sh.actions].tolist() in ([], [7])


# ----------------------------------------------------------------------------- rewards
@pytest.mark.parametrize("fn", [rewards.reverse_reward, rewards.letters_reward])
def test_toy_rewards_refuse_a_single_string(fn):
    """A str of the right length used to be scored character by character."""
    with pytest.raises(ValueError, match="target: expected a list of strings, got the str"):
        fn(None, ["ab", "cd"], "ac")
    with pytest.raises(ValueError, match="responses: expected a list of strings, got the str"):
        fn(None, "ab", ["a", "b"])
    assert fn(None, ["ab", "cd"], ("ab", "cd")) == [1.0, 1.0]


# ----------------------------------------------------------------------------- rollout
class _Tok:
    eos_token_id, pad_token_id = 1, 0


class _Recorder(torch.nn.Module):
    """A causal LM stand-in: ``generate`` records its inputs and answers EOS at once."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def generate(self, input_ids, **kw):
        self.seen.append(input_ids.tolist())
        return torch.cat([input_ids, torch.ones_like(input_ids[:, :1])], 1)


@pytest.mark.parametrize("bad", [6.7, -1, True, None, "7"])
def test_generate_refuses_prompt_ids_that_are_not_token_ids(bad):
    """A float id was truncated silently (6.7 -> 6), a negative one failed in the embedding."""
    model = _Recorder()
    eng = HFGenerationEngine(model, _Tok())
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected token ids \(ints >= 0\), got"):
        eng.generate([[5], [5, bad]], n_samples=1, max_new_tokens=2)
    assert model.seen == []
    assert eng.generate([[5, np.int64(6)]], n_samples=2, max_new_tokens=2) == [[1], [1]]
    assert model.seen == [[[5, 6], [5, 6]]]


@pytest.mark.parametrize("seed", [1.5, True, None, "3"])
def test_generate_refuses_a_seed_that_is_not_an_int(seed):
    """``torch.manual_seed(1.5)`` seeds 1: seeds 1.5 and 1.9 gave the same responses."""
    model = _Recorder()
    with pytest.raises(ValueError, match="generate: seed: expected an int, got"):
        HFGenerationEngine(model, _Tok()).generate([[5]], n_samples=1, max_new_tokens=1, seed=seed)
    assert model.seen == []
    out = HFGenerationEngine(model, _Tok()).generate(
        [[5]], n_samples=1, max_new_tokens=1, seed=np.int64(-3)
    )
    assert out == [[1]]


# ----------------------------------------------------------------------------- spawn
def _rank(rank, world):
    dist.barrier()
    return rank


def _boom(rank, world):
    raise ValueError(f"helper {rank} says boom")


def _vanish(rank, world):
    os._exit(3)


@pytest.mark.parametrize(
    "kw, text",
    [
        (dict(world_size=0), "world_size: expected an int >= 1, got 0"),
        (dict(world_size=-2), "world_size: expected an int >= 1, got -2"),
        (dict(world_size=2.0), "world_size: expected an int >= 1, got 2.0"),
        (dict(threads=0), "threads: expected an int >= 1, got 0"),
        (dict(timeout_s=0), "timeout_s: expected a finite number of seconds > 0, got 0"),
        (dict(timeout_s=-1.0), "timeout_s"),
        (dict(timeout_s=math.nan), "timeout_s"),
        (dict(timeout_s=math.inf), "timeout_s"),
        (dict(timeout_s=True), "timeout_s"),
    ],
)
def test_spawn_helpers_refuse_bad_arguments_before_starting(kw, text):
    """``run_gloo(fn, 0)`` returned ``[]`` without running ``fn`` anywhere."""
    kw = dict(world_size=2) | kw
    world = kw.pop("world_size")
    with pytest.raises(ValueError, match=f"run_gloo: {text}"):
        run_gloo(_rank, world, **kw)
    with pytest.raises(ValueError, match=f"gloo_rank0: {text}"):
        with gloo_rank0(_rank, world, **kw):
            pass


@pytest.mark.multiproc
@pytest.mark.slow
def test_gloo_rank0_reports_the_helpers_failure():
    """A helper that raised: rank 0's collective fails with a bare "Connection closed by peer";
    the helper's traceback used to be lost. A helper gone without a result: a bare
    ``queue.Empty`` after the whole timeout. Both are now ``RuntimeError`` naming the rank."""
    with gloo_rank0(_rank, 3, timeout_s=60) as others:
        dist.barrier()
    assert others == [1, 2]
    with pytest.raises(RuntimeError, match="(?s)rank 1 .*ValueError: helper 1 says boom"):
        with gloo_rank0(_boom, 2, timeout_s=60):
            dist.barrier()
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 ---\nexited \(exit code 3\) without a result"):
        with gloo_rank0(_vanish, 2, timeout_s=60):
            pass
    assert time.monotonic() - t < 30
