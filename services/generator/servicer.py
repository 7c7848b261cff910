"""GeneratorService RPCs: proto -> domain, call the engine, domain -> proto. Nothing else."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from relayrl.common import weightsync as ws
from relayrl.common.rpc import InvalidRequest, ResourceExhausted, bounded, map_errors
from relayrl.common.tensors import DTYPE_NAMES
from relayrl.common.v1 import common_pb2
from relayrl.generator import metrics
from relayrl.generator.config import GeneratorConfig
from relayrl.generator.engine import GenerationEngine, PromptIn, SampleOut, SamplingSpec
from relayrl.generator.v1 import generator_pb2, generator_pb2_grpc

_FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


MAX_STOPS = 64
"""Most stop strings (and stop token ids) a request may give."""
MAX_STOP_CHARS = 256
"""Longest stop string (each is searched in the text after every token)."""
MAX_SYNC_TIMEOUT_S = 86400.0
"""Longest InitWeightSync timeout accepted (a day)."""
MAX_TEMPERATURE = 100.0
"""Highest sampling temperature accepted (engines may allow less: vLLM stops at 2)."""


def sampling_from_proto(p: generator_pb2.SamplingParams) -> SamplingSpec:
    """Apply the contract's defaults and bounds; errors name the field."""
    if p.n < 1:
        raise InvalidRequest("sampling.n must be at least 1")
    temperature = p.temperature if p.HasField("temperature") else 1.0
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not 0 <= temperature <= MAX_TEMPERATURE:  # also refuses NaN
        raise InvalidRequest(f"sampling.temperature must be in [0, {MAX_TEMPERATURE:g}], got {temperature}")
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"sampling.top_p must be in (0, 1], got {top_p}")
    if p.top_k < -1:
        raise InvalidRequest(f"sampling.top_k must be -1, 0 (off) or positive, got {p.top_k}")
    if len(p.stop) > MAX_STOPS or len(p.stop_token_ids) > MAX_STOPS:
        raise InvalidRequest(
            f"sampling.stop and sampling.stop_token_ids take at most {MAX_STOPS} values each"
        )
    if any(not 0 < len(s) <= MAX_STOP_CHARS for s in p.stop):
        raise InvalidRequest(f"sampling.stop strings must have 1 to {MAX_STOP_CHARS} characters")
    return SamplingSpec(
        n=p.n,
        temperature=temperature,
        top_p=top_p,
        top_k=p.top_k if p.top_k > 0 else -1,
        max_tokens=p.max_tokens,
        stop=tuple(p.stop),
        stop_token_ids=tuple(p.stop_token_ids),
        seed=p.seed if p.HasField("seed") else None,
        include_stop_str_in_output=p.include_stop_str_in_output,
        ignore_eos=p.ignore_eos,
    )


def sample_to_proto(s: SampleOut) -> common_pb2.Sample:
    return common_pb2.Sample(
        prompt_id=s.prompt_id,
        sample_index=s.sample_index,
        prompt_token_ids=s.prompt_token_ids,
        completion_token_ids=s.token_ids,
        logprobs=s.logprobs,
        finish_reason=_FINISH[s.finish_reason],
        policy_version=s.policy_version,
        # A single span is implied by policy_version; spans are only sent when a swap split it.
        version_spans=[common_pb2.VersionSpan(version=v, start=a, end=b) for v, a, b in s.version_spans]
        if len(s.version_spans) > 1
        else [],
        replica_id=s.replica_id,
        text=s.text,
    )


def _meta(name: str, dtype_enum: int, shape) -> ws.TensorMeta:
    dtype = DTYPE_NAMES.get(dtype_enum)
    if dtype is None:
        raise InvalidRequest(f"{name}: dtype missing or unsupported")
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"{name}: negative dimension in shape {tuple(shape)}")
    return ws.TensorMeta(name, dtype, tuple(shape))


def bucket_from_proto(b: common_pb2.Bucket) -> ws.Bucket:
    """A bucket whose tensors lie in order, aligned, without overlap, and fill it exactly."""
    if len(b.offsets) != len(b.tensors):
        raise InvalidRequest(f"bucket has {len(b.tensors)} tensors but {len(b.offsets)} offsets")
    metas = tuple(_meta(t.name, t.dtype, t.shape) for t in b.tensors)
    end = 0
    for m, off in zip(metas, b.offsets, strict=True):
        if off % ws.ALIGN or off < end:
            raise InvalidRequest(f"{m.name}: offset {off} is unaligned or overlaps the previous tensor")
        end = off + m.nbytes
    if end != b.nbytes:
        raise InvalidRequest(f"bucket nbytes {b.nbytes} does not match its tensors (they end at {end})")
    return ws.Bucket(metas, tuple(b.offsets), b.nbytes)


class GeneratorServicer(generator_pb2_grpc.GeneratorServiceServicer):
    def __init__(
        self,
        engine: GenerationEngine,
        config: GeneratorConfig,
        set_ready: Callable[[bool], Awaitable[None]] | None = None,
    ):
        self.engine = engine
        self.config = config
        self.max_pending = config.max_pending_requests
        self.pending = 0
        self.set_ready = set_ready

    def _prompt_chars(self) -> int:
        return self.config.max_prompt_chars or 32 * self.engine.status().max_model_len

    def _encode(self, p: common_pb2.Prompt, spec: SamplingSpec) -> PromptIn:
        """Tokenize and check one prompt (CPU work: runs in a worker thread, see ``Generate``)."""
        name = bounded(repr(p.prompt_id), 80)
        kind = p.WhichOneof("input")
        if kind == "token_ids":
            ids = list(p.token_ids.ids)
        elif kind in ("messages", "text"):
            msgs = [{"role": m.role, "content": m.content} for m in p.messages.messages]
            size = (
                sum(len(m["role"]) + len(m["content"]) for m in msgs) if kind == "messages" else len(p.text)
            )
            if size > self._prompt_chars():
                raise InvalidRequest(
                    f"prompt {name}: {size} characters; at most {self._prompt_chars()} (max_prompt_chars)"
                )
            if kind == "messages" and not msgs:
                raise InvalidRequest(f"prompt {name}: messages is empty")
            ids = self.engine.encode_messages(msgs) if kind == "messages" else self.engine.encode_text(p.text)
        else:
            raise InvalidRequest(f"prompt {name}: no input (token_ids, messages or text)")
        try:
            self.engine.check_prompt(ids, spec)
        except InvalidRequest as e:
            raise InvalidRequest(f"prompt {name}: {e}") from None
        return PromptIn(p.prompt_id, tuple(ids))

    @map_errors
    async def Generate(self, request, context):
        if not request.prompts:
            raise InvalidRequest("prompts is empty")
        if len(request.request_id) > 256:
            raise InvalidRequest("request_id takes at most 256 characters")
        ids = [p.prompt_id for p in request.prompts]
        if not all(ids):
            raise InvalidRequest("every prompt needs a prompt_id")
        if len(set(ids)) != len(ids):
            raise InvalidRequest("prompt_id values must be unique within a request")
        spec = sampling_from_proto(request.sampling)
        if len(ids) * spec.n > self.config.max_samples_per_request:
            raise InvalidRequest(
                f"{len(ids)} prompts x n={spec.n} samples exceeds {self.config.max_samples_per_request} "
                "(max_samples_per_request)"
            )
        self.engine.check_sampling(spec)
        if self.pending >= self.max_pending:
            raise ResourceExhausted(f"{self.pending} Generate calls pending (max_pending_requests)")
        self.pending += 1
        code = "OK"
        try:
            # Tokenizing is CPU work proportional to the prompts: never on the event loop, which
            # must keep answering health checks and other calls meanwhile.
            prompts = await asyncio.to_thread(lambda: [self._encode(p, spec) for p in request.prompts])
            async for s in self.engine.generate(request.request_id or uuid.uuid4().hex, prompts, spec):
                metrics.TOKENS.inc(len(s.token_ids))
                metrics.SAMPLES.labels(s.finish_reason).inc()
                yield generator_pb2.GenerateResponse(samples=[sample_to_proto(s)])
        except BaseException as e:
            code = type(e).__name__
            raise
        finally:
            self.pending -= 1
            metrics.REQUESTS.labels(code).inc()

    @map_errors
    async def GetStatus(self, request, context):
        st = self.engine.status()
        return generator_pb2.GetStatusResponse(
            model=st.model,
            replica_id=st.replica_id,
            policy_version=st.policy_version,
            num_running_requests=st.running,
            num_waiting_requests=st.waiting,
            max_model_len=st.max_model_len,
            ready=st.ready,
            swapping=st.swapping,
            weight_sync_open=st.weight_sync_open,
            weight_sync_ranks=st.weight_sync_ranks,
        )

    @map_errors
    async def InitWeightSync(self, request, context):
        if not request.master_addr or not request.master_port:
            raise InvalidRequest("master_addr and master_port are required")
        if len(request.master_addr) > 255:
            raise InvalidRequest("master_addr takes at most 255 characters")
        if request.master_port > 65535:
            raise InvalidRequest(f"master_port must be 1-65535, got {request.master_port}")
        if request.backend not in ("", "gloo", "nccl"):
            raise InvalidRequest(
                f"backend must be 'nccl', 'gloo' or empty, got {bounded(request.backend, 40)!r}"
            )
        if not 0 <= request.timeout_seconds <= MAX_SYNC_TIMEOUT_S:  # also refuses NaN
            raise InvalidRequest(
                f"timeout_seconds must be in [0, {MAX_SYNC_TIMEOUT_S:g}], got {request.timeout_seconds}"
            )
        if len(request.group_name) > 128:
            raise InvalidRequest("group_name takes at most 128 characters")
        rank, n = await self.engine.open_weight_sync(
            request.master_addr,
            request.master_port,
            request.world_size,
            request.rank,
            request.backend,
            request.group_name or "relayrl-weights",
            request.timeout_seconds or 300.0,
        )
        return generator_pb2.InitWeightSyncResponse(
            replica_id=self.engine.status().replica_id, rank=rank, num_ranks=n
        )

    async def _swapping(self, fn):
        if self.set_ready:
            await self.set_ready(False)
        t0 = time.monotonic()
        try:
            return await fn()
        finally:
            metrics.SWAP_SECONDS.observe(time.monotonic() - t0)
            metrics.VERSION.set(self.engine.status().policy_version)
            if self.set_ready:
                await self.set_ready(self.engine.status().ready)

    @map_errors
    async def UpdateWeights(self, request, context):
        buckets = [bucket_from_proto(b) for b in request.plan.buckets]
        if not buckets:
            raise InvalidRequest("plan has no buckets")
        if request.transport_only:  # no swap: readiness and weights stay as they are
            nbytes, secs, sums = await self.engine.update_weights(
                request.version, buckets, transport_only=True
            )
        else:
            nbytes, secs, sums = await self._swapping(
                lambda: self.engine.update_weights(request.version, buckets)
            )
        return generator_pb2.UpdateWeightsResponse(
            version=request.version, swap_seconds=secs, nbytes=nbytes, bucket_checksums=sums
        )

    @map_errors
    async def CloseWeightSync(self, request, context):
        await self.engine.close_weight_sync()
        return generator_pb2.CloseWeightSyncResponse()

    @map_errors
    async def LoadWeights(self, request_iterator, context):
        t0 = time.monotonic()
        version, declared, items = 0, 0, []
        partial: dict[str, tuple[ws.TensorMeta, bytearray]] = {}
        done: set[str] = set()
        async for i, msg in _enumerate(request_iterator):
            if i == 0:
                version, declared = msg.version, msg.num_tensors
            t = msg.tensor
            meta = _meta(t.name, t.dtype, t.shape)
            if t.name in done:
                raise InvalidRequest(f"{t.name}: sent twice")
            first, buf = partial.setdefault(t.name, (meta, bytearray()))
            if first != meta:
                raise InvalidRequest(f"{t.name}: dtype or shape changed between chunks")
            if msg.offset != len(buf) or msg.offset + len(t.data) > meta.nbytes:
                raise InvalidRequest(
                    f"{t.name}: chunk [{msg.offset}, +{len(t.data)}) does not continue the tensor"
                )
            buf += t.data
            if len(buf) == meta.nbytes:
                items.append((t.name, meta.dtype, list(meta.shape), bytes(partial.pop(t.name)[1])))
                done.add(t.name)
        if not items and not partial:
            raise InvalidRequest("stream carried no tensors")
        if partial:
            raise InvalidRequest(f"incomplete tensors: {', '.join(sorted(partial))}")
        if declared and declared != len(items):
            raise InvalidRequest(f"stream announced {declared} tensors, carried {len(items)}")
        nbytes, _, _ = await self._swapping(lambda: self.engine.load_weights(version, items))
        return generator_pb2.LoadWeightsResponse(
            version=version, swap_seconds=time.monotonic() - t0, nbytes=nbytes, num_tensors=len(items)
        )


async def _enumerate(it):
    i = 0
    async for x in it:
        yield i, x
        i += 1
