"""SFT and RM trainers as a user runs them: real processes (python -m / torchrun on gloo), real
DeepSpeed, the bundled tiny Llama loaded with from_pretrained. Layouts are compared on per-step
losses of the same run (packing, data parallel + ZeRO-2/3, ring attention, AutoTP)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]
# a short run: 3 steps of 16 samples on a 400-sample slice, evaluation only at the end
SHORT = [
    "--max-steps",
    "3",
    "--batch-size",
    "16",
    "--max-samples",
    "400",
    "--eval-ratio",
    "0.05",
    "--micro-batch-tokens",
    "256",
    "--logger",
    "none",
    "--lr",
    "2e-3",
]


def command(module: str, args: list[str], nproc: int, out: Path | None) -> list[str]:
    """``python -m trainers.<module> ...``, or torchrun with ``nproc`` ranks (standalone)."""
    cmd = [sys.executable, "-m", f"trainers.{module}", *args]
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",  # its store on a port the OS picks: no race between parallel runs
            "--nproc-per-node",
            str(nproc),
            "-m",
            f"trainers.{module}",
            *args,
        ]
    return cmd + (["--output-dir", str(out)] if out is not None else [])


def run_trainer(
    module: str,
    args: list[str],
    out: Path | None,
    nproc: int = 1,
    cwd: Path | None = None,
    check: bool = True,
    timeout: int = 600,
):
    """Run ``python -m trainers.<module>`` (or torchrun with ``nproc`` ranks); returns the
    completed process. ``out``: --output-dir."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    cmd = command(module, args, nproc, out)
    proc = subprocess.run(
        cmd, cwd=cwd or ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [m["loss"] for m in metrics(out)]


def assert_same_losses(a: list[float], b: list[float], rel: float = 1e-4) -> None:
    assert len(a) == len(b) == 3, (a, b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(x), (a, b)


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# ----------------------------------------------------------------------------- defaults train
@pytest.mark.slow
def test_sft_default_run_trains(tmp_path):
    """``python -m trainers.sft`` with no arguments, in a fresh folder: the loss goes down."""
    t0 = time.perf_counter()
    run_trainer("sft", [], None, cwd=tmp_path)
    took = time.perf_counter() - t0
    out = tmp_path / "runs" / "sft"
    m = metrics(out)
    first = sum(x["loss"] for x in m[:3]) / 3
    last = sum(x["loss"] for x in m[-3:]) / 3
    assert last < 0.8 * first, (first, last)
    assert m[-1]["eval_loss"] < first
    for key in ("step", "loss", "lr", "tokens", "tokens_per_s", "padding_fraction", "grad_norm"):
        assert key in m[0]
    assert m[0]["step"] == 1 and m[0]["padding_fraction"] == 0.0
    assert (out / "metrics.png").is_file() and any((out / "tensorboard").iterdir())
    assert (out / "model" / "config.json").is_file() and (out / "model" / "tokenizer.json").exists()
    print(f"default SFT: {len(m)} steps, loss {first:.3f} -> {last:.3f}, {took:.0f} s")


@pytest.mark.slow
def test_rm_default_run_learns_preferences(tmp_path):
    from transformers import AutoModelForSequenceClassification

    run_trainer("rm", [], None, cwd=tmp_path)
    out = tmp_path / "runs" / "rm"
    m = metrics(out)
    assert m[-1]["eval_accuracy"] >= 0.75, m[-1]
    model = AutoModelForSequenceClassification.from_pretrained(out / "model")
    assert model.config.num_labels == 1 and model.config.is_reward_model
    assert model.config.reward_stats_from == "evaluation"
    assert (
        model.config.reward_std > 0
        and abs(model.config.reward_mean - m[-1]["eval_reward_mean"]) < 1e-6
    )


# ----------------------------------------------------------------------------- layouts agree
@pytest.fixture(scope="module")
def sft_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft-ref")
    run_trainer("sft", SHORT, out)
    return out


LAYOUTS = {
    "no-packing": (1, ["--no-packing"]),
    "dp2-zero2": (2, ["--zero-stage", "2"]),
    "dp2-zero3-checkpointing": (2, ["--zero-stage", "3", "--gradient-checkpointing"]),
    "zero2-offload": (1, ["--zero-stage", "2", "--offload"]),
    # checkpointed layers recompute ring attention in the backward (crashed before)
    "ring2-checkpointing": (2, ["--ring-attn-size", "2", "--gradient-checkpointing"]),
    "tp2": (2, ["--tp-size", "2"]),
}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sft_layouts_give_the_same_losses(name, sft_reference, tmp_path):
    nproc, extra = LAYOUTS[name]
    run_trainer("sft", SHORT + extra, tmp_path, nproc=nproc)
    assert_same_losses(losses(sft_reference), losses(tmp_path))
    if name == "no-packing":
        assert all(m["padding_fraction"] > 0 for m in metrics(tmp_path))
    assert_same_update(sft_reference / "model", tmp_path / "model")


def assert_same_update(ref_dir: Path, got_dir: Path) -> None:
    """The saved model is whole (every shard gathered) and holds the trained values: each
    tensor's update from the initial weights matches the reference run's to 1% (Adam turns
    rounding-level gradient differences of near-zero gradients into lr-sized steps)."""
    from trainers.tiny import ensure_tiny

    init = load_weights(Path(ensure_tiny()))
    ref, got = load_weights(ref_dir), load_weights(got_dir)
    assert ref.keys() == got.keys() == init.keys()
    for k in ref:
        assert got[k].shape == ref[k].shape == init[k].shape, k
        step = (ref[k] - init[k]).norm()
        assert step > 0, f"{k} was not trained"
        assert (got[k] - ref[k]).norm() <= 0.01 * step, (k, (got[k] - ref[k]).norm(), step)


@pytest.fixture(scope="module")
def rm_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("rm-ref")
    run_trainer("rm", SHORT, out)
    return out


RM_LAYOUTS = {
    "no-packing": (1, ["--no-packing"]),
    "ring2-checkpointing": (
        2,
        ["--ring-attn-size", "2", "--ring-layout", "contiguous", "--gradient-checkpointing"],
    ),
    "tp2-zero1": (2, ["--tp-size", "2", "--zero-stage", "1"]),
}


@pytest.mark.slow
@pytest.mark.multiproc
@pytest.mark.parametrize("name", list(RM_LAYOUTS))
def test_rm_layouts_give_the_same_losses(name, rm_reference, tmp_path):
    nproc, extra = RM_LAYOUTS[name]
    run_trainer("rm", SHORT + extra, tmp_path, nproc=nproc)
    assert_same_losses(losses(rm_reference), losses(tmp_path))
    ref, got = metrics(rm_reference)[-1], metrics(tmp_path)[-1]
    assert abs(ref["eval_accuracy"] - got["eval_accuracy"]) < 1e-9
    assert abs(ref["eval_reward_mean"] - got["eval_reward_mean"]) < 1e-4


@pytest.mark.slow
def test_rm_without_a_pad_token_reloads_with_its_logged_scores(tmp_path):
    """A tokenizer without a pad token (Llama, Mistral) trains with pad = EOS. The reward is read
    where the saved AutoModelForSequenceClassification reads it (the last non-pad token), so
    the reloaded model scores the held-out pairs as logged (it read the EOS in training and
    the token before it after reload: accuracy 0.94 logged vs 0.98 reloaded)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )

    from trainers import data
    from trainers.tiny import ensure_tiny

    tok = AutoTokenizer.from_pretrained(ensure_tiny())
    tok.pad_token = None
    base = AutoModelForCausalLM.from_pretrained(ensure_tiny())
    base.config.pad_token_id = None
    base.save_pretrained(tmp_path / "base")
    tok.save_pretrained(tmp_path / "base")
    run_trainer("rm", SHORT + ["--model", str(tmp_path / "base")], tmp_path / "rm")
    saved = tmp_path / "rm" / "model"
    model = AutoModelForSequenceClassification.from_pretrained(saved).eval()
    tok = AutoTokenizer.from_pretrained(saved)
    assert tok.pad_token_id == tok.eos_token_id == model.config.pad_token_id
    cfg = json.loads((tmp_path / "rm" / "config.json").read_text())
    rows = data.load_mixture(
        data.make_default_path("preference_toy.jsonl"), None, "train", cfg["seed"], 400
    )
    _, held = data.split_train_eval(rows, None, cfg["eval_ratio"], cfg["seed"])
    seqs = []
    for row in held:
        enc = data.tokenize_pair(tok, row["prompt"], row["chosen"], row["rejected"], cfg["max_len"])
        seqs += [enc["chosen_ids"], enc["rejected_ids"]]
    width = max(map(len, seqs))  # one right-padded batch, as a user would score
    batch = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        scores = model(batch, attention_mask=(torch.arange(width) < torch.tensor(
            [len(s) for s in seqs])[:, None]).long()).logits.double().view(-1, 2)  # fmt: skip
    logged = metrics(tmp_path / "rm")[-1]
    assert abs(scores.mean().item() - logged["eval_reward_mean"]) < 1e-4, logged
    accuracy = (scores[:, 0] > scores[:, 1]).double().mean().item()
    assert abs(accuracy - logged["eval_accuracy"]) < 1e-9, (accuracy, logged)


@pytest.mark.slow
def test_eval_split_of_the_training_dataset(tmp_path):
    """``--split train --eval-split test`` on a save_to_disk folder evaluates its test split
    (no --eval-dataset needed, nothing held out of train)."""
    import datasets

    from trainers.data import make_default_path

    rows = datasets.load_dataset("json", data_files=make_default_path("sft_toy.jsonl"))["train"]
    parts = datasets.DatasetDict(train=rows.select(range(40)), test=rows.select(range(40, 47)))
    parts.save_to_disk(str(tmp_path / "dd"))
    args = ["--dataset", str(tmp_path / "dd"), "--eval-split", "test", "--max-steps", "1"]
    proc = run_trainer("sft", args + ["--batch-size", "8", "--logger", "none"], tmp_path / "o")
    assert "40 training / 7 eval samples" in proc.stderr, proc.stderr[-2000:]
    assert "eval_loss" in metrics(tmp_path / "o")[-1]
    # training on another split without --eval-split: a holdout of it, or none with ratio 0
    args = ["--dataset", str(tmp_path / "dd"), "--split", "test", "--max-steps", "1"]
    proc = run_trainer("sft", args + ["--batch-size", "4", "--logger", "none"], tmp_path / "h")
    assert "6 training / 1 eval samples" in proc.stderr, proc.stderr[-2000:]
    args += ["--eval-ratio", "0", "--batch-size", "4", "--logger", "none"]
    proc = run_trainer("sft", args, tmp_path / "n")
    assert "7 training / 0 eval samples" in proc.stderr, proc.stderr[-2000:]
    assert "eval_loss" not in metrics(tmp_path / "n")[-1]
    args = ["--dataset", str(tmp_path / "dd"), "--eval-split", "train", "--logger", "none"]
    proc = run_trainer("sft", args, tmp_path / "e", check=False)
    assert proc.returncode != 0 and "evaluating on training rows" in proc.stderr


# ----------------------------------------------------------------------------- resume
@pytest.mark.slow
def test_resume_after_a_crash_during_a_save_repeats_the_run(tmp_path):
    args = SHORT[:]
    args[args.index("--max-steps") + 1] = "6"
    args += ["--save-steps", "3"]
    run_trainer("sft", args, tmp_path)
    full = metrics(tmp_path)
    assert [m["step"] for m in full] == [1, 2, 3, 4, 5, 6]
    ckpts = tmp_path / "checkpoints"
    # the save of step 6 died midway: its folder never got committed, a partial one is left
    shutil.rmtree(ckpts / "step-000006")
    partial = ckpts / ".tmp-step-000006" / "engine"
    partial.mkdir(parents=True)
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"truncated")
    proc = run_trainer("sft", args + ["--resume"], tmp_path)
    assert "resumed from" in proc.stderr and "step 3" in proc.stderr
    resumed = metrics(tmp_path)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(full, resumed):
        for key in ("loss", "lr", "grad_norm", "tokens"):
            assert abs(a[key] - b[key]) <= 1e-6 * abs(a[key]), (key, a, b)
    assert not (ckpts / ".tmp-step-000006").exists()
    assert (ckpts / "step-000006" / "trainer_state.json").is_file()
    # a checkpoint of another layout, dtype or offload is refused up front, in one line, and
    # config.json still describes the checkpoint's run
    config = (tmp_path / "config.json").read_text()
    for flags, name in ((["--zero-stage", "1"], "--zero-stage"), (["--dtype", "bf16"], "--dtype")):
        proc = run_trainer("sft", args + ["--resume", *flags], tmp_path, check=False)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        assert "error: --resume:" in proc.stderr and f"resume with the checkpoint's {name}" in (
            proc.stderr
        )
        assert (tmp_path / "config.json").read_text() == config
    # so is one with other data flags: it would train on other samples than the checkpoint's run
    proc = run_trainer("sft", args + ["--resume", "--seed", "7"], tmp_path, check=False)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "with --seed 0; this run has --seed 7: resume with the checkpoint's" in proc.stderr
    # this run's --lr replaces the checkpoint's: the schedule of the resumed steps doubles
    shutil.rmtree(ckpts / "step-000006")
    lr_at = args.index("--lr") + 1
    args[lr_at] = str(2 * float(args[lr_at]))
    run_trainer("sft", args + ["--resume", "--save-total-limit", "1"], tmp_path)
    assert [p.name for p in ckpts.iterdir()] == ["step-000006"]  # step 3 pruned after the save
    doubled = metrics(tmp_path)
    assert [m["lr"] for m in doubled[:3]] == [m["lr"] for m in full[:3]]
    for a, b in zip(full[3:], doubled[3:], strict=True):
        assert abs(b["lr"] - 2 * a["lr"]) <= 1e-9 * a["lr"], (a, b)
    assert json.loads((tmp_path / "config.json").read_text())["lr"] == float(args[lr_at])
    # a run that fails its input checks leaves the earlier run's files alone, even with
    # --overwrite (metrics.jsonl was truncated, config.json rewritten, checkpoints deleted)
    files = {p: p.read_bytes() for p in (tmp_path / "config.json", tmp_path / "metrics.jsonl")}
    bad = args + ["--overwrite", "--input-key", "nope"]
    proc = run_trainer("sft", bad, tmp_path, check=False)
    assert proc.returncode == 2 and "--input-key 'nope'" in proc.stderr, proc.stderr[-2000:]
    assert all(p.read_bytes() == b for p, b in files.items())
    assert (ckpts / "step-000006" / "trainer_state.json").is_file()


@pytest.mark.slow
def test_offload_resume_is_bit_exact(tmp_path):
    """DeepSpeed's CPU Adam keeps beta^t as a running float product; a restarted one computed
    pow(beta, t), which differs in the last bit at t = 3 for beta2 = 0.999: a resume from step 2
    was ~1e-7 off. The trainer replays the product after loading."""
    args = SHORT[:]
    args[args.index("--max-steps") + 1] = "4"
    args += ["--save-steps", "2", "--zero-stage", "2", "--offload"]
    run_trainer("sft", args, tmp_path)
    full = metrics(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "step-000004")
    run_trainer("sft", args + ["--resume"], tmp_path)
    resumed = metrics(tmp_path)
    for a, b in zip(full, resumed, strict=True):
        for key in ("loss", "lr", "grad_norm", "eval_loss"):
            assert a.get(key) == b.get(key), (key, a, b)


def test_resume_compares_data_files_by_content(tmp_path):
    from trainers.checkpoint import check_data
    from trainers.session import checkpoint_data
    from trainers.sft import SFTConfig

    a, b = tmp_path / "a.jsonl", tmp_path / "moved" / "a.jsonl"
    a.write_text('{"prompt": "p", "response": "r"}\n')
    (tmp_path / "trainer_state.json").write_text(
        json.dumps({"step": 2, "data": checkpoint_data(SFTConfig(dataset=str(a)))})
    )
    b.parent.mkdir()
    b.write_bytes(a.read_bytes())
    check_data(tmp_path, checkpoint_data(SFTConfig(dataset=str(b))))  # moved: the same data
    a.write_text('{"prompt": "q", "response": "s"}\n')  # edited in place: other samples
    with pytest.raises(ValueError, match=r"the files of --dataset .*a.jsonl changed since"):
        check_data(tmp_path, checkpoint_data(SFTConfig(dataset=str(a))))
    # without digests (an older checkpoint, or a rank other than 0): paths are compared
    check_data(tmp_path, checkpoint_data(SFTConfig(dataset=str(a)), digests=False))
    with pytest.raises(ValueError, match="was saved by a run with --dataset"):
        check_data(tmp_path, checkpoint_data(SFTConfig(dataset=str(b)), digests=False))


def test_resume_refuses_another_reward_model(tmp_path):
    from trainers.checkpoint import check_data
    from trainers.ppo import PPOConfig
    from trainers.session import checkpoint_data

    saved = checkpoint_data(PPOConfig(reward_model="rm_a"))
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "data": saved}))
    check_data(tmp_path, checkpoint_data(PPOConfig(reward_model="./rm_a")))  # the same folder
    with pytest.raises(ValueError, match="was saved by a run with --reward-model"):
        check_data(tmp_path, checkpoint_data(PPOConfig(reward_model="rm_b")))


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path):
    from trainers.checkpoint import latest_checkpoint, save_checkpoint

    class Engine:
        def __init__(self, fail: bool):
            self.fail = fail

        def save_checkpoint(self, path, tag, save_latest):
            (Path(path) / tag).mkdir()
            (Path(path) / tag / "model.pt").write_bytes(b"half")
            if self.fail:
                raise OSError("disk full")

    save_checkpoint(Engine(False), tmp_path, 3, {})
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(Engine(True), tmp_path, 6, {})
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-000003"
    assert (tmp_path / "checkpoints" / ".tmp-step-000006").is_dir()  # ignored by resume
    save_checkpoint(Engine(False), tmp_path, 9, {})  # the next save clears the leftovers
    assert latest_checkpoint(tmp_path).name == "step-000009"
    assert not (tmp_path / "checkpoints" / ".tmp-step-000006").exists()


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path):
    """``keep``: the just-saved folder and the newest others up to ``keep`` stay; a prune that
    died after its rename leaves a ``.del-`` folder that resume ignores and the next save
    removes; ``keep=0`` keeps every checkpoint."""
    from trainers.checkpoint import checkpoint_root, latest_checkpoint, save_checkpoint

    class Engine:
        def save_checkpoint(self, path, tag, save_latest):
            (Path(path) / tag).mkdir()

    root = checkpoint_root(tmp_path)
    for step in (2, 4, 6):
        save_checkpoint(Engine(), tmp_path, step, {}, keep=2)
    assert sorted(p.name for p in root.iterdir()) == ["step-000004", "step-000006"]
    (root / "step-000004").rename(root / ".del-step-000004")  # a prune killed midway
    assert latest_checkpoint(tmp_path).name == "step-000006"
    (root / "step-000006").rename(root / ".del-step-000006")
    assert latest_checkpoint(tmp_path) is None  # never a half-deleted folder
    (root / ".del-step-000006").rename(root / "step-000006")
    save_checkpoint(Engine(), tmp_path, 3, {}, keep=1)  # an older step saved last is kept
    assert sorted(p.name for p in root.iterdir()) == ["step-000003"]
    # a crashed re-save's only copy (.old-step-N) counts and goes; a folder without a state
    # file is not a checkpoint: neither counted nor deleted
    (root / "step-000003").rename(root / ".old-step-000003")
    (root / "step-000001").mkdir()
    save_checkpoint(Engine(), tmp_path, 4, {}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["step-000001", "step-000004"]
    (root / "step-000001").rmdir()
    for step in (5, 7):
        save_checkpoint(Engine(), tmp_path, step, {})
    assert len(list(root.iterdir())) == 3
    # without a limit, a crashed re-save's only copy survives the next save (resume needs it)
    (root / "step-000007").rename(root / ".old-step-000007")
    save_checkpoint(Engine(), tmp_path, 8, {})
    assert (root / ".old-step-000007" / "trainer_state.json").is_file()


def test_check_complete_names_the_missing_rank_file(tmp_path):
    """A resume with another process count is refused in one line before any engine loads."""
    from trainers.checkpoint import check_complete

    (tmp_path / "engine").mkdir()
    (tmp_path / "trainer_state.json").write_text('{"step": 2}')
    (tmp_path / "rng_rank0.pt").write_bytes(b"x")
    check_complete(tmp_path, ["engine"], rank=0)
    with pytest.raises(ValueError, match="rng_rank1.pt .saved by a different number of processes"):
        check_complete(tmp_path, ["engine"], rank=1)
    with pytest.raises(ValueError, match="no critic"):
        check_complete(tmp_path, ["engine", "critic"], rank=0)


def test_resume_refusal_names_every_flag_to_restore(tmp_path):
    from trainers.checkpoint import check_layout

    saved = {"processes": 2, "dp": 1, "ring": 2, "tp": 1, "zero_stage": 0, "dtype": "fp32"}
    saved |= {"offload": False, "critic": True}
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "layout": saved}))

    def fix(**change) -> str:
        with pytest.raises(ValueError, match="^--resume: ") as e:
            check_layout(tmp_path, {**saved, **change})
        return str(e.value).split(": resume with ")[1]

    # dp follows from the sizes: the same 2 processes without the ring name only the ring
    assert fix(ring=1, dp=2) == "the checkpoint's --ring-attn-size"
    assert fix(zero_stage=2, critic=False) == (
        "the checkpoint's --zero-stage and --advantage-estimator gae (the checkpoint holds a "
        "critic)"
    )
    want = "the checkpoint's torchrun process count, --dtype"
    assert fix(processes=4, dp=2, dtype="bf16") == want
    check_layout(tmp_path, {**saved, "new_key": 1})  # keys a checkpoint lacks are not compared


def test_resume_refuses_other_data_flags(tmp_path):
    from trainers.checkpoint import check_data
    from trainers.ppo import PPOConfig
    from trainers.session import checkpoint_data

    saved = checkpoint_data(PPOConfig())
    assert {"dataset", "rollout_batch_size", "n_samples_per_prompt", "seed"} <= saved.keys()
    assert "lr" not in saved and "max_steps" not in saved  # this run's: may change on resume
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "data": saved}))
    check_data(tmp_path, checkpoint_data(PPOConfig()))
    check_data(tmp_path, checkpoint_data(PPOConfig(lr=1.0, max_steps=9)))
    other = checkpoint_data(
        PPOConfig(dataset="b.jsonl", n_samples_per_prompt=4, apply_chat_template=True)
    )
    with pytest.raises(ValueError) as e:
        check_data(tmp_path, other)
    # in the user's own spelling (pasteable): unset / off flags are "no --flag"
    assert str(e.value).startswith(
        f"--resume: {tmp_path} was saved by a run with no --dataset, no --apply-chat-template, "
        "--n-samples-per-prompt 8; this run has --dataset "
    )
    assert f"--dataset {Path('b.jsonl').resolve()}, --apply-chat-template, " in str(e.value)
    # one file spelt two ways is one dataset
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2, "data": other}))
    same = PPOConfig(dataset=f"./b.jsonl, {Path('b.jsonl').resolve()}", n_samples_per_prompt=4)
    with pytest.raises(ValueError, match="this run has --dataset .*b.jsonl,"):
        check_data(tmp_path, checkpoint_data(same))  # two files are not one
    same.dataset, same.apply_chat_template = "./b.jsonl", True
    check_data(tmp_path, checkpoint_data(same))
    spaced = checkpoint_data(PPOConfig(dataset="a.jsonl,b.jsonl", dataset_probs="0.7, 0.3"))
    assert spaced["dataset_probs"] == "0.7,0.3"
    (tmp_path / "trainer_state.json").write_text(json.dumps({"step": 2}))  # older checkpoints
    check_data(tmp_path, other)


# ----------------------------------------------------------------------------- bad input
def _bad(
    module: str,
    args: list[str],
    nproc: int = 1,
    out: Path | None = None,
    pythonpath: Path | None = None,
):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), env.get("PYTHONPATH", "")])
    return subprocess.Popen(
        command(module, args, nproc, out),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_bad_input_is_one_clear_error_on_every_rank(tmp_path):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    cases = {  # name -> (trainer, args, ranks, expected text)
        "missing key": (
            "sft",
            ["--input-key", "question"],
            1,
            "--input-key 'question' is not a column",
        ),
        "unknown split": ("rm", ["--split", "test"], 1, "split"),
        "ring size": (
            "sft",
            ["--ring-attn-size", "2"],
            1,
            "must divide the number of processes (1)",
        ),
        "long sample": (
            "sft",
            ["--micro-batch-tokens", "16"],
            1,
            "longer than --micro-batch-tokens 16",
        ),
        "output dir": ("sft", [], 1, "is not a writable folder"),
        "template": ("sft", ["--input-template", "no slot"], 1, "has no '{}' where the prompt"),
        "two ranks": ("rm", ["--chosen-key", "better"], 2, "--chosen-key 'better'"),
        "tp size": ("sft", ["--tp-size", "3"], 3, "must divide the model's attention heads"),
        "old checkpoints": ("sft", [], 1, "holds checkpoints of an earlier run (newest: step-2)"),
        "ppo clip": ("ppo", ["--clip-low", "1.5"], 1, "need 0 <= --clip-low < 1"),
        "ppo group of one": (
            "ppo",
            ["--advantage-estimator", "dr_grpo", "--n-samples-per-prompt", "1"],
            1,
            "it needs --n-samples-per-prompt >= 2",
        ),
        "ppo batch over dp": (
            "ppo",
            ["--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--batch-size", "3"],
            2,
            "--batch-size 3 must be a multiple of the data-parallel size 2",
        ),
    }
    stale = tmp_path / "old-checkpoints" / "checkpoints" / "step-2"  # an earlier run's
    stale.mkdir(parents=True)
    (stale / "trainer_state.json").write_text("{}")
    t0 = time.perf_counter()
    procs = {}
    for name, (module, args, nproc, _) in cases.items():
        out = a_file if name == "output dir" else tmp_path / name.replace(" ", "-")
        procs[name] = _bad(module, args, nproc, out)
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        expected, nproc = cases[name][3], cases[name][2]
        assert proc.returncode != 0, name
        assert expected in err, (name, err[-3000:])
        assert err.count(expected) >= nproc, (name, "every rank reports it", err[-3000:])
        assert "[rank0]: Traceback" not in err, (name, err[-3000:])
        if nproc == 1:
            assert "Traceback" not in err, (name, err[-3000:])
    assert time.perf_counter() - t0 < 240


def test_help_documents_every_flag(capsys):
    from trainers import rm, sft

    wanted = """--model --dataset --dataset-probs --split --eval-dataset --eval-split --eval-ratio
    --max-samples --input-key --input-template --apply-chat-template --max-len
    --batch-size --micro-batch-tokens --no-packing --ring-attn-size --ring-layout --zero-stage
    --offload --tp-size --dtype --lr --epochs --max-steps --seed --gradient-checkpointing
    --output-dir --save-steps --save-total-limit --eval-steps --resume --logger --config""".split()
    for main, extra in (
        (sft.main, ["--output-key"]),
        (rm.main, ["--chosen-key", "--rejected-key", "--prompt-key", "--margin-key"]),
    ):
        with pytest.raises(SystemExit) as e:
            main(["--help"])
        assert e.value.code == 0
        text = capsys.readouterr().out
        for flag in wanted + extra:
            assert flag in text, flag
        assert ("--output-key" in text) == (main is sft.main)  # the RM reads chosen/rejected


@pytest.mark.slow
def test_rm_reports_what_it_leaves_out(tmp_path):
    """Rows identical to a held-out row and pairs whose chosen and rejected are the same tokens
    are left out with a count (both used to vanish silently); a resumed run with no steps left
    saves the evaluation set's reward statistics, not the training pairs'."""
    rows = [json.loads(x) for x in (ROOT / "trainers/data/preference_toy.jsonl").open()][:40]
    rows += rows[:10]  # duplicates: some land in the holdout
    rows.append({"prompt": "same", "chosen": "abc", "rejected": "abc", "margin": 0.0})
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    args = ["--dataset", str(data), "--eval-ratio", "0.2", "--max-steps", "2", "--batch-size", "8"]
    args += ["--logger", "none", "--save-steps", "2"]
    proc = run_trainer("rm", args, out)
    said = proc.stdout + proc.stderr
    assert "dropped 1 pairs whose chosen and rejected are the same tokens" in said, said
    dup = re.search(r"dropped (\d+) training rows identical to a held-out row", said)
    assert dup and int(dup.group(1)) >= 1, said
    cfg = json.loads((out / "model" / "config.json").read_text())
    last = metrics(out)[-1]
    assert cfg["reward_stats_from"] == "evaluation"
    assert cfg["reward_mean"] == pytest.approx(last["eval_reward_mean"], abs=1e-6)
    shutil.rmtree(out / "model")  # as a crash during the final save would
    run_trainer("rm", args + ["--resume"], out)
    again = json.loads((out / "model" / "config.json").read_text())
    assert again["reward_mean"] == pytest.approx(last["eval_reward_mean"], abs=1e-5)


def test_a_non_finite_loss_stops_before_saving(tmp_path):
    """A NaN / inf loss ends the run with one error line before a checkpoint (or the final
    model) could save non-finite weights; the step is logged first."""
    from types import SimpleNamespace

    from trainers.session import Session

    logged, saved = [], []
    s = SimpleNamespace(
        layout=SimpleNamespace(device=torch.device("cpu"), world=1),
        logger=SimpleNamespace(log=lambda m, step: logged.append(step), close=lambda: None),
        _bar=SimpleNamespace(set_postfix=lambda d: None),
        cfg=SimpleNamespace(save_steps=1, output_dir=str(tmp_path)),
    )
    engine = SimpleNamespace(save_checkpoint=lambda *a, **k: saved.append(a))
    for key in ("loss", "policy_loss", "value_loss", "grad_norm"):  # NaN grads: NaN weights
        with pytest.raises(SystemExit):
            Session.end_step(s, 3, {key: float("nan")}, engine)
    with pytest.raises(SystemExit):
        Session.end_step(s, 4, {"loss": float("inf")}, engine)
    assert logged == [3, 3, 3, 3, 4] and saved == []


@pytest.mark.slow
def test_sft_counts_samples_cut_before_their_eos(tmp_path):
    args = ["--max-len", "12", "--max-steps", "1", "--max-samples", "64", "--batch-size", "8"]
    proc = run_trainer("sft", args + ["--logger", "none", "--eval-ratio", "0"], tmp_path)
    cut = re.search(r"(\d+) training samples are cut at --max-len 12", proc.stdout + proc.stderr)
    assert cut and int(cut.group(1)) > 0, proc.stdout + proc.stderr


def test_score_head_is_kept_from_a_saved_classifier(tmp_path):
    """A *ForSequenceClassification folder without our is_reward_model flag (a third-party
    reward model) keeps its trained head; only a causal LM gets a fresh, seeded one."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trainers.distributed import Layout
    from trainers.rm import RMConfig
    from trainers.session import Session
    from trainers.tiny import ensure_tiny

    src = ensure_tiny()
    tok = AutoTokenizer.from_pretrained(src)
    clf = AutoModelForSequenceClassification.from_pretrained(src, num_labels=1)
    torch.nn.init.constant_(clf.score.weight, 0.5)
    clf.save_pretrained(tmp_path / "clf")
    layout = Layout(1, 0, 1, 1, 1, torch.device("cpu"))

    def head(path, seed=0):
        s = Session(RMConfig(model=str(path), seed=seed), "rm", layout, str(path), tok)
        return s.load_score_model().score.weight.detach()

    assert (head(tmp_path / "clf") == 0.5).all()
    fresh = head(src)
    assert torch.equal(fresh, head(src)) and not torch.equal(fresh, head(src, seed=1))


def test_rm_names_equal_pairs_when_none_is_left():
    """Every training pair chosen == rejected: the error used to say no sample fits --max-len;
    equal eval pairs alone are no error (counted, dropped)."""
    from transformers import AutoTokenizer

    from trainers import rm
    from trainers.tiny import ensure_tiny

    tok = AutoTokenizer.from_pretrained(ensure_tiny())
    rows = [{"prompt": "p", "chosen": "abc", "rejected": "abc"}] * 3
    same: list[int] = []
    assert rm.tokenize(rows, tok, rm.RMConfig(max_len=64), same) == ([], 0)
    good = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    pairs, dropped = rm.tokenize(rows + good, tok, rm.RMConfig(max_len=64), same)
    assert (len(pairs), dropped, same) == (1, 0, [3, 3])
    assert "3 training pairs have chosen and rejected" in rm.equal_pairs_reason(same, 64)
    assert rm.equal_pairs_reason([0, 3], 64) is None


def test_learned_position_tables_bound_max_len():
    """GPT-2 with n_positions=16 and --max-len 64 used to fail mid-run in torch.embedding."""
    from transformers import GPT2Config, LlamaConfig, OPTConfig

    from trainers.session import _position_table

    assert _position_table(GPT2Config(n_positions=16)) == 16
    assert _position_table(OPTConfig(max_position_embeddings=64)) == 64
    assert _position_table(LlamaConfig(max_position_embeddings=64)) is None  # RoPE: no table


ENGINE_SCRIPT = r"""
import json, types, torch
from trainers.prebuild import use_prebuilt_ops
use_prebuilt_ops()
from trainers.distributed import init_distributed
from trainers.engine import build_engine, build_frozen
layout = init_distributed(1, 1)
out = {}
for stage in (0, 1):
    cfg = types.SimpleNamespace(zero_stage=stage, dtype="bf16", offload=False, max_grad_norm=0.0,
        lr=0.5, weight_decay=0.5, warmup_steps=0, lr_scheduler="constant")
    torch.manual_seed(0)
    eng = build_engine(torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16), cfg, layout, 10)
    eng.backward(eng(torch.arange(8.0).view(2, 4).bfloat16()).float().sum())
    eng.step()
    out[stage] = eng.module.weight.float().tolist()
cfg = types.SimpleNamespace(**{**vars(cfg), "ref_zero_stage": 3, "ref_offload": False})
frozen = build_frozen(torch.nn.Linear(4, 1), cfg, layout)
out["frozen"] = str(next(frozen.parameters()).dtype)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_bf16_zero0_steps_as_zero1_and_frozen_models_keep_their_dtype():
    """DeepSpeed's bf16 optimizer at ZeRO 0 took an AdamW step on zero gradients when built
    (Adam's count started at 1, weight decay applied once): ZeRO 0 and 1 disagreed from the
    first step. A ZeRO-3 frozen fp32 model (PPO's reward model) was cast to bf16."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["0"] == got["1"], got
    assert got["frozen"] == "torch.float32"


@pytest.mark.slow
def test_models_outside_the_attention_interface_need_no_packing(tmp_path):
    """A Bloom model would have trained packed with samples attending to each other (its layers
    compute attention from a mask ours leaves empty); the trainer refuses it up front."""
    from transformers import AutoTokenizer, BloomConfig, BloomForCausalLM

    from trainers.tiny import ensure_tiny

    tok = AutoTokenizer.from_pretrained(ensure_tiny())
    BloomForCausalLM(
        BloomConfig(vocab_size=len(tok), hidden_size=32, n_layer=1, n_head=4)
    ).save_pretrained(tmp_path / "bloom")
    tok.save_pretrained(tmp_path / "bloom")
    args = ["--model", str(tmp_path / "bloom"), "--max-steps", "1", "--logger", "none"]
    proc = run_trainer("sft", args, tmp_path / "o", check=False)
    assert proc.returncode != 0 and "bloom models compute attention" in proc.stderr
    assert "use --no-packing" in proc.stderr and "Traceback" not in proc.stderr
    run_trainer("sft", args + ["--no-packing", "--batch-size", "4"], tmp_path / "p")


@pytest.mark.slow
def test_damaged_checkpoints_and_resume_edges_end_in_one_line(tmp_path):
    """A damaged newest checkpoint gave tracebacks (or a JSON error naming no file); a resume
    from the last checkpoint kept the crashed run's later metrics; a checkpoint past the run's
    last step was taken silently; --overwrite deleted in place (a kill left half a folder)."""
    args = SHORT[:]
    args[args.index("--max-steps") + 1] = "2"
    args += ["--save-steps", "1", "--logger", "none"]
    run_trainer("sft", args, tmp_path)
    ckpts = tmp_path / "checkpoints"
    step2 = ckpts / "step-000002"

    def refused(extra, *needles):
        proc = run_trainer("sft", args + ["--resume", *extra], tmp_path, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        for needle in needles:
            assert needle in proc.stderr, proc.stderr[-3000:]

    state = (step2 / "trainer_state.json").read_text()
    (step2 / "trainer_state.json").write_text("")
    refused([], "trainer_state.json is unreadable", "delete that checkpoint folder")
    (step2 / "trainer_state.json").write_text(state)
    shutil.move(step2 / "engine", tmp_path / "engine")
    refused([], "step-000002 is incomplete: no engine")
    shutil.move(tmp_path / "engine", step2 / "engine")
    refused(["--max-steps", "1"], "is at step 2, past this run's 1 steps")
    # no step left after the checkpoint: the records past it go (a crash after step 2's log)
    shutil.rmtree(step2)
    run_trainer("sft", args + ["--resume", "--max-steps", "1"], tmp_path)
    assert [m["step"] for m in metrics(tmp_path)] == [1]
    # --overwrite: the old checkpoints are gone, nothing half-deleted is left beside them
    run_trainer("sft", args + ["--overwrite"], tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000001", "step-000002"]
