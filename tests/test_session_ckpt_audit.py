"""Audit of trainers.session / checkpoint / common / cli: what the contract tests left open
(output-folder checks, --overwrite, keep-last, stale folders of crashed saves, data flags by
content, layout, resume refusals before any work, integer PPO prompts). Plain folders, fake
engines and stub tokenizers: no DeepSpeed, no processes."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch

from trainers import common
from trainers.checkpoint import (
    _as_flag,
    check_data,
    check_layout,
    checkpoint_root,
    latest_checkpoint,
    read_state,
    save_checkpoint,
)


class _Engine:
    def __init__(self, weight: bytes = b"w"):
        self.weight = weight

    def save_checkpoint(self, path, tag, save_latest):
        (Path(path) / tag).mkdir()
        (Path(path) / tag / "w.pt").write_bytes(self.weight)


def _names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _layout():
    from trainers.distributed import Layout

    return Layout(world=1, rank=0, dp=1, ring=1, tp=1, device=torch.device("cpu"))


def _state(path: Path, **state) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "trainer_state.json").write_text(json.dumps({"step": 1, **state}))
    return path


# ----------------------------------------------------------------------------- checkpoints
def test_save_total_limit_1_keeps_only_the_newest(tmp_path):
    for step in (1, 2, 3):
        save_checkpoint(_Engine(), tmp_path, step, {}, keep=1)
    assert _names(checkpoint_root(tmp_path)) == ["step-000003"]
    save_checkpoint(_Engine(), tmp_path, 4, {}, keep=0)  # 0: keep all
    assert _names(checkpoint_root(tmp_path)) == ["step-000003", "step-000004"]


def test_next_save_keeps_a_crashed_re_saves_only_copy_and_clears_stale_folders(tmp_path):
    """A re-save of step 2 that died between its renames left ``.old-step-000002`` as step 2's
    only copy: the next save must not delete it (resume may need it); the leftovers of a
    crashed save (``.tmp-``) and prune (``.del-``) go."""
    root = checkpoint_root(tmp_path)
    _state(root / ".old-step-000002", step=2)
    (root / ".tmp-step-000003").mkdir()
    _state(root / ".del-step-000001")
    save_checkpoint(_Engine(), tmp_path, 4, {})
    assert _names(root) == [".old-step-000002", "step-000004"]


def test_read_state_refuses_a_boolean_or_negative_step(tmp_path):
    for step in (True, -1):
        _state(tmp_path, step=step)
        with pytest.raises(ValueError, match="has no integer 'step' >= 0"):
            read_state(tmp_path)
    _state(tmp_path, step=0)
    assert read_state(tmp_path)["step"] == 0


def test_check_layout_refuses_another_offload(tmp_path):
    layout = {"processes": 1, "zero_stage": 1, "dtype": "fp32", "offload": True}
    _state(tmp_path, layout=layout)
    check_layout(tmp_path, layout)
    with pytest.raises(ValueError, match="resume with the checkpoint's --offload"):
        check_layout(tmp_path, {**layout, "offload": False})


def test_check_data_without_digests_compares_the_paths(tmp_path):
    """A checkpoint without data digests (or a run without files) cannot call another path the
    same data."""
    _state(tmp_path, data={"dataset": "/data/a.jsonl", "seed": 0})
    with pytest.raises(ValueError, match="--dataset /data/a.jsonl; this run has --dataset /b"):
        check_data(tmp_path, {"dataset": "/b", "seed": 0})


def test_check_data_other_path_and_other_bytes_names_the_flags(tmp_path):
    _state(tmp_path, data={"dataset": "/a", "dataset_sha256": "1" * 64})
    with pytest.raises(ValueError, match="with --dataset /a; this run has --dataset /b") as e:
        check_data(tmp_path, {"dataset": "/b", "dataset_sha256": "2" * 64})
    assert "sha256" not in str(e.value)  # a changed path is not reported as edited files


def test_as_flag_writes_off_and_unset_as_no_flag():
    assert _as_flag("apply_chat_template", False) == "no --apply-chat-template"
    assert _as_flag("dataset", None) == "no --dataset"
    assert _as_flag("apply_chat_template", True) == "--apply-chat-template"
    assert _as_flag("seed", 0) == "--seed 0"
    assert _as_flag("input_template", "Q: {}") == "--input-template 'Q: {}'"


# ----------------------------------------------------------------------------- session data
def test_checkpoint_data_normalises_what_names_the_same_data(tmp_path, monkeypatch):
    from trainers.ppo import PPOConfig
    from trainers.session import checkpoint_data

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"prompt": "x"}\n')
    a = checkpoint_data(PPOConfig(dataset="./a.jsonl", dataset_probs="1", reward_model="rm"))
    b = checkpoint_data(PPOConfig(dataset="a.jsonl", dataset_probs=" 1 ", reward_model="./rm"))
    assert a == b and a["dataset"] == str(tmp_path / "a.jsonl")
    assert a["reward_model"] == str(tmp_path / "rm")
    assert len(a["dataset_sha256"]) == 64
    no = checkpoint_data(PPOConfig(dataset="a.jsonl"), digests=False)
    assert "dataset_sha256" not in no  # other ranks do not read the files


def test_folder_digest_covers_file_names(tmp_path):
    from trainers.session import data_digest

    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / "a.arrow").write_bytes(b"rows")
    before = data_digest(str(folder))
    (folder / "a.arrow").rename(folder / "b.arrow")
    assert data_digest(str(folder)) != before
    assert data_digest(str(tmp_path / "missing")) == ""


def test_apply_optimizer_flags_replaces_weight_decay_and_lr():
    from trainers.session import apply_optimizer_flags

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1.0, weight_decay=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    apply_optimizer_flags(SimpleNamespace(lr_scheduler=sched), 0.2, 0.01)
    assert opt.param_groups[0]["weight_decay"] == 0.01
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)


def _session(tmp_path, cfg, total=5):
    from trainers.logger import MetricsLogger

    return SimpleNamespace(
        cfg=cfg,
        kind="sft",
        layout=_layout(),
        total=total,
        critic=None,
        logger=MetricsLogger(str(tmp_path), kind="none"),
        _bar=SimpleNamespace(set_postfix=lambda d: None),
        print=lambda m: None,
    )


@pytest.mark.parametrize("key", ["loss", "policy_loss", "value_loss", "grad_norm"])
def test_a_non_finite_step_ends_the_run_before_its_checkpoint(tmp_path, key, capsys):
    from trainers.session import Session
    from trainers.sft import SFTConfig

    s = _session(tmp_path, SFTConfig(output_dir=str(tmp_path), save_steps=1))
    with pytest.raises(SystemExit):
        Session.end_step(s, 1, {"loss": 1.0, key: math.nan}, _Engine())
    assert f"step 1: {key} is nan" in capsys.readouterr().err
    assert latest_checkpoint(tmp_path) is None


def test_a_resume_past_the_last_step_is_refused_before_the_engine_is_built(
    tmp_path, monkeypatch, capsys
):
    from trainers import engine as engine_mod
    from trainers.session import Session
    from trainers.sft import SFTConfig

    def build_engine(*a, **k):
        raise AssertionError("the engine was built for a run with no step left")

    monkeypatch.setattr(engine_mod, "build_engine", build_engine)
    save_checkpoint(_Engine(), tmp_path, 5, {})
    s = _session(tmp_path, SFTConfig(output_dir=str(tmp_path), resume=True), total=4)
    s.optimizer_steps = 4
    with pytest.raises(SystemExit):
        Session.build(s, torch.nn.Linear(1, 1))
    assert "is at step 5, past this run's 4 steps" in capsys.readouterr().err


class _CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]


def test_ppo_takes_integer_prompts_and_names_a_long_one(tmp_path, monkeypatch, capsys):
    """Integer prompts are legal (read as their digits): the prompt check used to slice them
    (TypeError traceback) instead of loading them or naming the row."""
    from trainers.ppo import PPOConfig
    from trainers.session import Session

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": 1000 + i}) + "\n" for i in range(8)))
    cfg = PPOConfig(
        dataset=str(path),
        reward_fn="trainers.rewards:reverse_reward",
        rollout_batch_size=4,
        batch_size=4,
        n_samples_per_prompt=2,
        eval_ratio=0.0,
        output_dir=str(tmp_path / "out"),
    )
    s = Session(cfg, "ppo", _layout(), "unused", _CharTokenizer())
    rows, held = s.load_prompts()
    assert [r["prompt"] for r in rows] == list(range(1000, 1008)) and held == []
    cfg.max_len = 3
    with pytest.raises(SystemExit):
        s.load_prompts()
    assert "prompt row 0 (0-based) of the --dataset (--split 'train'), '1000', has 4 tokens" in (
        capsys.readouterr().err
    )


# ----------------------------------------------------------------------------- common
def test_output_dir_with_checkpoints_needs_resume_or_overwrite_not_both(tmp_path):
    save_checkpoint(_Engine(), tmp_path, 2, {})

    def check(resume, overwrite):
        cfg = SimpleNamespace(resume=resume, overwrite=overwrite)
        common.check_output_dir(str(tmp_path), None, cfg)

    with pytest.raises(ValueError, match="holds checkpoints of an earlier run .newest: step-0"):
        check(False, False)
    check(True, False)
    check(False, True)
    with pytest.raises(ValueError, match="give --resume or --overwrite, not both"):
        check(True, True)
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ValueError, match="metrics.jsonl is not a file"):
        check(True, False)


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="is not a writable folder"):
        common.check_output_dir(str(tmp_path / "f"), None, None)


def test_overwrite_clears_every_checkpoint(tmp_path):
    save_checkpoint(_Engine(), tmp_path, 2, {})
    _state(checkpoint_root(tmp_path) / ".old-step-000001")
    common.clear_checkpoints(str(tmp_path), None)
    assert latest_checkpoint(tmp_path) is None and _names(tmp_path) == []
    common.clear_checkpoints(str(tmp_path), None)  # nothing to clear: no error


def test_a_sample_of_exactly_the_budget_fits():
    assert common.check_lengths([3, 4], 4, "training") == ""
    assert "1 training sample(s)" in common.check_lengths([3, 5], 4, "training")


def test_overwrite_that_cannot_move_the_checkpoints_is_one_error_line(
    tmp_path, monkeypatch, capsys
):
    """A failed --overwrite rename used to escape ``progress`` as a ValueError traceback."""
    import os

    from trainers.session import Session
    from trainers.sft import SFTConfig

    save_checkpoint(_Engine(), tmp_path, 2, {})
    cfg = SFTConfig(output_dir=str(tmp_path), overwrite=True, logger="none")
    s = Session(cfg, "sft", _layout(), "unused", None)

    def replace(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(SystemExit):
        s._open_outputs()
    monkeypatch.undo()
    assert "error: --overwrite: cannot move" in capsys.readouterr().err
    assert latest_checkpoint(tmp_path).name == "step-000002"  # kept


@pytest.mark.parametrize("key, value", [("data", "abc"), ("layout", [1])])
def test_a_state_whose_layout_or_data_is_no_mapping_is_refused(tmp_path, key, value):
    """A malformed 'data' crashed rank 0's check_data with an AttributeError (the other ranks
    waited for it); a malformed 'layout' skipped the layout check."""
    _state(tmp_path, **{key: value})
    with pytest.raises(ValueError, match=f"has a '{key}' that is no mapping"):
        check_layout(tmp_path, {"processes": 1})
    with pytest.raises(ValueError, match=f"has a '{key}' that is no mapping"):
        check_data(tmp_path, {"dataset": "/a"})


def test_check_complete_names_a_missing_engine_folder_and_rng_file(tmp_path):
    from trainers.checkpoint import check_complete

    path = save_checkpoint(_Engine(), tmp_path, 1, {})
    check_complete(path, ["engine"], 0)
    with pytest.raises(ValueError, match=r"incomplete: no critic, rng_rank1\.pt \(saved by a"):
        check_complete(path, ["engine", "critic"], 1)


def test_prune_counts_a_crashed_re_saves_only_copy(tmp_path):
    """``.old-step-N`` without its ``step-N`` is a checkpoint (resume takes it): it counts
    toward --save-total-limit and is deleted as the oldest."""
    root = checkpoint_root(tmp_path)
    _state(root / ".old-step-000001")
    save_checkpoint(_Engine(), tmp_path, 2, {}, keep=2)
    assert _names(root) == [".old-step-000001", "step-000002"]
    save_checkpoint(_Engine(), tmp_path, 3, {}, keep=2)
    assert _names(root) == ["step-000002", "step-000003"]


def test_check_layout_names_the_critic_fix_and_the_sizes(tmp_path):
    from trainers.distributed import Layout
    from trainers.ppo import PPOConfig
    from trainers.session import checkpoint_layout

    layout = Layout(world=4, rank=0, dp=1, ring=2, tp=2, device=torch.device("cpu"))
    saved = checkpoint_layout(PPOConfig(advantage_estimator="gae"), "ppo", layout)
    assert (saved["ring"], saved["tp"], saved["dp"], saved["processes"]) == (2, 2, 1, 4)
    _state(tmp_path, layout=saved)
    with pytest.raises(ValueError, match="--advantage-estimator gae .the checkpoint holds a cri"):
        check_layout(tmp_path, {**saved, "critic": False})
    with pytest.raises(ValueError, match="resume with the checkpoint's --ring-attn-size$"):
        check_layout(tmp_path, {**saved, "ring": 1, "dp": 2})


def _ppo_session(tmp_path, monkeypatch, n_rows=8, dp=1, **flags):
    from trainers.distributed import Layout
    from trainers.ppo import PPOConfig
    from trainers.session import Session

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(n_rows)))
    kw = dict(rollout_batch_size=4, batch_size=4, n_samples_per_prompt=2, eval_ratio=0.0)
    cfg = PPOConfig(dataset=str(path), reward_fn="trainers.rewards:reverse_reward", **kw)
    for k, v in flags.items():
        setattr(cfg, k, v)
    layout = Layout(world=dp, rank=0, dp=dp, ring=1, tp=1, device=torch.device("cpu"))
    return Session(cfg, "ppo", layout, "unused", _CharTokenizer())


def test_ppo_steps_count_epochs_and_ppo_epochs(tmp_path, monkeypatch):
    s = _ppo_session(tmp_path, monkeypatch, max_steps=None, epochs=3, ppo_epochs=2)
    s.load_prompts()
    assert s.total == 8 // 4 * 3
    assert s.optimizer_steps == s.total * 2 * (4 * 2 // 4)


@pytest.mark.parametrize(
    "flags, dp, text",
    [
        ({"rollout_batch_size": 3, "batch_size": 6}, 2, "--rollout-batch-size 3 must be a multi"),
        ({"rollout_batch_size": 16, "batch_size": 16}, 1, "larger than the 8 training prompts"),
        ({"max_new_tokens": 30, "micro_batch_tokens": 31}, 1, "+ --max-new-tokens 30 exceeds"),
        ({"eval_split": "train"}, 1, "--eval-split 'train' is the training split"),
    ],
)
def test_ppo_prompt_checks(tmp_path, monkeypatch, capsys, flags, dp, text):
    s = _ppo_session(tmp_path, monkeypatch, dp=dp, **flags)
    with pytest.raises(SystemExit):
        s.load_prompts()
    assert text in capsys.readouterr().err


def test_sample_line_shows_about_six_rollouts():
    from trainers.session import Session

    shown = []
    s = SimpleNamespace(
        total=12, cfg=SimpleNamespace(input_key="q"), _bar=SimpleNamespace(write=shown.append)
    )
    for step in range(1, 13):
        Session.sample_line(s, step, ({"q": "hi"}, "ih"), 1.0)
    assert [line.split(":")[0] for line in shown] == [f"step {i}" for i in (1, 2, 4, 6, 8, 10, 12)]


def test_a_field_named_config_clashes_with_the_flag():
    import dataclasses

    from trainers.cli import build_parser

    @dataclasses.dataclass
    class Cfg:
        config: str = "x"

    with pytest.raises(TypeError, match="Cfg.config clashes with --config"):
        build_parser(Cfg)


def test_a_yaml_key_given_twice_is_refused_not_the_last_taken(tmp_path, capsys):
    """PyYAML keeps the last of two equal keys: a long --config with ``lr`` twice trained with
    the second one silently (``max_len`` with ``max-len`` was already refused)."""
    from trainers.cli import parse_config
    from trainers.sft import SFTConfig

    path = tmp_path / "c.yaml"
    path.write_text("lr: 1.0e-4\nmax_len: 64\nlr: 1.0e-3\n")
    with pytest.raises(SystemExit) as e:
        parse_config(SFTConfig, ["--config", str(path)])
    assert e.value.code == 2
    assert "key 'lr' is given twice" in capsys.readouterr().err
    path.write_text("<<: {lr: 1.0e-4, max_len: 32}\nmax_len: 64\n")  # a merge key may be overridden
    cfg = parse_config(SFTConfig, ["--config", str(path)])
    assert (cfg.lr, cfg.max_len) == (1e-4, 64)
