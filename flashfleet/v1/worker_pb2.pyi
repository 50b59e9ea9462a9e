from flashfleet.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeRequest(_message.Message):
    __slots__ = ("subscription_id",)
    SUBSCRIPTION_ID_FIELD_NUMBER: _ClassVar[int]
    subscription_id: str
    def __init__(self, subscription_id: _Optional[str] = ...) -> None: ...

class ResponseBatch(_message.Message):
    __slots__ = ("responses",)
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    responses: _containers.RepeatedCompositeFieldContainer[_common_pb2.GenerateResponse]
    def __init__(self, responses: _Optional[_Iterable[_Union[_common_pb2.GenerateResponse, _Mapping]]] = ...) -> None: ...

class ExportSessionRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class CacheLayout(_message.Message):
    __slots__ = ("part", "layer", "dtype", "key_shape", "value_shape")
    PART_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KEY_SHAPE_FIELD_NUMBER: _ClassVar[int]
    VALUE_SHAPE_FIELD_NUMBER: _ClassVar[int]
    part: str
    layer: int
    dtype: str
    key_shape: _containers.RepeatedScalarFieldContainer[int]
    value_shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, part: _Optional[str] = ..., layer: _Optional[int] = ..., dtype: _Optional[str] = ..., key_shape: _Optional[_Iterable[int]] = ..., value_shape: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionStateHeader(_message.Message):
    __slots__ = ("format_version", "model_fingerprint", "draft_fingerprint", "mode", "token_ids", "positions", "caches", "payload_bytes", "request_id")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CACHES_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    model_fingerprint: str
    draft_fingerprint: str
    mode: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    positions: int
    caches: _containers.RepeatedCompositeFieldContainer[CacheLayout]
    payload_bytes: int
    request_id: str
    def __init__(self, format_version: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., draft_fingerprint: _Optional[str] = ..., mode: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., positions: _Optional[int] = ..., caches: _Optional[_Iterable[_Union[CacheLayout, _Mapping]]] = ..., payload_bytes: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class SessionStateData(_message.Message):
    __slots__ = ("cache", "values", "offset", "data", "crc32")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    cache: int
    values: bool
    offset: int
    data: bytes
    crc32: int
    def __init__(self, cache: _Optional[int] = ..., values: _Optional[bool] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class SessionStateTrailer(_message.Message):
    __slots__ = ("sha256",)
    SHA256_FIELD_NUMBER: _ClassVar[int]
    sha256: bytes
    def __init__(self, sha256: _Optional[bytes] = ...) -> None: ...

class SessionStateChunk(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: SessionStateHeader
    data: SessionStateData
    trailer: SessionStateTrailer
    def __init__(self, header: _Optional[_Union[SessionStateHeader, _Mapping]] = ..., data: _Optional[_Union[SessionStateData, _Mapping]] = ..., trailer: _Optional[_Union[SessionStateTrailer, _Mapping]] = ...) -> None: ...

class PullSessionRequest(_message.Message):
    __slots__ = ("request_id", "source_address")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    source_address: str
    def __init__(self, request_id: _Optional[str] = ..., source_address: _Optional[str] = ...) -> None: ...

class PullSessionResponse(_message.Message):
    __slots__ = ("import_id", "positions", "bytes")
    IMPORT_ID_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    import_id: str
    positions: int
    bytes: int
    def __init__(self, import_id: _Optional[str] = ..., positions: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("active_sessions", "capacity", "free_capacity", "kv_cache_bytes", "kv_budget_bytes", "kv_free_bytes", "prompt_cache_bytes", "sessions", "chip", "peak_memory_bandwidth_bytes_per_s", "decode_profile", "prefill_seconds_per_token", "kv_layers")
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FREE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    CHIP_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BANDWIDTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    DECODE_PROFILE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_LAYERS_FIELD_NUMBER: _ClassVar[int]
    active_sessions: int
    capacity: int
    free_capacity: int
    kv_cache_bytes: int
    kv_budget_bytes: int
    kv_free_bytes: int
    prompt_cache_bytes: int
    sessions: _containers.RepeatedCompositeFieldContainer[SessionLoad]
    chip: str
    peak_memory_bandwidth_bytes_per_s: float
    decode_profile: _containers.RepeatedCompositeFieldContainer[DecodeCost]
    prefill_seconds_per_token: float
    kv_layers: int
    def __init__(self, active_sessions: _Optional[int] = ..., capacity: _Optional[int] = ..., free_capacity: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ..., kv_free_bytes: _Optional[int] = ..., prompt_cache_bytes: _Optional[int] = ..., sessions: _Optional[_Iterable[_Union[SessionLoad, _Mapping]]] = ..., chip: _Optional[str] = ..., peak_memory_bandwidth_bytes_per_s: _Optional[float] = ..., decode_profile: _Optional[_Iterable[_Union[DecodeCost, _Mapping]]] = ..., prefill_seconds_per_token: _Optional[float] = ..., kv_layers: _Optional[int] = ...) -> None: ...

class SessionLoad(_message.Message):
    __slots__ = ("request_id", "context_tokens", "kv_bytes", "tokens_per_s", "speculative_speedup", "remaining_tokens", "kv_bytes_per_position")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    REMAINING_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    context_tokens: int
    kv_bytes: int
    tokens_per_s: float
    speculative_speedup: float
    remaining_tokens: int
    kv_bytes_per_position: int
    def __init__(self, request_id: _Optional[str] = ..., context_tokens: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., speculative_speedup: _Optional[float] = ..., remaining_tokens: _Optional[int] = ..., kv_bytes_per_position: _Optional[int] = ...) -> None: ...

class DecodeCost(_message.Message):
    __slots__ = ("batch_size", "context_tokens", "seconds", "samples")
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    batch_size: int
    context_tokens: int
    seconds: float
    samples: int
    def __init__(self, batch_size: _Optional[int] = ..., context_tokens: _Optional[int] = ..., seconds: _Optional[float] = ..., samples: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("worker_id", "address", "models", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    models: _containers.RepeatedCompositeFieldContainer[_common_pb2.ModelInfo]
    load: WorkerLoad
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., models: _Optional[_Iterable[_Union[_common_pb2.ModelInfo, _Mapping]]] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("lease_id", "lease_ttl_s", "heartbeat_interval_s", "shared_state")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    SHARED_STATE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ttl_s: float
    heartbeat_interval_s: float
    shared_state: bool
    def __init__(self, lease_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., heartbeat_interval_s: _Optional[float] = ..., shared_state: _Optional[bool] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id", "load")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: str
    load: WorkerLoad
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., load: _Optional[_Union[WorkerLoad, _Mapping]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("leave",)
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    leave: bool
    def __init__(self, leave: _Optional[bool] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: str
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CancelRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class CancelResponse(_message.Message):
    __slots__ = ("cancelled",)
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    cancelled: bool
    def __init__(self, cancelled: _Optional[bool] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
