"""The SFT trainer as a user runs it: tokens/s and peak memory, packing vs padding on a
long-tailed (chat-like) length mix, and ring sizes 1 vs 2 at a fixed total length.

Every configuration is a real ``python -m trainers.sft`` (or ``torchrun``) process on the
bundled tiny model, reading back ``metrics.jsonl``: tokens/s is the median over the steps after
the first, ``peak_mem_mb`` the busiest rank's peak RSS (CUDA: allocator peak), and the padding
fraction is ``1 - real tokens / token slots``; ``plan_micro_batches``' count of micro-batches
is compared with the lower bound ``ceil(tokens / budget)`` on the same length mix.
On a 2-core CPU, ring 2 runs two 1-thread ranks against one 1-thread process: it measures the
ring's overheads and per-rank memory, not a speed-up.

pytest-benchmark (group ``trainers-sft``): one round per configuration, timing the whole process.
Script: ``python -m bench.bench_trainers [--quick]`` writes
``bench/results/trainers-sft-cpu-<date>.json`` and ``.png``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlhf_kernels.packing import plan_micro_batches

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "the model reads each sample once and packing keeps every token useful while padding "
    "wastes slots on short chats so long answers and short greetings share a batch"
).split()


def chat_lengths(n: int, seed: int = 0) -> list[int]:
    """Long-tailed word counts: lognormal (median ~24 words), capped at 400."""
    rng = random.Random(seed)
    return [max(2, min(400, int(rng.lognormvariate(math.log(24), 1.0)))) for _ in range(n)]


def write_chat_data(path: Path, n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed + 1)
    lengths = chat_lengths(n, seed)
    with open(path, "w") as f:
        for words in lengths:
            k = max(1, words // 4)  # a quarter prompt, the rest response
            text = [rng.choice(WORDS) for _ in range(words)]
            f.write(json.dumps({"prompt": " ".join(text[:k]), "response": " ".join(text[k:])}))
            f.write("\n")
    return lengths


def write_long_docs(path: Path, n: int, words: int) -> None:
    rng = random.Random(2)
    with open(path, "w") as f:
        for _ in range(n):
            text = [rng.choice(WORDS) for _ in range(words)]
            f.write(json.dumps({"prompt": " ".join(text[:8]), "response": " ".join(text[8:])}))
            f.write("\n")


def planner_overhead(lengths: list[int], budget: int, batch: int) -> float:
    """Micro-batches planned / the lower bound ``ceil(tokens / budget)``, summed over
    consecutive global batches (1.0 = no micro-batch more than the token count forces)."""
    planned = bound = 0
    for i in range(0, len(lengths) - batch + 1, batch):
        chunk = lengths[i : i + batch]
        planned += len(plan_micro_batches(chunk, budget)[0])
        bound += math.ceil(sum(chunk) / budget)
    return planned / max(bound, 1)


def run_trainer(module: str, args: list[str], nproc: int = 1) -> list[dict]:
    """One ``python -m trainers.<module>`` (or torchrun) process; its ``metrics.jsonl`` lines."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", f"trainers.{module}", *args, "--output-dir", out]
        if nproc > 1:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                str(nproc),
                "-m",
                f"trainers.{module}",
                *args,
                "--output-dir",
                out,
            ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
        return [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]


def run_sft(args: list[str], nproc: int = 1) -> dict:
    """Median tokens/s (steps after the first), peak memory, padding fraction, losses."""
    m = run_trainer("sft", args, nproc)
    later = m[1:] or m
    return {
        "tokens_per_s": statistics.median(x["tokens_per_s"] for x in later),
        "peak_mem_mb": max(x["peak_mem_mb"] for x in m),
        "padding_fraction": sum(x["padding_fraction"] * x["tokens"] for x in m)
        / sum(x["tokens"] for x in m),
        "losses": [x["loss"] for x in m],
        "steps": len(m),
    }


def configurations(tmp: Path, quick: bool) -> dict[str, tuple[list[str], int]]:
    steps = "3" if quick else "8"
    chat = tmp / "chat.jsonl"
    write_chat_data(chat, 256 if quick else 1024)
    docs = tmp / "docs.jsonl"
    write_long_docs(docs, 64, 300 if quick else 700)
    common = ["--logger", "none", "--eval-ratio", "0", "--max-steps", steps, "--seed", "0"]
    mix = [
        *common,
        "--dataset",
        str(chat),
        "--batch-size",
        "32",
        "--max-len",
        "1024",
        "--micro-batch-tokens",
        "2048",
    ]
    fixed = [
        *common,
        "--dataset",
        str(docs),
        "--batch-size",
        "4",
        "--max-len",
        "2048",
        "--micro-batch-tokens",
        "8192",
    ]
    return {
        "packed": (mix, 1),
        "padded": ([*mix, "--no-packing"], 1),
        "ring1-fixed": (fixed, 1),
        "ring2-fixed": ([*fixed, "--ring-attn-size", "2"], 2),
    }


@pytest.fixture(scope="module")
def configs(quick, tmp_path_factory):
    return configurations(tmp_path_factory.mktemp("trainer-bench"), quick)


@pytest.mark.parametrize("name", ["packed", "padded", "ring1-fixed", "ring2-fixed"])
def test_sft_trainer(benchmark, configs, name):
    args, nproc = configs[name]
    benchmark.group = "trainers-sft"  # before the timed call, which copies it
    result = benchmark.pedantic(run_sft, args=(args, nproc), rounds=1, iterations=1)
    benchmark.extra_info.update(
        label=name,
        nproc=nproc,
        flags=" ".join(args),
        **{k: v for k, v in result.items() if k != "losses"},
    )
    if name == "packed":
        assert result["padding_fraction"] < 0.02


@pytest.mark.parametrize("groups", [1, 2, 8])
def test_plan_micro_batches(benchmark, quick, groups):
    """The planner alone on one PPO-sized rollout batch (16k samples, 16-4096 tokens, a 64k
    budget; 2k samples in quick mode), per data-parallel group count."""
    rng = random.Random(0)
    lengths = [rng.randint(16, 4096) for _ in range(2000 if quick else 16000)]
    benchmark.group = "packing-plan"
    plan = benchmark.pedantic(plan_micro_batches, args=(lengths, 65536, groups), rounds=3)
    totals = [sum(lengths[i] for mb in g for i in mb) for g in plan]
    benchmark.extra_info.update(
        samples=len(lengths),
        groups=groups,
        microbatches_over_bound=groups * len(plan[0]) / math.ceil(sum(lengths) / 65536),
        group_token_spread=max(totals) - min(totals),
    )
    assert max(totals) - min(totals) <= 4096


def main(argv=None) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import collect_machine_info, results_stem, script_args

    cli = script_args(argv, __doc__)
    quick = cli.quick
    out = results_stem("trainers-sft-cpu", quick, cli.force)
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (args, nproc) in configurations(Path(tmp), quick).items():
            print(f"running {name} ({nproc} process(es))...", flush=True)
            results[name] = {
                **run_sft(args, nproc),
                "nproc": nproc,
                "flags": " ".join(a for a in args if not a.startswith(tmp)),
            }
            print({k: v for k, v in results[name].items() if k not in ("losses", "flags")})
    lengths = chat_lengths(256 if quick else 1024)
    pk, pd = results["packed"]["losses"], results["padded"]["losses"]
    summary = {
        # lengths in words: ~1.5-2 tokens each, so the token budget is about 1200 words
        "planner_microbatches_over_bound": planner_overhead(lengths, 1200, 32),
        "packed_vs_padded_tokens_per_s": results["packed"]["tokens_per_s"]
        / results["padded"]["tokens_per_s"],
        "packed_vs_padded_peak_mem": results["packed"]["peak_mem_mb"]
        / results["padded"]["peak_mem_mb"],
        "max_rel_loss_diff_packed_padded": max(abs(a - b) / abs(a) for a, b in zip(pk, pd)),
    }
    date = datetime.date.today().isoformat()
    doc = {
        # each trainer process runs with OMP_NUM_THREADS=1 (this process's count is not theirs)
        "machine": {**collect_machine_info(), "torch_threads": 1},
        "date": date,
        "quick": quick,
        "results": results,
        "summary": summary,
    }
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, title in (
        (axes[0], "tokens_per_s", "tokens/s (median step)"),
        (axes[1], "peak_mem_mb", "peak memory, busiest rank (MiB)"),
    ):
        vals = [results[n][key] for n in names]
        bars = ax.bar(names, vals, color=["#4c72b0", "#dd8452", "#55a868", "#c44e52"])
        ax.bar_label(bars, fmt="%.0f")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(
        f"SFT trainer on CPU ({date}); padding fraction packed "
        f"{results['packed']['padding_fraction']:.1%}, padded "
        f"{results['padded']['padding_fraction']:.1%}"
    )
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(json.dumps(summary, indent=1))
    return doc


if __name__ == "__main__":
    main()
