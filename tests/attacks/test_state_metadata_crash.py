"""Remote crash of training processes through a donor's state metadata (high).

A state's metadata is msgpack bytes that the joiner's daemon passes on unchanged from
whichever donor published it. ``client.load_state`` decoded them without error handling,
so a donor that publishes, say, ``b"\\xc1"`` made it raise ``msgpack.FormatError``: not a
``SwarmError``, not an ``AveragingError``, so the training wrappers (``SwarmLink.load``
catches ``AveragingError``) let it out and the training process died. Now every decode of
donor bytes on the load path raises :class:`~swarmavg.peer.client.errors.MalformedStateError`
(a ``SwarmError`` and the layer's ``StateDownloadError``) naming what was malformed, and
the daemon keeps serving.

Real in-process daemons on 127.0.0.1 (the attacker publishes through its averager, below
the client's own checks), the async client, the sync client and the training wrappers'
``SwarmLink``; then Hypothesis on the decoders themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from swarmavg.averaging.errors import AveragingError, StateDownloadError
from swarmavg.averaging.state.format import (
    HASH_BYTES,
    Manifest,
    StateFormatError,
    chunk_hash,
    unpack_state,
)
from swarmavg.averaging.training.swarm import SwarmLink, swarm_errors
from swarmavg.peer import Peer, PeerConfig, connect
from swarmavg.peer.client.calls import StateReceiver, unpack_state_metadata
from swarmavg.peer.client.errors import MalformedStateError, SwarmError
from swarmavg.proto import control_pb2

MALFORMED = {
    "never-used byte": b"\xc1",  # msgpack.FormatError
    "extra data": b"\x01\x02",  # msgpack.ExtraData
    "truncated": b"\x92\x01",  # ValueError: incomplete input
    "invalid utf-8": b"\xa3\xff\xfe\xfd",  # UnicodeDecodeError
    "nested too deep": b"\x91" * 3000 + b"\x01",  # msgpack.StackError
    "unhashable key": b"\x81\x91\x01\x02",  # TypeError
    "bad timestamp": b"\xc7\x03\xff\x00\x00\x00",  # ValueError
}


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


def config(sock_dir: Path, name: str, join: str | None = None) -> PeerConfig:
    return PeerConfig(
        listen="127.0.0.1:0",
        control=str(sock_dir / f"{name}.sock"),
        run_id="attack",
        join=[join] if join else [],
    )


def sync_load(endpoint: str) -> tuple[Any, list[np.ndarray]] | BaseException:
    """``connect().load_state`` as a training process calls it (in a thread)."""
    try:
        with connect(endpoint) as client:
            return client.load_state(timeout=30)
    except BaseException as exc:  # the test inspects what came out
        return exc


def wrapper_load(endpoint: str) -> object:
    """What the training wrappers do: ``SwarmLink.load`` (None: no usable state)."""
    with connect(endpoint) as client:
        link = SwarmLink(client, "attack", codec=None, timeout=10.0, min_group_size=1,
                         state_timeout=30.0)  # fmt: skip
        return link.load("collaborative", like=[torch.zeros(4)])


@pytest.mark.timeout(180)
async def test_malformed_metadata_from_a_donor_raises_a_swarm_error(sock_dir: Path) -> None:
    tensors = [np.arange(4, dtype=np.float32)]
    async with Peer(config(sock_dir, "donor")) as donor, donor.client() as publisher:
        assert donor.averager is not None
        assert donor.address
        joiner_config = config(sock_dir, "joiner", join=donor.address)
        async with Peer(joiner_config) as joiner, joiner.client() as trainer:
            # control: an honest donor's metadata decodes
            await publisher.publish_state(tensors, {"epoch": 3})
            metadata, loaded = await trainer.load_state(timeout=30)
            assert metadata == {"epoch": 3}
            np.testing.assert_array_equal(loaded[0], tensors[0])

            for what, blob in MALFORMED.items():  # the attack, below the client's checks
                await donor.averager.publish_state(tensors, blob)
                with pytest.raises(MalformedStateError, match="metadata") as caught:
                    await trainer.load_state(timeout=30)
                assert isinstance(caught.value, SwarmError | StateDownloadError), what
                assert isinstance(caught.value, swarm_errors()), what
            outcome = await asyncio.to_thread(sync_load, joiner_config.control)
            assert isinstance(outcome, MalformedStateError), outcome
            assert await asyncio.to_thread(wrapper_load, joiner_config.control) is None

            # a state without tensors: the client refuses the layout, as a state error
            await donor.averager.publish_state([], msgpack.packb({"epoch": 1}))
            with pytest.raises(MalformedStateError, match="layout"):
                await trainer.load_state(timeout=30)

            # the daemon kept serving: the same client loads the next honest state (whose
            # int map keys now round-trip too, as through the daemon's other calls)
            await publisher.publish_state(tensors, {"epoch": 4, 0: "int key"})
            metadata, loaded = await trainer.load_state(timeout=30)
            assert metadata == {"epoch": 4, 0: "int key"}
            np.testing.assert_array_equal(loaded[0], tensors[0])
            assert (await trainer.status())["run_id"] == "attack"


# ---------------------------------------------------------------------- the decoders

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.text(max_size=8) | st.integers(-5, 5), inner, max_size=5)
    ),
    max_leaves=30,
)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=300))
def test_metadata_decode_of_any_bytes_returns_or_raises_malformed(data: bytes) -> None:
    try:
        unpack_state_metadata(data)
    except MalformedStateError as exc:
        message = str(exc)
    else:
        return
    assert "metadata" in message


@settings(max_examples=300, deadline=None)
@given(msgpack_values, st.binary(max_size=8), st.integers(0, 64))
def test_metadata_decode_of_damaged_msgpack_returns_or_raises_malformed(
    value: object, noise: bytes, cut: int
) -> None:
    packed = msgpack.packb(value, use_bin_type=True)
    assert unpack_state_metadata(packed) == value  # honest metadata round-trips
    for damaged in (packed[:cut], packed + noise, noise + packed[cut:]):
        with contextlib.suppress(MalformedStateError):
            unpack_state_metadata(damaged)


def manifest_of(header: bytes, extra: list[bytes]) -> tuple[Manifest, dict[bytes, bytes]]:
    """A manifest for a header chunk and data chunks (roots are not checked here: the
    chunks are the donor's, verified against the manifest it sent)."""
    pieces = [header or b"\x00", *extra]
    hashes = tuple(chunk_hash(p) for p in pieces)
    sizes = tuple(len(p) for p in pieces)
    chunk_size = max(sizes)
    manifest = Manifest(b"\x00" * HASH_BYTES, 1.0, chunk_size, 1, hashes, sizes)
    return manifest, dict(zip(hashes, pieces, strict=True))


dims = st.integers(min_value=-(2**63), max_value=2**64 - 1) | st.sampled_from([0, 1, 2, 4])
dtype_names = (
    st.sampled_from(["float32", "int64", "bool", "bfloat16", "object", "", "<f4"])
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.none()
    | st.binary(max_size=4)
)
specs = st.lists(st.tuples(dtype_names, st.lists(dims, max_size=70)).map(list) | msgpack_values,
                 max_size=4)  # fmt: skip


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs, st.binary(max_size=16), st.lists(st.binary(min_size=1, max_size=32), max_size=3))
@example([["float32", [0, 2**63]]], b"", [])  # zero bytes, a dimension numpy cannot hold
@example([["float32", [1] * 70]], b"", [b"\x00" * 4])  # more dimensions than numpy has
@example([["float32", [0] * 40]], b"", [])
def test_state_header_decode_returns_or_raises_state_format_error(
    tensor_specs: list[Any], metadata: bytes, data: list[bytes]
) -> None:
    header = msgpack.packb({"v": 1, "metadata": metadata, "tensors": tensor_specs})
    manifest, chunks = manifest_of(header, data)
    try:
        _, tensors = unpack_state(manifest, chunks)
    except StateFormatError:
        return
    assert sum(t.nbytes for t in tensors) <= manifest.total_bytes
    assert all(t.ndim <= 32 and math.prod(t.shape) >= 0 for t in tensors)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_state_header_of_any_bytes_returns_or_raises_state_format_error(header: bytes) -> None:
    manifest, chunks = manifest_of(header, [])
    with contextlib.suppress(StateFormatError):
        unpack_state(manifest, chunks)


def test_a_layout_the_client_refuses_is_a_malformed_state() -> None:
    receiver = StateReceiver()
    empty = control_pb2.StateHeader(metadata=msgpack.packb({}), tensors=[])
    with pytest.raises(MalformedStateError, match="layout"):
        receiver.feed(control_pb2.StateMessage(header=empty))
    assert issubclass(MalformedStateError, AveragingError)
