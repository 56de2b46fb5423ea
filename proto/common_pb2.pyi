from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class RequestHeader(_message.Message):
    __slots__ = ("peer_id", "run_id", "protocol_version", "address", "public_key")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    peer_id: bytes
    run_id: str
    protocol_version: int
    address: str
    public_key: bytes
    def __init__(self, peer_id: _Optional[bytes] = ..., run_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., address: _Optional[str] = ..., public_key: _Optional[bytes] = ...) -> None: ...
