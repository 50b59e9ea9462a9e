from flashfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutApiKeyRequest(_message.Message):
    __slots__ = ("sha256", "role")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    role: str
    def __init__(self, sha256: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class PutApiKeyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteApiKeyRequest(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    def __init__(self, sha256: _Optional[str] = ...) -> None: ...

class DeleteApiKeyResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainWorkerRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    def __init__(self, worker_id: _Optional[str] = ...) -> None: ...

class DrainProgress(_message.Message):
    __slots__ = ("worker_id", "sessions_left", "moved", "state")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_LEFT_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    sessions_left: int
    moved: int
    state: str
    def __init__(self, worker_id: _Optional[str] = ..., sessions_left: _Optional[int] = ..., moved: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class MoveSessionRequest(_message.Message):
    __slots__ = ("request_id", "to_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TO_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    to_worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., to_worker_id: _Optional[str] = ...) -> None: ...

class MoveSessionResponse(_message.Message):
    __slots__ = ("request_id", "from_worker_id", "to_worker_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TO_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    from_worker_id: str
    to_worker_id: str
    def __init__(self, request_id: _Optional[str] = ..., from_worker_id: _Optional[str] = ..., to_worker_id: _Optional[str] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServedModel(_message.Message):
    __slots__ = ("info", "worker_ids", "modes")
    INFO_FIELD_NUMBER: _ClassVar[int]
    WORKER_IDS_FIELD_NUMBER: _ClassVar[int]
    MODES_FIELD_NUMBER: _ClassVar[int]
    info: _common_pb2.ModelInfo
    worker_ids: _containers.RepeatedScalarFieldContainer[str]
    modes: _containers.RepeatedScalarFieldContainer[_common_pb2.DecodeMode]
    def __init__(self, info: _Optional[_Union[_common_pb2.ModelInfo, _Mapping]] = ..., worker_ids: _Optional[_Iterable[str]] = ..., modes: _Optional[_Iterable[_Union[_common_pb2.DecodeMode, str]]] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ServedModel]
    def __init__(self, models: _Optional[_Iterable[_Union[ServedModel, _Mapping]]] = ...) -> None: ...

class GetClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "address", "models", "active_sessions", "capacity", "kv_cache_bytes", "heartbeat_age_s", "served_requests", "unreachable", "kv_budget_bytes", "kv_free_bytes", "prompt_cache_bytes", "draining", "chip", "peak_memory_bandwidth_bytes_per_s")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    SERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    CHIP_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    models: _containers.RepeatedCompositeFieldContainer[_common_pb2.ModelInfo]
    active_sessions: int
    capacity: int
    kv_cache_bytes: int
    heartbeat_age_s: float
    served_requests: int
    unreachable: bool
    kv_budget_bytes: int
    kv_free_bytes: int
    prompt_cache_bytes: int
    draining: bool
    chip: str
    peak_memory_bandwidth_bytes_per_s: float
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., models: _Optional[_Iterable[_Union[_common_pb2.ModelInfo, _Mapping]]] = ..., active_sessions: _Optional[int] = ..., capacity: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ..., served_requests: _Optional[int] = ..., unreachable: _Optional[bool] = ..., kv_budget_bytes: _Optional[int] = ..., kv_free_bytes: _Optional[int] = ..., prompt_cache_bytes: _Optional[int] = ..., draining: _Optional[bool] = ..., chip: _Optional[str] = ..., peak_memory_bandwidth_bytes_per_s: _Optional[float] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("workers", "sessions")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    sessions: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., sessions: _Optional[int] = ...) -> None: ...
