"""GeneratorService RPCs: proto -> domain, call the engine, domain -> proto. Nothing else."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable

from relayrl.common.rpc import InvalidRequest, ResourceExhausted, bounded, map_errors, to_the_end
from relayrl.common.v1 import common_pb2
from relayrl.common.weightsync.plan import TensorMeta, plan_from_proto, tensor_meta
from relayrl.generator import metrics
from relayrl.generator.config import GeneratorConfig
from relayrl.generator.constraints import output_constraint
from relayrl.generator.engine import (
    GenerationEngine,
    PromptIn,
    SamplingSpec,
)
from relayrl.generator.toolcalls import parse_tool_calls
from relayrl.generator.v1 import generator_pb2, generator_pb2_grpc
from relayrl.generator.wire import (
    TRANSPORT_PROTO,
    adapter_from_proto,
    check_to_proto,
    check_tool_format,
    check_version,
    continuation_from_proto,
    message_from_proto,
    messages_chars,
    sample_to_proto,
    sampling_from_proto,
    source_from_proto,
    sync_spec_from_proto,
    tools_from_json,
)


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
        tools = None
        if kind == "token_ids":
            # Too long for the model is refused before the ids are copied or scanned: 25M ids
            # held this process's CPU (and its event loop's GIL) for seconds, for nothing.
            if (n := len(p.token_ids.ids)) >= (limit := self.engine.status().max_model_len):
                raise InvalidRequest(f"prompt {name}: {n} tokens; the model takes at most {limit - 1}")
            ids = list(p.token_ids.ids)
        elif kind == "messages":
            chat = p.messages
            if (size := messages_chars(chat.messages, chat.tools_json)) > self._prompt_chars():
                raise InvalidRequest(
                    f"prompt {name}: {size} characters; at most {self._prompt_chars()} (max_prompt_chars)"
                )
            if not chat.messages:
                raise InvalidRequest(f"prompt {name}: messages is empty")
            msgs = [
                message_from_proto(m, f"prompt {name}: messages[{i}]") for i, m in enumerate(chat.messages)
            ]
            tools = tools_from_json(chat.tools_json, f"prompt {name}: tools_json")
            ids = self.engine.encode_messages(msgs, tools)
        elif kind == "text":
            if len(p.text) > self._prompt_chars():
                raise InvalidRequest(
                    f"prompt {name}: {len(p.text)} characters; at most {self._prompt_chars()} (max_prompt_chars)"
                )
            ids = self.engine.encode_text(p.text)
        elif kind == "continuation":
            limit = self.engine.status().max_model_len
            prefix, append, tools = continuation_from_proto(
                p.continuation, limit, self._prompt_chars(), f"prompt {name}"
            )
            codec = self.engine.chat_codec()
            if p.continuation.close_turn and prefix[-1] not in codec.end_of_turn_ids:
                prefix.append(min(codec.end_of_turn_ids))  # a cut turn, closed as a render would
            ids = codec.bridge(prefix, append, tools)
        else:
            raise InvalidRequest(f"prompt {name}: no input (token_ids, messages or text)")
        try:
            self.engine.check_prompt(ids, spec)
            constraint = output_constraint(
                tools,
                spec.tool_format,
                spec.tool_choice,
                spec.tool_choice_function,
                spec.single_tool_call,
                spec.json_schema,
            )
        except InvalidRequest as e:
            raise InvalidRequest(f"prompt {name}: {e}") from None
        return PromptIn(p.prompt_id, tuple(ids), constraint)

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
                if spec.tool_format:
                    text = self.engine.chat_codec().completion_text(s.token_ids)
                    s.content, s.tool_calls = parse_tool_calls(
                        text, spec.tool_format, f"call_{s.sample_index}_"
                    )
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
            host_id=st.host_id,
            device=st.device,
            gpu_uuids=st.gpu_uuids,
            weight_transport=TRANSPORT_PROTO.get(st.transport, generator_pb2.WEIGHT_TRANSPORT_UNSPECIFIED),
            max_lora_rank=st.max_lora_rank,
            serving_lora=st.serving_lora,
        )

    @map_errors
    async def CheckChat(self, request, context):
        fmt = check_tool_format(request.tool_format, "tool_format")
        tools = tools_from_json(request.tools_json, "tools_json")
        # Renders a few dialogues: CPU work, off the event loop.
        report = await asyncio.to_thread(self.engine.chat_codec().check, tools, fmt)
        return check_to_proto(report)

    @map_errors
    async def InitWeightSync(self, request, context):
        spec = sync_spec_from_proto(request, self.engine.status().device)
        rank, n = await self.engine.open_weight_sync(spec)
        return generator_pb2.InitWeightSyncResponse(
            replica_id=self.engine.status().replica_id,
            rank=rank,
            num_ranks=n,
            transport=TRANSPORT_PROTO[spec.transport],
        )

    async def _swapping(self, fn):
        """A swap, not serving meanwhile. It runs to its end even if the caller goes away (the
        learner cancels the calls of a push that broke): cut short, the weights loaded so far
        would be served under the old version, and readiness never restored."""

        async def swap():
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

        return await to_the_end(swap())

    @map_errors
    async def UpdateWeights(self, request, context):
        version = check_version(request.version)
        buckets = plan_from_proto(request.plan)
        if not buckets:
            raise InvalidRequest("plan has no buckets")
        source = source_from_proto(request, len(buckets))
        lora = adapter_from_proto(request.lora) if request.HasField("lora") else None
        if request.transport_only:  # no swap: readiness and weights stay as they are
            nbytes, secs, sums = await self.engine.update_weights(
                version, buckets, transport_only=True, source=source
            )
        else:
            nbytes, secs, sums = await self._swapping(
                lambda: self.engine.update_weights(version, buckets, source=source, lora=lora)
            )
        # The version the engine holds now, not the request's: the learner checks the two agree.
        return generator_pb2.UpdateWeightsResponse(
            version=self.engine.status().policy_version,
            swap_seconds=secs,
            nbytes=nbytes,
            bucket_checksums=sums,
        )

    @map_errors
    async def CloseWeightSync(self, request, context):
        await self.engine.close_weight_sync()
        return generator_pb2.CloseWeightSyncResponse()

    @map_errors
    async def LoadWeights(self, request_iterator, context):
        t0 = time.monotonic()
        version, declared, items = 0, 0, []
        partial: dict[str, tuple[TensorMeta, bytearray]] = {}
        done: set[str] = set()
        async for i, msg in _enumerate(request_iterator):
            if i == 0:
                version, declared = check_version(msg.version), msg.num_tensors
            t = msg.tensor
            meta = tensor_meta(t.name, t.dtype, t.shape)
            if t.name in done:
                raise InvalidRequest(f"{t.name}: sent twice")
            if t.name not in partial:  # its first chunk: one of the model's, or refused now
                self.engine.check_tensor(meta)
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
        nbytes, _, sums = await self._swapping(lambda: self.engine.load_weights(version, items))
        return generator_pb2.LoadWeightsResponse(
            version=self.engine.status().policy_version,
            swap_seconds=time.monotonic() - t0,
            nbytes=nbytes,
            num_tensors=len(items),
            tensor_checksums=sums,
        )


async def _enumerate(it):
    i = 0
    async for x in it:
        yield i, x
        i += 1
