from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_INT64: _ClassVar[DType]
    DTYPE_INT32: _ClassVar[DType]
    DTYPE_UINT8: _ClassVar[DType]
    DTYPE_BOOL: _ClassVar[DType]

class ToolCallParse(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CALL_PARSE_UNSPECIFIED: _ClassVar[ToolCallParse]
    TOOL_CALL_PARSE_OK: _ClassVar[ToolCallParse]
    TOOL_CALL_PARSE_INVALID_JSON: _ClassVar[ToolCallParse]
    TOOL_CALL_PARSE_UNCLOSED_BLOCK: _ClassVar[ToolCallParse]
    TOOL_CALL_PARSE_MISSING_NAME: _ClassVar[ToolCallParse]
    TOOL_CALL_PARSE_INVALID_ARGUMENTS: _ClassVar[ToolCallParse]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_INT64: DType
DTYPE_INT32: DType
DTYPE_UINT8: DType
DTYPE_BOOL: DType
TOOL_CALL_PARSE_UNSPECIFIED: ToolCallParse
TOOL_CALL_PARSE_OK: ToolCallParse
TOOL_CALL_PARSE_INVALID_JSON: ToolCallParse
TOOL_CALL_PARSE_UNCLOSED_BLOCK: ToolCallParse
TOOL_CALL_PARSE_MISSING_NAME: ToolCallParse
TOOL_CALL_PARSE_INVALID_ARGUMENTS: ToolCallParse
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class Tensor(_message.Message):
    __slots__ = ("name", "data", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    data: bytes
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., data: _Optional[bytes] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class Bucket(_message.Message):
    __slots__ = ("tensors", "nbytes", "offsets")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    nbytes: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., nbytes: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class BucketPlan(_message.Message):
    __slots__ = ("buckets",)
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[Bucket]
    def __init__(self, buckets: _Optional[_Iterable[_Union[Bucket, _Mapping]]] = ...) -> None: ...

class CudaIpcBuffer(_message.Message):
    __slots__ = ("handle", "storage_size_bytes", "storage_offset_bytes", "device", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required", "nbytes")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    STORAGE_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    device: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    nbytes: int
    def __init__(self, handle: _Optional[bytes] = ..., storage_size_bytes: _Optional[int] = ..., storage_offset_bytes: _Optional[int] = ..., device: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments_json", "parse")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_JSON_FIELD_NUMBER: _ClassVar[int]
    PARSE_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments_json: str
    parse: ToolCallParse
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments_json: _Optional[str] = ..., parse: _Optional[_Union[ToolCallParse, str]] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages", "tools_json")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ...) -> None: ...

class Continuation(_message.Message):
    __slots__ = ("prefix_token_ids", "append", "tools_json", "close_turn")
    PREFIX_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    CLOSE_TURN_FIELD_NUMBER: _ClassVar[int]
    prefix_token_ids: _containers.RepeatedScalarFieldContainer[int]
    append: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    tools_json: str
    close_turn: bool
    def __init__(self, prefix_token_ids: _Optional[_Iterable[int]] = ..., append: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., close_turn: _Optional[bool] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Prompt(_message.Message):
    __slots__ = ("prompt_id", "token_ids", "messages", "text", "continuation")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONTINUATION_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    token_ids: TokenIds
    messages: ChatMessages
    text: str
    continuation: Continuation
    def __init__(self, prompt_id: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., messages: _Optional[_Union[ChatMessages, _Mapping]] = ..., text: _Optional[str] = ..., continuation: _Optional[_Union[Continuation, _Mapping]] = ...) -> None: ...

class VersionSpan(_message.Message):
    __slots__ = ("version", "start", "end")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    version: int
    start: int
    end: int
    def __init__(self, version: _Optional[int] = ..., start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class Sample(_message.Message):
    __slots__ = ("prompt_id", "sample_index", "prompt_token_ids", "completion_token_ids", "logprobs", "finish_reason", "policy_version", "version_spans", "replica_id", "text", "tool_calls", "content")
    PROMPT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    VERSION_SPANS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    prompt_id: str
    sample_index: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: FinishReason
    policy_version: int
    version_spans: _containers.RepeatedCompositeFieldContainer[VersionSpan]
    replica_id: str
    text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    content: str
    def __init__(self, prompt_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., policy_version: _Optional[int] = ..., version_spans: _Optional[_Iterable[_Union[VersionSpan, _Mapping]]] = ..., replica_id: _Optional[str] = ..., text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., content: _Optional[str] = ...) -> None: ...
