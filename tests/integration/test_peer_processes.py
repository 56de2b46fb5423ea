"""Real ``swarmavg peer`` processes started through the CLI, real client processes.

Every daemon here is a separate process on 127.0.0.1 with an OS-chosen port; every client
is a separate Python process running tests/integration/client_worker.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from swarmavg.peer.client.shm import NAME_RE, SHM_DIR
from tests.harness import ProcessPool, SwarmavgProcess
from tests.integration.client_worker import make_tensors

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("client_worker.py")


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder for control sockets (unix socket paths are capped at 107 bytes)."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def start_peer(
    pool: ProcessPool, control: Path, *extra: str, env: dict[str, str] | None = None
) -> SwarmavgProcess:
    return pool.start(
        ["peer", "--listen", "127.0.0.1:0", "--control", str(control), *extra], env=env
    )


class Worker:
    """One client process averaging seeded tensors. Every worker a test starts is stopped
    when the test ends (``_workers_end_with_their_test``), so a failed test leaves no
    process or pipe behind for a later test to trip on."""

    started: ClassVar[list[Worker]] = []

    def __init__(self, workdir: Path, name: str, **spec: Any) -> None:
        self.out = workdir / name
        self.spec = {"out": str(self.out), **spec}
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), json.dumps(self.spec)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        Worker.started.append(self)

    def wait_connected(self, timeout: float = 30.0) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "connected" once the daemon answered
        assert line.strip() == "connected", self.proc.stderr.read() if self.proc.stderr else ""

    def outcome(self, timeout: float) -> dict[str, Any]:
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the client process did not end within {timeout:.0f} s; its threads:\n"
                + self.stack_dump()
            ) from None
        assert self.proc.returncode == 0, err
        record: dict[str, Any] = json.loads(self.out.with_suffix(".json").read_text())
        if record["ok"]:
            with np.load(self.out.with_suffix(".npz")) as data:
                record["tensors"] = [data[f"arr_{i}"] for i in range(len(data.files))]
        return record

    def stack_dump(self) -> str:
        """Where a hung worker is: its threads' stacks (faulthandler on SIGUSR1, see
        client_worker.py) and everything it wrote to stderr, then it is killed."""
        self.proc.send_signal(signal.SIGUSR1)
        try:
            _, err = self.proc.communicate(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=10)
        return err or ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=10)


@pytest.fixture(autouse=True)
def _workers_end_with_their_test() -> Iterator[None]:
    yield
    workers, Worker.started[:] = list(Worker.started), []
    for worker in workers:
        worker.kill()


def status(control: Path) -> dict[str, Any]:
    """The daemon's status through a client in this process (cheap to poll)."""
    from swarmavg.peer import connect

    with connect(str(control), use_shm=False) as client:
        return client.status()


def status_cli(control: Path) -> dict[str, Any]:
    """The daemon's status through ``swarmavg status --json``."""
    result = subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", "status", "--control", str(control), "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    figures: dict[str, Any] = json.loads(result.stdout)
    return figures


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    """Poll a cheap condition on another process (no event to wait on across processes)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if (m := NAME_RE.match(n)) and int(m.group(1)) == pid]


def scrape(port: int) -> dict[str, float]:
    """Samples of the Prometheus text page, ``name{labels}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as page:
        text = page.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def average_in_threads(
    controls: list[str], shapes: list[list[int]], key: str, timeout: float = 30.0
) -> list[Any]:
    """One round with one client per daemon, each in a thread of this process (for
    follow-up rounds that only check a daemon still serves; the main tests use processes)."""
    from swarmavg.peer import connect

    def one(index: int) -> Any:
        with connect(controls[index]) as client:
            tensors = make_tensors(index, shapes, "float32")
            return client.average(tensors, key=key, group_size=len(controls), timeout=timeout)

    with ThreadPoolExecutor(len(controls)) as pool:
        return list(pool.map(one, range(len(controls))))


def swarm(
    pool: ProcessPool, sock_dir: Path, n: int, *first_args: str, rest_args: tuple[str, ...] = ()
) -> list[SwarmavgProcess]:
    first = start_peer(pool, sock_dir / "p0.sock", *first_args)
    rest = [
        start_peer(pool, sock_dir / f"p{i}.sock", "--join", first.address, *rest_args)
        for i in range(1, n)
    ]
    return [first, *rest]


@pytest.mark.timeout(120)
def test_four_daemons_four_clients_get_the_weighted_mean(
    swarmavg_processes: ProcessPool, sock_dir: Path, tmp_path: Path
) -> None:
    # Port 0: the OS picks it at the daemon's bind (a port the test chose could be taken
    # meanwhile, as it once was in CI); the ready line names it.
    peers = swarm(swarmavg_processes, sock_dir, 4, "--metrics", "127.0.0.1:0")
    metrics_port = int(str(peers[0].ready["metrics"]).rsplit(":", 1)[1])
    assert "metrics" not in peers[1].ready, "only a daemon that serves metrics names them"
    before = scrape(metrics_port)
    assert before["swarmavg_dht_size"] >= 1
    shapes = [[300, 1000], [17], [4, 5, 6]]  # 1.2 MB: the first round goes through shm
    weights = [1.0, 2.0, 3.0, 4.0]
    for round_index, use_shm in enumerate([True, False]):
        workers = [
            Worker(
                tmp_path,
                f"r{round_index}-c{i}",
                control=p.control,
                seed=i,
                shapes=shapes,
                weight=weights[i],
                key=f"round-{round_index}",
                group_size=4,
                min_group_size=4,
                timeout=40.0,
                use_shm=use_shm,
            )
            for i, p in enumerate(peers)
        ]
        outcomes = [w.outcome(timeout=60) for w in workers]
        inputs = [make_tensors(i, shapes, "float32") for i in range(4)]
        for outcome in outcomes:
            assert outcome["ok"], outcome
            assert outcome["group_size"] == 4
            assert sorted(outcome["peers"]) == sorted(p.peer_id for p in peers)
            assert outcome["partial"] is False
            for t, got in enumerate(outcome["tensors"]):
                want = sum(
                    w * x[t].astype(np.float64) for w, x in zip(weights, inputs, strict=True)
                )
                want /= sum(weights)
                assert got.dtype == np.float32
                assert got.shape == tuple(shapes[t])
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        for other in outcomes[1:]:  # bit-identical across members
            for a, b in zip(outcomes[0]["tensors"], other["tensors"], strict=True):
                assert a.tobytes() == b.tobytes()
        assert len({o["group_id"] for o in outcomes}) == 1
    for index, p in enumerate(peers):
        figures = (status_cli if index == 0 else status)(Path(p.control))
        assert figures["known_peers"] == 3, figures  # 4 peers: itself and 3 others
        assert figures["rounds_done"] == 2
        assert figures["bytes_sent"] > 0
        assert figures["codecs"]["none"]["rounds"] == 2
    human = subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", "status", "--control", peers[0].control],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "4 (3 known + this one)" in human
    assert peers[0].peer_id in human
    after: dict[str, float] = {}

    def scraped_two_rounds() -> bool:  # metrics are synced once a second
        after.update(scrape(metrics_port))
        return after.get('swarmavg_rounds_total{outcome="done"}') == 2

    wait_for(scraped_two_rounds, 10, "the metrics")
    assert after["swarmavg_known_peers"] == 3
    assert after['swarmavg_averaging_bytes_total{direction="sent"}'] > 0
    assert any(k.startswith("swarmavg_round_phase_seconds_count") for k in after)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("phase", ["matchmaking", "allreduce"])
def test_daemon_killed_mid_round_others_return_within_timeout(
    swarmavg_processes: ProcessPool, sock_dir: Path, tmp_path: Path, phase: str
) -> None:
    # -v: "group formed" is a per-round line, logged at DEBUG
    peers = swarm(swarmavg_processes, sock_dir, 3, "-v", rest_args=("-v",))
    timeout = 15.0
    workers = [
        Worker(
            tmp_path,
            f"c{i}",
            control=p.control,
            seed=i,
            shapes=[[4_000_000]],  # 16 MB each: the all-reduce takes a moment
            key="kill",
            group_size=3,
            min_group_size=2,
            timeout=timeout,
        )
        for i, p in enumerate(peers)
    ]
    for w in workers:
        w.wait_connected()
    from swarmavg.peer import connect

    victim = peers[2]
    watchers = [connect(p.control) for p in peers]
    try:
        wait_for(lambda: all(c.status()["active_calls"] >= 1 for c in watchers), 30, "calls")
        if phase == "allreduce":
            # Each daemon logs when it holds the group. The victim's line alone is not
            # enough: a leader logs it before its followers have the group, and killed
            # then, it leaves them to form a pair (a correct outcome, but not this case).
            wait_for(
                lambda: all("group formed under" in p.stderr() for p in peers), 30, "the group"
            )
        victim.proc.send_signal(signal.SIGKILL)
    finally:
        for c in watchers:
            c.close()
    victim.wait(timeout=10)
    for w in workers[:2]:
        outcome = w.outcome(timeout=timeout + 15)
        outcome.pop("tensors", None)
        assert outcome["elapsed"] <= timeout + 3.0, outcome
        if outcome["ok"]:
            # killed in the all-reduce: the group had the victim (its part is then kept
            # local, partial=True, unless the round had just finished)
            # (a full group can form within milliseconds, so a "matchmaking" kill may
            # land in the all-reduce too)
            assert outcome["group_size"] in ({3} if phase == "allreduce" else {2, 3}), outcome
        else:
            assert outcome["error"] in {"NoGroupError", "AveragingError", "SwarmTimeoutError"}
    workers[2].kill()
    if phase == "matchmaking":
        return  # the all-reduce variant also checks that the survivors keep serving
    for result in average_in_threads([p.control for p in peers[:2]], [[10]], "after"):
        assert result.group_size == 2


@pytest.mark.timeout(90)
def test_client_killed_mid_round_leaves_no_segment(
    swarmavg_processes: ProcessPool, sock_dir: Path, tmp_path: Path
) -> None:
    peers = swarm(swarmavg_processes, sock_dir, 2)
    doomed = Worker(
        tmp_path,
        "doomed",
        control=peers[0].control,
        seed=0,
        shapes=[[1_000_000]],
        key="lonely",
        min_group_size=2,
        timeout=30.0,
    )  # 4 MB through shm; nobody else averages "lonely", so it waits in matchmaking
    doomed.wait_connected()
    wait_for(lambda: status(Path(peers[0].control))["active_calls"] == 1, 30, "the call")
    doomed.kill()
    # Mapped by the daemon: already unlinked. Killed before the daemon mapped it: the
    # daemon unlinks it when the call breaks off, or its sweeper within 5 s.
    wait_for(lambda: segments_of(doomed.proc.pid) == [], 15, "the segment's removal")
    wait_for(lambda: status(Path(peers[0].control))["active_calls"] == 0, 40, "the call's end")
    for result in average_in_threads([p.control for p in peers], [[1_000_000]], "fine"):
        assert result.group_size == 2
    assert segments_of(os.getpid()) == []


@pytest.mark.timeout(60)
def test_sigint_stops_a_daemon_mid_round_within_5s(
    swarmavg_processes: ProcessPool, sock_dir: Path, tmp_path: Path
) -> None:
    peers = swarm(swarmavg_processes, sock_dir, 2)
    waiting = Worker(
        tmp_path,
        "waiting",
        control=peers[0].control,
        seed=0,
        shapes=[[1000]],
        key="never",
        min_group_size=3,
        timeout=30.0,
    )
    waiting.wait_connected()
    wait_for(lambda: status(Path(peers[0].control))["active_calls"] == 1, 30, "the call")
    started = time.monotonic()
    peers[0].signal(signal.SIGINT)
    assert peers[0].wait(timeout=10) == 0
    assert time.monotonic() - started < 5.0
    assert not Path(peers[0].control).exists(), "the control socket is removed on exit"
    outcome = waiting.outcome(timeout=30)
    assert not outcome["ok"]
    assert outcome["error"] in {"DaemonUnavailableError", "NoGroupError"}, outcome


@pytest.mark.timeout(90)
def test_bad_input_gets_a_clear_error_and_the_daemon_keeps_serving(
    swarmavg_processes: ProcessPool, sock_dir: Path, tmp_path: Path
) -> None:
    from swarmavg.peer import NoGroupError, SwarmError, ValidationError, connect

    peers = swarm(swarmavg_processes, sock_dir, 2)
    with connect(peers[0].control) as client:
        cases: list[tuple[list[Any], dict[str, Any], str]] = [
            ([np.array([np.nan], np.float32)], {}, "NaN/Inf"),
            ([np.zeros(3, np.int32)], {}, "unsupported dtype"),
            ([], {}, "non-empty"),
            ([np.zeros(3, np.float32)], {"key": "k" * 1000}, "limit"),
        ]
        for tensors, overrides, message in cases:
            kwargs = {"key": "bad", "timeout": 5.0, **overrides}
            with pytest.raises(ValidationError, match=message):
                client.average(tensors, **kwargs)
        assert client.status()["rounds_failed"] == 0  # nothing reached the daemon

    # shapes that differ between peers: both callers get an exception, nobody hangs
    def mismatched(index: int) -> BaseException | None:
        with connect(peers[index].control) as client:
            try:
                client.average(
                    [np.zeros(10 + index, np.float32)], key="shapes", group_size=2, timeout=8.0
                )
            except SwarmError as exc:
                return exc
        return None

    started = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(mismatched, range(2)))
    assert time.monotonic() - started < 8.0 + 3.0
    for error in errors:
        assert isinstance(error, ValidationError | NoGroupError), error
    for result in average_in_threads([p.control for p in peers], [[10]], "good"):
        assert result.group_size == 2


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.mark.timeout(90)
def test_startup_errors_are_one_clear_line(swarmavg_processes: ProcessPool, sock_dir: Path) -> None:
    first = start_peer(swarmavg_processes, sock_dir / "a.sock")
    port = first.address.rsplit(":", 1)[1]
    taken = run_cli("peer", "--listen", f"127.0.0.1:{port}", "--control", str(sock_dir / "b.sock"))
    assert taken.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}: port {port} is already in use" in taken.stderr
    assert taken.stdout == ""
    live = run_cli("peer", "--listen", "127.0.0.1:0", "--control", first.control)
    assert live.returncode != 0
    assert "belongs to a running swarmavg daemon" in live.stderr
    assert Path(first.control).exists(), "the live daemon's socket is left alone"
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    nobody = run_cli(
        "peer",
        "--listen",
        "127.0.0.1:0",
        "--control",
        str(sock_dir / "c.sock"),
        "--join",
        f"{dead},127.0.0.1:1",
        env={"SWARMAVG_BOOTSTRAP_TIMEOUT": "2"},
    )
    assert nobody.returncode != 0
    assert dead in nobody.stderr
    assert "127.0.0.1:1" in nobody.stderr
    assert not (sock_dir / "c.sock").exists()
    public = run_cli("peer", "--control", "0.0.0.0:5000")
    assert public.returncode != 0
    assert "not local" in public.stderr
    # a stale socket file (its daemon was SIGKILLed) is removed and the name reused
    first.proc.send_signal(signal.SIGKILL)
    first.wait(timeout=10)
    assert Path(first.control).exists()
    again = start_peer(swarmavg_processes, Path(first.control))
    assert again.control == first.control


@pytest.mark.timeout(60)
def test_identity_file_gives_the_same_peer_id(
    swarmavg_processes: ProcessPool, sock_dir: Path
) -> None:
    key = sock_dir / "id.key"
    first = start_peer(swarmavg_processes, sock_dir / "a.sock", "--identity", str(key))
    assert key.stat().st_mode & 0o777 == 0o600
    first.stop()
    second = start_peer(
        swarmavg_processes, sock_dir / "a.sock", env={"SWARMAVG_IDENTITY": str(key)}
    )
    assert second.peer_id == first.peer_id
    third = swarmavg_processes.start(
        ["peer", "--listen", "127.0.0.1:0", "--control", "127.0.0.1:0"]
    )
    assert third.peer_id != first.peer_id
    host, port = third.control.rsplit(":", 1)  # a loopback control port, the real one
    assert host == "127.0.0.1"
    assert int(port) > 0
    assert status(Path(third.control))["peer_id"] == third.peer_id


@pytest.mark.timeout(60)
def test_ready_line_and_bare_dht_bootstrap_node(
    swarmavg_processes: ProcessPool, sock_dir: Path
) -> None:
    boot = swarmavg_processes.start(["dht", "--listen", "127.0.0.1:0", "--run-id", "pub"])
    assert set(boot.ready) == {"event", "peer_id", "address", "control", "run_id"}
    assert boot.ready["control"] is None
    assert boot.ready["run_id"] == "pub"
    peer = start_peer(
        swarmavg_processes,
        sock_dir / "a.sock",
        "--join",
        f"{boot.address},127.0.0.1:1",
        "--run-id",
        "pub",
    )
    assert "initial peer(s) 127.0.0.1:1 did not answer" in peer.stderr()
    assert set(peer.ready) == {"event", "peer_id", "address", "control", "run_id"}
    assert peer.control == str(sock_dir / "a.sock")
    assert peer.address.startswith("127.0.0.1:")
    assert len(peer.stdout_lines) == 1, "exactly one line on stdout"
    assert status(Path(peer.control))["known_peers"] == 1
    client_mode = start_peer(
        swarmavg_processes,
        sock_dir / "c.sock",
        "--client-mode",
        "--join",
        peer.address,
        "--run-id",
        "pub",
    )
    assert client_mode.ready["address"] is None
    assert status(Path(client_mode.control))["client_mode"] is True
    results = average_in_threads([peer.control, client_mode.control], [[1000]], "cm")
    assert [r.group_size for r in results] == [2, 2]
    assert results[0].tensors[0].tobytes() == results[1].tensors[0].tobytes()


@pytest.mark.timeout(90)
def test_training_processes_on_one_machine_are_combined(
    swarmavg_processes: ProcessPool, sock_dir: Path, tmp_path: Path
) -> None:
    """Two training processes on daemon A, one on daemon B: A contributes once."""
    peers = swarm(swarmavg_processes, sock_dir, 2)
    go = tmp_path / "go"
    weights = [1.0, 2.0, 4.0]
    homes = [peers[0], peers[0], peers[1]]
    workers = [
        Worker(
            tmp_path,
            f"gpu{i}",
            control=home.control,
            seed=i,
            shapes=[[1000], [300, 1000]],
            weight=weights[i],
            key="multi-gpu",
            group_size=2,
            timeout=30.0,
            go_file=str(go),
        )
        for i, home in enumerate(homes)
    ]
    for w in workers:
        w.wait_connected()
    go.touch()
    outcomes = [w.outcome(timeout=60) for w in workers]
    inputs = [make_tensors(i, [[1000], [300, 1000]], "float32") for i in range(3)]
    for outcome in outcomes:
        assert outcome["ok"], outcome
        assert outcome["group_size"] == 2  # two daemons in the swarm's round
        for t, got in enumerate(outcome["tensors"]):
            want = sum(w * x[t].astype(np.float64) for w, x in zip(weights, inputs, strict=True))
            np.testing.assert_allclose(got, want / sum(weights), rtol=1e-5, atol=1e-6)
    assert [o["local_callers"] for o in outcomes] == [2, 2, 1]
    assert status(Path(peers[0].control))["rounds_done"] == 1


def test_the_readme_sequence_finds_the_daemon_of_a_named_run(
    swarmavg_processes: ProcessPool, sock_dir: Path
) -> None:
    # README: `swarmavg peer --run-id my-run`, then `swarmavg status`: no --control, no env.
    env = {"XDG_RUNTIME_DIR": str(sock_dir), "SWARMAVG_RUN_ID": "", "SWARMAVG_CONTROL": ""}
    peer = swarmavg_processes.start(
        ["peer", "--listen", "127.0.0.1:0", "--run-id", "my-run"], env=env
    )
    assert peer.ready["control"] == str(sock_dir / "swarmavg" / "my-run.sock")
    for flags in ([], ["--run-id", "my-run"]):
        result = subprocess.run(
            [sys.executable, "-m", "swarmavg.peer.cli", "status", *flags, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **env},
        )
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["run_id"] == "my-run"
    wrong = subprocess.run(
        [sys.executable, "-m", "swarmavg.peer.cli", "status", "--run-id", "other"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, **env},
    )
    assert wrong.returncode == 1
    assert "other.sock" in wrong.stderr
