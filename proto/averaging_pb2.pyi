from swarmavg.proto import common_pb2 as _common_pb2
from swarmavg.proto import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOIN_CODE_UNSPECIFIED: _ClassVar[JoinCode]
    JOIN_ACCEPTED: _ClassVar[JoinCode]
    JOIN_GROUP_FORMED: _ClassVar[JoinCode]
    JOIN_REDIRECT: _ClassVar[JoinCode]
    JOIN_DISBANDED: _ClassVar[JoinCode]
    JOIN_REJECT_NOT_LOOKING: _ClassVar[JoinCode]
    JOIN_REJECT_NOT_LEADER: _ClassVar[JoinCode]
    JOIN_REJECT_FULL: _ClassVar[JoinCode]
    JOIN_REJECT_SCHEMA_MISMATCH: _ClassVar[JoinCode]
    JOIN_REJECT_BAD_REQUEST: _ClassVar[JoinCode]
    JOIN_REJECT_AGGREGATION_MISMATCH: _ClassVar[JoinCode]

class StateCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_CODE_UNSPECIFIED: _ClassVar[StateCode]
    STATE_OK: _ClassVar[StateCode]
    STATE_NOT_FOUND: _ClassVar[StateCode]
    STATE_BAD_REQUEST: _ClassVar[StateCode]
    STATE_BUSY: _ClassVar[StateCode]
JOIN_CODE_UNSPECIFIED: JoinCode
JOIN_ACCEPTED: JoinCode
JOIN_GROUP_FORMED: JoinCode
JOIN_REDIRECT: JoinCode
JOIN_DISBANDED: JoinCode
JOIN_REJECT_NOT_LOOKING: JoinCode
JOIN_REJECT_NOT_LEADER: JoinCode
JOIN_REJECT_FULL: JoinCode
JOIN_REJECT_SCHEMA_MISMATCH: JoinCode
JOIN_REJECT_BAD_REQUEST: JoinCode
JOIN_REJECT_AGGREGATION_MISMATCH: JoinCode
STATE_CODE_UNSPECIFIED: StateCode
STATE_OK: StateCode
STATE_NOT_FOUND: StateCode
STATE_BAD_REQUEST: StateCode
STATE_BUSY: StateCode

class JoinRequest(_message.Message):
    __slots__ = ("header", "key", "schema_hash", "mode", "bandwidth", "user_data", "declared_start", "data_port", "aggregation", "signed_answers", "deadline", "give_up", "group_size", "codec")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_HASH_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    USER_DATA_FIELD_NUMBER: _ClassVar[int]
    DECLARED_START_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    SIGNED_ANSWERS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    GIVE_UP_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    key: str
    schema_hash: bytes
    mode: int
    bandwidth: float
    user_data: bytes
    declared_start: float
    data_port: int
    aggregation: str
    signed_answers: bool
    deadline: float
    give_up: float
    group_size: int
    codec: str
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., key: _Optional[str] = ..., schema_hash: _Optional[bytes] = ..., mode: _Optional[int] = ..., bandwidth: _Optional[float] = ..., user_data: _Optional[bytes] = ..., declared_start: _Optional[float] = ..., data_port: _Optional[int] = ..., aggregation: _Optional[str] = ..., signed_answers: _Optional[bool] = ..., deadline: _Optional[float] = ..., give_up: _Optional[float] = ..., group_size: _Optional[int] = ..., codec: _Optional[str] = ...) -> None: ...

class GroupMember(_message.Message):
    __slots__ = ("peer_id", "address", "mode", "bandwidth", "user_data", "data_port")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    USER_DATA_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    peer_id: bytes
    address: str
    mode: int
    bandwidth: float
    user_data: bytes
    data_port: int
    def __init__(self, peer_id: _Optional[bytes] = ..., address: _Optional[str] = ..., mode: _Optional[int] = ..., bandwidth: _Optional[float] = ..., user_data: _Optional[bytes] = ..., data_port: _Optional[int] = ...) -> None: ...

class GroupDescription(_message.Message):
    __slots__ = ("group_id", "members", "schema_hash", "codec", "aggregation")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_HASH_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    group_id: bytes
    members: _containers.RepeatedCompositeFieldContainer[GroupMember]
    schema_hash: bytes
    codec: str
    aggregation: str
    def __init__(self, group_id: _Optional[bytes] = ..., members: _Optional[_Iterable[_Union[GroupMember, _Mapping]]] = ..., schema_hash: _Optional[bytes] = ..., codec: _Optional[str] = ..., aggregation: _Optional[str] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("code", "leader_id", "leader_address", "deadline", "group", "detail", "taken", "header", "member_requests")
    CODE_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    TAKEN_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    MEMBER_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    code: JoinCode
    leader_id: bytes
    leader_address: str
    deadline: float
    group: GroupDescription
    detail: str
    taken: _containers.RepeatedScalarFieldContainer[bytes]
    header: _common_pb2.RequestHeader
    member_requests: _containers.RepeatedCompositeFieldContainer[JoinRequest]
    def __init__(self, code: _Optional[_Union[JoinCode, str]] = ..., leader_id: _Optional[bytes] = ..., leader_address: _Optional[str] = ..., deadline: _Optional[float] = ..., group: _Optional[_Union[GroupDescription, _Mapping]] = ..., detail: _Optional[str] = ..., taken: _Optional[_Iterable[bytes]] = ..., header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., member_requests: _Optional[_Iterable[_Union[JoinRequest, _Mapping]]] = ...) -> None: ...

class ReduceRequest(_message.Message):
    __slots__ = ("header", "chunk", "group_id", "part_index", "weight", "chunk_index", "stream_key", "mac", "resume", "stripe", "stripes")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PART_INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    STREAM_KEY_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    STRIPE_FIELD_NUMBER: _ClassVar[int]
    STRIPES_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    chunk: _tensor_pb2.TensorChunk
    group_id: bytes
    part_index: int
    weight: float
    chunk_index: int
    stream_key: bytes
    mac: bytes
    resume: bytes
    stripe: int
    stripes: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., group_id: _Optional[bytes] = ..., part_index: _Optional[int] = ..., weight: _Optional[float] = ..., chunk_index: _Optional[int] = ..., stream_key: _Optional[bytes] = ..., mac: _Optional[bytes] = ..., resume: _Optional[bytes] = ..., stripe: _Optional[int] = ..., stripes: _Optional[int] = ...) -> None: ...

class ReduceResponse(_message.Message):
    __slots__ = ("chunk", "chunk_index", "num_senders", "num_adjusted", "weights_clipped", "header", "stream_key", "mac", "end", "stripes")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_SENDERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ADJUSTED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_CLIPPED_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    STREAM_KEY_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STRIPES_FIELD_NUMBER: _ClassVar[int]
    chunk: _tensor_pb2.TensorChunk
    chunk_index: int
    num_senders: int
    num_adjusted: int
    weights_clipped: int
    header: _common_pb2.RequestHeader
    stream_key: bytes
    mac: bytes
    end: str
    stripes: int
    def __init__(self, chunk: _Optional[_Union[_tensor_pb2.TensorChunk, _Mapping]] = ..., chunk_index: _Optional[int] = ..., num_senders: _Optional[int] = ..., num_adjusted: _Optional[int] = ..., weights_clipped: _Optional[int] = ..., header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., stream_key: _Optional[bytes] = ..., mac: _Optional[bytes] = ..., end: _Optional[str] = ..., stripes: _Optional[int] = ...) -> None: ...

class StateManifest(_message.Message):
    __slots__ = ("root", "version", "chunk_size", "header_chunks", "chunk_hashes", "chunk_sizes")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEADER_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_SIZES_FIELD_NUMBER: _ClassVar[int]
    root: bytes
    version: float
    chunk_size: int
    header_chunks: int
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    chunk_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, root: _Optional[bytes] = ..., version: _Optional[float] = ..., chunk_size: _Optional[int] = ..., header_chunks: _Optional[int] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ..., chunk_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class StateRequest(_message.Message):
    __slots__ = ("header", "root", "want_manifest", "chunk_hashes")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    WANT_MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASHES_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    root: bytes
    want_manifest: bool
    chunk_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., root: _Optional[bytes] = ..., want_manifest: _Optional[bool] = ..., chunk_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class StateResponse(_message.Message):
    __slots__ = ("code", "manifest", "chunk_hash", "chunk_data", "detail")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_HASH_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DATA_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    code: StateCode
    manifest: StateManifest
    chunk_hash: bytes
    chunk_data: bytes
    detail: str
    def __init__(self, code: _Optional[_Union[StateCode, str]] = ..., manifest: _Optional[_Union[StateManifest, _Mapping]] = ..., chunk_hash: _Optional[bytes] = ..., chunk_data: _Optional[bytes] = ..., detail: _Optional[str] = ...) -> None: ...
