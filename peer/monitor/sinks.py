"""Where ``swarmavg monitor`` writes its samples besides the dashboard: CSV, TensorBoard,
Weights & Biases.

TensorBoard and wandb are optional: :func:`open_sinks` imports them only when asked for,
and a missing package is a :class:`SinkUnavailable` that says what to install, raised before
the monitor joins the swarm (asking for a log and silently getting none would be worse).
Sinks are written from the monitor's event loop through a worker thread (file and network
I/O); one poll's writes finish before the next poll starts.
"""

from __future__ import annotations

import csv
import importlib
import logging
from pathlib import Path
from typing import IO, Any, Protocol

from swarmavg.peer.monitor.series import Sample

log = logging.getLogger(__name__)

CSV_HEADER = ("time", "series", "value")
"""The CSV file's columns: one row per series per poll (series appear as the run reports
them, so a fixed set of columns could not hold a metric a trainer starts reporting later)."""


class SinkUnavailable(RuntimeError):
    """A sink was asked for whose package is not installed (the message says which)."""


class Sink(Protocol):
    def write(self, sample: Sample, step: int) -> None: ...
    def close(self) -> None: ...


class CsvSink:
    """Appends to ``path`` (created with a header; an existing file keeps its rows)."""

    def __init__(self, path: Path) -> None:
        fresh = not path.exists() or path.stat().st_size == 0
        self.path = path
        self._file: IO[str] = path.open("a", newline="", encoding="utf-8")
        self._writer = csv.writer(self._file)
        if fresh:
            self._writer.writerow(CSV_HEADER)
            self._file.flush()

    def write(self, sample: Sample, step: int) -> None:
        for name, value in sample.values.items():
            self._writer.writerow((f"{sample.time:.3f}", name, repr(float(value))))
        self._file.flush()  # a monitor is often stopped with Ctrl+C: keep every poll

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars in a TensorBoard log folder (torch's ``SummaryWriter``), step = poll index."""

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise SinkUnavailable(
                f"--tensorboard needs torch and tensorboard ({exc}): pip install torch tensorboard"
            ) from None
        self._writer: Any = SummaryWriter(log_dir=str(folder))

    def write(self, sample: Sample, step: int) -> None:
        for name, value in sample.values.items():
            self._writer.add_scalar(name, value, global_step=step, walltime=sample.time)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One wandb run (``project``, named after the swarm's run id); step = poll index."""

    def __init__(self, project: str, run_id: str) -> None:
        try:
            wandb: Any = importlib.import_module("wandb")  # optional, untyped
        except ImportError:
            raise SinkUnavailable("--wandb needs the wandb package: pip install wandb") from None
        self._run: Any = wandb.init(project=project, name=run_id, config={"run_id": run_id})

    def write(self, sample: Sample, step: int) -> None:
        self._run.log(dict(sample.values), step=step)

    def close(self) -> None:
        self._run.finish()


def open_sinks(
    run_id: str,
    csv_path: Path | None = None,
    tensorboard: Path | None = None,
    wandb_project: str | None = None,
) -> list[Sink]:
    """The sinks asked for, opened; on a failure the ones already opened are closed.

    Raises:
        SinkUnavailable: TensorBoard or wandb asked for but not installed.
        OSError: the CSV file or the log folder cannot be written.
    """
    sinks: list[Sink] = []
    try:
        if csv_path is not None:
            sinks.append(CsvSink(csv_path))
        if tensorboard is not None:
            sinks.append(TensorBoardSink(tensorboard))
        if wandb_project is not None:
            sinks.append(WandbSink(wandb_project, run_id))
    except BaseException:
        close_sinks(sinks)
        raise
    return sinks


def write_all(sinks: list[Sink], sample: Sample, step: int) -> None:
    """Write ``sample`` to every sink; a sink that fails is logged, the others still get it."""
    for sink in sinks:
        try:
            sink.write(sample, step)
        except Exception as exc:  # a full disk or a wandb outage must not stop the monitor
            log.warning("monitor: writing to %s failed: %s", type(sink).__name__, exc)


def close_sinks(sinks: list[Sink]) -> None:
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:
            log.warning("monitor: closing %s failed: %s", type(sink).__name__, exc)
