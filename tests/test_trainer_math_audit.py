"""Audit of the trainers' step bookkeeping that the contract tests left open: a PPO step whose
responses hold no action token, the split of a rollout batch into optimizer steps over the
data-parallel ranks, what ``generate`` hands the reward function, the reward model's dropped
equal pairs, and the SFT / RM totals of tensor-parallel ranks (faked in process)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("deepspeed")

from test_ppo_math_contract import StubEngine, _actor, _hand_actor, _rollout  # noqa: E402

from trainers import common, ppo, rm, sft, tiny  # noqa: E402
from trainers.distributed import Layout  # noqa: E402

CPU = torch.device("cpu")
ONE = Layout(1, 0, 1, 1, 1, CPU)


# ----------------------------------------------------------------------------- PPO updates
def _empty(n_prompt=3):
    """A sample whose response is empty (a custom generation engine may return one)."""
    s = ppo.Sample(torch.arange(5, 5 + n_prompt), n_prompt)
    z = torch.zeros(0, dtype=torch.float64)
    s.old_logp = s.ref_logp = s.advantages = s.values = s.returns = s.shift = s.ent = z
    return s


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum-norm"])
def test_a_step_of_empty_responses_updates_nothing_instead_of_dividing_by_zero(agg):
    """Every response of the optimizer step empty: no action token, so the losses and their
    gradients are 0 (this was a ZeroDivisionError in train_actor and train_critic)."""
    cfg = ppo.PPOConfig(loss_aggregation=agg)
    engine = StubEngine(_actor)
    out = ppo.train_actor(engine, [_empty(), _empty(2)], cfg, ONE, pad_id=0)
    assert engine.steps == 1 and out["policy_loss"] == out["actor_loss"] == 0.0
    assert out["grad_norm"] == 0.0 and engine.grad == 0.0
    critic = StubEngine(lambda theta, mb, layout: torch.cat([s.values for s in mb]) * theta)
    assert ppo.train_critic(critic, [_empty(), _empty(2)], cfg, ONE, pad_id=0) == 0.0
    assert critic.steps == 1


def test_kl_in_the_rewards_is_not_also_in_the_loss():
    """Without --kl-in-loss the KL penalty is in the rewards (hence the advantages) only: the
    actor's loss and gradient are the surrogate's, not the surrogate's plus --kl-coef x KL."""
    samples = _rollout([4, 2, 5], seed=3)
    cfg = ppo.PPOConfig(kl_coef=0.5)
    want = _hand_actor(samples, cfg, sum(s.n_act for s in samples))
    engine = StubEngine(_actor)
    got = ppo.train_actor(engine, samples, cfg, ONE, pad_id=0)
    assert got["actor_loss"] == pytest.approx(got["policy_loss"], rel=1e-12)
    assert got["actor_loss"] == pytest.approx(want["actor_loss"], rel=1e-6)
    assert engine.grad == pytest.approx(want["grad"], rel=1e-6)


@pytest.mark.parametrize(
    ("rollout", "n", "size", "dp"),
    [(4, 2, 4, 1), (4, 2, 4, 2), (8, 2, 8, 2), (6, 2, 4, 2), (4, 3, 6, 2), (4, 2, 2, 2)],
)
def test_mini_batches_are_the_optimizer_steps_of_the_one_rank_run(rollout, n, size, dp):
    """``--batch-size`` samples per optimizer step over all ranks: each rank's rollout is cut
    into ``rollout x n / batch-size`` slices, every sample in exactly one, and where
    ``prompt_positions`` splits each mini-batch over the ranks, step ``b`` of N ranks trains on
    the prompts of step ``b`` of one rank (one step for the whole rollout went unseen)."""
    cfg = ppo.PPOConfig(rollout_batch_size=rollout, n_samples_per_prompt=n, batch_size=size)

    def steps(layout):
        pos = ppo.prompt_positions(cfg, layout)
        samples = [ppo.Sample(torch.tensor([p, j]), 1) for p in pos for j in range(n)]
        out = ppo.mini_batches(samples, cfg, layout)
        assert [s for mb in out for s in mb] == samples  # in order, each once
        return [[int(s.ids[0]) for s in mb] for mb in out]

    one = steps(ONE)
    assert len(one) == rollout * n // size and all(len(mb) == size for mb in one)
    ranks = [steps(Layout(dp, r, dp, 1, 1, CPU)) for r in range(dp)]
    assert all(len(mine) == len(one) for mine in ranks)
    merged = [sorted(p for mine in ranks for p in mine[b]) for b in range(len(one))]
    assert all(len(mb) == size for mb in merged)
    assert sorted(p for mb in merged for p in mb) == sorted(p for mb in one for p in mb)
    if size % n == 0 and (size // n) % dp == 0:  # the even split: the same steps
        assert merged == [sorted(mb) for mb in one]


class _Tok:
    """Characters as ids; id 1 is EOS, shown as '</s>' unless special tokens are skipped."""

    eos_token_id, pad_token_id = 1, 0

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        eos = "" if skip_special_tokens else "</s>"
        return "".join(eos if i == 1 else chr(i) for i in ids)


class _Gen:
    def __init__(self):
        self.n_samples = []

    def generate(self, prompts, *, n_samples, max_new_tokens, greedy=False, **kw):
        self.n_samples.append(n_samples)
        return [[ord("x") + k, 1] for _ in prompts for k in range(n_samples)]


@pytest.mark.parametrize("greedy", [False, True])
def test_generate_gives_the_reward_function_the_text_without_eos(greedy):
    """Samples are prompt + response ids (actions: the response, its EOS included); the reward
    function reads the response text without special tokens, so an answer 'x' that ended
    properly is not scored as 'x</s>'; greedy evaluation asks for one response per prompt."""
    cfg = ppo.PPOConfig(n_samples_per_prompt=3, input_template=None)
    gen, rows = _Gen(), [{"prompt": "ab"}, {"prompt": "c"}]
    samples, texts = ppo.generate(gen, _Tok(), rows, cfg, ONE, 1, [0, 1], greedy=greedy)
    k = 1 if greedy else 3
    assert gen.n_samples == [k, k] and len(samples) == len(texts) == 2 * k
    want = [(row, chr(ord("x") + j)) for row in rows for j in range(k)]
    assert texts == want
    s = samples[-1]
    assert s.ids.tolist() == [ord("c"), ord("x") + k - 1, 1] and s.n_prompt == 1 and s.n_act == 2


def test_each_prompt_of_a_run_gets_its_own_sampling_seed():
    """``generate`` seeds each prompt with ``rollout_seed(--seed, step, position)``. The linear
    mix it replaced, ``seed * 1_000_003 + step * 10_007 + pos``, gave step 0's prompt 10 007 the
    seed of step 1's prompt 0 (and run seed 1's first prompt that of seed 0's step 99, prompt
    9 310): here 3 seeds x 3 steps x 10 010 positions are all distinct, 63-bit, and stable."""
    seeds = {ppo.rollout_seed(s, t, p) for s in range(3) for t in range(3) for p in range(10_010)}
    assert len(seeds) == 3 * 3 * 10_010
    assert all(0 <= x < 2**63 for x in seeds)
    assert ppo.rollout_seed(0, 1, 0) != ppo.rollout_seed(0, 0, 10_007)
    assert ppo.rollout_seed(1, 0, 0) != ppo.rollout_seed(0, 99, 9_310)
    assert ppo.rollout_seed(7, 3, 2) == ppo.rollout_seed(7, 3, 2)

    class Seeds(_Gen):
        def generate(self, prompts, **kw):
            self.seeds = [*getattr(self, "seeds", []), kw["seed"]]
            return super().generate(prompts, **kw)

    gen, rows = Seeds(), [{"prompt": "ab"}, {"prompt": "c"}]
    cfg = ppo.PPOConfig(n_samples_per_prompt=2, input_template=None, seed=5)
    ppo.generate(gen, _Tok(), rows, cfg, ONE, 4, [6, 9])
    assert gen.seeds == [ppo.rollout_seed(5, 4, 6), ppo.rollout_seed(5, 4, 9)]


# ----------------------------------------------------------------------------- reward model
@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.ensure_tiny())


def test_rm_tokenize_leaves_out_pairs_of_equal_tokens_and_counts_them(tok):
    """A pair whose chosen and rejected are the same tokens (equal texts, or cut to the same
    --max-len prefix) teaches nothing: it is dropped and counted, and the empty-data error then
    names them rather than --max-len alone."""
    cfg = rm.RMConfig(max_len=8)
    rows = [
        {"prompt": "p", "chosen": "same", "rejected": "same"},
        {"prompt": "p", "chosen": "a b c d e f g h i", "rejected": "a b c d e f g h j"},
        {"prompt": "p", "chosen": "good", "rejected": "bad"},
    ]
    same: list[int] = []
    pairs, dropped = rm.tokenize(rows, tok, cfg, same)
    assert dropped == 0 and same == [2] and len(pairs) == 1
    assert not torch.equal(pairs[0].chosen, pairs[0].rejected)
    assert "2 training pairs" in rm.equal_pairs_reason(same, 8)
    assert rm.equal_pairs_reason([0], 8) is None


def test_tokenize_reads_the_columns_the_key_flags_name(tok):
    """--output-key (SFT) and --prompt-key (RM, before --input-key) pick the columns: the
    trained response is the response column's text, not the prompt's."""
    from trainers import data

    row = {"q": "abc", "prompt": "zzz", "a": "cba", "chosen": "cb", "rejected": "xy"}
    (s,), _ = sft.tokenize([row], tok, sft.SFTConfig(input_key="q", output_key="a"))
    assert s.ids.tolist() == data.tokenize_sft(tok, "abc", "cba", 128)["input_ids"]
    (p,), _ = rm.tokenize([row], tok, rm.RMConfig(prompt_key="q"))
    enc = data.tokenize_pair(tok, "abc", "cb", "xy", 128)
    assert (p.chosen.tolist(), p.rejected.tolist()) == (enc["chosen_ids"], enc["rejected_ids"])


@pytest.mark.parametrize("no_packing", [False, True])
def test_sft_slots_are_the_processed_token_slots(no_packing):
    """``slots`` (padding_fraction's denominator): the packed tokens, or rows x width padded."""
    nll = lambda theta, labels, **kw: theta * (labels != -100).sum()  # noqa: E731
    samples = [
        sft.Sample(ids, common.shifted_targets(ids, torch.ones_like(ids)))
        for ids in (torch.tensor([5, 6, 2]), torch.tensor([7, 8, 9, 10, 11, 2]))
    ]
    cfg = sft.SFTConfig(no_packing=no_packing, micro_batch_tokens=64)
    got = sft.run_batch(StubEngine(nll), samples, cfg, ONE, 0, train=False)
    assert got["tokens"] == 9 and got["slots"] == (12 if no_packing else 9)


# ----------------------------------------------------------------------------- TP ranks
TP2 = Layout(2, 0, 1, 1, 2, CPU)  # two tensor-parallel ranks, one data-parallel rank


def _tp_copies(monkeypatch, module):
    """``sum_across`` of two TP ranks holding the same numbers."""
    monkeypatch.setattr(
        module, "sum_across", lambda vals, layout, group=None: [2 * v for v in vals]
    )


def test_sft_and_rm_totals_count_tensor_parallel_copies_once(monkeypatch):
    """TP ranks compute the same micro-batches: the logged SFT nll / slots and the RM loss /
    accuracy sums are those of one rank, not tp times them."""

    def nll(theta, input_ids, position_ids, labels, **kw):
        return theta * labels[labels != -100].double().sum()

    ids = torch.tensor([5, 6, 7, 2])
    s = sft.Sample(ids, common.shifted_targets(ids, torch.tensor([0, 0, 1, 1])))
    cfg = sft.SFTConfig()
    want = sft.run_batch(StubEngine(nll), [s], cfg, ONE, 0, train=True)
    _tp_copies(monkeypatch, sft)
    got = sft.run_batch(StubEngine(nll), [s], cfg, TP2, 0, train=True)
    assert got == want and got["nll"] == 9.0

    def score(theta, input_ids, position_ids, last_index, **kw):
        return theta * input_ids.reshape(-1)[last_index].double() / 10

    pairs = [
        rm.Pair(torch.tensor([3, 9]), torch.tensor([3, 4])),
        rm.Pair(torch.tensor([3, 1]), torch.tensor([3, 8])),
    ]
    rcfg = rm.RMConfig()
    want = rm.run_batch(StubEngine(score), pairs, rcfg, ONE, 0, train=False)
    _tp_copies(monkeypatch, rm)
    got = rm.run_batch(StubEngine(score), pairs, rcfg, TP2, 0, train=False)
    assert got == pytest.approx(want) and got["correct"] == 1.0
