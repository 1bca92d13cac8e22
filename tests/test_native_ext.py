"""The csrc/ extension: built by `make install`, used on CPU, optional at import time."""

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rlhf_kernels
from rlhf_kernels.ops import gae as gae_mod

ROOT = Path(__file__).resolve().parents[1]
NO_EXT = os.environ.get("RLHF_KERNELS_NO_EXT") == "1"


@pytest.mark.skipif(NO_EXT, reason="RLHF_KERNELS_NO_EXT=1: extension deliberately not built")
def test_extension_built_and_used_on_cpu():
    assert rlhf_kernels.has_native_ext(), "rlhf_kernels._C missing: run `make install`"
    assert gae_mod._pick_backend("auto", torch.zeros(1, 1)) == "native"
    x, c = torch.randn(4, 77, dtype=torch.float64), torch.rand(4, 77, dtype=torch.float64)
    out = torch.ops.rlhf_kernels.reverse_scan(x, c)
    torch.testing.assert_close(out, gae_mod.reverse_scan_loop(x, c))
    with pytest.raises(RuntimeError, match="coef must have x's shape"):
        torch.ops.rlhf_kernels.reverse_scan(x, c[:, :5])


@pytest.mark.skipif(NO_EXT, reason="RLHF_KERNELS_NO_EXT=1: extension deliberately not built")
def test_fake_impl_traces():
    x, c = torch.randn(2, 9), torch.rand(2, 9)
    f = torch.compile(
        lambda a, b: torch.ops.rlhf_kernels.reverse_scan(a, b) * 2, backend="eager", fullgraph=True
    )
    torch.testing.assert_close(f(x, c), 2 * gae_mod.reverse_scan_loop(x, c))


def test_package_works_without_extension():
    code = (
        "import sys; sys.modules['rlhf_kernels._C'] = None\n"
        "import torch, rlhf_kernels\n"
        "from rlhf_kernels.ops import gae as g\n"
        "assert not rlhf_kernels.has_native_ext()\n"
        "r = torch.randn(2, 9); m = torch.ones(2, 9)\n"
        "assert g._pick_backend('auto', r) == 'torch'\n"
        "a, _ = rlhf_kernels.gae(r, r, gamma=0.9, lam=0.8, mask=m)\n"
        "ref = g.reverse_scan_loop(0.9 * torch.cat([r[:, 1:], r[:, :1] * 0], 1),\n"
        "    torch.full_like(r, 0.72).index_fill(1, torch.tensor([8]), 0.0))\n"
        "torch.testing.assert_close(a, ref)\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0 and "ok" in res.stdout, res.stderr[-2000:]


def _torch_includes():
    from torch.utils import cpp_extension

    return cpp_extension.include_paths()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_source_compiles_with_nvcc(tmp_path):
    import sysconfig

    incs = _torch_includes()
    if not any(Path(p, "c10", "cuda", "CUDAStream.h").exists() for p in incs):
        pytest.skip("torch's c10/cuda headers are absent")
    # CPU wheels ship the c10/cuda headers but not this one generated header (it only says
    # whether c10_cuda is a shared library); supply it so the .cu can be compiled anyway.
    macros = Path("c10", "cuda", "impl", "cuda_cmake_macros.h")
    extra = []
    if not any(Path(p, macros).exists() for p in incs):
        (tmp_path / macros).parent.mkdir(parents=True)
        (tmp_path / macros).write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        extra = ["-I" + str(tmp_path)]
    src = glob.glob(str(ROOT / "csrc" / "*.cu"))
    assert src, "no CUDA sources in csrc/"
    for s in src:
        cmd = (
            [
                "nvcc",
                "-c",
                s,
                "-o",
                str(tmp_path / (Path(s).stem + ".o")),
                "-std=c++17",
                "-DWITH_CUDA",
                "-DTORCH_EXTENSION_NAME=_C",
                "-Xcompiler",
                "-fPIC",
                "-I" + sysconfig.get_paths()["include"],
            ]
            + extra
            + ["-I" + p for p in incs]
        )
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stderr[-3000:]
