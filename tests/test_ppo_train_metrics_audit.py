"""In-process audit of ``trainers.ppo.train``'s step metrics: the reward, length and token
statistics and their de-duplication over tensor-parallel / ring copies, the throughput and memory
numbers, the learning rate read before the updates, the means over the updates, and when the
greedy evaluations are logged. The session, generation, experience and updates are fakes with
known outputs and a fake clock (no model, no process group)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("deepspeed")

from trainers import common, ppo, ppo_ring  # noqa: E402
from trainers.distributed import Layout  # noqa: E402

CPU = torch.device("cpu")
MIB = 2**20
# four prompts x two responses: (prompt tokens, response lengths, rewards, greedy reward)
ROWS = [
    {"prompt": "a", "np": 3, "resp": (2, 5), "r": (1.0, -1.0), "g": 0.5},
    {"prompt": "b", "np": 4, "resp": (0, 3), "r": (0.5, 2.0), "g": 0.0},
    {"prompt": "c", "np": 2, "resp": (4, 1), "r": (0.25, 0.75), "g": 1.0},
    {"prompt": "d", "np": 5, "resp": (6, 2), "r": (-0.5, 0.1), "g": 0.25},
]
EVAL_ROWS = [{"prompt": "x", "g": 1.0}, {"prompt": "y", "g": 0.0}, {"prompt": "z", "g": 0.5}]


class FakeEngine:
    """The actor engine: ``get_lr`` moves by 1 per optimizer step (each ``train_actor``)."""

    def __init__(self):
        self.module, self.lr, self.steps = object(), 0.125, 0

    def get_lr(self):
        return [self.lr]

    def eval(self):
        pass


class FakeSession:
    """What ``train`` uses of ``Session``; records each step's metrics."""

    def __init__(self, layout, start, total, eval_at):
        self.layout, self.start_step, self.total, self.eval_at = layout, start, total, eval_at
        self.tokenizer = SimpleNamespace(pad_token_id=0, eos_token_id=1)
        self.engine, self.critic, self.logged, self.evaluated = FakeEngine(), None, {}, []

    def load_prompts(self):
        return ROWS, EVAL_ROWS

    def check_critic_folder(self, path):
        pass

    def load_reward(self):
        return lambda **_: None

    def load_causal_lm(self):
        return object()

    def load_score_model(self, path=None):
        return object()

    def build(self, module, check_tp_inputs=True):
        return self.engine, self.start_step

    def build_critic(self, module):
        self.critic = SimpleNamespace(module=object())
        return self.critic

    def progress(self, start):
        return range(start + 1, self.total + 1)

    def is_eval_step(self, step):
        return step in self.eval_at

    def end_step(self, step, metrics, engine, show=()):
        self.logged[step] = dict(metrics)

    def sample_line(self, step, text, reward):
        pass

    def finish(self, *args, **kw):
        pass

    def on_every_rank(self, fn, *args):
        return fn(*args)


def _fake_generate(session):
    def generate(gen, tok, rows, cfg, layout, step, positions, greedy=False):
        """Samples with the rows' lengths and rewards; a greedy reward grows by 1 per
        optimizer step taken (so evaluations before and after the updates differ)."""
        samples, texts = [], []
        for row in rows:
            if greedy:
                session.evaluated.append(step)
                s = ppo.Sample(torch.zeros(3, dtype=torch.long), 2, session.engine.steps + row["g"])
                samples.append(s), texts.append((row, "g"))
                continue
            for n, r in zip(row["resp"][: cfg.n_samples_per_prompt], row["r"]):
                samples.append(
                    ppo.Sample(torch.zeros(row["np"] + n, dtype=torch.long), row["np"], r)
                )
                texts.append((row, "t"))
        return samples, texts

    return generate


def _run(
    monkeypatch,
    layout=None,
    copies=1,
    start=0,
    total=2,
    eval_at=(2,),
    **kw,
):
    """``train`` on the fakes; ``copies``: ranks holding the same values (``sum_across`` and a
    SUM all-reduce scale by it, a MAX one keeps them). Returns the session and the calls."""
    layout = layout or Layout(1, 0, 1, 1, 1, CPU)
    session = FakeSession(layout, start, total, eval_at)
    calls = {"actor": [], "critic": []}
    clock = iter(x + 100 * k for k in range(100) for x in (0.0, 2.0, 6.0))  # t0, t1, t2 per step

    def train_actor(engine, batch, cfg, layout, pad):
        engine.steps += 1
        engine.lr += 1.0
        i = len(calls["actor"]) + 1
        calls["actor"].append(batch)
        return {"policy_loss": float(i), "actor_loss": 2.0 * i, "grad_norm": float(i * i)}

    def train_critic(engine, batch, cfg, layout, pad):
        calls["critic"].append(batch)
        return 10.0 * len(calls["critic"])

    def all_reduce(t, op=None, group=None):
        if op is not torch.distributed.ReduceOp.MAX:
            t.mul_(copies)

    def rollouts(s, make, prompts, cfg):
        rows = [row for _, row in prompts]
        samples, _ = ppo.generate(None, None, rows, cfg, s.layout, 0, [p for p, _ in prompts])
        shards = [SimpleNamespace(samples=samples[:3]), SimpleNamespace(samples=samples[3:])]
        return shards, (rows[0], "t"), 3 * MIB

    sub = {
        "generate": _fake_generate(session),
        "score": lambda *a: None,
        "make_experience": lambda *a: {"kl": 0.5, "advantage_mean": 0.0},
        "train_actor": train_actor,
        "train_critic": train_critic,
        "Actor": lambda lm, t: object(),
        "TokenCritic": lambda m: object(),
        "build_frozen": lambda *a: object(),
        "PeakMemory": lambda device: SimpleNamespace(stop=lambda: 5 * MIB),
        "sum_across": lambda vals, layout, group=None: [copies * v for v in vals],
        "time": SimpleNamespace(perf_counter=lambda: next(clock)),
        "dist": SimpleNamespace(all_reduce=all_reduce, ReduceOp=torch.distributed.ReduceOp),
    }
    for name, value in sub.items():
        monkeypatch.setattr(ppo, name, value)
    monkeypatch.setattr(ppo_ring, "rollouts", rollouts)
    monkeypatch.setattr(ppo_ring, "experience", lambda *a: {"kl": 0.5})
    monkeypatch.setattr("trainers.session.Session.start", lambda cfg, kind: session)
    monkeypatch.setattr("trainers.rollout.HFGenerationEngine", lambda *a, **k: object())
    base = dict(model="m", dataset="d", rollout_batch_size=4, n_samples_per_prompt=2, batch_size=8)
    ppo.train(ppo.PPOConfig(**{**base, **kw}))
    return session, calls


def _expected():
    """The statistics of the rollout batch by hand."""
    samples = [(row["np"], n, r) for row in ROWS for n, r in zip(row["resp"], row["r"])]
    rewards = torch.tensor([r for _, _, r in samples], dtype=torch.float64)
    return {
        "reward_mean": rewards.mean().item(),
        "reward_std": rewards.std(unbiased=False).item(),
        "response_length": sum(n for _, n, _ in samples) / len(samples),
        "tokens": float(sum(p + n for p, n, _ in samples)),
    }


LAYOUTS = {  # (layout, copies of each sample's bookkeeping that sum_across adds up)
    "one rank": (Layout(1, 0, 1, 1, 1, CPU), 1),
    "tp 2": (Layout(2, 1, 1, 1, 2, CPU), 2),
    "ring 2": (Layout(2, 1, 1, 2, 1, CPU), 2),
    "ring 2 x tp 2": (Layout(4, 3, 1, 2, 2, CPU), 4),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_step_statistics_count_each_sample_once(monkeypatch, name):
    """reward_mean / reward_std (population) / response_length / tokens are those of the
    rollout batch's samples, each counted once however many tp x ring ranks hold it; the
    memory numbers are the busiest rank's (a MAX, not a sum); rollout_s / train_s come from the
    step's own clock readings and tokens_per_s is tokens x --ppo-epochs / train_s."""
    layout, copies = LAYOUTS[name]
    session, _ = _run(monkeypatch, layout, copies, ppo_epochs=3)
    want = _expected()
    for step in (1, 2):
        m = session.logged[step]
        for key, value in want.items():
            assert m[key] == pytest.approx(value, rel=1e-12), (step, key)
        assert m["rollout_s"] == 2.0 and m["train_s"] == 4.0
        assert m["tokens_per_s"] == pytest.approx(want["tokens"] * 3 / 4.0, rel=1e-12)
        assert m["rollout_peak_mb"] == 5.0
        assert m["rollout_received_mb"] == (3.0 if layout.ring > 1 else 0.0)


def test_data_parallel_ranks_add_their_shares(monkeypatch):
    """Two data-parallel ranks with the same statistics: sums over ranks, means per sample
    (not per this rank's sample), and each rank trains on its part of every optimizer step."""
    layout = Layout(2, 1, 2, 1, 1, CPU)  # dp rank 1 of 2
    session, calls = _run(monkeypatch, layout, 2, total=1, eval_at=(), batch_size=4)
    assert [len(b) for b in calls["actor"]] == [2, 2]  # its half of each of the 2 steps
    half = [s for batch in calls["actor"] for s in batch]  # prompts 1 and 3 of the step's order
    order = common.batch_indices(1, len(ROWS), 4, ppo.PPOConfig().seed)
    assert [s.n_prompt for s in half] == [ROWS[order[j]]["np"] for j in (1, 1, 3, 3)]
    m = session.logged[1]
    rewards = torch.tensor([s.reward for s in half], dtype=torch.float64)
    assert m["reward_mean"] == pytest.approx(rewards.mean().item(), rel=1e-12)
    assert m["reward_std"] == pytest.approx(rewards.std(unbiased=False).item(), rel=1e-12)
    assert m["response_length"] == pytest.approx(sum(s.n_act for s in half) / 4, rel=1e-12)
    assert m["tokens"] == pytest.approx(2 * sum(len(s.ids) for s in half), rel=1e-12)


def test_updates_are_averaged_and_lr_is_read_before_them(monkeypatch):
    """With --ppo-epochs 2 and two optimizer steps per rollout batch: every mini-batch is
    trained once per epoch, the logged losses / grad_norm / value_loss are the means over the
    step's four updates, and lr is the one of the step's first update."""
    session, calls = _run(
        monkeypatch, ppo_epochs=2, batch_size=4, advantage_estimator="gae", eval_at=()
    )
    assert len(calls["actor"]) == len(calls["critic"]) == 8
    first = calls["actor"][:4]
    assert [len(b) for b in first] == [4, 4, 4, 4]
    assert first[0] is calls["critic"][0] and first[2] is first[0] and first[3] is first[1]
    assert len({id(s) for b in first[:2] for s in b}) == 8  # the two steps split the batch
    for step, ids in ((1, range(1, 5)), (2, range(5, 9))):
        m = session.logged[step]
        assert m["policy_loss"] == pytest.approx(sum(ids) / 4)
        assert m["actor_loss"] == pytest.approx(2 * sum(ids) / 4)
        assert m["grad_norm"] == pytest.approx(sum(i * i for i in ids) / 4)
        assert m["value_loss"] == pytest.approx(10 * sum(ids) / 4)
        assert m["lr"] == 0.125 + 4 * (step - 1)
        assert m["kl"] == 0.5


def test_eval_reward_before_the_first_update_and_on_eval_steps_only(monkeypatch):
    """eval_reward_before: step 1 only, measured before any update; eval_reward: on the eval
    steps only, after that step's update; the greedy mean over the held-out prompts."""
    session, _ = _run(monkeypatch, total=3, eval_at=(2,))
    g = sum(r["g"] for r in EVAL_ROWS) / len(EVAL_ROWS)
    logged = session.logged
    assert logged[1]["eval_reward_before"] == pytest.approx(g)
    assert "eval_reward" not in logged[1] and "eval_reward" not in logged[3]
    assert logged[2]["eval_reward"] == pytest.approx(g + 2)  # after two optimizer steps
    assert all("eval_reward_before" not in logged[s] for s in (2, 3))


def test_a_resumed_run_logs_no_eval_reward_before(monkeypatch):
    """A run resumed past step 0 neither runs nor logs the 'before' evaluation (its weights are
    trained): one greedy pass, the eval step's."""
    session, _ = _run(monkeypatch, start=1, total=2, eval_at=(2,))
    assert len(session.evaluated) == len(EVAL_ROWS)
    assert list(session.logged) == [2] and "eval_reward_before" not in session.logged[2]
    assert session.logged[2]["eval_reward"] == pytest.approx(0.5 + 1)


@pytest.mark.parametrize("tp", [1, 2])
def test_evaluate_counts_a_data_parallel_ranks_share_once(monkeypatch, tp):
    """evaluate: this data-parallel rank's held-out prompts (every dp-th), each counted once
    over its tensor-parallel copies; the mean over every rank's greedy rewards."""
    layout = Layout(2 * tp, tp, 2, 1, tp, CPU)  # dp rank 1
    seen = []
    monkeypatch.setattr(ppo, "sum_across", lambda vals, layout: [tp * v for v in vals])
    monkeypatch.setattr(ppo, "score", lambda *a: None)

    def generate(gen, tok, rows, cfg, layout, step, positions, greedy=False):
        seen.append((greedy, [r["prompt"] for r in rows]))
        return [ppo.Sample(torch.zeros(3), 2, r["g"]) for r in rows], [(r, "") for r in rows]

    monkeypatch.setattr(ppo, "generate", generate)
    session = SimpleNamespace(layout=layout, tokenizer=None, on_every_rank=lambda f, *a: f(*a))
    rows = [{"prompt": c, "g": g} for c, g in zip("abcde", (9.0, 1.0, 9.0, 3.0, 9.0))]
    assert ppo.evaluate(session, None, None, rows, ppo.PPOConfig()) == {"eval_reward": 2.0}
    assert seen == [(True, ["b", "d"])]


# ----------------------------------------------------------------------------- advantages
def _experience(lens=(2, 3, 1, 2), rewards=(1.0, -0.5, 0.25, 2.0)):
    """Samples with old / ref log-probs and values over their actions."""
    g = torch.Generator().manual_seed(3)
    out = []
    for n, r in zip(lens, rewards):
        s = ppo.Sample(torch.zeros(2 + n, dtype=torch.long), 2, reward=r)
        s.old_logp = -torch.rand(n, generator=g)
        s.ref_logp = -torch.rand(n, generator=g)
        s.values = torch.randn(n, generator=g)
        out.append(s)
    return out


def _whiten(x: list[float]) -> list[float]:
    m = sum(x) / len(x)
    var = sum((v - m) ** 2 for v in x) / (len(x) - 1)  # unbiased
    return [(v - m) / math.sqrt(var + 1e-8) for v in x]


def _k3(s) -> list[float]:
    """The k3 estimate of KL(actor || reference) on each action."""
    d = (s.ref_logp - s.old_logp).double()
    return (d.exp() - 1 - d).tolist()


def _token_rewards(samples, cfg, scalars):
    """Per sample: the scalar on the last action, minus kl_coef x the k3 KL on every action."""
    return [
        [r * (i == s.n_act - 1) - cfg.kl_coef * k for i, k in enumerate(_k3(s))]
        for s, r in zip(samples, scalars)
    ]


@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_baseline", "gae"])
def test_advantages_match_a_hand_computation(monkeypatch, estimator, copies):
    """advantages(): the reward on the last action, the KL subtracted per token; reinforce
    whitens the discounted returns, reinforce_baseline divides group-centred rewards by their
    (unbiased) std, gae whitens the GAE advantages (returns = advantages + values); the step
    statistics are token means (population std), each token counted once over ``copies``."""
    monkeypatch.setattr(
        ppo, "sum_across", lambda vals, layout, group=None: [copies * v for v in vals]
    )
    layout = Layout(copies, 0, 1, 1, copies, CPU)  # tp copies of the same samples
    cfg = ppo.PPOConfig(
        advantage_estimator=estimator, n_samples_per_prompt=2, kl_coef=0.3, gamma=0.8, lam=0.6
    )
    samples = _experience()
    stats = ppo.advantages(samples, cfg, layout)
    scalars = [s.reward for s in samples]
    if estimator == "reinforce_baseline":
        c = [r - (scalars[i] + scalars[i ^ 1]) / 2 for i, r in enumerate(scalars)]
        std = math.sqrt(sum(x * x for x in c) / (len(c) - 1))  # their mean is 0
        scalars = [x / (std + 1e-6) for x in c]
    adv, ret = [], []
    for s, tok in zip(samples, _token_rewards(samples, cfg, scalars)):
        v = s.values.double().tolist() + [0.0]
        a_run, g_run, a_s, r_s = 0.0, 0.0, [], []
        for t in reversed(range(len(tok))):
            g_run = tok[t] + cfg.gamma * g_run
            delta = tok[t] + cfg.gamma * v[t + 1] - v[t]
            a_run = delta + cfg.gamma * cfg.lam * a_run
            a_s.insert(0, a_run), r_s.insert(0, g_run if estimator != "gae" else a_run + v[t])
        adv += a_s if estimator == "gae" else r_s
        ret += r_s
    if estimator != "reinforce_baseline":
        adv = _whiten(adv)
    torch.testing.assert_close(
        torch.cat([s.returns for s in samples]).double(),
        torch.tensor(ret, dtype=torch.float64),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        torch.cat([s.advantages for s in samples]).double(),
        torch.tensor(adv, dtype=torch.float64),
        rtol=1e-5,
        atol=1e-5,
    )
    kl = [k for s in samples for k in _k3(s)]
    m = sum(adv) / len(adv)
    assert stats["kl"] == pytest.approx(sum(kl) / len(kl), rel=1e-5)
    assert stats["advantage_mean"] == pytest.approx(m, abs=1e-5)
    want_std = math.sqrt(sum((a - m) ** 2 for a in adv) / len(adv))
    assert stats["advantage_std"] == pytest.approx(want_std, rel=1e-5)


def test_kl_in_the_loss_leaves_the_token_rewards_alone():
    """--kl-in-loss: the returns carry the reward only (the KL is the loss's)."""
    cfg = ppo.PPOConfig(advantage_estimator="reinforce", kl_coef=0.3, kl_in_loss=True, gamma=0.5)
    samples = _experience()
    ppo.advantages(samples, cfg, Layout(1, 0, 1, 1, 1, CPU))
    for s in samples:
        want = [s.reward * 0.5 ** (s.n_act - 1 - i) for i in range(s.n_act)]
        torch.testing.assert_close(s.returns.double(), torch.tensor(want, dtype=torch.float64))


@pytest.mark.parametrize("copies", [1, 3])
def test_global_moments_and_whiten_are_the_unbiased_statistics(monkeypatch, copies):
    """global_moments: the mean and unbiased variance of the values, each counted once over
    the ``copies`` ranks holding it; global_whiten: (x - mean) / std."""
    monkeypatch.setattr(
        ppo, "sum_across", lambda vals, layout, group=None: [copies * v for v in vals]
    )
    layout = Layout(copies, 0, 1, 1, copies, CPU)
    x = torch.tensor([1e6 + 1.0, 1e6 + 2.0, 1e6 + 4.0, 1e6 + 9.0])
    mean, var = ppo.global_moments(x, layout, copies)
    assert mean == pytest.approx(1e6 + 4.0) and var == pytest.approx(x.double().var().item())
    want = (x.double() - x.double().mean()) / x.double().std()
    torch.testing.assert_close(
        ppo.global_whiten(x.double(), layout, copies), want, rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize(
    "layout", [Layout(2, 1, 1, 2, 1, CPU), Layout(4, 3, 1, 2, 2, CPU), Layout(2, 1, 2, 1, 1, CPU)]
)
def test_batch_seqs_count_a_samples_ring_and_tp_copies_once(monkeypatch, layout):
    """Dr. GRPO's normaliser counts each sample once: every ring x tp rank of a group holds the
    bookkeeping of all its samples (data-parallel ranks hold their own)."""
    copies = layout.world  # every rank holds as many samples as this one
    monkeypatch.setattr(
        ppo, "sum_across", lambda vals, layout, group=None: [copies * v for v in vals]
    )
    book = [ppo.Sample(None, 2, length=4) for _ in range(5)]
    shards = [ppo_ring.Shard(None, torch.zeros(0), torch.zeros(0), book[:2])]
    shards.append(ppo_ring.Shard(None, torch.zeros(0), torch.zeros(0), book[2:]))
    samples = [ppo.Sample(torch.zeros(4, dtype=torch.long), 2) for _ in range(5)]
    batch = shards if layout.ring > 1 else samples
    assert ppo._batch_seqs(batch, layout) == 5 * layout.dp


def test_reward_std_of_rewards_far_from_zero(monkeypatch):
    """reward_std was one-pass (E[r^2] - E[r]^2): rewards of 1e9 + O(1) lost it to rounding
    (squares of 1e18 have an ulp of 128). Two passes over the ranks keep it exact."""
    import sys

    me = sys.modules[__name__]
    shifted = [{**row, "r": [1e9 + r for r in row["r"]]} for row in ROWS]
    monkeypatch.setattr(me, "ROWS", shifted)
    session, _ = _run(monkeypatch, Layout(2, 1, 1, 1, 2, CPU), 2)
    want = _expected()
    assert want["reward_std"] > 0.1
    for step in (1, 2):
        assert session.logged[step]["reward_std"] == pytest.approx(want["reward_std"], rel=1e-9)
