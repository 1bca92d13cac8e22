"""The default PPO start: the bundled tiny Llama after a short SFT warm start, and its RL task.

The untrained tiny model never answers in the right format, so RL from it has no reward to
raise. ``python -m trainers.ppo`` with no ``--model`` therefore starts from a warm-started copy:
``trainers.sft`` (``SFT_STEPS`` steps, about 30 s on a 2-core CPU) on the bundled string tasks
with the prompt template ``TEMPLATE``. ``ensure_warm_start()`` builds it once, into a versioned
cache folder beside the tiny model (``~/.cache/rlhf-kernels/tiny-v1-sft-v1``, or
``$RLHF_KERNELS_WARM_START``), and afterwards only returns the folder.

The RL task (``first_letter_prompts()``): "first letter: <word>" prompts with fresh random words
and their answers in a ``target`` column, scored per character by ``REWARD_FN``. The warm-started
model answers about a quarter of them right; RL raises that (``make demo`` shows the recipe
stage by stage).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from trainers import tiny

WARM_VERSION = "sft-v1"  # bump when the recipe below changes: a new cache folder is built
PROMPTS_VERSION = "first-letter-prompts-v1"
TEMPLATE = "{} ="
REWARD_FN = "trainers.rewards:reverse_reward"
SFT_STEPS = 600
SFT_SEED = 1
MARKER = "warm_start.json"
REQUIRED_FILES = (*tiny.REQUIRED_FILES, "model.safetensors", MARKER)
# torchrun's variables: the SFT subprocess must be a world of one, whoever builds it
_LAUNCHER_ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def sft_args(output_dir: str | os.PathLike, steps: int = SFT_STEPS, seed: int = SFT_SEED):
    """``python -m trainers.sft`` arguments of the warm start (bundled data, default model)."""
    return [
        "--output-dir", str(output_dir), "--max-steps", str(steps), "--epochs", "20",
        "--batch-size", "32", "--lr", "3e-3", "--max-len", "64", "--eval-ratio", "0.02",
        "--logger", "none", "--seed", str(seed), "--input-template", TEMPLATE,
    ]  # fmt: skip


def write_prompts(path: str | os.PathLike, n: int = 1000, seed: int = 123) -> Path:
    """``first letter: <word>`` prompts (3-8 random lowercase letters) and their answers."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(
                rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8))
            )
            f.write(json.dumps({"prompt": f"first letter: {word}", "target": word[0]}) + "\n")
    return path


def _cache_dir() -> Path:
    return tiny.default_path().parent


def default_path() -> Path:
    """``$RLHF_KERNELS_WARM_START``, or ``<tiny model folder>-sft-v1`` beside the tiny model."""
    env = os.environ.get("RLHF_KERNELS_WARM_START")
    if env:
        return Path(env)
    return _cache_dir() / f"{tiny.default_path().name}-{WARM_VERSION}"


def is_complete(path: str | os.PathLike) -> bool:
    return all((Path(path) / f).is_file() for f in REQUIRED_FILES)


def first_letter_prompts() -> str:
    """Path of the cached default PPO prompts (1000 rows, seed 123), written on first use
    (atomically: every rank may write it, the content is the same)."""
    dst = _cache_dir() / f"{PROMPTS_VERSION}.jsonl"
    if not dst.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.tmp-", dir=dst.parent)
        os.close(fd)
        try:
            write_prompts(tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, dst)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return str(dst)


class _FileLock:
    """``flock`` on ``path``: one process at a time (polls, so a hung holder is an error)."""

    def __init__(self, path: Path, timeout_s: float):
        self.path, self.timeout_s = path, timeout_s

    def __enter__(self):
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(
                        f"waited {self.timeout_s:.0f} s for the lock {str(self.path)!r} held by "
                        f"another warm-start build; delete it if no build is running"
                    ) from None
                time.sleep(0.5)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def ensure_warm_start(
    path: str | os.PathLike | None = None,
    steps: int = SFT_STEPS,
    quiet: bool = False,
    timeout_s: float = 3600,
) -> str:
    """Return the warm-started model folder, building it on first use.

    One process builds (a file lock beside the folder; concurrent callers such as torchrun
    ranks wait for it, then use its folder): ``trainers.sft`` as a single-process subprocess
    into a temporary sibling folder, renamed into place, so nobody sees a partial model.
    ``steps``: SFT steps of a new build (a folder that exists is used as it is).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an int >= 1 (SFT steps of a build), got {steps!r}")
    dst = Path(path).expanduser() if path is not None else default_path()
    if is_complete(dst):
        return str(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with _FileLock(dst.parent / f".{dst.name}.lock", timeout_s):
        if is_complete(dst):  # built while we waited
            return str(dst)
        if dst.exists() and any(dst.iterdir()):
            raise FileExistsError(
                f"path {str(dst)!r}: expected a warm-started model folder with "
                f"{list(REQUIRED_FILES)} or no folder, got a non-empty folder without them; "
                f"delete it or pick another path"
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
        try:
            # the model folder is made by sft with the umask's modes, not mkdtemp's private one
            model = _build(tmp, steps, quiet, dst)
            if dst.exists():
                dst.rmdir()  # empty (checked above)
            os.replace(model, dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)


def _build(tmp: Path, steps: int, quiet: bool, dst: Path) -> Path:
    """Run the SFT warm start into ``tmp / "run"``; return its saved model folder."""
    run = tmp / "run"
    cmd = [sys.executable, "-m", "trainers.sft", *sft_args(run, steps)]
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    env = {k: v for k, v in env.items() if not k.startswith("TORCHELASTIC_")}
    if not quiet:
        print(
            f"building the default PPO model once: an SFT warm start of the tiny model "
            f"({steps} steps, about 30 s on a CPU) -> {dst}",
            file=sys.stderr,
            flush=True,
        )
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"the SFT warm start failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-4000:]}"
        )
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    model = run / "model"
    (model / MARKER).write_text(
        json.dumps(
            {
                "version": WARM_VERSION,
                "base_model": tiny.default_path().name,
                "sft_args": sft_args(run, steps)[2:],  # without --output-dir
                "steps": steps,
                "final_loss": metrics[-1]["loss"],
                "eval_loss": metrics[-1].get("eval_loss"),
                "input_template": TEMPLATE,
                "build_s": round(time.perf_counter() - t0, 1),
            },
            indent=1,
        )
    )
    if not quiet:
        print(
            f"warm start built in {time.perf_counter() - t0:.0f} s "
            f"(loss {metrics[0]['loss']:.2f} -> {metrics[-1]['loss']:.2f})",
            file=sys.stderr,
            flush=True,
        )
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m trainers.warm_start",
        description="Build (once) and print the warm-started default PPO model folder.",
    )
    p.add_argument(
        "--path", default=None, help="folder (default: $RLHF_KERNELS_WARM_START or cache)"
    )
    print(ensure_warm_start(p.parse_args(argv).path))


if __name__ == "__main__":
    main()
