"""``[allreduce] data_rto_min_ms``: the RTO floor of the data plane's sockets."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import numpy as np
import pytest

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.data_server import DataPlaneServer
from swarmavg.averaging.allreduce.framing import FrameProtocol
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.allreduce.rto_floor import (
    KERNEL_FLOOR_MS,
    SHORT_PATH_FLOOR_MS,
    SHORT_PATH_RTT_MS,
    apply_rto_floor,
    connection_rtt_ms,
    floor_for_rtt,
    get_rto_min,
    rto_min_us,
    set_rto_min,
)
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from swarmavg.peer.daemon.config import AllReduceSettings
from swarmavg.peer.daemon.settings import resolve_config
from tests.averaging.allreduce_peers import FAST, close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(60)

FLOOR_MS = 40.0  # a whole number of ticks at HZ 100, 250 and 1000, far from the 200 ms default
LOWER_MS = 8.0  # below the derived floor: two ticks at HZ 250, eight at HZ 1000


def _kernel_floor_after(milliseconds: float) -> float | None:
    """The floor a fresh socket reports after being given ``milliseconds`` (``None``:
    this kernel has no per-socket floor)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        if not set_rto_min(probe, milliseconds):
            return None
        return get_rto_min(probe)


def test_the_option_value_is_whole_microseconds_within_the_kernels_range() -> None:
    assert rto_min_us(20) == 20_000
    assert rto_min_us(0.0123) == 12
    assert rto_min_us(0.0001) == 1  # never 0: the kernel's refusal, not ours, decides
    assert rto_min_us(1000) == 200_000  # the kernel refuses more than its own 200 ms
    for bad in (0.0, -5.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="RTO floor"):
            rto_min_us(bad)


def test_the_derived_floor_is_low_on_short_paths_only() -> None:
    assert floor_for_rtt(0.02) == SHORT_PATH_FLOOR_MS == 10.0  # loopback, a LAN
    assert floor_for_rtt(9.9) == 10.0
    assert floor_for_rtt(SHORT_PATH_RTT_MS) == KERNEL_FLOOR_MS == 200.0
    assert floor_for_rtt(50.0) == 200.0  # a long path keeps the kernel's floor
    assert floor_for_rtt(350.0) == 200.0


async def test_the_floor_follows_the_connections_rtt_and_never_rises() -> None:
    derived = _kernel_floor_after(SHORT_PATH_FLOOR_MS)
    lower = _kernel_floor_after(LOWER_MS)
    if derived is None or lower is None:
        pytest.skip("this kernel has no per-socket RTO floor (TCP_RTO_MIN_US, Linux 6.15)")
    accepted: asyncio.Queue[asyncio.StreamWriter] = asyncio.Queue()

    async def serve(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await accepted.put(writer)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    writers: list[asyncio.StreamWriter] = []
    try:
        port = server.sockets[0].getsockname()[1]
        for _ in range(2):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writers += [writer, await accepted.get()]
        sock = writers[0].transport.get_extra_info("socket")
        rtt = connection_rtt_ms(sock)
        assert rtt is not None
        assert 0 <= rtt < SHORT_PATH_RTT_MS  # loopback: a short path
        apply_rto_floor(writers[0].transport, None)
        assert get_rto_min(sock) == derived
        # A socket whose floor is already lower (an operator's sysctl) keeps it.
        other = writers[2].transport.get_extra_info("socket")
        assert set_rto_min(other, LOWER_MS)
        apply_rto_floor(writers[2].transport, None)
        assert get_rto_min(other) == lower
        apply_rto_floor(writers[2].transport, FLOOR_MS)  # a fixed floor does not raise it
        assert get_rto_min(other) == lower
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("bad", [0.0, -1.0, 200.5, float("nan")])
def test_a_floor_outside_the_kernels_range_is_refused_in_the_config(bad: float) -> None:
    with pytest.raises(ValueError, match="data_rto_min_ms"):
        AllReduceConfig(data_rto_min_ms=bad)
    with pytest.raises(ValueError, match="data_rto_min_ms"):
        AllReduceSettings(data_rto_min_ms=bad)


def test_a_refused_floor_leaves_the_socket_as_it_was() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        before = get_rto_min(sock)
        assert not set_rto_min(sock, 0.001)  # under two ticks at any HZ: refused, no error
        assert get_rto_min(sock) == before


def test_flag_env_and_file_reach_the_allreduce_config(tmp_path: Path) -> None:
    toml = tmp_path / "peer.toml"
    toml.write_text("[allreduce]\ndata_rto_min_ms = 40\n")

    def chosen(flags: dict[str, float], env: dict[str, str], path: Path | None) -> float | None:
        config = resolve_config(flags, env, path)
        return config.averager_config().allreduce.data_rto_min_ms

    assert chosen({}, {}, None) == AllReduceConfig().data_rto_min_ms
    assert chosen({}, {}, toml) == 40
    assert chosen({}, {"SWARMAVG_DATA_RTO_MIN_MS": "12.5"}, toml) == 12.5
    assert chosen({"data_rto_min_ms": 8.0}, {"SWARMAVG_DATA_RTO_MIN_MS": "12.5"}, toml) == 8
    with pytest.raises(ValueError, match="data_rto_min_ms"):
        resolve_config({}, {"SWARMAVG_DATA_RTO_MIN_MS": "500"})


def _floors(protocols: list[FrameProtocol]) -> set[float | None]:
    sockets = [p.transport.get_extra_info("socket") for p in protocols if p.transport is not None]
    return {get_rto_min(s) for s in sockets}  # type: ignore[arg-type]


@pytest.mark.parametrize("configured", [FLOOR_MS, None], ids=["fixed", "derived"])
async def test_a_round_runs_on_sockets_with_the_chosen_floor(
    grpc_servers: GrpcServerPool, configured: float | None
) -> None:
    # Loopback is a short path.
    expected = _kernel_floor_after(FLOOR_MS if configured is not None else SHORT_PATH_FLOOR_MS)
    if expected is None:
        pytest.skip("this kernel has no per-socket RTO floor (TCP_RTO_MIN_US, Linux 6.15)")
    default = _kernel_floor_after(200.0)
    assert expected != default  # else the test could not tell
    config = AllReduceConfig(
        min_stall=FAST.min_stall,
        registration_wait=FAST.registration_wait,
        chunk_bytes=4096,
        data_rto_min_ms=configured,
    )
    peers = await start_peers(grpc_servers, 3, config, data_plane=True)
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
        # Both ends of every connection of the round: the ones the senders opened (kept
        # idle for the next round) and the ones the reducers accepted.
        opened: list[FrameProtocol] = []
        accepted: list[FrameProtocol] = []
        for p in peers:
            connector = p.service.data_connector
            assert connector is not None
            assert connector.opened == 2  # one to each other reducer
            opened += [proto for idle in connector._idle.values() for _, proto in idle]
            server = p.service._data_server
            assert isinstance(server, DataPlaneServer)
            accepted += list(server._protocols)
        assert len(opened) == 6
        assert len(accepted) == 6
        assert _floors(opened) == {expected}
        assert _floors(accepted) == {expected}
    finally:
        await channels.close()
        await close_peers(peers)
