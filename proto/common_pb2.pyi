from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RequestHeader(_message.Message):
    __slots__ = ("peer_id", "run_id", "protocol_version", "address", "public_key", "receiver_id", "method", "timestamp", "nonce", "signature")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    peer_id: bytes
    run_id: str
    protocol_version: int
    address: str
    public_key: bytes
    receiver_id: bytes
    method: str
    timestamp: float
    nonce: bytes
    signature: bytes
    def __init__(self, peer_id: _Optional[bytes] = ..., run_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., address: _Optional[str] = ..., public_key: _Optional[bytes] = ..., receiver_id: _Optional[bytes] = ..., method: _Optional[str] = ..., timestamp: _Optional[float] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...
