"""Mutation-audit pins for the trainers' I/O parts: ``trainers.logger`` (metrics.jsonl, TensorBoard,
wandb, the plot), ``trainers.engine`` (DeepSpeed config, lr schedule, frozen models, export),
``trainers.warm_start`` (the cached warm start and its prompts) and ``trainers.rollout``
(generation flags, batching, seeding, padding).

Each test kills a mutant that the earlier tests let through: step 0 and multi-element arrays in
the logger, the atomic truncation of a resumed ``metrics.jsonl``, infinities reaching
TensorBoard, the context manager closing, wandb's offline default, the plot's two-column layout;
the schedule's edges and the export's prefix/config handling; the warm start's lock re-check,
default prompt content and subprocess environment; and the generation engine's flags, batch
slicing, prompt-major order, left padding and RNG handling (with a stub model, no weights).
All run in-process in well under a second each.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_sft_rm_contract import _fake_sft

from trainers.logger import MetricsLogger, plot_metrics, read_metrics


# ----------------------------------------------------------------------------- logger
def test_step_zero_is_a_step_count(tmp_path):
    """``step`` is an integer >= 0: a log at step 0 (before the first update) is recorded."""
    with MetricsLogger(str(tmp_path), kind="none") as lg:
        lg.log({"loss": 2.0}, 0)
        lg.log({"loss": 1.0}, 1)
    assert read_metrics(str(tmp_path)) == [{"step": 0, "loss": 2.0}, {"step": 1, "loss": 1.0}]


def test_a_multi_element_array_is_a_type_error_naming_the_metric(tmp_path):
    """numpy's ``.item()`` of a 2-element array raises ValueError (torch: RuntimeError); both
    are the metric's TypeError, and nothing is written."""
    lg = MetricsLogger(str(tmp_path), kind="none")
    for bad in (np.array([1.0, 2.0]), torch.tensor([1.0, 2.0])):
        with pytest.raises(TypeError, match="metric 'loss': expected a number"):
            lg.log({"loss": bad}, 1)
    lg.close()
    assert read_metrics(str(tmp_path)) == []


def test_resume_drops_a_record_without_a_step(tmp_path):
    """Only records whose step is below the first step logged now are kept."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 1.0}\n{"loss": 9.0}\n{"step": 2, "loss": 0.5}\n'
    )
    with MetricsLogger(str(tmp_path), kind="none", resume=True) as lg:
        lg.log({"loss": 0.4}, 3)
    assert read_metrics(str(tmp_path)) == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 0.5},
        {"step": 3, "loss": 0.4},
    ]


def test_resume_truncation_is_atomic(tmp_path, monkeypatch):
    """The resumed file is rewritten beside ``metrics.jsonl`` and renamed over it: a crash before
    the rename leaves the earlier run's records whole."""
    lines = "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 6))
    (tmp_path / "metrics.jsonl").write_text(lines)
    import trainers.logger as logger_mod

    def crash(src, dst):
        raise OSError("crash before the rename")

    monkeypatch.setattr(logger_mod.os, "replace", crash)
    lg = MetricsLogger(str(tmp_path), kind="none", resume=True)
    with pytest.raises(OSError, match="crash before the rename"):
        lg.log({"loss": 0.1}, 3)
    assert (tmp_path / "metrics.jsonl").read_text() == lines


def test_fresh_run_empties_the_file_before_the_first_log(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with MetricsLogger(str(tmp_path), kind="none") as lg:
        assert read_metrics(str(tmp_path)) == []
        lg.log({"loss": 0.5}, 1)
    assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 0.5}]


def test_tensorboard_gets_the_infinite_values_jsonl_nulls(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(str(tmp_path), kind="tensorboard") as lg:
        lg.log({"grad_norm": math.inf, "loss": 1.0}, 1)
    assert read_metrics(str(tmp_path)) == [{"step": 1, "grad_norm": None, "loss": 1.0}]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.value for e in acc.Scalars("grad_norm")] == [math.inf]


def test_the_context_manager_closes_every_sink(tmp_path, monkeypatch):
    done = []
    run = SimpleNamespace(log=lambda values, step: None, finish=lambda: done.append(1))
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=lambda **kw: run))
    with MetricsLogger(str(tmp_path), kind="wandb") as lg:
        lg.log({"loss": 1.0}, 1)
    assert done == [1] and lg._file.closed
    with pytest.raises(RuntimeError, match="after close"):
        lg.log({"loss": 1.0}, 2)


def test_wandb_is_offline_in_the_output_folder_unless_wandb_mode_says_otherwise(
    tmp_path, monkeypatch
):
    inits, sent = [], []
    run = SimpleNamespace(log=lambda values, step: sent.append((step, values)), finish=lambda: None)
    monkeypatch.setitem(
        sys.modules, "wandb", SimpleNamespace(init=lambda **kw: inits.append(kw) or run)
    )
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with MetricsLogger(str(tmp_path / "a"), kind="wandb", run_name="r", config={"lr": 1}) as lg:
        lg.log({"grad_norm": math.inf, "loss": np.float32(0.5)}, 1)
    assert sent == [(1, {"grad_norm": math.inf, "loss": 0.5})]  # the float, not jsonl's null
    monkeypatch.setenv("WANDB_MODE", "online")
    MetricsLogger(str(tmp_path / "b"), kind="wandb").close()
    a, b = inits
    assert (a["mode"], a["dir"], a["name"], a["config"]) == (
        "offline",
        str(tmp_path / "a"),
        "r",
        {"lr": 1},
    )
    assert a["project"] == "rlhf-kernels" and "resume" not in a
    assert a["id"] == (tmp_path / "a" / "wandb" / "run_id").read_text()
    assert b["mode"] == "online"


def test_a_boolean_tensor_is_no_step_count(tmp_path):
    """Bug: ``True`` was refused as a step but ``torch.tensor(True)`` was logged as step 1
    (``operator.index`` takes a bool tensor as an int)."""
    lg = MetricsLogger(str(tmp_path), kind="none")
    for bad in (torch.tensor(True), np.array(False)):
        with pytest.raises(ValueError, match=r"step: expected an integer >= 0, got"):
            lg.log({"loss": 1.0}, bad)
    lg.log({"loss": 1.0}, torch.tensor(2, dtype=torch.uint8))
    lg.close()
    assert read_metrics(str(tmp_path)) == [{"step": 2, "loss": 1.0}]


def test_plot_skips_a_record_without_a_step(tmp_path):
    """Bug: a record without "step" (hand-edited or foreign ``metrics.jsonl``; ``read_metrics``
    and a resume accept it) was sorted as step 0, then plotting it raised KeyError 'step'."""
    records = [{"step": 2, "loss": 0.5}, {"loss": 9.0}, {"step": 1, "loss": 1.0}]
    assert plot_metrics(records, [("loss",)], str(tmp_path), "") == str(tmp_path / "metrics.png")
    assert plot_metrics([{"loss": 9.0}], [("loss",)], str(tmp_path / "none"), "") is None


def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as fh:
        head = fh.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", head[16:24])


def test_plot_lays_the_groups_out_in_two_columns(tmp_path):
    """3 groups: 2 columns x 2 rows of 6.4 x 3.8 inches at 120 dpi; 1 group: one panel."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    records = [{"step": s, "loss": 1.0 / s, "lr": 0.1, "kl": 0.01 * s} for s in range(1, 4)]
    path = plot_metrics(records, [("loss",), ("lr",), ("kl",)], str(tmp_path / "a"), "t")
    assert _png_size(path) == (1536, 912)
    path = plot_metrics(records, [("loss", "kl")], str(tmp_path / "b"), "")
    assert _png_size(path) == (768, 456)


def test_plot_has_the_title_and_one_labelled_panel_per_group(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    titles = []
    real = Figure.suptitle
    monkeypatch.setattr(
        Figure, "suptitle", lambda fig, t, **k: (titles.append(t), real(fig, t, **k))[1]
    )
    records = [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}]
    assert plot_metrics(records, [("loss",)], str(tmp_path), "SFT run") is not None
    plot_metrics(records, [("loss",)], str(tmp_path), "")
    assert titles == ["SFT run"]


# ----------------------------------------------------------------------------- warm start
def test_warm_start_marker_records_the_recipe_and_the_folder_is_shared(tmp_path, monkeypatch):
    from trainers import warm_start

    calls = []
    monkeypatch.setattr(warm_start.subprocess, "run", _fake_sft(calls))
    old = os.umask(0o022)
    try:
        dst = warm_start.ensure_warm_start(tmp_path / "w", steps=5, quiet=True)
    finally:
        os.umask(old)
    ((cmd, _),) = calls
    args = cmd[3:]
    assert args[args.index("--seed") + 1] == str(warm_start.SFT_SEED) == "1"
    assert args[args.index("--logger") + 1] == "none"
    marker = json.loads((Path(dst) / warm_start.MARKER).read_text())
    assert marker["version"] == warm_start.WARM_VERSION
    assert marker["sft_args"] == warm_start.sft_args("x", 5)[2:] == args[2:]
    assert (
        marker["sft_args"][:2] == ["--max-steps", "5"] and "--output-dir" not in marker["sft_args"]
    )
    assert (marker["final_loss"], marker["input_template"]) == (1.5, warm_start.TEMPLATE)
    assert os.stat(dst).st_mode & 0o777 == 0o755  # mkdtemp's 0700 opened up for the cache


def test_warm_start_built_by_another_process_while_waiting_is_used(tmp_path, monkeypatch):
    """The folder is checked again once the lock is held: a concurrent caller (another torchrun
    rank) that waited for the builder uses its folder, neither rebuilds nor refuses it."""
    from trainers import tiny, warm_start

    dst = tmp_path / "w"

    class BuiltWhileWaiting:
        def __init__(self, path, timeout_s):
            pass

        def __enter__(self):
            dst.mkdir()
            for f in warm_start.REQUIRED_FILES:
                (dst / f).write_text("{}")

        def __exit__(self, *exc):
            pass

    assert "model.safetensors" in warm_start.REQUIRED_FILES and tiny.REQUIRED_FILES
    monkeypatch.setattr(warm_start, "_FileLock", BuiltWhileWaiting)
    monkeypatch.setattr(warm_start.subprocess, "run", lambda *a, **k: pytest.fail("rebuilt"))
    assert warm_start.ensure_warm_start(dst, quiet=True) == str(dst)


def test_warm_start_path_expands_the_home_folder(tmp_path, monkeypatch):
    from trainers import warm_start

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)  # an unexpanded "~" would land in tmp_path/~, not the repo
    monkeypatch.setattr(warm_start.subprocess, "run", _fake_sft([]))
    home = tmp_path / "home"
    assert warm_start.ensure_warm_start("~/w", steps=2, quiet=True) == str(home / "w")
    assert warm_start.is_complete(home / "w") and not (tmp_path / "~").exists()


def test_default_prompts_are_first_letters_of_3_to_8_letter_words(tmp_path, monkeypatch):
    import re

    from trainers import warm_start

    monkeypatch.setenv("RLHF_KERNELS_TINY", str(tmp_path / "tiny-v1"))
    path = warm_start.first_letter_prompts()
    rows = [json.loads(x) for x in open(path)]
    words = [re.fullmatch(r"first letter: ([a-z]{3,8})", r["prompt"]).group(1) for r in rows]
    assert [r["target"] for r in rows] == [w[0] for w in words]
    assert {len(w) for w in words} == set(range(3, 9))
    assert sorted(rows[0]) == ["prompt", "target"]
    ref = warm_start.write_prompts(tmp_path / "ref.jsonl", n=1000, seed=123)
    assert open(path).read() == ref.read_text()
    other = warm_start.write_prompts(tmp_path / "other.jsonl", n=1000, seed=124)
    assert other.read_text() != ref.read_text()


# ----------------------------------------------------------------------------- engine
def _engine_cfg(**kw):
    base = dict(
        zero_stage=0, dtype="fp32", offload=False, max_grad_norm=1.0, lr=1e-3, weight_decay=0.1,
        warmup_steps=2, lr_scheduler="cosine", ref_zero_stage=0, ref_offload=False,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def _fake_initialize(monkeypatch, hook=None):
    """``deepspeed.initialize`` that records its arguments and returns a bare engine."""
    import deepspeed

    seen = {}

    def initialize(model, config, optimizer=None, lr_scheduler=None):
        seen.update(model=model, config=config, optimizer=optimizer, lr_scheduler=lr_scheduler)
        eng = SimpleNamespace(
            module=model, optimizer=optimizer, first_dataloader_check=hook, eval=lambda: None
        )
        return eng, optimizer, None, lr_scheduler

    monkeypatch.setattr(deepspeed, "initialize", initialize)
    return seen


def test_build_engine_wires_adamw_the_schedule_and_the_config(monkeypatch):
    pytest.importorskip("deepspeed")
    from trainers.distributed import Layout
    from trainers.engine import build_engine, ds_config, lr_lambda

    seen = _fake_initialize(monkeypatch)
    cpu = torch.device("cpu")
    lin = torch.nn.Linear(2, 2)
    lin.bias.requires_grad_(False)
    cfg, lay = _engine_cfg(), Layout(1, 0, 1, 1, 1, cpu)
    eng = build_engine(lin, cfg, lay, total_steps=6)
    opt = seen["optimizer"]
    assert isinstance(opt, torch.optim.AdamW) and seen["config"] == ds_config(cfg, lay)
    (group,) = opt.param_groups
    assert group["params"] == [lin.weight]  # frozen parameters are not optimised
    assert group["weight_decay"] == 0.1 and group["initial_lr"] == 1e-3
    f = lr_lambda(cfg, 6)
    assert group["lr"] == pytest.approx(1e-3 * f(0)) and f(0) == pytest.approx(1 / 3)
    assert seen["lr_scheduler"].lr_lambdas[0](4) == pytest.approx(f(4))
    assert eng.rk_cpu_adam is None and eng.rk_max_grad_norm is None
    build_engine(torch.nn.Linear(2, 2), cfg, lay, total_steps=6, lr=5e-4)  # the critic's lr
    assert seen["optimizer"].param_groups[0]["initial_lr"] == 5e-4
    tp2 = Layout(2, 0, 1, 1, 2, cpu)
    eng = build_engine(torch.nn.Linear(2, 2), _engine_cfg(dtype="bf16", max_grad_norm=0.7), tp2, 6)
    assert eng.rk_max_grad_norm == 0.7 and seen["config"]["gradient_clipping"] == 0.0


def test_build_engine_drops_autotps_first_forward_check_only_when_asked(monkeypatch):
    pytest.importorskip("deepspeed")
    from trainers.distributed import Layout
    from trainers.engine import build_engine

    removed = []
    hook = SimpleNamespace(remove=lambda: removed.append(1))
    _fake_initialize(monkeypatch, hook)
    lay = Layout(1, 0, 1, 1, 1, torch.device("cpu"))
    eng = build_engine(torch.nn.Linear(2, 2), _engine_cfg(), lay, 4)
    assert eng.first_dataloader_check is hook and removed == []
    eng = build_engine(torch.nn.Linear(2, 2), _engine_cfg(), lay, 4, check_tp_inputs=False)
    assert eng.first_dataloader_check is None and removed == [1]


def test_undo_init_step_clears_the_state_and_copies_the_weights_to_the_masters():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    from trainers.engine import _undo_init_step

    low = torch.nn.Parameter(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    master = torch.tensor([1.4, -1.9])  # one weight-decayed zero-gradient step away
    inner = torch.optim.AdamW([master.requires_grad_()], lr=0.1)
    inner.state[master] = {"step": torch.tensor(1.0)}
    opt = FP16_UnfusedOptimizer.__new__(FP16_UnfusedOptimizer)
    opt.optimizer, opt.fp16_groups, opt.fp32_groups = inner, [[low]], [[master]]
    _undo_init_step(SimpleNamespace(optimizer=opt))
    assert len(inner.state) == 0 and master.tolist() == [1.5, -2.0]


def test_frozen_model_is_eval_no_grad_and_zero3_keeps_its_own_dtype(monkeypatch):
    pytest.importorskip("deepspeed")
    from trainers.distributed import Layout
    from trainers.engine import build_frozen

    lay = Layout(1, 0, 1, 1, 1, torch.device("cpu"))
    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)).train()
    out = build_frozen(m, _engine_cfg(), lay)
    assert out is m and not m.training and not any(p.requires_grad for p in m.parameters())
    seen = _fake_initialize(monkeypatch)
    cfg = _engine_cfg(dtype="bf16", ref_zero_stage=3, ref_offload=True)
    fp32 = torch.nn.Linear(2, 2).train()
    assert build_frozen(fp32, cfg, lay) is fp32 and not fp32.training
    zero = seen["config"]["zero_optimization"]
    assert zero == {"stage": 3, "offload_param": {"device": "cpu"}}
    assert seen["config"]["bf16"] == {"enabled": False} and seen["optimizer"] is None
    build_frozen(torch.nn.Linear(2, 2).to(torch.bfloat16), _engine_cfg(ref_zero_stage=3), lay)
    assert seen["config"]["bf16"] == {"enabled": True}
    assert seen["config"]["zero_optimization"] == {"stage": 3}


def test_model_export_sets_the_extra_config_saves_the_tokenizer_and_clears_a_stale_tmp(tmp_path):
    from trainers.engine import save_hf_model

    class Model:
        config = SimpleNamespace()

        def save_pretrained(self, path, state_dict, safe_serialization):
            Path(path).mkdir()
            (Path(path) / "w").write_text(json.dumps(sorted(state_dict)))
            (Path(path) / "config").write_text(json.dumps(vars(self.config)))

    stale = tmp_path / ".tmp-model"
    stale.mkdir()
    (stale / "junk").write_text("x")
    tok = SimpleNamespace(save_pretrained=lambda p: (Path(p) / "tok").write_text("t"))
    out = save_hf_model(
        Model(), tok, {"lm.a": 1, "lm.b.c": 2, "v.d": 3}, tmp_path / "model", "lm.", {"score": 2}
    )
    assert sorted(p.name for p in out.iterdir()) == ["config", "tok", "w"]
    assert json.loads((out / "w").read_text()) == ["a", "b.c"]
    assert json.loads((out / "config").read_text()) == {"score": 2}
    assert not stale.exists()


# ----------------------------------------------------------------------------- rollout
class _StubLM(torch.nn.Module):
    """``generate`` stand-in: records each call's keyword arguments and mode, and answers every
    row with ``[row's last prompt id + 100, random id, *tail]`` after the prompt columns."""

    def __init__(self, tail=(), gen_eos=None):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = SimpleNamespace(eos_token_id=gen_eos)
        self.calls, self.tail = [], list(tail)

    def generate(self, input_ids, attention_mask, **kw):
        self.calls.append(dict(ids=input_ids, mask=attention_mask, training=self.training, **kw))
        b = input_ids.shape[0]
        first = input_ids[:, -1:] + 100
        rand = torch.randint(200, 300, (b, 1))
        tail = torch.tensor([self.tail] * b, dtype=torch.long).reshape(b, len(self.tail))
        return torch.cat([input_ids, first, rand, tail], dim=1)


def _tok(eos=2, pad=None):
    return SimpleNamespace(eos_token_id=eos, pad_token_id=pad)


def test_generation_flags_sample_from_the_plain_softmax(monkeypatch):
    from trainers.rollout import HFGenerationEngine

    lm = _StubLM()
    eng = HFGenerationEngine(lm, _tok(eos=2, pad=0), batch_size=8)
    eng.generate([[5, 6]], n_samples=1, max_new_tokens=7, temperature=0.7, top_p=0.9, seed=1)
    kw = lm.calls[-1]
    assert (kw["do_sample"], kw["temperature"], kw["top_p"]) == (True, 0.7, 0.9)
    assert (kw["top_k"], kw["min_length"], kw["num_beams"]) == (0, 0, 1)
    assert kw["repetition_penalty"] is None and kw["no_repeat_ngram_size"] is None
    assert kw["max_new_tokens"] == 7 and kw["use_cache"] is True
    assert kw["cache_implementation"] == "dynamic" and kw["synced_gpus"] is False
    assert kw["pad_token_id"] == 0 and kw["eos_token_id"] == [2]
    assert kw["suppress_tokens"] == [0]  # pad is no stop id: never sampled
    eng.generate([[5, 6]], n_samples=1, max_new_tokens=3, greedy=True, temperature=0.0)
    kw = lm.calls[-1]
    assert kw["do_sample"] is False and kw["temperature"] is kw["top_p"] is kw["top_k"] is None
    eos_pad = HFGenerationEngine(lm, _tok(eos=2, pad=None))  # pad = EOS, a stop id
    eos_pad.generate([[5]], n_samples=1, max_new_tokens=2)
    assert lm.calls[-1]["suppress_tokens"] is None and lm.calls[-1]["pad_token_id"] == 2


def test_zero3_engine_is_synced_only_in_a_world_of_several(monkeypatch):
    from trainers import rollout

    monkeypatch.setattr(rollout.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(rollout.dist, "get_world_size", lambda: 1)
    assert not rollout.HFGenerationEngine(_StubLM(), _tok(), zero3=True).synced
    monkeypatch.setattr(rollout.dist, "get_world_size", lambda: 2)
    assert rollout.HFGenerationEngine(_StubLM(), _tok(), zero3=True).synced
    assert not rollout.HFGenerationEngine(_StubLM(), _tok(), zero3=False).synced


def test_batches_are_left_padded_prompt_major_slices_of_batch_size():
    from trainers.rollout import HFGenerationEngine

    lm = _StubLM()
    eng = HFGenerationEngine(lm, _tok(eos=2, pad=0), batch_size=2)
    out = eng.generate([[7], [3, 4, 5]], n_samples=3, max_new_tokens=2)
    assert [r[0] for r in out] == [107, 107, 107, 105, 105, 105]  # prompt-major
    assert [c["ids"].shape[0] for c in lm.calls] == [2, 2, 2]
    ids, mask = lm.calls[1]["ids"], lm.calls[1]["mask"]  # prompt 0's last sample, prompt 1's first
    assert ids.tolist() == [[0, 0, 7], [3, 4, 5]] and mask.tolist() == [[0, 0, 1], [1, 1, 1]]
    assert all(len(r) == 2 for r in out)


def test_generation_runs_in_eval_mode_and_restores_the_mode():
    from trainers.rollout import HFGenerationEngine

    lm = _StubLM().train()
    HFGenerationEngine(lm, _tok()).generate([[5]], n_samples=1, max_new_tokens=1)
    assert lm.calls[-1]["training"] is False and lm.training
    lm.eval()
    HFGenerationEngine(lm, _tok()).generate([[5]], n_samples=1, max_new_tokens=1)
    assert not lm.training


def test_seed_fixes_the_samples_and_leaves_the_callers_rng_alone():
    from trainers.rollout import HFGenerationEngine

    eng = HFGenerationEngine(_StubLM(), _tok(), batch_size=3)
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    a = eng.generate([[5], [6]], n_samples=4, max_new_tokens=2, seed=3)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(99)
    assert eng.generate([[5], [6]], n_samples=4, max_new_tokens=2, seed=3) == a
    b = eng.generate([[5], [6]], n_samples=4, max_new_tokens=2, seed=4)
    assert [r[1] for r in a] != [r[1] for r in b]


def test_model_stop_ids_follow_the_tokenizers_eos_and_end_responses():
    from trainers.rollout import HFGenerationEngine

    lm = _StubLM(tail=[9, 11, 2], gen_eos=[9, 2])
    eng = HFGenerationEngine(lm, _tok(eos=2, pad=0))
    assert eng.stop_ids == [2, 9]
    assert HFGenerationEngine(_StubLM(gen_eos=4), _tok(eos=2)).stop_ids == [2, 4]
    out = eng.generate([[5]], n_samples=1, max_new_tokens=5)
    assert lm.calls[-1]["eos_token_id"] == [2, 9]
    assert out[0][0] == 105 and out[0][2:] == [9]  # cut after the model's own end id


def test_cut_and_split_use_every_stop_id_and_keep_the_first():
    from trainers.rollout import cut_at_eos, split_responses

    assert cut_at_eos([5, 3, 7, 3], [7, 3]) == [5, 3]
    assert cut_at_eos([5, 7], 7) == [5, 7] and cut_at_eos([5, 6], [7]) == [5, 6]
    seqs = torch.tensor([[1, 5, 3, 0], [1, 6, 0, 0], [1, 0, 6, 0]])
    assert split_responses(seqs, 1, [7, 3], 0) == [[5, 3], [6], [0, 6]]
    assert split_responses(seqs, 4, 3, 0) == [[], [], []]  # no generated column
    with pytest.raises(ValueError, match="prompt_width"):
        split_responses(seqs, 5, 3, 0)


@pytest.mark.parametrize(
    "kw, ok",
    [
        (dict(prompts=[[0, 1]]), True),  # id 0 is an id
        (dict(prompts=[[-1]]), False),
        (dict(prompts=[]), False),
        (dict(prompts=[[]]), False),
        (dict(seed=1.5), False),
        (dict(n_samples=True), False),
        (dict(max_new_tokens=0), False),
        (dict(top_p=1.0), True),
        (dict(top_p=0.0), False),
        (dict(temperature=-1.0), False),
        (dict(temperature=0.0), False),
        (dict(temperature=0.0, greedy=True), True),
    ],
)
def test_generate_argument_edges(kw, ok):
    from trainers.rollout import HFGenerationEngine

    eng = HFGenerationEngine(_StubLM(), _tok())
    args = {"n_samples": 1, "max_new_tokens": 2, **kw}
    prompts = args.pop("prompts", [[5]])
    if ok:
        assert len(eng.generate(prompts, **args)) == len(prompts)
    else:
        with pytest.raises(ValueError, match="generate: "):
            eng.generate(prompts, **args)


def test_engine_needs_an_eos_and_a_positive_int_batch_size():
    from trainers.rollout import HFGenerationEngine

    with pytest.raises(ValueError, match="eos_token_id"):
        HFGenerationEngine(_StubLM(), _tok(eos=None))
    for bad in (True, 0, 2.0):
        with pytest.raises(ValueError, match="batch_size"):
            HFGenerationEngine(_StubLM(), _tok(), batch_size=bad)


def test_zero0_gradients_at_exactly_the_max_norm_are_not_scaled():
    pytest.importorskip("deepspeed")
    from trainers.distributed import Layout
    from trainers.engine import optimizer_step

    lin = torch.nn.Linear(1, 1, bias=False)
    lin.weight.grad = torch.ones(1, 1)
    steps = []
    eng = SimpleNamespace(
        module=lin,
        optimizer=SimpleNamespace(loss_scale_config=None),
        rk_max_grad_norm=1.0,
        zero_optimization_stage=lambda: 0,
        step=lambda: steps.append(1),
    )
    assert optimizer_step(eng, Layout(1, 0, 1, 1, 1, torch.device("cpu"))) == 1.0
    assert lin.weight.grad.item() == 1.0 and steps == [1]
