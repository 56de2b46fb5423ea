"""swarmavg.averaging: matchmaking, the butterfly all-reduce and state sharing.

See docs/averaging.md. Public API::

    from swarmavg.averaging import Averager, AveragerConfig, AveragingResult
    from swarmavg.averaging import AveragingError, NoGroupError, SchemaMismatchError, ...
"""

from swarmavg.averaging.averager import Averager, AveragerConfig, AveragingResult
from swarmavg.averaging.errors import (
    AveragingError,
    InvalidTensorsError,
    MatchmakingError,
    NoGroupError,
    SchemaMismatchError,
    StateDownloadError,
    StateNotFoundError,
)
from swarmavg.averaging.group import GroupInfo, Member, Mode

__all__ = [
    "Averager",
    "AveragerConfig",
    "AveragingError",
    "AveragingResult",
    "GroupInfo",
    "InvalidTensorsError",
    "MatchmakingError",
    "Member",
    "Mode",
    "NoGroupError",
    "SchemaMismatchError",
    "StateDownloadError",
    "StateNotFoundError",
]
