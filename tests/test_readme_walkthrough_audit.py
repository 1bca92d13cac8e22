"""README walkthrough audit: behaviours a user acts on that the README stated incompletely.

Each test pins the code's behaviour and the README sentence that now describes it (all three
findings were documentation gaps, not code bugs). Fast: no model, no process.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _prose(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_warm_start_lives_beside_rlhf_kernels_tiny(monkeypatch, tmp_path):
    # README said "~/.cache/rlhf-kernels/tiny-v1-sft-v1 or $RLHF_KERNELS_WARM_START"; with only
    # $RLHF_KERNELS_TINY set the warm start (and the default prompts) go beside the tiny model.
    from trainers import tiny, warm_start

    monkeypatch.delenv("RLHF_KERNELS_WARM_START", raising=False)
    monkeypatch.setenv("RLHF_KERNELS_TINY", str(tmp_path / "mytiny"))
    assert tiny.default_path() == tmp_path / "mytiny"
    assert warm_start.default_path() == tmp_path / "mytiny-sft-v1"
    monkeypatch.setenv("RLHF_KERNELS_WARM_START", str(tmp_path / "ws"))
    assert warm_start.default_path() == tmp_path / "ws"
    assert "`$RLHF_KERNELS_TINY-sft-v1` when that is set" in _prose(README)


class _ByteTok:
    """Enough of a tokenizer for the plain-text path: bytes, no BOS, EOS 300."""

    eos_token_id = 300

    def encode(self, text, add_special_tokens=True):
        return list(text.encode())


def test_sft_drops_a_sample_whose_prompt_fills_max_len():
    # README said only that a sample longer than --max-len "keeps its start and loses its EOS";
    # one whose prompt alone fills --max-len is dropped (and counted) instead.
    from trainers.sft import SFTConfig, tokenize

    cfg = SFTConfig(max_len=4)
    rows = [
        {"prompt": "abcdef", "response": "x"},  # prompt fills max_len: dropped
        {"prompt": "ab", "response": "xyzw"},  # cut: keeps its start, no EOS
        {"prompt": "a", "response": "b"},  # fits
    ]
    samples, dropped = tokenize(rows, _ByteTok(), cfg)
    assert dropped == 1 and len(samples) == 2
    assert samples[0].ids.tolist() == [97, 98, 120, 121]
    assert samples[1].ids.tolist() == [97, 98, 300]
    assert "one whose prompt alone fills `--max-len`" in _prose(README)


def test_ppo_takes_the_sft_flags_but_output_key(capsys):
    # README said "The trainer takes the SFT trainer's flags plus ..."; --output-key is SFT's only.
    from trainers.cli import build_parser
    from trainers.ppo import PPOConfig
    from trainers.sft import SFTConfig

    sft, ppo = build_parser(SFTConfig), build_parser(PPOConfig)
    sft_flags = {s for a in sft._actions for s in a.option_strings}
    ppo_flags = {s for a in ppo._actions for s in a.option_strings}
    assert sft_flags - ppo_flags == {"--output-key"}
    with pytest.raises(SystemExit):
        ppo.parse_args(["--output-key", "answer"])
    assert "unrecognized arguments: --output-key" in capsys.readouterr().err
    assert "flags (all but `--output-key`" in _prose(README)
