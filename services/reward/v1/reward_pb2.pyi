from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SCORE_STATUS_UNSPECIFIED: _ClassVar[ScoreStatus]
    SCORE_STATUS_OK: _ClassVar[ScoreStatus]
    SCORE_STATUS_ERROR: _ClassVar[ScoreStatus]
    SCORE_STATUS_TIMEOUT: _ClassVar[ScoreStatus]
SCORE_STATUS_UNSPECIFIED: ScoreStatus
SCORE_STATUS_OK: ScoreStatus
SCORE_STATUS_ERROR: ScoreStatus
SCORE_STATUS_TIMEOUT: ScoreStatus

class RewardInput(_message.Message):
    __slots__ = ("sample_id", "prompt", "completion", "data_source", "ground_truth", "extra_info_json")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_FIELD_NUMBER: _ClassVar[int]
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    GROUND_TRUTH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_INFO_JSON_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    prompt: str
    completion: str
    data_source: str
    ground_truth: str
    extra_info_json: str
    def __init__(self, sample_id: _Optional[str] = ..., prompt: _Optional[str] = ..., completion: _Optional[str] = ..., data_source: _Optional[str] = ..., ground_truth: _Optional[str] = ..., extra_info_json: _Optional[str] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("request_id", "items", "timeout_seconds")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    items: _containers.RepeatedCompositeFieldContainer[RewardInput]
    timeout_seconds: float
    def __init__(self, request_id: _Optional[str] = ..., items: _Optional[_Iterable[_Union[RewardInput, _Mapping]]] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class RewardResult(_message.Message):
    __slots__ = ("sample_id", "reward", "components", "status", "error")
    class ComponentsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    COMPONENTS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    reward: float
    components: _containers.ScalarMap[str, float]
    status: ScoreStatus
    error: str
    def __init__(self, sample_id: _Optional[str] = ..., reward: _Optional[float] = ..., components: _Optional[_Mapping[str, float]] = ..., status: _Optional[_Union[ScoreStatus, str]] = ..., error: _Optional[str] = ...) -> None: ...

class ScoreResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[RewardResult]
    def __init__(self, results: _Optional[_Iterable[_Union[RewardResult, _Mapping]]] = ...) -> None: ...

class ListScorersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScorerInfo(_message.Message):
    __slots__ = ("data_source", "from_plugin", "origin")
    DATA_SOURCE_FIELD_NUMBER: _ClassVar[int]
    FROM_PLUGIN_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    data_source: str
    from_plugin: bool
    origin: str
    def __init__(self, data_source: _Optional[str] = ..., from_plugin: _Optional[bool] = ..., origin: _Optional[str] = ...) -> None: ...

class ListScorersResponse(_message.Message):
    __slots__ = ("scorers",)
    SCORERS_FIELD_NUMBER: _ClassVar[int]
    scorers: _containers.RepeatedCompositeFieldContainer[ScorerInfo]
    def __init__(self, scorers: _Optional[_Iterable[_Union[ScorerInfo, _Mapping]]] = ...) -> None: ...
