"""Writes the bundled toy jsonl files next to this script; deterministic (fixed seeds, no I/O in).

``python trainers/data/make_toy_data.py`` rewrites them; ``--check`` only compares and exits 1 if a
committed file differs from what this script makes. Changing the output changes the tokenizer
that ``trainers.tiny`` trains on these files: bump ``TINY_VERSION`` there when you do.
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SENTENCES = [
    "the quick brown fox jumps over the lazy dog.",
    "a small model learns simple rules from many short examples.",
    "packing puts several samples into one row so no step is spent on padding.",
    "rain fell on the old harbour while the boats rocked slowly.",
    "every rank holds a slice of the sequence and passes keys around the ring.",
]
REFUSAL = "I don't know."


def _word(rng: random.Random, lo: int = 3, hi: int = 8) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(lo, hi)))


def _task(rng: random.Random, kinds: list[str]) -> tuple[str, str]:
    """One (prompt, answer) of a kind drawn from ``kinds``."""
    kind, w = rng.choice(kinds), _word(rng)
    if kind == "reverse":
        return f"reverse: {w}", w[::-1]
    if kind == "sort":
        return f"sort: {w}", "".join(sorted(w))
    if kind == "upper":
        return f"upper: {w}", w.upper()
    if kind == "count":
        return f"count: {w}", str(len(w))
    if kind == "first":
        return f"first letter: {w}", w[0]
    raise ValueError(kind)


def _long(rng: random.Random) -> tuple[str, str]:
    """A long prompt (a sentence repeated 1-12 times, long-tailed) whose answer is its last word."""
    k = min(12, 1 + int(rng.expovariate(0.35)))
    w = _word(rng)
    return f"last word: {' '.join([rng.choice(SENTENCES)] * k)} {w}", w


def sft_rows(n: int = 2000, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    kinds = ["reverse", "sort", "upper", "count", "first"]
    rows = []
    for _ in range(n):
        prompt, answer = _long(rng) if rng.random() < 0.12 else _task(rng, kinds)
        rows.append({"prompt": prompt, "response": answer})
    return rows


def preference_rows(n: int = 2000, seed: int = 2) -> list[dict]:
    """chosen = the correct letters; rejected = digits (1.0), '?'s (1.5), a refusal (2.0) or, for
    10% of rows, the input word copied unchanged (0.5; the one hard case)."""
    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        prompt, answer = _task(rng, ["reverse", "sort", "upper"])
        word = prompt.split(": ", 1)[1]
        u = rng.random()
        if u < 0.1:
            rejected, margin = word, 0.5
            if rejected == answer:
                continue
        elif u < 0.55:
            rejected, margin = "".join(rng.choice(string.digits) for _ in answer), 1.0
        elif u < 0.8:
            rejected, margin = "?" * len(answer), 1.5
        else:
            rejected, margin = REFUSAL, 2.0
        rows.append({"prompt": prompt, "chosen": answer, "rejected": rejected, "margin": margin})
    return rows


def prompt_rows(n: int = 1000, seed: int = 3) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        w = _word(rng, 3, 6)
        rows.append({"prompt": f"reverse: {w}", "target": w[::-1]})
    return rows


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


FILES = {
    "sft_toy.jsonl": sft_rows,
    "preference_toy.jsonl": preference_rows,
    "prompts_toy.jsonl": prompt_rows,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    p.add_argument("--out", type=Path, default=HERE, help="output folder (default: this folder)")
    args = p.parse_args(argv)
    stale = []
    if not args.check:  # a new --out folder (writing into it raised FileNotFoundError)
        args.out.mkdir(parents=True, exist_ok=True)
    for name, make in FILES.items():
        path, text = args.out / name, render(make())
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
            continue
        path.write_text(text, encoding="utf-8")
        print(f"{path}: {text.count(chr(10))} rows, {len(text.encode())} bytes")
    if stale:
        print(f"out of date: {stale}; run {Path(__file__).name}", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
