"""On the wire: a private run's tensors never cross a link in clear.

Real ``swarmavg peer`` daemons, one per test bed host, average a tensor filled with a
recognisable float32 pattern while a raw-socket capture (deploy/testbed/capture.py) records
every frame on one host's link. In a public run the pattern's bytes are on the wire (the control
case: the check can fail); in a private run, over the same links with the same tensors, they
never are, while the round still averages correctly.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from deploy.testbed import Host, HostSpec
from deploy.testbed.capture import read_frames
from swarmavg.peer import connect_async
from swarmavg.peer.client.calls import AverageResult
from tests.deploy.conftest import MakeTestBed
from tests.harness import ProcessPool, SwarmavgProcess
from tests.private_runs import Authority

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
CAPTURE = REPO / "deploy" / "testbed" / "capture.py"
# Four float32 values no codec, header or TLS record would produce by chance; 16 bytes.
PATTERN = np.array([7919.0137, -31.337, 2.7182817, 4242.4243], dtype=np.float32)
ELEMENTS = 200_000  # 800 kB per peer: thousands of copies of the pattern per round


@contextmanager
def capturing(host: Host, out: Path) -> Iterator[dict[str, int]]:
    """Capture ``host``'s link while the block runs; yields the capture's final figures."""
    proc = host.popen(
        [sys.executable, str(CAPTURE), "--device", "eth0", "--out", str(out), "--seconds", "120"],
        stdout=subprocess.PIPE,
    )
    figures: dict[str, int] = {}
    try:
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline() or b"{}")
        assert ready.get("event") == "ready", ready
        yield figures
    finally:
        proc.terminate()
        out_text, _ = proc.communicate(timeout=30)
        for line in out_text.decode().splitlines():
            record = json.loads(line)
            if record.get("event") == "done":
                figures.update(record)


def start_daemons(
    pool: ProcessPool, hosts: Sequence[Host], workdir: Path, port: int, flags: Sequence[list[str]]
) -> list[SwarmavgProcess]:
    daemons: list[SwarmavgProcess] = []
    for host, extra in zip(hosts, flags, strict=True):
        args = ["peer", "--listen", f"{host.address}:{port}"]
        args += ["--control", str(workdir / f"{host.name}-{port}.sock"), *extra]
        if daemons:
            args += ["--join", daemons[0].address]
        daemons.append(pool.start(args, executable=host.swarmavg_command()))
    return daemons


async def average_pattern(daemons: Sequence[SwarmavgProcess], key: str) -> list[AverageResult]:
    tensor = np.tile(PATTERN, ELEMENTS // PATTERN.size)

    async def one(daemon: SwarmavgProcess) -> AverageResult:
        async with connect_async(daemon.control) as client:
            return await client.average(
                [tensor], key=key, group_size=len(daemons), min_group_size=len(daemons), timeout=60
            )

    results = await asyncio.gather(*(one(d) for d in daemons))
    for result in results:
        assert result.group_size == len(daemons)
        np.testing.assert_array_equal(result.tensors[0], tensor)  # the mean of equal inputs
    return results


def captured(out: Path) -> bytes:
    return b"".join(read_frames(out))


@pytest.mark.timeout(240)
def test_no_tensor_bytes_in_clear_on_the_link_of_a_private_run(
    make_testbed: MakeTestBed, peer_pool: ProcessPool, tmp_path: Path
) -> None:
    bed = make_testbed([HostSpec(f"h{i}", rate_mbit=200) for i in range(3)])
    hosts = list(bed.hosts.values())
    needle = PATTERN.tobytes()
    payload = ELEMENTS * 4

    # Public run (the control): the pattern crosses h0's link in clear.
    public = start_daemons(peer_pool, hosts, tmp_path, 31337, [["--run-id", "open"]] * 3)
    with capturing(hosts[0], tmp_path / "public.pcap") as public_figures:
        asyncio.run(average_pattern(public, "round"))
    public_wire = captured(tmp_path / "public.pcap")
    assert public_figures["drops"] == 0
    assert public_wire.count(needle) > 1000

    # Private run: same hosts, same tensor, every member invited.
    authority = Authority.create(tmp_path / "run", "closed")
    members = [authority.invite(host.name) for host in hosts]
    private = start_daemons(
        peer_pool, hosts, tmp_path, 31338, [authority.peer_flags(m) for m in members]
    )
    with capturing(hosts[0], tmp_path / "private.pcap") as private_figures:
        asyncio.run(average_pattern(private, "round"))
    private_wire = captured(tmp_path / "private.pcap")
    assert private_figures["drops"] == 0
    # The round's bytes did cross the link (h0 sends and receives its share of the parts)...
    assert len(private_wire) > payload
    # ...and none of them in clear.
    assert private_wire.count(needle) == 0
    assert needle[:8] not in private_wire
