"""swarmavg.averaging: matchmaking, the butterfly all-reduce and state sharing.

See docs/averaging.md. Public API::

    from swarmavg.averaging import Averager, AveragerConfig, AveragingResult
    from swarmavg.averaging import AveragingError, NoGroupError, SchemaMismatchError, ...
"""

from swarmavg.averaging.averager import Averager, AveragerConfig
from swarmavg.averaging.errors import (
    AveragingError,
    InvalidRequestError,
    InvalidTensorsError,
    MatchmakingError,
    NoGroupError,
    SchemaMismatchError,
    StateDownloadError,
    StateNotFoundError,
)
from swarmavg.averaging.group import GroupInfo, Member, Mode
from swarmavg.averaging.request import RoundRequest
from swarmavg.averaging.result import AveragingResult

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
    "RoundRequest",
    "SchemaMismatchError",
    "StateDownloadError",
    "StateNotFoundError",
]
