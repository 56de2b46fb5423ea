from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT8: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT8: DType
UINT8: DType
INT32: DType
INT64: DType

class TensorChunk(_message.Message):
    __slots__ = ("codec", "dtype", "shape", "buffer", "meta", "seq", "num_chunks", "offset", "total_bytes")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    BUFFER_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    codec: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    buffer: bytes
    meta: bytes
    seq: int
    num_chunks: int
    offset: int
    total_bytes: int
    def __init__(self, codec: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., buffer: _Optional[bytes] = ..., meta: _Optional[bytes] = ..., seq: _Optional[int] = ..., num_chunks: _Optional[int] = ..., offset: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...
