"""The package surface: every public name resolves, import stays light."""

import subprocess
import sys

import pytest

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


def test_console_scripts_exit_0_after_a_run(monkeypatch):
    """pyproject's commands pointed at ``main``, which returns the metrics dict: the pip
    wrapper's ``sys.exit(main())`` printed it and exited 1 after every successful run."""
    import importlib
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()  # (no tomllib on 3.10)
    section = text.split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    scripts = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"', section, re.M))
    assert set(scripts) == {"rlhf-sft", "rlhf-rm", "rlhf-ppo"}
    for target in scripts.values():
        module, func = target.split(":")
        mod = importlib.import_module(module)
        monkeypatch.setattr(mod, "main", lambda: {"loss": 1.0})
        with pytest.raises(SystemExit) as e:
            sys.exit(getattr(mod, func)())
        assert e.value.code is None, target
