from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class JoinRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation", "devices", "host", "preferred_rank", "pid", "declared", "relay_port", "relay_cert", "join_key")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    DECLARED_FIELD_NUMBER: _ClassVar[int]
    RELAY_PORT_FIELD_NUMBER: _ClassVar[int]
    RELAY_CERT_FIELD_NUMBER: _ClassVar[int]
    JOIN_KEY_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    host: str
    preferred_rank: int
    pid: int
    declared: _containers.RepeatedCompositeFieldContainer[VariableInfo]
    relay_port: int
    relay_cert: bytes
    join_key: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., host: _Optional[str] = ..., preferred_rank: _Optional[int] = ..., pid: _Optional[int] = ..., declared: _Optional[_Iterable[_Union[VariableInfo, _Mapping]]] = ..., relay_port: _Optional[int] = ..., relay_cert: _Optional[bytes] = ..., join_key: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("rank", "num_workers", "chief_incarnation", "secret")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    rank: int
    num_workers: int
    chief_incarnation: str
    secret: str
    def __init__(self, rank: _Optional[int] = ..., num_workers: _Optional[int] = ..., chief_incarnation: _Optional[str] = ..., secret: _Optional[str] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("rank", "worker_id", "host", "devices", "incarnation", "parent", "relay_address", "relay_cert", "parent_b")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    RELAY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RELAY_CERT_FIELD_NUMBER: _ClassVar[int]
    PARENT_B_FIELD_NUMBER: _ClassVar[int]
    rank: int
    worker_id: str
    host: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    incarnation: str
    parent: int
    relay_address: str
    relay_cert: bytes
    parent_b: int
    def __init__(self, rank: _Optional[int] = ..., worker_id: _Optional[str] = ..., host: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., incarnation: _Optional[str] = ..., parent: _Optional[int] = ..., relay_address: _Optional[str] = ..., relay_cert: _Optional[bytes] = ..., parent_b: _Optional[int] = ...) -> None: ...

class GroupInfo(_message.Message):
    __slots__ = ("group_key", "devices")
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    group_key: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_key: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ...) -> None: ...

class VariableInfo(_message.Message):
    __slots__ = ("name", "shape", "dtype", "synchronization", "aggregation", "trainable", "group_key", "instance_key", "offset", "nbytes", "digest")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONIZATION_FIELD_NUMBER: _ClassVar[int]
    AGGREGATION_FIELD_NUMBER: _ClassVar[int]
    TRAINABLE_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_KEY_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    synchronization: str
    aggregation: str
    trainable: bool
    group_key: int
    instance_key: int
    offset: int
    nbytes: int
    digest: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ..., synchronization: _Optional[str] = ..., aggregation: _Optional[str] = ..., trainable: _Optional[bool] = ..., group_key: _Optional[int] = ..., instance_key: _Optional[int] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("chief_incarnation", "num_workers", "workers", "groups", "variables", "total_bytes", "chunk_bytes", "manifest_digest", "model", "shm_socket", "shm_secret", "topology", "chunk_digests", "shard", "digests_follow")
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHM_SOCKET_FIELD_NUMBER: _ClassVar[int]
    SHM_SECRET_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FOLLOW_FIELD_NUMBER: _ClassVar[int]
    chief_incarnation: str
    num_workers: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    groups: _containers.RepeatedCompositeFieldContainer[GroupInfo]
    variables: _containers.RepeatedCompositeFieldContainer[VariableInfo]
    total_bytes: int
    chunk_bytes: int
    manifest_digest: str
    model: str
    shm_socket: str
    shm_secret: str
    topology: str
    chunk_digests: _containers.RepeatedScalarFieldContainer[str]
    shard: ShardInfo
    digests_follow: bool
    def __init__(self, chief_incarnation: _Optional[str] = ..., num_workers: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[GroupInfo, _Mapping]]] = ..., variables: _Optional[_Iterable[_Union[VariableInfo, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., manifest_digest: _Optional[str] = ..., model: _Optional[str] = ..., shm_socket: _Optional[str] = ..., shm_secret: _Optional[str] = ..., topology: _Optional[str] = ..., chunk_digests: _Optional[_Iterable[str]] = ..., shard: _Optional[_Union[ShardInfo, _Mapping]] = ..., digests_follow: _Optional[bool] = ...) -> None: ...

class ShardInfo(_message.Message):
    __slots__ = ("index", "world", "pieces", "model_manifest_digest", "model_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WORLD_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    MODEL_MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    world: int
    pieces: _containers.RepeatedCompositeFieldContainer[ShardPiece]
    model_manifest_digest: str
    model_bytes: int
    def __init__(self, index: _Optional[int] = ..., world: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[ShardPiece, _Mapping]]] = ..., model_manifest_digest: _Optional[str] = ..., model_bytes: _Optional[int] = ...) -> None: ...

class ShardPiece(_message.Message):
    __slots__ = ("shape", "row_start", "row_stop", "placement")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_STOP_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    row_start: int
    row_stop: int
    placement: str
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., row_start: _Optional[int] = ..., row_stop: _Optional[int] = ..., placement: _Optional[str] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("data", "total_bytes", "worker")
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    total_bytes: int
    worker: WorkerRef
    def __init__(self, data: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., worker: _Optional[_Union[WorkerRef, _Mapping]] = ...) -> None: ...

class WorkerRef(_message.Message):
    __slots__ = ("worker_id", "incarnation", "resume_from", "want_digests", "secret", "stop_at", "chunk_stride", "chunk_phase", "newer_than", "delta_from")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    WANT_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_STRIDE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_PHASE_FIELD_NUMBER: _ClassVar[int]
    NEWER_THAN_FIELD_NUMBER: _ClassVar[int]
    DELTA_FROM_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    resume_from: int
    want_digests: bool
    secret: str
    stop_at: int
    chunk_stride: int
    chunk_phase: int
    newer_than: int
    delta_from: int
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., resume_from: _Optional[int] = ..., want_digests: _Optional[bool] = ..., secret: _Optional[str] = ..., stop_at: _Optional[int] = ..., chunk_stride: _Optional[int] = ..., chunk_phase: _Optional[int] = ..., newer_than: _Optional[int] = ..., delta_from: _Optional[int] = ...) -> None: ...

class StreamEnd(_message.Message):
    __slots__ = ("total_bytes", "manifest_digest")
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    total_bytes: int
    manifest_digest: str
    def __init__(self, total_bytes: _Optional[int] = ..., manifest_digest: _Optional[str] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("offset", "data", "group_key", "instance_keys", "end", "digest")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_KEYS_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    group_key: int
    instance_keys: _containers.RepeatedScalarFieldContainer[int]
    end: StreamEnd
    digest: str
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., group_key: _Optional[int] = ..., instance_keys: _Optional[_Iterable[int]] = ..., end: _Optional[_Union[StreamEnd, _Mapping]] = ..., digest: _Optional[str] = ...) -> None: ...

class DeviceDigests(_message.Message):
    __slots__ = ("device", "replica", "chunk_digests")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    device: str
    replica: int
    chunk_digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, device: _Optional[str] = ..., replica: _Optional[int] = ..., chunk_digests: _Optional[_Iterable[str]] = ...) -> None: ...

class ReadyRequest(_message.Message):
    __slots__ = ("worker", "worker_digest", "devices")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WORKER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerRef
    worker_digest: str
    devices: _containers.RepeatedCompositeFieldContainer[DeviceDigests]
    def __init__(self, worker: _Optional[_Union[WorkerRef, _Mapping]] = ..., worker_digest: _Optional[str] = ..., devices: _Optional[_Iterable[_Union[DeviceDigests, _Mapping]]] = ...) -> None: ...

class ReadyReply(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: int
    def __init__(self, ready: _Optional[int] = ...) -> None: ...

class PreparedReply(_message.Message):
    __slots__ = ("prepared",)
    PREPARED_FIELD_NUMBER: _ClassVar[int]
    prepared: int
    def __init__(self, prepared: _Optional[int] = ...) -> None: ...

class StartReply(_message.Message):
    __slots__ = ("start", "broadcast_seconds")
    START_FIELD_NUMBER: _ClassVar[int]
    BROADCAST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    start: bool
    broadcast_seconds: float
    def __init__(self, start: _Optional[bool] = ..., broadcast_seconds: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation", "bytes_received", "secret")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    SECRET_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    bytes_received: int
    secret: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., bytes_received: _Optional[int] = ..., secret: _Optional[str] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("chief_incarnation", "phase", "error")
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    chief_incarnation: str
    phase: str
    error: str
    def __init__(self, chief_incarnation: _Optional[str] = ..., phase: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("worker", "phase", "message", "culprit", "stop_signal")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CULPRIT_FIELD_NUMBER: _ClassVar[int]
    STOP_SIGNAL_FIELD_NUMBER: _ClassVar[int]
    worker: WorkerRef
    phase: str
    message: str
    culprit: str
    stop_signal: int
    def __init__(self, worker: _Optional[_Union[WorkerRef, _Mapping]] = ..., phase: _Optional[str] = ..., message: _Optional[str] = ..., culprit: _Optional[str] = ..., stop_signal: _Optional[int] = ...) -> None: ...

class FailureReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("brief",)
    BRIEF_FIELD_NUMBER: _ClassVar[int]
    brief: bool
    def __init__(self, brief: _Optional[bool] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "worker_id", "host", "devices", "phase", "bytes_received", "detail", "seconds_since_heartbeat", "bytes_total", "variables_received", "variables_total")
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    rank: int
    worker_id: str
    host: str
    devices: _containers.RepeatedScalarFieldContainer[str]
    phase: str
    bytes_received: int
    detail: str
    seconds_since_heartbeat: float
    bytes_total: int
    variables_received: int
    variables_total: int
    def __init__(self, rank: _Optional[int] = ..., worker_id: _Optional[str] = ..., host: _Optional[str] = ..., devices: _Optional[_Iterable[str]] = ..., phase: _Optional[str] = ..., bytes_received: _Optional[int] = ..., detail: _Optional[str] = ..., seconds_since_heartbeat: _Optional[float] = ..., bytes_total: _Optional[int] = ..., variables_received: _Optional[int] = ..., variables_total: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("phase", "expected", "joined", "workers", "error", "waiting_for", "chief_incarnation", "seconds_in_phase", "model")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    JOINED_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    CHIEF_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_IN_PHASE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    phase: str
    expected: int
    joined: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    error: str
    waiting_for: str
    chief_incarnation: str
    seconds_in_phase: float
    model: str
    def __init__(self, phase: _Optional[str] = ..., expected: _Optional[int] = ..., joined: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., error: _Optional[str] = ..., waiting_for: _Optional[str] = ..., chief_incarnation: _Optional[str] = ..., seconds_in_phase: _Optional[float] = ..., model: _Optional[str] = ...) -> None: ...
