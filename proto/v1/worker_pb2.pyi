from . import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_BOTH: _ClassVar[WorkerRole]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_BOTH: WorkerRole

class PrefillPeer(_message.Message):
    __slots__ = ("worker_id", "address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class TokenGenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "prefill_peer", "alternate_prefill_peers", "n", "cache_salt", "trace_context", "kv_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_PEER_FIELD_NUMBER: _ClassVar[int]
    ALTERNATE_PREFILL_PEERS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    prefill_peer: PrefillPeer
    alternate_prefill_peers: _containers.RepeatedCompositeFieldContainer[PrefillPeer]
    n: int
    cache_salt: str
    trace_context: _common_pb2.TraceContext
    kv_source: KvSource
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefill_peer: _Optional[_Union[PrefillPeer, _Mapping]] = ..., alternate_prefill_peers: _Optional[_Iterable[_Union[PrefillPeer, _Mapping]]] = ..., n: _Optional[int] = ..., cache_salt: _Optional[str] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., kv_source: _Optional[_Union[KvSource, _Mapping]] = ...) -> None: ...

class KvSource(_message.Message):
    __slots__ = ("worker_id", "address", "request_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    request_id: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class SuspendRequest(_message.Message):
    __slots__ = ("request_id", "hold_s")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HOLD_S_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    hold_s: float
    def __init__(self, request_id: _Optional[str] = ..., hold_s: _Optional[float] = ...) -> None: ...

class SuspendResponse(_message.Message):
    __slots__ = ("suspended", "num_tokens", "reason")
    SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    suspended: bool
    num_tokens: int
    reason: str
    def __init__(self, suspended: _Optional[bool] = ..., num_tokens: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class TokenGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "logprobs", "finished", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "num_output_tokens", "prefilled_remotely", "choice", "prompt_logprobs", "kv_moved")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLED_REMOTELY_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_MOVED_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    finished: bool
    finish_reason: _common_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    prefilled_remotely: bool
    choice: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    kv_moved: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_output_tokens: _Optional[int] = ..., prefilled_remotely: _Optional[bool] = ..., choice: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., kv_moved: _Optional[bool] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("generate", "abort_request_id")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    generate: TokenGenerateRequest
    abort_request_id: str
    def __init__(self, generate: _Optional[_Union[TokenGenerateRequest, _Mapping]] = ..., abort_request_id: _Optional[str] = ...) -> None: ...

class SessionResponse(_message.Message):
    __slots__ = ("request_id", "output", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    output: TokenGenerateResponse
    error: SessionError
    def __init__(self, request_id: _Optional[str] = ..., output: _Optional[_Union[TokenGenerateResponse, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class TransferTarget(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "layout_hash", "block_ids", "num_cached_blocks", "incarnation", "deadline_unix", "other_ranks")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    OTHER_RANKS_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    layout_hash: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_blocks: int
    incarnation: str
    deadline_unix: float
    other_ranks: _containers.RepeatedCompositeFieldContainer[TransferAgent]
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., layout_hash: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_blocks: _Optional[int] = ..., incarnation: _Optional[str] = ..., deadline_unix: _Optional[float] = ..., other_ranks: _Optional[_Iterable[_Union[TransferAgent, _Mapping]]] = ...) -> None: ...

class TransferAgent(_message.Message):
    __slots__ = ("agent_name", "agent_metadata", "incarnation")
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    agent_name: str
    agent_metadata: bytes
    incarnation: str
    def __init__(self, agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., incarnation: _Optional[str] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _common_pb2.TokenLogprob
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "params", "target", "cache_salt", "trace_context", "kv_handoff", "migrate_request_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    MIGRATE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    target: TransferTarget
    cache_salt: str
    trace_context: _common_pb2.TraceContext
    kv_handoff: bool
    migrate_request_id: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target: _Optional[_Union[TransferTarget, _Mapping]] = ..., cache_salt: _Optional[str] = ..., trace_context: _Optional[_Union[_common_pb2.TraceContext, _Mapping]] = ..., kv_handoff: _Optional[bool] = ..., migrate_request_id: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "first_logprob", "num_prompt_tokens", "num_cached_tokens", "prompt_logprobs", "kv_transfer_params_json")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    first_logprob: _common_pb2.TokenLogprob
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    kv_transfer_params_json: str
    def __init__(self, first_token_id: _Optional[int] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., kv_transfer_params_json: _Optional[str] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class FenceTransferRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class FenceTransferResponse(_message.Message):
    __slots__ = ("drained",)
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    def __init__(self, drained: _Optional[bool] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_hash", "token_ids", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    tier: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., tier: _Optional[str] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "tier")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    tier: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., tier: _Optional[str] = ...) -> None: ...

class AllCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("seq", "stored", "removed", "cleared")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    stored: BlockStored
    removed: BlockRemoved
    cleared: AllCleared
    def __init__(self, seq: _Optional[int] = ..., stored: _Optional[_Union[BlockStored, _Mapping]] = ..., removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., cleared: _Optional[_Union[AllCleared, _Mapping]] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ("since_seq", "snapshot")
    SINCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    since_seq: int
    snapshot: bool
    def __init__(self, since_seq: _Optional[int] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("worker_id", "instance_id", "snapshot", "last_seq", "events")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    instance_id: str
    snapshot: bool
    last_seq: int
    events: _containers.RepeatedCompositeFieldContainer[KvEvent]
    def __init__(self, worker_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., snapshot: _Optional[bool] = ..., last_seq: _Optional[int] = ..., events: _Optional[_Iterable[_Union[KvEvent, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("worker_id", "role", "draining", "num_kv_blocks", "num_used_kv_blocks", "num_cached_kv_blocks", "kv_usage", "num_running", "num_waiting", "num_remote_prefill", "num_in_flight", "num_steps", "num_computed_tokens", "num_prompt_tokens_computed", "num_prefix_hit_tokens", "num_generated_tokens", "num_preemptions", "num_finished", "num_aborted", "num_requests", "num_local_prefills", "num_remote_prefills", "num_prefills_served", "num_errors", "last_kv_event_seq", "num_prefill_retries", "num_prefill_fallbacks", "num_transfer_reservations", "num_held_prefills", "num_fenced_kv_blocks", "num_fences_confirmed", "num_fences_waited_out", "num_fences_served", "num_forks", "num_forked_kv_blocks", "num_fork_copies", "kv_tiers", "kv_tier_rejections", "num_remote_prefill_kv_blocks", "num_suspended", "num_kv_migrations_sent", "num_kv_migrations_received", "num_kv_migration_fallbacks", "num_suspended_held")
    class KvTierRejectionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_LOCAL_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILLS_SERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_ERRORS_FIELD_NUMBER: _ClassVar[int]
    LAST_KV_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_RETRIES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFILL_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRANSFER_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_HELD_PREFILLS_FIELD_NUMBER: _ClassVar[int]
    NUM_FENCED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FENCES_CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    NUM_FENCES_WAITED_OUT_FIELD_NUMBER: _ClassVar[int]
    NUM_FENCES_SERVED_FIELD_NUMBER: _ClassVar[int]
    NUM_FORKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FORKED_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FORK_COPIES_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_REJECTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_REMOTE_PREFILL_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SUSPENDED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_MIGRATIONS_SENT_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_MIGRATIONS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_MIGRATION_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SUSPENDED_HELD_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    draining: bool
    num_kv_blocks: int
    num_used_kv_blocks: int
    num_cached_kv_blocks: int
    kv_usage: float
    num_running: int
    num_waiting: int
    num_remote_prefill: int
    num_in_flight: int
    num_steps: int
    num_computed_tokens: int
    num_prompt_tokens_computed: int
    num_prefix_hit_tokens: int
    num_generated_tokens: int
    num_preemptions: int
    num_finished: int
    num_aborted: int
    num_requests: int
    num_local_prefills: int
    num_remote_prefills: int
    num_prefills_served: int
    num_errors: int
    last_kv_event_seq: int
    num_prefill_retries: int
    num_prefill_fallbacks: int
    num_transfer_reservations: int
    num_held_prefills: int
    num_fenced_kv_blocks: int
    num_fences_confirmed: int
    num_fences_waited_out: int
    num_fences_served: int
    num_forks: int
    num_forked_kv_blocks: int
    num_fork_copies: int
    kv_tiers: _containers.RepeatedCompositeFieldContainer[KvTierStats]
    kv_tier_rejections: _containers.ScalarMap[str, int]
    num_remote_prefill_kv_blocks: int
    num_suspended: int
    num_kv_migrations_sent: int
    num_kv_migrations_received: int
    num_kv_migration_fallbacks: int
    num_suspended_held: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., draining: _Optional[bool] = ..., num_kv_blocks: _Optional[int] = ..., num_used_kv_blocks: _Optional[int] = ..., num_cached_kv_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_remote_prefill: _Optional[int] = ..., num_in_flight: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_computed_tokens: _Optional[int] = ..., num_prompt_tokens_computed: _Optional[int] = ..., num_prefix_hit_tokens: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_aborted: _Optional[int] = ..., num_requests: _Optional[int] = ..., num_local_prefills: _Optional[int] = ..., num_remote_prefills: _Optional[int] = ..., num_prefills_served: _Optional[int] = ..., num_errors: _Optional[int] = ..., last_kv_event_seq: _Optional[int] = ..., num_prefill_retries: _Optional[int] = ..., num_prefill_fallbacks: _Optional[int] = ..., num_transfer_reservations: _Optional[int] = ..., num_held_prefills: _Optional[int] = ..., num_fenced_kv_blocks: _Optional[int] = ..., num_fences_confirmed: _Optional[int] = ..., num_fences_waited_out: _Optional[int] = ..., num_fences_served: _Optional[int] = ..., num_forks: _Optional[int] = ..., num_forked_kv_blocks: _Optional[int] = ..., num_fork_copies: _Optional[int] = ..., kv_tiers: _Optional[_Iterable[_Union[KvTierStats, _Mapping]]] = ..., kv_tier_rejections: _Optional[_Mapping[str, int]] = ..., num_remote_prefill_kv_blocks: _Optional[int] = ..., num_suspended: _Optional[int] = ..., num_kv_migrations_sent: _Optional[int] = ..., num_kv_migrations_received: _Optional[int] = ..., num_kv_migration_fallbacks: _Optional[int] = ..., num_suspended_held: _Optional[int] = ...) -> None: ...

class KvTierStats(_message.Message):
    __slots__ = ("tier", "num_blocks", "capacity_blocks", "num_hits", "bytes_loaded", "load_seconds", "num_written", "num_evicted")
    TIER_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_LOADED_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    tier: str
    num_blocks: int
    capacity_blocks: int
    num_hits: int
    bytes_loaded: int
    load_seconds: float
    num_written: int
    num_evicted: int
    def __init__(self, tier: _Optional[str] = ..., num_blocks: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., num_hits: _Optional[int] = ..., bytes_loaded: _Optional[int] = ..., load_seconds: _Optional[float] = ..., num_written: _Optional[int] = ..., num_evicted: _Optional[int] = ...) -> None: ...

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("worker_id", "instance_id", "role", "model_name", "max_model_len", "vocab_size", "block_size", "num_kv_blocks", "dtype", "device", "tensor_parallel_size", "transfer_backend", "block_hash_extra_key", "session_port", "max_logprobs", "kv_transfer_layout", "fingerprint", "moves_kv")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_EXTRA_KEY_FIELD_NUMBER: _ClassVar[int]
    SESSION_PORT_FIELD_NUMBER: _ClassVar[int]
    MAX_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MOVES_KV_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    instance_id: str
    role: WorkerRole
    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    dtype: str
    device: str
    tensor_parallel_size: int
    transfer_backend: str
    block_hash_extra_key: bytes
    session_port: int
    max_logprobs: int
    kv_transfer_layout: str
    fingerprint: str
    moves_kv: bool
    def __init__(self, worker_id: _Optional[str] = ..., instance_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., tensor_parallel_size: _Optional[int] = ..., transfer_backend: _Optional[str] = ..., block_hash_extra_key: _Optional[bytes] = ..., session_port: _Optional[int] = ..., max_logprobs: _Optional[int] = ..., kv_transfer_layout: _Optional[str] = ..., fingerprint: _Optional[str] = ..., moves_kv: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("num_in_flight",)
    NUM_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    num_in_flight: int
    def __init__(self, num_in_flight: _Optional[int] = ...) -> None: ...
