"""Shared pytest-benchmark setup for every ``bench/bench_*.py`` file.

- Without CUDA, Triton runs under its interpreter (``TRITON_INTERPRET=1``): correct but not a
  performance path, so benchmarks skip Triton peers on CPU.
- ``bench_*.py`` files are collected here (pyproject's ``testpaths``/``python_files`` only cover
  ``tests/test_*.py``); benchmark functions are ordinary ``test_*`` functions.
- Quick mode (``--bench-quick`` or ``RLHF_BENCH_QUICK=1``) asks every benchmark to use small shapes,
  for smoke runs; the ``quick`` fixture exposes it.
- Machine info (CPU model, cores, GPU, library versions, rlhf_kernels version) goes into the
  pytest-benchmark JSON, where ``bench/report.py`` reads it.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # must happen before anything imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from bench.report import collect_machine_info  # noqa: E402

QUICK_ENV = "RLHF_BENCH_QUICK"


def pytest_addoption(parser):
    parser.addoption(
        "--bench-quick",
        action="store_true",
        default=False,
        help=f"small shapes for smoke runs (same as {QUICK_ENV}=1)",
    )


def is_quick(config) -> bool:
    """True when quick mode was asked for by option or environment variable."""
    env = os.environ.get(QUICK_ENV, "").strip().lower() not in ("", "0", "false", "no")
    return bool(config.getoption("--bench-quick", default=False)) or env


def pytest_collect_file(file_path, parent):
    # files named on the command line are already collected by pytest's python plugin
    if parent.session.isinitpath(file_path):
        return None
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info.update(collect_machine_info())
    machine_info["bench_quick"] = is_quick(config)


@pytest.fixture(scope="session")
def quick(request) -> bool:
    """Whether benchmarks should shrink their shapes (``--bench-quick`` / ``RLHF_BENCH_QUICK``)."""
    return is_quick(request.config)


@pytest.fixture(scope="session")
def device() -> torch.device:
    """``cuda`` when available, else ``cpu``."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(scope="session")
def sync(device):
    """Callable that waits for queued device work; call it at the end of a timed function."""
    if device.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
