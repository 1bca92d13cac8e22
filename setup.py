"""Build script: the Python package plus the optional native ops in csrc/.

The C++ (CPU) extension ``rlhf_kernels._C`` is built from ``csrc/*.cpp`` whenever torch is
importable at build time (``pip install -e . --no-build-isolation``); CUDA sources
``csrc/*.cu`` are added when nvcc and a CUDA torch are present. If that CUDA build fails (say,
nvcc and torch disagree on the CUDA version) the CPU extension is built instead, with a warning;
if even that fails, the package installs without it and every op falls back to Triton or torch.
The C++ standard is torch's own (no ``-std`` flag is forced: torch 2.13 needs C++20).
``RLHF_KERNELS_NO_EXT=1`` skips the extension, ``RLHF_KERNELS_NO_CUDA=1`` builds CPU only.
"""

import glob
import os
import warnings

from setuptools import setup

ext_modules, cmdclass = [], {}


def _extensions(cpp_extension, cpp, cu):
    """The extension to try first, then the fallbacks: CUDA+CPU, CPU only."""
    out = []
    if cu:
        out.append(
            cpp_extension.CUDAExtension(
                "rlhf_kernels._C",
                cpp + cu,
                extra_compile_args={"cxx": ["-O3"], "nvcc": ["-O3"]},
                define_macros=[("WITH_CUDA", None)],
            )
        )
    out.append(cpp_extension.CppExtension("rlhf_kernels._C", cpp, extra_compile_args=["-O3"]))
    return out


if os.environ.get("RLHF_KERNELS_NO_EXT") != "1":
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # build without torch: pure-Python install
        torch = None
    cpp = sorted(glob.glob("csrc/*.cpp"))
    if torch is not None and cpp:
        cu = sorted(glob.glob("csrc/*.cu"))
        if (
            not (torch.version.cuda and cpp_extension.CUDA_HOME)
            or os.environ.get("RLHF_KERNELS_NO_CUDA") == "1"
        ):
            cu = []
        candidates = _extensions(cpp_extension, cpp, cu)
        base = cpp_extension.BuildExtension.with_options(use_ninja=False)

        class BuildWithFallback(base):
            """Builds the first candidate that compiles: a failed CUDA build falls back to the
            CPU extension, a failed CPU build to no extension, each with a warning."""

            def build_extensions(self):
                for i, cand in enumerate(candidates):
                    self.extensions = [cand]
                    try:
                        return super().build_extensions()
                    except Exception as err:  # compiler errors surface as several types
                        nxt = "the CPU extension" if i + 1 < len(candidates) else "no extension"
                        msg = f"building rlhf_kernels._C from {cand.sources} failed ({err})"
                        warnings.warn(f"{msg}; falling back to {nxt}", stacklevel=1)
                self.extensions = []

        ext_modules = [candidates[0]]
        cmdclass = {"build_ext": BuildWithFallback}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
