"""``make demo``: the RLHF pipeline on a CPU in a few minutes, with the bundled tiny Llama.

1. SFT warm start (``trainers.sft``) on the bundled string tasks, so the model answers in the
   right format (a letter, a word or a number, then EOS);
2. RL (``trainers.ppo``, GRPO) on "first letter: <word>" prompts with fresh random words,
   scored per character against the answer by ``trainers.rewards:reverse_reward``: the
   warm-started model is right about a quarter of the time, RL raises that;
3. a table of the sampled and greedy rewards before and after RL, and the plot
   ``runs/demo/ppo/metrics.png``.

Every stage is the real trainer program run as a subprocess (the command is printed), so the
demo shows what a user types. The recipe lives in ``trainers/warm_start.py`` (the SFT stage,
the prompts) and in ``trainers.ppo``'s defaults (the RL hyper-parameters): ``python -m
trainers.ppo --seed 1`` runs the same RL stage from a cached warm start (the demo's default
``--seed`` is 1). Exits 1 if RL
did not raise the mean reward by ``--min-gain``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import subprocess
import sys
import time
from pathlib import Path

from trainers.warm_start import REWARD_FN, SFT_SEED, SFT_STEPS, TEMPLATE, sft_args, write_prompts

__all__ = ["main", "write_prompts"]


def run(module: str, args: list[str]) -> float:
    cmd = [sys.executable, "-m", f"trainers.{module}", *args]
    print("$ " + " ".join(shlex.quote(c) for c in ["python", *cmd[1:]]), flush=True)
    t0 = time.perf_counter()
    code = subprocess.run(cmd).returncode
    if code:  # the stage printed its own error: end with that stage's code, no traceback
        print(f"demo: the {module} stage failed (exit code {code})", file=sys.stderr)
        raise SystemExit(code)
    return time.perf_counter() - t0


def read(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainers.demo",
        description="SFT warm start, then GRPO on 'first letter: <word>' with a per-character "
        "reward; prints the reward before and after RL. Exits 1 if the mean sampled reward of "
        "the last three steps is not at least --min-gain above the first three (of the last "
        "and first half with fewer than six steps).",
    )
    p.add_argument("--output-dir", default="runs/demo", help="where both runs write")
    p.add_argument("--sft-steps", type=int, default=SFT_STEPS, help="SFT warm-start steps")
    p.add_argument(
        "--rl-steps",
        type=int,
        default=None,
        help="RL steps, >= 2 (default: trainers.ppo's --max-steps)",
    )
    p.add_argument("--seed", type=int, default=SFT_SEED, help="seed of both runs")
    p.add_argument("--min-gain", type=float, default=0.2, help="required reward gain")
    args = p.parse_args(argv)
    if not math.isfinite(args.min_gain):
        p.error(f"--min-gain must be a finite number, got {args.min_gain}")
    if args.sft_steps < 1:
        p.error(f"--sft-steps must be >= 1, got {args.sft_steps}")
    if not 0 <= args.seed < 2**32:
        p.error(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.rl_steps is not None and args.rl_steps < 2:  # before the SFT stage's minutes
        p.error(f"--rl-steps: the reward of the first and last steps is compared: need >= 2, got "
                f"{args.rl_steps}")  # fmt: skip
    return args


def gain_windows(rewards: list[float]) -> tuple[int, float, float]:
    """``(k, mean of the first k, mean of the last k)`` with ``k = min(3, len // 2)``: the two
    windows never overlap (with 3 steps, windows of 3 were the same steps: a gain of 0)."""
    k = min(3, len(rewards) // 2)
    if k < 1:
        raise ValueError(f"need the rewards of at least 2 RL steps, got {len(rewards)}")
    return k, sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.output_dir)
    # each demo is a fresh pair of runs: --overwrite replaces an earlier demo's checkpoints
    t_sft = run("sft", [*sft_args(out / "sft", args.sft_steps, args.seed), "--overwrite"])
    prompts = write_prompts(out / "prompts_first_letter.jsonl")
    # the RL hyper-parameters are trainers.ppo's defaults (GRPO, 8 samples per prompt, ...)
    steps = ["--max-steps", str(args.rl_steps)] if args.rl_steps is not None else []
    t_rl = run("ppo", [
        "--model", str(out / "sft" / "model"), "--output-dir", str(out / "ppo"),
        "--dataset", str(prompts), "--reward-fn", REWARD_FN, "--input-template", TEMPLATE,
        *steps, "--logger", "tensorboard", "--seed", str(args.seed), "--overwrite",
    ])  # fmt: skip
    m = read(out / "ppo")
    k, first, last = gain_windows([x["reward_mean"] for x in m])
    evals = [m[0]["eval_reward_before"]] + [x["eval_reward"] for x in m if "eval_reward" in x]
    print()
    print(f"{'':<36}{'before RL':>10}{'after RL':>10}")
    print(f"{f'sampled reward (mean of {k} steps)':<36}{first:>10.3f}{last:>10.3f}")
    print(f"{'greedy reward (held-out prompts)':<36}{evals[0]:>10.3f}{evals[-1]:>10.3f}")
    plot = out / "ppo" / "metrics.png"
    print(f"\nSFT {t_sft:.0f} s, RL {t_rl:.0f} s ({len(m)} steps); plot: {plot}")
    result = {"first": first, "last": last, "evals": evals}
    if last - first < args.min_gain:
        print(f"FAIL: reward gain {last - first:.3f} < --min-gain {args.min_gain}", file=sys.stderr)
        raise SystemExit(1)
    print(f"OK: RL raised the mean sampled reward by {last - first:.3f}")
    return result


if __name__ == "__main__":
    main()
