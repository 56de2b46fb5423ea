"""Owning helper tasks: cancel one and wait for it to end."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Future[Any]) -> None:
    """Cancel a helper task and wait for it, without swallowing our own cancellation."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:  # its outcome is read (or dropped) by the caller
        pass
