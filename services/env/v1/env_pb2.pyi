from relayrl.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_STATUS_UNSPECIFIED: _ClassVar[ToolStatus]
    TOOL_STATUS_OK: _ClassVar[ToolStatus]
    TOOL_STATUS_INVALID_ARGS: _ClassVar[ToolStatus]
    TOOL_STATUS_UNKNOWN_TOOL: _ClassVar[ToolStatus]
    TOOL_STATUS_TIMEOUT: _ClassVar[ToolStatus]
    TOOL_STATUS_CRASHED: _ClassVar[ToolStatus]
    TOOL_STATUS_OUTPUT_TRUNCATED: _ClassVar[ToolStatus]
    TOOL_STATUS_PARSE_ERROR: _ClassVar[ToolStatus]

class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTCOME_UNSPECIFIED: _ClassVar[Outcome]
    OUTCOME_OK: _ClassVar[Outcome]
    OUTCOME_MASK: _ClassVar[Outcome]
    OUTCOME_REDO: _ClassVar[Outcome]
TOOL_STATUS_UNSPECIFIED: ToolStatus
TOOL_STATUS_OK: ToolStatus
TOOL_STATUS_INVALID_ARGS: ToolStatus
TOOL_STATUS_UNKNOWN_TOOL: ToolStatus
TOOL_STATUS_TIMEOUT: ToolStatus
TOOL_STATUS_CRASHED: ToolStatus
TOOL_STATUS_OUTPUT_TRUNCATED: ToolStatus
TOOL_STATUS_PARSE_ERROR: ToolStatus
OUTCOME_UNSPECIFIED: Outcome
OUTCOME_OK: Outcome
OUTCOME_MASK: Outcome
OUTCOME_REDO: Outcome

class EnvInfo(_message.Message):
    __slots__ = ("name", "tools_json", "expects_tools", "max_turns", "description", "black_box")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    EXPECTS_TOOLS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    BLACK_BOX_FIELD_NUMBER: _ClassVar[int]
    name: str
    tools_json: str
    expects_tools: bool
    max_turns: int
    description: str
    black_box: bool
    def __init__(self, name: _Optional[str] = ..., tools_json: _Optional[str] = ..., expects_tools: _Optional[bool] = ..., max_turns: _Optional[int] = ..., description: _Optional[str] = ..., black_box: _Optional[bool] = ...) -> None: ...

class ListEnvsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListEnvsResponse(_message.Message):
    __slots__ = ("envs", "max_sessions", "open_sessions", "replica_id", "sandbox_tier")
    ENVS_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_TIER_FIELD_NUMBER: _ClassVar[int]
    envs: _containers.RepeatedCompositeFieldContainer[EnvInfo]
    max_sessions: int
    open_sessions: int
    replica_id: str
    sandbox_tier: str
    def __init__(self, envs: _Optional[_Iterable[_Union[EnvInfo, _Mapping]]] = ..., max_sessions: _Optional[int] = ..., open_sessions: _Optional[int] = ..., replica_id: _Optional[str] = ..., sandbox_tier: _Optional[str] = ...) -> None: ...

class ResetRequest(_message.Message):
    __slots__ = ("request_id", "env", "task_json", "seed", "episode_id", "attempt", "gateway")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TASK_JSON_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    env: str
    task_json: str
    seed: int
    episode_id: str
    attempt: int
    gateway: GatewayEndpoint
    def __init__(self, request_id: _Optional[str] = ..., env: _Optional[str] = ..., task_json: _Optional[str] = ..., seed: _Optional[int] = ..., episode_id: _Optional[str] = ..., attempt: _Optional[int] = ..., gateway: _Optional[_Union[GatewayEndpoint, _Mapping]] = ...) -> None: ...

class GatewayEndpoint(_message.Message):
    __slots__ = ("base_url", "api_key", "model")
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    API_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    base_url: str
    api_key: str
    model: str
    def __init__(self, base_url: _Optional[str] = ..., api_key: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class ResetResponse(_message.Message):
    __slots__ = ("session_id", "messages", "tools_json", "lease_seconds", "max_turns")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TURNS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    messages: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    tools_json: str
    lease_seconds: float
    max_turns: int
    def __init__(self, session_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., tools_json: _Optional[str] = ..., lease_seconds: _Optional[float] = ..., max_turns: _Optional[int] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("text", "tool_calls", "finish_reason")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    text: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.ToolCall]
    finish_reason: _common_pb2.FinishReason
    def __init__(self, text: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[_common_pb2.ToolCall, _Mapping]]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ...) -> None: ...

class StepRequest(_message.Message):
    __slots__ = ("request_id", "session_id", "step_index", "action")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_INDEX_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    step_index: int
    action: Action
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., step_index: _Optional[int] = ..., action: _Optional[_Union[Action, _Mapping]] = ...) -> None: ...

class ToolResult(_message.Message):
    __slots__ = ("tool_call_id", "name", "status")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    name: str
    status: ToolStatus
    def __init__(self, tool_call_id: _Optional[str] = ..., name: _Optional[str] = ..., status: _Optional[_Union[ToolStatus, str]] = ...) -> None: ...

class StepResponse(_message.Message):
    __slots__ = ("observations", "done", "tool_results")
    OBSERVATIONS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULTS_FIELD_NUMBER: _ClassVar[int]
    observations: _containers.RepeatedCompositeFieldContainer[_common_pb2.ChatMessage]
    done: bool
    tool_results: _containers.RepeatedCompositeFieldContainer[ToolResult]
    def __init__(self, observations: _Optional[_Iterable[_Union[_common_pb2.ChatMessage, _Mapping]]] = ..., done: _Optional[bool] = ..., tool_results: _Optional[_Iterable[_Union[ToolResult, _Mapping]]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("request_id", "session_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class CloseResponse(_message.Message):
    __slots__ = ("reward", "components", "outcome", "failure_kind", "failure_reason")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    FAILURE_KIND_FIELD_NUMBER: _ClassVar[int]
    FAILURE_REASON_FIELD_NUMBER: _ClassVar[int]
    reward: float
    components: _containers.ScalarMap[str, float]
    outcome: Outcome
    failure_kind: str
    failure_reason: str
    def __init__(self, reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., outcome: _Optional[_Union[Outcome, str]] = ..., failure_kind: _Optional[str] = ..., failure_reason: _Optional[str] = ...) -> None: ...
