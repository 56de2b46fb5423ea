from swarmavg.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STORE_STATUS_UNSPECIFIED: _ClassVar[StoreStatus]
    STORE_STATUS_STORED: _ClassVar[StoreStatus]
    STORE_STATUS_OUTDATED: _ClassVar[StoreStatus]
    STORE_STATUS_EXPIRED: _ClassVar[StoreStatus]
    STORE_STATUS_FULL: _ClassVar[StoreStatus]
    STORE_STATUS_NOT_NEAREST: _ClassVar[StoreStatus]
STORE_STATUS_UNSPECIFIED: StoreStatus
STORE_STATUS_STORED: StoreStatus
STORE_STATUS_OUTDATED: StoreStatus
STORE_STATUS_EXPIRED: StoreStatus
STORE_STATUS_FULL: StoreStatus
STORE_STATUS_NOT_NEAREST: StoreStatus

class PeerInfo(_message.Message):
    __slots__ = ("peer_id", "address")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    peer_id: bytes
    address: str
    def __init__(self, peer_id: _Optional[bytes] = ..., address: _Optional[str] = ...) -> None: ...

class Record(_message.Message):
    __slots__ = ("key", "subkey", "value", "expiration", "public_key", "signature", "issued")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SUBKEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPIRATION_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    ISSUED_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    subkey: bytes
    value: bytes
    expiration: float
    public_key: bytes
    signature: bytes
    issued: float
    def __init__(self, key: _Optional[bytes] = ..., subkey: _Optional[bytes] = ..., value: _Optional[bytes] = ..., expiration: _Optional[float] = ..., public_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., issued: _Optional[float] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("header", "address_signature")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    address_signature: bytes
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., address_signature: _Optional[bytes] = ...) -> None: ...

class PingResponse(_message.Message):
    __slots__ = ("header", "address_signature")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    address_signature: bytes
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., address_signature: _Optional[bytes] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("header", "address_signature", "records", "cache")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    address_signature: bytes
    records: _containers.RepeatedCompositeFieldContainer[Record]
    cache: bool
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., address_signature: _Optional[bytes] = ..., records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., cache: _Optional[bool] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("header", "statuses", "address_signature")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    statuses: _containers.RepeatedScalarFieldContainer[StoreStatus]
    address_signature: bytes
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., statuses: _Optional[_Iterable[_Union[StoreStatus, str]]] = ..., address_signature: _Optional[bytes] = ...) -> None: ...

class FindRequest(_message.Message):
    __slots__ = ("header", "address_signature", "key_ids", "k", "want_values", "store", "replication")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KEY_IDS_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    WANT_VALUES_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    REPLICATION_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    address_signature: bytes
    key_ids: _containers.RepeatedScalarFieldContainer[bytes]
    k: int
    want_values: bool
    store: _containers.RepeatedCompositeFieldContainer[Record]
    replication: int
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., address_signature: _Optional[bytes] = ..., key_ids: _Optional[_Iterable[bytes]] = ..., k: _Optional[int] = ..., want_values: _Optional[bool] = ..., store: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., replication: _Optional[int] = ...) -> None: ...

class FindResult(_message.Message):
    __slots__ = ("records", "nearest")
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    NEAREST_FIELD_NUMBER: _ClassVar[int]
    records: _containers.RepeatedCompositeFieldContainer[Record]
    nearest: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    def __init__(self, records: _Optional[_Iterable[_Union[Record, _Mapping]]] = ..., nearest: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ...) -> None: ...

class FindResponse(_message.Message):
    __slots__ = ("header", "results", "store_statuses", "address_signature")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    STORE_STATUSES_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    header: _common_pb2.RequestHeader
    results: _containers.RepeatedCompositeFieldContainer[FindResult]
    store_statuses: _containers.RepeatedScalarFieldContainer[StoreStatus]
    address_signature: bytes
    def __init__(self, header: _Optional[_Union[_common_pb2.RequestHeader, _Mapping]] = ..., results: _Optional[_Iterable[_Union[FindResult, _Mapping]]] = ..., store_statuses: _Optional[_Iterable[_Union[StoreStatus, str]]] = ..., address_signature: _Optional[bytes] = ...) -> None: ...
