"""The test bed's links with propagation delay, jitter and loss (``HostSpec(delay_ms=...,
jitter_ms=..., loss=...)``), measured from inside the hosts: UDP echoes for the round-trip
time, its spread and the loss rate, TCP for the rate limit on a delayed link.

Root and a C compiler, like the rest of the test bed; ``make_testbed`` skips where the
machine cannot run one. Bounds are statistical (counted probes) or physical (a wire never
delivers a frame before its delay); the upper bounds on time allow for a loaded machine.
"""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
import textwrap
import time

import pytest

from deploy.testbed import HostSpec, list_namespaces, sweep_stale, wire
from deploy.testbed.goodput import send, transfer
from deploy.testbed.latency import echo
from tests.deploy.conftest import MakeTestBed

pytestmark = [
    pytest.mark.timeout(90),
    pytest.mark.skipif(wire.missing_requirements() is not None, reason="no wire here"),
]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_round_trip_time_is_twice_the_delays_on_the_path(make_testbed: MakeTestBed) -> None:
    bed = make_testbed([HostSpec("a", delay_ms=20), HostSpec("b", delay_ms=30), HostSpec("plain")])
    for peer, expected_ms in (("b", 100.0), ("plain", 40.0)):  # 2 * (20 + 30), 2 * 20
        # Best of three runs: a burst of load on the shared machine delays the processes
        # that time the probes, which is not the link's doing.
        runs = [echo(bed["a"], bed[peer], count=80, interval=0.01) for _ in range(3)]
        for run in runs:
            assert run.loss == 0
            # A wire never lets a frame through before its delay...
            assert min(run.answered) >= expected_ms * 0.999
        # ...and holds it no longer than that, but for the time the processes take to run.
        best = min(run.median_ms for run in runs)
        assert best <= expected_ms * 1.03 + 0.5, [run.median_ms for run in runs]


def test_loss_rate_is_the_probability_asked(make_testbed: MakeTestBed) -> None:
    loss = 0.1
    bed = make_testbed([HostSpec("lossy", loss=loss), HostSpec("b", delay_ms=1)])
    count = 16_000
    run = echo(bed["b"], bed["lossy"], count=count, interval=0.0004)
    # A probe and its echo each cross the lossy link once.
    expected = 1 - (1 - loss) ** 2
    sigma = math.sqrt(expected * (1 - expected) / count)  # about 0.0031: 1.6 % of 0.19
    assert abs(run.loss - expected) <= 4 * sigma, run.loss


def test_jitter_spreads_the_delay_within_its_bounds_and_keeps_order(
    make_testbed: MakeTestBed,
) -> None:
    bed = make_testbed([HostSpec("j", delay_ms=20, jitter_ms=10), HostSpec("plain")])
    run = echo(bed["plain"], bed["j"], count=300, interval=0.01)
    low, high = 2 * (20 - 10), 2 * (20 + 10)
    assert run.loss == 0
    assert min(run.answered) >= low * 0.999
    # Delays only add on a busy machine (the wire and the probes wait for a CPU), so the
    # upper bound is checked on the median: a tail past it is the scheduler's, not the wire's.
    assert statistics.median(run.answered) <= high, sorted(run.answered)[-30:]
    # The delay does vary (each direction walks through the whole +-10 ms)...
    assert statistics.pstdev(run.answered) >= 3
    assert max(run.answered) - min(run.answered) >= 20
    # ...but no frame overtakes another: echoes come back in the order of the probes.
    assert run.reordered == 0


def test_rate_limit_still_holds_on_a_delayed_link(make_testbed: MakeTestBed) -> None:
    rate = 20.0
    bed = make_testbed(
        [HostSpec("slow", rate_mbit=rate, delay_ms=10), HostSpec("far", delay_ms=10)]
    )
    nbytes = 6_000_000  # 2.4 s at 20 Mbit/s; TCP's start at RTT 40 ms takes about 0.2 s
    for sender, receiver in (("slow", "far"), ("far", "slow")):
        shaped = transfer(bed[sender], bed[receiver], nbytes)
        assert shaped.mbit_per_s <= rate * 1.05
        assert shaped.mbit_per_s >= rate * 0.8, (sender, shaped.mbit_per_s)


def test_cut_link_silences_a_delayed_host_and_restore_heals_it(
    make_testbed: MakeTestBed,
) -> None:
    bed = make_testbed([HostSpec("a", delay_ms=5, loss=0.01), HostSpec("b")])
    bed.cut_link("a")
    record = send(bed["a"], f"{bed['b'].address}:9", 1000, timeout=2)
    assert record["event"] == "error"
    assert "timed out" in record["error"]
    bed.restore_link("a")
    # The address resolution that failed during the cut may still be pending and would fail
    # the next connection too (EHOSTUNREACH): start afresh, as a host does on link-up.
    bed["a"].run(["ip", "neigh", "flush", "dev", "eth0"])
    assert transfer(bed["a"], bed["b"], 200_000).nbytes == 200_000


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (within a few seconds: a process signalled by the
    sweep leaves its namespace first and ends a moment later)."""
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"  # Z: exited, not reaped
    except FileNotFoundError:
        return False


def test_close_stops_the_wires_and_removes_everything(make_testbed: MakeTestBed) -> None:
    bed = make_testbed([HostSpec("a", delay_ms=5), HostSpec("n", nat=True, loss=0.01)])
    wires = list(bed.wires.values())
    assert len(wires) == 2
    assert all(w.proc.poll() is None for w in wires)
    bed.close()
    assert all(w.proc.poll() is not None for w in wires)
    assert "passed" in wires[0].stderr  # its counters, printed on SIGTERM
    assert [n for n in list_namespaces() if n.startswith(bed.prefix)] == []


def test_wires_of_a_killed_owner_are_swept_with_its_namespaces(make_testbed: MakeTestBed) -> None:
    make_testbed([HostSpec("x")])  # skips where test beds cannot run
    script = textwrap.dedent(
        """
        import os, signal
        from deploy.testbed import HostSpec, TestBed
        bed = TestBed([HostSpec("a", delay_ms=5), HostSpec("b", loss=0.01)]).start()
        print(bed.prefix, *(w.proc.pid for w in bed.wires.values()), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # no finally, no atexit
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    prefix, *pids = done.stdout.split()
    assert len(pids) == 2, done.stderr
    assert all(_alive(int(pid)) for pid in pids)  # the wires outlive their owner...
    sweep_stale()
    assert [n for n in list_namespaces() if n.startswith(prefix)] == []
    for pid in pids:  # ...until the sweep stops them with the hosts' namespaces
        assert _gone(int(pid))
