"""Hole punching on the multi-host test bed: two hosts behind two separate
MASQUERADE routers (home routers: they keep the host's port and drop unsolicited packets)
punch a direct TCP connection and move their round's bytes off the relay; behind routers
that randomise every connection's port (symmetric NAT) the punch cannot work, the peers
stay on the relay, and the round completes all the same. Daemons start through the CLI with
no NAT-specific flag.
"""

from __future__ import annotations

import asyncio
import functools
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy.testbed import HostSpec, TestBed
from swarmavg.peer.client.calls import AverageResult
from tests.deploy.conftest import MakeTestBed
from tests.deploy.test_nat_on_testbed import start_daemon, status_of
from tests.deploy.test_swarm_on_testbed import (
    average_all,
    check_exact_mean,
    make_inputs,
    start_together,
)
from tests.harness import ProcessPool, SwarmavgProcess
from tests.private_runs import Authority

pytestmark = pytest.mark.integration

HOMES = ("home0", "home1")


async def wait_for(daemon: SwarmavgProcess, key: str, within: float) -> dict[str, Any]:
    """Ask the daemon's status until ``key`` is set (the punch runs in the daemon, with no
    event to wait on from here, so this polls, with a deadline)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + within
    while True:
        status = await status_of(daemon)
        if status[key] or loop.time() > give_up:
            return status
        await asyncio.sleep(0.5)


def punch_bed(make_testbed: MakeTestBed, random_ports: bool) -> TestBed:
    return make_testbed(
        [HostSpec("pub0", rate_mbit=100)]
        + [HostSpec(name, rate_mbit=100, nat=True, nat_random_ports=random_ports) for name in HOMES]
    )


def private_args(authority: Authority | None, name: str) -> list[str]:
    """A private run's flags for the daemon on host ``name`` (none for a public run)."""
    if authority is None:
        return []
    member = authority.invite(name)
    return [
        "--run-file", str(authority.run_path),
        "--identity", str(member.identity_path),
        "--credential", str(member.credential_path),
    ]  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", ["public", "private"])
async def test_two_nated_hosts_punch_and_their_round_goes_direct(
    make_testbed: MakeTestBed, peer_pool: ProcessPool, tmp_path: Path, run: str
) -> None:
    """In a private run every connection is mutual TLS: the dial-backs, the reservations,
    the punches' calls, and the gRPC and data-plane traffic on the punched connections."""
    bed = punch_bed(make_testbed, random_ports=False)
    authority = Authority.create(tmp_path / "run", "testbed") if run == "private" else None
    relay = start_daemon(peer_pool, bed["pub0"], tmp_path, extra=private_args(authority, "pub0"))
    homes = start_together(
        [
            functools.partial(
                start_daemon, peer_pool, bed[name], tmp_path, join=relay.address,
                extra=private_args(authority, name),
            )
            for name in HOMES
        ]
    )  # fmt: skip
    for home in homes:
        assert (await status_of(home))["reachability"] == "relayed"

    # The first round: each home dials the other through the relay and, in the background,
    # punches a hole to it.
    warm = make_inputs(2, [100_000], seed=7)
    first = await average_all(homes, warm, key="punch-warm", timeout=60)
    assert all(isinstance(r, AverageResult) for r in first), first
    for home, other in zip(homes, reversed(HOMES), strict=True):
        status = await wait_for(home, "direct_peers", within=60)
        assert status["direct_peers"], status
        assert status["direct_peers"][0].startswith(bed[other].public_address + " "), status

    # What an operator reads.
    text = (
        bed[HOMES[0]]
        .run([sys.executable, "-m", "swarmavg.peer.cli", "status", "--control", homes[0].control])
        .stdout
    )
    assert f"direct to {bed[HOMES[1]].public_address}" in text
    assert "after punching" in text

    # The next round's bytes go router to router: home1's router forwards them straight from
    # home0's router, and the relay carries next to nothing.
    bed.count_forwarded_from(HOMES[1], bed[HOMES[0]].public_address)
    bed.count_forwarded_from(HOMES[0], bed[HOMES[1]].public_address)
    relayed_before = int((await status_of(relay))["relayed_bytes"])
    size = 2_000_000
    inputs = make_inputs(2, [size, 5], seed=8)
    results = await average_all(homes, inputs, key="punch-direct", timeout=90)
    assert all(isinstance(r, AverageResult) for r in results), results
    ok = [r for r in results if isinstance(r, AverageResult)]
    check_exact_mean(ok, inputs)
    assert all(r.group_size == 2 and not r.partial for r in ok)
    part = 4 * size / 2  # each home reduces half and sends the other half
    relayed = int((await status_of(relay))["relayed_bytes"]) - relayed_before
    assert relayed < 0.05 * part, relayed
    for receiver, sender in ((HOMES[1], HOMES[0]), (HOMES[0], HOMES[1])):
        direct = bed.forwarded_from(receiver, bed[sender].public_address)
        assert direct >= part, (receiver, direct)


@pytest.mark.timeout(300)
async def test_behind_port_randomising_routers_the_punch_fails_and_the_relay_carries_the_round(
    make_testbed: MakeTestBed, peer_pool: ProcessPool, tmp_path: Path
) -> None:
    bed = punch_bed(make_testbed, random_ports=True)
    relay = start_daemon(peer_pool, bed["pub0"], tmp_path)
    homes = start_together(
        [
            functools.partial(start_daemon, peer_pool, bed[n], tmp_path, join=relay.address)
            for n in HOMES
        ]
    )
    warm = make_inputs(2, [100_000], seed=9)
    first = await average_all(homes, warm, key="nopunch-warm", timeout=60)
    assert all(isinstance(r, AverageResult) for r in first), first
    for home in homes:
        status = await wait_for(home, "punches_failed", within=90)
        assert status["direct_peers"] == [], status
        assert status["punches_failed"] >= 1, status

    relayed_before = int((await status_of(relay))["relayed_bytes"])
    size = 1_000_000
    inputs = make_inputs(2, [size], seed=10)
    results = await average_all(homes, inputs, key="nopunch-round", timeout=90)
    assert all(isinstance(r, AverageResult) for r in results), results
    check_exact_mean([r for r in results if isinstance(r, AverageResult)], inputs)
    relayed = int((await status_of(relay))["relayed_bytes"]) - relayed_before
    assert relayed >= 2 * 4 * size / 2  # both halves crossed the relay
