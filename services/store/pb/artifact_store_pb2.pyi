from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SHARD_KIND_UNSPECIFIED: _ClassVar[ShardKind]
    SHARD_KIND_LATENT: _ClassVar[ShardKind]
    SHARD_KIND_LOCAL: _ClassVar[ShardKind]
    SHARD_KIND_MANIFEST: _ClassVar[ShardKind]
    SHARD_KIND_CERTIFICATE: _ClassVar[ShardKind]
    SHARD_KIND_OTHER: _ClassVar[ShardKind]

class FallbackReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FALLBACK_REASON_UNSPECIFIED: _ClassVar[FallbackReason]
    FALLBACK_REASON_MISSING_LAYER: _ClassVar[FallbackReason]
    FALLBACK_REASON_MISSING_SHARD: _ClassVar[FallbackReason]
    FALLBACK_REASON_TOKEN_MISMATCH: _ClassVar[FallbackReason]
    FALLBACK_REASON_PROFILE_MISMATCH: _ClassVar[FallbackReason]
    FALLBACK_REASON_STALE_GENERATION: _ClassVar[FallbackReason]
    FALLBACK_REASON_TP_GEOMETRY_MISMATCH: _ClassVar[FallbackReason]
    FALLBACK_REASON_DIGEST_MISMATCH: _ClassVar[FallbackReason]
    FALLBACK_REASON_RANK_DISAGREEMENT: _ClassVar[FallbackReason]
    FALLBACK_REASON_STORE_UNAVAILABLE: _ClassVar[FallbackReason]
    FALLBACK_REASON_CHECKPOINT_MISMATCH: _ClassVar[FallbackReason]
    FALLBACK_REASON_PRODUCER_MISMATCH: _ClassVar[FallbackReason]
    FALLBACK_REASON_UNCALIBRATED: _ClassVar[FallbackReason]
SHARD_KIND_UNSPECIFIED: ShardKind
SHARD_KIND_LATENT: ShardKind
SHARD_KIND_LOCAL: ShardKind
SHARD_KIND_MANIFEST: ShardKind
SHARD_KIND_CERTIFICATE: ShardKind
SHARD_KIND_OTHER: ShardKind
FALLBACK_REASON_UNSPECIFIED: FallbackReason
FALLBACK_REASON_MISSING_LAYER: FallbackReason
FALLBACK_REASON_MISSING_SHARD: FallbackReason
FALLBACK_REASON_TOKEN_MISMATCH: FallbackReason
FALLBACK_REASON_PROFILE_MISMATCH: FallbackReason
FALLBACK_REASON_STALE_GENERATION: FallbackReason
FALLBACK_REASON_TP_GEOMETRY_MISMATCH: FallbackReason
FALLBACK_REASON_DIGEST_MISMATCH: FallbackReason
FALLBACK_REASON_RANK_DISAGREEMENT: FallbackReason
FALLBACK_REASON_STORE_UNAVAILABLE: FallbackReason
FALLBACK_REASON_CHECKPOINT_MISMATCH: FallbackReason
FALLBACK_REASON_PRODUCER_MISMATCH: FallbackReason
FALLBACK_REASON_UNCALIBRATED: FallbackReason

class DocumentKey(_message.Message):
    __slots__ = ("doc_hash", "checkpoint_fingerprint", "profile", "tp_size")
    DOC_HASH_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    doc_hash: str
    checkpoint_fingerprint: str
    profile: str
    tp_size: int
    def __init__(self, doc_hash: _Optional[str] = ..., checkpoint_fingerprint: _Optional[str] = ..., profile: _Optional[str] = ..., tp_size: _Optional[int] = ...) -> None: ...

class Range(_message.Message):
    __slots__ = ("lo", "hi")
    LO_FIELD_NUMBER: _ClassVar[int]
    HI_FIELD_NUMBER: _ClassVar[int]
    lo: int
    hi: int
    def __init__(self, lo: _Optional[int] = ..., hi: _Optional[int] = ...) -> None: ...

class ShardSpec(_message.Message):
    __slots__ = ("name", "rank", "kind", "layers", "channels", "digest", "size")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    name: str
    rank: int
    kind: ShardKind
    layers: Range
    channels: Range
    digest: str
    size: int
    def __init__(self, name: _Optional[str] = ..., rank: _Optional[int] = ..., kind: _Optional[_Union[ShardKind, str]] = ..., layers: _Optional[_Union[Range, _Mapping]] = ..., channels: _Optional[_Union[Range, _Mapping]] = ..., digest: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("key", "generation", "shards", "committed_at_unix_ms")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    key: DocumentKey
    generation: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardSpec]
    committed_at_unix_ms: int
    def __init__(self, key: _Optional[_Union[DocumentKey, _Mapping]] = ..., generation: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardSpec, _Mapping]]] = ..., committed_at_unix_ms: _Optional[int] = ...) -> None: ...

class BeginGenerationRequest(_message.Message):
    __slots__ = ("key", "generation", "shards")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    key: DocumentKey
    generation: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardSpec]
    def __init__(self, key: _Optional[_Union[DocumentKey, _Mapping]] = ..., generation: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardSpec, _Mapping]]] = ...) -> None: ...

class BeginGenerationResponse(_message.Message):
    __slots__ = ("generation", "upload_id", "already_stored", "expires_at_unix_ms")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    upload_id: str
    already_stored: _containers.RepeatedCompositeFieldContainer[ShardRef]
    expires_at_unix_ms: int
    def __init__(self, generation: _Optional[int] = ..., upload_id: _Optional[str] = ..., already_stored: _Optional[_Iterable[_Union[ShardRef, _Mapping]]] = ..., expires_at_unix_ms: _Optional[int] = ...) -> None: ...

class ShardRef(_message.Message):
    __slots__ = ("rank", "name")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    rank: int
    name: str
    def __init__(self, rank: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class PutShardsRequest(_message.Message):
    __slots__ = ("upload_id", "rank", "name", "offset", "data", "last")
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    rank: int
    name: str
    offset: int
    data: bytes
    last: bool
    def __init__(self, upload_id: _Optional[str] = ..., rank: _Optional[int] = ..., name: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class PutShardsResponse(_message.Message):
    __slots__ = ("stored", "bytes")
    STORED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedCompositeFieldContainer[ShardRef]
    bytes: int
    def __init__(self, stored: _Optional[_Iterable[_Union[ShardRef, _Mapping]]] = ..., bytes: _Optional[int] = ...) -> None: ...

class CommitGenerationRequest(_message.Message):
    __slots__ = ("upload_id",)
    UPLOAD_ID_FIELD_NUMBER: _ClassVar[int]
    upload_id: str
    def __init__(self, upload_id: _Optional[str] = ...) -> None: ...

class CommitGenerationResponse(_message.Message):
    __slots__ = ("manifest", "became_current", "current_generation")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    BECAME_CURRENT_FIELD_NUMBER: _ClassVar[int]
    CURRENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    became_current: bool
    current_generation: int
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., became_current: _Optional[bool] = ..., current_generation: _Optional[int] = ...) -> None: ...

class GetManifestRequest(_message.Message):
    __slots__ = ("key", "generation")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    key: DocumentKey
    generation: int
    def __init__(self, key: _Optional[_Union[DocumentKey, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class GetManifestResponse(_message.Message):
    __slots__ = ("manifest", "current_generation", "generations")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CURRENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    manifest: Manifest
    current_generation: int
    generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, manifest: _Optional[_Union[Manifest, _Mapping]] = ..., current_generation: _Optional[int] = ..., generations: _Optional[_Iterable[int]] = ...) -> None: ...

class FetchShardsRequest(_message.Message):
    __slots__ = ("key", "generation", "rank", "layers", "channels", "names")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    key: DocumentKey
    generation: int
    rank: int
    layers: Range
    channels: Range
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, key: _Optional[_Union[DocumentKey, _Mapping]] = ..., generation: _Optional[int] = ..., rank: _Optional[int] = ..., layers: _Optional[_Union[Range, _Mapping]] = ..., channels: _Optional[_Union[Range, _Mapping]] = ..., names: _Optional[_Iterable[str]] = ...) -> None: ...

class FetchShardsResponse(_message.Message):
    __slots__ = ("shard", "generation", "offset", "data", "last")
    SHARD_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    shard: ShardSpec
    generation: int
    offset: int
    data: bytes
    last: bool
    def __init__(self, shard: _Optional[_Union[ShardSpec, _Mapping]] = ..., generation: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., last: _Optional[bool] = ...) -> None: ...

class ValidateCertificateRequest(_message.Message):
    __slots__ = ("key", "tp_rank", "channels", "layers_needed", "generation", "certificate_digest", "deep")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    CHANNELS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_NEEDED_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DEEP_FIELD_NUMBER: _ClassVar[int]
    key: DocumentKey
    tp_rank: int
    channels: Range
    layers_needed: _containers.RepeatedScalarFieldContainer[int]
    generation: int
    certificate_digest: str
    deep: bool
    def __init__(self, key: _Optional[_Union[DocumentKey, _Mapping]] = ..., tp_rank: _Optional[int] = ..., channels: _Optional[_Union[Range, _Mapping]] = ..., layers_needed: _Optional[_Iterable[int]] = ..., generation: _Optional[int] = ..., certificate_digest: _Optional[str] = ..., deep: _Optional[bool] = ...) -> None: ...

class ValidateCertificateResponse(_message.Message):
    __slots__ = ("ok", "reason", "detail", "current_generation", "certificate_digest")
    OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    CURRENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    reason: FallbackReason
    detail: str
    current_generation: int
    certificate_digest: str
    def __init__(self, ok: _Optional[bool] = ..., reason: _Optional[_Union[FallbackReason, str]] = ..., detail: _Optional[str] = ..., current_generation: _Optional[int] = ..., certificate_digest: _Optional[str] = ...) -> None: ...

class ListDocumentsRequest(_message.Message):
    __slots__ = ("page_size", "page_token", "doc_hash")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DOC_HASH_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    doc_hash: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., doc_hash: _Optional[str] = ...) -> None: ...

class DocumentSummary(_message.Message):
    __slots__ = ("key", "current_generation", "generations")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CURRENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    key: DocumentKey
    current_generation: int
    generations: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, key: _Optional[_Union[DocumentKey, _Mapping]] = ..., current_generation: _Optional[int] = ..., generations: _Optional[_Iterable[int]] = ...) -> None: ...

class ListDocumentsResponse(_message.Message):
    __slots__ = ("documents", "next_page_token")
    DOCUMENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    documents: _containers.RepeatedCompositeFieldContainer[DocumentSummary]
    next_page_token: str
    def __init__(self, documents: _Optional[_Iterable[_Union[DocumentSummary, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RetireGenerationRequest(_message.Message):
    __slots__ = ("key", "generation")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    key: DocumentKey
    generation: int
    def __init__(self, key: _Optional[_Union[DocumentKey, _Mapping]] = ..., generation: _Optional[int] = ...) -> None: ...

class RetireGenerationResponse(_message.Message):
    __slots__ = ("current_generation",)
    CURRENT_GENERATION_FIELD_NUMBER: _ClassVar[int]
    current_generation: int
    def __init__(self, current_generation: _Optional[int] = ...) -> None: ...

class CollectGarbageRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: DocumentKey
    def __init__(self, key: _Optional[_Union[DocumentKey, _Mapping]] = ...) -> None: ...

class CollectGarbageResponse(_message.Message):
    __slots__ = ("blobs_deleted", "bytes_freed", "blobs_kept", "temp_files_removed")
    BLOBS_DELETED_FIELD_NUMBER: _ClassVar[int]
    BYTES_FREED_FIELD_NUMBER: _ClassVar[int]
    BLOBS_KEPT_FIELD_NUMBER: _ClassVar[int]
    TEMP_FILES_REMOVED_FIELD_NUMBER: _ClassVar[int]
    blobs_deleted: int
    bytes_freed: int
    blobs_kept: int
    temp_files_removed: int
    def __init__(self, blobs_deleted: _Optional[int] = ..., bytes_freed: _Optional[int] = ..., blobs_kept: _Optional[int] = ..., temp_files_removed: _Optional[int] = ...) -> None: ...

class CalibrationKey(_message.Message):
    __slots__ = ("checkpoint_fingerprint", "profile")
    CHECKPOINT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    checkpoint_fingerprint: str
    profile: str
    def __init__(self, checkpoint_fingerprint: _Optional[str] = ..., profile: _Optional[str] = ...) -> None: ...

class PutCalibrationRequest(_message.Message):
    __slots__ = ("record",)
    RECORD_FIELD_NUMBER: _ClassVar[int]
    record: bytes
    def __init__(self, record: _Optional[bytes] = ...) -> None: ...

class PutCalibrationResponse(_message.Message):
    __slots__ = ("key", "digest", "stored_at_unix_ms", "replaced")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REPLACED_FIELD_NUMBER: _ClassVar[int]
    key: CalibrationKey
    digest: str
    stored_at_unix_ms: int
    replaced: bool
    def __init__(self, key: _Optional[_Union[CalibrationKey, _Mapping]] = ..., digest: _Optional[str] = ..., stored_at_unix_ms: _Optional[int] = ..., replaced: _Optional[bool] = ...) -> None: ...

class GetCalibrationRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: CalibrationKey
    def __init__(self, key: _Optional[_Union[CalibrationKey, _Mapping]] = ...) -> None: ...

class GetCalibrationResponse(_message.Message):
    __slots__ = ("record", "digest", "stored_at_unix_ms", "stored_by")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    STORED_BY_FIELD_NUMBER: _ClassVar[int]
    record: bytes
    digest: str
    stored_at_unix_ms: int
    stored_by: str
    def __init__(self, record: _Optional[bytes] = ..., digest: _Optional[str] = ..., stored_at_unix_ms: _Optional[int] = ..., stored_by: _Optional[str] = ...) -> None: ...
