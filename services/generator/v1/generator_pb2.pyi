from relayrl.common.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ToolChoice(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_CHOICE_UNSPECIFIED: _ClassVar[ToolChoice]
    TOOL_CHOICE_REQUIRED: _ClassVar[ToolChoice]
    TOOL_CHOICE_FUNCTION: _ClassVar[ToolChoice]

class WeightTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WEIGHT_TRANSPORT_UNSPECIFIED: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_GLOO: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_NCCL: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_SHM: _ClassVar[WeightTransport]
    WEIGHT_TRANSPORT_IPC: _ClassVar[WeightTransport]
TOOL_CHOICE_UNSPECIFIED: ToolChoice
TOOL_CHOICE_REQUIRED: ToolChoice
TOOL_CHOICE_FUNCTION: ToolChoice
WEIGHT_TRANSPORT_UNSPECIFIED: WeightTransport
WEIGHT_TRANSPORT_GLOO: WeightTransport
WEIGHT_TRANSPORT_NCCL: WeightTransport
WEIGHT_TRANSPORT_SHM: WeightTransport
WEIGHT_TRANSPORT_IPC: WeightTransport

class SamplingParams(_message.Message):
    __slots__ = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids", "seed", "include_stop_str_in_output", "ignore_eos", "tool_format", "fit_to_context", "tool_choice", "tool_choice_function", "single_tool_call", "json_schema")
    N_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    FIT_TO_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FUNCTION_FIELD_NUMBER: _ClassVar[int]
    SINGLE_TOOL_CALL_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    seed: int
    include_stop_str_in_output: bool
    ignore_eos: bool
    tool_format: str
    fit_to_context: bool
    tool_choice: ToolChoice
    tool_choice_function: str
    single_tool_call: bool
    json_schema: str
    def __init__(self, n: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., seed: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., tool_format: _Optional[str] = ..., fit_to_context: _Optional[bool] = ..., tool_choice: _Optional[_Union[ToolChoice, str]] = ..., tool_choice_function: _Optional[str] = ..., single_tool_call: _Optional[bool] = ..., json_schema: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompts", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompts: _containers.RepeatedCompositeFieldContainer[_common_pb2.Prompt]
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompts: _Optional[_Iterable[_Union[_common_pb2.Prompt, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("samples",)
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    samples: _containers.RepeatedCompositeFieldContainer[_common_pb2.Sample]
    def __init__(self, samples: _Optional[_Iterable[_Union[_common_pb2.Sample, _Mapping]]] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("model", "replica_id", "policy_version", "num_running_requests", "num_waiting_requests", "max_model_len", "ready", "swapping", "weight_sync_open", "weight_sync_ranks", "host_id", "device", "gpu_uuids", "weight_transport", "max_lora_rank", "serving_lora")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    SWAPPING_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_OPEN_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_SYNC_RANKS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GPU_UUIDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    SERVING_LORA_FIELD_NUMBER: _ClassVar[int]
    model: str
    replica_id: str
    policy_version: int
    num_running_requests: int
    num_waiting_requests: int
    max_model_len: int
    ready: bool
    swapping: bool
    weight_sync_open: bool
    weight_sync_ranks: int
    host_id: str
    device: str
    gpu_uuids: _containers.RepeatedScalarFieldContainer[str]
    weight_transport: WeightTransport
    max_lora_rank: int
    serving_lora: bool
    def __init__(self, model: _Optional[str] = ..., replica_id: _Optional[str] = ..., policy_version: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_waiting_requests: _Optional[int] = ..., max_model_len: _Optional[int] = ..., ready: _Optional[bool] = ..., swapping: _Optional[bool] = ..., weight_sync_open: _Optional[bool] = ..., weight_sync_ranks: _Optional[int] = ..., host_id: _Optional[str] = ..., device: _Optional[str] = ..., gpu_uuids: _Optional[_Iterable[str]] = ..., weight_transport: _Optional[_Union[WeightTransport, str]] = ..., max_lora_rank: _Optional[int] = ..., serving_lora: _Optional[bool] = ...) -> None: ...

class SharedMemoryBuckets(_message.Message):
    __slots__ = ("segment", "offsets", "push_id", "ready_offset")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    READY_OFFSET_FIELD_NUMBER: _ClassVar[int]
    segment: str
    offsets: _containers.RepeatedScalarFieldContainer[int]
    push_id: int
    ready_offset: int
    def __init__(self, segment: _Optional[str] = ..., offsets: _Optional[_Iterable[int]] = ..., push_id: _Optional[int] = ..., ready_offset: _Optional[int] = ...) -> None: ...

class CudaIpcBuckets(_message.Message):
    __slots__ = ("buffers", "push_id", "ready_segment")
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    READY_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    buffers: _containers.RepeatedCompositeFieldContainer[_common_pb2.CudaIpcBuffer]
    push_id: int
    ready_segment: str
    def __init__(self, buffers: _Optional[_Iterable[_Union[_common_pb2.CudaIpcBuffer, _Mapping]]] = ..., push_id: _Optional[int] = ..., ready_segment: _Optional[str] = ...) -> None: ...

class InitWeightSyncRequest(_message.Message):
    __slots__ = ("master_addr", "master_port", "world_size", "rank", "backend", "group_name", "timeout_seconds", "transport", "shm_probe", "ipc_probe", "probe_checksum")
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHM_PROBE_FIELD_NUMBER: _ClassVar[int]
    IPC_PROBE_FIELD_NUMBER: _ClassVar[int]
    PROBE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    master_addr: str
    master_port: int
    world_size: int
    rank: int
    backend: str
    group_name: str
    timeout_seconds: float
    transport: WeightTransport
    shm_probe: str
    ipc_probe: _common_pb2.CudaIpcBuffer
    probe_checksum: int
    def __init__(self, master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., world_size: _Optional[int] = ..., rank: _Optional[int] = ..., backend: _Optional[str] = ..., group_name: _Optional[str] = ..., timeout_seconds: _Optional[float] = ..., transport: _Optional[_Union[WeightTransport, str]] = ..., shm_probe: _Optional[str] = ..., ipc_probe: _Optional[_Union[_common_pb2.CudaIpcBuffer, _Mapping]] = ..., probe_checksum: _Optional[int] = ...) -> None: ...

class InitWeightSyncResponse(_message.Message):
    __slots__ = ("replica_id", "rank", "num_ranks", "transport")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    rank: int
    num_ranks: int
    transport: WeightTransport
    def __init__(self, replica_id: _Optional[str] = ..., rank: _Optional[int] = ..., num_ranks: _Optional[int] = ..., transport: _Optional[_Union[WeightTransport, str]] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("version", "plan", "transport_only", "shm", "ipc", "lora")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_ONLY_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    version: int
    plan: _common_pb2.BucketPlan
    transport_only: bool
    shm: SharedMemoryBuckets
    ipc: CudaIpcBuckets
    lora: LoraAdapter
    def __init__(self, version: _Optional[int] = ..., plan: _Optional[_Union[_common_pb2.BucketPlan, _Mapping]] = ..., transport_only: _Optional[bool] = ..., shm: _Optional[_Union[SharedMemoryBuckets, _Mapping]] = ..., ipc: _Optional[_Union[CudaIpcBuckets, _Mapping]] = ..., lora: _Optional[_Union[LoraAdapter, _Mapping]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("rank", "alpha", "target_modules")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., target_modules: _Optional[_Iterable[str]] = ...) -> None: ...

class UpdateWeightsResponse(_message.Message):
    __slots__ = ("version", "swap_seconds", "nbytes", "bucket_checksums")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    version: int
    swap_seconds: float
    nbytes: int
    bucket_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., swap_seconds: _Optional[float] = ..., nbytes: _Optional[int] = ..., bucket_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CloseWeightSyncRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CloseWeightSyncResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadWeightsRequest(_message.Message):
    __slots__ = ("version", "tensor", "offset", "num_tensors")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    version: int
    tensor: _common_pb2.Tensor
    offset: int
    num_tensors: int
    def __init__(self, version: _Optional[int] = ..., tensor: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., offset: _Optional[int] = ..., num_tensors: _Optional[int] = ...) -> None: ...

class LoadWeightsResponse(_message.Message):
    __slots__ = ("version", "swap_seconds", "nbytes", "num_tensors", "tensor_checksums")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SWAP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    version: int
    swap_seconds: float
    nbytes: int
    num_tensors: int
    tensor_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., swap_seconds: _Optional[float] = ..., nbytes: _Optional[int] = ..., num_tensors: _Optional[int] = ..., tensor_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckChatRequest(_message.Message):
    __slots__ = ("tools_json", "tool_format")
    TOOLS_JSON_FIELD_NUMBER: _ClassVar[int]
    TOOL_FORMAT_FIELD_NUMBER: _ClassVar[int]
    tools_json: str
    tool_format: str
    def __init__(self, tools_json: _Optional[str] = ..., tool_format: _Optional[str] = ...) -> None: ...

class CheckChatResponse(_message.Message):
    __slots__ = ("tools_missing_from_prompt", "round_trip_ok", "round_trip_detail", "prefix_preserving", "bridge_detail", "glue_token_ids", "stop_token_ids")
    TOOLS_MISSING_FROM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_OK_FIELD_NUMBER: _ClassVar[int]
    ROUND_TRIP_DETAIL_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PRESERVING_FIELD_NUMBER: _ClassVar[int]
    BRIDGE_DETAIL_FIELD_NUMBER: _ClassVar[int]
    GLUE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    tools_missing_from_prompt: _containers.RepeatedScalarFieldContainer[str]
    round_trip_ok: bool
    round_trip_detail: str
    prefix_preserving: bool
    bridge_detail: str
    glue_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tools_missing_from_prompt: _Optional[_Iterable[str]] = ..., round_trip_ok: _Optional[bool] = ..., round_trip_detail: _Optional[str] = ..., prefix_preserving: _Optional[bool] = ..., bridge_detail: _Optional[str] = ..., glue_token_ids: _Optional[_Iterable[int]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...
