"""Bandwidth limits with ``tc tbf`` (netem is not available on the project's machines).

A host's link is a veth pair. ``tc`` shapes only what leaves an interface, so a limit in both
directions takes two qdiscs: one on the host's end (its uploads) and one on the far end in the
switch or router namespace (what it downloads). Policing ingress instead would drop packets
instead of queueing them and TCP would reach far less than the link rate.
"""

from __future__ import annotations

from collections.abc import Sequence

# A token bucket of at least this many bytes: tbf must be able to pass one full-size frame,
# and GSO hands it segments of up to 64 KiB (larger ones tbf splits itself).
MIN_BURST_BYTES = 16 * 1024
# Bucket depth in seconds of traffic at the configured rate: deep enough that timer slack does
# not cost throughput, shallow enough that a measurement of a few MB is not skewed by it.
BURST_SECONDS = 0.005
# Queueing delay the qdisc accepts before it drops: a few BDPs of a LAN, so that TCP keeps
# the link busy without building a multi-second queue.
QUEUE_LATENCY_MS = 50


def burst_bytes(rate_mbit: float) -> int:
    """The tbf bucket size for ``rate_mbit`` megabits per second."""
    return max(MIN_BURST_BYTES, int(rate_mbit * 1e6 / 8 * BURST_SECONDS))


def tbf_command(namespace: str, device: str, rate_mbit: float | None) -> list[str]:
    """The ``tc`` command that sets (or, for None, removes) the egress limit of ``device``.

    Raises:
        ValueError: ``rate_mbit`` is not a positive number.
    """
    base = ["ip", "netns", "exec", namespace, "tc", "qdisc"]
    if rate_mbit is None:
        return [*base, "del", "dev", device, "root"]
    if not rate_mbit > 0:
        raise ValueError(f"rate_mbit must be positive, got {rate_mbit!r}")
    rate_kbit = max(1, round(rate_mbit * 1000))
    return [
        *base,
        "replace",
        "dev",
        device,
        "root",
        "tbf",
        "rate",
        f"{rate_kbit}kbit",
        "burst",
        str(burst_bytes(rate_mbit)),
        "latency",
        f"{QUEUE_LATENCY_MS}ms",
    ]


def link_limit_commands(
    ends: Sequence[tuple[str, str]], rate_mbit: float | None
) -> list[list[str]]:
    """Commands limiting every ``(namespace, device)`` end of one link to ``rate_mbit``."""
    return [tbf_command(namespace, device, rate_mbit) for namespace, device in ends]
