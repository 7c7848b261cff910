import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExperimentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPERIMENT_STATE_UNSPECIFIED: _ClassVar[ExperimentState]
    EXPERIMENT_STATE_PENDING: _ClassVar[ExperimentState]
    EXPERIMENT_STATE_RUNNING: _ClassVar[ExperimentState]
    EXPERIMENT_STATE_STOPPING: _ClassVar[ExperimentState]
    EXPERIMENT_STATE_COMPLETED: _ClassVar[ExperimentState]
    EXPERIMENT_STATE_FAILED: _ClassVar[ExperimentState]
    EXPERIMENT_STATE_STOPPED: _ClassVar[ExperimentState]
EXPERIMENT_STATE_UNSPECIFIED: ExperimentState
EXPERIMENT_STATE_PENDING: ExperimentState
EXPERIMENT_STATE_RUNNING: ExperimentState
EXPERIMENT_STATE_STOPPING: ExperimentState
EXPERIMENT_STATE_COMPLETED: ExperimentState
EXPERIMENT_STATE_FAILED: ExperimentState
EXPERIMENT_STATE_STOPPED: ExperimentState

class ExperimentStatus(_message.Message):
    __slots__ = ("run_id", "run_dir", "state", "step", "total_steps", "policy_version", "message", "started_at", "last_metrics")
    class LastMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_DIR_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_METRICS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    run_dir: str
    state: ExperimentState
    step: int
    total_steps: int
    policy_version: int
    message: str
    started_at: _timestamp_pb2.Timestamp
    last_metrics: _containers.ScalarMap[str, float]
    def __init__(self, run_id: _Optional[str] = ..., run_dir: _Optional[str] = ..., state: _Optional[_Union[ExperimentState, str]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., policy_version: _Optional[int] = ..., message: _Optional[str] = ..., started_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., last_metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class MetricsRecord(_message.Message):
    __slots__ = ("run_id", "step", "values", "time")
    class ValuesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    values: _containers.ScalarMap[str, float]
    time: _timestamp_pb2.Timestamp
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., values: _Optional[_Mapping[str, float]] = ..., time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class StartExperimentRequest(_message.Message):
    __slots__ = ("config_yaml", "overrides", "run_id", "resume_from")
    CONFIG_YAML_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_FIELD_NUMBER: _ClassVar[int]
    config_yaml: str
    overrides: _containers.RepeatedScalarFieldContainer[str]
    run_id: str
    resume_from: str
    def __init__(self, config_yaml: _Optional[str] = ..., overrides: _Optional[_Iterable[str]] = ..., run_id: _Optional[str] = ..., resume_from: _Optional[str] = ...) -> None: ...

class StartExperimentResponse(_message.Message):
    __slots__ = ("experiment",)
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    experiment: ExperimentStatus
    def __init__(self, experiment: _Optional[_Union[ExperimentStatus, _Mapping]] = ...) -> None: ...

class GetExperimentStatusRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetExperimentStatusResponse(_message.Message):
    __slots__ = ("experiment",)
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    experiment: ExperimentStatus
    def __init__(self, experiment: _Optional[_Union[ExperimentStatus, _Mapping]] = ...) -> None: ...

class StopExperimentRequest(_message.Message):
    __slots__ = ("run_id", "checkpoint")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    checkpoint: bool
    def __init__(self, run_id: _Optional[str] = ..., checkpoint: _Optional[bool] = ...) -> None: ...

class StopExperimentResponse(_message.Message):
    __slots__ = ("experiment",)
    EXPERIMENT_FIELD_NUMBER: _ClassVar[int]
    experiment: ExperimentStatus
    def __init__(self, experiment: _Optional[_Union[ExperimentStatus, _Mapping]] = ...) -> None: ...

class ListExperimentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListExperimentsResponse(_message.Message):
    __slots__ = ("experiments",)
    EXPERIMENTS_FIELD_NUMBER: _ClassVar[int]
    experiments: _containers.RepeatedCompositeFieldContainer[ExperimentStatus]
    def __init__(self, experiments: _Optional[_Iterable[_Union[ExperimentStatus, _Mapping]]] = ...) -> None: ...

class StreamMetricsRequest(_message.Message):
    __slots__ = ("run_id", "from_step")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_STEP_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    from_step: int
    def __init__(self, run_id: _Optional[str] = ..., from_step: _Optional[int] = ...) -> None: ...

class StreamMetricsResponse(_message.Message):
    __slots__ = ("record",)
    RECORD_FIELD_NUMBER: _ClassVar[int]
    record: MetricsRecord
    def __init__(self, record: _Optional[_Union[MetricsRecord, _Mapping]] = ...) -> None: ...
