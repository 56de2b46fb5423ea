"""A host's TCP counters (deploy/testbed/tcpstats.py): parsed from the kernel's tables, and
read per host, so that a round's retransmissions are the round's own.

The parser is tested on the kernel's text; the reader on a real bed (root, like the rest of
the bed's tests): a lossy link retransmits, the host at the other end of no transfer counts
nothing of it.
"""

from __future__ import annotations

import pytest

from deploy.testbed import HostSpec, wire
from deploy.testbed.goodput import transfer
from deploy.testbed.tcpstats import counter_delta, parse_counters, read_counters
from tests.deploy.conftest import MakeTestBed

SNMP_AND_NETSTAT = """\
Ip: Forwarding DefaultTTL InReceives
Ip: 1 64 1234
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens OutSegs RetransSegs InErrs
Tcp: 1 200 120000 -1 148 17363422 73497 0
TcpExt: SyncookiesSent TCPLossProbes TCPTimeouts TCPFastRetrans
TcpExt: 0 20242 13967 992
IpExt: InNoRoutes
IpExt: 0
"""


def test_parse_takes_each_counter_from_its_own_table() -> None:
    assert parse_counters(SNMP_AND_NETSTAT) == {
        "OutSegs": 17363422,
        "RetransSegs": 73497,
        "TCPLossProbes": 20242,
        "TCPTimeouts": 13967,
        "TCPFastRetrans": 992,
    }


def test_parse_leaves_out_what_the_kernel_does_not_report() -> None:
    text = "Tcp: OutSegs RetransSegs\nTcp: 10 x\nTcpExt: TCPTimeouts\n"
    assert parse_counters(text) == {"OutSegs": 10}


def test_delta_subtracts_the_counters_present_in_both() -> None:
    assert counter_delta({"OutSegs": 30, "RetransSegs": 4}, {"OutSegs": 10}) == {"OutSegs": 20}


@pytest.mark.timeout(90)
@pytest.mark.skipif(wire.missing_requirements() is not None, reason="no wire here")
def test_a_lossy_link_shows_as_the_senders_retransmissions(make_testbed: MakeTestBed) -> None:
    bed = make_testbed(
        [HostSpec("lossy", rate_mbit=100, delay_ms=5, loss=0.05), HostSpec("b"), HostSpec("idle")]
    )
    hosts = [bed["lossy"], bed["b"], bed["idle"]]
    before = [read_counters(host) for host in hosts]
    transfer(bed["lossy"], bed["b"], 4 << 20)
    sender, receiver, idle = (
        counter_delta(read_counters(host), old) for host, old in zip(hosts, before, strict=True)
    )
    # 4 MiB is about 2900 full segments; 5 % of them dropped on the way out.
    assert sender["OutSegs"] >= 2800
    assert sender["RetransSegs"] >= 50
    # It sent ACKs, which are never retransmitted: only a lost SYN-ACK or FIN would be.
    assert receiver["RetransSegs"] <= 3
    assert idle["OutSegs"] == 0
