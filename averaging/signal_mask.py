"""Threads the library starts in a user's process leave Ctrl+C to the user's main thread.

The kernel hands a process-directed signal to the main thread when it can take it, but any
thread that does not block the signal may dequeue it first (one that creates a thread or
changes its mask while the signal is pending). Python's handler run there only sets a flag
that the main thread reads when it next runs bytecode, so a main thread blocked in a wait
(``threading.Event().wait()``, a ``join()``) never raises its ``KeyboardInterrupt``. A
thread that blocks the signals cannot take them, and the threads it creates (gRPC's among
them) inherit its mask.
"""

from __future__ import annotations

import signal

SCRIPT_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})
"""Signals the library's threads leave to the user's main thread."""


def leave_signals_to_main_thread() -> None:
    """Block :data:`SCRIPT_SIGNALS` in the calling thread (a no-op where threads have no
    signal mask); first thing in a thread the library starts, or a thread pool's
    ``initializer``."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_BLOCK, SCRIPT_SIGNALS)


__all__ = ["SCRIPT_SIGNALS", "leave_signals_to_main_thread"]
