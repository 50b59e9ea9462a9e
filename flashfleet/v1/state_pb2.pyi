from flashfleet.v1 import common_pb2 as _common_pb2
from flashfleet.v1 import worker_pb2 as _worker_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerEntry(_message.Message):
    __slots__ = ("worker", "leaving")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    worker: _worker_pb2.RegisterRequest
    leaving: bool
    def __init__(self, worker: _Optional[_Union[_worker_pb2.RegisterRequest, _Mapping]] = ..., leaving: _Optional[bool] = ...) -> None: ...

class PlacementEntry(_message.Message):
    __slots__ = ("worker_id", "coordinator_id", "tokens", "model", "mode", "max_tokens", "seeded")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SEEDED_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    coordinator_id: str
    tokens: int
    model: str
    mode: _common_pb2.DecodeMode
    max_tokens: int
    seeded: bool
    def __init__(self, worker_id: _Optional[str] = ..., coordinator_id: _Optional[str] = ..., tokens: _Optional[int] = ..., model: _Optional[str] = ..., mode: _Optional[_Union[_common_pb2.DecodeMode, str]] = ..., max_tokens: _Optional[int] = ..., seeded: _Optional[bool] = ...) -> None: ...

class MoveEntry(_message.Message):
    __slots__ = ("coordinator_id", "from_worker_id", "to_worker_id", "reason")
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TO_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    coordinator_id: str
    from_worker_id: str
    to_worker_id: str
    reason: str
    def __init__(self, coordinator_id: _Optional[str] = ..., from_worker_id: _Optional[str] = ..., to_worker_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...
