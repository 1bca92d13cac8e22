"""PPO rollout distribution under ring attention: what each ring rank receives and holds while
rollouts are distributed, ``scatter`` (each rank gets only its ``RingPlan`` shard of the token
ids) vs ``broadcast`` (whole samples to every ring rank, the OpenRLHF-style path), at ring
sizes 2 and 4, plus rollout vs training time per step.

Every configuration is a real ``torchrun ... -m trainers.ppo --ring-attn-size W`` run on the
bundled tiny model; numbers come from its ``metrics.jsonl``: ``rollout_received_mb`` (token
bytes the busiest rank received), ``rollout_peak_mb`` (peak RSS growth of the busiest rank
during the rollout phase, which generation itself dominates with a model this small),
``rollout_s`` and ``train_s`` (medians over steps). On a 2-core CPU, ring size 4 oversubscribes
the cores: times are not speed-ups.

Script: ``python -m bench.bench_ppo [--quick]`` writes ``bench/results/ppo-rollout-cpu-<date>``
``.json`` and ``.png``; pytest-benchmark group ``ppo-rollout``.
"""

from __future__ import annotations

import datetime
import json
import statistics

import pytest

from bench.bench_trainers import ROOT, run_trainer

CONFIGS = [(w, d) for w in (2, 4) for d in ("scatter", "broadcast")]


def args(quick: bool) -> list[str]:
    from trainers.tiny import ensure_tiny

    # pinned: the untrained tiny model on the bundled "reverse" prompts, so the numbers do not
    # move with the trainer's defaults (which are a warm-started model on other prompts)
    return [
        "--model",
        str(ensure_tiny()),
        "--dataset",
        str(ROOT / "trainers" / "data" / "prompts_toy.jsonl"),
        "--reward-fn",
        "trainers.rewards:reverse_reward",
        "--logger",
        "none",
        "--eval-ratio",
        "0.01",
        "--seed",
        "1",
        "--max-steps",
        "2" if quick else "3",
        "--rollout-batch-size",
        "8",
        "--n-samples-per-prompt",
        "4" if quick else "8",
        "--max-new-tokens",
        "32" if quick else "96",
        "--batch-size",
        "32" if quick else "64",
        "--micro-batch-tokens",
        "1024",
    ]


def run_config(world: int, dist: str, quick: bool) -> dict:
    m = run_trainer(
        "ppo",
        [*args(quick), "--ring-attn-size", str(world), "--rollout-distribution", dist],
        nproc=world,
    )
    med = lambda k: statistics.median(x[k] for x in m)  # noqa: E731
    return {
        "ring": world,
        "distribution": dist,
        "steps": len(m),
        "tokens_per_step": med("tokens"),
        "rollout_received_mb": med("rollout_received_mb"),
        "rollout_peak_mb": med("rollout_peak_mb"),
        "rollout_s": med("rollout_s"),
        "train_s": med("train_s"),
        "reward_mean": [x["reward_mean"] for x in m],
    }


@pytest.mark.parametrize("world,dist", CONFIGS)
def test_ppo_rollout_distribution(benchmark, quick, world, dist):
    benchmark.group = "ppo-rollout"  # before the timed call, which copies it
    result = benchmark.pedantic(run_config, args=(world, dist, quick), rounds=1, iterations=1)
    benchmark.extra_info.update(label=f"ring{world}-{dist}", **result)


def main(argv=None) -> dict:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.report import collect_machine_info, results_stem, script_args

    cli = script_args(argv, __doc__)
    quick = cli.quick
    out = results_stem("ppo-rollout-cpu", quick, cli.force)
    rows = []
    for world, dist in CONFIGS:
        print(f"ring {world}, {dist}...", flush=True)
        rows.append(run_config(world, dist, quick))
        print({k: v for k, v in rows[-1].items() if k != "reward_mean"}, flush=True)
    date = datetime.date.today().isoformat()
    doc = {
        "machine": collect_machine_info(),
        "date": date,
        "quick": quick,
        "flags": " ".join(args(quick)),
        "results": rows,
    }
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    labels = [f"ring {r['ring']}\n{r['distribution']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, title in (
        (axes[0], "rollout_received_mb", "token MiB received (busiest rank)"),
        (axes[1], "rollout_peak_mb", "rollout-phase peak RSS growth (MiB)"),
        (axes[2], "rollout_s", "rollout s / step (train s hatched)"),
    ):
        bars = ax.bar(labels, [r[key] for r in rows], color="#4c72b0")
        ax.bar_label(bars, fmt="%.3g")
        if key == "rollout_s":
            ax.bar(labels, [r["train_s"] for r in rows], color="#dd8452", hatch="//")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"PPO rollout distribution under ring attention, CPU gloo ({date})")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    return doc


if __name__ == "__main__":
    main()
