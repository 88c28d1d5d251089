from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FieldSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class BufferConfig(_message.Message):
    __slots__ = ("hot_capacity", "total_capacity", "fields", "prioritized", "mode", "max_times_sampled", "rate_limiter", "episodes", "meta_fields", "frame_stack", "next_of", "frame_capacity", "compression", "compressed_bytes")
    class FrameStackEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class NextOfEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CompressionEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Compression
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Compression, _Mapping]] = ...) -> None: ...
    HOT_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    PRIORITIZED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_TIMES_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMITER_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    META_FIELDS_FIELD_NUMBER: _ClassVar[int]
    FRAME_STACK_FIELD_NUMBER: _ClassVar[int]
    NEXT_OF_FIELD_NUMBER: _ClassVar[int]
    FRAME_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_BYTES_FIELD_NUMBER: _ClassVar[int]
    hot_capacity: int
    total_capacity: int
    fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    prioritized: Prioritized
    mode: str
    max_times_sampled: int
    rate_limiter: RateLimiter
    episodes: bool
    meta_fields: _containers.RepeatedCompositeFieldContainer[FieldSpec]
    frame_stack: _containers.ScalarMap[str, int]
    next_of: _containers.ScalarMap[str, str]
    frame_capacity: int
    compression: _containers.MessageMap[str, Compression]
    compressed_bytes: int
    def __init__(self, hot_capacity: _Optional[int] = ..., total_capacity: _Optional[int] = ..., fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ..., prioritized: _Optional[_Union[Prioritized, _Mapping]] = ..., mode: _Optional[str] = ..., max_times_sampled: _Optional[int] = ..., rate_limiter: _Optional[_Union[RateLimiter, _Mapping]] = ..., episodes: _Optional[bool] = ..., meta_fields: _Optional[_Iterable[_Union[FieldSpec, _Mapping]]] = ..., frame_stack: _Optional[_Mapping[str, int]] = ..., next_of: _Optional[_Mapping[str, str]] = ..., frame_capacity: _Optional[int] = ..., compression: _Optional[_Mapping[str, Compression]] = ..., compressed_bytes: _Optional[int] = ...) -> None: ...

class Compression(_message.Message):
    __slots__ = ("codec", "level")
    CODEC_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    codec: str
    level: int
    def __init__(self, codec: _Optional[str] = ..., level: _Optional[int] = ...) -> None: ...

class RateLimiter(_message.Message):
    __slots__ = ("samples_per_insert", "min_size_to_sample", "min_diff", "max_diff")
    SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    MIN_SIZE_TO_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    MIN_DIFF_FIELD_NUMBER: _ClassVar[int]
    MAX_DIFF_FIELD_NUMBER: _ClassVar[int]
    samples_per_insert: float
    min_size_to_sample: int
    min_diff: float
    max_diff: float
    def __init__(self, samples_per_insert: _Optional[float] = ..., min_size_to_sample: _Optional[int] = ..., min_diff: _Optional[float] = ..., max_diff: _Optional[float] = ...) -> None: ...

class Prioritized(_message.Message):
    __slots__ = ("alpha", "beta")
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    alpha: float
    beta: float
    def __init__(self, alpha: _Optional[float] = ..., beta: _Optional[float] = ...) -> None: ...

class Column(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("columns",)
    COLUMNS_FIELD_NUMBER: _ClassVar[int]
    columns: _containers.RepeatedCompositeFieldContainer[Column]
    def __init__(self, columns: _Optional[_Iterable[_Union[Column, _Mapping]]] = ...) -> None: ...

class CreateRequest(_message.Message):
    __slots__ = ("name", "config")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    config: BufferConfig
    def __init__(self, name: _Optional[str] = ..., config: _Optional[_Union[BufferConfig, _Mapping]] = ...) -> None: ...

class CreateReply(_message.Message):
    __slots__ = ("info", "created")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    info: BufferInfo
    created: bool
    def __init__(self, info: _Optional[_Union[BufferInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("name", "record", "timeout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RECORD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    record: Batch
    timeout: float
    def __init__(self, name: _Optional[str] = ..., record: _Optional[_Union[Batch, _Mapping]] = ..., timeout: _Optional[float] = ...) -> None: ...

class PushBatchRequest(_message.Message):
    __slots__ = ("name", "batch", "priorities", "timeout", "updates")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    name: str
    batch: Batch
    priorities: _containers.RepeatedScalarFieldContainer[float]
    timeout: float
    updates: _containers.RepeatedCompositeFieldContainer[EpisodeUpdate]
    def __init__(self, name: _Optional[str] = ..., batch: _Optional[_Union[Batch, _Mapping]] = ..., priorities: _Optional[_Iterable[float]] = ..., timeout: _Optional[float] = ..., updates: _Optional[_Iterable[_Union[EpisodeUpdate, _Mapping]]] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("size", "pushed")
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    size: int
    pushed: int
    def __init__(self, size: _Optional[int] = ..., pushed: _Optional[int] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("name", "batch_size", "seed", "timeout", "filter_meta", "n_step", "gamma", "stored_form")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    FILTER_META_FIELD_NUMBER: _ClassVar[int]
    N_STEP_FIELD_NUMBER: _ClassVar[int]
    GAMMA_FIELD_NUMBER: _ClassVar[int]
    STORED_FORM_FIELD_NUMBER: _ClassVar[int]
    name: str
    batch_size: int
    seed: int
    timeout: float
    filter_meta: Batch
    n_step: int
    gamma: float
    stored_form: bool
    def __init__(self, name: _Optional[str] = ..., batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., timeout: _Optional[float] = ..., filter_meta: _Optional[_Union[Batch, _Mapping]] = ..., n_step: _Optional[int] = ..., gamma: _Optional[float] = ..., stored_form: _Optional[bool] = ...) -> None: ...

class SampleReply(_message.Message):
    __slots__ = ("batch",)
    BATCH_FIELD_NUMBER: _ClassVar[int]
    batch: Batch
    def __init__(self, batch: _Optional[_Union[Batch, _Mapping]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ("name", "include_unavailable")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    include_unavailable: bool
    def __init__(self, name: _Optional[str] = ..., include_unavailable: _Optional[bool] = ...) -> None: ...

class BufferInfo(_message.Message):
    __slots__ = ("name", "config", "size", "pushed", "hot_size", "cold_size", "record_nbytes", "path", "inserts", "samples", "insert_waits", "sample_waits", "insert_wait_seconds", "sample_wait_seconds", "samples_per_insert", "waiting_inserts", "waiting_samples", "damaged", "beta", "max_priority", "priority_total", "priority_min", "memory_needed", "memory_limit", "episodes", "episodes_in_progress", "state", "reason", "stored_bytes", "logical_bytes", "disk_bytes", "read_only")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    HOT_SIZE_FIELD_NUMBER: _ClassVar[int]
    COLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RECORD_NBYTES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    INSERTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    INSERT_WAITS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_WAITS_FIELD_NUMBER: _ClassVar[int]
    INSERT_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_INSERT_FIELD_NUMBER: _ClassVar[int]
    WAITING_INSERTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    MAX_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_MIN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_NEEDED_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    EPISODES_FIELD_NUMBER: _ClassVar[int]
    EPISODES_IN_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGICAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DISK_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    name: str
    config: BufferConfig
    size: int
    pushed: int
    hot_size: int
    cold_size: int
    record_nbytes: int
    path: str
    inserts: int
    samples: int
    insert_waits: int
    sample_waits: int
    insert_wait_seconds: float
    sample_wait_seconds: float
    samples_per_insert: float
    waiting_inserts: int
    waiting_samples: int
    damaged: int
    beta: float
    max_priority: float
    priority_total: float
    priority_min: float
    memory_needed: int
    memory_limit: int
    episodes: int
    episodes_in_progress: int
    state: str
    reason: str
    stored_bytes: int
    logical_bytes: int
    disk_bytes: int
    read_only: bool
    def __init__(self, name: _Optional[str] = ..., config: _Optional[_Union[BufferConfig, _Mapping]] = ..., size: _Optional[int] = ..., pushed: _Optional[int] = ..., hot_size: _Optional[int] = ..., cold_size: _Optional[int] = ..., record_nbytes: _Optional[int] = ..., path: _Optional[str] = ..., inserts: _Optional[int] = ..., samples: _Optional[int] = ..., insert_waits: _Optional[int] = ..., sample_waits: _Optional[int] = ..., insert_wait_seconds: _Optional[float] = ..., sample_wait_seconds: _Optional[float] = ..., samples_per_insert: _Optional[float] = ..., waiting_inserts: _Optional[int] = ..., waiting_samples: _Optional[int] = ..., damaged: _Optional[int] = ..., beta: _Optional[float] = ..., max_priority: _Optional[float] = ..., priority_total: _Optional[float] = ..., priority_min: _Optional[float] = ..., memory_needed: _Optional[int] = ..., memory_limit: _Optional[int] = ..., episodes: _Optional[int] = ..., episodes_in_progress: _Optional[int] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ..., stored_bytes: _Optional[int] = ..., logical_bytes: _Optional[int] = ..., disk_bytes: _Optional[int] = ..., read_only: _Optional[bool] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("include_unavailable",)
    INCLUDE_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    include_unavailable: bool
    def __init__(self, include_unavailable: _Optional[bool] = ...) -> None: ...

class ListReply(_message.Message):
    __slots__ = ("buffers",)
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    buffers: _containers.RepeatedCompositeFieldContainer[BufferInfo]
    def __init__(self, buffers: _Optional[_Iterable[_Union[BufferInfo, _Mapping]]] = ...) -> None: ...

class NegotiateRequest(_message.Message):
    __slots__ = ("boot_id",)
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    boot_id: str
    def __init__(self, boot_id: _Optional[str] = ...) -> None: ...

class NegotiateReply(_message.Message):
    __slots__ = ("shm", "socket", "boot_id", "uid", "reason", "ticket")
    SHM_FIELD_NUMBER: _ClassVar[int]
    SOCKET_FIELD_NUMBER: _ClassVar[int]
    BOOT_ID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    shm: bool
    socket: str
    boot_id: str
    uid: int
    reason: str
    ticket: str
    def __init__(self, shm: _Optional[bool] = ..., socket: _Optional[str] = ..., boot_id: _Optional[str] = ..., uid: _Optional[int] = ..., reason: _Optional[str] = ..., ticket: _Optional[str] = ...) -> None: ...

class UpdatePrioritiesRequest(_message.Message):
    __slots__ = ("name", "indices", "priorities")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    PRIORITIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    priorities: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, name: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ..., priorities: _Optional[_Iterable[float]] = ...) -> None: ...

class UpdatePrioritiesReply(_message.Message):
    __slots__ = ("updated",)
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    updated: int
    def __init__(self, updated: _Optional[int] = ...) -> None: ...

class SetBetaRequest(_message.Message):
    __slots__ = ("name", "beta")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BETA_FIELD_NUMBER: _ClassVar[int]
    name: str
    beta: float
    def __init__(self, name: _Optional[str] = ..., beta: _Optional[float] = ...) -> None: ...

class SetBetaReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EpisodeUpdate(_message.Message):
    __slots__ = ("episode_id", "meta", "end")
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    META_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    episode_id: int
    meta: Batch
    end: bool
    def __init__(self, episode_id: _Optional[int] = ..., meta: _Optional[_Union[Batch, _Mapping]] = ..., end: _Optional[bool] = ...) -> None: ...

class UpdateEpisodesRequest(_message.Message):
    __slots__ = ("name", "updates")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    name: str
    updates: _containers.RepeatedCompositeFieldContainer[EpisodeUpdate]
    def __init__(self, name: _Optional[str] = ..., updates: _Optional[_Iterable[_Union[EpisodeUpdate, _Mapping]]] = ...) -> None: ...

class UpdateEpisodesReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SampleSequencesRequest(_message.Message):
    __slots__ = ("name", "batch_size", "seq_len", "seed", "timeout", "filter_meta", "stored_form")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    FILTER_META_FIELD_NUMBER: _ClassVar[int]
    STORED_FORM_FIELD_NUMBER: _ClassVar[int]
    name: str
    batch_size: int
    seq_len: int
    seed: int
    timeout: float
    filter_meta: Batch
    stored_form: bool
    def __init__(self, name: _Optional[str] = ..., batch_size: _Optional[int] = ..., seq_len: _Optional[int] = ..., seed: _Optional[int] = ..., timeout: _Optional[float] = ..., filter_meta: _Optional[_Union[Batch, _Mapping]] = ..., stored_form: _Optional[bool] = ...) -> None: ...

class SampleEpisodesRequest(_message.Message):
    __slots__ = ("name", "batch_size", "seed", "timeout", "filter_meta", "max_len")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    FILTER_META_FIELD_NUMBER: _ClassVar[int]
    MAX_LEN_FIELD_NUMBER: _ClassVar[int]
    name: str
    batch_size: int
    seed: int
    timeout: float
    filter_meta: Batch
    max_len: int
    def __init__(self, name: _Optional[str] = ..., batch_size: _Optional[int] = ..., seed: _Optional[int] = ..., timeout: _Optional[float] = ..., filter_meta: _Optional[_Union[Batch, _Mapping]] = ..., max_len: _Optional[int] = ...) -> None: ...

class EpisodeCatalogRequest(_message.Message):
    __slots__ = ("name", "filter_meta")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FILTER_META_FIELD_NUMBER: _ClassVar[int]
    name: str
    filter_meta: Batch
    def __init__(self, name: _Optional[str] = ..., filter_meta: _Optional[_Union[Batch, _Mapping]] = ...) -> None: ...

class ReadRequest(_message.Message):
    __slots__ = ("name", "seqs", "fields", "positions", "episode_ids")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SEQS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    EPISODE_IDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    seqs: _containers.RepeatedScalarFieldContainer[int]
    fields: _containers.RepeatedScalarFieldContainer[str]
    positions: bool
    episode_ids: bool
    def __init__(self, name: _Optional[str] = ..., seqs: _Optional[_Iterable[int]] = ..., fields: _Optional[_Iterable[str]] = ..., positions: _Optional[bool] = ..., episode_ids: _Optional[bool] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ResetReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class CheckpointProgress(_message.Message):
    __slots__ = ("copied", "total", "done", "path", "records", "first", "pushed", "dropped", "damaged", "nbytes")
    COPIED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    DAMAGED_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    copied: int
    total: int
    done: bool
    path: str
    records: int
    first: int
    pushed: int
    dropped: int
    damaged: int
    nbytes: int
    def __init__(self, copied: _Optional[int] = ..., total: _Optional[int] = ..., done: _Optional[bool] = ..., path: _Optional[str] = ..., records: _Optional[int] = ..., first: _Optional[int] = ..., pushed: _Optional[int] = ..., dropped: _Optional[int] = ..., damaged: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class RepairRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class RepairReply(_message.Message):
    __slots__ = ("info", "dropped", "repaired")
    INFO_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REPAIRED_FIELD_NUMBER: _ClassVar[int]
    info: BufferInfo
    dropped: int
    repaired: bool
    def __init__(self, info: _Optional[_Union[BufferInfo, _Mapping]] = ..., dropped: _Optional[int] = ..., repaired: _Optional[bool] = ...) -> None: ...
