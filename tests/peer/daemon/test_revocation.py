"""Revoking a peer of a private run, in process: invited ``Peer`` daemons, real gRPC and TLS.

A peer holding a revocation list that names X refuses X with ``PERMISSION_DENIED``
("credential revoked") on every public endpoint (DHT Ping/Store/Find, JoinGroup, Reduce over
gRPC and over the data plane, DownloadState), on connections X already had open too, and
drops X from its routing table; the other peers keep averaging. The list given to one peer
reaches the others through the run's DHT; a forged or older list stored there is not adopted.
A changed file is read again while the daemon runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from swarmavg.dht import ChannelPool, DHTConfig, DHTNode
from swarmavg.dht.credentials import load_authority_key, read_run_file
from swarmavg.dht.ids import key_id
from swarmavg.dht.records import owner_suffix, pack_subkey
from swarmavg.dht.revocation import RevocationList, Revocations, revocation_key, revoke
from swarmavg.dht.revocation_keeper import RevocationKeeper
from swarmavg.peer import Peer, PeerConfig
from swarmavg.peer.daemon.config import DHTSettings
from swarmavg.peer.daemon.daemon import StartupError
from swarmavg.proto import dht_pb2
from tests.dht.swarm import swarm
from tests.peer.daemon.test_private_run import (
    REFUSED,
    pool,
    private_config,
    probe_all,
    probed,
    signer_of,
    target,
)
from tests.private_runs import Authority, Member

pytestmark = pytest.mark.timeout(90)

RUN = "secret-run"
NOBODY = bytes(20)  # a peer id no test member has: a first list that revokes none of them
DENIED = {
    name: "PERMISSION_DENIED"
    for name in ("Ping", "Store", "Find", "JoinGroup", "DownloadState", "Reduce", "data plane")
}


@pytest.fixture
def authority(tmp_path: Path) -> Authority:
    return Authority.create(tmp_path / "run", RUN)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def with_list(config: PeerConfig, path: Path) -> PeerConfig:
    return dataclasses.replace(config, revocations=str(path))


def keeper(peer: Peer) -> RevocationKeeper:
    assert peer.revocation_keeper is not None
    return peer.revocation_keeper


def adoption(revocations: Revocations, number: int) -> asyncio.Event:
    """Set once ``revocations`` holds list ``number`` or newer (readiness by event)."""
    event = asyncio.Event()
    revocations.on_change(lambda found: event.set() if found.number >= number else None)
    if revocations.number >= number:
        event.set()
    return event


async def ping_details(channels: ChannelPool, peer: Peer, member: Member) -> str:
    where = target(peer)
    request = signer_of(member.identity).signed(
        dht_pb2.PingRequest(), where.peer_id, "/swarmavg.v1.DHT/Ping"
    )
    try:
        await channels.channel(where.address).unary_unary("/swarmavg.v1.DHT/Ping")(
            request.SerializeToString(), timeout=10
        )
    except grpc.aio.AioRpcError as e:
        return f"{e.code().name}: {e.details()}"
    return "OK"


def assert_answers(probed: dict[str, str]) -> None:
    """The control: a probe that passes the TLS and revocation checks reaches the handlers."""
    assert "PERMISSION_DENIED" not in probed.values(), probed
    assert "UNAVAILABLE" not in probed.values(), probed
    assert probed["Ping"] == "OK"
    assert probed["data plane"] != REFUSED


async def test_a_revoked_peer_is_refused_everywhere_while_the_others_average(
    authority: Authority, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RevocationKeeper, "file_interval", 0.2)  # the default is 2 s
    a, b, c = (authority.invite(name) for name in ("a", "b", "c"))
    path = authority.folder / f"{RUN}.revoked"
    revoke(authority.authority_path, authority.run_path, [NOBODY.hex()], path)  # list #1
    c_tls = authority.tls(c)
    first = probed(with_list(private_config(authority, a, sock_dir), path))
    async with Peer(first) as peer_a, pool(c_tls) as channels:
        assert peer_a.address is not None
        async with (
            Peer(private_config(authority, b, sock_dir, join=[peer_a.address])) as peer_b,
            Peer(private_config(authority, c, sock_dir, join=[peer_a.address])) as peer_c,
        ):
            assert peer_a.dht is not None
            c_id = bytes.fromhex(peer_c.peer_id)
            assert c_id in peer_a.dht.routing
            # Before: c is an invited peer like any other, on connections it keeps open.
            assert_answers(
                await probe_all(target(peer_a), channels, c_tls.client_context, c.identity)
            )
            # The organiser revokes c; a reads its changed file while it runs.
            adopted = adoption(keeper(peer_a).revocations, 2)
            revoke(authority.authority_path, authority.run_path, [str(c.credential_path)], path)
            async with asyncio.timeout(20):
                await adopted.wait()
            refused = await probe_all(target(peer_a), channels, c_tls.client_context, c.identity)
            assert refused == DENIED
            assert (
                await ping_details(channels, peer_a, c) == "PERMISSION_DENIED: credential revoked"
            )
            assert c_id not in peer_a.dht.routing
            # The other two keep averaging, without c.
            async with peer_a.client() as client_a, peer_b.client() as client_b:
                rng = np.random.default_rng(1)
                x, y = (rng.standard_normal(50_000).astype(np.float32) for _ in range(2))
                results = await asyncio.gather(
                    client_a.average([x], key="k", group_size=2, timeout=30),
                    client_b.average([y], key="k", group_size=2, timeout=30),
                )
                for result in results:
                    assert sorted(result.peers) == sorted([peer_a.peer_id, peer_b.peer_id])
                    np.testing.assert_allclose(result.tensors[0], (x + y) / 2, rtol=1e-5, atol=1e-6)
        # c, restarted with its old credential, learns why nobody lets it in.
        late = private_config(authority, c, sock_dir, join=[peer_a.address])
        late = dataclasses.replace(late, dht=DHTSettings(bootstrap_timeout=1.0))
        with pytest.raises(StartupError, match="revoked this peer's credential"):
            async with Peer(late):
                pass


async def test_the_list_given_to_one_peer_reaches_the_others_through_the_dht(
    authority: Authority, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(RevocationKeeper, "dht_interval", 0.2)  # the default is 30 s
    a, b, c = (authority.invite(name) for name in ("a", "b", "c"))
    path = authority.folder / f"{RUN}.revoked"
    revoke(authority.authority_path, authority.run_path, [c.identity.peer_id_hex], path)
    c_tls = authority.tls(c)
    async with (
        Peer(probed(private_config(authority, b, sock_dir))) as peer_b,
        pool(c_tls) as channels,
    ):
        assert peer_b.address is not None
        assert_answers(await probe_all(target(peer_b), channels, c_tls.client_context, c.identity))
        learned = adoption(keeper(peer_b).revocations, 1)
        # Only a is given the file; it joins through b and stores the list in the run's DHT.
        config = with_list(private_config(authority, a, sock_dir, join=[peer_b.address]), path)
        async with Peer(config):
            async with asyncio.timeout(20):
                await learned.wait()
            refused = await probe_all(target(peer_b), channels, c_tls.client_context, c.identity)
            assert refused == DENIED


async def test_a_forged_or_older_list_in_the_dht_is_not_adopted(
    authority: Authority, sock_dir: Path, tmp_path: Path
) -> None:
    a, b, mallory = (authority.invite(name) for name in ("a", "b", "mallory"))
    key = load_authority_key(authority.authority_path)
    older = RevocationList.sign(key, RUN, 1, [NOBODY])
    path = authority.folder / f"{RUN}.revoked"
    path.write_text(RevocationList.sign(key, RUN, 2, [NOBODY, b"\x01" * 20]).dumps())
    foreign = Authority.create(tmp_path / "foreign", RUN)  # same run name, its own authority
    forged = RevocationList.sign(
        load_authority_key(foreign.authority_path), RUN, 99, [a.identity.peer_id]
    )
    async with Peer(with_list(private_config(authority, a, sock_dir), path)) as peer_a:
        assert peer_a.address is not None
        assert peer_a.dht is not None
        async with (
            Peer(private_config(authority, b, sock_dir, join=[peer_a.address])) as peer_b,
            contextlib.AsyncExitStack() as stack,
        ):
            # An invited peer whose node skips the run's key rules writes what it likes.
            channels = ChannelPool(tls=authority.tls(mallory))
            stack.push_async_callback(channels.close)
            rogue = await DHTNode.create(
                DHTConfig(run_id=RUN, initial_peers=(peer_a.address,)),
                mallory.identity,
                channels=channels,
            )
            stack.push_async_callback(rogue.shutdown)
            name = revocation_key(RUN)
            expiration = time.time() + 300
            mine = owner_suffix(mallory.identity.peer_id)
            kid, packed = key_id(name.encode()), pack_subkey(mine)
            await rogue.store(name, forged.to_value(), expiration, subkey=mine)
            await rogue.store(name, "wipe", expiration + 10)  # a plain value over every copy
            # a (a storing node) took neither: no plain value, no copy of mallory's.
            assert all(r.subkey and r.subkey != packed for r in peer_a.dht.storage.get(kid))
            await rogue.store(name, older.to_value(), expiration + 20, subkey=mine)  # genuine
            assert any(r.subkey == packed for r in peer_a.dht.storage.get(kid))
            await keeper(peer_a).sync_dht()  # a's own copy (#2) is there
            await keeper(peer_b).sync_dht()
            assert keeper(peer_b).revocations.number == 2  # not 99 (forged), not 1 (older)
            assert a.identity.peer_id not in keeper(peer_b).revocations
            assert keeper(peer_a).revocations.number == 2


async def test_a_bad_list_stops_the_daemon_at_start(
    authority: Authority, sock_dir: Path, tmp_path: Path
) -> None:
    a = authority.invite("a")
    foreign = Authority.create(tmp_path / "foreign", "other")
    path = tmp_path / "other.revoked"
    revoke(foreign.authority_path, foreign.run_path, [NOBODY.hex()], path)
    config = with_list(private_config(authority, a, sock_dir), path)
    with pytest.raises(
        StartupError, match=f"revocation list {path}: it is a revocation list of run 'other'"
    ):
        async with Peer(config):
            pass


def test_settings_of_a_revocation_list(authority: Authority, tmp_path: Path) -> None:
    from swarmavg.peer.daemon.settings import resolve_config

    member = authority.invite("a")
    flags = {
        "run_file": str(authority.run_path),
        "credential": str(member.credential_path),
        "identity": str(member.identity_path),
    }
    env = {"SWARMAVG_REVOCATIONS": "/env.revoked"}
    assert resolve_config(flags, env).revocations == "/env.revoked"
    toml = tmp_path / "peer.toml"
    toml.write_text('[peer]\nrevocations = "/file.revoked"\n')
    assert resolve_config(flags, {}, toml).revocations == "/file.revoked"
    assert resolve_config({**flags, "revocations": "/flag.revoked"}, env, toml).revocations == (
        "/flag.revoked"
    )
    with pytest.raises(ValueError, match="belongs to a private run"):
        resolve_config({"revocations": "/x.revoked"}, {})


async def test_only_a_few_holders_keep_a_copy_of_the_list_in_the_dht(
    authority: Authority,
) -> None:
    """Every read of the run's key returns every copy: a peer adds its own only while fewer
    than ``RevocationKeeper.copies`` holders keep one, so the key does not grow with the run."""
    run = read_run_file(authority.run_path)
    key = load_authority_key(authority.authority_path)
    listed = RevocationList.sign(key, RUN, 1, [NOBODY])
    async with swarm(7, run_id=RUN) as s:
        keepers = []
        for node in s.nodes:
            revocations = Revocations(RUN, run.authority_pem)
            keepers.append(RevocationKeeper(node, revocations, run))
            keepers[-1].copies = 3
        keepers[0].revocations.adopt(listed)
        for keeper_ in keepers:
            await keeper_.sync_dht()
        assert all(k.revocations.number == 1 for k in keepers)  # every peer learned it
        found = await s.nodes[-1].get(revocation_key(RUN), latest=True)
        assert found is not None
        assert len(found.value) == 3
