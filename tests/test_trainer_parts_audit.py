"""Unit contract of the trainers' building blocks that the end-to-end runs cover only slowly:
the DeepSpeed config, the ZeRO-0 gradient norm and clipping, the checkpointing scope, the full
state dict, Falcon-H1's logit scale, the warm start's cached prompts, lock and argument checks,
the logger's step checks and resumed TensorBoard, the world of one and the prebuilt-ops env."""

from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("deepspeed")

from trainers import engine as E  # noqa: E402
from trainers import tiny, warm_start  # noqa: E402
from trainers.distributed import Layout  # noqa: E402

CPU = torch.device("cpu")


def _cfg(**kw):
    base = dict(zero_stage=0, dtype="fp32", offload=False, max_grad_norm=1.0)
    return SimpleNamespace(**{**base, **kw})


# ----------------------------------------------------------------------------- ds_config
def test_ds_config_follows_the_run_config():
    lay = Layout(8, 0, 2, 2, 2, CPU)
    c = E.ds_config(_cfg(zero_stage=2, offload=True, max_grad_norm=0.5, dtype="bf16"), lay)
    assert c["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}
    assert c["train_batch_size"] == 8 and c["train_micro_batch_size_per_gpu"] == 1
    assert c["gradient_accumulation_steps"] == 1 and c["gradient_clipping"] == 0.5
    assert c["bf16"] == {"enabled": True} and c["tensor_parallel"] == {"autotp_size": 2}
    c = E.ds_config(_cfg(max_grad_norm=2.0), Layout(3, 0, 3, 1, 1, CPU))
    assert c["zero_optimization"] == {"stage": 0} and c["train_batch_size"] == 3
    assert c["bf16"] == {"enabled": False} and "tensor_parallel" not in c
    assert c["gradient_clipping"] == 2.0


def test_trainer_clips_itself_only_for_bf16_zero0_with_autotp():
    tp2, tp1 = Layout(2, 0, 1, 1, 2, CPU), Layout(2, 0, 2, 1, 1, CPU)
    assert E.clips_itself(_cfg(dtype="bf16"), tp2)
    assert E.ds_config(_cfg(dtype="bf16", max_grad_norm=3.0), tp2)["gradient_clipping"] == 0.0
    for cfg, lay in [
        (_cfg(dtype="bf16"), tp1),
        (_cfg(dtype="fp32"), tp2),
        (_cfg(dtype="bf16", zero_stage=1), tp2),
    ]:
        assert not E.clips_itself(cfg, lay)
        assert E.ds_config(cfg, lay)["gradient_clipping"] == 1.0


def test_lr_schedule_with_warmup_as_long_as_the_run():
    """No decay phase left (--warmup-steps == the run's steps): the factor the scheduler asks
    for after the last step is the peak, not a division by zero."""
    f = E.lr_lambda(SimpleNamespace(warmup_steps=3, lr_scheduler="cosine"), 3)
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


# ----------------------------------------------------------------------------- ZeRO-0 steps
class _Engine:
    """The engine surface of ``accumulate`` / ``optimizer_step`` (ZeRO stage ``stage``)."""

    def __init__(self, grads, stage=0, scale=None, max_norm=None, ds_norm=None):
        self.module = torch.nn.Module()
        for i, g in enumerate(grads):
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g.clone()
            self.module.register_parameter(f"p{i}", p)
        self.stage, self.steps, self.ds_norm, self.calls = stage, 0, ds_norm, []
        cfg = None if scale is None else SimpleNamespace(cur_scale=scale)
        self.optimizer = SimpleNamespace(loss_scale_config=cfg)
        self.rk_max_grad_norm = max_norm

    def zero_optimization_stage(self):
        return self.stage

    def step(self):
        self.steps += 1

    def get_global_grad_norm(self):
        return self.ds_norm

    def set_gradient_accumulation_boundary(self, last):
        self.calls.append(("boundary", last))

    def backward(self, loss, scale_wrt_gas=True):
        self.calls.append(("backward", loss.item(), scale_wrt_gas))

    def grads(self):
        return [p.grad for p in self.module.parameters()]


ONE = Layout(1, 0, 1, 1, 1, CPU)


def test_zero0_norm_is_the_global_norm_before_clipping_without_the_loss_scale():
    eng = _Engine([torch.tensor([3.0]), torch.tensor([0.0, 4.0])])
    assert E.optimizer_step(eng, ONE) == pytest.approx(5.0) and eng.steps == 1
    assert [g.tolist() for g in eng.grads()] == [[3.0], [0.0, 4.0]]  # DeepSpeed clips: untouched
    eng = _Engine([torch.tensor([6.0]), torch.tensor([8.0])], scale=2.0)
    assert E.optimizer_step(eng, ONE) == pytest.approx(5.0)  # gradients carry the scale 2


def test_zero0_self_clipping_scales_every_gradient_to_the_max_norm():
    eng = _Engine([torch.tensor([3.0]), torch.tensor([0.0, 4.0])], max_norm=1.0)
    assert E.optimizer_step(eng, ONE) == pytest.approx(5.0)  # the norm before clipping
    got = math.sqrt(sum(float(g.pow(2).sum()) for g in eng.grads()))
    assert got == pytest.approx(1.0, rel=1e-5) and eng.grads()[0].item() == pytest.approx(0.6)
    eng = _Engine([torch.tensor([0.3]), torch.tensor([0.4])], max_norm=1.0)
    assert E.optimizer_step(eng, ONE) == pytest.approx(0.5)  # below the max: left alone
    assert [g.item() for g in eng.grads()] == pytest.approx([0.3, 0.4])


def test_zero0_norm_counts_tp_shards_on_every_rank_and_replicas_once(monkeypatch):
    """TP rank 1 adds only its shards (marked ``tensor_model_parallel``); the replicated weights
    are counted by TP rank 0; the squares are summed over the tensor-parallel group."""
    from deepspeed.utils import groups

    reduced = []

    def all_reduce(t, op=None, group=None):
        reduced.append((t.item(), group))
        t.add_(100.0)  # the other TP rank's share

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(groups, "get_tensor_model_parallel_group", lambda: "tp-group")
    for tp_rank, local in ((1, 4.0), (0, 13.0)):
        eng = _Engine([torch.tensor([2.0]), torch.tensor([3.0])])  # p0 a shard, p1 replicated
        eng.module.p0.tensor_model_parallel = True
        reduced.clear()
        norm = E.optimizer_step(eng, Layout(2, tp_rank, 1, 1, 2, CPU))
        assert reduced == [(local, "tp-group")] and norm == pytest.approx(math.sqrt(local + 100))


def test_zero_1_to_3_report_deepspeeds_norm():
    eng = _Engine([torch.tensor([3.0])], stage=2, ds_norm=torch.tensor(7.5), max_norm=1.0)
    assert E.optimizer_step(eng, ONE) == 7.5 and eng.steps == 1
    assert eng.grads()[0].item() == 3.0  # DeepSpeed's optimizer clips, not the trainer


def test_accumulate_marks_the_boundary_and_keeps_the_loss_scale():
    eng = _Engine([])
    E.accumulate(eng, torch.tensor(2.0), last=False)
    E.accumulate(eng, torch.tensor(3.0), last=True)
    assert eng.calls == [
        ("boundary", False),
        ("backward", 2.0, False),
        ("boundary", True),
        ("backward", 3.0, False),
    ]


# ----------------------------------------------------------------------------- model helpers
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_checkpointing_flags_only_checkpointed_layers_and_restores_them():
    lm = _tiny_llama()
    lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.eval()
    layers = list(lm.model.layers)
    with E.checkpointing(lm):
        assert all(m.training for m in layers) and not lm.training
        assert not any(m.training for m in layers[0].modules() if m is not layers[0])
    assert not any(m.training for m in lm.modules())
    lm.train()  # a layer in training mode stays so
    with E.checkpointing(lm):
        pass
    assert all(m.training for m in layers)
    plain = _tiny_llama().eval()  # without gradient checkpointing: nothing flagged
    with E.checkpointing(plain):
        assert not any(m.training for m in plain.modules())


def test_full_state_dict_is_the_models_state_dict_on_rank_0_only():
    lm = _tiny_llama()
    eng = SimpleNamespace(module=lm)
    sd = E.full_state_dict(eng, ONE)
    want = lm.state_dict()  # no rotary inv_freq: non-persistent buffers are left out
    assert sorted(sd) == sorted(want)
    assert all(torch.equal(sd[k], want[k]) for k in want)
    sd["model.norm.weight"].add_(1.0)  # a copy, not the live weight
    assert torch.equal(lm.model.norm.weight, torch.ones(16))
    assert E.full_state_dict(eng, Layout(2, 1, 2, 1, 1, CPU)) is None


def test_falcon_h1_lm_head_multiplier_scales_the_logits():
    """Falcon-H1 multiplies its logits by ``lm_head_multiplier`` (the one scale of the four
    that had no test against a real model): the fused head must fold it into the temperature."""
    import transformers

    from trainers import modeling

    cfg = transformers.FalconH1Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, mamba_d_ssm=32,
        mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=16,
        lm_head_multiplier=3.0, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = transformers.FalconH1ForCausalLM(cfg)
    with torch.no_grad():  # logits of real magnitude, where a wrong scale shows
        lm.lm_head.weight.mul_(60.0)
    assert modeling.head_logit_args(lm, 0.6)["temperature"] == pytest.approx(0.2)
    assert modeling.check_head_logits(lm) < 1e-3


# ----------------------------------------------------------------------------- warm start
def test_first_letter_prompts_are_cached_once_and_shared(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_KERNELS_TINY", str(tmp_path / "tiny-v1"))
    path = warm_start.first_letter_prompts()
    assert path == str(tmp_path / f"{warm_start.PROMPTS_VERSION}.jsonl")
    rows = [json.loads(x) for x in open(path)]
    assert len(rows) == 1000 and all(r["target"] == r["prompt"][14] for r in rows)
    assert open(path).read() == warm_start.write_prompts(tmp_path / "again.jsonl").read_text()
    assert os.stat(path).st_mode & 0o777 == 0o644
    os.utime(path, (1, 1))
    assert warm_start.first_letter_prompts() == path and os.stat(path).st_mtime == 1  # kept
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_warm_start_lock_waits_then_names_itself(tmp_path):
    lock = tmp_path / ".w.lock"
    with warm_start._FileLock(lock, timeout_s=5):
        with pytest.raises(TimeoutError, match=r"waited 0 s for the lock .*\.w\.lock"):
            with warm_start._FileLock(lock, timeout_s=0.1):
                pass
    with warm_start._FileLock(lock, timeout_s=0.1):  # released: taken at once
        pass


def test_tiny_and_warm_start_default_paths_follow_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("RLHF_KERNELS_TINY", str(tmp_path / "t"))
    monkeypatch.delenv("RLHF_KERNELS_WARM_START", raising=False)
    assert tiny.default_path() == tmp_path / "t"
    assert warm_start.default_path() == tmp_path / f"t-{warm_start.WARM_VERSION}"
    monkeypatch.setenv("RLHF_KERNELS_WARM_START", str(tmp_path / "w"))
    assert warm_start.default_path() == tmp_path / "w"


def test_warm_start_refuses_bad_steps_before_any_work(tmp_path, monkeypatch):
    """``steps=0`` used to reach the SFT subprocess (which refused it only after starting up),
    and ``2.5`` or ``True`` became ``--max-steps 2.5`` / ``True``."""
    calls = []
    monkeypatch.setattr(warm_start.subprocess, "run", lambda *a, **k: calls.append(a))
    for bad in (0, -3, 2.5, True, "600"):
        with pytest.raises(ValueError, match=r"steps: expected an int >= 1.*got"):
            warm_start.ensure_warm_start(tmp_path / "w", steps=bad, quiet=True)
    assert calls == [] and list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- logger
def test_logger_refuses_a_step_that_is_no_step_count(tmp_path):
    """A step of 2.7 was logged as 2, "5" as 5 and -1 as -1 (int() of anything); a metric
    named by an int became the JSON key "1"."""
    import numpy as np

    from trainers.logger import MetricsLogger, read_metrics

    lg = MetricsLogger(str(tmp_path), kind="none")
    for bad in (2.7, "5", -1, True, torch.tensor(1.0), torch.tensor([1, 2])):
        with pytest.raises(ValueError, match=r"step: expected an integer >= 0, got"):
            lg.log({"loss": 1.0}, bad)
    with pytest.raises(TypeError, match="metrics: expected str keys, got 1"):
        lg.log({1: 2.0}, 1)
    lg.log({"loss": 1.0}, np.int64(1))
    lg.log({"loss": 2.0}, torch.tensor(2))
    lg.close()
    assert read_metrics(str(tmp_path)) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}]
    lg = MetricsLogger(str(tmp_path), kind="none", resume=True)
    with pytest.raises(ValueError, match="step: expected"):
        lg.start_at(1.5)
    assert len(read_metrics(str(tmp_path))) == 2  # nothing truncated


def test_tiny_cache_folder_is_readable_by_everyone(tmp_path):
    """The cache folder is shared (other users, containers): the rename keeps mkdtemp's private
    0700 unless the build opens it up."""
    old = os.umask(0o022)
    try:
        path = tiny.ensure_tiny(tmp_path / "t")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o755 and tiny.is_complete(path)
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_resumed_tensorboard_hides_the_crashed_runs_later_steps(tmp_path):
    """A resume from step 2 after a crash at step 4: TensorBoard shows steps 1-2 of the first
    run and 3-4 of the resumed one, not both runs' values at steps 3 and 4."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from trainers.logger import MetricsLogger

    lg = MetricsLogger(str(tmp_path), kind="tensorboard")
    for s in range(1, 5):
        lg.log({"loss": float(s)}, s)
    lg.close()
    lg = MetricsLogger(str(tmp_path), kind="tensorboard", resume=True)
    for s in (3, 4):
        lg.log({"loss": 10.0 * s}, s)
    lg.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 1), (2, 2), (3, 30), (4, 40)]


def test_wandb_run_is_finished_once_on_close(tmp_path, monkeypatch):
    import sys

    from trainers.logger import MetricsLogger

    done = []
    run = SimpleNamespace(log=lambda values, step: None, finish=lambda: done.append(1))
    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=lambda **kw: run))
    lg = MetricsLogger(str(tmp_path), kind="wandb")
    lg.log({"loss": 1.0}, 1)
    lg.close()
    lg.close()
    assert done == [1]


# ----------------------------------------------------------------------------- distributed
def _unset(monkeypatch, *names):
    """Remove env variables and restore them (or their absence) after the test: a bare
    ``delenv(raising=False)`` of an absent one records nothing, so what the code under test sets
    leaked into later tests' subprocesses (RANK / MASTER_PORT: a stale port, EADDRINUSE)."""
    for k in names:
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)


def test_plain_python_is_a_world_of_one_with_the_runs_timeout(monkeypatch):
    import datetime

    import torch.distributed as dist

    from trainers import distributed as D

    _unset(monkeypatch, "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.append((a, k)))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    lay = D.init_distributed(1, 1, timeout_s=42)
    ((args, kw),) = calls  # a world of one on an in-process store: no port to race for
    assert args == ("gloo",) and kw.pop("timeout") == datetime.timedelta(seconds=42)
    assert isinstance(kw.pop("store"), dist.HashStore) and kw == {"rank": 0, "world_size": 1}
    assert (lay.world, lay.rank, lay.dp, lay.device) == (1, 0, 1, CPU)
    assert os.environ["WORLD_SIZE"] == "1" and int(os.environ["MASTER_PORT"]) > 0
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # joined already: not again
    D.init_distributed(1, 1)
    assert len(calls) == 1


# ----------------------------------------------------------------------------- prebuild
def test_prebuilt_ops_folder_and_cpu_accelerator_keep_the_users_choice(monkeypatch):
    import sys

    from trainers import prebuild

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _unset(monkeypatch, "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR")
    prebuild.use_prebuilt_ops()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == os.path.join(sys.prefix, "torch_extensions")
    assert os.environ["DS_ACCELERATOR"] == "cpu"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/mine")
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    prebuild.use_prebuilt_ops()
    assert (os.environ["TORCH_EXTENSIONS_DIR"], os.environ["DS_ACCELERATOR"]) == ("/mine", "xpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("DS_ACCELERATOR")
    prebuild.use_prebuilt_ops()  # CUDA: DeepSpeed picks its accelerator itself
    assert "DS_ACCELERATOR" not in os.environ
