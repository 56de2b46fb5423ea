"""Fixtures for tests on the multi-host network test bed (``deploy.testbed``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import pytest

from deploy.testbed import HostSpec, TestBed, missing_requirements
from tests.harness import ProcessPool

MakeTestBed = Callable[[Sequence[HostSpec]], TestBed]


@pytest.fixture
def make_testbed() -> Iterator[MakeTestBed]:
    """``make_testbed([HostSpec(...), ...])`` -> a started test bed, removed at teardown.

    Skips the test where the machine cannot run one (not root, no iproute2/iptables, no
    permission to create network namespaces); CI and the project machines can.
    """
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    beds: list[TestBed] = []

    def make(hosts: Sequence[HostSpec]) -> TestBed:
        bed = TestBed(hosts)
        beds.append(bed)
        return bed.start()

    try:
        yield make
    finally:
        for bed in beds:
            bed.close()


@pytest.fixture
def peer_pool(make_testbed: MakeTestBed, swarmavg_processes: ProcessPool) -> Iterator[ProcessPool]:
    """``swarmavg_processes`` for daemons inside test bed hosts.

    Depends on ``make_testbed`` so that the daemons are stopped (gracefully, SIGTERM) before
    their namespaces are deleted.
    """
    yield swarmavg_processes
    swarmavg_processes.close()
