"""setup.py: a native build that fails falls back (CUDA -> CPU extension -> none) with a warning
instead of aborting the install, and no C++ standard is forced on torch's headers."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_no_forced_cpp_standard():
    src = (ROOT / "setup.py").read_text()
    assert "-std=" not in src  # torch 2.13's headers need C++20; torch picks its own standard


@pytest.mark.slow
def test_failing_native_build_still_installs(tmp_path):
    shutil.copy(ROOT / "setup.py", tmp_path / "setup.py")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "README.md").write_text("x\n")
    (tmp_path / "csrc").mkdir()
    (tmp_path / "csrc" / "broken.cpp").write_text("this is not C++;\n")
    (tmp_path / "rlhf_kernels").mkdir()
    (tmp_path / "rlhf_kernels" / "__init__.py").write_text("")
    res = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "falling back to no extension" in out
    assert not list((tmp_path / "rlhf_kernels").glob("_C*.so"))
