"""The bundled default model: a tiny Llama and a byte-level BPE tokenizer, built offline.

``ensure_tiny()`` builds both once (about a second on CPU) from the toy jsonl files in
``trainers/data`` and afterwards only returns the folder. Builds are deterministic: the same files
give the same ``tokenizer.json`` and bit-identical float32 weights. Special token ids:
``<|bos|>`` 0, ``<|eos|>`` 1, ``<|pad|>`` 2, ``<|user|>`` 3, ``<|assistant|>`` 4, ``<|system|>`` 5.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

TINY_VERSION = "tiny-v1"
VOCAB_SIZE = 512
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
USER, ASSISTANT, SYSTEM = "<|user|>", "<|assistant|>", "<|system|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT, SYSTEM]
REQUIRED_FILES = ("config.json", "tokenizer.json")
DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_FILES = ("sft_toy.jsonl", "preference_toy.jsonl", "prompts_toy.jsonl", "toy_corpus.jsonl")

# <|bos|><|user|>hi<|assistant|>ho<|eos|>... ; a generation prompt ends with <|assistant|>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{% elif m['role'] == 'assistant' %}<|assistant|>"
    "{% elif m['role'] == 'system' %}<|system|>"
    "{% else %}{{ raise_exception('unknown role: ' ~ m['role']) }}{% endif %}"
    "{{ m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_INIT_LOCK = threading.Lock()  # weight init seeds the process-global RNG


def default_path() -> Path:
    """``$RLHF_KERNELS_TINY`` or ``~/.cache/rlhf-kernels/tiny-v1``."""
    env = os.environ.get("RLHF_KERNELS_TINY")
    return Path(env) if env else Path.home() / ".cache" / "rlhf-kernels" / TINY_VERSION


def is_complete(path: str | os.PathLike) -> bool:
    return all((Path(path) / f).is_file() for f in REQUIRED_FILES)


def ensure_tiny(path: str | os.PathLike | None = None) -> str:
    """Return a folder holding the tiny model and tokenizer, building it on first use.

    The build goes to a temporary sibling folder renamed into place, so concurrent callers (e.g.
    torchrun ranks) never see a partial folder; the loser of the rename race uses the winner's.
    """
    dst = Path(path).expanduser() if path is not None else default_path()
    if is_complete(dst):
        return str(dst)
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(
            f"path {str(dst)!r}: expected a tiny-model folder with {list(REQUIRED_FILES)} or no "
            f"folder, got a non-empty folder without them; delete it or pick another path"
        )
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.tmp-", dir=dst.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache folder is meant to be shared
        _build(tmp)
        try:
            os.replace(tmp, dst)  # atomic; fails if another builder already put a folder there
        except OSError:
            if not is_complete(dst):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dst)


def _corpus() -> Iterator[str]:
    """Every string value of every row of the bundled jsonl files, in file order."""
    for name in CORPUS_FILES:
        with open(DATA_DIR / name, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield from (v for v in json.loads(line).values() if isinstance(v, str))


def build_tokenizer():
    """Byte-level BPE (``VOCAB_SIZE`` ids, specials first) wrapped as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=[USER, ASSISTANT, SYSTEM],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1024,
    )


def build_model(tokenizer):
    """A 2-layer, 64-wide Llama (158,016 parameters) with seed-0 float32 weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.to(torch.float32)


def _build(dst: Path) -> None:
    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(dst)
    tokenizer.save_pretrained(dst)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Build (once) and print the tiny model folder.")
    p.add_argument("--path", default=None, help="folder (default: $RLHF_KERNELS_TINY or cache)")
    print(ensure_tiny(p.parse_args(argv).path))


if __name__ == "__main__":
    main()
