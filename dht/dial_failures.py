"""What a failed call to an initial peer means, in words a user acts on, and whether
retrying it can help.

gRPC reports a wrong ``--join`` address in its transport's terms: ``failed to connect to
all addresses; last error: UNKNOWN: ipv4:127.0.0.1:9: Failed to connect to remote host:
Connection refused`` for a closed port, ``Failed parsing HTTP/2`` or ``Trying to connect
an http1.x server`` for a web server. The bootstrap keeps gRPC's text for the log and
gives the user one of the sentences below, which say what is at that address.
"""

from __future__ import annotations

REFUSED = "nothing listens there (connection refused)"
NOT_SWARMAVG = (
    "that address does not speak swarmavg's protocol (something answered, but not with "
    "gRPC: a web server, or another service on that port?)"
)
SILENT = "no answer in time (is the host up, and is that port open in its firewall?)"
CLOSED = (
    "it closed the connection at once (a private run's peer, which takes only TLS "
    "connections from invited peers?)"
)
UNRESOLVED = "the host name does not resolve"

REFUSED_GRACE = 2.0
"""Seconds an initial peer may refuse connections (or close them at once) before the
bootstrap stops asking it.
Not zero: peers started together by a script may dial their initial peer a moment before
it listens; a few seconds cover that, and a wrong port costs no more than that."""

# Substrings of gRPC's messages (C-core's wording, stable across the 1.5x-1.7x releases).
_REFUSED_MARKERS = ("connection refused",)
_CLOSED_MARKERS = ("socket closed",)
_NOT_GRPC_MARKERS = ("failed parsing http/2", "http1.x server", "bad http/2", "frame size")
_UNRESOLVED_MARKERS = ("dns resolution failed", "name or service not known")


def is_refused(reason: str) -> bool:
    """Whether ``reason`` says that nothing listens at the address."""
    lowered = reason.lower()
    return any(marker in lowered for marker in _REFUSED_MARKERS)


def turns_away(reason: str) -> bool:
    """Whether the address refused the connection or closed it at once: asked again for
    :data:`REFUSED_GRACE` seconds only."""
    lowered = reason.lower()
    return not is_not_grpc(reason) and any(
        marker in lowered for marker in (*_REFUSED_MARKERS, *_CLOSED_MARKERS)
    )


def is_not_grpc(reason: str) -> bool:
    """Whether something answered at the address in another protocol than gRPC."""
    lowered = reason.lower()
    return any(marker in lowered for marker in _NOT_GRPC_MARKERS)


def plain_reason(reason: str) -> str:
    """The sentence a user sees for gRPC's ``reason`` (``reason`` itself when it is
    already ours, e.g. another run's id)."""
    lowered = reason.lower()
    if is_not_grpc(reason):
        return NOT_SWARMAVG
    if is_refused(reason):
        return REFUSED
    if any(marker in lowered for marker in _CLOSED_MARKERS):
        return CLOSED
    if any(marker in lowered for marker in _UNRESOLVED_MARKERS):
        return UNRESOLVED
    if lowered.startswith("deadline_exceeded") or "deadline exceeded" in lowered:
        return SILENT
    return reason
