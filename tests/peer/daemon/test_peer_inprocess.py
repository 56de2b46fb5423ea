"""``Peer`` in process (notebooks, tests): two daemons in one event loop averaging."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from swarmavg.peer import (
    AsyncClient,
    NoGroupError,
    Peer,
    PeerConfig,
    RoundClosedError,
    SchemaMismatchError,
    ValidationError,
)
from swarmavg.peer.cli.main import build_parser
from swarmavg.peer.cli.status import format_status
from swarmavg.peer.daemon.settings import flags_from_args, resolve_config
from tests.peer.daemon.raw_calls import unchecked_shm_call

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


async def test_two_in_process_peers_average(sock_dir: Path) -> None:
    first = PeerConfig(listen="127.0.0.1:0", control=str(sock_dir / "a.sock"), run_id="t")
    async with Peer(first) as a:
        assert a.address is not None
        second = PeerConfig(
            listen="127.0.0.1:0", control=str(sock_dir / "b.sock"), run_id="t", join=[a.address]
        )
        async with Peer(second) as b, a.client() as ca, b.client() as cb:
            x = np.arange(300_000, dtype=np.float32)  # 1.2 MB: shared-memory path
            y = np.ones(300_000, dtype=np.float32)
            ra, rb = await asyncio.gather(
                ca.average([x], key="k", weight=1.0, group_size=2, timeout=20),
                cb.average([y], key="k", weight=3.0, group_size=2, timeout=20),
            )
            expected = (x + 3 * y) / 4
            np.testing.assert_allclose(ra.tensors[0], expected, rtol=1e-6)
            assert ra.tensors[0].tobytes() == rb.tensors[0].tobytes()
            assert sorted(ra.peers) == sorted([a.peer_id, b.peer_id])
            assert await ca.dht.store("note", {"hello": 1}, ttl=30)
            assert await cb.dht.get("note") == {"hello": 1}
            status = await cb.status()
            assert status["known_peers"] == 1
            assert status["rounds_done"] == 1
    assert not (sock_dir / "a.sock").exists()


async def _joined(
    stack: contextlib.AsyncExitStack, sock_dir: Path, first: Peer, names: str, run_id: str
) -> list[Peer]:
    """``first`` and one more peer per letter of ``names``, each joined through it."""
    assert first.address is not None
    peers = [first]
    for name in names:
        config = PeerConfig(
            listen="127.0.0.1:0",
            control=str(sock_dir / f"{name}.sock"),
            run_id=run_id,
            join=[first.address],
        )
        peers.append(await stack.enter_async_context(Peer(config)))
    return peers


@contextlib.asynccontextmanager
async def _three_peers(
    sock_dir: Path, run_id: str
) -> AsyncIterator[tuple[list[Peer], list[AsyncClient]]]:
    """Three in-process peers of ``run_id`` joined through the first, and a client of each."""
    first = PeerConfig(listen="127.0.0.1:0", control=str(sock_dir / "a.sock"), run_id=run_id)
    async with Peer(first) as a, contextlib.AsyncExitStack() as stack:
        peers = await _joined(stack, sock_dir, a, "bc", run_id)
        yield peers, [await stack.enter_async_context(p.client()) for p in peers]


async def test_state_digests_reach_every_member_and_schema_mismatch_is_told_apart(
    sock_dir: Path,
) -> None:
    async with _three_peers(sock_dir, "sd") as (peers, clients):
        x = np.ones(10, dtype=np.float32)
        results = await asyncio.gather(
            clients[0].average([x], key="k", group_size=3, timeout=20, state_digest=b"A"),
            clients[1].average([x], key="k", group_size=3, timeout=20, state_digest=b"B" * 64),
            clients[2].average([x], key="k", group_size=3, timeout=20),
        )
        expected = {peers[0].peer_id: b"A", peers[1].peer_id: b"B" * 64}
        assert [r.state_digests for r in results] == [expected] * 3
        with pytest.raises(ValidationError, match="state_digest"):
            await clients[0].average([x], key="k2", state_digest=b"x" * 65)
        # another layout under the same key: a SchemaMismatchError (still a
        # ValidationError), which names other peers rather than the caller's input
        outcomes = await asyncio.gather(
            clients[0].average([x], key="s", group_size=2, min_group_size=2, timeout=4),
            clients[1].average([x[:5]], key="s", group_size=2, min_group_size=2, timeout=4),
            return_exceptions=True,
        )
        assert all(isinstance(o, SchemaMismatchError) for o in outcomes), outcomes
        assert all(isinstance(o, ValidationError) for o in outcomes)
        assert "ours: 1 tensor: float32[5]" in str(outcomes[1]), outcomes[1]
        status = await clients[0].status()
        assert status["failures"] == {"schema_mismatch": 1}
        assert status["rounds_done"] == 1
        assert status["rounds_partial"] == 0


async def test_a_peer_that_comes_after_its_round_closed_is_told_so(sock_dir: Path) -> None:
    """Over the control socket too, a late peer's failure says the others did average
    (``RoundClosedError``, a ``NoGroupError``), and the daemon counts it under its label."""
    async with _three_peers(sock_dir, "rc") as (_, clients):
        x = np.ones(10, dtype=np.float32)
        done = await asyncio.gather(
            *(c.average([x], key="k", group_size=2, timeout=20) for c in clients[:2])
        )
        assert [r.group_size for r in done] == [2, 2]
        with pytest.raises(RoundClosedError, match="closed before this peer joined") as late:
            await clients[2].average([x], key="k", group_size=2, timeout=20)
        assert isinstance(late.value, NoGroupError)
        assert (await clients[2].status())["failures"] == {"round_closed": 1}


def peer_config(*argv: str) -> PeerConfig:
    """The config ``swarmavg peer ARGV...`` runs with (no env vars, no file)."""
    return resolve_config(flags_from_args(build_parser().parse_args(["peer", *argv]), "peer"), {})


async def test_bandwidth_flag_is_advertised_and_unset_bandwidth_is_measured(
    sock_dir: Path,
) -> None:
    """`--bandwidth 250` goes into every matchmaking request unchanged by rounds; a peer
    without it starts from the conservative default and measures its rounds."""
    common = ("--listen", "127.0.0.1:0", "--run-id", "bw")
    fixed = peer_config(*common, "--control", str(sock_dir / "a.sock"), "--bandwidth", "250")
    async with Peer(fixed) as a:
        assert a.address is not None
        assert a.averager is not None
        measured = peer_config(*common, "--control", str(sock_dir / "b.sock"), "--join", a.address)
        async with Peer(measured) as b, a.client() as ca, b.client() as cb:
            assert b.averager is not None
            assert a.averager.config.bandwidth == 250.0
            assert b.averager.config.bandwidth is None
            before = await cb.status()
            assert before["bandwidth_measured"] is True
            assert before["bandwidth_samples"] == 0
            assert before["bandwidth"] == b.averager.bandwidth.value
            assert "not measured yet (starting value" in format_status(before)
            # 18 MB: 9 MB each way, above the 8 MiB a round must move to be measured
            x = np.zeros(4_500_000, dtype=np.float32)
            ra, rb = await asyncio.gather(
                ca.average([x], key="k", group_size=2, timeout=30),
                cb.average([x + 1], key="k", group_size=2, timeout=30),
            )
            assert ra.group_size == rb.group_size == 2
            status_a, status_b = await ca.status(), await cb.status()
    assert a.averager.bandwidth.value == 250.0  # what the matchmaking request carries
    assert (status_a["bandwidth"], status_a["bandwidth_measured"]) == (250.0, False)
    assert status_a["bandwidth_samples"] == 0
    assert "250.0 MB/s (set)" in format_status(status_a)
    assert status_b["bandwidth_measured"] is True
    # A partial round (a member stalled on a loaded machine) is deliberately not measured.
    assert status_b["bandwidth_samples"] == (0 if rb.partial else 1)
    assert status_b["bandwidth"] == b.averager.bandwidth.value > 0


@pytest.mark.parametrize(
    ("measured", "samples", "shown"),
    [
        (False, 0, "250.0 MB/s (set)"),
        (True, 0, "not measured yet (starting value 250.0 MB/s until a round"),
        (True, 1, "250.0 MB/s (measured from 1 round)"),
        (True, 7, "250.0 MB/s (measured from 7 rounds)"),
    ],
)
def test_status_shows_the_bandwidth_and_where_it_comes_from(
    measured: bool, samples: int, shown: str
) -> None:
    status = {
        "peer_id": "ab",
        "run_id": "r",
        "address": None,
        "control": "/tmp/x.sock",
        "known_peers": 0,
        "dht_size_estimate": 1.0,
        "bandwidth": 250.0,
        "bandwidth_measured": measured,
        "bandwidth_samples": samples,
        "rounds_done": 0,
        "rounds_failed": 0,
        "bytes_sent": 0,
        "bytes_received": 0,
        "uptime": 1.0,
        "version": "0",
        "failures": {},
        "codecs": {},
    }
    row = next(line for line in format_status(status).splitlines() if line.startswith("bandw"))
    assert row.split(None, 1)[1].startswith(shown)


def test_daemon_never_imports_torch() -> None:
    code = (
        "import sys, swarmavg.peer.daemon, swarmavg.peer.cli, swarmavg.peer.daemon.bare_dht;"
        "print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "False"


async def test_result_and_stats_name_the_codec_the_group_used(sock_dir: Path) -> None:
    # A group has one codec, which every member asked for (a follower refuses a
    # leader's other codec). Peers asking for different codecs form no group and say why;
    # with one codec, both results and both daemons' per-codec figures name it.
    first = PeerConfig(listen="127.0.0.1:0", control=str(sock_dir / "a.sock"), run_id="t")
    async with Peer(first) as a:
        assert a.address is not None
        second = PeerConfig(
            listen="127.0.0.1:0", control=str(sock_dir / "b.sock"), run_id="t", join=[a.address]
        )
        async with Peer(second) as b, a.client() as ca, b.client() as cb:
            x = np.linspace(-1, 1, 4096, dtype=np.float32)
            mixed = await asyncio.gather(
                ca.average([x], key="m", group_size=2, timeout=4, codec="float16"),
                cb.average([x], key="m", group_size=2, timeout=4, codec="none"),
                return_exceptions=True,
            )
            assert all(isinstance(r, NoGroupError) for r in mixed), mixed
            assert any("another codec" in str(r) for r in mixed), mixed
            ra, rb = await asyncio.gather(
                ca.average([x], key="c", group_size=2, timeout=20, codec="float16"),
                cb.average([x], key="c", group_size=2, timeout=20, codec="float16"),
            )
            assert ra.codec == rb.codec == "float16"
            for client in (ca, cb):
                status = await client.status()
                assert set(status["codecs"]) == {"float16"}


def test_rounds_are_counted_by_outcome_in_status_and_metrics() -> None:
    pytest.importorskip("prometheus_client")
    from swarmavg.peer.daemon.metrics import MetricsServer
    from swarmavg.peer.daemon.stats import PeerStats

    stats = PeerStats()
    stats.record_round("none", 1.0, 10, 10, {}, partial=False)
    stats.record_round("none", 1.0, 10, 10, {}, partial=True)
    stats.record_failure("no_group")
    metrics = MetricsServer("127.0.0.1:0", stats, dht_size=lambda: 1.0, known_peers=lambda: 0)
    metrics.sync()
    value = metrics.registry.get_sample_value
    assert value("swarmavg_rounds_total", {"outcome": "done"}) == 2
    assert value("swarmavg_partial_rounds_total") == 1
    assert value("swarmavg_rounds_total", {"outcome": "failed"}) == 1
    assert value("swarmavg_round_failures_total", {"reason": "no_group"}) == 1
    status = {
        "peer_id": "ab",
        "run_id": "r",
        "address": None,
        "control": "/tmp/x.sock",
        "known_peers": 0,
        "dht_size_estimate": 1.0,
        "bandwidth": 1.0,
        "bandwidth_measured": False,
        "bandwidth_samples": 0,
        "rounds_done": stats.rounds_done,
        "rounds_partial": stats.rounds_partial,
        "rounds_failed": stats.rounds_failed,
        "bytes_sent": 0,
        "bytes_received": 0,
        "uptime": 1.0,
        "version": "0",
        "failures": dict(stats.failures),
        "codecs": {},
    }
    text = format_status(status)
    assert "2 (1 complete, 1 partial)" in text
    assert "no_group" in text


async def test_a_caller_that_claims_a_check_it_did_not_make_fails_alone(sock_dir: Path) -> None:
    """A shared-memory call whose client says it checked its tensors is not
    scanned before matchmaking. A caller that lied (NaN in its segment) joins the group,
    is refused when its codec meets the bad chunk, and gets INVALID_ARGUMENT; the other
    members finish with finite, partial results, and its daemon keeps serving."""
    first = PeerConfig(listen="127.0.0.1:0", control=str(sock_dir / "a.sock"), run_id="lie")
    async with Peer(first) as a, contextlib.AsyncExitStack() as stack:
        peers = await _joined(stack, sock_dir, a, "bc", "lie")
        ca, cb, cc = [await stack.enter_async_context(p.client()) for p in peers]
        size = 1 << 20  # 4 MB: several chunks per part
        bad = np.ones(size, np.float32)
        bad[size - 10] = np.nan  # in the last part, whoever reduces it
        x = np.full(size, 2.0, np.float32)
        error, ra, rc = await asyncio.gather(
            unchecked_shm_call(
                str(sock_dir / "b.sock"),
                [bad],
                key="k",
                timeout=20,
                group_size=3,
                min_group_size=3,
                inputs_checked=True,
            ),
            ca.average([x], key="k", group_size=3, min_group_size=3, timeout=20),
            cc.average([x], key="k", group_size=3, min_group_size=3, timeout=20),
        )
        assert error is not None
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "NaN or Inf" in (error.details() or "")
        for result in (ra, rc):
            assert result.group_size == 3
            assert result.partial
            assert np.isfinite(result.tensors[0]).all()
        status = await cb.status()
        assert status["failures"] == {"invalid_input": 1}
        y = np.full(size, 5.0, np.float32)
        results = await asyncio.gather(
            *(
                c.average([v], key="k2", group_size=3, timeout=20)
                for c, v in ((ca, x), (cb, y), (cc, x))
            )
        )
        for result in results:
            assert not result.partial
            np.testing.assert_allclose(result.tensors[0], 3.0)
