"""The multi-host test bed itself: reachability, rate limits, NAT, link cuts and cleanup.

These run real network namespaces (root, iproute2, iptables); ``make_testbed`` skips them
with the reason where the machine cannot.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap

import pytest

from deploy.testbed import HostSpec, TestBed, TestBedError, _system, list_namespaces, sweep_stale
from deploy.testbed.goodput import Sink, all_to_all, send, send_command, transfer
from tests.deploy.conftest import MakeTestBed

pytestmark = pytest.mark.timeout(60)


def _leftovers(prefix: str) -> list[str]:
    return [name for name in list_namespaces() if name.startswith(prefix)]


def test_hosts_reach_each_other_from_their_own_addresses(make_testbed: MakeTestBed) -> None:
    bed = make_testbed([HostSpec("a"), HostSpec("b"), HostSpec("c")])
    addresses = {host.address for host in bed.hosts.values()}
    assert len(addresses) == 3
    for src, dst in [("a", "b"), ("b", "c"), ("c", "a")]:
        result = transfer(bed[src], bed[dst], 1_000_000)
        assert result.nbytes == 1_000_000
        assert result.peer.split(":")[0] == bed[src].address


def test_rate_limit_applies_in_both_directions(make_testbed: MakeTestBed) -> None:
    rate = 20.0
    bed = make_testbed([HostSpec("slow", rate_mbit=rate), HostSpec("fast"), HostSpec("other")])
    nbytes = 4_000_000  # 1.6 s at 20 Mbit/s; the 16 KiB bucket is noise next to it
    upload = transfer(bed["slow"], bed["fast"], nbytes)
    download = transfer(bed["fast"], bed["slow"], nbytes)
    unshaped = transfer(bed["fast"], bed["other"], nbytes)
    for shaped in (upload, download):
        # The shaper can never be beaten (payload < frame bytes); CPU noise only slows it.
        assert shaped.mbit_per_s <= rate * 1.05
        assert shaped.mbit_per_s >= rate * 0.5
    assert unshaped.mbit_per_s > 3 * max(upload.mbit_per_s, download.mbit_per_s)


def test_set_rate_changes_and_removes_the_limit(make_testbed: MakeTestBed) -> None:
    bed = make_testbed([HostSpec("a", rate_mbit=10), HostSpec("b")])
    qdiscs = bed["a"].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" in qdiscs
    assert "10Mbit" in qdiscs
    bed.set_rate("a", 50)
    assert "50Mbit" in bed["a"].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    far_namespace, far_device = bed["a"].link_ends[1]
    far = subprocess.run(
        ["ip", "netns", "exec", far_namespace, "tc", "qdisc", "show", "dev", far_device],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "50Mbit" in far
    bed.set_rate("a", None)
    assert "tbf" not in bed["a"].run(["tc", "qdisc", "show", "dev", "eth0"]).stdout
    assert bed["a"].rate_mbit is None


def test_nat_host_dials_out_but_cannot_be_dialled(make_testbed: MakeTestBed) -> None:
    bed = make_testbed([HostSpec("pub"), HostSpec("home", nat=True)])
    home, pub = bed["home"], bed["pub"]
    assert home.public_address != home.address

    # Dialling out works, and the other side sees the router's address (MASQUERADE).
    out = transfer(home, pub, 500_000)
    assert out.peer.split(":")[0] == home.public_address

    sink = Sink(home, connections=2, timeout=30)
    try:
        port = sink.port
        # The host itself reaches its listener: it is up.
        assert send(home, sink.endpoint, 1000)["event"] == "sent"
        assert sink.wait_received().nbytes == 1000
        # Nobody outside does: no route to the private range, nothing listens on the router.
        for endpoint in (f"{home.address}:{port}", f"{home.public_address}:{port}"):
            assert send(pub, endpoint, 1000, timeout=2)["event"] == "error"
        # Even a peer that routes the private range through the router is dropped by it.
        pub.run(["ip", "route", "add", f"{home.address}/32", "via", home.public_address])
        record = send(pub, f"{home.address}:{port}", 1000, timeout=2)
        assert record["event"] == "error"
        assert "timed out" in record["error"]
    finally:
        sink.close()


def test_cut_link_silences_a_host_mid_transfer_and_restore_heals_it(
    make_testbed: MakeTestBed,
) -> None:
    bed = make_testbed([HostSpec("a"), HostSpec("b", rate_mbit=20)])
    sink = Sink(bed["b"], timeout=30)
    # 50 MB need 20 s at 20 Mbit/s: the cut certainly lands mid-transfer.
    sender = subprocess.Popen(
        send_command(bed["a"], sink.endpoint, 50_000_000, timeout=2),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sink.wait_accepted()
        bed.cut_link("b")
        out, _ = sender.communicate(timeout=30)
        record = json.loads(out.strip().splitlines()[-1])
        # Silence, not a reset: the sender's own deadline is what ends it.
        assert record["event"] == "error"
        assert "timed out" in record["error"]
    finally:
        if sender.poll() is None:
            sender.kill()
        sender.wait(10)
        if sender.stdout is not None:
            sender.stdout.close()
        sink.close()
    bed.restore_link("b")
    assert transfer(bed["a"], bed["b"], 200_000).nbytes == 200_000


def test_close_removes_namespaces_and_processes(make_testbed: MakeTestBed) -> None:
    bed = make_testbed([HostSpec("a", rate_mbit=10), HostSpec("n", nat=True)])
    assert len(_leftovers(bed.prefix)) == 4  # switch, a, router, n
    sleeper = bed["n"].popen(["sleep", "60"])
    bed.close()
    assert sleeper.wait(10) != 0  # killed by close(), not finished
    assert _leftovers(bed.prefix) == []
    bed.close()  # idempotent
    with pytest.raises(TestBedError, match="closed"):
        bed.start()


def test_keyboard_interrupt_inside_the_block_still_cleans_up(make_testbed: MakeTestBed) -> None:
    make_testbed([HostSpec("x")])  # skips where test beds cannot run
    prefixes: list[str] = []

    def interrupted() -> None:
        with TestBed([HostSpec("a"), HostSpec("b", nat=True)]) as bed:
            prefixes.append(bed.prefix)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    [prefix] = prefixes
    assert _leftovers(prefix) == []


def test_failure_while_building_removes_what_was_built(
    make_testbed: MakeTestBed, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_testbed([HostSpec("x")])  # skips where test beds cannot run
    real_run = _system.run

    def failing_run(args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        if "MASQUERADE" in args:
            raise TestBedError("injected failure")
        return real_run(args, check=check)

    monkeypatch.setattr(_system, "run", failing_run)
    bed = TestBed([HostSpec("a"), HostSpec("b", nat=True)])
    with pytest.raises(TestBedError, match="injected"):
        bed.start()
    monkeypatch.undo()
    assert _leftovers(bed.prefix) == []


def test_leftovers_of_a_killed_owner_are_swept(make_testbed: MakeTestBed) -> None:
    make_testbed([HostSpec("x")])  # skips where test beds cannot run
    script = textwrap.dedent(
        """
        import os, signal, subprocess
        from deploy.testbed import HostSpec, TestBed
        bed = TestBed([HostSpec("a"), HostSpec("n", nat=True)]).start()
        bed["n"].popen(["sleep", "60"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(bed.prefix, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no finally, no atexit
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    prefix = done.stdout.strip()
    assert prefix, done.stderr
    assert len(_leftovers(prefix)) == 4
    sweep_stale()
    assert _leftovers(prefix) == []


def test_two_test_beds_with_the_same_host_names_coexist(make_testbed: MakeTestBed) -> None:
    first = make_testbed([HostSpec("a"), HostSpec("b", nat=True)])
    second = make_testbed([HostSpec("a"), HostSpec("b", nat=True)])
    assert first.prefix != second.prefix
    assert not set(first.namespaces) & set(second.namespaces)
    for bed in (first, second):
        assert transfer(bed["b"], bed["a"], 100_000).peer.split(":")[0] == bed["b"].public_address
    second.close()  # closing one leaves the other intact
    assert _leftovers(second.prefix) == []
    assert transfer(first["b"], first["a"], 100_000).nbytes == 100_000


_UDP_PROBE = textwrap.dedent(
    """
    import socket, sys
    mode, address, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if mode == "recv":
        sock.bind((address, 0))
        sock.settimeout(20)
        print(sock.getsockname()[1], flush=True)
        print(len(sock.recv(65536)), flush=True)
    else:  # send one datagram that may not be fragmented (DF set)
        # Linux's IP_MTU_DISCOVER = 10, IP_PMTUDISC_DO = 2 (named in socket from 3.12 on)
        sock.setsockopt(socket.IPPROTO_IP, 10, 2)
        host, port = address.rsplit(":", 1)
        try:
            sock.sendto(b"x" * size, (host, int(port)))
            print("sent", flush=True)
        except OSError as exc:
            print(exc.strerror, flush=True)
    """
)


def _mtu(namespace: str, device: str) -> int:
    done = _system.run(["ip", "-n", namespace, "-j", "link", "show", "dev", device])
    return int(json.loads(done.stdout)[0]["mtu"])


def test_mtu_sets_both_ends_and_carries_jumbo_frames_unfragmented(
    make_testbed: MakeTestBed,
) -> None:
    bed = make_testbed(
        [HostSpec("j1", mtu=9000), HostSpec("j2", mtu=9000, nat=True), HostSpec("plain")]
    )
    for name in ("j1", "j2"):
        assert all(_mtu(ns, dev) == 9000 for ns, dev in bed[name].link_ends)
    assert all(_mtu(ns, dev) == 1500 for ns, dev in bed["plain"].link_ends)
    size = 8972  # 9000 - 20 (IPv4) - 8 (UDP)
    receiver = bed["j1"].popen(
        [sys.executable, "-c", _UDP_PROBE, "recv", bed["j1"].address, "0"], stdout=subprocess.PIPE
    )
    try:
        assert receiver.stdout is not None
        port = int(receiver.stdout.readline())
        target = f"{bed['j1'].address}:{port}"
        # From a host of the same MTU (through its NAT router's jumbo LAN): one whole frame.
        sent = bed["j2"].run([sys.executable, "-c", _UDP_PROBE, "send", target, str(size)])
        assert sent.stdout.strip() == "sent"
        assert int(receiver.stdout.readline()) == size
    finally:
        receiver.kill()
        receiver.wait(10)
        if receiver.stdout is not None:
            receiver.stdout.close()
    # A host left at 1500 cannot even send it unfragmented.
    refused = bed["plain"].run([sys.executable, "-c", _UDP_PROBE, "send", target, str(size)])
    assert refused.stdout.strip() == "Message too long"
    assert transfer(bed["j2"], bed["j1"], 4_000_000).nbytes == 4_000_000


@pytest.mark.parametrize("mtu", [575, 9001, 0])
def test_an_mtu_out_of_range_is_refused_before_anything_is_built(mtu: int) -> None:
    with pytest.raises(ValueError, match="mtu must be in"):
        TestBed([HostSpec("a", mtu=mtu)])


def test_all_to_all_splits_each_pairs_bytes_over_its_connections(
    make_testbed: MakeTestBed,
) -> None:
    bed = make_testbed([HostSpec("a"), HostSpec("b"), HostSpec("c")])
    hosts = list(bed.hosts.values())
    exchange = all_to_all(hosts, 300_000, connections_per_pair=3)
    # 3 hosts, 2 peers each, 3 connections per pair: 18 connections of a third each.
    assert len(exchange.transfers) == 18
    assert all(t.nbytes == 100_000 for t in exchange.transfers)
    by_source: dict[str, int] = {}
    for t in exchange.transfers:
        source = t.peer.rpartition(":")[0]
        by_source[source] = by_source.get(source, 0) + t.nbytes
    assert by_source == {host.address: 600_000 for host in hosts}


def test_a_shifted_all_to_all_sends_to_one_peer_after_another(make_testbed: MakeTestBed) -> None:
    bed = make_testbed([HostSpec("a"), HostSpec("b"), HostSpec("c"), HostSpec("d")])
    hosts = list(bed.hosts.values())
    exchange = all_to_all(hosts, 200_000, shifted=True)
    assert len(exchange.transfers) == 12
    assert all(t.nbytes == 200_000 for t in exchange.transfers)
    # Host i's transfers, by start: to i+1, then i+2, then i+3, each begun after the one
    # before it ended (the sinks timestamp accept and EOF on one monotonic clock).
    index = {host.address: i for i, host in enumerate(hosts)}
    for i, host in enumerate(hosts):
        sent = sorted(
            (t for t in exchange.transfers if t.peer.rpartition(":")[0] == host.address),
            key=lambda t: t.started_at,
        )
        assert [index[t.receiver] for t in sent] == [(i + k) % 4 for k in (1, 2, 3)]
        assert all(a.ended_at <= b.started_at for a, b in itertools.pairwise(sent))
