from relayrl.common.v1 import common_pb2 as _common_pb2
from relayrl.generator.v1 import generator_pb2 as _generator_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("request_id", "episode_id", "sampling", "max_episode_tokens", "max_calls", "min_version", "ttl_seconds", "agent_reward")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPISODE_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_EPISODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_CALLS_FIELD_NUMBER: _ClassVar[int]
    MIN_VERSION_FIELD_NUMBER: _ClassVar[int]
    TTL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    AGENT_REWARD_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    episode_id: str
    sampling: _generator_pb2.SamplingParams
    max_episode_tokens: int
    max_calls: int
    min_version: int
    ttl_seconds: float
    agent_reward: bool
    def __init__(self, request_id: _Optional[str] = ..., episode_id: _Optional[str] = ..., sampling: _Optional[_Union[_generator_pb2.SamplingParams, _Mapping]] = ..., max_episode_tokens: _Optional[int] = ..., max_calls: _Optional[int] = ..., min_version: _Optional[int] = ..., ttl_seconds: _Optional[float] = ..., agent_reward: _Optional[bool] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_key", "base_url", "model")
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    BASE_URL_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    session_key: str
    base_url: str
    model: str
    def __init__(self, session_key: _Optional[str] = ..., base_url: _Optional[str] = ..., model: _Optional[str] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("request_id", "session_key")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_key: str
    def __init__(self, request_id: _Optional[str] = ..., session_key: _Optional[str] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("sample", "loss_mask", "calls", "break_reason")
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    BREAK_REASON_FIELD_NUMBER: _ClassVar[int]
    sample: _common_pb2.Sample
    loss_mask: _containers.RepeatedScalarFieldContainer[float]
    calls: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    break_reason: str
    def __init__(self, sample: _Optional[_Union[_common_pb2.Sample, _Mapping]] = ..., loss_mask: _Optional[_Iterable[float]] = ..., calls: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ..., break_reason: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ("segments", "calls", "history_breaks", "break_reasons", "reward_set", "reward", "components", "truncated", "malformed_calls", "constrained_calls")
    class BreakReasonsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_BREAKS_FIELD_NUMBER: _ClassVar[int]
    BREAK_REASONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_SET_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    MALFORMED_CALLS_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINED_CALLS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    calls: int
    history_breaks: int
    break_reasons: _containers.ScalarMap[str, int]
    reward_set: bool
    reward: float
    components: _containers.ScalarMap[str, float]
    truncated: int
    malformed_calls: int
    constrained_calls: int
    def __init__(self, segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., calls: _Optional[int] = ..., history_breaks: _Optional[int] = ..., break_reasons: _Optional[_Mapping[str, int]] = ..., reward_set: _Optional[bool] = ..., reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., truncated: _Optional[int] = ..., malformed_calls: _Optional[int] = ..., constrained_calls: _Optional[int] = ...) -> None: ...

class SetRewardRequest(_message.Message):
    __slots__ = ("session_key", "reward", "components")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    session_key: str
    reward: float
    components: _containers.ScalarMap[str, float]
    def __init__(self, session_key: _Optional[str] = ..., reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ...) -> None: ...

class SetRewardResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
