"""Pure parts of the test bed: tc commands, host spec validation, requirement checks (no root)."""

from __future__ import annotations

import os
import shutil

import pytest

from deploy.testbed import HostSpec, TestBed, _system
from deploy.testbed.shaping import MIN_BURST_BYTES, burst_bytes, tbf_command


def test_tbf_command_sets_rate_burst_and_queue() -> None:
    command = tbf_command("ns1", "eth0", 100)
    assert command[:6] == ["ip", "netns", "exec", "ns1", "tc", "qdisc"]
    assert command[6:11] == ["replace", "dev", "eth0", "root", "tbf"]
    assert command[command.index("rate") + 1] == "100000kbit"
    assert int(command[command.index("burst") + 1]) == burst_bytes(100)
    assert "latency" in command


def test_tbf_command_none_removes_the_limit() -> None:
    assert tbf_command("ns1", "eth0", None)[6:] == ["del", "dev", "eth0", "root"]


@pytest.mark.parametrize("rate", [0, -5, float("nan")])
def test_tbf_command_rejects_non_positive_rates(rate: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        tbf_command("ns1", "eth0", rate)


def test_burst_grows_with_rate_above_the_floor() -> None:
    assert burst_bytes(1) == MIN_BURST_BYTES
    assert burst_bytes(1000) > burst_bytes(100) > MIN_BURST_BYTES


@pytest.mark.parametrize(
    ("hosts", "message"),
    [
        ([], "at least one host"),
        ([HostSpec("a"), HostSpec("a")], "duplicate"),
        ([HostSpec("Bad")], "must match"),
        ([HostSpec("a" * 13)], "must match"),
        ([HostSpec("a", rate_mbit=0)], "positive"),
    ],
)
def test_invalid_specs_are_rejected_before_anything_is_built(
    hosts: list[HostSpec], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        TestBed(hosts)


def test_missing_requirements_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reason tests skip with, where the test bed cannot run (checked without root)."""
    check = _system.missing_requirements.__wrapped__  # bypass the per-process cache
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "needs root" in str(check())
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        shutil, "which", lambda tool: None if tool == "iptables" else f"/bin/{tool}"
    )
    assert "apt-get install iptables" in str(check())
