"""Build script: the Python package plus the optional native ops in csrc/.

The C++ (CPU) extension ``rlhf_kernels._C`` is built from ``csrc/*.cpp`` whenever torch is
importable at build time (``pip install -e . --no-build-isolation``); CUDA sources
``csrc/*.cu`` are added when nvcc and a CUDA torch are present. Without either the package still
installs and every op falls back to Triton or torch.
"""

import glob
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("RLHF_KERNELS_NO_EXT") != "1":
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:  # build without torch: pure-Python install
        torch = None
    cpp = sorted(glob.glob("csrc/*.cpp"))
    if torch is not None and cpp:
        cu = sorted(glob.glob("csrc/*.cu"))
        use_cuda = bool(cu) and torch.version.cuda is not None and cpp_extension.CUDA_HOME
        flags = {"cxx": ["-O3", "-std=c++17"]}
        if use_cuda:
            flags["nvcc"] = ["-O3", "-std=c++17"]
            ext = cpp_extension.CUDAExtension(
                "rlhf_kernels._C",
                cpp + cu,
                extra_compile_args=flags,
                define_macros=[("WITH_CUDA", None)],
            )
        else:
            ext = cpp_extension.CppExtension("rlhf_kernels._C", cpp, extra_compile_args=flags)
        ext_modules = [ext]
        cmdclass = {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=False)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
