"""Turn a pytest-benchmark JSON into one results JSON and one PNG plot per benchmark group.

Usage::

    python bench/report.py [--raw bench/results/latest-raw.json] [--out-dir bench/results]
                           [--tag TAG] [--date YYYY-MM-DD] [--no-plot] [--force]

Writes ``<out-dir>/<group>-<machine-tag>[-quick]-<date>.json`` and ``.png`` for every group
found; if one of them exists (a committed result of the day) it writes nothing and exits 1
unless ``--force`` (the raw JSON stays for that second call). The machine tag is ``cpu``
without a GPU, else the GPU name in lower case (``h100-80gb-hbm3``); ``unstamped`` for raw JSON
that ``bench/conftest.py`` did not stamp (then only pytest-benchmark's own machine fields are
reported, never this machine's).
Each results JSON holds: machine (CPU model, cores, GPU), library versions, rlhf_kernels version
and git commit, date, and per benchmark its name, params, mean/median/stddev/min/max (seconds),
rounds and ``extra_info``. A benchmark may set ``extra_info["label"]`` to name its bar.

``collect_machine_info`` is also used by ``bench/conftest.py`` to stamp the raw JSON at run time.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_RAW = ROOT / "bench" / "results" / "latest-raw.json"
DEFAULT_OUT = ROOT / "bench" / "results"
# distribution names whose versions go into every report (None when not installed)
VERSIONED = {
    "torch": "torch",
    "triton": "triton",
    "transformers": "transformers",
    "flash_attn": "flash-attn",
    "ring_flash_attn": "ring-flash-attn",
    "deepspeed": "deepspeed",
    "pytest_benchmark": "pytest-benchmark",
    "rlhf_kernels": "rlhf-kernels",
}
STAT_KEYS = ("mean", "median", "stddev", "min", "max", "rounds", "iterations")


# ----------------------------------------------------------------------------- machine info
def proc_memory_kb() -> dict[str, int]:
    """This process's ``VmRSS`` and ``VmHWM`` (peak RSS) in KiB, from ``/proc/self/status``."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmHWM", "VmRSS")):
                vals[line.split(":")[0]] = int(line.split()[1])
    return vals


def reset_peak_rss() -> int:
    """Reset ``VmHWM`` to the current RSS (``/proc/self/clear_refs`` = 5); returns that RSS in
    KiB, the base a later ``proc_memory_kb()["VmHWM"]`` is measured from."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return proc_memory_kb()["VmRSS"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def collect_machine_info() -> dict:
    """Describe this machine and software: a flat dict, JSON-serialisable."""
    import torch

    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    info = {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpus[0] if gpus else None,
        "gpu_count": len(gpus),
        "versions": {key: _version(dist) for key, dist in VERSIONED.items()},
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    if info["versions"]["rlhf_kernels"] is None:
        try:
            import rlhf_kernels

            info["versions"]["rlhf_kernels"] = rlhf_kernels.__version__
        except ImportError:
            pass
    return info


def _unstamped(info: dict) -> dict:
    """What pytest-benchmark's ``machine_info`` tells; the GPU and versions are unknown there
    (tag ``unstamped``)."""
    cpu = info.get("cpu") or {}
    return {
        "cpu_model": cpu.get("brand_raw") or info.get("processor") or None,
        "cpu_cores": cpu.get("count"),
        "torch_threads": None,
        "gpu": None,
        "gpu_count": None,
        "python_version": info.get("python_version"),
        "versions": {},
        "tag": "unstamped",
    }


def machine_tag(info: dict) -> str:
    """``unstamped`` for raw JSON not stamped by bench/conftest.py; ``cpu`` without a GPU, else
    a file-name-safe GPU name (``NVIDIA H100 80GB HBM3`` -> ``h100-80gb-hbm3``)."""
    if info.get("tag"):
        return info["tag"]
    gpu = info.get("gpu")
    if not gpu:
        return "cpu"
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return re.sub(r"^nvidia-", "", slug) or "gpu"


def script_args(argv: list[str] | None, doc: str, rounds: int | None = None):
    """The command line of a bench script: ``--quick``, ``--force`` (and ``--rounds`` when the
    script takes it). ``--help`` prints it; an unknown flag is an error (it used to start the
    full benchmark, which then wrote over the committed results of the day)."""
    ap = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="small shapes: a smoke run (file *-quick)")
    ap.add_argument(
        "--force", action="store_true", help="overwrite a results file of the same name (today's)"
    )
    if rounds is not None:
        ap.add_argument("--rounds", type=int, default=rounds, help="timed rounds per case")
    return ap.parse_args(sys.argv[1:] if argv is None else argv)


def results_stem(name: str, quick: bool, force: bool, date: str | None = None) -> Path:
    """``bench/results/<name>[-quick]-<date>`` (no suffix), checked before any work: an existing
    ``.json`` of that name is kept unless ``force``."""
    date = date or _dt.date.today().isoformat()
    stem = DEFAULT_OUT / f"{name}{'-quick' if quick else ''}-{date}"
    if stem.with_suffix(".json").exists() and not force:
        raise SystemExit(
            f"{stem.with_suffix('.json')} exists (committed results?): pass --force to overwrite"
        )
    return stem


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", name).strip("_") or "ungrouped"


# ----------------------------------------------------------------------------- reports
def build_reports(raw: dict, date: str | None = None) -> dict[str, dict]:
    """Group the benchmarks of a pytest-benchmark JSON: ``{group: report dict}``."""
    info = dict(raw.get("machine_info") or {})
    if "cpu_model" not in info:  # not stamped by bench/conftest.py: pytest-benchmark's own fields
        info = _unstamped(info)  # only; never this machine's, which may not have run it
    commit = raw.get("commit_info") or {}
    if date is None:
        stamp = raw.get("datetime")
        date = stamp[:10] if stamp else _dt.date.today().isoformat()
    versions = dict(info.get("versions") or {})
    header = {
        "machine": {
            "tag": machine_tag(info),
            "cpu_model": info.get("cpu_model"),
            "cpu_cores": info.get("cpu_cores"),
            "torch_threads": info.get("torch_threads"),
            "gpu": info.get("gpu"),
            "gpu_count": info.get("gpu_count", 0),
            "python": info.get("python_version"),
        },
        "versions": versions,
        "rlhf_kernels": {
            "version": versions.get("rlhf_kernels"),
            "git_commit": info.get("git_commit") or commit.get("id"),
            "git_dirty": info.get("git_dirty", commit.get("dirty")),
        },
        "date": date,
        "datetime": raw.get("datetime"),
        "bench_quick": bool(info.get("bench_quick", False)),
    }
    reports: dict[str, dict] = {}
    for b in raw.get("benchmarks", []):
        group = b.get("group") or "ungrouped"
        rep = reports.setdefault(group, {"group": group, **header, "benchmarks": []})
        stats = b.get("stats") or {}
        rep["benchmarks"].append(
            {
                "name": b.get("name"),
                "fullname": b.get("fullname"),
                "params": b.get("params"),
                "param": b.get("param"),
                **{k: stats.get(k) for k in STAT_KEYS},
                "unit": "s",
                "extra_info": b.get("extra_info") or {},
            }
        )
    return reports


def _label(b: dict) -> str:
    extra = b.get("extra_info") or {}
    if extra.get("label"):
        return str(extra["label"])
    return b.get("param") or re.sub(r"^test_", "", b.get("name") or "?")


def plot_group(report: dict, path: Path) -> None:
    """Horizontal bars: median time per call, whiskers +- one standard deviation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [b for b in report["benchmarks"] if b.get("median") is not None]
    medians = [b["median"] for b in rows]
    top = max(medians, default=1.0)
    scale, unit = (1.0, "s") if top >= 1 else (1e3, "ms") if top >= 1e-3 else (1e6, "µs")
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.45 * max(len(rows), 1)))
    ys = range(len(rows))
    vals = [m * scale for m in medians]
    errs = [(b.get("stddev") or 0.0) * scale for b in rows]
    ax.barh(list(ys), vals, xerr=errs, color="tab:blue", alpha=0.8, capsize=3)
    ax.set_yticks(list(ys), [_label(b) for b in rows], fontsize=8)
    ax.invert_yaxis()
    for y, v, e in zip(ys, vals, errs):
        ax.text(v + e, y, f"  {v:.3g}", va="center", fontsize=8)  # past the whisker
    ax.set_xlabel(f"median time per call ({unit}); whiskers: ±1 std")
    m = report["machine"]
    where = m["gpu"] or f"{m['cpu_model']} ({m['cpu_cores']} cores)"
    ax.set_title(f"{report['group']}  |  {where}  |  {report['date']}", fontsize=9)
    ax.margins(x=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(
    reports: dict[str, dict],
    out_dir: Path,
    tag: str | None = None,
    plot: bool = True,
    force: bool = True,
) -> list[Path]:
    """Write ``<group>-<tag>-<date>.json`` (+ ``.png``) per group; returns the paths written.
    ``force=False``: FileExistsError (before writing any) if one of them exists."""
    out_dir.mkdir(parents=True, exist_ok=True)

    def stem_of(group: str, rep: dict) -> str:
        quick = "-quick" if rep.get("bench_quick") else ""  # never overwrites a full run's file
        return f"{_safe(group)}-{tag or rep['machine']['tag']}{quick}-{rep['date']}"

    stems: dict[str, str] = {}
    for g, r in reports.items():  # "a/b" and "a b" are both a_b: one would replace the other
        other = stems.setdefault(stem_of(g, r), g)
        if other != g:
            raise ValueError(f"groups {other!r} and {g!r} would both write {stem_of(g, r)}.json")
    taken = [out_dir / f"{stem}.json" for stem in stems]
    taken = [p for p in taken if p.exists()]
    if taken and not force:
        raise FileExistsError(f"{taken[0]} exists (committed results?): pass --force to overwrite")
    written = []
    for group, rep in sorted(reports.items()):
        stem = stem_of(group, rep)
        path = out_dir / f"{stem}.json"
        path.write_text(json.dumps(rep, indent=2, sort_keys=False) + "\n")
        written.append(path)
        if plot:
            plot_group(rep, out_dir / f"{stem}.png")
            written.append(out_dir / f"{stem}.png")
    return written


def _iso_date(text: str) -> str:
    """``--date``: a real YYYY-MM-DD (it becomes part of a file name)."""
    try:
        return _dt.date.fromisoformat(text).isoformat()
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a date YYYY-MM-DD, got {text!r}") from None


def _tag(text: str) -> str:
    """``--tag``: a file-name-safe machine tag (letters, digits, ``._+-``)."""
    if not text or _safe(text) != text:
        raise argparse.ArgumentTypeError(
            f"expected a tag of letters, digits and ._+- (like h100-80gb-hbm3), got {text!r}"
        )
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--raw", type=Path, default=DEFAULT_RAW, help="pytest-benchmark JSON")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT)
    ap.add_argument(
        "--tag", type=_tag, default=None, help="machine tag (default: cpu or the GPU name)"
    )
    ap.add_argument(
        "--date", type=_iso_date, default=None, help="YYYY-MM-DD (default: the run's date)"
    )
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--force", action="store_true", help="overwrite existing report files")
    args = ap.parse_args(argv)
    if not args.raw.is_file():
        print(f"report.py: no raw benchmark JSON at {args.raw}", file=sys.stderr)
        return 1
    raw = json.loads(args.raw.read_text())
    if (
        not isinstance(raw, dict)
        or not isinstance(raw.get("benchmarks"), list)
        or "group" in raw  # one of this script's own reports
        or any("stats" not in b for b in raw["benchmarks"])
    ):
        print(
            f"report.py: {args.raw} is not pytest-benchmark JSON (no 'benchmarks' list; a "
            f"report this script wrote?)",
            file=sys.stderr,
        )
        return 1
    reports = build_reports(raw, args.date)
    if not reports:
        print(f"report.py: {args.raw} holds no benchmarks", file=sys.stderr)
        return 1
    for rep in reports.values():  # benchmarks without statistics (skipped, failed) are named
        for b in rep["benchmarks"]:
            if b.get("median") is None:
                print(f"report.py: {b.get('fullname') or b.get('name')}: no timings, not plotted")
    try:
        written = write_reports(
            reports, args.out_dir, args.tag, plot=not args.no_plot, force=args.force
        )
    except (FileExistsError, ValueError) as e:
        print(f"report.py: {e} (the raw timings stay in {args.raw})", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
