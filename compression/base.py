"""The codec interface: ``encode(array, info) -> TensorChunk``, ``decode(message) -> array``.

A codec is split in two layers. The public ``encode``/``decode`` speak
``tensor_pb2.TensorChunk``. Underneath, ``encode_payload``/``decode_payload`` speak a
:class:`Header` (codec name, dtype, shape, parameters) plus a byte buffer, so that the
all-reduce's wire (``swarmavg.averaging.allreduce.wire``) and the wrapper codecs
(``lossless.py``) can pass payloads around without copying them into protobuf messages.

Messages are self-describing: ``message.codec`` names the codec that produced the
buffer and ``message.meta`` (a msgpack map) holds its parameters, so any peer decodes
any message without knowing how the sender was configured.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import msgpack
import numpy as np

from swarmavg.compression.dtypes import FLOATING, dtype_from_proto, dtype_to_proto, normalize_dtype
from swarmavg.compression.errors import CodecError
from swarmavg.compression.kernels import all_finite
from swarmavg.proto import tensor_pb2

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "MAX_META_BYTES",
    "MAX_NDIM",
    "Codec",
    "CodecInfo",
    "Encoded",
    "Header",
    "Role",
    "parse_header",
    "parse_header_with",
]

Buffer: TypeAlias = bytes | bytearray | memoryview

MAX_NDIM = 32
"""More dimensions than this is an absurd shape."""

DEFAULT_MAX_ELEMENTS = 1 << 28
"""Decoders refuse messages declaring more elements (1 GiB of float32) unless the caller
passes a larger ``max_elements``. The averager decodes chunks of about a MiB; the cap
exists because a top-k message of a few bytes may declare a huge dense shape."""

MAX_META_BYTES = 1 << 16
"""Codec parameters are small (a 256-entry codebook is 1 KiB); anything larger is hostile."""


class Role(enum.Enum):
    """What a tensor is; adaptive codecs choose by it."""

    GRADIENT = "gradient"
    PARAMETER = "parameter"
    OPTIMIZER_STATE = "optimizer_state"
    OTHER = "other"


@dataclass(frozen=True)
class CodecInfo:
    """What the caller knows about the tensor being encoded.

    Attributes:
        key: the tensor's name; stateful codecs (top-k error feedback) keep their state
            per ``(key, part_index)``.
        role: gradient, parameter, optimizer state or other; a string such as
            ``"gradient"`` is accepted and converted.
        part_index: which part of the flattened tensors this is (all-reduce partition).
        part_size: number of elements in that part.
        finite: the caller has already checked that the array holds no NaN/Inf, so the
            codec may skip its own input check (one pass over the data fewer).
        reduced: the array is a reducer's weighted mean of the members' decoded chunks
            (what it returns to them), not a member's own tensor; a codec whose messages
            the mean does not fit (``sparseloco``: the mean of sparse vectors is denser)
            encodes it differently.
    """

    key: str = ""
    role: Role = Role.OTHER
    part_index: int = 0
    part_size: int = 0
    finite: bool = False
    reduced: bool = False

    def __post_init__(self) -> None:
        role: object = self.role
        if not isinstance(role, Role):
            try:
                object.__setattr__(self, "role", Role(role))
            except ValueError:
                names = ", ".join(r.value for r in Role)
                raise ValueError(f"unknown role {role!r}; known: {names}") from None
        if self.part_index < 0 or self.part_size < 0:
            raise ValueError("part_index and part_size must be >= 0")


@dataclass(frozen=True)
class Header:
    """Everything in a message except its payload buffer.

    Attributes:
        codec: registry name of the codec that produced the payload.
        dtype: dtype of the decoded array (native byte order).
        shape: shape of the decoded array.
        meta: codec parameters (msgpack map on the wire).
    """

    codec: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """Number of elements of the decoded array."""
        return math.prod(self.shape)

    def meta_bytes(self) -> bytes:
        """The msgpack encoding of ``meta`` (empty when there are no parameters)."""
        return msgpack.packb(self.meta, use_bin_type=True) if self.meta else b""


@dataclass(frozen=True)
class Encoded:
    """A header plus the payload a codec produced (not yet a protobuf message)."""

    header: Header
    payload: Buffer

    def to_message(self) -> tensor_pb2.TensorChunk:
        """Build one complete (unsplit) TensorChunk."""
        h = self.header
        payload = self.payload if isinstance(self.payload, bytes) else bytes(self.payload)
        return tensor_pb2.TensorChunk(
            codec=h.codec,
            dtype=dtype_to_proto(h.dtype),  # type: ignore[arg-type]
            shape=h.shape,
            buffer=payload,
            meta=h.meta_bytes(),
            seq=0,
            num_chunks=1,
            offset=0,
            total_bytes=len(payload),
        )


def parse_meta(raw: bytes) -> dict[str, Any]:
    """Decode a msgpack parameter map, bounded and type-checked.

    Raises:
        CodecError: oversized, malformed, or not a map with string keys.
    """
    if not raw:
        return {}
    if len(raw) > MAX_META_BYTES:
        raise CodecError(f"codec meta is {len(raw)} bytes, more than {MAX_META_BYTES}")
    try:
        meta = msgpack.unpackb(
            raw, raw=False, strict_map_key=True, max_bin_len=MAX_META_BYTES, use_list=True
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise CodecError(f"codec meta is not valid msgpack: {e}") from None
    if not isinstance(meta, dict):
        raise CodecError(f"codec meta must be a map, got {type(meta).__name__}")
    return meta


def check_shape(shape: tuple[int, ...], max_elements: int) -> None:
    """Reject absurd shapes before anything is allocated for them."""
    if len(shape) > MAX_NDIM:
        raise CodecError(f"shape has {len(shape)} dimensions, more than {MAX_NDIM}")
    for d in shape:
        if d < 0:
            raise CodecError(f"negative dimension in shape {shape}")
    # Multiply stepwise so that a huge product is caught without big-int work.
    n = 1
    for d in shape:
        n *= d
        if n > max_elements:
            raise CodecError(f"shape {shape} has more than {max_elements} elements")


def parse_header(
    message: tensor_pb2.TensorChunk, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> Header:
    """Validate and extract the header of a complete message.

    Raises:
        CodecError: unknown dtype, absurd shape, bad meta, or a message that is one
            piece of a split stream rather than a whole payload.
    """
    return parse_header_with(message, message.buffer, max_elements)


def parse_header_with(
    message: tensor_pb2.TensorChunk, buffer: bytes, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> Header:
    """:func:`parse_header` for a caller that has already read ``message.buffer``.

    Reading a bytes field of a protobuf message copies it every time, so a decoder
    reads it once and passes it here instead of paying a second copy for the length
    check.
    """
    if message.num_chunks > 1 or message.offset != 0 or message.seq != 0:
        raise CodecError(
            f"message is chunk {message.seq} of {message.num_chunks} of a stream; "
            "only whole messages are decoded"
        )
    if message.total_bytes and message.total_bytes != len(buffer):
        raise CodecError(
            f"message declares total_bytes={message.total_bytes} but carries {len(buffer)} bytes"
        )
    if not message.codec:
        raise CodecError("message names no codec")
    shape = tuple(int(d) for d in message.shape)
    check_shape(shape, max_elements)
    return Header(
        codec=message.codec,
        dtype=dtype_from_proto(message.dtype),
        shape=shape,
        meta=parse_meta(message.meta),
    )


class Codec(ABC):
    """A compressor/decompressor for one tensor (or one chunk of a flattened tensor).

    Contract: ``encode`` and ``decode`` are deterministic (the same input gives the same
    bytes; the same bytes decode to bit-identical arrays on every machine, because
    decoding uses only exactly-rounded elementwise arithmetic and table lookups) and
    thread-safe. Codecs with state (top-k) keep it in an explicit, locked state object.
    """

    name: str
    """Registry name; written into every message this codec produces."""

    decodes_finite: bool = False
    """Whether ``decode_payload`` itself refuses payloads that decode to NaN/Inf, so that
    callers checking hostile input need not check its output again."""

    decodes_into_cleanly: bool = False
    """Whether ``decode_payload_into`` checks the whole payload, its values' finiteness
    included, before it writes anything: when it raises, ``out`` is as it was. A caller
    that decodes over values it must keep if the payload is bad (the all-reduce's result
    in place of the caller's tensors) may then decode straight into them."""

    exact: bool = False
    """Whether decoding an encoding gives back the input bit for bit (and encoding has no
    state), so a caller that needs "what the others will decode" of its own array may use
    the array itself instead of decoding its own message."""

    def encode(self, array: np.ndarray, info: CodecInfo | None = None) -> tensor_pb2.TensorChunk:
        """Encode ``array`` into one complete message.

        Raises:
            CodecError: unsupported dtype, or values the codec cannot carry (NaN/Inf).
        """
        return self.encode_payload(array, info if info is not None else CodecInfo()).to_message()

    def decode(
        self, message: tensor_pb2.TensorChunk, *, max_elements: int = DEFAULT_MAX_ELEMENTS
    ) -> np.ndarray:
        """Decode a complete message into an array of its original dtype and shape.

        The returned array is writable and owns (or exclusively references) its memory.

        Raises:
            CodecError: malformed message, or one produced by another codec.
        """
        # One read of the bytes field: each read of it is a copy of the payload.
        buffer = message.buffer
        header = parse_header_with(message, buffer, max_elements)
        if not self.accepts(header.codec):
            raise CodecError(f"codec {self.name!r} cannot decode a {header.codec!r} message")
        return writable(self.decode_payload(header, buffer))

    def accepts(self, codec_name: str) -> bool:
        """Whether this codec decodes messages labelled ``codec_name``."""
        return codec_name == self.name

    @abstractmethod
    def encode_payload(self, array: np.ndarray, info: CodecInfo) -> Encoded:
        """Encode into a header and a payload buffer (no protobuf copy)."""

    @abstractmethod
    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        """Decode a payload whose header was validated by :func:`parse_header`.

        The result may be a read-only view of ``payload`` (``none`` avoids a copy that
        way); :func:`writable` gives an array the caller owns.
        """

    def decode_payload_unchecked(self, header: Header, payload: Buffer) -> tuple[np.ndarray, bool]:
        """Decode as :meth:`decode_payload` does, but leave the NaN/Inf check to a caller
        that reads every value anyway (the all-reduce's mean checks in the pass that
        combines the copies); return the values and whether they were checked.

        Codecs whose decoding checks for free (see :attr:`decodes_finite`) check; ``none``
        returns the payload's bytes as they came, and ``float16`` its words as float16
        values for a float32 header (a narrower dtype that widens exactly: the mean's
        kernel widens them as it adds them, :func:`~swarmavg.compression.native.weighted_sum`).
        """
        return self.decode_payload(header, payload), self.decodes_finite

    def decode_payload_into(self, header: Header, payload: Buffer, out: np.ndarray) -> None:
        """Decode a payload (header validated as for :meth:`decode_payload`) into ``out``.

        For callers that gather many chunks into one buffer: codecs override it to write
        their output there directly instead of into a new array that is then copied.

        Args:
            out: a writable, C-contiguous array of the header's dtype and size (its
                shape may differ). Its contents are unspecified if this raises.

        Raises:
            CodecError: exactly when :meth:`decode_payload` raises.
            ValueError: ``out`` does not have the header's dtype and size.
        """
        check_output(header, out)
        np.copyto(out.reshape(-1), self.decode_payload(header, payload).reshape(-1))

    def encode_payload_and_values(
        self, array: np.ndarray, info: CodecInfo
    ) -> tuple[Encoded, np.ndarray]:
        """Encode ``array`` and also return what decoding that encoding gives.

        Contract: ``encoded`` is exactly what :meth:`encode_payload` returns for the same
        arguments (same header, same payload bytes), with the same side effects on codec
        state (top-k error feedback is updated once). ``values`` is bit for bit the array
        ``decode_payload(encoded.header, encoded.payload)`` would return: same dtype (the
        header's), same shape, same bits. It may be read-only, and it may share memory
        with the input (``exact`` codecs, or a 16-bit float input that is its own
        encoding): the caller must not mutate the input while it still uses ``values``.

        The default encodes, then decodes its own payload (for ``exact`` codecs it
        returns the input itself). Codecs override it to compute the values while
        encoding, without parsing the payload again.

        Args:
            array: the tensor to encode (any shape, a dtype the codec accepts).
            info: what the caller knows about the tensor (see :class:`CodecInfo`).

        Returns:
            ``(encoded, values)``.

        Raises:
            CodecError: exactly when :meth:`encode_payload` raises, or when decoding the
                encoding would raise (e.g. a float16 header dtype that the decoded values
                overflow).
        """
        encoded = self.encode_payload(array, info)
        header = encoded.header
        if self.exact:
            values = np.asarray(array)
            if values.dtype != header.dtype:
                values = values.astype(header.dtype)
            return encoded, values.reshape(header.shape)
        return encoded, self.decode_payload(header, encoded.payload)

    def round_trip(self, array: np.ndarray, info: CodecInfo) -> np.ndarray:
        """What the other members decode from this member's encoding of ``array``.

        Contract: bit-identical to ``decode_payload(*encode_payload(array, info))``
        (dtype, shape and bits), with the same side effects on codec state as one
        :meth:`encode_payload` call (top-k's error feedback is updated exactly as if the
        encoding had been sent). The result may be read-only, and it may share memory
        with ``array`` (see :meth:`encode_payload_and_values`).

        The default calls :meth:`encode_payload_and_values` and drops the encoding;
        codecs override it to skip producing the payload at all.

        Args:
            array: the tensor to pass through the codec.
            info: what the caller knows about the tensor (see :class:`CodecInfo`).

        Raises:
            CodecError: exactly when encoding then decoding would raise.
        """
        return self.encode_payload_and_values(array, info)[1]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


# ---------------------------------------------------------------------------------------
# Helpers shared by the codec implementations.


def as_input(array: np.ndarray, *, floating_only: bool) -> tuple[np.ndarray, np.dtype[Any]]:
    """Validate an input array; return it flattened, C-contiguous, native-endian.

    Non-contiguous inputs are copied once; contiguous ones are viewed.

    Raises:
        CodecError: unsupported dtype (or a non-floating dtype for a lossy codec).
    """
    a = np.asarray(array)
    dtype = normalize_dtype(a.dtype)
    if floating_only and dtype not in FLOATING:
        raise CodecError(
            f"this codec takes float32/float16/bfloat16/float64, got {dtype}; "
            "integers travel through codec 'none'"
        )
    if a.dtype != dtype:
        a = a.astype(dtype)
    return np.ascontiguousarray(a).reshape(-1), dtype


def writable(x: np.ndarray) -> np.ndarray:
    """``x`` itself when it is writable, else a copy (decoded views of received bytes)."""
    return x if x.flags.writeable else x.copy()


def require_finite(x: np.ndarray, what: str) -> None:
    """Raise CodecError naming ``what`` unless every element is finite."""
    if not all_finite(x):
        raise CodecError(f"{what} contains NaN or Inf")


def check_output(header: Header, out: np.ndarray) -> None:
    """Raise ValueError unless ``out`` can receive the header's decoded values in place."""
    if out.dtype != header.dtype or out.size != header.size:
        raise ValueError(
            f"{header.codec}: output must be {header.dtype}[{header.size}], "
            f"got {out.dtype}{list(out.shape)}"
        )
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{header.codec}: output must be C-contiguous and writable")


def check_payload_size(header: Header, payload: Buffer, expected: int) -> None:
    """Raise CodecError unless the payload has exactly ``expected`` bytes."""
    n = len(payload) if not isinstance(payload, memoryview) else payload.nbytes
    if n != expected:
        raise CodecError(
            f"{header.codec}: payload is {n} bytes but shape {header.shape} "
            f"of {header.dtype} needs {expected}"
        )


def meta_int(header: Header, key: str, lo: int, hi: int) -> int:
    """Read an integer parameter within [lo, hi] from the header's meta."""
    v = header.meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CodecError(f"{header.codec}: meta[{key!r}] must be an integer in [{lo}, {hi}]")
    return v


def meta_float(header: Header, key: str) -> float:
    """Read a finite float parameter from the header's meta."""
    v = header.meta.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise CodecError(f"{header.codec}: meta[{key!r}] must be a finite number")
    return float(v)


def meta_array(header: Header, key: str, dtype: type[np.generic], length: int) -> np.ndarray:
    """Read a little-endian array parameter (msgpack bin) of exactly ``length`` items."""
    v = header.meta.get(key)
    d = np.dtype(dtype).newbyteorder("<")
    if not isinstance(v, bytes) or len(v) != length * d.itemsize:
        got = f"{len(v)} bytes" if isinstance(v, bytes) else type(v).__name__
        raise CodecError(
            f"{header.codec}: meta[{key!r}] must hold {length} {d.name} values "
            f"({length * d.itemsize} bytes), got {got}"
        )
    return np.frombuffer(v, dtype=d).astype(dtype)


def restore(flat32: np.ndarray, header: Header) -> np.ndarray:
    """Cast a decoded, finite flat float array to the header's dtype and shape.

    Raises:
        CodecError: a value does not fit the (16-bit) output dtype.
    """
    if flat32.dtype == header.dtype:
        return flat32.reshape(header.shape)
    with np.errstate(over="ignore"):
        out = flat32.astype(header.dtype)
    if out.itemsize == 2 and out.size:
        exp = np.uint16(0x7C00) if out.dtype == np.float16 else np.uint16(0x7F80)
        if np.any((out.view(np.uint16) & exp) == exp):
            raise CodecError(f"{header.codec}: decoded values overflow {header.dtype}")
    return out.reshape(header.shape)
