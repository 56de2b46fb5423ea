"""The control transport end to end inside one process: real client, real control service,
real shared memory, over a unix socket. The backend is a swarm of one (the round's result is
the local batch's weighted mean), so these tests cover the client <-> daemon layer alone;
rounds between real daemons are in tests/integration."""

from __future__ import annotations

import asyncio
import errno
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import pytest
import torch

from swarmavg.averaging.request import RoundRequest
from swarmavg.averaging.result import AveragingResult
from swarmavg.peer import (
    DaemonUnavailableError,
    NoStateError,
    ValidationError,
    connect,
    connect_async,
)
from swarmavg.peer.client.errors import NoGroupError, SwarmError
from swarmavg.peer.client.shm import NAME_RE, SHM_DIR, DaemonSegmentCache
from swarmavg.peer.daemon.combiner import LocalCombiner
from swarmavg.peer.daemon.control import ControlService
from swarmavg.proto import control_pb2
from tests.peer.daemon.raw_calls import unchecked_shm_call
from tests.peer.shm_views import in_shared_memory


class SoloBackend:
    """A daemon backend whose swarm is this one peer."""

    def __init__(self, window: float = 0.0) -> None:
        self.combiner = LocalCombiner(self._average, window)
        self.segments = DaemonSegmentCache()
        self.rounds: list[RoundRequest] = []
        self.started: list[str] = []  # keys of rounds begun, before their inputs were ready
        self.round_began = asyncio.Event()
        self.outs: list[list[np.ndarray] | None] = []  # where each round was told to write
        self.in_place: list[bool] = []  # whether it read its inputs where it writes
        self.checked_by_client: list[bool] = []  # whether only the client checked them
        self.store: dict[str, Any] = {}
        self.state: tuple[bytes, list[np.ndarray]] | None = None
        self.failures: list[str] = []

    async def _average(
        self,
        arrays: list[np.ndarray],
        params: RoundRequest,
        *,
        out: list[np.ndarray] | None = None,
        inputs_ready: Awaitable[object] | None = None,
        checked_by_client: bool = False,
    ) -> AveragingResult:
        self.started.append(params.key)  # as the averager declares before the inputs
        self.round_began.set()
        if inputs_ready is not None:  # are ready, and waits for them before it joins a group
            await inputs_ready
        self.rounds.append(params)
        self.checked_by_client.append(checked_by_client)
        self.outs.append(out)
        self.in_place.append(
            out is not None and all(a is o for a, o in zip(arrays, out, strict=True))
        )
        if params.key == "fails-mid-round":
            from swarmavg.averaging.errors import AveragingError

            raise AveragingError("a member failed mid-round")
        if params.min_group_size > 1:
            from swarmavg.averaging.errors import NoGroupError as AveragingNoGroup

            raise AveragingNoGroup(f"no peers for {params.key}")
        return AveragingResult(
            tensors=[a.copy() for a in arrays],
            group_size=1,
            peers=["solo"],
            group_id="g",
            codec=params.codec or "none",
            partial=False,
        )

    async def dht_store(self, key: str, value: Any, ttl: float, subkey: Any) -> bool:
        if subkey is None:
            self.store[key] = value
        else:
            self.store.setdefault(key, {})[subkey] = value
        return True

    async def dht_get(self, key: str) -> tuple[bool, Any]:
        return (key in self.store), self.store.get(key)

    async def publish_state(self, arrays: list[np.ndarray], metadata: bytes) -> None:
        # As the real daemon (whose StateSharer copies them into chunks): the arrays may be
        # views of the client's segment, which its next publish writes over.
        self.state = (metadata, [a.copy() for a in arrays])

    async def load_state(
        self, timeout: float, max_bytes: int | None = None
    ) -> tuple[bytes, list[np.ndarray]]:
        if self.state is None:
            from swarmavg.averaging.errors import StateNotFoundError

            raise StateNotFoundError("nobody published state")
        return self.state

    def state_progress(self) -> None:
        return None  # load_state answers at once: no download to report

    async def peers(self, training_run: str) -> control_pb2.PeersResponse:
        return control_pb2.PeersResponse(run_id="solo")

    def status(self) -> control_pb2.StatusResponse:
        info = os.stat(SHM_DIR)
        return control_pb2.StatusResponse(
            peer_id="solo", shm_dir=str(SHM_DIR), shm_dev=info.st_dev, shm_ino=info.st_ino
        )

    def record_failure(self, reason: str) -> None:
        self.failures.append(reason)


@dataclass
class Daemon:
    backend: SoloBackend
    endpoint: str


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    backend = SoloBackend()
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        path = Path(d) / "c.sock"
        server = grpc.aio.server()
        service = ControlService(backend)
        service.add_to_server(server)
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        try:
            yield Daemon(backend, str(path))
        finally:
            await backend.combiner.close()
            await server.stop(None)
            backend.segments.close()


def my_segments() -> list[str]:
    pid = os.getpid()
    return [n for n in os.listdir(SHM_DIR) if (m := NAME_RE.match(n)) and int(m.group(1)) == pid]


@pytest.mark.parametrize("use_shm", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, ml_dtypes.bfloat16])
async def test_numpy_round_trip(daemon: Daemon, use_shm: bool, dtype: Any) -> None:
    rng = np.random.default_rng(0)
    tensors = [rng.standard_normal(s).astype(dtype) for s in [(700, 700), (3,), (0,)]]
    async with connect_async(daemon.endpoint, use_shm=use_shm) as client:
        result = await client.average(tensors, key="k", min_group_size=1, timeout=5)
    assert result.group_size == 1
    assert result.peers == ["solo"]
    for got, want in zip(result.tensors, tensors, strict=True):
        assert isinstance(got, np.ndarray)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
    assert my_segments() == []


async def test_sync_client_in_thread(daemon: Daemon) -> None:
    tensors = [torch.randn(600, 600), torch.randn(5, dtype=torch.bfloat16), torch.ones(2).half()]

    def call() -> Any:
        with connect(daemon.endpoint) as client:
            assert client.dht.store("a", {"x": [1, 2]}, ttl=10) is True
            assert client.dht.get("a") == {"x": [1, 2]}
            return client.average(tensors, key="t", min_group_size=1, timeout=5)

    result = await asyncio.to_thread(call)
    for got, want in zip(result.tensors, tensors, strict=True):
        assert isinstance(got, torch.Tensor)
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
    assert my_segments() == []


async def test_local_processes_are_combined(daemon: Daemon) -> None:
    daemon.backend.combiner = LocalCombiner(daemon.backend._average, window=0.5)
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal(1000).astype(np.float32) for _ in range(3)]
    weights = [1.0, 2.0, 5.0]
    clients = [await connect_async(daemon.endpoint) for _ in range(3)]
    try:
        results = await asyncio.gather(
            *(
                c.average([x], key="same", weight=w, min_group_size=1, timeout=5)
                for c, x, w in zip(clients, inputs, weights, strict=True)
            )
        )
    finally:
        for c in clients:
            await c.close()
    expected = sum(w * x.astype(np.float64) for w, x in zip(weights, inputs, strict=True)) / 8.0
    assert len(daemon.backend.rounds) == 1, "one contribution for the three local callers"
    assert daemon.backend.rounds[0].weight == 8.0
    for r in results:
        assert r.local_callers == 3
        np.testing.assert_allclose(r.tensors[0], expected, rtol=1e-5, atol=1e-6)


async def test_a_local_batch_carries_one_callers_state_digest(daemon: Daemon) -> None:
    daemon.backend.combiner = LocalCombiner(daemon.backend._average, window=0.5)
    clients = [await connect_async(daemon.endpoint) for _ in range(2)]
    try:
        await asyncio.gather(
            *(
                c.average([np.zeros(4, np.float32)], key="d", min_group_size=1, state_digest=d)
                for c, d in zip(clients, [b"first", b"second"], strict=True)
            )
        )
    finally:
        for c in clients:
            await c.close()
    assert len(daemon.backend.rounds) == 1
    assert daemon.backend.rounds[0].state_digest in {b"first", b"second"}


async def test_local_layout_mismatch_is_rejected(daemon: Daemon) -> None:
    daemon.backend.combiner = LocalCombiner(daemon.backend._average, window=0.5)
    async with connect_async(daemon.endpoint) as a, connect_async(daemon.endpoint) as b:
        first = asyncio.ensure_future(
            a.average([np.zeros(4, np.float32)], key="m", min_group_size=1)
        )
        await asyncio.sleep(0.1)
        with pytest.raises(ValidationError, match="differ from those another local process"):
            await b.average([np.zeros(5, np.float32)], key="m", min_group_size=1)
        assert (await first).group_size == 1


async def test_errors_map_to_swarm_errors(daemon: Daemon) -> None:
    async with connect_async(daemon.endpoint) as client:
        with pytest.raises(NoGroupError, match="no peers"):
            await client.average([np.zeros(2, np.float32)], key="k", timeout=1)
        with pytest.raises(NoStateError):
            await client.load_state(timeout=1)
        await client.publish_state([np.arange(3.0)], {"step": 7})
        metadata, tensors = await client.load_state(timeout=1)
        assert metadata == {"step": 7}
        np.testing.assert_array_equal(tensors[0], np.arange(3.0))
        assert await client.dht.get("missing") is None
        await client.dht.store("d", 1, subkey="a")
        await client.dht.store("d", 2, subkey="b")
        assert await client.dht.get("d") == {"a": 1, "b": 2}
        assert (await client.status())["peer_id"] == "solo"


async def test_daemon_revalidates_raw_requests(daemon: Daemon) -> None:
    """A caller that skips the client's checks still gets INVALID_ARGUMENT."""
    from swarmavg.proto import control_pb2_grpc, tensor_pb2

    bad_start = control_pb2.AverageStart(
        key="k",
        weight=1,
        min_group_size=1,
        timeout=5,
        tensors=[control_pb2.TensorSpec(dtype=tensor_pb2.FLOAT32, shape=[2])],
    )
    nan = np.array([np.nan, 1], np.float32).tobytes()
    cases = [
        [
            control_pb2.AverageRequest(start=bad_start),
            control_pb2.AverageRequest(data=control_pb2.TensorBytes(index=0, data=nan)),
        ],
        [
            control_pb2.AverageRequest(
                start=control_pb2.AverageStart(key="k" * 300, weight=1, min_group_size=1, timeout=1)
            )
        ],
        [
            control_pb2.AverageRequest(
                start=control_pb2.AverageStart(
                    key="k",
                    weight=1,
                    min_group_size=1,
                    timeout=1,
                    tensors=[control_pb2.TensorSpec(dtype=tensor_pb2.INT64, shape=[2])],
                )
            )
        ],
        [
            control_pb2.AverageRequest(
                start=control_pb2.AverageStart(
                    key="k",
                    weight=1,
                    min_group_size=1,
                    timeout=1,
                    tensors=[control_pb2.TensorSpec(dtype=tensor_pb2.FLOAT32, shape=[1 << 40])],
                )
            )
        ],
        [
            control_pb2.AverageRequest(
                start=control_pb2.AverageStart(
                    key="k",
                    weight=1,
                    min_group_size=1,
                    timeout=1,
                    shm_name="../x",
                    shm_size=8,
                    tensors=[control_pb2.TensorSpec(dtype=tensor_pb2.FLOAT32, shape=[2])],
                )
            )
        ],
    ]
    async with grpc.aio.insecure_channel(f"unix:{daemon.endpoint}") as channel:
        stub = control_pb2_grpc.ControlStub(channel)
        for requests in cases:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async for _ in stub.Average(iter(requests), timeout=5):
                    pass
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    async with connect_async(daemon.endpoint) as client:  # still serving
        result = await client.average([np.ones(2, np.float32)], key="k", min_group_size=1)
        assert result.group_size == 1


async def test_no_daemon() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        with pytest.raises(DaemonUnavailableError, match="no swarmavg daemon"):
            await connect_async(str(Path(d) / "none.sock"), connect_timeout=0.5)
        with pytest.raises(DaemonUnavailableError, match="no swarmavg daemon"):
            await asyncio.to_thread(connect, str(Path(d) / "none.sock"), connect_timeout=0.5)


async def test_shm_segments_are_reused_across_calls(daemon: Daemon) -> None:
    rng = np.random.default_rng(3)
    x = [rng.standard_normal(400_000).astype(np.float32)]
    async with connect_async(daemon.endpoint) as client:
        first = await client.average(x, key="a", min_group_size=1)
        assert len(daemon.backend.segments) == 1
        np.testing.assert_array_equal(first.tensors[0], x[0])
        held = first.tensors[0]  # still referenced: the next call must not overwrite it
        del first
        y = [x[0] * 2]
        second = await client.average(y, key="b", min_group_size=1)
        assert len(daemon.backend.segments) == 2, "a fresh segment while results are held"
        np.testing.assert_array_equal(held, x[0])
        np.testing.assert_array_equal(second.tensors[0], y[0])
        del held, second
        third = await client.average(x, key="c", min_group_size=1)
        assert len(daemon.backend.segments) == 2, "the idle segment was reused"
        np.testing.assert_array_equal(third.tensors[0], x[0])
        del third
        assert len(client._segments) == 2, "both segments are kept for reuse"
        daemon.backend.segments.close()  # as if the daemon restarted or evicted them
        fourth = await client.average(y, key="d", min_group_size=1)  # retried transparently
        np.testing.assert_array_equal(fourth.tensors[0], y[0])
    assert my_segments() == []


async def test_a_call_that_found_no_group_keeps_its_segment_for_the_next(daemon: Daemon) -> None:
    """Seen on the test bed: a call that found no group used to drop its
    segment on both sides, so the peer's next call faulted in a fresh one, reached its
    daemon late again and missed that round too."""
    x = [np.random.default_rng(4).standard_normal(400_000).astype(np.float32)]
    async with connect_async(daemon.endpoint) as client:
        with pytest.raises(NoGroupError, match="no peers"):
            await client.average(x, key="lonely", min_group_size=2)
        assert len(client._segments) == 1, "kept: the round never wrote into it"
        assert len(daemon.backend.segments) == 1, "and the daemon kept its mapping"
        result = await client.average(x, key="next", min_group_size=1)
        assert daemon.backend.outs[-1] is not None
        assert len(daemon.backend.segments) == 1, "the next call reused it"
        np.testing.assert_array_equal(result.tensors[0], x[0])
        del result
        # Any other failure still drops the segment on both sides.
        with pytest.raises(SwarmError, match="mid-round"):
            await client.average(x, key="fails-mid-round", min_group_size=1)
        assert len(client._segments) == 0
        assert len(daemon.backend.segments) == 0
    assert my_segments() == []


async def test_a_shm_call_hands_the_round_its_segment_as_the_result(daemon: Daemon) -> None:
    """The round averages in the client's segment (no copy of the inputs, no
    result copied back), and does not scan it first: the client checked it as it wrote it
    and says so, so the round checks each chunk as it encodes it."""
    rng = np.random.default_rng(4)
    tensors = [rng.standard_normal(s).astype(np.float32) for s in [(300_000,), (7,), (2, 3)]]
    async with connect_async(daemon.endpoint) as client:
        for key in ("a", "b"):
            result = await client.average(tensors, key=key, min_group_size=1)
            for got, want in zip(result.tensors, tensors, strict=True):
                np.testing.assert_array_equal(got, want)
            for phase in ("daemon.check", "daemon.write_back", "client.prepare", "client.call"):
                assert result.timings[phase] >= 0.0
            del result
    outs = daemon.backend.outs
    assert len(outs) == 2
    assert all(
        out is not None and [o.shape for o in out] == [(300_000,), (7,), (2, 3)] for out in outs
    )
    assert daemon.backend.in_place == [True, True]
    assert daemon.backend.checked_by_client == [True, True]


async def test_inline_calls_and_calls_that_do_not_vouch_are_checked_by_the_daemon(
    daemon: Daemon,
) -> None:
    """Small tensors travel inline and are checked before the round, whatever the start
    says; so is a segment whose start does not say its client checked it."""
    async with connect_async(daemon.endpoint) as client:
        await client.average([np.ones(10, np.float32)], key="small", min_group_size=1)
    async with connect_async(daemon.endpoint, use_shm=False) as client:
        await client.average([np.ones(300_000, np.float32)], key="inline", min_group_size=1)
    assert daemon.backend.checked_by_client == [False, False]


async def test_nan_in_shared_memory_is_refused_by_the_daemon(daemon: Daemon) -> None:
    """A caller that skips the client's check and does not claim it checked
    (``inputs_checked`` unset): the daemon's check finds the NaN, names the tensor, and
    the round never starts."""
    values = [np.ones(300_000, np.float32), np.ones(5, np.float32)]
    values[1][3] = np.inf
    error = await unchecked_shm_call(daemon.endpoint, values, key="k")
    assert error is not None
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tensor 1 holds 1 NaN/Inf" in (error.details() or "")
    assert daemon.backend.rounds == []
    assert daemon.backend.failures == ["invalid_input"]


async def test_a_caller_in_a_batch_whose_client_lied_about_its_check_is_left_out(
    daemon: Daemon,
) -> None:
    """A batch of two local callers, one of which claims a check it did not make: the
    batch checks claimed inputs before combining them, refuses that caller alone (counted
    once), and averages the other's tensors."""
    daemon.backend.combiner = LocalCombiner(daemon.backend._average, window=0.5)
    x = np.arange(300_000, dtype=np.float32)
    bad = np.ones(300_000, np.float32)
    bad[-1] = np.nan
    async with connect_async(daemon.endpoint) as client:
        error, result = await asyncio.gather(
            unchecked_shm_call(daemon.endpoint, [bad], key="b", inputs_checked=True),
            client.average([x], key="b", min_group_size=1),
        )
        assert error is not None
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tensor 0 holds 1 NaN/Inf" in (error.details() or "")
        assert result.local_callers == 1
        np.testing.assert_array_equal(result.tensors[0], x)
    assert len(daemon.backend.rounds) == 1
    assert daemon.backend.failures == ["invalid_input"]


@pytest.mark.parametrize("during_declaration", [False, True])
def test_the_client_checks_while_it_copies_into_shared_memory(during_declaration: bool) -> None:
    from swarmavg.peer.client.calls import PreparedAverage
    from swarmavg.peer.client.errors import ValidationError
    from swarmavg.peer.client.shm import SegmentPool

    x = np.ones(1 << 20, np.float32)
    x[-1] = np.nan  # in the last block
    pool = SegmentPool()

    def prepare() -> PreparedAverage:
        return PreparedAverage(
            [x],
            key="k",
            weight=1.0,
            group_size=None,
            min_group_size=1,
            timeout=5.0,
            codec=None,
            segments=pool,
            write_during_declaration=during_declaration,
        )

    if not during_declaration:
        with pytest.raises(ValidationError, match="tensor 0 holds 1 NaN/Inf"):
            prepare()
    else:
        # The start goes out first; the copy finds the NaN and ends the stream there.
        call = prepare()
        kinds = [m.WhichOneof("kind") for m in call.requests()]
        assert kinds == ["start_before_inputs"]
        assert call.write_error is not None
        assert "tensor 0 holds 1 NaN/Inf" in str(call.write_error)
        call.cleanup()
    assert len(pool) == 0
    assert my_segments() == []


async def test_a_nan_found_while_the_daemon_declares_fails_the_call_with_the_clients_error(
    daemon: Daemon,
) -> None:
    x = np.ones(1 << 20, np.float32)
    x[12345] = np.inf
    async with connect_async(daemon.endpoint) as client:
        with pytest.raises(ValidationError, match="tensor 0 holds 1 NaN/Inf"):
            await client.average([x], key="nan", min_group_size=1, timeout=5)
        result = await client.average([np.ones_like(x)], key="after", min_group_size=1)
        np.testing.assert_array_equal(result.tensors[0], np.ones_like(x))
        del result
    assert daemon.backend.failures == ["invalid_input"]
    assert my_segments() == []


async def test_the_daemon_declares_before_the_client_has_written_its_inputs(
    daemon: Daemon,
) -> None:
    """The client's copy into shared memory overlaps the declaration. A raw
    client sends ``start_before_inputs`` and holds ``inputs_written`` back: the round
    (here the backend's ``average``) starts at once and waits for the inputs."""
    import grpc

    from swarmavg.peer.client.shm import ClientSegment, segment_layout
    from swarmavg.proto import control_pb2_grpc, tensor_pb2

    x = np.arange(300_000, dtype=np.float32)
    segment = ClientSegment(segment_layout([x.dtype], [x.shape])[1])
    written = asyncio.Event()

    async def requests() -> Any:
        yield control_pb2.AverageRequest(
            start_before_inputs=control_pb2.AverageStart(
                key="early",
                weight=1,
                min_group_size=1,
                timeout=5,
                shm_name=segment.name,
                shm_size=segment.size,
                tensors=[control_pb2.TensorSpec(dtype=tensor_pb2.FLOAT32, shape=x.shape)],
                inputs_checked=True,
            )
        )
        await written.wait()
        yield control_pb2.AverageRequest(inputs_written=control_pb2.InputsWritten())

    try:
        async with grpc.aio.insecure_channel(f"unix:{daemon.endpoint}") as channel:
            call = control_pb2_grpc.ControlStub(channel).Average(requests(), timeout=15)
            first = await call.read()
            assert first.WhichOneof("kind") == "accepted"
            await daemon.backend.round_began.wait()  # the round began without the inputs
            assert daemon.backend.started == ["early"]
            assert not daemon.backend.rounds  # and waits for them
            segment.results([x.dtype], [x.shape])[0][...] = x
            written.set()
            done = await call.read()
            assert done.WhichOneof("kind") == "done"
            assert done.done.group_size == 1
    finally:
        segment.unlink()
    np.testing.assert_array_equal(daemon.backend.outs[-1][0], x)


async def test_a_daemon_older_than_early_writes_gets_the_inputs_before_the_start(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that predates ``start_before_inputs`` refuses it as a first message; the
    client retries with the inputs written first, and sends only that from then on."""
    from swarmavg.peer.daemon import control

    monkeypatch.setattr(control, "START_KINDS", ("start",))
    x = [np.random.default_rng(5).standard_normal(400_000).astype(np.float32)]
    async with connect_async(daemon.endpoint) as client:
        for key in ("old-1", "old-2"):
            result = await client.average(x, key=key, min_group_size=1)
            np.testing.assert_array_equal(result.tensors[0], x[0])
            assert "client.write" not in result.timings
            del result
        assert client._early_writes.supported is False
    assert [r.key for r in daemon.backend.rounds] == ["old-1", "old-2"]
    assert daemon.backend.failures == ["invalid_input"]  # the one refused start
    assert my_segments() == []


def big_state(seed: int) -> list[np.ndarray]:
    """A state above the shared-memory threshold (2.4 MB in three tensors)."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(np.float32) for s in [(600_000,), (7,), (2, 3)]]


async def test_a_large_state_is_published_through_one_reused_segment(daemon: Daemon) -> None:
    """DESIGN 6.4: tensors above a small threshold go through shared memory, a published
    state too. The daemon maps the client's segment once and keeps the mapping; every
    later publish of the layout is written into the same segment and copied out by the
    daemon before the call returns, so what it serves is never the client's next write."""
    first, second = big_state(1), big_state(2)
    with await asyncio.to_thread(connect, daemon.endpoint) as client:
        await asyncio.to_thread(client.publish_state, first, {"epoch": 1})
        assert len(daemon.backend.segments) == 1, "the state came through a segment"
        assert len(client._publish_segments) == 1, "kept for the next publish"
        metadata, tensors = await asyncio.to_thread(client.load_state, 5.0)
        assert metadata == {"epoch": 1}
        for got, want in zip(tensors, first, strict=True):
            np.testing.assert_array_equal(got, want)
        served = daemon.backend.state
        await asyncio.to_thread(client.publish_state, second, {"epoch": 2})
        assert len(daemon.backend.segments) == 1, "the same segment, reused"
        assert served is not None
        for kept, want in zip(served[1], first, strict=True):  # not written over
            np.testing.assert_array_equal(kept, want)
        _, tensors = await asyncio.to_thread(client.load_state, 5.0)
        for got, want in zip(tensors, second, strict=True):
            np.testing.assert_array_equal(got, want)
        # A small state still travels inline.
        await asyncio.to_thread(client.publish_state, [np.arange(3.0)], {"epoch": 3})
        assert len(daemon.backend.segments) == 1
    assert my_segments() == []


async def test_a_large_state_with_nan_is_refused_before_anything_is_sent(daemon: Daemon) -> None:
    state = big_state(3)
    state[0][123_456] = np.nan
    async with connect_async(daemon.endpoint) as client:
        with pytest.raises(ValidationError, match="NaN"):
            await client.publish_state(state, {"epoch": 1})
        assert len(client._publish_segments) == 0
    assert daemon.backend.state is None
    assert len(daemon.backend.segments) == 0
    assert my_segments() == []


async def test_a_publish_after_the_daemon_lost_its_mapping_sends_a_fresh_segment(
    daemon: Daemon,
) -> None:
    """A restarted daemon (or one that evicted the mapping) does not know the reused
    segment: the client sends the state again in a fresh one, and the caller sees nothing."""
    async with connect_async(daemon.endpoint) as client:
        await client.publish_state(big_state(4), {"epoch": 1})
        daemon.backend.segments.close()  # as if the daemon restarted
        second = big_state(5)
        await client.publish_state(second, {"epoch": 2})
        assert len(daemon.backend.segments) == 1
        _, tensors = await client.load_state(timeout=5)
        np.testing.assert_array_equal(tensors[0], second[0])
    assert daemon.backend.failures == []
    assert my_segments() == []


async def test_a_daemon_older_than_shared_memory_publishes_gets_the_bytes_inline(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that predates the header's segment fields ignores them and waits for the
    tensor bytes: the client sends the state again inline, and inline from then on."""
    original = ControlService.rpc_publish_state

    async def old_daemon(
        self: ControlService, requests: AsyncIterator[control_pb2.StateMessage]
    ) -> control_pb2.PublishStateResponse:
        async def unknown_fields_dropped() -> AsyncIterator[control_pb2.StateMessage]:
            async for message in requests:
                if message.WhichOneof("kind") == "header":
                    for name in ("shm_name", "shm_size", "shm_reuse"):
                        message.header.ClearField(name)
                yield message

        return await original(self, unknown_fields_dropped())

    monkeypatch.setattr(ControlService, "rpc_publish_state", old_daemon)
    states = [big_state(6), big_state(7)]
    async with connect_async(daemon.endpoint) as client:
        for epoch, state in enumerate(states):
            await client.publish_state(state, {"epoch": epoch})
            _, tensors = await client.load_state(timeout=5)
            np.testing.assert_array_equal(tensors[0], state[0])
        assert client._shm_publishes.supported is False
    assert len(daemon.backend.segments) == 0
    assert my_segments() == []


async def test_the_daemon_refuses_a_publish_naming_a_segment_it_cannot_use(daemon: Daemon) -> None:
    """A raw header naming a foreign, missing or mis-sized segment gets INVALID_ARGUMENT
    and the daemon keeps serving."""
    from swarmavg.proto import control_pb2_grpc, tensor_pb2

    spec = control_pb2.TensorSpec(dtype=tensor_pb2.FLOAT32, shape=[600_000])
    headers = [
        control_pb2.StateHeader(tensors=[spec], shm_name="../etc/passwd", shm_size=2_400_000),
        control_pb2.StateHeader(
            tensors=[spec], shm_name=f"swarmavg-{os.getpid()}-{'0' * 32}", shm_size=2_400_000
        ),
        control_pb2.StateHeader(
            tensors=[spec], shm_name=f"swarmavg-{os.getpid()}-{'1' * 32}", shm_reuse=True
        ),
    ]
    async with grpc.aio.insecure_channel(f"unix:{daemon.endpoint}") as channel:
        stub = control_pb2_grpc.ControlStub(channel)  # type: ignore[no-untyped-call]
        for header in headers:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stub.PublishState(iter([control_pb2.StateMessage(header=header)]))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert daemon.backend.state is None
    async with connect_async(daemon.endpoint) as client:
        await client.publish_state(big_state(8), {"epoch": 1})
    assert daemon.backend.state is not None


async def test_without_room_in_shared_memory_calls_go_through_the_socket(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A /dev/shm without room for the tensors (a container's 64 MB one, a large model)
    used to kill the training process with SIGBUS as it wrote them; now a round, a
    publish and a load of a state that does not fit go inline, and they still work."""
    from swarmavg.peer.client import shm

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "posix_fallocate", no_room)  # the client's segments
    monkeypatch.setattr(shm.os, "pwrite", lambda *_: no_room(0, 0, 0))  # the daemon's writes
    monkeypatch.setattr(shm._NoRoom, "warned", False)
    x = [np.random.default_rng(9).standard_normal(400_000).astype(np.float32)]
    async with connect_async(daemon.endpoint) as client:
        result = await client.average(x, key="no-room", min_group_size=1)
        np.testing.assert_array_equal(result.tensors[0], x[0])
        state = big_state(10)
        await client.publish_state(state, {"epoch": 1})
        _, tensors = await client.load_state(timeout=5)
        assert not in_shared_memory(tensors[0]), "the daemon found no room: inline"
        np.testing.assert_array_equal(tensors[0], state[0])
    assert daemon.backend.outs == [None], "the round's inputs came inline"
    assert len(daemon.backend.segments) == 0
    assert my_segments() == []


@pytest.mark.parametrize("blocking", [False, True])
async def test_a_large_loaded_state_comes_through_the_segment_the_client_offered(
    daemon: Daemon, blocking: bool
) -> None:
    """DESIGN 6.4 for ``load_state``: the client offers an empty segment, the daemon writes
    the state there instead of streaming its bytes, and the client maps it. The arrays are
    writable and private (a second load is not changed by writes to the first), and no
    file is left behind."""
    state = big_state(11)
    async with connect_async(daemon.endpoint, use_shm=False) as publisher:
        await publisher.publish_state(state, {"epoch": 4})
    if blocking:
        with await asyncio.to_thread(connect, daemon.endpoint) as client:
            metadata, first = await asyncio.to_thread(client.load_state, 5.0)
            _, second = await asyncio.to_thread(client.load_state, 5.0)
    else:
        async with connect_async(daemon.endpoint) as aclient:
            metadata, first = await aclient.load_state(timeout=5)
            _, second = await aclient.load_state(timeout=5)
    assert metadata == {"epoch": 4}
    assert all(in_shared_memory(t) for t in first), "the tensors came through shared memory"
    first[0][:] = 0.0
    for got, want in zip(second, state, strict=True):
        np.testing.assert_array_equal(got, want)
    assert my_segments() == []


async def test_a_small_loaded_state_and_a_client_without_shared_memory_get_the_bytes(
    daemon: Daemon,
) -> None:
    async with connect_async(daemon.endpoint) as client:
        await client.publish_state([np.arange(5.0)], {"epoch": 1})
        _, tensors = await client.load_state(timeout=5)
        assert not in_shared_memory(tensors[0])
        np.testing.assert_array_equal(tensors[0], np.arange(5.0))
    state = big_state(12)
    async with connect_async(daemon.endpoint, use_shm=False) as client:
        await client.publish_state(state, {"epoch": 2})
        _, tensors = await client.load_state(timeout=5)
        assert not in_shared_memory(tensors[0])
        np.testing.assert_array_equal(tensors[0], state[0])
    assert my_segments() == []


async def test_a_daemon_older_than_load_offers_sends_the_bytes(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that predates the request's ``shm_name`` ignores it and streams the bytes;
    the client takes them and unlinks its unused offer."""
    original = ControlService.rpc_load_state

    def old_daemon(
        self: ControlService, request: control_pb2.LoadStateRequest, context: Any
    ) -> AsyncIterator[control_pb2.StateMessage]:
        request.ClearField("shm_name")
        return original(self, request, context)

    monkeypatch.setattr(ControlService, "rpc_load_state", old_daemon)
    state = big_state(13)
    async with connect_async(daemon.endpoint) as client:
        await client.publish_state(state, {"epoch": 1})
        _, tensors = await client.load_state(timeout=5)
    assert not in_shared_memory(tensors[0])
    np.testing.assert_array_equal(tensors[0], state[0])
    assert my_segments() == []


async def test_the_daemon_checks_an_offered_segment_before_it_writes(daemon: Daemon) -> None:
    """Raw requests: a name that is not a segment's gets INVALID_ARGUMENT; a missing file, a
    file that is not empty and a symbolic link are not written to (the state comes as bytes),
    and the daemon keeps serving."""
    from swarmavg.proto import control_pb2_grpc

    state = big_state(14)
    daemon.backend.state = (b"\x80", state)  # msgpack None
    pid = os.getpid()
    missing = f"swarmavg-{pid}-{'2' * 32}"
    full, link = f"swarmavg-{pid}-{'3' * 32}", f"swarmavg-{pid}-{'4' * 32}"
    target = Path(tempfile.mkdtemp(prefix="sa-")) / "victim"
    target.write_bytes(b"")
    (SHM_DIR / full).write_bytes(b"x" * 10)
    (SHM_DIR / link).symlink_to(target)
    try:
        async with grpc.aio.insecure_channel(f"unix:{daemon.endpoint}") as channel:
            stub = control_pb2_grpc.ControlStub(channel)  # type: ignore[no-untyped-call]
            request = control_pb2.LoadStateRequest(timeout=5, shm_name="../etc/passwd")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [m async for m in stub.LoadState(request)]
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            for name in (missing, full, link):
                request = control_pb2.LoadStateRequest(timeout=5, shm_name=name)
                messages = [m async for m in stub.LoadState(request)]
                assert messages[0].header.shm_name == ""
                assert sum(len(m.data.data) for m in messages[1:]) == sum(a.nbytes for a in state)
        assert (SHM_DIR / full).read_bytes() == b"x" * 10
        assert target.read_bytes() == b""
    finally:
        for name in (full, link):
            (SHM_DIR / name).unlink()
        target.unlink()
        target.parent.rmdir()


def test_a_client_reads_no_segment_it_did_not_offer() -> None:
    """A header naming a segment (another process's, say) the call did not offer is an
    error, not a file the client maps."""
    from swarmavg.peer.client.calls import StateReceiver
    from swarmavg.proto import tensor_pb2

    header = control_pb2.StateHeader(
        tensors=[control_pb2.TensorSpec(dtype=tensor_pb2.FLOAT32, shape=[4])],
        shm_name=f"swarmavg-1-{'5' * 32}",
        shm_size=16,
    )
    with pytest.raises(SwarmError, match="not the one offered"):
        StateReceiver().feed(control_pb2.StateMessage(header=header))
