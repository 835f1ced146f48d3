"""Where a step's scalar metrics go: TensorBoard, CSV (DeepSpeed's ``csv_monitor`` layout),
Weights & Biases and JSON lines.

A writer is anything with ``write(scalars, *, step, samples)`` and ``close()``
(:class:`Monitor`). ``fzero.compile`` calls ``write`` on rank 0 only, after every step, with
the step's metrics flattened to floats (:func:`scalars`); ``step`` counts the calls (1, 2,
...) and ``samples`` the samples all data-parallel ranks have passed so far, DeepSpeed's
x-axis. A writer opens its files on its first ``write``, so one constructed on every rank
creates nothing on the others, and closes them at exit if nobody did before.

TensorBoard, CSV and W&B take DeepSpeed's event names: ``Train/Samples/<metric>``, the loss
as ``Train/Samples/train_loss`` and the learning rate as ``Train/Samples/lr``, so a
DeepSpeed dashboard reads them; a nested metric keeps its path (``time/forward`` is
``Train/Samples/time/forward``).
"""

from __future__ import annotations

import atexit
import csv
import importlib.util
import json
import numbers
import os
from collections.abc import Mapping
from fractions import Fraction
from typing import Any, Protocol

import torch

__all__ = ["CSV", "JSONL", "Monitor", "TensorBoard", "Wandb", "event_name", "scalars"]


class Monitor(Protocol):
    """What ``fzero.compile(monitors=[...])`` writes to."""

    def write(self, scalars: Mapping[str, float], *, step: int, samples: int) -> None: ...

    def close(self) -> None: ...


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """``metrics`` flattened to ``{"name": float}``: nested dicts joined with ``/``, numbers,
    bools and one-element tensors as floats; anything else (a vector, a string) is left out.

    Example:
        >>> scalars({"loss": torch.tensor(2.5), "time": {"forward": 0.25}, "skipped": False,
        ...          "logits": torch.zeros(3)})
        {'loss': 2.5, 'time/forward': 0.25, 'skipped': 0.0}
    """
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(scalars(value, name + "/"))
        elif isinstance(value, torch.Tensor):
            if value.numel() == 1:
                out[name] = float(value.detach().reshape(()).float().item())
        elif isinstance(value, (numbers.Real, Fraction)):
            out[name] = float(value)
    return out


def event_name(name: str) -> str:
    """DeepSpeed's event name of a metric.

    Example:
        >>> event_name("loss"), event_name("time/forward")
        ('Train/Samples/train_loss', 'Train/Samples/time/forward')
    """
    return "Train/Samples/" + ("train_loss" if name == "loss" else name)


def _require(package: str, where: str, key: str, install: str) -> None:
    """Fail at construction (before any step, on every rank) when ``package`` is missing."""
    if importlib.util.find_spec(package) is None:
        raise ImportError(f"{where} (the config's {key!r} section) needs the {package} package, which is not "
                          f"installed: {install}")


def _log_dir(where: str, output_path: str, job_name: str) -> str:
    """DeepSpeed's ``output_path/job_name`` (``output_path`` empty: the working directory)."""
    if not isinstance(output_path, str) or not isinstance(job_name, str) or not job_name:
        raise ValueError(f"{where}: output_path must be a str and job_name a non-empty str, got "
                         f"output_path={output_path!r}, job_name={job_name!r}")
    return os.path.join(output_path or ".", job_name)


class _Writer:
    """Open on first write, close once (by hand or at exit)."""

    _open = False

    def _start(self) -> None:
        raise NotImplementedError

    def _ensure_open(self) -> None:
        if not self._open:
            self._start()
            self._open = True
            atexit.register(self.close)

    def close(self) -> None:
        """Flush and close; writing again reopens (appending)."""
        if self._open:
            self._open = False
            atexit.unregister(self.close)
            self._stop()

    def _stop(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TensorBoard(_Writer):
    """Scalars to TensorBoard event files in ``output_path/job_name`` (DeepSpeed's
    ``tensorboard`` section), through ``torch.utils.tensorboard.SummaryWriter``, flushed
    every step.

    Args:
        output_path: the directory (``""``: the working directory).
        job_name: the run's subdirectory (DeepSpeed's default ``"DeepSpeedJobName"``).

    Raises:
        ImportError: the ``tensorboard`` package is missing (``pip install 'fzero[monitor]'``).
        ValueError: ``output_path`` or ``job_name`` is not a string.
    """

    def __init__(self, output_path: str = "", job_name: str = "DeepSpeedJobName"):
        self.log_dir = _log_dir("fzero.monitor.TensorBoard", output_path, job_name)
        _require("tensorboard", "fzero.monitor.TensorBoard", "tensorboard", "pip install 'fzero[monitor]'")
        self._writer = None

    def _start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        os.makedirs(self.log_dir, exist_ok=True)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def write(self, scalars: Mapping[str, float], *, step: int, samples: int) -> None:
        self._ensure_open()
        for name, value in scalars.items():
            self._writer.add_scalar(event_name(name), value, samples)
        self._writer.flush()

    def _stop(self) -> None:
        self._writer.close()


class CSV(_Writer):
    """Scalars to CSV files in ``output_path/job_name``, as DeepSpeed's ``csv_monitor``
    writes them: one file per metric, named by its event name with ``/`` and spaces as
    ``_`` (``Train_Samples_train_loss.csv``), a header row ``step,<last part of the name>``,
    then one ``samples,value`` row per step.

    Args:
        output_path: the directory (``""``: the working directory).
        job_name: the run's subdirectory.

    Raises:
        ValueError: ``output_path`` or ``job_name`` is not a string.
    """

    def __init__(self, output_path: str = "", job_name: str = "DeepSpeedJobName"):
        self.log_dir = _log_dir("fzero.monitor.CSV", output_path, job_name)
        self._files: dict[str, Any] = {}

    def _start(self) -> None:
        os.makedirs(self.log_dir, exist_ok=True)

    def write(self, scalars: Mapping[str, float], *, step: int, samples: int) -> None:
        self._ensure_open()
        for name, value in scalars.items():
            event = event_name(name)
            f = self._files.get(event)
            if f is None:
                path = os.path.join(self.log_dir, event.replace("/", "_").replace(" ", "_") + ".csv")
                fresh = not os.path.exists(path) or os.path.getsize(path) == 0
                f = self._files[event] = open(path, "a", newline="", encoding="utf-8")
                if fresh:
                    csv.writer(f).writerow(["step", event.split("/")[-1]])
            csv.writer(f).writerow([samples, value])
        for f in self._files.values():
            f.flush()

    def _stop(self) -> None:
        for f in self._files.values():
            f.close()
        self._files = {}


class JSONL(_Writer):
    """One JSON object per step, one line each: ``{"step", "samples", <metric>: value,
    ...}`` with the metrics' own flattened names (``"loss"``, ``"time/forward"``).

    Args:
        path: the file, appended to (its directory is created).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._file = None

    def _start(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, scalars: Mapping[str, float], *, step: int, samples: int) -> None:
        self._ensure_open()
        self._file.write(json.dumps({"step": step, "samples": samples, **scalars}) + "\n")
        self._file.flush()

    def _stop(self) -> None:
        self._file.close()


class Wandb(_Writer):
    """Scalars to Weights & Biases (DeepSpeed's ``wandb`` section): ``wandb.init(project=,
    group=, entity=team)`` on the first write, then ``wandb.log`` each step at
    ``step=samples``, each step committed as it is written. Set ``WANDB_MODE=offline`` to write only the local run directory.

    Args:
        project: the W&B project (DeepSpeed's default ``"deepspeed"``).
        group: the run group, or ``None``.
        team: the W&B entity, or ``None``.

    Raises:
        ImportError: the ``wandb`` package is missing (``pip install 'fzero[wandb]'``).
    """

    def __init__(self, project: str = "deepspeed", group: str | None = None, team: str | None = None, **init):
        _require("wandb", "fzero.monitor.Wandb", "wandb", "pip install 'fzero[wandb]'")
        self.project, self.group, self.team, self.init = project, group, team, init
        self.run = None

    def _start(self) -> None:
        import wandb

        self.run = wandb.init(project=self.project, group=self.group, entity=self.team, **self.init)

    def write(self, scalars: Mapping[str, float], *, step: int, samples: int) -> None:
        self._ensure_open()
        # commit: the step is complete now (W&B would otherwise hold it until a later step).
        self.run.log({event_name(k): v for k, v in scalars.items()}, step=samples, commit=True)

    def _stop(self) -> None:
        self.run.finish()
