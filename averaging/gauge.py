"""A counter that can be awaited: how tests and benchmarks observe an attack without sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ["Gauge"]


class Gauge:
    """An integer that event-loop code moves with :meth:`add` and others await with
    :meth:`wait_until` (e.g. "64 streams are being served"). Not thread-safe."""

    def __init__(self) -> None:
        self.value = 0
        self._watchers: list[tuple[Callable[[int], bool], asyncio.Future[None]]] = []

    def add(self, delta: int) -> None:
        self.value += delta
        for predicate, future in self._watchers:
            if not future.done() and predicate(self.value):
                future.set_result(None)

    async def wait_until(self, predicate: Callable[[int], bool]) -> None:
        """Return once ``predicate(value)`` holds (wrap it in a timeout). Call it inside
        the running loop."""
        if predicate(self.value):
            return
        future = asyncio.get_running_loop().create_future()
        self._watchers.append((predicate, future))
        try:
            await future
        finally:
            self._watchers = [w for w in self._watchers if w[1] is not future]
