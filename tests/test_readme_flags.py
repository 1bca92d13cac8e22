"""Every ``--flag`` the READMEs name exists: in the ``--help`` of one of our programs (trainers,
demos, ring self-check, benchmark scripts, the bench conftest's pytest option) or in the short
list of other tools' flags the READMEs quote (torchrun, pip). A renamed or removed flag that a
README still shows fails here, not in a user's shell."""

from __future__ import annotations

import contextlib
import importlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = [
    "trainers.sft",
    "trainers.rm",
    "trainers.ppo",
    "trainers.demo",
    "trainers.packing_demo",
    "rlhf_kernels.ring.selfcheck",
    "bench.gpu_check",
    "bench.report",
    "bench.attn_host",
    "bench.attn_sweep",
    "bench.bench_attention",
    "bench.bench_comm",
    "bench.bench_liger",
    "bench.bench_ppo",
    "bench.bench_ring",
    "bench.bench_rl_math",
    "bench.bench_trainers",
]
# quoted from other tools: torchrun's, pip's, pytest-benchmark's; the bench conftest's option
OTHERS = {
    "--nproc-per-node",
    "--nnodes",
    "--node-rank",
    "--rdzv-backend",
    "--rdzv-endpoint",
    "--no-deps",
    "--benchmark-only",
    "--benchmark-json",
    "--benchmark-min-rounds",
    "--bench-quick",
}


def _help(module: str) -> str:
    main = importlib.import_module(module).main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0, module
    return out.getvalue()


def test_every_flag_in_the_readmes_exists():
    text = "".join((ROOT / p).read_text() for p in ("README.md", "bench/README.md"))
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", text))
    helps = "\n".join(_help(m) for m in OURS)
    known = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", helps)) | OTHERS
    assert len(named) > 50  # the pattern still finds the READMEs' flags
    assert sorted(named - known) == []
