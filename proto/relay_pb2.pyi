from swarmavg.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DialBackRequest(_message.Message):
    __slots__ = ("header", "port", "token")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    port: int
    token: bytes
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., port: _Optional[int] = ..., token: _Optional[bytes] = ...) -> None: ...

class DialBackResponse(_message.Message):
    __slots__ = ("reachable", "observed_host", "detail")
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_HOST_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    reachable: bool
    observed_host: str
    detail: str
    def __init__(self, reachable: _Optional[bool] = ..., observed_host: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("token", "header")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    header: _common_pb2.RequestHeader
    def __init__(self, token: _Optional[bytes] = ..., header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: bytes
    def __init__(self, token: _Optional[bytes] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("header", "ports")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    ports: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., ports: _Optional[int] = ...) -> None: ...

class RelayEvent(_message.Message):
    __slots__ = ("reserved", "incoming")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    INCOMING_FIELD_NUMBER: _ClassVar[int]
    reserved: Reserved
    incoming: Incoming
    def __init__(self, reserved: _Optional[_Union[Reserved, _Mapping]] = ..., incoming: _Optional[_Union[Incoming, _Mapping]] = ...) -> None: ...

class Reserved(_message.Message):
    __slots__ = ("relay_id", "relay_host", "ports", "splice_port")
    RELAY_ID_FIELD_NUMBER: _ClassVar[int]
    RELAY_HOST_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    SPLICE_PORT_FIELD_NUMBER: _ClassVar[int]
    relay_id: bytes
    relay_host: str
    ports: _containers.RepeatedScalarFieldContainer[int]
    splice_port: int
    def __init__(self, relay_id: _Optional[bytes] = ..., relay_host: _Optional[str] = ..., ports: _Optional[_Iterable[int]] = ..., splice_port: _Optional[int] = ...) -> None: ...

class Incoming(_message.Message):
    __slots__ = ("connection_id", "index", "dialer")
    CONNECTION_ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DIALER_FIELD_NUMBER: _ClassVar[int]
    connection_id: bytes
    index: int
    dialer: str
    def __init__(self, connection_id: _Optional[bytes] = ..., index: _Optional[int] = ..., dialer: _Optional[str] = ...) -> None: ...

class PunchRequest(_message.Message):
    __slots__ = ("header", "session", "index", "address", "start_in_ms")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    START_IN_MS_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    session: bytes
    index: int
    address: str
    start_in_ms: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., session: _Optional[bytes] = ..., index: _Optional[int] = ..., address: _Optional[str] = ..., start_in_ms: _Optional[int] = ...) -> None: ...

class PunchResponse(_message.Message):
    __slots__ = ("address", "start_in_ms", "data_port")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    START_IN_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    address: str
    start_in_ms: int
    data_port: int
    def __init__(self, address: _Optional[str] = ..., start_in_ms: _Optional[int] = ..., data_port: _Optional[int] = ...) -> None: ...
