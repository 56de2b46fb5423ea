from swarmavg.proto import common_pb2 as _common_pb2
from swarmavg.proto import tensor_pb2 as _tensor_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReduceRequest(_message.Message):
    __slots__ = ("header", "chunk", "group_id", "part_index", "weight", "chunk_index")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    chunk: _tensor_pb2.TensorChunk
    group_id: bytes
    part_index: int
    weight: float
    chunk_index: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., group_id: _Optional[bytes] = ..., part_index: _Optional[int] = ..., weight: _Optional[float] = ..., chunk_index: _Optional[int] = ...) -> None: ...

class ReduceResponse(_message.Message):
    __slots__ = ("chunk", "chunk_index", "num_senders")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SENDERS_FIELD_NUMBER: _ClassVar[int]
    chunk: _tensor_pb2.TensorChunk
    chunk_index: int
    num_senders: int
    def __init__(self, chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., chunk_index: _Optional[int] = ..., num_senders: _Optional[int] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("header",)
    HEADER_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ...) -> None: ...

class StateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
