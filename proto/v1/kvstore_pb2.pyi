from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AttachStoreRequest(_message.Message):
    __slots__ = ("agent_metadata",)
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    def __init__(self, agent_metadata: _Optional[bytes] = ...) -> None: ...

class AttachStoreResponse(_message.Message):
    __slots__ = ("agent_metadata", "capacity_blocks")
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    agent_metadata: bytes
    capacity_blocks: int
    def __init__(self, agent_metadata: _Optional[bytes] = ..., capacity_blocks: _Optional[int] = ...) -> None: ...

class LookupBlocksRequest(_message.Message):
    __slots__ = ("block_hashes",)
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupBlocksResponse(_message.Message):
    __slots__ = ("num_held", "blocks_held", "capacity_blocks", "incarnation")
    NUM_HELD_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    num_held: int
    blocks_held: int
    capacity_blocks: int
    incarnation: str
    def __init__(self, num_held: _Optional[int] = ..., blocks_held: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class OfferBlocksRequest(_message.Message):
    __slots__ = ("request_id", "agent_name", "block_hashes", "crcs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CRCS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    agent_name: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    crcs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., crcs: _Optional[_Iterable[int]] = ...) -> None: ...

class OfferBlocksResponse(_message.Message):
    __slots__ = ("wanted", "slot_ids", "incarnation", "deadline_unix", "evicted")
    WANTED_FIELD_NUMBER: _ClassVar[int]
    SLOT_IDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    wanted: _containers.RepeatedScalarFieldContainer[int]
    slot_ids: _containers.RepeatedScalarFieldContainer[int]
    incarnation: str
    deadline_unix: float
    evicted: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, wanted: _Optional[_Iterable[int]] = ..., slot_ids: _Optional[_Iterable[int]] = ..., incarnation: _Optional[str] = ..., deadline_unix: _Optional[float] = ..., evicted: _Optional[_Iterable[bytes]] = ...) -> None: ...

class FetchBlocksRequest(_message.Message):
    __slots__ = ("request_id", "agent_name", "block_hashes", "block_ids", "incarnation", "deadline_unix")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    agent_name: str
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    incarnation: str
    deadline_unix: float
    def __init__(self, request_id: _Optional[str] = ..., agent_name: _Optional[str] = ..., block_hashes: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ..., incarnation: _Optional[str] = ..., deadline_unix: _Optional[float] = ...) -> None: ...

class FetchBlocksResponse(_message.Message):
    __slots__ = ("num_blocks", "crcs")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CRCS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    crcs: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_blocks: _Optional[int] = ..., crcs: _Optional[_Iterable[int]] = ...) -> None: ...

class StoreStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StoreStatsResponse(_message.Message):
    __slots__ = ("blocks_held", "capacity_blocks", "block_bytes", "counters", "layout")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    BLOCKS_HELD_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    blocks_held: int
    capacity_blocks: int
    block_bytes: int
    counters: _containers.ScalarMap[str, int]
    layout: str
    def __init__(self, blocks_held: _Optional[int] = ..., capacity_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., counters: _Optional[_Mapping[str, int]] = ..., layout: _Optional[str] = ...) -> None: ...
