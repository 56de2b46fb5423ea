"""``--congestion-control`` on the test bed: real daemons in network namespaces (which may
not change the machine-wide algorithm) give their data-plane sockets the chosen one, seen
from outside the processes with ``ss``, and average over rate-limited links."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.testbed import Host, HostSpec
from swarmavg.peer.client.calls import AverageResult
from tests.deploy.conftest import MakeTestBed
from tests.deploy.test_swarm_on_testbed import PORT, average_all, check_exact_mean, make_inputs
from tests.harness import ProcessPool, SwarmavgProcess

pytestmark = pytest.mark.integration

_ENDPOINT = re.compile(r"^\s*\d+\s+\d+\s+(\S+):(\d+)\s+(\S+):(\d+)\s+(\S+)")


def sysctl(host: Host, name: str) -> str:
    """``net.ipv4.X`` as ``host``'s network namespace has it (coreutils only: no procps)."""
    return host.run(["cat", "/proc/sys/" + name.replace(".", "/")]).stdout.strip()


def connections(host: Host) -> list[tuple[int, int, str]]:
    """``(local port, remote port, algorithm)`` of every established TCP connection in
    ``host``, as ``ss`` reports them."""
    done = host.run(["ss", "-tinHO", "state", "established"])
    found = []
    for line in done.stdout.splitlines():
        match = _ENDPOINT.match(line)
        if match is not None:
            found.append((int(match[2]), int(match[4]), match[5]))
    return found


def start_daemon(
    pool: ProcessPool, host: Host, workdir: Path, algorithm: str, join: str | None
) -> SwarmavgProcess:
    args = ["peer", "--run-id", "cc", "--control", str(workdir / f"{host.name}.sock")]
    args += ["--listen", f"{host.address}:{PORT}", "--congestion-control", algorithm]
    if join is not None:
        args += ["--join", join]
    return pool.start(args, executable=host.swarmavg_command())


@pytest.mark.timeout(120)
async def test_data_plane_sockets_use_the_chosen_algorithm_on_the_test_bed(
    make_testbed: MakeTestBed, peer_pool: ProcessPool, tmp_path: Path
) -> None:
    bed = make_testbed([HostSpec(f"h{i}", rate_mbit=50) for i in range(3)])
    hosts = list(bed.hosts.values())
    default = sysctl(hosts[0], "net.ipv4.tcp_congestion_control")
    available = sysctl(hosts[0], "net.ipv4.tcp_available_congestion_control").split()
    # One the namespaces do not use already (reno is always built in).
    algorithm = next(a for a in ("cubic", "reno") if a != default and a in available)

    daemons = [start_daemon(peer_pool, hosts[0], tmp_path, algorithm, None)]
    for host in hosts[1:]:
        daemons.append(start_daemon(peer_pool, host, tmp_path, algorithm, daemons[0].address))
    inputs = make_inputs(3, [500_000])
    results = await average_all(daemons, inputs, key="step-1", timeout=60)
    ok = [r for r in results if isinstance(r, AverageResult)]
    assert len(ok) == 3, results
    assert not any(r.partial for r in ok)
    check_exact_mean(ok, inputs)

    for host in hosts:
        seen = connections(host)
        # gRPC (matchmaking, DHT) runs on PORT and keeps the kernel's default; every other
        # connection between the daemons is the data plane, which the senders keep open
        # for the next round and the reducers hold: both ends must show the algorithm.
        data = [cc for local, remote, cc in seen if PORT not in (local, remote)]
        grpc = [cc for local, remote, cc in seen if PORT in (local, remote)]
        assert len(data) >= 2 * (len(hosts) - 1), (host.name, seen)  # 2 out, 2 in
        assert set(data) == {algorithm}, (host.name, seen)
        assert grpc, (host.name, seen)
        assert set(grpc) == {default}, (host.name, seen)  # per socket, not machine-wide


_LISTEN = """
import socket, sys
from swarmavg.averaging.allreduce.congestion import path_min_rtt
with socket.create_server((sys.argv[1], 0)) as listener:
    print(listener.getsockname()[1], flush=True)
    for _ in range(2):  # the first connection's handshake also waits for ARP
        conn, _ = listener.accept()
        with conn:
            conn.recv(1)
            rtt = path_min_rtt(conn)
    print(rtt, flush=True)
"""
_CONNECT = """
import socket, sys
from swarmavg.averaging.allreduce.congestion import algorithm_for_path, path_min_rtt
for _ in range(2):  # the first connection's handshake also waits for ARP
    with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as conn:
        rtt = path_min_rtt(conn)
        conn.sendall(b"x")
print(rtt, algorithm_for_path(rtt, "cubic"), flush=True)
"""


@pytest.mark.timeout(60)
def test_auto_reads_the_paths_round_trip_at_both_ends_on_the_test_bed(
    make_testbed: MakeTestBed,
) -> None:
    bed = make_testbed([HostSpec("a", delay_ms=20), HostSpec("b", delay_ms=30), HostSpec("c")])
    for peer, rtt_ms, algorithm in (("b", 100.0, "bbr"), ("c", 40.0, "cubic")):  # 2 x delays
        listener = bed[peer].popen(
            [sys.executable, "-c", _LISTEN, bed[peer].address],
            stdout=subprocess.PIPE,
        )
        try:
            assert listener.stdout is not None
            port = listener.stdout.readline().decode().strip()
            done = bed["a"].run([sys.executable, "-c", _CONNECT, bed[peer].address, port])
            rtt, chosen = done.stdout.split()
            server_rtt = float(listener.stdout.readline().decode())
        finally:
            listener.kill()
            listener.wait(10)
            if listener.stdout is not None:
                listener.stdout.close()
        # The handshake's sample: never below the wire's delays, a little above at most.
        for measured in (float(rtt), server_rtt):
            assert rtt_ms * 0.999 <= measured * 1000 <= rtt_ms * 1.5 + 5, (peer, measured)
        assert chosen == algorithm
