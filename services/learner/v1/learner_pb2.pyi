from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TrainSample(_message.Message):
    __slots__ = ("prompt_token_ids", "completion_token_ids", "generator_logprobs", "advantage", "policy_version", "loss_mask", "token_advantages", "returns", "values")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATOR_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    ADVANTAGE_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ADVANTAGES_FIELD_NUMBER: _ClassVar[int]
    RETURNS_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    generator_logprobs: _containers.RepeatedScalarFieldContainer[float]
    advantage: float
    policy_version: int
    loss_mask: _containers.RepeatedScalarFieldContainer[float]
    token_advantages: _containers.RepeatedScalarFieldContainer[float]
    returns: _containers.RepeatedScalarFieldContainer[float]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ..., generator_logprobs: _Optional[_Iterable[float]] = ..., advantage: _Optional[float] = ..., policy_version: _Optional[int] = ..., loss_mask: _Optional[_Iterable[float]] = ..., token_advantages: _Optional[_Iterable[float]] = ..., returns: _Optional[_Iterable[float]] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...

class TrainStepRequest(_message.Message):
    __slots__ = ("run_id", "step", "samples")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    step: int
    samples: _containers.RepeatedCompositeFieldContainer[TrainSample]
    def __init__(self, run_id: _Optional[str] = ..., step: _Optional[int] = ..., samples: _Optional[_Iterable[_Union[TrainSample, _Mapping]]] = ...) -> None: ...

class TrainMetrics(_message.Message):
    __slots__ = ("loss", "kl", "entropy", "clip_fraction", "grad_norm", "lr", "tokens", "samples", "step_seconds", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LOSS_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    loss: float
    kl: float
    entropy: float
    clip_fraction: float
    grad_norm: float
    lr: float
    tokens: int
    samples: int
    step_seconds: float
    extra: _containers.ScalarMap[str, float]
    def __init__(self, loss: _Optional[float] = ..., kl: _Optional[float] = ..., entropy: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., grad_norm: _Optional[float] = ..., lr: _Optional[float] = ..., tokens: _Optional[int] = ..., samples: _Optional[int] = ..., step_seconds: _Optional[float] = ..., extra: _Optional[_Mapping[str, float]] = ...) -> None: ...

class TrainStepResponse(_message.Message):
    __slots__ = ("step", "policy_version", "metrics")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    metrics: TrainMetrics
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., metrics: _Optional[_Union[TrainMetrics, _Mapping]] = ...) -> None: ...

class RegisterGeneratorRequest(_message.Message):
    __slots__ = ("address", "replica_id")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    address: str
    replica_id: str
    def __init__(self, address: _Optional[str] = ..., replica_id: _Optional[str] = ...) -> None: ...

class RegisterGeneratorResponse(_message.Message):
    __slots__ = ("replica_ids", "policy_version", "transport")
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    policy_version: int
    transport: str
    def __init__(self, replica_ids: _Optional[_Iterable[str]] = ..., policy_version: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class UnregisterGeneratorRequest(_message.Message):
    __slots__ = ("replica_id",)
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    def __init__(self, replica_id: _Optional[str] = ...) -> None: ...

class UnregisterGeneratorResponse(_message.Message):
    __slots__ = ("replica_ids",)
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class PushWeightsRequest(_message.Message):
    __slots__ = ("version", "bucket_bytes", "transport_only")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_ONLY_FIELD_NUMBER: _ClassVar[int]
    version: int
    bucket_bytes: int
    transport_only: bool
    def __init__(self, version: _Optional[int] = ..., bucket_bytes: _Optional[int] = ..., transport_only: _Optional[bool] = ...) -> None: ...

class PushWeightsResponse(_message.Message):
    __slots__ = ("version", "seconds", "bytes", "replica_ids")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    version: int
    seconds: float
    bytes: int
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, version: _Optional[int] = ..., seconds: _Optional[float] = ..., bytes: _Optional[int] = ..., replica_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class SaveCheckpointRequest(_message.Message):
    __slots__ = ("path", "tag", "client_state_json")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    path: str
    tag: str
    client_state_json: str
    def __init__(self, path: _Optional[str] = ..., tag: _Optional[str] = ..., client_state_json: _Optional[str] = ...) -> None: ...

class SaveCheckpointResponse(_message.Message):
    __slots__ = ("path", "tag", "step", "policy_version", "seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    tag: str
    step: int
    policy_version: int
    seconds: float
    def __init__(self, path: _Optional[str] = ..., tag: _Optional[str] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class LoadCheckpointRequest(_message.Message):
    __slots__ = ("path", "tag")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    path: str
    tag: str
    def __init__(self, path: _Optional[str] = ..., tag: _Optional[str] = ...) -> None: ...

class LoadCheckpointResponse(_message.Message):
    __slots__ = ("step", "policy_version", "client_state_json", "tag")
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STATE_JSON_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    step: int
    policy_version: int
    client_state_json: str
    tag: str
    def __init__(self, step: _Optional[int] = ..., policy_version: _Optional[int] = ..., client_state_json: _Optional[str] = ..., tag: _Optional[str] = ...) -> None: ...

class ExportModelRequest(_message.Message):
    __slots__ = ("path", "adapter")
    PATH_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    path: str
    adapter: bool
    def __init__(self, path: _Optional[str] = ..., adapter: _Optional[bool] = ...) -> None: ...

class ExportModelResponse(_message.Message):
    __slots__ = ("path", "policy_version", "seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    policy_version: int
    seconds: float
    def __init__(self, path: _Optional[str] = ..., policy_version: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisteredGenerator(_message.Message):
    __slots__ = ("replica_id", "address", "policy_version", "transport")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    policy_version: int
    transport: str
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., policy_version: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("model", "world_size", "step", "policy_version", "ready", "generators", "role")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    GENERATORS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    model: str
    world_size: int
    step: int
    policy_version: int
    ready: bool
    generators: _containers.RepeatedCompositeFieldContainer[RegisteredGenerator]
    role: str
    def __init__(self, model: _Optional[str] = ..., world_size: _Optional[int] = ..., step: _Optional[int] = ..., policy_version: _Optional[int] = ..., ready: _Optional[bool] = ..., generators: _Optional[_Iterable[_Union[RegisteredGenerator, _Mapping]]] = ..., role: _Optional[str] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("prompt_token_ids", "completion_token_ids")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    completion_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., completion_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class TokenValues(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class ComputeLogprobsRequest(_message.Message):
    __slots__ = ("run_id", "sequences")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, run_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class ComputeLogprobsResponse(_message.Message):
    __slots__ = ("logprobs", "policy_version", "seconds")
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenValues]
    policy_version: int
    seconds: float
    def __init__(self, logprobs: _Optional[_Iterable[_Union[TokenValues, _Mapping]]] = ..., policy_version: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class ComputeValuesRequest(_message.Message):
    __slots__ = ("run_id", "sequences")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    def __init__(self, run_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ...) -> None: ...

class ComputeValuesResponse(_message.Message):
    __slots__ = ("values", "step", "seconds")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedCompositeFieldContainer[TokenValues]
    step: int
    seconds: float
    def __init__(self, values: _Optional[_Iterable[_Union[TokenValues, _Mapping]]] = ..., step: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
