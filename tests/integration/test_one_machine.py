"""Several peers on one machine without flags to invent; real ``swarmavg`` processes.

A second daemon of a run takes the free ``<run>-2.sock`` beside the first one's default
socket and prints the ``SWARMAVG_CONTROL=...`` line its trainers need; ``swarmavg launch``
runs a training command beside a daemon of its own, forwards Ctrl+C to it, stops the daemon
when it ends and exits with its code.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from swarmavg.peer import connect
from tests.harness import ProcessPool

pytestmark = pytest.mark.integration

TRAINER = textwrap.dedent(
    """
    import os, signal, sys, threading
    from swarmavg.peer import connect

    with connect() as client:  # no endpoint: SWARMAVG_CONTROL, set by the launcher
        print("daemon", client.status()["peer_id"], os.environ["SWARMAVG_CONTROL"], flush=True)
    if sys.argv[1] == "wait":
        stopped = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stopped.set())
        print("waiting", flush=True)
        # Short waits: the kernel may deliver SIGINT to the client's other thread, and
        # Python runs the handler only once the main thread executes again (a long
        # Event.wait is not interrupted then).
        for _ in range(1000):
            if stopped.wait(0.1):
                break
        sys.exit(3 if stopped.is_set() else 4)
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Path:
    """A private ``$XDG_RUNTIME_DIR``, so default sockets are this test's own."""
    folder = tmp_path / "runtime"
    folder.mkdir(mode=0o700)
    return folder


def launch(runtime: Path, workdir: Path, *trainer_args: str) -> subprocess.Popen[str]:
    script = workdir / "trainer.py"
    script.write_text(TRAINER)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime), "PYTHONUNBUFFERED": "1"}
    env.pop("SWARMAVG_CONTROL", None)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "swarmavg.peer.cli",
            "launch",
            "--run-id",
            "gpus",
            "--listen",
            "127.0.0.1:0",
            "--",
            sys.executable,
            str(script),
            *trainer_args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=workdir,
    )


@pytest.mark.timeout(120)
def test_a_second_daemon_of_the_run_takes_a_sibling_socket_and_prints_the_line(
    swarmavg_processes: ProcessPool, runtime_dir: Path
) -> None:
    env = {"XDG_RUNTIME_DIR": str(runtime_dir)}
    first = swarmavg_processes.start(
        ["peer", "--run-id", "gpus", "--listen", "127.0.0.1:0"], env=env
    )
    second = swarmavg_processes.start(
        ["peer", "--run-id", "gpus", "--listen", "127.0.0.1:0", "--join", first.address],
        env=env,
    )
    assert first.control == str(runtime_dir / "swarmavg" / "gpus.sock")
    assert second.control == str(runtime_dir / "swarmavg" / "gpus-2.sock")
    # the line works: a client given it reaches the second daemon
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from swarmavg.peer import connect\nwith connect() as c: print(c.status()['peer_id'])",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "SWARMAVG_CONTROL": second.control},
        timeout=60,
        check=True,
    )
    assert probe.stdout.strip() == second.peer_id
    assert second.stop() == 0  # its banner, printed after the ready line, is all written now
    assert f"SWARMAVG_CONTROL={second.control}" in second.stderr()
    assert f"swarmavg peers --control {second.control}" in second.stderr()


@pytest.mark.timeout(120)
def test_daemons_of_a_run_started_together_take_one_socket_each(
    swarmavg_processes: ProcessPool, runtime_dir: Path
) -> None:
    args = ["peer", "--run-id", "gpus", "--listen", "127.0.0.1:0"]
    env = {"XDG_RUNTIME_DIR": str(runtime_dir)}
    with ThreadPoolExecutor(3) as pool:
        daemons = list(pool.map(lambda _: swarmavg_processes.start(args, env=env), range(3)))
    folder = runtime_dir / "swarmavg"
    assert sorted(d.control for d in daemons) == [
        str(folder / "gpus-2.sock"),
        str(folder / "gpus-3.sock"),
        str(folder / "gpus.sock"),
    ]
    for daemon in daemons:  # each socket is its own daemon's (none replaced another's)
        with connect(daemon.control, connect_timeout=30) as client:
            assert client.status()["peer_id"] == daemon.peer_id


@pytest.mark.timeout(120)
def test_launch_runs_the_command_beside_its_daemon_and_exits_with_its_code(
    tmp_path: Path, runtime_dir: Path
) -> None:
    launcher = launch(runtime_dir, tmp_path, "7")
    out, err = launcher.communicate(timeout=90)
    assert launcher.returncode == 7, err
    [line] = [text for text in out.splitlines() if text.startswith("daemon ")]
    _, peer_id, control = line.split()
    assert control == str(runtime_dir / "swarmavg" / "gpus.sock")
    assert f"peer {peer_id} of run 'gpus' is ready" in err
    assert not Path(control).exists()  # the daemon stopped and removed its socket


@pytest.mark.timeout(120)
def test_launch_forwards_ctrl_c_to_the_command(tmp_path: Path, runtime_dir: Path) -> None:
    launcher = launch(runtime_dir, tmp_path, "wait")
    assert launcher.stdout is not None
    lines = iter(launcher.stdout.readline, "")
    control = next(line for line in lines if line.startswith("daemon ")).split()[2]
    assert next(lines).strip() == "waiting"
    launcher.send_signal(signal.SIGINT)
    launcher.wait(timeout=60)
    assert launcher.returncode == 3  # the command's own exit on SIGINT
    assert not Path(control).exists()
    launcher.stdout.close()
    assert launcher.stderr is not None
    launcher.stderr.close()
