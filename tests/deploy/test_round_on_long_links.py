"""Real ``swarmavg peer`` daemons on long, lossy links: a round at RTT 100 ms with jitter and
1 % loss on every link still forms its group, finishes and averages exactly.

The links are the test bed's delayed links (``HostSpec(delay_ms=..., jitter_ms=...,
loss=...)``, a userspace wire per link): every packet between two daemons waits 100 ms per
round trip, more or less 10 ms, and about 2 % of them (1 % per link crossed) are lost and
resent by TCP. Root and a C compiler; skipped otherwise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.testbed import HostSpec, wire
from tests.deploy.conftest import MakeTestBed
from tests.deploy.test_swarm_on_testbed import (
    average_all,
    check_one_whole_group,
    make_inputs,
    start_daemon,
)
from tests.harness import ProcessPool

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(wire.missing_requirements() is not None, reason="no wire here"),
]


@pytest.mark.timeout(120)
async def test_a_round_at_rtt_100_ms_with_loss_and_jitter_averages_exactly(
    make_testbed: MakeTestBed, peer_pool: ProcessPool, tmp_path: Path
) -> None:
    # RTT between any two hosts: 2 * (25 + 25) ms.
    bed = make_testbed(
        [HostSpec(f"h{i}", rate_mbit=50, delay_ms=25, jitter_ms=5, loss=0.01) for i in range(4)]
    )
    hosts = list(bed.hosts.values())
    daemons = [start_daemon(peer_pool, hosts[0], tmp_path)]
    for host in hosts[1:]:
        daemons.append(start_daemon(peer_pool, host, tmp_path, join=daemons[0].address))

    inputs = make_inputs(4, [500_000, 11], seed=3)
    sent_before = [host.link_bytes()[0] for host in hosts]
    results = await average_all(daemons, inputs, key="long-link-step", timeout=60)
    check_one_whole_group(results, inputs)
    payload = 2 * 3 / 4 * 2_000_000  # a butterfly sends 2 * (n - 1) / n of the data
    for host, before in zip(hosts, sent_before, strict=True):
        assert host.link_bytes()[0] - before >= payload
