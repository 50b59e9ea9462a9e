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
    __slots__ = ("worker_id", "coordinator_id", "tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    coordinator_id: str
    tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., coordinator_id: _Optional[str] = ..., tokens: _Optional[int] = ...) -> None: ...
