"""Contract checks of trainers.data / trainers.config / trainers.cli that the other tests left
open (found by mutation testing): holdout order and determinism, chat prompts, the CLI's 'null',
YAML keys, ``is_set`` and prompt templates that ``str.format`` cannot apply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import pytest

from trainers import data
from trainers.cli import is_set, parse_config
from trainers.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


class _Tok:
    eos_token_id = 1
    chat_template = "unused"


@dataclass
class _Cfg:
    a: int = 0
    name: str | None = None
    tags: list = field(default_factory=list, metadata={"cli": False})


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def _exit2(capsys, cls, argv) -> str:
    with pytest.raises(SystemExit) as e:
        parse_config(cls, argv, prog="t")
    assert e.value.code == 2
    return capsys.readouterr().err


# ----------------------------------------------------------------------------- holdout
def test_holdout_keeps_the_original_row_order():
    """Both parts keep the rows' order (the docstring's promise), the holdout too."""
    ds = datasets.Dataset.from_dict({"i": list(range(40)), "t": [f"r{i}" for i in range(40)]})
    train, held = data.split_train_eval(ds, None, 0.3, seed=3)
    kept, out = list(train["i"]), list(held["i"])
    assert len(out) == 12 and out == sorted(out) and kept == sorted(kept)
    assert sorted(kept + out) == list(range(40))


_SPLIT = """
import json, sys
import datasets
datasets.config.HF_DATASETS_CACHE = sys.argv[2]
from trainers import data
rows = data.load_mixture(sys.argv[1], "0.3,0.7", "train", 7, None)
train, held = data.split_train_eval(rows, None, 0.25, 7, ["prompt"])
print(json.dumps([list(train["prompt"]), list(held["prompt"])]))
"""


def test_mixture_and_holdout_agree_across_processes(tmp_path):
    """Every rank mixes and splits on its own: other hash seeds must give the same rows."""
    files = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"{name}{i}"}) + "\n" for i in range(9)))
        files.append(str(path))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _SPLIT, ",".join(files), str(tmp_path / f"cache{h}")],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": str(h)},
        )
        for h in (1, 2)
    ]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    train, held = json.loads(outs[0])
    assert outs[0] == outs[1] and held and not set(train) & set(held)


# ----------------------------------------------------------------------------- prompts
def test_a_chat_prompt_refuses_an_input_template():
    """Chat messages need --apply-chat-template and no --input-template (refused before the
    tokenizer is used)."""
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="no --input-template"):
        data.render_prompt(None, chat, "Q: {}", True)
    with pytest.raises(ValueError, match="no --input-template"):
        data.render_response(_Tok(), chat, "a", "Q: {}", True)


@pytest.mark.parametrize("template", ["{.x}", "{0.x}", "{[a]}", "{.upper}", "{[0]}"])
def test_a_template_that_does_not_place_the_prompt_is_a_value_error(template, capsys):
    """Attribute / item lookups fail (or do not show the prompt) as a ValueError naming the
    flag, so the CLI exits 2 with one line instead of a traceback."""
    with pytest.raises(ValueError, match="--input-template"):
        data.check_template(template, "--input-template")
    assert "--input-template" in _exit2(capsys, TrainConfig, ["--input-template", template])
    data.check_template("{0!r}: {0:>20}")  # a conversion or format spec still places it


# ----------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "name", ["batch_size", "micro_batch_tokens", "max_len", "ring_attn_size", "tp_size", "epochs"]
)
def test_positive_int_flags_refuse_zero(name):
    with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} must be >= 1, got 0"):
        TrainConfig(**{name: 0}).validate()


# ----------------------------------------------------------------------------- cli
@pytest.mark.parametrize("text", ["none", "null", " NULL ", "None"])
def test_a_flag_unsets_with_none_or_null(tmp_path, text):
    cfg = parse_config(_Cfg, ["--config", _yaml(tmp_path, "name: x"), "--name", text])
    assert cfg.name is None


def test_a_yaml_key_given_twice_is_refused(tmp_path, capsys):
    """'a' and its dashed spelling are one key: which one wins would be arbitrary."""
    err = _exit2(capsys, TrainConfig, ["--config", _yaml(tmp_path, "max_len: 8\nmax-len: 9\n")])
    assert "key 'max-len' is given twice" in err


def test_a_yaml_key_without_a_flag_type_is_unknown(tmp_path, capsys):
    """A field whose type has no flag (``cli: False``, list) is no YAML key either."""
    err = _exit2(capsys, _Cfg, ["--config", _yaml(tmp_path, "tags: [x]")])
    assert "unknown key 'tags'; valid keys: a, name" in err


def test_is_set_flag_at_default_yes_yaml_at_default_no(tmp_path):
    assert is_set(parse_config(_Cfg, ["--a", "0"]), "a")
    assert not is_set(parse_config(_Cfg, ["--config", _yaml(tmp_path, "a: 0")]), "a")
    assert is_set(parse_config(_Cfg, ["--config", _yaml(tmp_path, "a: 3")]), "a")
    assert is_set(_Cfg(a=3), "a") and not is_set(_Cfg(), "a")
