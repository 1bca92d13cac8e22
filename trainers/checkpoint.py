"""Resumable checkpoints that a crash cannot corrupt.

``<output_dir>/checkpoints/step-000003/`` holds the DeepSpeed engine (model, optimizer, scheduler:
``engine.save_checkpoint``), ``trainer_state.json`` (step, data position) and every rank's RNG
states. A checkpoint is written into ``.tmp-step-000003`` and renamed into place by rank 0 only
after every rank has finished writing; the rename is the commit. A save that dies midway leaves
a ``.tmp-*`` folder that resume ignores (and the next save removes), so the previous checkpoint
stays usable; a save failing on any rank stops every rank with that rank's error. Resume takes
the newest ``step-*`` folder. With ``keep`` (``--save-total-limit``) only that many committed
folders stay: older ones are renamed to ``.del-step-*`` (atomically, so a half-deleted folder is
never taken for a checkpoint) and then deleted. ``--output-dir`` must be on a file system every
node sees (as for DeepSpeed checkpoints in general).
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

# step-N, or .old-step-N: a committed folder set aside by a re-save of step N (commit_folder)
_STEP_DIR = re.compile(r"^(\.old-)?step-(\d+)$")
_TAG = "engine"


def checkpoint_root(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / "checkpoints"


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The newest committed ``step-N`` folder, or None. A re-save of step N that crashed between
    its two renames left its previous copy as ``.old-step-N`` only: that one is taken then."""
    root = checkpoint_root(output_dir)
    if not root.is_dir():
        return None
    found = [
        (int(m.group(2)), m.group(1) is None, p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name)) and (p / "trainer_state.json").is_file()
    ]
    return max(found)[2] if found else None


def read_state(path: Path) -> dict:
    """``path/trainer_state.json`` as a dict with an integer ``step``; ValueError naming the
    file when it is unreadable or malformed."""
    file = path / "trainer_state.json"
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume: {file} is unreadable ({e}): {_DELETE_IT}") from None
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:  # true is no step
        raise ValueError(f"--resume: {file} has no integer 'step' >= 0: {_DELETE_IT}")
    for key in ("layout", "data"):  # what check_layout / check_data compare
        if state.get(key) is not None and not isinstance(state[key], dict):
            raise ValueError(f"--resume: {file} has a {key!r} that is no mapping: {_DELETE_IT}")
    return state


_DELETE_IT = "delete that checkpoint folder to resume from an earlier one (or start fresh)"


def check_complete(path: Path, tags: list[str], rank: int) -> None:
    """ValueError unless ``path`` holds a readable state, the engine folders ``tags`` and this
    rank's RNG state (a folder damaged after its commit, e.g. by a partial copy)."""
    read_state(path)
    missing = [t for t in tags if not (path / t).is_dir()]
    if not (path / f"rng_rank{rank}.pt").is_file():
        missing.append(f"rng_rank{rank}.pt (saved by a different number of processes?)")
    if missing:
        raise ValueError(f"--resume: {path} is incomplete: no {', '.join(missing)}; {_DELETE_IT}")


def _rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class OtherRankFailed(RuntimeError):
    """Raised by :func:`agree` on the ranks that did not fail themselves."""


def agree(error: BaseException | None, what: str) -> None:
    """A barrier that also says whether ``what`` failed on any rank: the failing rank re-raises
    its own error, every other rank raises :class:`OtherRankFailed` naming that rank and error
    (a rank failing in a rank-0-only step, a full disk, never leaves the others waiting)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        if error is not None:
            raise error
        return
    msgs: list = [None] * dist.get_world_size()
    dist.all_gather_object(msgs, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    bad = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if bad:
        raise OtherRankFailed(f"{what} failed on rank {bad[0][0]}: {bad[0][1]}")


def save_checkpoint(
    engines, output_dir: str | os.PathLike, step: int, state: dict, keep: int = 0
) -> Path:
    """Collective: every rank calls it. ``engines``: one DeepSpeed engine, or ``{tag: engine}``
    (PPO's actor and critic). ``keep`` > 0: after the commit, keep this folder and the newest
    others up to ``keep`` in all, delete the rest (0: keep all). Returns the committed folder."""
    if not isinstance(engines, dict):
        engines = {_TAG: engines}
    rank = dist.get_rank() if dist.is_initialized() else 0
    root = checkpoint_root(output_dir)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    what = f"saving checkpoint {final}"
    error = None
    if rank == 0:
        try:
            for pattern in (".tmp-step-*", ".del-step-*"):  # an interrupted save / prune left them
                for stale in root.glob(pattern) if root.is_dir() else []:
                    shutil.rmtree(stale, ignore_errors=True)
            for old in root.glob(".old-step-*") if root.is_dir() else []:
                if (root / old.name[len(".old-") :] / "trainer_state.json").is_file():
                    shutil.rmtree(old, ignore_errors=True)  # replaced: its re-save committed
            tmp.mkdir(parents=True)
        except Exception as e:
            error = e
    agree(error, what)
    # not guarded: DeepSpeed's save has barriers of its own, which a rank waiting in agree()
    # would not match; a rank failing in there exits, and its peers' collectives fail with it
    for tag, engine in engines.items():
        engine.save_checkpoint(str(tmp), tag=tag, save_latest=False)
    try:
        torch.save(_rng_state(), tmp / f"rng_rank{rank}.pt")
    except Exception as e:
        error = e
    agree(error, what)  # every rank's files are on disk
    if rank == 0:
        try:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=1))
            commit_folder(tmp, final)  # a re-save of the same step (a resumed run) replaces it
            if keep > 0:
                prune_checkpoints(root, keep, final)
        except Exception as e:
            error = e
    agree(error, what)
    return final


def prune_checkpoints(root: Path, keep: int, newest: Path) -> list[Path]:
    """Delete the checkpoints of ``root`` beyond ``newest`` and the next newest ``keep - 1``;
    returns the deleted paths. Checkpoints: committed ``step-N`` folders and ``.old-step-N``
    ones left alone by a crashed re-save (what :func:`latest_checkpoint` can take); folders
    without a state file are neither counted nor deleted. Each is renamed to ``.del-step-N``
    first: a crash midway leaves a folder resume ignores (the next save removes it)."""
    others = sorted(
        (int(m.group(2)), p)
        for p in root.iterdir()
        if (m := _STEP_DIR.match(p.name))
        and p != newest
        and (p / "trainer_state.json").is_file()
        and (m.group(1) is None or not (root / p.name[len(".old-") :]).exists())
    )
    doomed = [p for _, p in others[: max(0, len(others) - (keep - 1))]]
    for p in doomed:
        gone = p.with_name(f".del-{p.name.removeprefix('.old-')}")
        os.replace(p, gone)
        shutil.rmtree(gone, ignore_errors=True)
    return doomed


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_folder(tmp: Path, final: Path) -> None:
    """Rename the complete folder ``tmp`` to ``final``, durably: every file and folder under
    ``tmp`` is flushed to disk first (a power loss after the rename cannot leave a committed
    folder of empty files), then the rename and its parent folder. An existing ``final`` is
    moved to ``.old-<name>`` first and deleted last: a crash at any point leaves a whole copy
    (:func:`latest_checkpoint` finds ``.old-step-N``), and a failed rename puts the old one back."""
    for folder, _, files in os.walk(tmp):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))
    old = final.with_name(f".old-{final.name}")
    moved = final.exists()
    if moved:
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:  # an OSError, or an interrupt between the two renames
        if moved:
            os.replace(old, final)
        raise
    _fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


_FLAG = {  # a layout key -> what the user sets
    "processes": "torchrun process count",
    "ring": "--ring-attn-size",
    "tp": "--tp-size",
    "zero_stage": "--zero-stage",
    "dtype": "--dtype",
    "offload": "--offload",
}


def check_layout(path: Path, layout: dict) -> None:
    """ValueError unless the checkpoint in ``path`` was saved by the same process layout
    (``layout``: sizes, ZeRO stage, dtype, optimizer offload and, for PPO, whether a critic is
    trained, as the trainer saved them in its state; keys a checkpoint lacks are not compared)."""
    saved = read_state(path).get("layout")
    if saved is None:
        return
    differ = [k for k in layout if k in saved and saved[k] != layout[k]]
    if differ:

        def show(x: dict) -> str:
            return ", ".join(f"{k} {x[k]}" for k in layout if k in saved)

        # dp follows from the process count, ring and TP sizes: named only by them
        names = [_FLAG[k] for k in differ if k in _FLAG]
        fixes = ["the checkpoint's " + ", ".join(dict.fromkeys(names))] if names else []
        if "critic" in differ:  # PPO: the checkpoint holds a critic engine or none
            fixes.append(
                "--advantage-estimator gae (the checkpoint holds a critic)"
                if saved["critic"]
                else "an --advantage-estimator other than gae (the checkpoint holds no critic)"
            )
        fix = " and ".join(fixes)
        raise ValueError(
            f"--resume: {path} was saved by a run with {show(saved)}; this run has "
            f"{show(layout)}: resume with {fix}"
        )


def check_data(path: Path, data: dict) -> None:
    """ValueError unless this run's data flags (``data``: flag -> value, as the trainer saved
    them) are the checkpoint's: a resumed run repeats the checkpoint's run step for step, so a
    changed dataset, key, template, batch size or seed would silently make another run. Keys a
    checkpoint lacks are not compared."""
    saved = read_state(path).get("data")
    differ = [k for k in data if saved is not None and k in saved and saved[k] != data[k]]
    for key in ("dataset", "eval_dataset"):  # compared by content where both have a digest
        digest = key + "_sha256"
        if digest not in differ:
            if saved and saved.get(digest) and saved.get(digest) == data.get(digest):
                differ = [k for k in differ if k != key]  # the same files, moved
            continue
        differ.remove(digest)
        if key not in differ and data.get(digest):  # same path, other bytes
            raise ValueError(
                f"--resume: the files of --{key.replace('_', '-')} {data[key]} changed since "
                f"{path} was saved (sha256 {saved[digest][:12]}.. then, {data[digest][:12]}.. "
                f"now): the resumed steps would train on other samples; restore them, or start "
                f"a new run (--overwrite or another --output-dir)"
            )
    if differ:

        def show(x: dict) -> str:
            return ", ".join(_as_flag(k, x[k]) for k in differ)

        raise ValueError(
            f"--resume: {path} was saved by a run with {show(saved)}; this run has {show(data)}: "
            f"resume with the checkpoint's values (or start a new run: --overwrite or another "
            f"--output-dir)"
        )


def _as_flag(key: str, value) -> str:
    """How a user writes ``key=value`` on the command line (``no --flag`` when unset / off)."""
    flag = "--" + key.replace("_", "-")
    if value is None or value is False:
        return f"no {flag}"
    return flag if value is True else f"{flag} {shlex.quote(str(value))}"


def load_checkpoint(engine, path: Path, tag: str = _TAG, rng: bool = True) -> dict:
    """Restore ``engine`` (model, optimizer, scheduler) from ``tag`` and, with ``rng``, this
    rank's RNG; returns the trainer state (``step`` and what the trainer saved)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    try:
        load_path, _ = engine.load_checkpoint(str(path), tag=tag)
    except (RuntimeError, AssertionError, OSError, KeyError, ValueError) as e:
        raise ValueError(
            f"--resume: DeepSpeed could not load {tag!r} from {path} ({type(e).__name__}: "
            f"{str(e)[:300]}): the folder is damaged or was saved from another model; "
            f"{_DELETE_IT}"
        ) from e
    if load_path is None:
        raise ValueError(f"--resume: DeepSpeed could not load {tag!r} from {path}; {_DELETE_IT}")
    if not rng:
        return read_state(path)
    rng = path / f"rng_rank{rank}.pt"
    if not rng.is_file():
        raise ValueError(
            f"{path} has no RNG state for rank {rank}: was it saved with a different number of "
            f"processes? (resume with the same torchrun layout)"
        )
    _set_rng_state(torch.load(rng, weights_only=False))
    return read_state(path)
