"""A client's view of whether its daemon is there, and how it waits for a restarted one.

A daemon restarted under a running trainer (Ctrl+C, then the same command again) comes
back on the same control endpoint. Its client does not die with it:

- a round in flight, or started while the daemon is away, fails at once with
  ``DaemonUnavailableError``: the training wrappers count it as a failed round and step
  with local values, which is what they do for any failed round;
- a short call (the DHT reads and writes of progress tracking, ``status``, state) waits
  for the daemon with capped, jittered backoff, up to ``reconnect_timeout`` seconds, then
  runs again once; past that it raises ``DaemonUnavailableError``;
- the daemon's absence and its return are logged once each, never per attempt.

Each wait re-checks the endpoint's owner and re-reads its token (a restarted daemon writes
a new one; peer/client/control_access.py), so a look-alike that took the endpoint meanwhile is
refused as at connect time.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator

from swarmavg.peer.client.errors import DaemonUnavailableError

log = logging.getLogger("swarmavg.peer.client")

RECONNECT_TIMEOUT = 120.0
"""Seconds a short call waits for a daemon that went away (a restart takes a few)."""
PROBE_TIMEOUT = 1.0
"""Deadline of one look for the daemon (a Status call that waits for the connection)."""
FIRST_DELAY = 0.2
MAX_DELAY = 2.0

STOPPING = "the daemon is shutting down"
"""Why a look found the daemon that went away still there (it answers status calls)."""


class DaemonLink:
    """Whether the daemon at ``endpoint`` answered the last call; the logging of its
    absence and return; the waits between two looks for it."""

    def __init__(self, endpoint: str, reconnect_timeout: float = RECONNECT_TIMEOUT) -> None:
        if reconnect_timeout < 0:
            raise ValueError(f"reconnect_timeout must be >= 0, got {reconnect_timeout}")
        self.endpoint = endpoint
        self.reconnect_timeout = reconnect_timeout
        self.gone_since: float | None = None
        """``time.monotonic()`` when a call first found the daemon away; None while there."""
        self.reconnects = 0
        """How many times the daemon came back after going away."""
        self.peer_id = ""
        """The daemon's peer id when the client connected (hex; "" until known)."""
        self.pid = 0
        """The daemon's process id, from its last status (0 until known)."""
        self._stopping = False  # the daemon said it is shutting down

    @property
    def gone(self) -> bool:
        return self.gone_since is not None

    def lost(self, reason: str) -> None:
        """A call did not reach the daemon (logged once per absence)."""
        self._stopping = self._stopping or STOPPING in reason
        if self.gone_since is not None:
            return
        self.gone_since = time.monotonic()
        log.warning(
            "the daemon at %s went away (%s); rounds fail until it is back, other calls "
            "wait up to %.0f s for it",
            self.endpoint,
            reason,
            self.reconnect_timeout,
        )

    def back(self, peer_id: str, pid: int) -> bool:
        """A look for the daemon got a status from process ``pid``: whether the daemon is
        back (then :meth:`answered` ran). A status from the daemon that said it is shutting
        down (it answers status calls to the end) is not."""
        if self._stopping and pid == self.pid:
            return False
        self.answered(peer_id, pid)
        return True

    def answered(self, peer_id: str = "", pid: int = 0) -> None:
        """A call reached the daemon (logs its return once, when it was away). ``peer_id``:
        the daemon's id, when the call tells it; a daemon that came back under another id
        (restarted without ``--identity``) is worth a warning: the swarm sees a new member, and
        the trainer's progress records move to the new id (averaging/training/progress.py)."""
        self.pid = pid or self.pid
        self.peer_id = self.peer_id or peer_id
        self._stopping = False
        if self.gone_since is None:
            return
        away = time.monotonic() - self.gone_since
        self.gone_since = None
        self.reconnects += 1
        log.warning("the daemon at %s is back after %.1f s", self.endpoint, away)
        if peer_id and self.peer_id and peer_id != self.peer_id:
            log.warning(
                "the daemon came back as another peer (%s, was %s): start it with --identity "
                "FILE to keep its id across restarts (the swarm sees a new member; a training "
                "wrapper reports under the new id from its next report)",
                peer_id[:12],
                self.peer_id[:12],
            )
        self.peer_id = peer_id or self.peer_id

    def waits(self) -> Iterator[float]:
        """Pauses between two looks for the daemon (capped, jittered backoff), until
        ``reconnect_timeout`` after it went away."""
        since = self.gone_since if self.gone_since is not None else time.monotonic()
        deadline = since + self.reconnect_timeout
        delay = FIRST_DELAY
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            yield min(delay * random.uniform(0.5, 1.5), left)
            delay = min(delay * 2, MAX_DELAY)

    def retry_until(self, deadline: float | None) -> float:
        """When a failing call stops waiting: ``deadline`` once set, else
        ``reconnect_timeout`` from its first failure (now). A bound on its retries, however
        often the daemon seems back and fails it again."""
        return deadline if deadline is not None else time.monotonic() + self.reconnect_timeout

    def gave_up(self, last_reason: str) -> DaemonUnavailableError:
        """The error of a call that waited ``reconnect_timeout`` in vain."""
        return DaemonUnavailableError(
            f"the daemon at {self.endpoint} went away and did not come back within "
            f"{self.reconnect_timeout:.0f} s ({last_reason}); start it again with "
            "`swarmavg peer` and the same --control / --run-id"
        )
