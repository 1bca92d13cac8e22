"""Reward functions for ``trainers.ppo --reward-fn module:function``, and the toy task's.

A reward function is called as ``fn(prompts=[...], responses=[...], **columns)`` (one entry per
response; ``columns`` are the prompt dataset's other columns, repeated per sample) and returns
one finite number per response. ``score`` checks that contract and names the function when it is
broken.
"""

from __future__ import annotations

import importlib
import math
from collections import Counter
from collections.abc import Callable, Sequence

import torch


def load_reward_fn(spec: str) -> Callable:
    """``"package.module:function"`` -> the function (ValueError naming the spec otherwise)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"--reward-fn must look like 'module:function', got {spec!r}")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"--reward-fn {spec!r}: cannot import {module!r} ({e})") from None
    fn = getattr(mod, name, None)
    if fn is None:
        raise ValueError(f"--reward-fn {spec!r}: module {module!r} has no {name!r}")
    if not callable(fn):
        raise ValueError(f"--reward-fn {spec!r}: {name!r} is a {type(fn).__name__}, not callable")
    return fn


def score(
    fn: Callable, name: str, prompts: Sequence[str], responses: Sequence[str], columns: dict
) -> list[float]:
    """Call ``fn`` and return its rewards as floats; ValueError naming ``name`` when it raises or
    returns the wrong count, None, NaN/inf or a non-number."""
    try:
        out = fn(prompts=list(prompts), responses=list(responses), **columns)
    except Exception as e:  # noqa: BLE001 - reported with the function's name
        raise ValueError(f"reward function {name} raised {type(e).__name__}: {e}") from e
    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().reshape(-1).tolist()
    try:
        out = list(out)
    except TypeError:
        raise ValueError(
            f"reward function {name} must return a sequence of {len(responses)} numbers, got "
            f"{type(out).__name__}"
        ) from None
    if len(out) != len(responses):
        raise ValueError(
            f"reward function {name} returned {len(out)} rewards for {len(responses)} responses"
        )
    values = []
    for i, v in enumerate(out):
        try:
            f = float(v)
        except (TypeError, ValueError):
            f = None
        if f is None or not math.isfinite(f):
            raise ValueError(
                f"reward function {name} returned {v!r} for response #{i}: expected a finite number"
            )
        values.append(f)
    return values


# ----------------------------------------------------------------------------- the toy task
def _chars(text: str) -> str:
    return text.strip()


def reverse_reward(prompts, responses, target, **_) -> list[float]:
    """Per-character score of "reverse: <word>" answers, in [0, 1]: matching positions divided
    by ``max(len(target), len(response))`` (extra characters cost, an empty answer scores 0)."""
    out = []
    for resp, tgt in zip(responses, target):
        r, t = _chars(resp), _chars(tgt)
        hits = sum(a == b for a, b in zip(r, t))
        out.append(hits / max(len(r), len(t), 1))
    return out


def letters_reward(prompts, responses, target, **_) -> list[float]:
    """A smoother variant: half the multiset overlap of the answer's characters with the
    target's (divided by the longer length), half ``reverse_reward``."""
    out = []
    for resp, tgt, exact in zip(responses, target, reverse_reward(prompts, responses, target)):
        r, t = _chars(resp), _chars(tgt)
        overlap = sum((Counter(r) & Counter(t)).values()) / max(len(r), len(t), 1)
        out.append(0.5 * overlap + 0.5 * exact)
    return out
