"""The swarmavg peer daemon, its local control service, the client library and the CLI."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("swarmavg")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
