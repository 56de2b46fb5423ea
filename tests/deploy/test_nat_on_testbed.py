"""Peers behind NAT as full members (issue 20), on the multi-host test bed: 2 public hosts
and 3 hosts behind 3 separate MASQUERADE routers that can only dial out. Daemons are started
through the CLI with no NAT-specific flag: each finds out by dial-back whether others can
reach it, and the NATed ones reserve at a public relay and announce the relayed address.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.testbed import HostSpec, TestBed
from tests.deploy.conftest import MakeTestBed
from tests.deploy.test_swarm_on_testbed import (
    PORT,
    average_all,
    check_exact_mean,
    make_inputs,
    start_daemon,
    status_inside,
)
from tests.harness import ProcessPool, SwarmavgProcess
from swarmavg.peer.calls import AverageResult

pytestmark = pytest.mark.integration

PUBLIC = ("pub0", "pub1")
NATED = ("home0", "home1", "home2")


def nat_bed(make_testbed: MakeTestBed, rate_mbit: float | None = 100) -> TestBed:
    return make_testbed(
        [HostSpec(name, rate_mbit=rate_mbit) for name in PUBLIC]
        + [HostSpec(name, rate_mbit=rate_mbit, nat=True) for name in NATED]
    )


def start_swarm(pool: ProcessPool, bed: TestBed, workdir: Path) -> list[SwarmavgProcess]:
    """One daemon per host, each as its owner would start it: listening on all its
    interfaces and joining the first public host. Nothing says which hosts are NATed."""
    first = start_daemon(pool, bed[PUBLIC[0]], workdir, listen=f"0.0.0.0:{PORT}")
    daemons = [first]
    for name in (*PUBLIC[1:], *NATED):
        daemons.append(
            start_daemon(pool, bed[name], workdir, join=first.address, listen=f"0.0.0.0:{PORT}")
        )
    return daemons


@pytest.mark.timeout(180)
async def test_nated_hosts_are_reducing_members_through_relays(
    make_testbed: MakeTestBed, peer_pool: ProcessPool, tmp_path: Path
) -> None:
    bed = nat_bed(make_testbed)
    daemons = start_swarm(peer_pool, bed, tmp_path)
    by_host = dict(zip((*PUBLIC, *NATED), daemons, strict=True))
    public_addresses = {f"{bed[name].address}:{PORT}" for name in PUBLIC}
    for name in PUBLIC:
        assert by_host[name].address == f"{bed[name].address}:{PORT}"
    for name in NATED:
        # Announced at a relay: a public host's address, another port.
        host, _, port = by_host[name].address.rpartition(":")
        assert host in {bed[p].address for p in PUBLIC}, by_host[name].address
        assert by_host[name].address not in public_addresses
        status = status_inside(bed[name], by_host[name])
        assert status["reachability"] == "relayed"
        assert status["client_mode"] is False
        assert status["relay"] in public_addresses
        assert status["observed_host"] == bed[name].public_address
    for name in PUBLIC:
        assert status_inside(bed[name], by_host[name])["reachability"] == "public"

    n, size = 5, 500_000
    inputs = make_inputs(n, [size, 11], seed=3)
    received_before = {name: bed[name].link_bytes()[1] for name in by_host}
    results = await average_all(daemons, inputs, key="nat-round", timeout=90)
    assert all(isinstance(r, AverageResult) for r in results), results
    ok = [r for r in results if isinstance(r, AverageResult)]
    check_exact_mean(ok, inputs)
    for result in ok:
        assert result.group_size == n
        assert set(result.peers) == {d.peer_id for d in daemons}
        assert not result.partial
    # A reducing member receives the others' copies of its part and the other parts'
    # results: 2 (n-1)/n of the data; a client-mode member only the results, half that.
    for name in by_host:
        received = bed[name].link_bytes()[1] - received_before[name]
        assert received >= 0.9 * 2 * (n - 1) / n * 4 * size, (name, received)
    relayed = sum(
        int(status_inside(bed[name], by_host[name])["relayed_bytes"]) for name in PUBLIC
    )
    assert relayed >= 3 * 2 * (n - 1) / n * 4 * size  # the NATed members' parts went through
