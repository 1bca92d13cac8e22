"""The package surface: every public name resolves, import stays light."""

import subprocess
import sys

import rlhf_kernels


def test_every_export_resolves():
    for name in rlhf_kernels.__all__:
        assert getattr(rlhf_kernels, name) is not None, name


def test_import_does_not_pull_heavy_modules():
    code = (
        "import sys, rlhf_kernels; "
        "print(','.join(m for m in ('triton', 'transformers', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
