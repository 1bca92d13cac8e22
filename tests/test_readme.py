"""Every ```python block of README.md runs as written, in a fresh interpreter (CPU).

A block whose first line is ``# torchrun --nproc-per-node N`` runs under torchrun with N gloo
ranks. Fragments that are not meant to run belong in ```text blocks.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TIMEOUT_S = 240  # per block; each takes a few seconds unloaded
TORCHRUN_RE = re.compile(r"#\s*torchrun\s+--nproc-per-node[ =](\d+)\s*$")
FENCE_RE = re.compile(r"^(\s*)```(\S*)\s*$")
HEADING_RE = re.compile(r"^#{1,6}\s")
PRINTED_RE = re.compile(r"^\s*print\(.*\)\s+#\s*(\S.*?)\s*$", re.M)

# recipe heading -> what its python block must show
RECIPES = {
    "Recipe: SFT loss of a Hugging Face model on a padded batch": [
        "LlamaConfig(",
        "unpad_input(",
        "model.model(",
        "model.lm_head.weight",
        "labels=labels).loss",
        "assert torch.allclose(",
    ],
    "Recipe: swapping Liger's fused linear cross-entropy for ours": [
        "FusedLinearCrossEntropyLoss as LigerFusedLinearCrossEntropyLoss",
        "F.cross_entropy(F.linear(",
        "assert torch.allclose(",
    ],
    "Recipe: a GRPO step on packed rollouts": [
        "unpad_input(hidden, attention_mask)",
        "group_advantages(",
        "sequence_to_tokens(",
        "linear_policy_loss(",
        ".backward()",
    ],
    "Recipe: ring attention with a Hugging Face model": [
        "# torchrun --nproc-per-node 2",
        'init_process_group("gloo")',
        "RingPlan.build(",
        "register()",
        "ring_context(plan, group)",
        "plan.next_token_labels(",
        "ring_token_mean(",
        "assert torch.allclose(",
    ],
    "Recipe: GAE on padded and on packed sequences": [
        "mask=mask",
        "cu_seqlens=cu_seqlens",
        "assert torch.allclose(",
    ],
}


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    heading: str  # nearest heading above
    code: str

    @property
    def nproc(self) -> int | None:
        first = self.code.lstrip().splitlines()[0] if self.code.strip() else ""
        m = TORCHRUN_RE.match(first.strip())
        return int(m.group(1)) if m else None

    @property
    def id(self) -> str:
        slug = re.sub(r"[^a-z0-9]+", "-", self.heading.lower()).strip("-")[:48]
        return f"L{self.line}-{slug}"


def _blocks(text: str) -> list[Block]:
    blocks, heading, lines = [], "", text.splitlines()
    i = 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if m is None:
            if HEADING_RE.match(lines[i]):
                heading = lines[i].lstrip("#").strip()
            i += 1
            continue
        indent, lang, start = m.group(1), m.group(2), i
        i += 1
        body = []
        while i < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        if i == len(lines):
            raise AssertionError(f"README.md:{start + 1}: unclosed ``` block")
        blocks.append(Block(start + 1, lang, heading, textwrap.dedent("\n".join(body)) + "\n"))
        i += 1
    return blocks


BLOCKS = _blocks(README.read_text())
PYTHON = [b for b in BLOCKS if b.lang == "python"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env.update(
        PYTHONPATH=str(ROOT) + (os.pathsep + path if path else ""),
        TRITON_INTERPRET="1",
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    return env


def _run(block: Block, tmp_path: Path) -> None:
    if "transformers" in block.code and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs transformers (pip install .[hf])")
    script = tmp_path / f"readme_{block.line}.py"
    script.write_text(block.code)
    if block.nproc is None:
        cmd = [sys.executable, str(script)]
    else:
        torchrun = Path(sys.executable).with_name("torchrun")  # .venv/bin/torchrun
        cmd = (
            [str(torchrun)]
            if torchrun.exists()
            else [sys.executable, "-m", "torch.distributed.run"]
        )
        cmd += ["--nproc-per-node", str(block.nproc), "--master-addr", "127.0.0.1"]
        cmd += ["--master-port", str(_free_port()), str(script)]
    # own session, so a timeout kills torchrun's workers too
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"README.md:{block.line} ({block.heading}) ran over {TIMEOUT_S} s: {' '.join(cmd)}\n"
            f"--- stdout ---\n{out}\n--- stderr ---\n{err[-20000:]}"
        )
    print(out)
    assert proc.returncode == 0, (
        f"README.md:{block.line} ({block.heading}) exited {proc.returncode}: {' '.join(cmd)}\n"
        f"--- stdout ---\n{out}\n--- stderr ---\n{err[-20000:]}"
    )
    # a print whose comment shows its output (`print(x.shape)  # torch.Size([...])`) shows it
    shown = [m.group(1).strip() for m in PRINTED_RE.finditer(block.code)]
    missing = [want for want in shown if want not in out.splitlines()]
    assert not missing, f"README.md:{block.line}: printed {out!r}, its comments say {missing}"


def _params():
    for b in PYTHON:
        marks = []
        if b.nproc is not None:
            marks += [pytest.mark.multiproc, pytest.mark.slow]
        elif "transformers" in b.code:  # building and loading a model takes ~10 s on 2 cores
            marks.append(pytest.mark.slow)
        yield pytest.param(b, id=b.id, marks=marks)


@pytest.mark.parametrize("block", list(_params()))
def test_readme_python_block_runs(block, tmp_path):
    _run(block, tmp_path)


def test_readme_has_runnable_blocks_and_recipes():
    assert len(PYTHON) >= 5, [b.id for b in PYTHON]
    assert sum(len(PRINTED_RE.findall(b.code)) for b in PYTHON) >= 2  # shown outputs: checked
    ids = [b.id for b in PYTHON]
    assert len(set(ids)) == len(ids), ids
    for heading, needles in RECIPES.items():
        found = [b for b in PYTHON if b.heading == heading]
        assert found, f"README.md has no python block under the heading {heading!r}"
        missing = [n for n in needles if n not in found[0].code]
        assert not missing, f"{heading!r}: its block lacks {missing}"


def test_readme_torchrun_blocks_are_marked():
    """A block that initialises a process group must say how to launch it."""
    for b in PYTHON:
        if "init_process_group" in b.code:
            assert b.nproc is not None and b.nproc >= 2, (
                f"README.md:{b.line}: starts a process group but its first line is not "
                f"'# torchrun --nproc-per-node N'"
            )
