"""Pure parts of the test bed's delay/jitter/loss wire: validation, its command line, and the
on-demand build (no root; the build needs a C compiler and is skipped without one)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy.testbed import HostSpec, TestBed, TestBedError, wire
from deploy.testbed.wire import LinkImpairment, queue_bytes, wire_command


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"delay_ms": -1}, "delay_ms"),
        ({"delay_ms": 5, "jitter_ms": 6}, "jitter_ms"),
        ({"jitter_ms": -1}, "jitter_ms"),
        ({"loss": 1.0}, "loss"),
        ({"loss": -0.1}, "loss"),
        ({"delay_ms": float("nan")}, "delay_ms"),
    ],
)
def test_out_of_range_impairments_are_refused_before_anything_is_built(
    fields: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=f"host a: {message}"):
        TestBed([HostSpec("a", **fields)])


def test_only_delay_or_loss_needs_a_wire() -> None:
    assert not LinkImpairment().active
    assert LinkImpairment(delay_ms=1).active
    assert LinkImpairment(loss=0.01).active
    assert HostSpec("a", delay_ms=3, jitter_ms=1, loss=0.5).impairment == LinkImpairment(3, 1, 0.5)


def test_queue_holds_twice_what_the_link_carries_while_a_frame_crosses_it() -> None:
    slow = queue_bytes(100, LinkImpairment(delay_ms=100))
    assert slow == int(2 * 100e6 / 8 * (0.1 + wire.QUEUE_HEADROOM_S))
    assert queue_bytes(100, LinkImpairment(delay_ms=100, jitter_ms=50)) > slow
    assert queue_bytes(None, LinkImpairment(delay_ms=100)) > slow  # sized for the wire's own pace
    assert queue_bytes(1, LinkImpairment(loss=0.1)) == wire.MIN_QUEUE_BYTES
    assert queue_bytes(100_000, LinkImpairment(delay_ms=1000)) == wire.MAX_QUEUE_BYTES


def test_wire_command_names_both_ends_and_the_impairment() -> None:
    command = wire_command(
        Path("/cache/wire-x"), ("ns-host", "eth0"), ("ns-sw", "p-a"),
        LinkImpairment(delay_ms=12.5, jitter_ms=2, loss=0.01), rate_mbit=100, seed=7,
    )  # fmt: skip
    options = dict(zip(command[1::2], command[2::2], strict=True))
    assert command[0] == "/cache/wire-x"
    assert options["--a"] == "/run/netns/ns-host:eth0"  # the end whose namespace it stays in
    assert options["--b"] == "/run/netns/ns-sw:p-a"
    assert options["--delay-us"] == "12500"
    assert options["--jitter-us"] == "2000"
    assert float(options["--loss"]) == 0.01
    assert options["--seed"] == "7"
    assert options["--offload"] == "0"  # a lossy link carries single packets
    lossless = wire_command(
        Path("/w"), ("h", "eth0"), ("s", "p-a"), LinkImpairment(delay_ms=5), rate_mbit=None
    )
    assert lossless[lossless.index("--offload") + 1] == "1"  # TCP super-frames


def test_without_a_compiler_the_error_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    assert "C compiler" in str(wire.missing_requirements())
    with pytest.raises(TestBedError, match="apt-get install gcc"):
        wire.binary()


@pytest.mark.skipif(wire.compiler() is None, reason="no C compiler")
def test_the_wire_is_built_once_per_source_and_checks_its_arguments(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SWARMAVG_TESTBED_CACHE", str(tmp_path))
    built = wire.binary()
    assert built.parent == tmp_path
    assert os.access(built, os.X_OK)
    assert wire.binary() == built  # cached: same file, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [built.name]  # no partial files left
    for args in ([], ["--a", "/x:eth0"], ["--a", "/x:e", "--b", "/y:f", "--loss", "2"]):
        done = subprocess.run([built, *args], capture_output=True, timeout=10, check=False)
        assert done.returncode == 2, args
    jitter_over_delay = ["--a", "/x:e", "--b", "/y:f", "--delay-us", "5", "--jitter-us", "6"]
    done = subprocess.run(
        [built, *jitter_over_delay], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 2
    assert "jitter" in done.stderr
