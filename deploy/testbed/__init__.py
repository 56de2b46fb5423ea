"""A multi-host network test bed on one Linux machine (network namespaces, tc, iptables NAT).

    from deploy.testbed import HostSpec, TestBed, missing_requirements

    with TestBed([HostSpec("a", rate_mbit=100), HostSpec("b", rate_mbit=100, delay_ms=25),
                  HostSpec("c", nat=True)]) as bed:
        proc = bed["a"].popen(["python", "-m", "http.server", "--bind", bed["a"].address])
        ...
        bed.cut_link("b")

Needs root, iproute2 and iptables (:func:`missing_requirements` says why it cannot run; tests
skip with that reason), and for links with delay, jitter or loss a C compiler and
/dev/net/tun (``deploy.testbed.wire.missing_requirements``). See ``deploy.testbed.bed`` for
the topology and ``deploy.testbed.wire`` for delay.
"""

from deploy.testbed._system import TestBedError, list_namespaces, sweep_stale
from deploy.testbed._system import missing_requirements as _missing_requirements
from deploy.testbed.bed import Host, HostSpec, TestBed


def missing_requirements() -> str | None:
    """Why the test bed cannot run on this machine (a reason to skip with), or None."""
    return _missing_requirements()


__all__ = [
    "Host",
    "HostSpec",
    "TestBed",
    "TestBedError",
    "list_namespaces",
    "missing_requirements",
    "sweep_stale",
]
