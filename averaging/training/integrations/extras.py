"""The error raised when a framework that an optional extra provides is not installed."""

from __future__ import annotations


def missing_extra(package: str, extra: str) -> ImportError:
    """An ``ImportError`` that says which extra provides ``package``."""
    return ImportError(
        f"this integration needs {package!r}, which is not installed: "
        f"pip install 'swarmavg[{extra}]'"
    )
