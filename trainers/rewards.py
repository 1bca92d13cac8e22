"""Reward functions for ``trainers.ppo --reward-fn module:function``, and the toy task's.

A reward function is called as ``fn(prompts=[...], responses=[...], **columns)``: ``responses``
are decoded texts, ``columns`` the prompt dataset's other columns (one entry per response, e.g.
``target``). It returns one finite number per response. :func:`score` checks that contract and
names the function when it is broken.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections import Counter
from collections.abc import Callable, Mapping, Sequence, Set


def load_reward_fn(spec: str) -> Callable:
    """``"package.module:function"`` (or ``module:Class.method``) -> the callable.

    ValueError naming the spec when it is malformed, the module cannot be imported, the
    attribute is missing or it is not callable.
    """
    module, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not sep or not module.strip() or not attr.strip():
        raise ValueError(f"--reward-fn: expected 'module:function', got {spec!r}")
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and (module == e.name or module.startswith(e.name + ".")):
            raise ValueError(
                f"--reward-fn {spec!r}: module {module!r} not found (cannot import {e.name!r})"
            ) from None
        raise ValueError(  # the module exists but imports something missing
            f"--reward-fn {spec!r}: cannot import module {module!r}: {type(e).__name__}: {e}"
        ) from e
    except Exception as e:  # a broken module: SyntaxError, an error at import time, ...
        raise ValueError(
            f"--reward-fn {spec!r}: cannot import module {module!r}: {type(e).__name__}: {e}"
        ) from e
    path = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--reward-fn {spec!r}: {path!r} has no {part!r}")
        obj, path = getattr(obj, part), f"{path}.{part}"
    if not callable(obj):
        raise ValueError(
            f"--reward-fn {spec!r}: expected a callable, got {attr!r} of type {type(obj).__name__}"
            " (not callable)"
        )
    return obj


def _as_number(v) -> float | None:
    """``v`` as a Python float (0-d tensors/arrays and numpy scalars are unwrapped with
    ``.item()``), or None when ``v`` is not a real number or has no float (``10**400``)."""
    if getattr(v, "ndim", None) == 0 and hasattr(v, "item"):  # 0-d tensor/array, numpy scalar
        v = v.item()
    if not isinstance(v, numbers.Real):  # bool is an int, so a Real
        return None
    try:
        return float(v)
    except (OverflowError, ValueError, TypeError):
        return None


def score(
    fn: Callable,
    name: str,
    prompts: Sequence[str],
    responses: Sequence[str],
    columns: Mapping[str, Sequence],
) -> list[float]:
    """``fn(prompts=prompts, responses=responses, **columns)`` as N = len(responses) floats.

    ValueError naming ``name`` when ``fn`` raises, or returns something other than a sequence
    (list, tuple, 1-D tensor/array) of N finite real numbers (None, NaN, inf, strings fail).
    """
    n = len(responses)
    if len(prompts) != n:  # a reward function zipping the two would score shifted pairs
        raise ValueError(f"score: expected one prompt per response ({n}), got {len(prompts)}")
    for key, col in columns.items():
        if len(col) != n:
            raise ValueError(
                f"score: column {key!r}: expected one entry per response ({n}), got {len(col)}"
            )
    try:
        out = fn(prompts=list(prompts), responses=list(responses), **columns)
    except Exception as e:  # reported with the function's name
        raise ValueError(f"reward function {name} raised {type(e).__name__}: {e}") from e
    unordered = isinstance(out, (str, bytes, Mapping, Set))  # a set's order is not the responses'
    if getattr(out, "ndim", 1) != 1 or unordered:
        shape = tuple(getattr(out, "shape", ())) if hasattr(out, "ndim") else None
        raise ValueError(
            f"reward function {name} must return a sequence of {n} numbers, got "
            f"{type(out).__name__}" + (f" of shape {shape}" if shape is not None else "")
        )
    try:
        it = iter(out)
    except TypeError:
        raise ValueError(
            f"reward function {name} must return a sequence of {n} numbers, got "
            f"{type(out).__name__}"
        ) from None
    try:  # a lazy result (generator, map) runs the function's code here
        out = list(it)
    except Exception as e:
        raise ValueError(f"reward function {name} raised {type(e).__name__}: {e}") from e
    if len(out) != n:
        raise ValueError(f"reward function {name} returned {len(out)} rewards for {n} responses")
    values = []
    for i, v in enumerate(out):
        x = _as_number(v)
        if x is None or not math.isfinite(x):
            raise ValueError(
                f"reward function {name} returned {v!r} for response #{i}: expected a finite number"
            )
        values.append(x)
    return values


# ----------------------------------------------------------------------------- the toy task
def _check_targets(fn: str, responses, target) -> None:
    for key, v in (("responses", responses), ("target", target)):
        if isinstance(v, str):  # one string would be read as one entry per character
            raise ValueError(f"{fn}: {key}: expected a list of strings, got the str {v!r:.80}")
    if len(target) != len(responses):
        raise ValueError(
            f"{fn}: target: expected one entry per response ({len(responses)}), got {len(target)}"
        )


def _position_score(response: str, target: str) -> float:
    r, t = response.strip(), target.strip()
    hits = sum(a == b for a, b in zip(r, t))
    return hits / max(len(r), len(t), 1)


def reverse_reward(prompts, responses, target, **_) -> list[float]:
    """Per-character score in [0, 1] of "reverse: <word>" answers.

    After stripping surrounding whitespace from both: the number of positions ``i`` where
    ``response[i] == target[i]`` divided by ``max(len(target), len(response))``; so extra or
    missing characters cost, and an empty answer scores 0 (also for an empty target: nothing to
    reward). E.g. target "dcba": "dcba" 1.0, "dcbx" 0.75, "dc" 0.5, "dcbaaa" 4/6, "abcd" 0.0.
    """
    _check_targets("reverse_reward", responses, target)
    return [_position_score(r, t) for r, t in zip(responses, target)]


def letters_reward(prompts, responses, target, **_) -> list[float]:
    """A smoother shaping of :func:`reverse_reward`, in [0, 1].

    ``0.5 * overlap + 0.5 * reverse_reward``, where ``overlap`` is the multiset overlap of the
    (stripped) response's characters with the target's, divided by the longer length: the right
    letters in the wrong order earn half. E.g. target "dcba": "abcd" 0.5, "dcba" 1.0, "zzzz" 0.
    """
    _check_targets("letters_reward", responses, target)
    out = []
    for resp, tgt in zip(responses, target):
        r, t = resp.strip(), tgt.strip()
        overlap = sum((Counter(r) & Counter(t)).values()) / max(len(r), len(t), 1)
        out.append(0.5 * overlap + 0.5 * _position_score(r, t))
    return out
