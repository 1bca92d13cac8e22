"""Training metrics for people to read: ``metrics.jsonl`` always, plus TensorBoard or wandb, and
a PNG plot on ``close``. Only the rank built with ``enabled=True`` (rank 0) writes anything.

``metrics.jsonl`` holds one JSON object per ``log`` call, ``{"step": N, "key": value, ...}``,
values at full precision, flushed line by line so a crash keeps what was logged. NaN and
infinities are written as ``null`` (JSON has no NaN); TensorBoard and wandb get the float.
"""

from __future__ import annotations

import json
import math
import operator
import os
import secrets
from typing import Any

KINDS = ("tensorboard", "wandb", "none")
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


def read_metrics(path: str) -> list[dict[str, Any]]:
    """Records of a ``metrics.jsonl`` file (or of the one in folder ``path``) in file order.

    An unparsable last line (a write cut short by a crash) is dropped.
    """
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    with open(path) as fh:
        lines = fh.read().splitlines()
    last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
    out = []
    for i, line in enumerate(lines):  # i + 1: the file's line number, blank lines counted
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if i == last:
                break
            record = None
        if not isinstance(record, dict):  # valid JSON but no object ([1], 3) is no record
            raise ValueError(f"{path}:{i + 1}: expected a JSON object, got {line!r}")
        out.append(record)
    return out


def _number(key: str, value: Any) -> int | float:
    """Python int/float from a Python, numpy or one-element torch number."""
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        try:
            value = value.item()
        except (RuntimeError, ValueError):
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"metric {key!r}: expected a number, got {value!r}")
    return value


def _step(step: Any) -> int:
    """``step`` as an int: an optimizer step count (Python, numpy or integer-tensor int >= 0)."""
    boolean = isinstance(step, bool) or str(getattr(step, "dtype", "")) in ("bool", "torch.bool")
    try:  # (operator.index takes a bool tensor as 0 or 1)
        value = None if boolean else operator.index(step)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise ValueError(f"step: expected an integer >= 0, got {step!r}")
    return value


class MetricsLogger:
    """Writes ``<output_dir>/metrics.jsonl`` and the ``kind`` sink: ``"tensorboard"``
    (``<output_dir>/tensorboard``), ``"wandb"`` (offline unless ``WANDB_MODE`` says otherwise,
    files under ``<output_dir>/wandb``) or ``"none"``.

    ``resume=True`` keeps the earlier records of ``metrics.jsonl`` whose step is below the first
    step logged now; ``resume=False`` starts it afresh. TensorBoard hides earlier events from
    the first step logged now on.
    ``enabled=False`` (non-zero ranks) makes every method a no-op.
    """

    def __init__(
        self,
        output_dir: str,
        kind: str = "tensorboard",
        enabled: bool = True,
        run_name: str | None = None,
        config: dict | None = None,
        resume: bool = False,
    ) -> None:
        if kind not in KINDS:
            raise ValueError(f"kind: expected one of {KINDS}, got {kind!r}")
        self.output_dir, self.kind, self.enabled, self.resume = output_dir, kind, enabled, resume
        self.path = os.path.join(output_dir, METRICS_FILE)
        self._file = self._tb = self._wandb = None
        self._closed = self._started = self._wandb_resumed = False
        self._wandb_done = 0  # a resumed wandb run already holds the steps up to this one
        if not enabled:
            return
        os.makedirs(output_dir, exist_ok=True)
        if kind == "wandb":  # first: a missing or failing wandb leaves metrics.jsonl alone
            try:
                import wandb
            except ImportError as e:
                raise ImportError(
                    "--logger wandb needs the wandb package: `pip install wandb`, "
                    "or use --logger tensorboard"
                ) from e
            self._wandb = wandb.init(
                project="rlhf-kernels",
                dir=output_dir,
                mode=os.environ.get("WANDB_MODE", "offline"),
                name=run_name,
                config=config,
                **self._wandb_run(),
            )
        if not resume:
            self._file = open(self.path, "w")

    def _wandb_run(self) -> dict:
        """A fresh run gets a new id, kept in ``<output_dir>/wandb/run_id``; a resumed run
        continues the run of that id (one wandb run per training run). wandb drops steps below
        its last one, so the steps re-run after the checkpoint are not sent again: the crashed
        run logged them (a deterministic resume reproduces them; ``metrics.jsonl`` holds the
        re-run's values)."""
        path = os.path.join(self.output_dir, "wandb", "run_id")
        if self.resume and os.path.isfile(path):
            self._wandb_resumed = True
            with open(path) as fh:
                return {"id": fh.read().strip(), "resume": "allow"}
        run_id = secrets.token_hex(4)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(run_id)
        return {"id": run_id}

    def _open(self, step: int) -> None:
        """First ``log``: truncate a resumed file at ``step``; TensorBoard hides older events at
        steps >= ``step`` (its purge_step), so a rerun in the same folder does not overlap."""
        self._started = True
        if self._file is None:
            kept = []
            if os.path.exists(self.path):
                old = read_metrics(self.path)
                kept = [r for r in old if r.get("step", step) < step]
                if self._wandb_resumed:  # wandb is written first: it holds at least these
                    self._wandb_done = max((r.get("step", 0) for r in old), default=0)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as fh:
                fh.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(tmp, self.path)
            self._file = open(self.path, "a")
        if self.kind == "tensorboard" and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(self.output_dir, "tensorboard"), purge_step=step)

    def start_at(self, step: int) -> None:
        """Open the outputs as the first ``log`` at ``step`` would (a resumed file is truncated
        at ``step``), also when no step is left to log (a resume from the last checkpoint)."""
        if self.enabled and not self._closed and not self._started:
            self._open(_step(step))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Record ``metrics`` (numbers, numpy or one-element tensors) at optimizer ``step``."""
        if not self.enabled:
            return
        if self._closed:
            raise RuntimeError("MetricsLogger.log() called after close()")
        if "step" in metrics:
            raise ValueError("metrics: the key 'step' is reserved; pass it as step=")
        for k in metrics:
            if not isinstance(k, str):
                raise TypeError(f"metrics: expected str keys, got {k!r}")
        step = _step(step)
        values = {k: _number(k, v) for k, v in metrics.items()}
        if not self._started:
            self._open(step)
        if self._wandb is not None and step > self._wandb_done:
            self._wandb.log(values, step=step)
        finite = {k: v if math.isfinite(v) else None for k, v in values.items()}
        self._file.write(json.dumps({"step": step, **finite}, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in values.items():
                self._tb.add_scalar(k, float(v), step)

    def close(self, plot_keys: list[tuple[str, ...]] | None = None, title: str = "") -> str | None:
        """Flush and close the sinks; with ``plot_keys`` (one subplot per tuple of keys) write
        ``metrics.png`` from the whole ``metrics.jsonl`` and return its path, else None."""
        if not self.enabled:
            return None
        if not self._closed:
            self._closed = True
            if self._file is not None:
                self._file.close()
            if self._tb is not None:
                self._tb.flush()
                self._tb.close()
            if self._wandb is not None:
                self._wandb.finish()
        if not plot_keys or not os.path.exists(self.path):
            return None
        return plot_metrics(read_metrics(self.path), plot_keys, self.output_dir, title)

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def plot_metrics(
    records: list[dict[str, Any]], plot_keys: list[tuple[str, ...]], output_dir: str, title: str
) -> str | None:
    """``<output_dir>/metrics.png``, one subplot per key group against step; keys never logged
    and records without a step are skipped; None (and no file) when nothing is left to plot."""
    series: dict[str, tuple[list, list]] = {}
    for r in sorted((r for r in records if "step" in r), key=lambda r: r["step"]):
        for k, v in r.items():
            if k != "step" and v is not None:
                xs, ys = series.setdefault(k, ([], []))
                xs.append(r["step"])
                ys.append(v)
    groups = [[k for k in keys if k in series] for keys in plot_keys]
    groups = [g for g in groups if g]
    if not groups:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # headless, no pyplot state
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    ncols = min(2, len(groups))
    nrows = -(-len(groups) // ncols)
    fig = Figure(figsize=(6.4 * ncols, 3.8 * nrows), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, keys in zip(axes, groups):
        for k in keys:
            xs, ys = series[k]
            ax.plot(xs, ys, label=k, marker="o" if len(xs) <= 30 else None, markersize=3)
        ax.set_title(", ".join(keys))
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(keys[0] if len(keys) == 1 else "value")
        ax.grid(True, alpha=0.3)
        ax.legend()
    for ax in axes[len(groups) :]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    path = os.path.join(output_dir, PLOT_FILE)
    fig.savefig(path)
    return path
