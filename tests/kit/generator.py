"""A GeneratorService on a fake engine, for the tests of the servicer and of its clients.

``FakeEngine`` is a ``GenerationEngine`` without a model, deterministic (completion = prompt ids
reversed, logprob -0.5 per token, finish reasons cycling through ``REASONS``), recording what the
servicer hands it; its chat codec is the real one on the tiny model's tokenizer; ``serving`` runs the real ``grpc.aio`` server around it on port 0 and yields
its handle, a channel and the stubs. Real-engine behaviour is covered by tests/integration.
"""

from __future__ import annotations

import asyncio
import contextlib

from relayrl.common.grpc_server import start
from relayrl.common.rpc import InvalidRequest
from relayrl.generator.config import GeneratorConfig
from relayrl.generator.engine import EngineStatus, SampleOut
from relayrl.generator.server import build
from relayrl.generator.v1 import generator_pb2_grpc

from tests.kit.serving import client

REASONS = ("stop", "length", "abort")


class FakeEngine:
    """``GenerationEngine`` without a model. ``gate`` (an Event) holds generate before each
    sample and the weight updates until set; ``fail`` is raised by the next engine call."""

    def __init__(self, delay: float = 0.01):
        self.delay, self.gate, self.fail = delay, None, None
        self.version, self.swapping, self.active, self.cancelled = 0, False, 0, 0
        self.calls, self.buckets, self.loaded, self.shutdowns = [], [], [], 0
        self.syncs, self.sources, self.adapters = [], [], []
        self.codec = None

    def encode_messages(self, messages, tools=None):
        def calls(m):
            return "".join(
                f"{c['function']['name']}({c['function']['arguments']})" for c in m.get("tool_calls", [])
            )

        head = f"tools:{[t['function']['name'] for t in tools]}|" if tools else ""
        return self.encode_text(head + "".join(f"{m['role']}:{m['content']}{calls(m)}|" for m in messages))

    def encode_text(self, text):
        return [ord(ch) for ch in text]

    def chat_codec(self):
        """The real codec on the tiny model's tokenizer and template (``tests/kit/chat.py``)."""
        from relayrl.generator.bridge import ChatCodec

        from tests.kit.chat import chat_tokenizer

        if self.codec is None:
            self.codec = ChatCodec(chat_tokenizer("tiny"))
        return self.codec

    def check_prompt(self, token_ids, spec):
        if not token_ids:
            raise InvalidRequest("prompt is empty")

    def check_sampling(self, spec):
        if spec.temperature > 2:
            raise InvalidRequest(f"sampling: temperature must be at most 2, got {spec.temperature}")

    async def generate(self, request_id, prompts, spec):
        self.calls.append((request_id, prompts, spec))
        self.active += 1
        try:
            for p in prompts:
                for i in range(spec.n):
                    await asyncio.sleep(self.delay)
                    if self.gate is not None:
                        await self.gate.wait()
                    if self.fail is not None:
                        raise self.fail
                    ids = list(reversed(p.token_ids))
                    spans = [(self.version, 0, len(ids))]
                    if p.prompt_id.endswith("split"):  # a swap landed mid-sample
                        spans = [(self.version, 0, 1), (self.version + 1, 1, len(ids))]
                    yield SampleOut(
                        prompt_id=p.prompt_id,
                        sample_index=i,
                        prompt_token_ids=p.token_ids,
                        token_ids=ids,
                        logprobs=[-0.5] * len(ids),
                        finish_reason=REASONS[i % 3],
                        version_spans=spans,
                        text=" ".join(map(str, ids)),
                        replica_id="fake-0",
                    )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1

    async def _swap(self, version, record, nbytes):
        self.swapping = True
        try:
            if self.gate is not None:
                await self.gate.wait()
            if self.fail is not None:
                raise self.fail
            record.append((version, nbytes))
            self.version = version
            sums = [n % 251 for n in nbytes] if isinstance(nbytes, list) else []
            return sum(nbytes) if isinstance(nbytes, list) else nbytes, 0.01, sums
        finally:
            self.swapping = False

    async def open_weight_sync(self, spec):
        self.syncs.append(spec)
        return (spec.rank, 1) if spec.transport in ("gloo", "nccl") else (0, 1)

    async def update_weights(self, version, buckets, transport_only=False, source=None, lora=None):
        self.sources.append(source)
        self.adapters.append(lora)
        return await self._swap(version, self.buckets, [b.nbytes for b in buckets])

    async def close_weight_sync(self):
        pass

    def check_tensor(self, meta):
        if meta.name.startswith("not-"):
            raise InvalidRequest(f"{meta.name}: not a tensor of this model")

    async def load_weights(self, version, items):
        self.loaded.append({name: (dtype, shape, data) for name, dtype, shape, data in items})
        return await self._swap(version, [], sum(len(d) for *_, d in items))

    def status(self):
        return EngineStatus("fake", "fake-0", self.version, self.active, 0, 64, not self.swapping,
                            self.swapping, False, 1)  # fmt: skip

    async def shutdown(self):
        self.shutdowns += 1


@contextlib.asynccontextmanager
async def serving(engine: FakeEngine, **config):
    handle = build(engine, GeneratorConfig(**config))
    await start(handle, ready=True)
    try:
        async with client(handle, generator_pb2_grpc.GeneratorServiceStub, engine=engine) as s:
            yield s
    finally:
        if not engine.shutdowns:
            await handle.stop(0)
