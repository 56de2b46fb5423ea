"""swarmavg.averaging: matchmaking, the butterfly all-reduce and state sharing.

See docs/averaging.md. Public API::

    from swarmavg.averaging import Averager, AveragerConfig, AveragingResult
    from swarmavg.averaging import AveragingError, NoGroupError, SchemaMismatchError, ...

The names are imported on first use (PEP 562): a training process that imports only the
errors or the wrappers (``swarmavg.averaging.optim``) never loads the engine (the
all-reduce, the matchmaker, state sharing, the DHT node).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmavg.averaging.averager import Averager, AveragerConfig
    from swarmavg.averaging.errors import (
        AveragingError,
        InvalidRequestError,
        InvalidTensorsError,
        MatchmakingError,
        NoGroupError,
        RoundClosedError,
        SchemaMismatchError,
        StateDownloadError,
        StateNotFoundError,
    )
    from swarmavg.averaging.group import GroupInfo, Member, Mode
    from swarmavg.averaging.request import RoundRequest
    from swarmavg.averaging.result import AveragingResult

_MODULE_OF = {
    "Averager": "averager",
    "AveragerConfig": "averager",
    "AveragingError": "errors",
    "InvalidRequestError": "errors",
    "InvalidTensorsError": "errors",
    "MatchmakingError": "errors",
    "NoGroupError": "errors",
    "RoundClosedError": "errors",
    "SchemaMismatchError": "errors",
    "StateDownloadError": "errors",
    "StateNotFoundError": "errors",
    "GroupInfo": "group",
    "Member": "group",
    "Mode": "group",
    "RoundRequest": "request",
    "AveragingResult": "result",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'swarmavg.averaging' has no attribute {name!r}")
    return getattr(importlib.import_module(f"swarmavg.averaging.{module}"), name)


__all__ = [
    "Averager",
    "AveragerConfig",
    "AveragingError",
    "AveragingResult",
    "GroupInfo",
    "InvalidRequestError",
    "InvalidTensorsError",
    "MatchmakingError",
    "Member",
    "Mode",
    "NoGroupError",
    "RoundClosedError",
    "RoundRequest",
    "SchemaMismatchError",
    "StateDownloadError",
    "StateNotFoundError",
]
