"""The installed package's version, read on first use.

Importing ``importlib.metadata`` and reading the distribution costs about 30 ms of CPU
(measured with ``python -X importtime``), paid by every daemon and client process at
start when it was read at import; only ``--version`` and the status answers need it.
"""

from __future__ import annotations

import functools

__all__ = ["installed_version"]


@functools.cache
def installed_version() -> str:
    """The installed distribution's version, or ``"0.0.0"`` for a source tree that was
    never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("swarmavg")
    except PackageNotFoundError:
        return "0.0.0"
