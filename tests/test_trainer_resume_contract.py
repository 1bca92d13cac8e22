"""Resume contracts of trainers.checkpoint / session / engine / logger that only the slow
end-to-end runs covered: RNG restore, load errors, re-saves, pruning, when a step saves and what
a resumed run keeps. Fake engines and plain folders: no DeepSpeed, no processes."""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainers import checkpoint
from trainers.checkpoint import (
    checkpoint_root,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
)


class _Engine:
    """Writes one weight file per save; ``load`` says what DeepSpeed's loader would."""

    def __init__(self, weight: bytes = b"w", load=None):
        self.weight, self.load, self.loaded = weight, load, []

    def save_checkpoint(self, path, tag, save_latest):
        (Path(path) / tag).mkdir()
        (Path(path) / tag / "w.pt").write_bytes(self.weight)

    def load_checkpoint(self, path, tag):
        self.loaded.append((path, tag))
        if isinstance(self.load, Exception):
            raise self.load
        return (path, {}) if self.load is None else self.load


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(()))


def _committed(root: Path, *names: str) -> None:
    for name in names:
        (root / name).mkdir(parents=True)
        (root / name / "trainer_state.json").write_text('{"step": 1}')


# ----------------------------------------------------------------------------- save
def test_resave_whose_commit_fails_keeps_the_previous_copy(tmp_path, monkeypatch):
    """A resumed run re-saving step N replaces the committed step-N only by the rename: a
    failed commit leaves the earlier copy in place, whole."""
    save_checkpoint(_Engine(b"first"), tmp_path, 3, {"seen": 0})
    path = save_checkpoint(_Engine(b"old"), tmp_path, 3, {"seen": 1})  # a re-save replaces it
    assert (path / "engine" / "w.pt").read_bytes() == b"old"
    assert [p.name for p in checkpoint_root(tmp_path).iterdir()] == ["step-000003"]
    real = os.replace

    def fail_commit(a, b):
        if Path(a).name.startswith(".tmp-"):
            raise OSError(28, "No space left on device")
        real(a, b)

    monkeypatch.setattr(os, "replace", fail_commit)
    with pytest.raises(OSError, match="No space"):
        save_checkpoint(_Engine(b"new"), tmp_path, 3, {"seen": 2})
    ckpt = latest_checkpoint(tmp_path)
    assert ckpt == checkpoint_root(tmp_path) / "step-000003"
    assert (ckpt / "engine" / "w.pt").read_bytes() == b"old"
    assert checkpoint.read_state(ckpt) == {"step": 3, "seen": 1}


class _RankEngine:
    """One file per rank."""

    def __init__(self, rank: int):
        self.rank = rank

    def save_checkpoint(self, path, tag, save_latest):
        (Path(path) / f"{tag}-{self.rank}.pt").write_bytes(b"w")


def _save_where_one_rank_fails(rank, world, out, where):
    """Step 1 saves cleanly; step 2 fails on one rank ``where``: writing rank 1's RNG states,
    or in rank 0's commit. Returns (exception type, message) and the newest checkpoint's name."""
    save_checkpoint(_RankEngine(rank), out, 1, {})

    def full(*a):
        raise OSError(28, "No space left on device")

    if where == "commit" and rank == 0:
        os.replace = full
    if where == "rng" and rank == 1:
        checkpoint._rng_state = full
    try:
        save_checkpoint(_RankEngine(rank), out, 2, {})
    except Exception as e:
        got = (type(e).__name__, str(e))
    else:
        got = None
    return got, latest_checkpoint(out).name


@pytest.mark.multiproc
@pytest.mark.parametrize("where,bad", [("rng", 1), ("commit", 0)])
def test_a_save_failing_on_one_rank_stops_every_rank(tmp_path, where, bad):
    """No rank is left waiting at a barrier for one that failed: the failing rank raises its
    own error, the others OtherRankFailed naming it; the step-1 checkpoint stays the newest."""
    from rlhf_kernels.ring.spawn import run_gloo

    out = run_gloo(_save_where_one_rank_fails, 2, str(tmp_path), where, timeout_s=120)
    (mine, newest0), (theirs, newest1) = out if bad == 0 else out[::-1]
    assert mine == ("OSError", "[Errno 28] No space left on device")
    assert theirs[0] == "OtherRankFailed"
    assert f"step-000002 failed on rank {bad}: OSError: [Errno 28] No space" in theirs[1]
    assert newest0 == newest1 == "step-000001"


def test_an_interrupted_commit_puts_the_committed_folder_back(tmp_path, monkeypatch):
    """Ctrl-C between commit_folder's two renames (not an OSError) must not leave the only
    whole copy under ``.old-<name>``, where a user looking for ``model/`` would not find it."""
    final, tmp = tmp_path / "model", tmp_path / ".tmp-model"
    final.mkdir()
    (final / "w").write_text("old")
    tmp.mkdir()
    (tmp / "w").write_text("new")
    real = os.replace

    def interrupt(a, b):
        if Path(a) == tmp:
            raise KeyboardInterrupt
        real(a, b)

    monkeypatch.setattr(os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.commit_folder(tmp, final)
    assert (final / "w").read_text() == "old" and not (tmp_path / ".old-model").exists()


def test_next_save_removes_a_set_aside_copy_beside_its_step(tmp_path):
    """A crash after a re-save's commit, before its cleanup, leaves ``.old-step-N`` beside a
    committed ``step-N``: the next save deletes it (prune neither counts nor deletes it)."""
    root = checkpoint_root(tmp_path)
    _committed(root, "step-000002", ".old-step-000002")
    save_checkpoint(_Engine(), tmp_path, 4, {}, keep=3)
    assert sorted(p.name for p in root.iterdir()) == ["step-000002", "step-000004"]


def test_prune_renames_each_folder_before_deleting_it(tmp_path, monkeypatch):
    """A kill during the deletion must leave no half-deleted ``step-N`` (resume would take it);
    fewer checkpoints than ``keep``: none goes."""
    root = checkpoint_root(tmp_path)
    _committed(root, "step-000000", "step-000001", "step-000002", "step-000003")
    deleted, real = [], checkpoint.shutil.rmtree
    monkeypatch.setattr(
        checkpoint.shutil, "rmtree", lambda p, **k: (deleted.append(Path(p).name), real(p, **k))
    )
    assert prune_checkpoints(root, 5, root / "step-000003") == []
    gone = prune_checkpoints(root, 2, root / "step-000003")
    assert [p.name for p in gone] == ["step-000000", "step-000001"]
    assert deleted == [".del-step-000000", ".del-step-000001"]


# ----------------------------------------------------------------------------- load
def test_load_restores_every_rng_of_the_save(tmp_path):
    """The resumed run draws what the uninterrupted run drew after the save (python, numpy,
    torch); ``rng=False`` (PPO's critic) leaves this process's RNG alone."""
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    path = save_checkpoint(_Engine(), tmp_path, 2, {"seen": 5})
    want = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    engine = _Engine()
    assert load_checkpoint(engine, path) == {"step": 2, "seen": 5}
    assert engine.loaded == [(str(path), "engine")]
    assert _draws() == want
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    other = _draws()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert load_checkpoint(_Engine(), path, tag="critic", rng=False)["step"] == 2
    assert _draws() == other


@pytest.mark.parametrize(
    "load, text",
    [
        ((None, None), "DeepSpeed could not load 'engine' from .*; delete that checkpoint"),
        (KeyError("module"), r"\(KeyError: 'module'\): the folder is damaged"),
        (AssertionError("shape"), r"\(AssertionError: shape\)"),
        (OSError("gone"), r"\(OSError: gone\)"),
        (ValueError("bad"), r"\(ValueError: bad\)"),
    ],
)
def test_a_failed_engine_load_is_one_value_error(tmp_path, load, text):
    path = save_checkpoint(_Engine(), tmp_path, 2, {})
    with pytest.raises(ValueError, match=text) as e:
        load_checkpoint(_Engine(load=load), path)
    assert str(e.value).startswith("--resume: DeepSpeed could not load 'engine' from ")


def test_check_complete_reads_the_state(tmp_path):
    from trainers.checkpoint import check_complete

    path = save_checkpoint(_Engine(), tmp_path, 2, {})
    check_complete(path, ["engine"], 0)
    (path / "trainer_state.json").write_text('{"step": ')
    with pytest.raises(ValueError, match="trainer_state.json is unreadable"):
        check_complete(path, ["engine"], 0)


def test_load_without_this_ranks_rng_names_the_layout(tmp_path):
    path = save_checkpoint(_Engine(), tmp_path, 2, {})
    (path / "rng_rank0.pt").unlink()
    with pytest.raises(ValueError, match="no RNG state for rank 0: .*same torchrun layout"):
        load_checkpoint(_Engine(), path)
    assert load_checkpoint(_Engine(), path, rng=False) == {"step": 2}  # the critic needs none


# ----------------------------------------------------------------------------- session
def _session(tmp_path, cfg, total=5, critic=None):
    from trainers.distributed import Layout
    from trainers.logger import MetricsLogger

    layout = Layout(world=1, rank=0, dp=1, ring=1, tp=1, device=torch.device("cpu"))
    return SimpleNamespace(
        cfg=cfg,
        kind="sft",
        layout=layout,
        total=total,
        critic=critic,
        logger=MetricsLogger(str(tmp_path), kind="none", resume=True),
        _bar=SimpleNamespace(set_postfix=lambda d: None),
        _open_outputs=lambda: None,
    )


def test_end_step_saves_every_save_steps_what_a_resume_checks(tmp_path):
    """Steps that are multiples of --save-steps save (with the critic, under
    --save-total-limit); the state holds what resume compares, so this run passes its checks."""
    from trainers.checkpoint import check_data, check_layout, read_state
    from trainers.session import Session, checkpoint_data, checkpoint_layout
    from trainers.sft import SFTConfig

    cfg = SFTConfig(output_dir=str(tmp_path), save_steps=2, save_total_limit=2, seed=3)
    s = _session(tmp_path, cfg, total=7, critic=_Engine(b"critic"))
    saved = []
    for step in range(1, 8):
        Session.end_step(s, step, {"loss": 1.0}, _Engine())
        saved.append(latest_checkpoint(tmp_path))
    assert [p.name if p else None for p in saved] == [
        None, "step-000002", "step-000002", "step-000004", "step-000004", "step-000006",
        "step-000006",
    ]  # fmt: skip
    assert sorted(p.name for p in checkpoint_root(tmp_path).iterdir()) == [
        "step-000004",
        "step-000006",
    ]
    ckpt = saved[-1]
    assert (ckpt / "critic" / "w.pt").read_bytes() == b"critic"
    state = read_state(ckpt)
    assert state["step"] == 6 and state["total_steps"] == 7
    assert state["layout"] == checkpoint_layout(cfg, "sft", s.layout)
    assert state["data"]["seed"] == 3
    check_layout(ckpt, checkpoint_layout(cfg, "sft", s.layout))
    check_data(ckpt, checkpoint_data(cfg))
    with pytest.raises(ValueError, match="this run has --seed 4"):
        check_data(ckpt, checkpoint_data(SFTConfig(seed=4)))


def test_a_failed_checkpoint_save_is_one_line_and_keeps_the_earlier_ones(
    tmp_path, monkeypatch, capsys
):
    from trainers.session import Session
    from trainers.sft import SFTConfig

    cfg = SFTConfig(output_dir=str(tmp_path), save_steps=1)
    s = _session(tmp_path, cfg, total=3)
    Session.end_step(s, 1, {"loss": 1.0}, _Engine(b"one"))

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "commit_folder", full)
    with pytest.raises(SystemExit):
        Session.end_step(s, 2, {"loss": 1.0}, _Engine(b"two"))
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"error: step 2: saving the checkpoint failed ([Errno 28] No space left on device); "
        f"the earlier checkpoints in {tmp_path} are kept"
    ]
    assert (latest_checkpoint(tmp_path) / "engine" / "w.pt").read_bytes() == b"one"


def test_a_failed_model_export_is_one_line(tmp_path, monkeypatch, capsys):
    from trainers import engine
    from trainers.session import Session
    from trainers.sft import SFTConfig

    s = _session(tmp_path, SFTConfig(output_dir=str(tmp_path)))
    s._bar = SimpleNamespace(close=lambda: None)
    s.tokenizer = None
    monkeypatch.setattr(engine, "full_state_dict", lambda e, layout: {})

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(engine, "save_hf_model", full)
    with pytest.raises(SystemExit):
        Session.finish(s, None, None, "", plot=[])
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: saving the model to {tmp_path / 'model'} failed ([Errno 28] No space left on "
        f"device); an earlier export there is kept"
    ]
    assert s.logger._closed


def test_ppo_layout_records_whether_a_critic_is_saved():
    from trainers.distributed import Layout
    from trainers.ppo import PPOConfig
    from trainers.session import checkpoint_layout

    layout = Layout(world=2, rank=0, dp=2, ring=1, tp=1, device=torch.device("cpu"))
    assert checkpoint_layout(PPOConfig(advantage_estimator="gae"), "ppo", layout)["critic"]
    assert not checkpoint_layout(PPOConfig(), "ppo", layout)["critic"]
    assert "critic" not in checkpoint_layout(PPOConfig(), "sft", layout)


def test_progress_of_a_resumed_run_keeps_the_checkpoints_records(tmp_path):
    """Resumed at step 3: records 1-3 stay (the checkpoint's run logged them), 4+ go; the loop
    runs steps 4..total."""
    from trainers.logger import read_metrics
    from trainers.session import Session

    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": s}) + "\n" for s in range(1, 6))
    )
    s = _session(tmp_path, SimpleNamespace(), total=6)
    assert list(Session.progress(s, 3)) == [4, 5, 6]
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2, 3]


def _fake_build(monkeypatch, tmp_path, step, total, lr=1e-3):
    """Session.build with a real AdamW + schedule in a fake engine, resumed at ``step``."""
    from trainers import engine as engine_mod
    from trainers import session as session_mod
    from trainers.sft import SFTConfig

    cfg = SFTConfig(output_dir=str(tmp_path), resume=True, lr=lr, warmup_steps=2)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, engine_mod.lr_lambda(cfg, total))
    for _ in range(step):  # the checkpoint's scheduler state
        opt.step(), sched.step()
    fake = SimpleNamespace(lr_scheduler=sched, optimizer=opt)
    monkeypatch.setattr(engine_mod, "build_engine", lambda *a, **k: fake)
    monkeypatch.setattr(session_mod, "load_checkpoint", lambda e, p: {"step": step})
    save_checkpoint(_Engine(), tmp_path, step, {})
    s = _session(tmp_path, cfg, total=total)
    s.optimizer_steps, s.print = total, lambda m: None
    return session_mod.Session.build(s, torch.nn.Linear(1, 1)), cfg


def test_build_resumes_at_the_last_step_and_refuses_one_past_it(tmp_path, monkeypatch, capsys):
    (engine, start), _ = _fake_build(monkeypatch, tmp_path / "a", 4, 4)
    assert start == 4  # nothing left to train: the final model is still saved
    with pytest.raises(SystemExit):
        _fake_build(monkeypatch, tmp_path / "b", 5, 4)
    assert "is at step 5, past this run's 4 steps" in capsys.readouterr().err


def test_resumed_schedule_follows_this_runs_lr(tmp_path, monkeypatch):
    """--lr of the resumed run replaces the checkpoint's; the schedule keeps its step count."""
    from trainers.engine import lr_lambda

    (engine, start), cfg = _fake_build(monkeypatch, tmp_path, 3, 6, lr=2e-3)
    factor = lr_lambda(cfg, 6)
    group = engine.optimizer.param_groups[0]
    assert start == 3 and group["lr"] == pytest.approx(2e-3 * factor(3))
    assert engine.lr_scheduler.get_last_lr() == [group["lr"]]
    engine.optimizer.step(), engine.lr_scheduler.step()
    assert group["lr"] == pytest.approx(2e-3 * factor(4))


def test_eval_steps_and_the_last_step_evaluate():
    from trainers.session import Session

    s = SimpleNamespace(cfg=SimpleNamespace(eval_steps=0), total=5)
    assert [t for t in range(1, 6) if Session.is_eval_step(s, t)] == [5]
    s.cfg.eval_steps = 2
    assert [t for t in range(1, 6) if Session.is_eval_step(s, t)] == [2, 4, 5]


# ----------------------------------------------------------------------------- engine
def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    from trainers.engine import lr_lambda

    f = lr_lambda(SimpleNamespace(warmup_steps=2, lr_scheduler="cosine"), 6)
    assert [f(s) for s in (0, 1)] == [1 / 3, 2 / 3]
    assert f(2) == 1.0 and f(4) == pytest.approx(0.55) and f(6) == pytest.approx(0.1)
    assert f(99) == pytest.approx(0.1)
    c = lr_lambda(SimpleNamespace(warmup_steps=1, lr_scheduler="constant"), 6)
    assert [c(s) for s in (0, 1, 5)] == [0.5, 1.0, 1.0]


def test_resync_cpu_adam_replays_every_loaded_step():
    from trainers.engine import resync_cpu_adam

    calls = []
    ops = SimpleNamespace(adam_update=lambda opt_id, step, *a: calls.append(step))
    group = {"lr": 1.0, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    opt = SimpleNamespace(
        state={0: {"step": torch.tensor(3.0)}},
        param_groups=[{**group, "bias_correction": True}],
        ds_opt_adam=ops,
        opt_id=0,
    )
    resync_cpu_adam(SimpleNamespace(rk_cpu_adam=opt))
    assert calls == [1, 2, 3]
    resync_cpu_adam(SimpleNamespace(rk_cpu_adam=None))  # no offload: nothing to do


def test_model_export_whose_commit_fails_keeps_the_earlier_export(tmp_path, monkeypatch):
    from trainers.engine import save_hf_model

    class Model:
        config = SimpleNamespace()

        def save_pretrained(self, path, state_dict, safe_serialization):
            Path(path).mkdir()
            (Path(path) / "w").write_text(json.dumps(sorted(state_dict)))

    tok = SimpleNamespace(save_pretrained=lambda p: (Path(p) / "tok").write_text("t"))
    out = save_hf_model(Model(), tok, {"m.a": 1, "x.b": 2}, tmp_path / "model", "m.", {"k": 1})
    assert json.loads((out / "w").read_text()) == ["a"]
    real = os.replace

    def fail_commit(a, b):
        if ".tmp-" in str(a):
            raise OSError(28, "No space left on device")
        real(a, b)

    monkeypatch.setattr(os, "replace", fail_commit)
    with pytest.raises(OSError, match="No space"):
        save_hf_model(Model(), tok, {"m.c": 1}, tmp_path / "model", "m.")
    assert json.loads((out / "w").read_text()) == ["a"]


# ----------------------------------------------------------------------------- logger
def test_logger_refuses_a_log_after_close(tmp_path):
    from trainers.logger import MetricsLogger

    lg = MetricsLogger(str(tmp_path), kind="none")
    lg.log({"loss": 1.0}, 1)
    lg.close()
    with pytest.raises(RuntimeError, match="after close"):
        lg.log({"loss": 1.0}, 2)


def test_start_at_opens_once(tmp_path):
    """A second start_at (or one after a log) must not truncate what the run has logged."""
    from trainers.logger import MetricsLogger, read_metrics

    lg = MetricsLogger(str(tmp_path), kind="none", resume=True)
    lg.start_at(1)
    lg.log({"loss": 1.0}, 1)
    lg.log({"loss": 2.0}, 2)
    lg.start_at(2)
    lg.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]


def test_plot_orders_by_step_and_skips_nulls(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    from trainers.logger import plot_metrics

    drawn, real = [], Axes.plot
    monkeypatch.setattr(
        Axes,
        "plot",
        lambda ax, xs, ys, **k: (drawn.append((list(xs), list(ys))), real(ax, xs, ys, **k)),
    )
    records = [{"step": 3, "loss": 0.5}, {"step": 1, "loss": 1.0}, {"step": 2, "loss": None}]
    assert plot_metrics(records, [("loss",)], str(tmp_path), "") is not None
    assert drawn == [([1, 3], [1.0, 0.5])]
    assert not math.isnan(drawn[0][1][0])


def test_a_resumed_logger_that_never_logged_plots_nothing(tmp_path):
    from trainers.logger import MetricsLogger

    assert MetricsLogger(str(tmp_path), kind="none", resume=True).close([("loss",)]) is None
    assert not (tmp_path / "metrics.jsonl").exists()


def test_read_metrics_names_the_files_own_line_number(tmp_path):
    """Blank lines count: the error names the line an editor shows."""
    from trainers.logger import read_metrics

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n\n[1]\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: expected a JSON object, got '\[1\]'"):
        read_metrics(str(tmp_path))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"st\n\n')  # cut, then a blank line
    assert read_metrics(str(tmp_path)) == [{"step": 1}]
