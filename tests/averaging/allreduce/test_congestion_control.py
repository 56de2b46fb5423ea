"""``[allreduce] congestion_control``: checked at start, applied to real data-plane sockets."""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from swarmavg.averaging.allreduce import congestion
from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.congestion import (
    AUTO,
    KERNEL,
    LONG_PATH_RTT,
    CongestionControlError,
    algorithm_for_path,
    apply_for_path,
    check_congestion_control,
    check_name,
    get_congestion_control,
    path_min_rtt,
    restart_congestion_control,
    set_congestion_control,
)
from swarmavg.averaging.allreduce.data_server import DataPlaneServer
from swarmavg.averaging.allreduce.framing import FrameProtocol
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from swarmavg.dht.auth import Authenticator
from swarmavg.dht.identity import Identity
from swarmavg.peer import PeerConfig, start_peer
from swarmavg.peer.daemon.config import AllReduceSettings
from swarmavg.peer.daemon.daemon import StartupError
from swarmavg.peer.daemon.settings import resolve_config
from tests.averaging.allreduce_peers import (
    FAST,
    LocalPeer,
    close_peers,
    exact_round,
    make_group,
    run_group,
    start_peers,
)
from tests.harness import GrpcServerPool

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(
        not hasattr(socket, "TCP_CONGESTION"), reason="TCP_CONGESTION is Linux's socket option"
    ),
]

# reno is built into every Linux kernel and always in tcp_allowed_congestion_control, so an
# unprivileged test can set it; it is also never the default of a modern kernel, so a
# socket that reports it got it from us.
ALGORITHM = "reno"
MISSING = "nosuchcc"


def _default_algorithm() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return get_congestion_control(probe)


@pytest.mark.parametrize("name", ["", "a" * 16, "cu bic", "cübic", "cubic\0"])
def test_a_malformed_name_is_refused_before_any_socket(name: str) -> None:
    with pytest.raises(CongestionControlError, match="algorithm name"):
        check_name(name)
    with pytest.raises(ValueError, match="congestion_control"):
        AllReduceConfig(congestion_control=name)
    with pytest.raises(ValueError, match="congestion_control"):
        AllReduceSettings(congestion_control=name)


def test_an_algorithm_the_kernel_lacks_is_refused_with_what_it_has() -> None:
    with pytest.raises(CongestionControlError, match=r"refused it.*available here: .*reno"):
        check_congestion_control(MISSING)
    check_congestion_control(ALGORITHM)  # no error


def test_set_congestion_control_changes_a_real_socket() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        set_congestion_control(sock, ALGORITHM)
        assert get_congestion_control(sock) == ALGORITHM
        with pytest.raises(CongestionControlError, match=MISSING):
            set_congestion_control(sock, MISSING)
        assert get_congestion_control(sock) == ALGORITHM  # a refusal changes nothing


def test_the_service_refuses_a_missing_algorithm_at_start() -> None:
    auth = Authenticator(Identity.generate(), "cc")
    with pytest.raises(CongestionControlError, match=MISSING):
        AllReduceService(auth, AllReduceConfig(congestion_control=MISSING))
    # Without a data plane there is no socket to set it on: nothing to refuse.
    AllReduceService(auth, AllReduceConfig(congestion_control=MISSING, data_plane=False))


def test_flag_env_and_file_reach_the_allreduce_config(tmp_path: Path) -> None:
    toml = tmp_path / "peer.toml"
    toml.write_text('[allreduce]\ncongestion_control = "cubic"\n')

    def chosen(flags: dict[str, str], env: dict[str, str], path: Path | None) -> str | None:
        config = resolve_config(flags, env, path)
        return config.averager_config().allreduce.congestion_control

    assert chosen({}, {}, None) == "auto"  # by path length
    assert chosen({"congestion_control": "kernel"}, {}, None) == "kernel"
    assert chosen({}, {}, toml) == "cubic"
    assert chosen({}, {"SWARMAVG_CONGESTION_CONTROL": "bbr"}, toml) == "bbr"
    assert chosen({"congestion_control": "reno"}, {"SWARMAVG_CONGESTION_CONTROL": "bbr"}, toml) == (
        "reno"
    )
    with pytest.raises(ValueError, match="congestion_control"):
        resolve_config({}, {"SWARMAVG_CONGESTION_CONTROL": "two words"})


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-cc-") as d:
        yield Path(d)


def test_a_daemon_with_a_missing_algorithm_does_not_start(sock_dir: Path) -> None:
    config = PeerConfig(
        listen="127.0.0.1:0",
        control=str(sock_dir / "p.sock"),
        allreduce=AllReduceSettings(congestion_control=MISSING),
    )
    with pytest.raises(StartupError, match=f"congestion_control '{MISSING}'.*available here"):
        start_peer(config)
    assert not (sock_dir / "p.sock").exists()  # refused before binding anything


def _algorithms(protocols: list[FrameProtocol]) -> set[str]:
    sockets = [p.transport.get_extra_info("socket") for p in protocols if p.transport is not None]
    return {get_congestion_control(s) for s in sockets}  # type: ignore[arg-type]


def _connections(peers: list[LocalPeer]) -> tuple[list[FrameProtocol], list[FrameProtocol]]:
    """Every data-plane connection of the peers, both ends: the ones the senders opened
    (kept idle for the next round) and the ones the reducers accepted."""
    opened: list[FrameProtocol] = []
    accepted: list[FrameProtocol] = []
    for p in peers:
        connector = p.service.data_connector
        assert connector is not None
        opened += [proto for idle in connector._idle.values() for _, proto in idle]
        server = p.service._data_server
        assert isinstance(server, DataPlaneServer)
        accepted += list(server._protocols)
    return opened, accepted


async def _start_peers(grpc_servers: GrpcServerPool, algorithm: str | None) -> list[LocalPeer]:
    """Three peers with data planes whose sockets get ``algorithm`` (the setting's value)."""
    config = AllReduceConfig(
        min_stall=FAST.min_stall,
        registration_wait=FAST.registration_wait,
        chunk_bytes=4096,
        congestion_control=algorithm,
    )
    return await start_peers(grpc_servers, 3, config, data_plane=True)


async def test_a_round_runs_on_sockets_with_the_chosen_algorithm(
    grpc_servers: GrpcServerPool,
) -> None:
    if _default_algorithm() == ALGORITHM:
        pytest.skip(f"{ALGORITHM} is this kernel's default: the test could not tell")
    peers = await _start_peers(grpc_servers, ALGORITHM)
    channels = ChannelPool()
    try:
        rng = np.random.default_rng(0)
        inputs = [[rng.standard_normal(5000).astype(np.float32)] for _ in peers]
        group = make_group(peers, inputs[0])
        results = await run_group(peers, group, inputs, [1.0] * 3, channels, timeout=20)
        mean = weighted_mean([x[0] for x in inputs], [1.0] * 3)
        for r in results:
            assert isinstance(r, AveragingResult), r
            assert not r.partial
            np.testing.assert_allclose(r.tensors[0], mean, rtol=1e-5, atol=1e-6)
        for p in peers:
            connector = p.service.data_connector
            assert connector is not None
            assert connector.opened == 2  # one to each other reducer
        opened, accepted = _connections(peers)
        assert len(opened) == 6
        assert len(accepted) == 6
        assert _algorithms(opened) == {ALGORITHM}
        assert _algorithms(accepted) == {ALGORITHM}
    finally:
        await channels.close()
        await close_peers(peers)


def _bbr_allowed() -> bool:
    try:
        check_congestion_control("bbr")
    except CongestionControlError:
        return False
    return True


def _connected_pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return listener, client, server


@pytest.mark.parametrize("algorithm", ["bbr", ALGORITHM])
def test_only_bbr_is_restarted_and_keeps_its_name(algorithm: str) -> None:
    if algorithm == "bbr" and not _bbr_allowed():
        pytest.skip("this kernel does not let the test use bbr")
    listener, client, server = _connected_pair()
    with listener, client, server:
        set_congestion_control(client, algorithm)
        client.sendall(b"x" * 65536)  # some state to restart
        assert restart_congestion_control(client) is (algorithm == "bbr")
        assert get_congestion_control(client) == algorithm
        client.sendall(b"y")  # the connection carries on
        received = b""
        while len(received) < 65537:
            received += server.recv(1 << 20)
        assert received.endswith(b"y")


async def test_reused_bbr_connections_restart_at_each_stream_both_ends(
    grpc_servers: GrpcServerPool,
) -> None:
    if not _bbr_allowed():
        pytest.skip("this kernel does not let the test use bbr")
    peers = await _start_peers(grpc_servers, "bbr")
    channels = ChannelPool()
    try:
        for seed in range(3):
            await exact_round(peers, channels, seed)
            opened, accepted = _connections(peers)
            assert len(opened) == len(accepted) == 6  # one connection per pair, reused
            # Each connection's first stream starts fresh; every later one restarts BBR,
            # at the sender (the chunks) and at the reducer (the averages).
            assert [p.restarts for p in opened] == [seed] * 6
            assert [p.restarts for p in accepted] == [seed] * 6
            assert _algorithms(opened) == _algorithms(accepted) == {"bbr"}
    finally:
        await channels.close()
        await close_peers(peers)


# ---- auto: the algorithm by the path's round-trip time ----


def test_auto_takes_bbr_from_the_long_path_rtt_and_the_default_below() -> None:
    assert algorithm_for_path(None, "cubic") == "cubic"  # no sample yet
    assert algorithm_for_path(0.0002, "cubic") == "cubic"
    assert algorithm_for_path(LONG_PATH_RTT * 0.99, "reno") == "reno"
    assert algorithm_for_path(LONG_PATH_RTT, "cubic") == "bbr"
    assert algorithm_for_path(0.3, "cubic") == "bbr"
    assert algorithm_for_path(0.3, "bbr") == "bbr"
    assert algorithm_for_path(float("nan"), "cubic") == "cubic"
    assert algorithm_for_path(float("inf"), "cubic") == "cubic"


def test_auto_and_kernel_are_never_refused() -> None:
    for name in (AUTO, KERNEL):
        check_name(name)
        check_congestion_control(name)
        AllReduceConfig(congestion_control=name)
        AllReduceSettings(congestion_control=name)
    assert AllReduceConfig().congestion_control == AUTO
    assert AllReduceSettings().congestion_control == AUTO


def test_the_kernel_measures_a_connections_minimum_rtt() -> None:
    listener, client, server = _connected_pair()
    with listener, client, server:
        client.sendall(b"x" * 4096)
        server.recv(4096)
        for sock in (client, server):  # each end has its handshake's sample
            rtt = path_min_rtt(sock)
            assert rtt is not None
            assert 0 < rtt < LONG_PATH_RTT  # loopback
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as unconnected:
        assert path_min_rtt(unconnected) is None


def test_auto_gives_a_long_path_bbr_and_leaves_a_short_one() -> None:
    listener, client, server = _connected_pair()
    with listener, client, server:
        set_congestion_control(client, ALGORITHM)  # a machine whose default is reno
        assert apply_for_path(client, ALGORITHM) == ALGORITHM  # loopback: short
        assert get_congestion_control(client) == ALGORITHM
        chosen = apply_for_path(client, ALGORITHM, min_rtt=0.2)
        if _bbr_allowed():
            assert chosen == get_congestion_control(client) == "bbr"
        else:  # refused: the socket keeps its algorithm, and the remedy is logged
            assert chosen == get_congestion_control(client) == ALGORITHM
        # The path measured shorter later: back to the machine's default.
        assert apply_for_path(client, ALGORITHM, min_rtt=0.01) == ALGORITHM
        assert get_congestion_control(client) == ALGORITHM


def test_a_long_path_without_bbr_is_logged_once_with_the_remedy(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(congestion, "LONG_PATH", MISSING)  # an algorithm nobody may use
    monkeypatch.setattr(congestion, "_long_path_warned", False)
    listener, client, server = _connected_pair()
    with listener, client, server, caplog.at_level("WARNING"):
        set_congestion_control(client, ALGORITHM)
        for _ in range(3):
            assert apply_for_path(client, ALGORITHM, min_rtt=0.2) == ALGORITHM
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "200 ms" in warnings[0]
    assert "tcp_allowed_congestion_control" in warnings[0]


@pytest.mark.parametrize("setting", [AUTO, KERNEL, None])
async def test_a_round_on_short_paths_keeps_the_kernels_algorithm(
    grpc_servers: GrpcServerPool, setting: str | None
) -> None:
    peers = await _start_peers(grpc_servers, setting)
    channels = ChannelPool()
    try:
        for seed in range(2):  # the second round reuses every connection
            await exact_round(peers, channels, seed)
        opened, accepted = _connections(peers)
        assert len(opened) == len(accepted) == 6
        assert _algorithms(opened) == _algorithms(accepted) == {_default_algorithm()}
    finally:
        await channels.close()
        await close_peers(peers)


async def test_auto_chooses_at_both_ends_and_again_at_each_stream(
    grpc_servers: GrpcServerPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if _default_algorithm() == ALGORITHM:
        pytest.skip(f"{ALGORITHM} is this kernel's default: the test could not tell")
    # Every loopback path "long", and reno the long-path algorithm: what auto chooses is
    # then visible on every data-plane socket of a real round.
    monkeypatch.setattr(congestion, "LONG_PATH", ALGORITHM)
    monkeypatch.setattr(congestion, "LONG_PATH_RTT", 0.0)
    peers = await _start_peers(grpc_servers, AUTO)
    channels = ChannelPool()
    try:
        await exact_round(peers, channels, 0)
        opened, accepted = _connections(peers)
        assert len(opened) == len(accepted) == 6
        assert _algorithms(opened) == _algorithms(accepted) == {ALGORITHM}
        # The paths "measured short" now: each end goes back to the kernel's default at
        # the reused connection's next stream.
        monkeypatch.setattr(congestion, "LONG_PATH_RTT", 1.0)
        await exact_round(peers, channels, 1)
        opened, accepted = _connections(peers)
        assert len(opened) == len(accepted) == 6  # the same connections, reused
        assert _algorithms(opened) == _algorithms(accepted) == {_default_algorithm()}
    finally:
        await channels.close()
        await close_peers(peers)
