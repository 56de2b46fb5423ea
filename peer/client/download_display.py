"""How a training process shows its daemon's state download: a tqdm bar when
stderr is a terminal and tqdm is installed (it is not a dependency), INFO log lines every
few seconds otherwise (visible with ``swarmavg.peer.enable_logging()``)."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from swarmavg.averaging.transfer_progress import LOG_EVERY, TransferProgress
from swarmavg.proto import control_pb2

log = logging.getLogger("swarmavg.peer.client")


def _tqdm_bar(total: int) -> Any:
    """A tqdm bar over ``total`` bytes, or None without a terminal or without tqdm."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading state")


class DownloadDisplay:
    """Shows the progress messages of one ``load_state`` call; :meth:`close` once."""

    def __init__(self) -> None:
        self._bar: Any = None
        self._bar_done = 0
        self._last_log = 0.0
        self.updates = 0

    def update(self, message: control_pb2.StateProgress) -> None:
        self.updates += 1
        if self._bar is None and self.updates == 1:
            self._bar = _tqdm_bar(message.bytes_total)
        if self._bar is not None:
            self._bar.update(message.bytes_done - self._bar_done)
            self._bar_done = message.bytes_done
            return
        now = time.monotonic()
        if self.updates == 1 or now - self._last_log >= LOG_EVERY:
            self._last_log = now
            progress = TransferProgress(
                message.bytes_total, message.bytes_done, started=now - message.seconds
            )
            log.info("%s", progress.line("loading state", now))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
