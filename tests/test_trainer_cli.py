"""trainers.cli (dataclass -> argparse + YAML) and trainers.logger (metrics.jsonl, sinks, plot)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import pytest
import torch
import yaml

from trainers.cli import build_parser, config_to_dict, parse_config
from trainers.logger import MetricsLogger, read_metrics


def _f(default, help, **meta):
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class Cfg:
    """Toy trainer config."""

    model: str | None = _f(None, "model folder (default: the tiny model)")
    dataset: str = _f("toy.jsonl", "training data")
    batch_size: int = _f(16, "samples per step")
    lr: float = _f(1e-4, "peak learning rate, 10% at the end")
    max_samples: int | None = _f(None, "cap on samples")
    temperature: Optional[float] = _f(None, "sampling temperature")  # noqa: UP045
    no_packing: bool = _f(False, "pad instead of packing")
    shuffle: bool = _f(True, "shuffle the data")
    zero_stage: int = _f(0, "ZeRO stage", choices=(0, 1, 2, 3))
    ring_layout: str = _f("zigzag", "ring layout", choices=("zigzag", "contiguous"))
    world_size: int = field(default=1, metadata={"cli": False})

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")


def _exit2(capsys, argv, **kw) -> str:
    """Run parse_config expecting exit 2; return the last stderr line."""
    with pytest.raises(SystemExit) as e:
        parse_config(Cfg, argv, prog="toy", **kw)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("toy: error: ")
    return err[-1]


def _yaml(tmp_path, data) -> str:
    p = tmp_path / "cfg.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(p)


# ---------------------------------------------------------------- cli


def test_help_lists_every_flag_with_help_and_default(capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(Cfg, ["--help"], prog="toy")
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # undo line wrapping
    assert "Toy trainer config." in out
    assert "--config FILE.yaml" in out
    for text in (
        "--model MODEL model folder (default: the tiny model)",
        "--dataset DATASET training data (default: toy.jsonl)",
        "--batch-size BATCH_SIZE samples per step (default: 16)",
        "--lr LR peak learning rate, 10% at the end (default: 0.0001)",
        "--max-samples MAX_SAMPLES cap on samples (default: None)",
        "--temperature TEMPERATURE sampling temperature (default: None)",
        "--no-packing, --packing pad instead of packing (flag)",
        "--shuffle, --no-shuffle shuffle the data (default: True)",
        "--zero-stage {0,1,2,3} ZeRO stage (default: 0)",
        "--ring-layout {zigzag,contiguous} ring layout (default: zigzag)",
    ):
        assert text in out, text
    assert "(default: None)" not in out.split("--model MODEL")[1].split("--dataset")[0]
    assert "--world-size" not in out


def test_defaults_and_types():
    assert parse_config(Cfg, []) == Cfg()
    cfg = parse_config(Cfg, ["--batch-size", "8", "--lr", "3e-4", "--dataset", "a.jsonl"])
    assert (cfg.batch_size, cfg.lr, cfg.dataset) == (8, 3e-4, "a.jsonl")
    assert type(cfg.batch_size) is int and type(cfg.lr) is float


def test_optional_fields():
    cfg = parse_config(Cfg, ["--max-samples", "5", "--temperature", "0.7", "--model", "m"])
    assert (cfg.max_samples, cfg.temperature, cfg.model) == (5, 0.7, "m")
    assert type(cfg.max_samples) is int


def test_bool_flags(capsys):
    cfg = parse_config(Cfg, ["--no-packing", "--no-shuffle"])
    assert cfg.no_packing is True and cfg.shuffle is False
    assert parse_config(Cfg, ["--shuffle"]).shuffle is True
    msg = _exit2(capsys, ["--no-packing=1"])
    assert "--no-packing/--packing: ignored explicit argument '1'" in msg
    assert parse_config(Cfg, ["--no-packing", "--packing"]).no_packing is False  # the last wins


def test_flags_undo_what_the_yaml_set(tmp_path):
    """A YAML true could not be turned off, nor a YAML string unset ('none' stayed text)."""
    path = _yaml(tmp_path, "no_packing: true\nshuffle: false\nmodel: mine\n")
    cfg = parse_config(Cfg, ["--config", path, "--packing", "--shuffle", "--model", "none"])
    assert (cfg.no_packing, cfg.shuffle, cfg.model) == (False, True, None)
    assert parse_config(Cfg, ["--dataset", "none"]).dataset == "none"  # not nullable: text
    assert parse_config(Cfg, ["--config", path]).no_packing is True


def test_choices_and_bad_types(capsys):
    cfg = parse_config(Cfg, ["--zero-stage", "3", "--ring-layout", "contiguous"])
    assert (cfg.zero_stage, cfg.ring_layout) == (3, "contiguous")
    msg = _exit2(capsys, ["--zero-stage", "4"])
    assert "--zero-stage" in msg and "invalid choice: 4" in msg
    assert "invalid choice: 'ring'" in _exit2(capsys, ["--ring-layout", "ring"])
    msg = _exit2(capsys, ["--batch-size", "x"])
    assert "--batch-size" in msg and "invalid int value: 'x'" in msg
    assert "invalid float value: 'fast'" in _exit2(capsys, ["--lr", "fast"])


def test_no_abbreviations_and_no_flag_for_cli_false(capsys):
    assert "unrecognized arguments" in _exit2(capsys, ["--batch", "8"])
    assert "unrecognized arguments" in _exit2(capsys, ["--world-size", "2"])


def test_yaml_applied_and_overridden_by_flags(tmp_path):
    path = _yaml(
        tmp_path,
        "lr: 1e-4\nbatch-size: 4\nmax_samples: 7\nno_packing: true\nshuffle: false\n"
        "zero_stage: 2\nring-layout: contiguous\ntemperature: 1\nmodel: null\n",
    )
    cfg = parse_config(Cfg, ["--config", path])
    assert cfg.lr == 1e-4 and type(cfg.lr) is float  # PyYAML reads 1e-4 as a string
    assert (cfg.batch_size, cfg.max_samples, cfg.no_packing, cfg.shuffle) == (4, 7, True, False)
    assert (cfg.zero_stage, cfg.ring_layout, cfg.temperature) == (2, "contiguous", 1.0)
    cfg = parse_config(Cfg, ["--batch-size", "32", "--config", path, "--shuffle"])
    assert (cfg.batch_size, cfg.shuffle, cfg.max_samples) == (32, True, 7)
    assert parse_config(Cfg, ["--config", _yaml(tmp_path, "")]) == Cfg()
    # 'none' unsets a nullable number in YAML as on the command line
    path = _yaml(tmp_path, "max_samples: none\ntemperature: None\n")
    cfg = parse_config(Cfg, ["--max-samples", "3", "--config", path])
    assert (cfg.max_samples, cfg.temperature) == (3, None)
    assert parse_config(Cfg, ["--config", path]).max_samples is None


def test_yaml_numbers_for_text_options_keep_their_text(tmp_path):
    """A text option given a YAML number takes it as written: ``007`` (YAML 1.1 octal), ``1.10``
    and ``0x1F`` were converted to '7', '1.1' and '31'. Number options still get numbers."""
    path = _yaml(tmp_path, "dataset: 007\nmodel: 1.10\nbatch_size: 0x1F\nlr: 2.50\n")
    cfg = parse_config(Cfg, ["--config", path])
    assert (cfg.dataset, cfg.model) == ("007", "1.10")
    assert (cfg.batch_size, cfg.lr) == (31, 2.5) and type(cfg.batch_size) is int
    assert type(cfg.lr) is float
    cfg = parse_config(Cfg, ["--config", _yaml(tmp_path, "dataset: 0x1F\nmodel: 1_000\n")])
    assert (cfg.dataset, cfg.model) == ("0x1F", "1_000")


def test_yaml_unknown_key(tmp_path, capsys):
    msg = _exit2(capsys, ["--config", _yaml(tmp_path, {"batch_size": 2, "learning_rate": 1})])
    assert "unknown key 'learning_rate'" in msg
    assert "valid keys: model, dataset, batch_size, lr," in msg


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("batch_size", "abc", "expected int, got 'abc'"),
        ("batch-size", 1.5, "expected int, got 1.5"),
        ("batch_size", None, "expected int, got None"),
        ("lr", "fast", "expected float, got 'fast'"),
        ("lr", True, "expected float, got True"),
        ("max_samples", [1], "expected int or null, got [1]"),
        ("no_packing", "yes", "expected bool, got 'yes'"),
        ("dataset", False, "expected str, got False"),
        ("zero_stage", 5, "expected one of [0, 1, 2, 3], got 5"),
        ("ring_layout", "ring", "expected one of ['zigzag', 'contiguous'], got 'ring'"),
    ],
)
def test_yaml_wrong_type(tmp_path, capsys, key, value, expected):
    msg = _exit2(capsys, ["--config", _yaml(tmp_path, {key: value})])
    assert f"config key {key!r}: {expected}" in msg


def test_yaml_not_a_mapping_or_missing(tmp_path, capsys):
    assert "expected a mapping" in _exit2(capsys, ["--config", _yaml(tmp_path, "- 1\n- 2\n")])
    assert "--config nope.yaml" in _exit2(capsys, ["--config", "nope.yaml"])


def test_validate_error_exits_2(tmp_path, capsys):
    msg = _exit2(capsys, ["--batch-size", "0"])
    assert msg == "toy: error: --batch-size must be >= 1, got 0"
    msg = _exit2(capsys, ["--config", _yaml(tmp_path, {"batch_size": -1})])
    assert msg == "toy: error: --batch-size must be >= 1, got -1"


def test_config_to_dict_round_trips_through_yaml(tmp_path):
    cfg = parse_config(Cfg, ["--lr", "0.003", "--no-shuffle", "--max-samples", "9"])
    d = config_to_dict(cfg)
    assert list(d)[:3] == ["model", "dataset", "batch_size"] and d["world_size"] == 1
    assert parse_config(Cfg, ["--config", _yaml(tmp_path, d)]) == cfg
    with pytest.raises(TypeError, match="dataclass instance"):
        config_to_dict(Cfg)


def test_unsupported_type_is_rejected_at_build_time():
    @dataclass
    class Bad:
        ids: list = field(default_factory=list)

    with pytest.raises(TypeError, match="Bad.ids: expected a type in int, float, str, bool"):
        build_parser(Bad, "bad", "")
    with pytest.raises(TypeError, match="dataclass type"):
        build_parser(dict, "bad", "")


# ---------------------------------------------------------------- logger


def test_metrics_jsonl_lines_flushed_and_converted(tmp_path):
    lg = MetricsLogger(str(tmp_path), kind="none")
    lg.log({"loss": torch.tensor(0.123456789012345, dtype=torch.float64), "tok": np.int64(7)}, 1)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()  # before close: flushed
    assert lines == ['{"step": 1, "loss": 0.123456789012345, "tok": 7}']
    lg.log({"loss": float("nan"), "grad_norm": math.inf, "lr": 1 / 3}, step=2)
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[1])
    assert list(rec) == ["step", "loss", "grad_norm", "lr"]
    assert rec == {"step": 2, "loss": None, "grad_norm": None, "lr": 1 / 3}
    with pytest.raises(TypeError, match="metric 'bad': expected a number, got 'x'"):
        lg.log({"bad": "x"}, 3)
    with pytest.raises(ValueError, match="'step' is reserved"):
        lg.log({"step": 3}, 3)
    assert lg.close() is None
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]


def test_fresh_run_overwrites_and_resume_truncates(tmp_path):
    lg = MetricsLogger(str(tmp_path), kind="none")
    for s in range(1, 6):
        lg.log({"loss": 1.0 / s}, s)
    lg.close()
    lg = MetricsLogger(str(tmp_path), kind="none", resume=True)
    assert len(read_metrics(str(tmp_path))) == 5  # nothing dropped until the first new line
    lg.log({"loss": 0.9}, 3)
    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path))] == [
        (1, 1.0),
        (2, 0.5),
        (3, 0.9),
    ]
    lg.log({"loss": 0.8}, 4)
    lg.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3, 4]
    MetricsLogger(str(tmp_path), kind="none").close()
    assert read_metrics(str(tmp_path)) == []


def test_read_metrics_drops_a_cut_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_metrics(str(p)) == [{"step": 1, "loss": 2.0}]
    p.write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_metrics(str(p))


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lg = MetricsLogger(str(tmp_path), kind="tensorboard")
    for s in range(1, 4):
        lg.log({"train/loss": 1.0 / s, "train/lr": 0.1}, s)
    lg.close()
    tb = tmp_path / "tensorboard"
    assert any(n.startswith("events.out.tfevents") for n in os.listdir(tb))
    acc = EventAccumulator(str(tb))
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == ["train/loss", "train/lr"]
    ev = acc.Scalars("train/loss")
    assert [e.step for e in ev] == [1, 2, 3]
    assert [e.value for e in ev] == pytest.approx([1.0, 0.5, 1 / 3])


def test_wandb_offline_writes_into_output_dir(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    lg = MetricsLogger(str(tmp_path), kind="wandb", run_name="t", config={"lr": 0.1})
    lg.log({"loss": 1.5}, 1)
    lg.log({"loss": 0.5}, 2)
    lg.close()
    runs = [n for n in os.listdir(tmp_path / "wandb") if n.startswith("offline-run-")]
    assert len(runs) == 1
    assert any(n.endswith(".wandb") for n in os.listdir(tmp_path / "wandb" / runs[0]))
    assert len(read_metrics(str(tmp_path))) == 2
    # --resume continues the same wandb run (its id is kept in the output folder)
    lg = MetricsLogger(str(tmp_path), kind="wandb", run_name="t", resume=True)
    lg.log({"loss": 0.25}, 3)
    lg.close()
    runs = sorted(n for n in os.listdir(tmp_path / "wandb") if n.startswith("offline-run-"))
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    assert len(runs) == 2 and all(f"-{run_id}" in n for n in runs), (runs, run_id)
    fresh = MetricsLogger(str(tmp_path / "other"), kind="wandb")  # a new run: a new id
    fresh.close()
    assert (tmp_path / "other" / "wandb" / "run_id").read_text() != run_id


def test_wandb_resume_sends_only_steps_it_lacks(tmp_path, monkeypatch):
    """A crash after step 5 and a resume from the step-3 checkpoint: the continued wandb run
    gets steps 6+ only (wandb drops steps below its last one, with a warning per step), while
    metrics.jsonl holds the re-run's steps 4 and 5."""
    import types

    sent = []

    class Run:
        def log(self, values, step):
            sent.append(step)

        def finish(self):
            pass

    fake = types.SimpleNamespace(init=lambda **kw: sent.append(kw.get("resume")) or Run())
    monkeypatch.setitem(__import__("sys").modules, "wandb", fake)
    lg = MetricsLogger(str(tmp_path), kind="wandb")
    for step in range(1, 6):
        lg.log({"loss": 1 / step}, step)
    lg.close()
    lg = MetricsLogger(str(tmp_path), kind="wandb", resume=True)
    for step in range(4, 8):
        lg.log({"loss": 2 / step}, step)
    lg.close()
    assert sent == [None, 1, 2, 3, 4, 5, "allow", 6, 7]
    assert [r["loss"] for r in read_metrics(str(tmp_path))][3:] == [0.5, 0.4, 2 / 6, 2 / 7]


def test_wandb_missing_and_bad_kind(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match="pip install wandb.*--logger tensorboard"):
        MetricsLogger(str(tmp_path), kind="wandb")
    with pytest.raises(ValueError, match="kind: expected one of .*got 'mlflow'"):
        MetricsLogger(str(tmp_path), kind="mlflow")


def test_plot_png_and_none_when_nothing_to_plot(tmp_path):
    lg = MetricsLogger(str(tmp_path / "a"), kind="none")
    for s in range(1, 6):
        lg.log({"loss": 1.0 / s, "lr": 1e-3}, s)
        if s % 2 == 0:
            lg.log({"eval_loss": 0.9 / s}, s)
    path = lg.close([("loss", "eval_loss"), ("lr",), ("never_logged",)], title="SFT")
    assert path == str(tmp_path / "a" / "metrics.png")
    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 10_000

    lg = MetricsLogger(str(tmp_path / "b"), kind="none")
    lg.log({"loss": 1.0}, 1)
    assert lg.close([("reward",)]) is None
    assert MetricsLogger(str(tmp_path / "c"), kind="none").close([("loss",)]) is None
    assert not (tmp_path / "b" / "metrics.png").exists()
    assert not (tmp_path / "c" / "metrics.png").exists()


def test_disabled_rank_writes_nothing(tmp_path):
    out = tmp_path / "rank1"
    lg = MetricsLogger(str(out), kind="tensorboard", enabled=False)
    lg.log({"loss": 1.0}, 1)
    assert lg.close([("loss",)]) is None
    assert not out.exists()


def test_a_missing_wandb_touches_no_output(tmp_path, monkeypatch):
    """--overwrite used to delete the checkpoints and empty metrics.jsonl, then fail importing
    wandb: the config check now fails first, and the logger imports before truncating."""
    from trainers.config import TrainConfig
    from trainers.logger import MetricsLogger

    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ValueError, match="--logger wandb needs the wandb package"):
        TrainConfig(logger="wandb").validate()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    with pytest.raises(ImportError):
        MetricsLogger(str(tmp_path), kind="wandb")
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 2.0}\n'
    cases = [(dict(seed=-1), "--seed must be in"), (dict(timeout_s=0), "--timeout-s")]
    cases.append((dict(offload=True), "it needs --zero-stage 1, 2 or 3, got 0"))  # no-op at 0
    for bad, text in cases:
        with pytest.raises(ValueError, match=text):
            TrainConfig(**bad).validate()


def test_none_unsets_optional_choices_and_yaml_text(tmp_path, capsys):
    from trainers.ppo import PPOConfig

    path = _yaml(tmp_path, "ref_zero_stage: 3\neval_split: none\n")
    cfg = parse_config(PPOConfig, ["--config", path, "--ref-zero-stage", "none"])
    assert (cfg.ref_zero_stage, cfg.eval_split) == (0, None)  # None: follows --zero-stage 0
    with pytest.raises(SystemExit):
        parse_config(PPOConfig, ["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--ref-zero-stage {0,3,none}" in out
    assert "(must differ from --split) (default: None); 'none' unsets it" in out


def test_commit_folder_flushes_before_the_rename_and_keeps_a_whole_copy(tmp_path, monkeypatch):
    """Checkpoints and exported models are committed by ``commit_folder``: every file and folder
    is fsynced before the rename (then the parent after it), and a re-save whose commit rename
    fails leaves the previous folder in place, whole."""
    from trainers import checkpoint

    final, tmp = tmp_path / "step-000002", tmp_path / ".tmp-step-000002"
    (tmp / "engine").mkdir(parents=True)
    (tmp / "engine" / "w.pt").write_bytes(b"new")
    (tmp / "trainer_state.json").write_text("{}")
    events, real_replace, real_fsync = [], os.replace, os.fsync

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("rename", str(a))),
                                                     real_replace(a, b)))  # fmt: skip
    checkpoint.commit_folder(tmp, final)
    flushed = {p for kind, p in events if kind == "fsync"}
    assert {str(tmp / "engine" / "w.pt"), str(tmp / "trainer_state.json"), str(tmp)} <= flushed
    rename = events.index(("rename", str(tmp)))
    assert all(kind == "fsync" for kind, _ in events[:rename])  # all flushed before the commit
    assert events[rename + 1] == ("fsync", str(tmp_path))  # then the rename itself
    assert (final / "engine" / "w.pt").read_bytes() == b"new" and not tmp.exists()

    (tmp / "engine").mkdir(parents=True)  # a re-save whose commit rename fails
    (tmp / "engine" / "w.pt").write_bytes(b"newer")

    def fail_second(a, b):
        if str(a) == str(tmp):
            raise OSError(28, "No space left on device")
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", fail_second)
    with pytest.raises(OSError, match="No space"):
        checkpoint.commit_folder(tmp, final)
    assert (final / "engine" / "w.pt").read_bytes() == b"new"  # the previous copy, back
    assert (tmp / "engine" / "w.pt").read_bytes() == b"newer"


def test_resume_finds_a_checkpoint_set_aside_by_a_crashed_re_save(tmp_path):
    """A re-save of step N moves the committed step-N to .old-step-N before its own rename: a
    crash between the two left the only whole copy there, which --resume ignored (it fell back
    to an older step, or started fresh)."""
    from trainers.checkpoint import checkpoint_root, latest_checkpoint

    root = checkpoint_root(tmp_path)
    for name in ("step-000002", ".old-step-000004", ".tmp-step-000004", ".old-step-000001"):
        (root / name).mkdir(parents=True)
        (root / name / "trainer_state.json").write_text("{}")
    assert latest_checkpoint(tmp_path).name == ".old-step-000004"
    (root / "step-000004").mkdir()  # the re-save's rename happened, its state not complete
    assert latest_checkpoint(tmp_path).name == ".old-step-000004"
    (root / "step-000004" / "trainer_state.json").write_text("{}")
    assert latest_checkpoint(tmp_path).name == "step-000004"  # the committed one wins


def test_an_empty_flag_is_refused_not_taken_for_the_default():
    """``--dataset "$DATA"`` with DATA unset trained on the bundled toy set; an empty
    ``--eval-dataset`` evaluated on the training file itself; an empty ``--output-dir`` is the
    working directory."""
    from trainers.ppo import PPOConfig
    from trainers.sft import SFTConfig

    for name, value in (("dataset", ""), ("eval_dataset", " "), ("output_dir", ""), ("split", ",")):
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} is empty"):
            SFTConfig(**{name: value}).validate()
    with pytest.raises(ValueError, match="--reward-fn is empty"):
        PPOConfig(reward_fn="").validate()


def test_max_steps_replaces_epochs():
    """``--max-steps`` was capped at ``--epochs`` passes in SFT / RM (40 rows, batch 4,
    --max-steps 100 trained 10 steps, and a resume with a higher --max-steps trained none)."""
    from types import SimpleNamespace

    from trainers.common import batch_indices, total_steps

    assert total_steps(40, SimpleNamespace(batch_size=4, epochs=1, max_steps=100)) == 100
    assert total_steps(40, SimpleNamespace(batch_size=4, epochs=3, max_steps=None)) == 30
    assert total_steps(40, SimpleNamespace(batch_size=4, epochs=3, max_steps=5)) == 5
    second = [i for s in range(11, 21) for i in batch_indices(s, 40, 4, seed=0)]
    assert sorted(second) == list(range(40))  # step 11 on: a second, reshuffled pass
    assert second != [i for s in range(1, 11) for i in batch_indices(s, 40, 4, seed=0)]
