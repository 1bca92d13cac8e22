"""Audit of the SFT / reward-model loops that the fast suite left open (found by mutation
testing ``trainers/sft.py`` and ``trainers/rm.py``): the metrics ``train`` logs (loss, accuracy,
tokens, tokens_per_s, padding_fraction, grad_norm, lr, eval metrics), the reward statistics
saved into the reward model's config, the gradient scale over data-parallel ranks, the
accumulation boundary, the padding micro-batch of an idle rank and the train mode restored
after an evaluation. ``train`` runs in process on a faked ``Session`` and stub engines."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("deepspeed")

from trainers import common, modeling, rm, session, sft  # noqa: E402
from trainers.distributed import Layout  # noqa: E402

CPU = torch.device("cpu")
ONE = Layout(1, 0, 1, 1, 1, CPU)
EOS, PAD = 2, 0


class Engine:
    """``engine(...)`` = ``fn(theta, ...)``; records accumulation boundaries, the train / eval
    mode and the learning rate (which ``optimizer_step`` below moves on)."""

    def __init__(self, fn):
        self.theta = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))
        self.fn, self.boundaries, self.training, self.lr = fn, [], True, 0.5

    def __call__(self, *args, **kw):
        return self.fn(self.theta, *args, **kw)

    def set_gradient_accumulation_boundary(self, last):
        self.boundaries.append(last)

    def backward(self, loss, scale_wrt_gas=False):
        loss.backward()

    def eval(self):
        self.training = False

    def train(self):
        self.training = True

    def get_lr(self):
        return [self.lr]


def _nll(theta, input_ids, position_ids, labels, attention_mask=None, **kw):
    """An 'nll' = theta x the sum of the target token ids: a wrong label shows."""
    return theta * labels[labels != -100].double().sum()


def _score(theta, input_ids, position_ids, last_index, attention_mask=None, **kw):
    """Reward = theta x (the token id read) / 10, plus a little of its position in the batch
    (as dropout or positions would make two copies of one sequence score differently)."""
    return theta * (input_ids.reshape(-1)[last_index].double() / 10 + last_index / 1000)


def _sample(ids, n_prompt):
    ids = torch.tensor(ids)
    mask = torch.tensor([0] * n_prompt + [1] * (len(ids) - n_prompt))
    return sft.Sample(ids, common.shifted_targets(ids, mask))


class FakeSession:
    """What ``sft.train`` / ``rm.train`` use of ``Session``: fixed data, ``steps`` steps, an
    evaluation on the steps in ``eval_steps``, and a record of logged metrics and the finish."""

    def __init__(self, cfg, train_set, eval_set, steps, eval_steps, rows=None):
        self.cfg, self.layout, self.total = cfg, ONE, steps
        self.train_set, self.eval_set, self.rows, self.eval_steps = (
            train_set,
            eval_set,
            rows,
            eval_steps,
        )
        self.tokenizer = SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
        self.logged, self.printed, self.finished, self.engine = [], [], None, None

    def load_data(self, keys, tokenize, lengths, why_empty=None):
        if self.rows is not None:  # through the trainer's own tokenize
            return tokenize(self.rows[0])[0], tokenize(self.rows[1])[0]
        return self.train_set, self.eval_set

    def load_causal_lm(self):
        return "lm"

    load_score_model = load_causal_lm

    def build(self, module):
        return self.engine, 0

    def progress(self, start):
        return range(start + 1, self.total + 1)

    def is_eval_step(self, step):
        return step in self.eval_steps

    def end_step(self, step, metrics, engine):
        self.logged.append((step, dict(metrics)))

    def finish(self, engine, model, prefix, plot, extra_config=None):
        self.finished = extra_config

    def print(self, message):
        self.printed.append(message)


def _fake_run(monkeypatch, module, fake, fn, grad_norm=0.125):
    """``module.train`` on ``fake``: an engine of ``fn``, ``optimizer_step`` returning
    ``grad_norm`` (and halving the lr), a clock that advances 2 s per step."""
    fake.engine = Engine(fn)
    monkeypatch.setattr(session.Session, "start", staticmethod(lambda cfg, kind: fake))
    monkeypatch.setattr(modeling, "CausalLMLoss", lambda lm: lm)
    monkeypatch.setattr(modeling, "RewardModel", lambda m: m)

    def step(engine, layout):
        engine.lr /= 2
        return grad_norm

    monkeypatch.setattr(module, "optimizer_step", step)
    ticks = itertools.count()
    monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: 2.0 * next(ticks)))
    return fake


# ----------------------------------------------------------------------------- SFT loop
SFT_TRAIN = [
    _sample([5, 6, 7, 8, EOS], 2),
    _sample([9, 3, 4, EOS], 1),
    _sample([11, 12, 13], 2),  # cut at --max-len: no EOS
    _sample([14, 15, 16, 17, 18, 19, EOS], 3),
]
SFT_EVAL = [_sample([21, 22, EOS], 1), _sample([23, 24, 25, 26, EOS], 3), _sample([7, EOS], 1)]


def _sft_sums(samples):
    """(sum of target ids, target tokens, tokens, padded slots) of one padded micro-batch."""
    nll = sum(float(s.targets[s.targets != -100].sum()) for s in samples)
    n_t = sum(s.n_targets for s in samples)
    tokens = sum(len(s.ids) for s in samples)
    return nll, n_t, tokens, len(samples) * max(len(s.ids) for s in samples)


def test_sft_train_logs_the_step_metrics_and_eval_loss(monkeypatch):
    """Each step logs loss = nll / target tokens, the batch's tokens and target tokens, tokens
    per second, the padding fraction 1 - tokens / slots, the step's lr (before the optimizer
    step moves it) and grad norm; eval_loss (nll per target token over all evaluation samples,
    the last partial batch included) only on evaluation steps; samples without EOS are counted."""
    cfg = sft.SFTConfig(batch_size=2, seed=5, no_packing=True, micro_batch_tokens=10_000)
    fake = FakeSession(cfg, SFT_TRAIN, SFT_EVAL, steps=3, eval_steps={2})
    _fake_run(monkeypatch, sft, fake, _nll)
    last = sft.train(cfg)
    assert [step for step, _ in fake.logged] == [1, 2, 3]
    for step, m in fake.logged:
        idx = common.batch_indices(step, len(SFT_TRAIN), 2, 5)
        nll, n_t, tokens, slots = _sft_sums([SFT_TRAIN[i] for i in idx])
        assert m["loss"] == pytest.approx(nll / n_t)
        assert (m["tokens"], m["target_tokens"]) == (tokens, n_t)
        assert m["tokens_per_s"] == pytest.approx(tokens / 2.0)
        assert m["step_s"] == pytest.approx(2.0)
        assert m["padding_fraction"] == pytest.approx(1 - tokens / slots)
        assert m["lr"] == 0.5 / 2 ** (step - 1) and m["grad_norm"] == 0.125
        assert ("eval_loss" in m) == (step == 2)
    nll, n_t = _sft_sums(SFT_EVAL)[:2]
    assert fake.logged[1][1]["eval_loss"] == pytest.approx(nll / n_t)
    assert last == fake.logged[-1][1] and fake.engine.training
    assert any("1 training samples are cut" in p for p in fake.printed), fake.printed


def _two_ranks(monkeypatch, module):
    """``sum_across`` of one process standing for two data-parallel ranks."""
    monkeypatch.setattr(module, "sum_across", lambda vals, layout, group=None: vals)


@pytest.mark.parametrize("no_packing", [False, True])
def test_sft_gradient_over_data_parallel_ranks_is_the_global_mean(monkeypatch, no_packing):
    """DeepSpeed averages the ranks' gradients: each rank scales its nll by dp / (the global
    target count) so that the average is d(sum nll) / targets of the whole batch."""
    _two_ranks(monkeypatch, sft)
    samples = SFT_TRAIN + SFT_EVAL
    cfg = sft.SFTConfig(no_packing=no_packing, micro_batch_tokens=8)
    want = Engine(_nll)
    sft.run_batch(want, samples, cfg, ONE, PAD, train=True)
    grads = []
    for rank in range(2):
        engine = Engine(_nll)
        sft.run_batch(engine, samples, cfg, Layout(2, rank, 2, 1, 1, CPU), PAD, train=True)
        grads.append(engine.theta.grad.item())
    assert sum(grads) / 2 == pytest.approx(want.theta.grad.item())


@pytest.mark.parametrize("no_packing", [False, True])
def test_sft_slots_and_nll_add_up_over_several_micro_batches(no_packing):
    """padding_fraction's slots and the logged nll are summed over all of a batch's
    micro-batches, not the last one's."""
    samples = SFT_TRAIN + SFT_EVAL
    cfg = sft.SFTConfig(no_packing=no_packing, micro_batch_tokens=8)
    plan = common.my_micro_batches([len(s.ids) for s in samples], cfg, ONE)
    assert len(plan) > 2
    got = sft.run_batch(Engine(_nll), samples, cfg, ONE, PAD, train=False)
    parts = [_sft_sums([samples[i] for i in idx]) for idx in plan]
    slots = sum(p[3] for p in parts) if no_packing else sum(p[2] for p in parts)
    assert got["slots"] == slots and got["tokens"] == sum(p[2] for p in parts)
    assert got["nll"] == pytest.approx(_sft_sums(samples)[0])


@pytest.mark.parametrize("module", ["sft", "rm"])
def test_only_the_last_micro_batch_is_the_accumulation_boundary(module):
    """DeepSpeed reduces gradients and may step at the boundary: exactly the last of several
    micro-batches is one."""
    if module == "sft":
        engine = Engine(_nll)
        cfg = sft.SFTConfig(micro_batch_tokens=8)
        sft.run_batch(engine, SFT_TRAIN + SFT_EVAL, cfg, ONE, PAD, train=True)
    else:
        engine = Engine(_score)
        rm.run_batch(engine, RM_PAIRS, rm.RMConfig(micro_batch_tokens=8), ONE, PAD, train=True)
    assert len(engine.boundaries) > 2
    assert engine.boundaries == [False] * (len(engine.boundaries) - 1) + [True]


@pytest.mark.parametrize("module", ["sft", "rm"])
def test_evaluate_puts_the_engine_back_in_train_mode(module):
    """An evaluation in the middle of training must not leave dropout off for the next steps."""
    engine = Engine(_nll if module == "sft" else _score)
    if module == "sft":
        sft.evaluate(engine, SFT_EVAL, sft.SFTConfig(batch_size=2), ONE, PAD)
    else:
        rm.evaluate(engine, RM_PAIRS, rm.RMConfig(batch_size=2), ONE, PAD)
    assert engine.training


# ----------------------------------------------------------------------------- RM loop
def _pair(c, r, margin=0.0):
    return rm.Pair(torch.tensor(c), torch.tensor(r), margin)


RM_PAIRS = [
    _pair([3, 9, 12], [3, 9, 5, 8], margin=0.5),
    _pair([3, 4], [3, 7]),
    _pair([3, 6, 8], [3, 2, 1]),
    _pair([3, 30, 11], [3, 31]),
    _pair([3, 17], [3, 16, 15, 14, 13], margin=-0.25),
]
RM_EVAL = [_pair([3, 40], [3, 20]), _pair([3, 22, 5], [3, 60]), _pair([3, 33], [3, 44, 1])]


def _rm_expect(pairs):
    """(loss sum, correct, rewards) of ``pairs`` packed in one micro-batch."""
    seqs = [s for p in pairs for s in (p.chosen, p.rejected)]
    starts = [0] + list(itertools.accumulate(len(s) for s in seqs))[:-1]
    r = torch.tensor(
        [float(s[-1]) / 10 + (b + len(s) - 1) / 1000 for s, b in zip(seqs, starts)],
        dtype=torch.float64,
    ).view(-1, 2)
    m = torch.tensor([p.margin for p in pairs], dtype=torch.float64)
    loss = -F.logsigmoid(r[:, 0] - r[:, 1] - m)
    return loss.sum().item(), int((r[:, 0] > r[:, 1]).sum()), r.flatten()


def test_rm_train_logs_the_step_metrics(monkeypatch):
    """Each step logs the pair-mean loss and accuracy, the chosen + rejected tokens, tokens per
    second, the step's lr and grad norm; the eval metrics only on evaluation steps."""
    cfg = rm.RMConfig(batch_size=2, seed=3, micro_batch_tokens=10_000)
    fake = FakeSession(cfg, RM_PAIRS, RM_EVAL, steps=2, eval_steps={1})
    _fake_run(monkeypatch, rm, fake, _score, grad_norm=0.75)
    last = rm.train(cfg)
    assert [step for step, _ in fake.logged] == [1, 2]
    for step, m in fake.logged:
        batch = [RM_PAIRS[i] for i in common.batch_indices(step, len(RM_PAIRS), 2, 3)]
        loss, correct, _ = _rm_expect(batch)
        tokens = sum(len(p.chosen) + len(p.rejected) for p in batch)
        assert m["loss"] == pytest.approx(loss / 2) and m["accuracy"] == correct / 2
        assert m["tokens"] == tokens and m["tokens_per_s"] == pytest.approx(tokens / 2.0)
        assert m["lr"] == 0.5 / 2 ** (step - 1) and m["grad_norm"] == 0.75
        assert ("eval_loss" in m) == (step == 1) and ("eval_accuracy" in m) == (step == 1)
    assert last == fake.logged[-1][1] and fake.engine.training


@pytest.mark.parametrize("eval_steps", [{2}, set()])
def test_rm_saves_the_evaluation_reward_statistics(monkeypatch, eval_steps):
    """reward_mean / reward_std in the saved config are those of the evaluation rewards (all of
    them, the last partial batch included), whether or not an evaluation step ran."""
    cfg = rm.RMConfig(batch_size=2, micro_batch_tokens=10_000)
    fake = FakeSession(cfg, RM_PAIRS, RM_EVAL, steps=2, eval_steps=eval_steps)
    _fake_run(monkeypatch, rm, fake, _score)
    rm.train(cfg)
    rewards = torch.cat([_rm_expect(RM_EVAL[i : i + 2])[2] for i in (0, 2)])
    extra = fake.finished
    assert extra["is_reward_model"] and extra["reward_stats_from"] == "evaluation"
    assert extra["reward_mean"] == pytest.approx(rewards.mean().item())
    assert extra["reward_std"] == pytest.approx(rewards.std(unbiased=False).item())


def test_rm_without_eval_set_saves_the_first_training_pairs_statistics(monkeypatch):
    """No evaluation set: the statistics come from the first 4 x batch-size training pairs and
    the config says so."""
    cfg = rm.RMConfig(batch_size=1, micro_batch_tokens=10_000)
    fake = FakeSession(cfg, RM_PAIRS, [], steps=1, eval_steps={1})
    _fake_run(monkeypatch, rm, fake, _score)
    rm.train(cfg)
    rewards = torch.cat([_rm_expect([p])[2] for p in RM_PAIRS[:4]])
    assert fake.finished["reward_stats_from"] == "training (first 4 pairs)"
    assert fake.finished["reward_mean"] == pytest.approx(rewards.mean().item())
    assert fake.finished["reward_std"] == pytest.approx(rewards.std(unbiased=False).item())
    assert "eval_loss" not in fake.logged[0][1]


@pytest.mark.parametrize("no_packing", [False, True])
def test_rm_gradient_over_data_parallel_ranks_is_the_global_pair_mean(monkeypatch, no_packing):
    """Each rank scales its loss sum by dp / (the global pair count): DeepSpeed's average of
    the ranks' gradients is that of the mean loss over the whole batch."""
    _two_ranks(monkeypatch, rm)
    cfg = rm.RMConfig(no_packing=no_packing, micro_batch_tokens=8)
    want = Engine(_score)
    rm.run_batch(want, RM_PAIRS, cfg, ONE, PAD, train=True)
    grads = []
    for rank in range(2):
        engine = Engine(_score)
        rm.run_batch(engine, RM_PAIRS, cfg, Layout(2, rank, 2, 1, 1, CPU), PAD, train=True)
        grads.append(engine.theta.grad.item())
    assert sum(grads) / 2 == pytest.approx(want.theta.grad.item())


def test_rm_idle_rank_padding_micro_batch_adds_no_gradient(monkeypatch):
    """A rank with no pair (fewer pairs than ranks) runs a padding pair for the ZeRO hooks; its
    two copies may score differently (dropout, positions) but must add no gradient or loss."""
    _two_ranks(monkeypatch, rm)
    engine = Engine(_score)
    got = rm.run_batch(engine, RM_PAIRS[:1], rm.RMConfig(), Layout(2, 1, 2, 1, 1, CPU), PAD, True)
    assert engine.theta.grad.item() == 0.0 and engine.boundaries == [True]
    assert (got["loss"], got["correct"], got["r_sum"]) == (0.0, 0.0, 0.0)


def test_rm_reports_pairs_dropped_as_equal_in_either_dataset(monkeypatch):
    """Pairs whose chosen and rejected tokenize the same are counted in the training and the
    evaluation rows alike (the message used to be the only place equal eval pairs show)."""
    from transformers import AutoTokenizer

    from trainers.tiny import ensure_tiny

    tok = AutoTokenizer.from_pretrained(ensure_tiny())
    rows = [{"prompt": "p", "chosen": c, "rejected": r} for c, r in (("ab", "ba"), ("a", "b"))]
    same = [{"prompt": "p", "chosen": "abc", "rejected": "abc"}] * 2
    cfg = rm.RMConfig(batch_size=1, max_len=64, micro_batch_tokens=10_000)
    fake = FakeSession(cfg, None, None, steps=1, eval_steps=set(), rows=(rows, rows + same))
    _fake_run(monkeypatch, rm, fake, _score)
    fake.tokenizer = tok
    rm.train(cfg)
    assert any(p.startswith("dropped 2 pairs whose chosen") for p in fake.printed), fake.printed
    assert math.isfinite(fake.finished["reward_mean"])


def _ids_score(theta, input_ids, position_ids, last_index, attention_mask=None, **kw):
    return theta * input_ids.reshape(-1)[last_index].double() / 10


@pytest.mark.parametrize("pairs", [RM_PAIRS, RM_EVAL[::-1]])
def test_rm_ring_shards_put_each_reward_in_its_own_sequence(monkeypatch, pairs):
    """Over a ring, each rank reads the rewards of the last tokens it holds and files them
    under their sequence: the ranks' partial vectors add up to the one-rank rewards."""
    import contextlib

    monkeypatch.setattr(rm, "_RingSum", SimpleNamespace(apply=lambda x, group: x))
    cfg = rm.RMConfig(micro_batch_tokens=10_000)
    want = rm.rewards(Engine(_ids_score), pairs, cfg, ONE, PAD, None)
    parts = []
    for rank in range(2):
        with contextlib.ExitStack() as scope:
            lay = Layout(2, rank, 1, 2, 1, CPU)
            parts.append(rm.rewards(Engine(_ids_score), pairs, cfg, lay, PAD, scope).detach())
    assert all((p != 0).any() for p in parts)  # both ranks hold some of the last tokens
    assert torch.allclose(parts[0] + parts[1], want.detach())


def test_rm_totals_count_ring_copies_once(monkeypatch):
    """Ring ranks all hold the ring-summed rewards: the logged loss, accuracy and reward sums
    are those of one rank, not ring times them."""
    cfg = rm.RMConfig(micro_batch_tokens=10_000)
    want = rm.run_batch(Engine(_ids_score), RM_PAIRS, cfg, ONE, PAD, train=False)
    full = rm.rewards(Engine(_ids_score), RM_PAIRS, cfg, ONE, PAD, None).detach()
    monkeypatch.setattr(rm, "rewards", lambda *a, **k: full.clone())
    monkeypatch.setattr(rm, "sum_across", lambda vals, layout, group=None: [2 * v for v in vals])
    got = rm.run_batch(Engine(_ids_score), RM_PAIRS, cfg, Layout(2, 0, 1, 2, 1, CPU), PAD, False)
    assert got == pytest.approx(want)
