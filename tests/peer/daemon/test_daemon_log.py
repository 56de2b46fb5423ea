"""What the daemon tells humans (pure parts): banner, address warnings, routing diffs,
summary lines."""

from __future__ import annotations

import pytest

from swarmavg.peer.daemon.narration import RoutingDiff, SummaryWindow, address_warning, join_banner
from swarmavg.peer.daemon.stats import PeerStats


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1:31337", "loopback"),
        ("localhost:31337", "loopback name"),
        ("[::1]:31337", "loopback"),
        ("10.1.2.3:31337", "private"),
        ("192.168.0.7:1", "private"),
        ("169.254.3.4:1", "link-local"),
        ("0.0.0.0:1", "wildcard"),
    ],
)
def test_unroutable_announced_addresses_are_named(address: str, kind: str) -> None:
    warning = address_warning(address)
    assert warning is not None
    assert address in warning
    assert kind in warning


@pytest.mark.parametrize("address", ["8.8.8.8:31337", "[2001:4860::8888]:1", "peer.example:1"])
def test_public_addresses_and_host_names_get_no_warning(address: str) -> None:
    assert address_warning(address) is None


def test_banner_has_the_exact_join_command() -> None:
    record = {"peer_id": "ab" * 20, "address": "1.2.3.4:5", "control": "/s.sock", "run_id": "r"}
    lines = join_banner(record, "peer")
    assert "swarmavg peer --join 1.2.3.4:5 --run-id r" in "\n".join(lines)
    assert "swarmavg peers --control /s.sock" in "\n".join(lines)  # not the run's default
    odd = join_banner({**record, "run_id": "my run"}, "dht")
    assert "swarmavg peer --join 1.2.3.4:5 --run-id 'my run'" in "\n".join(odd)
    assert "bootstrap DHT node" in odd[0]
    client = join_banner({**record, "address": None}, "peer")
    assert "--join" not in "\n".join(client)
    assert "client mode" in "\n".join(client)


def test_routing_diff_reports_joins_and_leaves_after_the_first_look() -> None:
    diff = RoutingDiff()
    assert diff.update([("a", "h:1"), ("b", "h:2")]) == ({}, {})
    assert diff.update([("b", "h:2"), ("c", "h:3")]) == ({"c": "h:3"}, {"a": "h:1"})
    assert len(diff) == 2
    assert diff.update([("b", "h:2"), ("c", "h:3")]) == ({}, {})


def test_summary_counts_the_last_interval_only() -> None:
    stats = PeerStats()
    stats.record_round("none", 0.1, 2048, 1024, {})
    window = SummaryWindow(stats)
    stats.record_round("none", 0.1, 3 << 20, 1 << 20, {}, partial=True)
    stats.record_failure("timeout")
    stats.record_failure("timeout")
    stats.record_failure("no_group")
    assert window.line(60.0, 5) == (
        "last 60 s: 1 round ok (1 partial), 3 failed (no_group 1, timeout 2), "
        "sent 3.0 MiB, received 1.0 MiB; 5 peers known"
    )
    assert window.line(60.0, 1) == (
        "last 60 s: 0 rounds ok, 0 failed, sent 0 B, received 0 B; 1 peer known"
    )
    assert SummaryWindow(None).line(60.0, 3) == "last 60 s: 3 peers known"
