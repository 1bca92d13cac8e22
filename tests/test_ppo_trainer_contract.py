"""In-process contract of the PPO trainer's bookkeeping: micro-batches and their padding,
experience forwards, statistics over ranks (faked by scaling ``sum_across``: every rank holds
the same samples), prompt placement, generation seeds, evaluation's share, defaults, the
ring's experience and update on a ring of one, and the reward columns. Stub engines and models,
no process spawning."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from test_ppo_math_contract import StubEngine, _rollout  # noqa: E402

from trainers import common, ppo, ppo_ring  # noqa: E402
from trainers.distributed import Layout  # noqa: E402

CPU = torch.device("cpu")
ONE = Layout(1, 0, 1, 1, 1, CPU)


def _ranks(monkeypatch, k: int, busiest: int | None = None):
    """``k`` ranks holding the same values (``sum_across`` scales by ``k``); ``busiest``: the
    micro-batch count of the busiest rank (``max_across``)."""
    monkeypatch.setattr(ppo, "sum_across", lambda vals, layout, group=None: [k * v for v in vals])
    fake = lambda n, layout: max(n, busiest or 0)  # noqa: E731
    monkeypatch.setattr(ppo, "max_across", fake)
    monkeypatch.setattr("trainers.distributed.max_across", fake)
    monkeypatch.setattr(ppo, "optimizer_step", lambda engine, layout: engine.step() or 0.0)


def _stub_actor(theta, mb, layout):
    """``logp = old + theta * shift``; samples without ``shift`` (padding, ring shards) shift
    by 1."""
    if isinstance(mb, ppo_ring.Shard):
        ones = torch.ones(mb.n_local, dtype=torch.float64)
        return mb.old_logp.double() + theta * ones, ones * theta
    shift = [getattr(s, "shift", torch.ones(s.n_act, dtype=torch.float64)) for s in mb]
    old = torch.cat([s.old_logp.double() for s in mb])
    ent = torch.cat([getattr(s, "ent", torch.ones(s.n_act, dtype=torch.float64)) for s in mb])
    return old + theta * torch.cat(shift), ent * theta


def _stub_critic(theta, mb, layout):
    return torch.cat([s.values.double() + theta * 0.3 for s in mb])


class Recorder(StubEngine):
    """StubEngine that also records the accumulation boundaries."""

    def __init__(self, fn):
        super().__init__(fn)
        self.boundaries = []

    def set_gradient_accumulation_boundary(self, last):
        self.boundaries.append(last)


# ----------------------------------------------------------------------------- micro-batches
def test_micro_batches_hold_every_sample_once_within_the_budget(monkeypatch):
    samples = _rollout([4, 2, 5, 3, 1], n_prompt=3)
    cfg = ppo.PPOConfig(micro_batch_tokens=9)
    mbs = ppo.micro_batches(samples, cfg, ONE)
    got = sorted(id(s) for mb in mbs for s in mb)
    assert got == sorted(id(s) for s in samples)
    assert all(sum(len(s.ids) for s in mb) <= 9 for mb in mbs) and all(mbs)
    # a busier rank: empty lists pad up to its count, and train as 0-weight dummy forwards
    _ranks(monkeypatch, 1, busiest=len(mbs) + 2)
    padded = ppo.micro_batches(samples, cfg, ONE)
    assert [[id(s) for s in mb] for mb in padded] == [[id(s) for s in mb] for mb in mbs] + [[], []]
    ups = ppo.update_batches(samples, cfg, ONE, pad_id=0)
    assert [c for _, c in ups] == [True] * len(mbs) + [False, False]
    assert all(mb[0].n_act == 1 and mb[0].ids.tolist() == [0, 0] for mb, c in ups if not c)


@pytest.mark.parametrize("kw", [dict(), dict(loss_aggregation="seq-mean-token-sum-norm")])
def test_padding_micro_batches_run_but_count_zero(monkeypatch, kw):
    """A rank with fewer micro-batches runs dummy forwards / backwards (ZeRO collectives line
    up) that change neither the loss, the metrics nor the gradient; the accumulation boundary is
    the last backward only."""
    cfg = ppo.PPOConfig(micro_batch_tokens=9, kl_coef=0.2, kl_in_loss=True, entropy_coef=0.1, **kw)
    samples = _rollout([4, 2, 5])
    ref = StubEngine(_stub_actor)
    want = ppo.train_actor(ref, samples, cfg, ONE, 0)
    crit_want = ppo.train_critic(StubEngine(_stub_critic), samples, cfg, ONE, 0)
    _ranks(monkeypatch, 1, busiest=5)
    eng = Recorder(_stub_actor)
    got = ppo.train_actor(eng, samples, cfg, ONE, 0)
    assert eng.boundaries == [False] * 4 + [True] and eng.steps == 1
    assert eng.losses[3:] == [0.0, 0.0]
    for k in ("policy_loss", "actor_loss", "entropy", "clip_fraction", "approx_kl"):
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), k
    assert eng.grad == pytest.approx(ref.grad, rel=1e-9)
    crit = StubEngine(_stub_critic)
    assert ppo.train_critic(crit, samples, cfg, ONE, 0) == pytest.approx(crit_want, rel=1e-9)
    assert len(crit.losses) == 5 and crit.losses[3:] == [0.0, 0.0]


# ----------------------------------------------------------------------------- over ranks
DP2 = Layout(2, 0, 2, 1, 1, CPU)  # two data-parallel ranks
TP2 = Layout(2, 0, 1, 1, 2, CPU)  # one sample set held by a tensor-parallel pair


def test_global_moments_count_each_value_once(monkeypatch):
    """Values held by ``repeats`` ranks: the statistics of the values themselves."""
    x = torch.randn(37, generator=torch.Generator().manual_seed(1)) * 3 + 2
    _ranks(monkeypatch, 2)
    mean, var = ppo.global_moments(x, TP2, repeats=2)
    assert mean == pytest.approx(x.double().mean().item(), rel=1e-12)
    assert var == pytest.approx(x.double().var().item(), rel=1e-12)
    # two data-parallel ranks holding copies: twice the values (unbiased over 74)
    mean, var = ppo.global_moments(x, DP2, repeats=1)
    assert var == pytest.approx(x.double().var().item() * 72 / 73, rel=1e-12)


@pytest.mark.parametrize("estimator", ["gae", "reinforce", "reinforce_baseline", "grpo"])
def test_tensor_parallel_pairs_give_the_one_rank_experience(monkeypatch, estimator):
    """Each sample is held by the ``tp`` ranks of a pair: advantages and step statistics are
    those of one rank (``repeats`` defaults to ``tp``)."""

    def run():
        samples = _rollout([3, 1, 2, 4])
        for s, r in zip(samples, [1.0, 0.0, 0.6, 0.2]):  # float32, as the experience's
            s.reward, s.old_logp, s.ref_logp = r, s.old_logp.float(), s.ref_logp.float()
            s.values = s.values.float()
        cfg = ppo.PPOConfig(advantage_estimator=estimator, n_samples_per_prompt=2, kl_coef=0.1)
        return samples, ppo.advantages(samples, cfg, layout)

    layout = ONE
    want_s, want = run()
    _ranks(monkeypatch, 2)
    layout = TP2
    got_s, got = run()
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    for a, b in zip(got_s, want_s):
        torch.testing.assert_close(a.advantages, b.advantages)
        torch.testing.assert_close(a.returns, b.returns)


@pytest.mark.parametrize("layout", [DP2, TP2], ids=["dp2", "tp2"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_identical_ranks_reproduce_the_one_rank_update(monkeypatch, layout, agg):
    """Two data-parallel ranks with the same samples (DeepSpeed averages their identical
    gradients) or a tensor-parallel pair: the same metrics and gradient as one rank."""
    cfg = ppo.PPOConfig(
        micro_batch_tokens=9, kl_coef=0.2, kl_in_loss=True, entropy_coef=0.1,
        loss_aggregation=agg, advantage_estimator="gae", max_new_tokens=6,
    )  # fmt: skip
    samples = _rollout([4, 2, 5])
    monkeypatch.setattr(ppo, "optimizer_step", lambda engine, layout: engine.step() or 0.0)
    one, crit_one = StubEngine(_stub_actor), StubEngine(_stub_critic)
    want = ppo.train_actor(one, samples, cfg, ONE, 0)
    want_v = ppo.train_critic(crit_one, samples, cfg, ONE, 0)
    _ranks(monkeypatch, 2)
    eng, crit = StubEngine(_stub_actor), StubEngine(_stub_critic)
    got = ppo.train_actor(eng, samples, cfg, layout, 0)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert eng.grad == pytest.approx(one.grad, rel=1e-9)
    assert ppo.train_critic(crit, samples, cfg, layout, 0) == pytest.approx(want_v, rel=1e-9)
    assert crit.grad == pytest.approx(crit_one.grad, rel=1e-9)


# ----------------------------------------------------------------------------- experience
class StubModel(torch.nn.Module):
    """Per-action outputs from the target token ids (``Sample`` lists and ring shards alike):
    ``scale * id + bias``; counts its forwards."""

    def __init__(self, scale, bias, pair=True):
        super().__init__()
        self.scale, self.bias, self.pair, self.calls = scale, bias, pair, 0

    def forward(self, mb, layout):
        self.calls += 1
        if isinstance(mb, ppo_ring.Shard):
            t = mb.targets[mb.actions]
        else:
            t = torch.cat([s.targets()[s.targets() != -100] for s in mb])
        out = self.scale * t.float() + self.bias
        return (out, torch.zeros_like(out)) if self.pair else out


def _samples(lens=(3, 1, 2, 4), n_prompt=2, seed=5):
    g = torch.Generator().manual_seed(seed)
    rewards = [1.0, 0.0, 0.5, 0.25, 0.75, 0.1]
    return [
        ppo.Sample(torch.randint(3, 50, (n_prompt + n,), generator=g), n_prompt, reward=r)
        for n, r in zip(lens, rewards)
    ]


def _expected(s, scale, bias):
    return scale * s.ids[s.n_prompt :].float() + bias


def test_make_experience_fills_each_sample_from_its_own_tokens(monkeypatch):
    """old / ref log-probs and values of each sample are the models' outputs on ITS action
    tokens (whatever the micro-batch split); the advantages follow from them."""
    cfg = ppo.PPOConfig(advantage_estimator="gae", n_samples_per_prompt=2, micro_batch_tokens=7)
    actor, ref, critic = StubModel(-0.01, -1), StubModel(-0.02, -0.5), StubModel(0.1, 0, False)
    samples = _samples()
    stats = ppo.make_experience(samples, actor, ref, critic, cfg, ONE, pad_id=0)
    for s in samples:
        torch.testing.assert_close(s.old_logp, _expected(s, -0.01, -1))
        torch.testing.assert_close(s.ref_logp, _expected(s, -0.02, -0.5))
        torch.testing.assert_close(s.values, _expected(s, 0.1, 0))
    twin = [ppo.Sample(s.ids, s.n_prompt, reward=s.reward) for s in samples]
    for t, s in zip(twin, samples):
        t.old_logp, t.ref_logp, t.values = s.old_logp, s.ref_logp, s.values
    assert stats == ppo.advantages(twin, cfg, ONE)
    # a busier rank: padding forwards on every model, none changes the experience
    calls = [m.calls for m in (actor, ref, critic)]
    _ranks(monkeypatch, 1, busiest=len(ppo.micro_batches(samples, cfg, ONE)) + 2)
    assert ppo.make_experience(samples, actor, ref, critic, cfg, ONE, 0) == stats
    assert [m.calls - c for m, c in zip((actor, ref, critic), calls)] == [calls[0] + 2] * 3


def _ring_of_one(samples, cfg):
    """Two ring micro-batches (shards of a ring of one) of ``samples``' halves, as
    ``ppo_ring.rollouts`` builds them."""
    shards = []
    for part in (samples[:4], samples[4:]):
        packed = common.pack_sequences([s.ids for s in part])
        plan = ppo_ring.RingPlan.build(packed.cu_seqlens, 1, cfg.ring_layout)
        targets = plan.shard(torch.cat([s.targets() for s in part]), 0)
        meta = [{"n_prompt": s.n_prompt, "reward": s.reward} for s in part]
        book = ppo_ring._bookkeeping(meta, plan)
        shards.append(ppo_ring._shard(plan, plan.shard(packed.input_ids, 0), targets, book, ONE))
    return shards


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_ring_experience_on_a_ring_of_one_is_the_plain_experience(estimator):
    """``ppo_ring.experience`` (shards -> whole samples -> advantages -> local slots) on a ring
    of one matches ``make_experience`` on the samples, slot for slot."""
    cfg = ppo.PPOConfig(advantage_estimator=estimator, n_samples_per_prompt=2, kl_coef=0.1)
    models = lambda: (StubModel(-0.01, -1), StubModel(-0.02, -0.5), StubModel(0.1, 0, False))  # noqa: E731
    crit = lambda m: m if estimator == "gae" else None  # noqa: E731
    samples = _samples(lens=(3, 1, 2, 4, 2, 3))
    a, r, c = models()
    want = ppo.make_experience(samples, a, r, crit(c), cfg, ONE, 0)
    shards = _ring_of_one(samples, cfg)
    a, r, c = models()
    got = ppo_ring.experience(shards, a, r, crit(c), cfg, ONE, 0)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
    ring_samples = [x for sh in shards for x in sh.samples]
    assert [x.n_act for x in ring_samples] == [s.n_act for s in samples]
    for x, s in zip(ring_samples, samples):
        for name in ("old_logp", "ref_logp", "advantages", "returns"):
            torch.testing.assert_close(getattr(x, name), getattr(s, name), msg=name)
    for sh, part in zip(shards, (samples[:4], samples[4:])):
        torch.testing.assert_close(sh.advantages, torch.cat([s.advantages for s in part]))
        torch.testing.assert_close(sh.returns, torch.cat([s.returns for s in part]))
    assert a.calls == 2  # one forward per shard, no padding ones
    # the update on the shards is the update on the samples (Dr. GRPO: samples x max_new_tokens)
    cfg.loss_aggregation, cfg.micro_batch_tokens = "seq-mean-token-sum-norm", 8
    for kind, batch in (("samples", samples), ("shards", shards)):
        eng = StubEngine(_stub_actor)
        got = ppo.train_actor(eng, batch, cfg, ONE, 0)
        if kind == "samples":
            want, grad, n_mb = got, eng.grad, len(eng.losses)
    assert got == pytest.approx(want, rel=1e-6) and eng.grad == pytest.approx(grad, rel=1e-6)
    assert n_mb > 2 and len(eng.losses) == 2


def test_ring_padding_shards_count_zero(monkeypatch):
    """A ring rank with fewer micro-batches runs dummy shards that change nothing."""
    cfg = ppo.PPOConfig(n_samples_per_prompt=2)
    shards = _ring_of_one(_samples(lens=(3, 1, 2, 4, 2, 3)), cfg)
    ppo_ring.experience(shards, StubModel(-0.01, -1), StubModel(-0.02, -0.5), None, cfg, ONE, 0)
    _ranks(monkeypatch, 1)
    one = StubEngine(_stub_actor)
    want = ppo.train_actor(one, shards, cfg, ONE, 0)
    _ranks(monkeypatch, 1, busiest=4)
    eng = StubEngine(_stub_actor)
    got = ppo.train_actor(eng, shards, cfg, ONE, 0)
    assert len(eng.losses) == 4 and eng.losses[2:] == [0.0, 0.0]
    assert got == pytest.approx(want, rel=1e-9) and eng.grad == pytest.approx(one.grad, rel=1e-9)


def test_ring_shards_count_no_pad_slot_as_an_action():
    """Ring shards pad the stream up to the ring's slots: pad slots are never actions, so the
    ranks' local action counts add up to the samples' actions."""
    cfg = ppo.PPOConfig()
    samples = _samples(lens=(3, 2))
    packed = common.pack_sequences([s.ids for s in samples])
    plan = ppo_ring.RingPlan.build(packed.cu_seqlens, 2, cfg.ring_layout)
    targets = torch.cat([s.targets() for s in samples])
    assert plan.local_len * 2 > plan.total  # the plan has pad slots
    shards = [  # plan.shard fills pad slots with 0: a token id, not -100
        ppo_ring._shard(plan, plan.shard(packed.input_ids, r), plan.shard(targets, r), [], lay)
        for r, lay in enumerate(Layout(2, r, 1, 2, 1, CPU) for r in range(2))
    ]
    assert sum(sh.n_local for sh in shards) == sum(s.n_act for s in samples)
    assert ppo_ring.dummy(ONE, 0, cfg).n_local == 1


def test_an_empty_response_neither_takes_nor_moves_a_reward():
    """A response with no token (a generation engine may return one) has no token to carry its
    reward: the reward of its neighbour stays on the neighbour's last token (it was overwritten:
    the indices ``cu[1:] - 1`` of an empty sample are its predecessor's, or -1 for the first)."""
    cfg = ppo.PPOConfig(advantage_estimator="dr_grpo", n_samples_per_prompt=2)
    samples = []
    for n, rew in zip([0, 2, 3, 0], [5.0, 1.0, 0.0, 4.0]):
        s = ppo.Sample(torch.arange(2 + n), 2, reward=rew)
        s.old_logp = s.ref_logp = torch.zeros(n)
        samples.append(s)
    ppo.advantages(samples, cfg, ONE)
    # dr_grpo: the reward minus its group's mean, on the last token, gamma 1
    assert [s.returns.tolist() for s in samples] == [[], [-2.0, -2.0], [-2.0, -2.0, -2.0], []]


# ----------------------------------------------------------------------------- placement
@pytest.mark.parametrize(
    "rollout,n,size,dp",
    [
        (8, 2, 8, 2),
        (8, 2, 16, 2),
        (8, 4, 8, 2),
        (8, 2, 4, 2),
        (6, 2, 2, 3),
        (12, 3, 12, 2),
        (4, 4, 2, 2),
    ],
)
def test_prompt_positions_split_every_mini_batch_over_the_ranks(rollout, n, size, dp):
    """Every prompt goes to exactly one rank, each rank gets its share; when a mini-batch's
    whole prompts split evenly, rank r's samples of mini-batch b are the r-th slice of the
    one-rank run's mini-batch b (an optimizer step trains on the same samples)."""
    cfg = ppo.PPOConfig(rollout_batch_size=rollout, n_samples_per_prompt=n, batch_size=size)
    per_rank = [ppo.prompt_positions(cfg, Layout(dp, r, dp, 1, 1, CPU)) for r in range(dp)]
    assert sorted(p for ps in per_rank for p in ps) == list(range(rollout))
    assert all(len(ps) == rollout // dp for ps in per_rank)
    assert ppo.prompt_positions(cfg, ONE) == list(range(rollout))
    per_batch = size // n
    if size % n == 0 and per_batch % dp == 0:
        k = per_batch // dp
        for r, ps in enumerate(per_rank):
            for b in range(rollout // per_batch):
                assert ps[b * k : (b + 1) * k] == list(
                    range(b * per_batch + r * k, b * per_batch + (r + 1) * k)
                )


# ----------------------------------------------------------------------------- generation
class _Tok:
    eos_token_id, pad_token_id = 1, 2

    def encode(self, text):
        return [3 + ord(c) % 40 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class _Gen:
    """A ZeRO-3 style (synced) engine recording each call's prompts and seed."""

    synced = True

    def __init__(self):
        self.calls = []

    def generate(self, prompts, *, n_samples, max_new_tokens, seed=None, **kw):
        self.calls.append((prompts, seed))
        return [[5, 1] for _ in prompts for _ in range(n_samples)]


def _seeds(cfg, rows, step, positions):
    gen = _Gen()
    ppo.generate(gen, _Tok(), rows, cfg, ONE, step, positions)
    return [seed for _, seed in gen.calls]


def test_generate_seeds_by_step_and_position_and_keeps_synced_ranks_in_step(monkeypatch):
    """A prompt's responses are seeded by (seed, step, its place in the rollout batch): the same
    on any rank, another for every other prompt; a synced rank with fewer prompts makes dummy
    calls up to the busiest rank's count."""
    cfg = ppo.PPOConfig(n_samples_per_prompt=2)
    rows = [{"prompt": "ab"}, {"prompt": "cd"}]
    both = _seeds(cfg, rows, 4, [5, 9])
    assert len(set(both)) == 2 and _seeds(cfg, rows[1:], 4, [9]) == both[1:]
    assert set(_seeds(cfg, rows, 5, [5, 9])).isdisjoint(both)
    _ranks(monkeypatch, 1, busiest=4)
    gen = _Gen()
    samples, texts = ppo.generate(gen, _Tok(), rows, cfg, ONE, 4, [5, 9])
    assert len(gen.calls) == 4 and len(samples) == len(texts) == 4


def test_evaluate_scores_this_data_parallel_ranks_share_of_the_prompts(monkeypatch):
    from types import SimpleNamespace

    _ranks(monkeypatch, 1)  # the statistics of this rank alone
    session = SimpleNamespace(
        layout=Layout(2, 1, 2, 1, 1, CPU), tokenizer=_Tok(), on_every_rank=lambda f, *a: f(*a)
    )
    rows = [{"prompt": c} for c in "abcde"]
    gen = _Gen()
    reward = lambda prompts, responses, **_: [float(p in "bd") for p in prompts]  # noqa: E731
    cfg = ppo.PPOConfig(reward_fn="m:f")
    assert ppo.evaluate(session, gen, reward, rows, cfg) == {"eval_reward": 1.0}
    assert [p for prompts, _ in gen.calls for p in prompts] == [
        _Tok().encode("b"),
        _Tok().encode("d"),
    ]


# ----------------------------------------------------------------------------- defaults
def test_resolve_defaults_without_a_model(monkeypatch):
    """Without --model: the warm-started model and its template unless one is given."""
    from trainers import warm_start

    monkeypatch.setattr(warm_start, "ensure_warm_start", lambda: "/warm")
    monkeypatch.setattr(warm_start, "first_letter_prompts", lambda: "/prompts.jsonl")
    cfg = ppo.resolve_defaults(ppo.PPOConfig())
    assert (cfg.model, cfg.input_template, cfg.dataset, cfg.reward_fn) == (
        "/warm", warm_start.TEMPLATE, "/prompts.jsonl", warm_start.REWARD_FN,
    )  # fmt: skip
    cfg = ppo.resolve_defaults(ppo.PPOConfig(input_template="Q: {}", dataset="d.jsonl"))
    assert (cfg.model, cfg.input_template, cfg.reward_fn) == ("/warm", "Q: {}", None)

    def broken():
        raise OSError("disk full")

    monkeypatch.setattr(warm_start, "ensure_warm_start", broken)
    with pytest.raises(SystemExit):
        ppo.resolve_defaults(ppo.PPOConfig())


# ----------------------------------------------------------------------------- rewards
def test_score_passes_the_other_columns_but_not_the_prompt_twice():
    seen = {}

    def fn(prompts, responses, **cols):
        seen.update(cols, prompts=prompts)
        return [float(len(r)) for r in responses]

    cfg = ppo.PPOConfig(reward_fn="m:fn")
    samples = [ppo.Sample(torch.arange(4), 2), ppo.Sample(torch.arange(5), 2)]
    texts = [({"prompt": "a", "target": "x"}, "ab"), ({"prompt": "b", "target": "y"}, "abc")]
    ppo.score(fn, None, samples, texts, cfg, ONE)
    assert seen == {"prompts": ["a", "b"], "target": ["x", "y"]}
    assert [s.reward for s in samples] == [2.0, 3.0]


def test_peak_memory_sees_a_cpu_allocation():
    peak = ppo.PeakMemory(CPU)
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert x.sum() > 0
    assert peak.stop() >= 32 * 2**20
