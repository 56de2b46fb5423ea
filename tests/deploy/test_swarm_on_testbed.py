"""Real ``swarmavg peer`` daemons on the multi-host test bed: one per network namespace,
started through the CLI, averaging over rate-limited links, through NAT, and with a link cut
in the middle of a round.

The training side is the real async client in the test process: it reaches each daemon
through the daemon's unix control socket (filesystem paths are shared between namespaces),
exactly as a training process on that host would; all peer-to-peer traffic crosses the
shaped links of the test bed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from deploy.testbed import Host, HostSpec
from swarmavg.peer import connect_async
from swarmavg.peer.client.calls import AverageResult
from tests.deploy.conftest import MakeTestBed
from tests.harness import ProcessPool, SwarmavgProcess

pytestmark = pytest.mark.integration

PORT = 31337


def start_daemon(
    pool: ProcessPool,
    host: Host,
    workdir: Path,
    *,
    join: str | None = None,
    listen: str | None = None,
    client_mode: bool = False,
) -> SwarmavgProcess:
    """``swarmavg peer`` inside ``host``; its control socket is ``workdir/<host>.sock``."""
    args = ["peer", "--run-id", "testbed", "--control", str(workdir / f"{host.name}.sock")]
    if client_mode:
        args.append("--client-mode")
    else:
        args += ["--listen", listen or f"{host.address}:{PORT}"]
    if join is not None:
        args += ["--join", join]
    return pool.start(args, executable=host.swarmavg_command())


def start_together(starts: Sequence[Callable[[], SwarmavgProcess]]) -> list[SwarmavgProcess]:
    """Run daemon starts at once, as the machines of a swarm start: each start is mostly
    waiting (its interpreter for a CPU, its dial-back for an answer that a NATed host never
    gets), and those waits overlap instead of adding up. Returns the daemons in order."""
    with ThreadPoolExecutor(len(starts)) as starting:
        return list(starting.map(lambda start: start(), starts))


async def average_all(
    daemons: Sequence[SwarmavgProcess],
    inputs: Sequence[list[np.ndarray]],
    key: str,
    timeout: float,
) -> list[AverageResult | BaseException]:
    """Every daemon's training process calls ``average`` at once; results or errors."""

    async def one(daemon: SwarmavgProcess, tensors: list[np.ndarray]) -> AverageResult:
        async with connect_async(daemon.control) as client:
            return await client.average(
                tensors,
                key=key,
                group_size=len(daemons),
                min_group_size=len(daemons),
                timeout=timeout,
            )

    return await asyncio.gather(
        *(one(d, t) for d, t in zip(daemons, inputs, strict=True)), return_exceptions=True
    )


def make_inputs(n: int, sizes: Sequence[int], seed: int = 0) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(size, dtype=np.float32) for size in sizes] for _ in range(n)]


def check_exact_mean(results: Sequence[AverageResult], inputs: Sequence[list[np.ndarray]]) -> None:
    for index in range(len(inputs[0])):
        expected = np.mean([tensors[index] for tensors in inputs], axis=0, dtype=np.float64)
        first = results[0].tensors[index]
        np.testing.assert_allclose(first, expected, rtol=1e-5, atol=1e-6)
        for result in results[1:]:  # bit-identical across members
            assert np.array_equal(result.tensors[index], first)


def check_one_whole_group(
    results: Sequence[AverageResult | BaseException], inputs: Sequence[list[np.ndarray]]
) -> list[AverageResult]:
    """Every call returned, in one group of all callers, none partial, with the exact
    mean; the results."""
    assert all(isinstance(r, AverageResult) for r in results), results
    ok = [r for r in results if isinstance(r, AverageResult)]
    check_exact_mean(ok, inputs)
    for result in ok:
        assert result.group_size == len(inputs)
        assert not result.partial
    return ok


def status_inside(host: Host, daemon: SwarmavgProcess) -> dict[str, object]:
    """``swarmavg status --json`` run on the daemon's host, as an operator would."""
    command = [sys.executable, "-m", "swarmavg.peer.cli", "status", "--json"]
    done = host.run([*command, "--control", daemon.control], timeout=60)
    status: dict[str, object] = json.loads(done.stdout)
    return status


@pytest.mark.timeout(120)
async def test_four_hosts_average_over_limited_links(
    make_testbed: MakeTestBed, peer_pool: ProcessPool, tmp_path: Path
) -> None:
    bed = make_testbed([HostSpec(f"h{i}", rate_mbit=50) for i in range(4)])
    hosts = list(bed.hosts.values())
    # Every host on the same port of its own address, found by the daemon itself
    # (wildcard listen): like four real machines.
    first = start_daemon(peer_pool, hosts[0], tmp_path, listen=f"0.0.0.0:{PORT}")
    joiners = [
        functools.partial(
            start_daemon, peer_pool, host, tmp_path, join=first.address,
            listen=f"0.0.0.0:{PORT}",
        )
        for host in hosts[1:]
    ]  # fmt: skip
    daemons = [first, *start_together(joiners)]
    assert [d.address for d in daemons] == [f"{h.address}:{PORT}" for h in hosts]

    inputs = make_inputs(4, [1_000_000, 37])
    sent_before = [host.link_bytes()[0] for host in hosts]
    results = await average_all(daemons, inputs, key="step-1", timeout=60)
    for result in check_one_whole_group(results, inputs):
        assert set(result.peers) == {d.peer_id for d in daemons}
    # The tensors crossed the shaped links: a butterfly sends 2*(n-1)/n of the data.
    payload = 2 * 3 / 4 * 4_000_000
    for host, before in zip(hosts, sent_before, strict=True):
        assert host.link_bytes()[0] - before >= payload

    status = status_inside(hosts[2], daemons[2])
    assert status["peer_id"] == daemons[2].peer_id
    assert status["rounds_done"] == 1
    assert isinstance(status["known_peers"], int)
    assert status["known_peers"] >= 3


@pytest.mark.timeout(120)
async def test_host_behind_nat_joins_in_client_mode_and_averages(
    make_testbed: MakeTestBed, peer_pool: ProcessPool, tmp_path: Path
) -> None:
    bed = make_testbed(
        [HostSpec("pub0", rate_mbit=50), HostSpec("pub1", rate_mbit=50), HostSpec("home", nat=True)]
    )
    first = start_daemon(peer_pool, bed["pub0"], tmp_path)
    second, home = start_together(
        [
            functools.partial(start_daemon, peer_pool, bed["pub1"], tmp_path, join=first.address),
            functools.partial(
                start_daemon, peer_pool, bed["home"], tmp_path, join=first.address, client_mode=True
            ),
        ]
    )
    daemons = [first, second, home]

    inputs = make_inputs(3, [500_000], seed=1)
    home_sent_before = bed["home"].link_bytes()[0]
    results = await average_all(daemons, inputs, key="nat-step", timeout=60)
    assert all(isinstance(r, AverageResult) for r in results), results
    ok = [r for r in results if isinstance(r, AverageResult)]
    check_exact_mean(ok, inputs)
    for result in ok:
        assert result.group_size == 3
        assert home.peer_id in result.peers
    # A client-mode peer reduces nothing, but its tensors went out through the NAT router.
    assert bed["home"].link_bytes()[0] - home_sent_before >= 2_000_000 * 2 / 3
    status = status_inside(bed["home"], home)
    assert status["client_mode"] is True
    assert status["address"] is None


@pytest.mark.timeout(120)
async def test_link_cut_mid_round_the_others_finish_within_their_timeout(
    make_testbed: MakeTestBed, peer_pool: ProcessPool, tmp_path: Path
) -> None:
    rate = 10.0
    bed = make_testbed([HostSpec(f"h{i}", rate_mbit=rate) for i in range(4)])
    hosts = list(bed.hosts.values())
    first = start_daemon(peer_pool, hosts[0], tmp_path)
    joiners = [
        functools.partial(start_daemon, peer_pool, host, tmp_path, join=first.address)
        for host in hosts[1:]
    ]
    daemons = [first, *start_together(joiners)]
    victim = 3
    # 4 MB each: a butterfly moves 6 MB per host, about 5 s at 10 Mbit/s, so the cut, made
    # once the victim has sent 1 MB of it, lands in the middle of the exchange.
    inputs = make_inputs(4, [1_000_000], seed=2)
    timeout = 30.0
    sent_before = hosts[victim].link_bytes()[0]

    async def victim_sent() -> int:
        tx, _ = await asyncio.to_thread(hosts[victim].link_bytes)
        return tx - sent_before

    async def cut_mid_round() -> None:
        # A kernel counter has no event to wait on: poll it.
        while await victim_sent() < 1_000_000:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        await asyncio.to_thread(bed.cut_link, hosts[victim].name)

    cutter = asyncio.create_task(cut_mid_round())
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        results = await average_all(daemons, inputs, key="cut-step", timeout=timeout)
    finally:
        if not cutter.done():
            cutter.cancel()
        await asyncio.gather(cutter, return_exceptions=True)
    elapsed = loop.time() - started
    assert cutter.done()
    assert not cutter.cancelled(), "the round ended before the victim sent 1 MB"

    survivors = [r for i, r in enumerate(results) if i != victim]
    assert all(isinstance(r, AverageResult) for r in survivors), survivors
    # The contract (docs/averaging.md, "Failures"): a member that fails never makes the
    # others hang; they finish within their own timeout, with partial results. The client
    # would have raised a deadline error otherwise; the elapsed check only restates that.
    assert elapsed < timeout + 5
    ok = [r for r in survivors if isinstance(r, AverageResult)]
    mean_all = np.mean([t[0] for t in inputs], axis=0, dtype=np.float64)
    mean_rest = np.mean(
        [t[0] for i, t in enumerate(inputs) if i != victim], axis=0, dtype=np.float64
    )
    for index, result in zip([i for i in range(4) if i != victim], ok, strict=True):
        assert result.partial
        out = np.asarray(result.tensors[0], dtype=np.float64)
        # Every element is averaged with or without the victim, or (for the part the victim
        # was reducing) left at the member's own value.
        close = [
            np.isclose(out, reference, rtol=1e-5, atol=1e-6)
            for reference in (mean_all, mean_rest, inputs[index][0])
        ]
        assert np.logical_or.reduce(close).all()
        assert close[0].any() or close[1].any()  # the surviving parts were averaged
