"""Contract checks of the trainers' pure-Python helpers that the other tests left open.

Each test checks documented behaviour (docstrings, --help) without spawning processes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import datasets
import pytest
import torch

from trainers import data, rewards
from trainers.data import load_mixture, split_train_eval
from trainers.rollout import HFGenerationEngine, split_responses


class _StubTokenizer:
    eos_token_id = 1
    pad_token_id = 2


class _StubModel:
    """Never asked to generate: argument checks come first."""

    def generate(self, **_):
        raise AssertionError("generate must not run on bad arguments")


# ----------------------------------------------------------------------------- rewards
def test_score_refuses_a_column_longer_than_the_responses():
    """``columns`` hold one entry per response: extra entries cannot be matched to one."""
    with pytest.raises(ValueError, match="column 'target': expected one entry per response"):
        rewards.score(lambda **_: [1.0], "f", ["p"], ["a"], {"target": ["x", "y"]})


def test_score_refuses_prompts_that_do_not_pair_with_the_responses():
    for prompts in (["p"], ["p", "q", "r"]):
        with pytest.raises(
            ValueError, match=f"one prompt per response \\(2\\), got {len(prompts)}"
        ):
            rewards.score(lambda **_: [1.0, 1.0], "f", prompts, ["a", "b"], {})


def test_toy_rewards_refuse_more_targets_than_responses():
    for fn in (rewards.reverse_reward, rewards.letters_reward):
        with pytest.raises(ValueError, match="target: expected one entry per response"):
            fn(None, ["a"], ["a", "b"])


# ----------------------------------------------------------------------------- data
@pytest.fixture
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_max_samples_keeps_the_first_rows(tmp_path, _datasets_cache):
    """``max_samples`` keeps the first N after mixing (concatenation: the first file's first)."""
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(5)])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(5)])
    assert load_mixture(a, None, "train", 0, 3)["prompt"] == ["a0", "a1", "a2"]
    assert load_mixture(f"{a},{b}", None, "train", 0, 7)["prompt"] == [
        *(f"a{i}" for i in range(5)),
        "b0",
        "b1",
    ]
    assert len(load_mixture(a, None, "train", 0, 50)) == 5  # fewer rows than asked: all


def test_holdout_size_is_the_nearest_count_to_the_ratio():
    """``--eval-ratio``: hold out this fraction of the rows (10 rows at 0.29: 3, not 2)."""
    ds = datasets.Dataset.from_list([{"i": i} for i in range(10)])
    train, held = split_train_eval(ds, None, 0.29, seed=0)
    assert (len(train), len(held)) == (7, 3)
    train, held = split_train_eval(ds, None, 0.51, seed=0)
    assert (len(train), len(held)) == (5, 5)


def test_mixing_keeps_the_shared_columns_in_the_first_datasets_order(tmp_path, _datasets_cache):
    a = _jsonl(tmp_path / "a.jsonl", [{"x": 1, "prompt": "a", "target": "t"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"target": "u", "prompt": "b", "y": 2}])
    for probs in (None, "1,1"):
        mixed = load_mixture(f"{a},{b}", probs, "train", 0, None)
        assert mixed.column_names == ["prompt", "target"]
    assert load_mixture(f"{b},{a}", None, "train", 0, None).column_names == ["target", "prompt"]


def test_an_empty_list_is_not_a_chat_prompt():
    """With ``--apply-chat-template`` the prompt column may hold chat messages; an empty list
    holds none (nothing to answer) and is refused naming the flag and row."""
    assert not data.is_chat([])
    assert data.is_chat([{"role": "user", "content": "hi"}])
    ds = datasets.Dataset.from_list([{"p": [{"role": "user", "content": "hi"}]}, {"p": []}])
    with pytest.raises(ValueError, match=r"--input-key 'p': row 1 \(0-based\)"):
        data.check_values(ds, {"--input-key": "p"}, "data", chat_flag="--input-key")


def test_check_values_refuses_booleans_as_text():
    """Text columns take text or integers (read as their digits); True is neither."""
    data.check_values(datasets.Dataset.from_list([{"r": 7}]), {"--output-key": "r"}, "data")
    flags = datasets.Dataset.from_list([{"r": True}, {"r": False}])
    with pytest.raises(ValueError, match=r"--output-key 'r': row 0 \(0-based\).*bool True"):
        data.check_values(flags, {"--output-key": "r"}, "data")


def test_a_prompt_is_text_or_an_integer_never_a_bool():
    """``render_prompt``: an integer is read as its digits; True is not an integer prompt."""

    class Tok:
        def encode(self, text):
            return [ord(c) for c in text]

    assert data.render_prompt(Tok(), 42, "Q{}", False) == [ord(c) for c in "Q42"]
    for bad in (True, None, 1.5):
        with pytest.raises(ValueError, match="prompt: expected text, got"):
            data.render_prompt(Tok(), bad, None, False)


# ----------------------------------------------------------------------------- rollout
def test_split_responses_drops_every_trailing_pad():
    """A row that ends without a stop id is padded up to the batch's length: all pads go."""
    E, P = 1, 2
    seqs = torch.tensor([[P, 3, 4, 5, P, P, P], [3, 3, 4, 6, 7, E, P]])
    assert split_responses(seqs, 2, E, P) == [[4, 5], [4, 6, 7, E]]


@pytest.mark.parametrize("name", ["n_samples", "max_new_tokens"])
@pytest.mark.parametrize("value", [True, 1.0, 0, -1])
def test_generate_counts_are_ints_not_bools(name, value):
    """``n_samples`` / ``max_new_tokens``: "expected an int >= 1" (True is not a count)."""
    engine = HFGenerationEngine(_StubModel(), _StubTokenizer())
    args = {"n_samples": 1, "max_new_tokens": 1, name: value}
    with pytest.raises(ValueError, match=f"{name}: expected an int >= 1"):
        engine.generate([[5, 6]], **args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(tokenizer, model) of the bundled tiny Llama, built in a private folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainers.tiny import ensure_tiny

    path = ensure_tiny(tmp_path_factory.mktemp("tiny") / "tiny")
    tok = AutoTokenizer.from_pretrained(path)
    return tok, AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def test_greedy_decoding_is_the_plain_argmax(tiny):
    """The engine's distribution is the model's softmax shaped only by temperature / top_p (and
    the pad token is never generated): greedy decoding is the argmax of the raw logits, with no
    repetition penalty, top-k or other processor of its own."""
    tok, model = tiny
    stops = {tok.eos_token_id}
    prompts = [tok("aaaa bbbb aaaa").input_ids]
    got = HFGenerationEngine(model, tok).generate(prompts, n_samples=1, max_new_tokens=8,
                                                  greedy=True)  # fmt: skip
    for prompt, response in zip(prompts, got):
        ids, want = list(prompt), []
        with torch.no_grad():
            for _ in range(8):
                logits = model(torch.tensor([ids])).logits[0, -1].clone()
                if tok.pad_token_id not in stops:
                    logits[tok.pad_token_id] = -float("inf")
                nxt = int(logits.argmax())
                ids.append(nxt)
                want.append(nxt)
                if nxt in stops:
                    break
        assert response == want


@pytest.mark.parametrize("batch_size", [True, 0, -1, 2.0])
def test_engine_batch_size_is_a_positive_int(batch_size):
    with pytest.raises(ValueError, match="batch_size: expected an int >= 1"):
        HFGenerationEngine(_StubModel(), _StubTokenizer(), batch_size=batch_size)


# ----------------------------------------------------------------------------- checkpoint
class _Engine:
    def save_checkpoint(self, path, tag, save_latest):
        (Path(path) / tag).mkdir()


def test_read_state_needs_an_integer_step(tmp_path):
    from trainers.checkpoint import read_state

    state = tmp_path / "trainer_state.json"
    state.write_text('{"step": 3, "epoch": 1}')
    assert read_state(tmp_path) == {"step": 3, "epoch": 1}
    for bad in ('{"step": "3"}', '{"epoch": 1}', "[3]", '{"step": 3.0}'):
        state.write_text(bad)
        with pytest.raises(ValueError, match="has no integer 'step'"):
            read_state(tmp_path)
    state.write_text('{"step": ')
    with pytest.raises(ValueError, match="trainer_state.json is unreadable"):
        read_state(tmp_path)


def test_saved_state_is_the_step_and_what_the_trainer_passed(tmp_path):
    from trainers.checkpoint import latest_checkpoint, read_state, save_checkpoint

    path = save_checkpoint(_Engine(), tmp_path, 7, {"epoch": 2, "seen": 14})
    assert path == tmp_path / "checkpoints" / "step-000007" == latest_checkpoint(tmp_path)
    assert read_state(path) == {"step": 7, "epoch": 2, "seen": 14}
    assert (path / "engine").is_dir() and (path / "rng_rank0.pt").is_file()


def test_latest_checkpoint_is_the_highest_committed_step(tmp_path):
    from trainers.checkpoint import checkpoint_root, latest_checkpoint

    assert latest_checkpoint(tmp_path) is None
    root = checkpoint_root(tmp_path)
    for name in ("step-000009", "step-000010", "step-1000000", ".tmp-step-2000000", "step-3000000"):
        (root / name).mkdir(parents=True)
    for name in ("step-000009", "step-000010", "step-1000000", ".tmp-step-2000000"):
        (root / name / "trainer_state.json").write_text('{"step": 1}')
    # by number (not by name); an uncommitted save and a folder without a state are not taken
    assert latest_checkpoint(tmp_path) == root / "step-1000000"


def test_prune_keeps_the_newest_and_returns_what_it_deleted(tmp_path):
    from trainers.checkpoint import checkpoint_root, prune_checkpoints

    root = checkpoint_root(tmp_path)
    for step in (1, 2, 3, 4, 5):
        (root / f"step-{step:06d}").mkdir(parents=True)
        (root / f"step-{step:06d}" / "trainer_state.json").write_text(json.dumps({"step": step}))
    gone = prune_checkpoints(root, 3, root / "step-000005")
    assert sorted(p.name for p in gone) == ["step-000001", "step-000002"]
    assert sorted(p.name for p in root.iterdir()) == ["step-000003", "step-000004", "step-000005"]
    assert prune_checkpoints(root, 3, root / "step-000005") == []


def test_prune_neither_counts_nor_deletes_a_set_aside_copy_beside_its_step(tmp_path):
    """``.old-step-N`` counts only as a crashed re-save's *only* copy; beside a committed
    ``step-N`` it takes no slot of ``keep`` and is not pruned (the next save removes it)."""
    from trainers.checkpoint import checkpoint_root, prune_checkpoints

    root = checkpoint_root(tmp_path)
    for name in ("step-000001", ".old-step-000001", "step-000002", "step-000003"):
        (root / name).mkdir(parents=True)
        (root / name / "trainer_state.json").write_text('{"step": 1}')
    assert prune_checkpoints(root, 3, root / "step-000003") == []
    assert (root / ".old-step-000001").is_dir()


def test_check_data_compares_data_files_by_content(tmp_path):
    from trainers.checkpoint import check_data

    saved = {"dataset": "/a/d.jsonl", "dataset_sha256": "ab" * 32, "seed": 0}
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "data": saved}))
    check_data(tmp_path, dict(saved))
    check_data(tmp_path, {**saved, "dataset": "/moved/d.jsonl"})  # the same bytes, moved
    with pytest.raises(ValueError, match="the files of --dataset /a/d.jsonl changed since"):
        check_data(tmp_path, {**saved, "dataset_sha256": "cd" * 32})
    with pytest.raises(ValueError, match="this run has --seed 1"):
        check_data(tmp_path, {**saved, "seed": 1})


def test_check_layout_refuses_another_dtype(tmp_path):
    from trainers.checkpoint import check_layout

    saved = {"processes": 1, "dp": 1, "ring": 1, "tp": 1, "zero_stage": 0, "dtype": "fp32"}
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "layout": saved}))
    check_layout(tmp_path, dict(saved))
    with pytest.raises(ValueError, match="resume with the checkpoint's --dtype$"):
        check_layout(tmp_path, {**saved, "dtype": "bf16"})


# ----------------------------------------------------------------------------- logger
def test_metrics_logger_resume_keeps_earlier_steps_only(tmp_path):
    from trainers.logger import MetricsLogger, read_metrics

    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": float(s)}) + "\n" for s in (1, 2, 3, 4))
    )
    lg = MetricsLogger(str(tmp_path), kind="none", resume=True)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]  # untouched yet
    lg.log({"loss": -3.0}, 3)
    lg.close()
    assert read_metrics(str(tmp_path / "metrics.jsonl")) == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": -3.0},
    ]
    lg = MetricsLogger(str(tmp_path), kind="none", resume=True)
    lg.start_at(2)  # a resume with no step left to log still drops the records from step 2 on
    lg.close()
    assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 1.0}]


def test_tensorboard_of_a_resumed_run_hides_the_replaced_steps(tmp_path):
    """TensorBoard hides earlier events from the first step logged now on (no overlap)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainers.logger import MetricsLogger

    lg = MetricsLogger(str(tmp_path), kind="tensorboard")
    for s in (1, 2, 3, 4):
        lg.log({"loss": float(s)}, s)
    lg.close()
    lg = MetricsLogger(str(tmp_path), kind="tensorboard", resume=True)
    lg.log({"loss": -3.0}, 3)
    lg.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, -3.0)]


def test_metrics_logger_refuses_booleans_and_nulls_infinities(tmp_path):
    from trainers.logger import MetricsLogger, read_metrics

    lg = MetricsLogger(str(tmp_path), kind="none")
    with pytest.raises(TypeError, match="metric 'ok': expected a number, got True"):
        lg.log({"ok": True}, 1)
    lg.log({"a": -math.inf, "b": math.inf, "c": 2}, 1)
    lg.close()
    assert read_metrics(str(tmp_path)) == [{"step": 1, "a": None, "b": None, "c": 2}]
    assert read_metrics(str(tmp_path)) == read_metrics(str(tmp_path / "metrics.jsonl"))


def test_plot_skips_nulls_and_groups_never_logged(tmp_path):
    """A NaN logged as null is not plotted; key groups never logged are skipped."""
    from trainers.logger import plot_metrics

    records = [{"step": 2, "loss": None, "lr": 1.0}, {"step": 1, "loss": 0.5, "lr": 2.0}]
    path = plot_metrics(records, [("loss",), ("nope",), ("lr",)], str(tmp_path), "t")
    assert path == str(tmp_path / "metrics.png")
    assert plot_metrics([{"step": 1, "loss": None}], [("loss",)], str(tmp_path / "x"), "") is None


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "bad, text",
    [
        (dict(epochs=0), "--epochs must be >= 1"),
        (dict(micro_batch_tokens=0), "--micro-batch-tokens must be >= 1"),
        (dict(max_steps=0), "--max-steps must be >= 1"),
        (dict(max_samples=0), "--max-samples must be >= 1"),
        (dict(eval_ratio=1.0), r"--eval-ratio must be in \[0, 1\)"),
        (dict(seed=2**32), "--seed must be in"),
        (dict(lr=0.0), "--lr must be > 0"),
        (dict(lr=float("inf")), "--lr must be a finite number"),
        (dict(max_grad_norm=-1.0), "--max-grad-norm must be >= 0"),
        (dict(save_total_limit=-1), "--save-total-limit must be >= 0"),
        (dict(save_total_limit=2), "--save-total-limit 2 needs --save-steps N"),
        (dict(timeout_s=0), "--timeout-s must be >= 1"),
        (dict(eval_steps=5, eval_ratio=0.0), "--eval-steps 5 evaluates held-out data"),
        (dict(tp_size=2, zero_stage=3), "cannot be combined with --zero-stage 3"),
        (dict(no_packing=True, ring_attn_size=2), "--no-packing cannot be combined"),
        (dict(dataset=", ,"), "--dataset is empty"),
        (dict(input_template="Q: A:"), "--input-template 'Q: A:' has no"),
    ],
)
def test_train_config_validate_refuses(bad, text):
    from trainers.config import TrainConfig

    with pytest.raises(ValueError, match=text):
        TrainConfig(**bad).validate()


def test_train_config_validate_accepts_the_edges():
    from trainers.config import TrainConfig

    TrainConfig().validate()
    ok = dict(seed=2**32 - 1, eval_ratio=0.0, max_grad_norm=0.0, save_total_limit=0, tp_size=2)
    TrainConfig(**ok).validate()
    # --eval-split (or --eval-dataset) is held-out data: --eval-steps needs no --eval-ratio
    TrainConfig(eval_steps=5, eval_ratio=0.0, eval_split="test").validate()
    TrainConfig(eval_steps=5, eval_ratio=0.0, eval_dataset="e.jsonl").validate()


def test_dataset_probs_must_be_finite_and_may_be_large():
    """inf passed as "positive" and gave NaN weights; 1e308 + 1e308 overflowed to zero weights
    (both surfaced as a datasets error that does not name the flag)."""
    assert data._parse_probs("1e308,1e308", 2) == [0.5, 0.5]
    assert data._parse_probs("3,1", 2) == [0.75, 0.25]
    for bad in ("inf,1", "nan,1", "0,1", "-1,2"):
        with pytest.raises(ValueError, match="expected 2 positive finite floats"):
            data._parse_probs(bad, 2)


def test_read_metrics_names_a_line_that_is_not_an_object(tmp_path):
    from trainers.logger import MetricsLogger, read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n[1]\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: expected a JSON object, got '\[1\]'"):
        read_metrics(str(tmp_path))
    with pytest.raises(ValueError, match="expected a JSON object"):  # not an AttributeError
        MetricsLogger(str(tmp_path), kind="none", resume=True).log({"loss": 1.0}, 3)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')  # a cut last line
    assert read_metrics(str(tmp_path)) == [{"step": 1}]


def test_a_literal_nul_is_no_prompt_slot():
    with pytest.raises(ValueError, match="has no '{}' where the prompt goes"):
        data.check_template("Q:\0")
    data.check_template("Q:\0 {} A:")  # a NUL beside the slot is fine
