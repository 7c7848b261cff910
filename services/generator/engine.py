"""The generation engine's interface: what the servicer depends on (``GenerationEngine``), the
values that cross it, and the tensor names a model folder expects. The vLLM adapter lives in
``vllm_engine.py``; unit tests of the servicer implement the interface with a fake.

Flow: the servicer turns a ``GenerateRequest`` into ``PromptIn`` + ``SamplingSpec`` and iterates
``engine.generate(...)``, which yields one ``SampleOut`` per finished completion, as each
finishes. Chat prompts, Continuation prompts (exact ids + new turns) and the tool calls read out
of completions go through ``engine.chat_codec()`` (``bridge.py``, on the model's tokenizer).
Weight updates go ``open_weight_sync`` -> ``update_weights`` (repeatedly) ->
``close_weight_sync``, or ``load_weights`` for the gRPC fallback.

Weight swap semantics: requests in flight keep the tokens they have and continue under the new
version; ``SampleOut.version_spans`` says which token range came from which version, exactly
(``continuation.py`` says how). New requests arriving during the swap wait and start on the new
version.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from relayrl.common.rpc import Unavailable
from relayrl.common.weightsync.adapters import AdapterSpec
from relayrl.common.weightsync.cudaipc import Shared
from relayrl.common.weightsync.plan import Bucket, TensorMeta, safetensors_kind
from relayrl.generator.bridge import ChatCodec
from relayrl.generator.toolcalls import ParsedCall

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingSpec:
    """Validated sampling parameters (defaults already applied)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 0  # 0: up to the context length
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    tool_format: str = ""  # "" | "hermes" | "llama3_json": read tool calls out of completions
    fit_to_context: bool = False  # max_tokens cut per prompt to the room its context leaves
    tool_choice: str = ""  # "" (free) | "required" | "function": enforced (``constraints.py``)
    tool_choice_function: str = ""  # with "function": the tool every completion calls
    single_tool_call: bool = False  # with "required": at most one call per completion
    json_schema: str = ""  # the answer's JSON schema (JSON text), enforced; "" for none


def prompt_seed(seed: int, prompt_id: str) -> int:
    """The seed of one prompt's samples in a request seeded with ``seed``: the same for that
    prompt id wherever it is sampled (whichever replica or request carries it, a retry included),
    distinct between prompts, so that two prompts of one request never share a random stream.
    A stable hash (Python's ``hash`` of a str differs between processes), 63 bits.

    >>> prompt_seed(0, "e0-12") == prompt_seed(0, "e0-12") != prompt_seed(0, "e0-13")
    True
    >>> prompt_seed(1, "e0-12") != prompt_seed(0, "e0-12") and 0 <= prompt_seed(2**64 - 1, "x") < 2**63
    True
    """
    digest = hashlib.blake2b(f"{seed}/{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class PromptIn:
    """A prompt in token ids; chat messages and text are encoded by ``engine.encode_*``."""

    prompt_id: str
    token_ids: tuple[int, ...]
    constraint: str = ""
    """A structural tag (JSON) its completions must follow (``constraints.tool_call_constraint``),
    "" for none."""


@dataclass
class SampleOut:
    """One finished completion."""

    prompt_id: str
    sample_index: int
    prompt_token_ids: Sequence[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    version_spans: list[tuple[int, int, int]]  # (version, start, end) over completion tokens
    text: str
    replica_id: str = ""
    tool_calls: list[ParsedCall] = field(default_factory=list)  # read with SamplingSpec.tool_format
    content: str = ""  # with a tool_format: the text outside the calls

    @property
    def policy_version(self) -> int:
        return self.version_spans[0][0] if self.version_spans else 0


@dataclass
class EngineStatus:
    model: str
    replica_id: str
    policy_version: int
    running: int
    waiting: int
    max_model_len: int
    ready: bool
    swapping: bool
    weight_sync_open: bool
    weight_sync_ranks: int
    host_id: str = ""
    device: str = "cpu"
    gpu_uuids: tuple[str, ...] = ()
    transport: str = ""  # the open weight sync's: "gloo", "nccl", "shm", "ipc"; "" when none
    max_lora_rank: int = 0  # 0: full weights only
    serving_lora: bool = False  # a pushed adapter runs over the base weights


@dataclass(frozen=True)
class SyncSpec:
    """How the learner will send weights (``InitWeightSync``, validated)."""

    transport: str  # "gloo" | "nccl" (a group) | "shm" | "ipc" (a probe to open)
    master_addr: str = ""
    master_port: int = 0
    world_size: int = 0
    rank: int = 0
    group_name: str = "relayrl-weights"
    timeout_s: float = 300.0
    shm_probe: str = ""
    ipc_probe: Shared | None = None
    probe_checksum: int = 0


@dataclass(frozen=True)
class BucketSource:
    """Where an update's buckets are when the transport is not a group: a shared-memory segment
    and each bucket's offset in it, or one shared CUDA buffer per bucket."""

    shm_segment: str = ""
    shm_offsets: tuple[int, ...] = ()
    shm_push_id: int = 0  # non-zero: pipelined, wait for each bucket's mark in the ready table
    shm_ready_offset: int = 0
    ipc: tuple[Shared, ...] = ()
    ipc_push_id: int = 0  # non-zero: pipelined, wait for each bucket's mark in ipc_ready_segment
    ipc_ready_segment: str = ""


class GenerationEngine(Protocol):
    """What the generator servicer needs from an engine (a fake implements it in unit tests)."""

    def encode_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]: ...
    def encode_text(self, text: str) -> list[int]: ...
    def chat_codec(self) -> ChatCodec: ...
    def check_prompt(self, token_ids: Sequence[int], spec: SamplingSpec) -> None: ...
    def check_sampling(self, spec: SamplingSpec) -> None: ...
    def generate(
        self, request_id: str, prompts: Sequence[PromptIn], spec: SamplingSpec
    ) -> AsyncIterator[SampleOut]: ...
    async def open_weight_sync(self, spec: SyncSpec) -> tuple[int, int]: ...
    async def update_weights(
        self,
        version: int,
        buckets: list[Bucket],
        transport_only: bool = False,
        source: BucketSource | None = None,
        lora: AdapterSpec | None = None,
    ) -> tuple[int, float, list[int]]: ...
    async def close_weight_sync(self) -> None: ...
    def check_tensor(self, meta: TensorMeta) -> None: ...
    async def load_weights(
        self, version: int, items: list[tuple[str, str, list[int], bytes]]
    ) -> tuple[int, float, list[int]]: ...
    def status(self) -> EngineStatus: ...
    async def shutdown(self) -> None: ...


def checkpoint_tensors(
    model_dir: str | Path,
) -> tuple[dict[str, tuple[int, ...]], set[str], dict[str, str]]:
    """Names and shapes of a HF folder's tensors (from safetensors headers, no data read), the
    names a sender may add or omit (a tied ``lm_head.weight``), and each tensor's dtype kind
    ("float", "int" or "bool": ``weightsync.dtype_kind``)."""
    folder = Path(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    kinds: dict[str, str] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        shapes.update({k: tuple(v["shape"]) for k, v in header.items()})
        kinds.update({k: safetensors_kind(v["dtype"]) for k, v in header.items()})
    cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    optional = {"lm_head.weight"} if cfg.get("tie_word_embeddings") else set()
    for name in optional:
        shapes.pop(name, None)
    return shapes, optional, kinds


async def within(call: Awaitable[Any], seconds: float, what: str) -> Any:
    """Await ``call`` for at most ``seconds``, else UNAVAILABLE naming ``what``. Past the limit
    the call is cancelled but not awaited: a call into a dead vLLM EngineCore may ignore its
    cancellation, and ``asyncio.wait_for`` would then wait for it forever."""
    task = asyncio.ensure_future(call)
    try:
        await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not task.done():
        task.cancel()
        task.add_done_callback(_retrieve)
        raise Unavailable(f"{what} did not return within {seconds:g} s (is the vLLM engine alive?)")
    return task.result()


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("an engine call given up on failed later: %r", task.exception())
