"""The gateway in front of a real generator servicer on a scripted model, all on 127.0.0.1 port 0,
for tests of agent frameworks through the gateway (seconds, no vLLM).

``ScriptedEngine`` is a ``GenerationEngine`` whose completions a ``CalcPolicy`` writes, as a model
that learned the calc task would: call ``calc`` for 12 * 34, then answer (``final_answer`` where
the agent offers that tool, else text). It runs the real chat codec (the tiny model's tokenizer
and template: renders, bridges, the hermes parser) and records every sample it makes, so a test
checks the gateway's segments against the tokens "sampled". A completion sampled under an
enforced tool choice (``PromptIn.constraint``) is checked against that constraint with xgrammar
and the tiny tokenizer (when xgrammar is installed): the structural tag the generator hands vLLM
must accept what the policy writes. ``stack`` serves the generator and a gateway replica (gRPC +
HTTP) and opens sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from types import SimpleNamespace
from urllib.parse import urlsplit

from relayrl.common.grpc_server import start
from relayrl.common.serving import ServeConfig
from relayrl.generator.config import GeneratorConfig
from relayrl.generator.engine import EngineStatus, SampleOut
from relayrl.generator.server import build as build_generator

from tests.kit.generator import FakeEngine

CALL = '<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'
QUESTION = "What is 12 * 34? Use the calc tool."
ANSWER = "408"
MALFORMED = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12 * 34"\n</tool_call>'
"""A call whose JSON never closes its arguments (TOOL_CALL_PARSE_INVALID_JSON)."""
CUT = '<tool_call>\n{"name": "calc", "arguments": {"expression": "12 *'
"""A call cut at the token budget (TOOL_CALL_PARSE_UNCLOSED_BLOCK, finish reason "length")."""


@dataclass
class CalcPolicy:
    """What the scripted model writes for a prompt (its text decoded with special tokens): calc
    until it has read ``steps`` results, then the answer. ``malformed``: the first completion is
    ``MALFORMED`` (or ``CUT`` under a constraint, the only malformed call a grammar lets
    through)."""

    malformed: bool = False
    steps: int = 1
    wrote: int = 0

    def __call__(
        self, prompt: str, names: list[str], function: str, json_answer: bool = False
    ) -> tuple[str, str]:
        """``(text, finish reason)``; ``names``: the tools a constraint allows ([] when free);
        ``json_answer``: the answer must be JSON (``{"answer": 408}``)."""
        self.wrote += 1
        if self.malformed and self.wrote == 1:
            return (CUT, "length") if names else (MALFORMED, "stop")
        answered = prompt.rsplit(QUESTION, 1)[-1].count(ANSWER) >= self.steps
        offered = names or [n for n in ("calc", "final_answer") if f'"{n}"' in prompt]
        if function:
            name = function
        elif not answered and "calc" in offered:
            name = "calc"
        elif answered and "final_answer" in offered:
            name = "final_answer"
        elif json_answer:
            return json.dumps({"answer": int(ANSWER)}), "stop"
        elif names:
            name = names[0]
        else:
            return f"12 * 34 = {ANSWER}.", "stop"
        args = {"expression": "12 * 34"} if name == "calc" else {"answer": ANSWER}
        return CALL.format(name=name, args=json.dumps(args)), "stop"


@dataclass
class Sampled:
    prompt_ids: list[int]
    completion_ids: list[int]
    constraint: str


class ScriptedEngine(FakeEngine):
    """A ``FakeEngine`` whose completions ``policy`` writes (see the module docstring)."""

    def __init__(self, policy: CalcPolicy | None = None):
        super().__init__(delay=0)
        self.policy = policy or CalcPolicy()
        self.sampled: list[Sampled] = []

    def encode_messages(self, messages, tools=None):
        return self.chat_codec().render(messages, tools)  # as the vLLM engine renders them

    def encode_text(self, text):
        return self.chat_codec().encode(text)

    def status(self):
        return EngineStatus(
            "scripted", "scripted-0", self.version, self.active, 0, 1 << 16, True, False, False, 1
        )

    async def generate(self, request_id, prompts, spec):
        codec = self.chat_codec()
        (stop,) = codec.end_of_turn_ids
        self.calls.append((request_id, prompts, spec))
        for p in prompts:
            names, json_answer = constraint_names(p.constraint)
            function = names[0] if spec.tool_choice == "function" else ""
            text, reason = self.policy(codec.decode(p.token_ids), names, function, json_answer)
            ids = codec.encode(text) + ([stop] if reason == "stop" else [])
            if p.constraint:
                check_constraint(p.constraint, ids, codec.tokenizer, stop)
            self.sampled.append(Sampled(list(p.token_ids), ids, p.constraint))
            await asyncio.sleep(0)
            yield SampleOut(
                prompt_id=p.prompt_id,
                sample_index=0,
                prompt_token_ids=p.token_ids,
                token_ids=ids,
                logprobs=[-0.25] * len(ids),
                finish_reason=reason,
                version_spans=[(self.version, 0, len(ids))],
                text=codec.tokenizer.decode(ids, skip_special_tokens=True),
                replica_id="scripted-0",
            )


def constraint_names(constraint: str) -> tuple[list[str], bool]:
    """The tool names a structural tag lets a completion call ([] for none), and whether it
    lets it answer in JSON instead."""
    if not constraint:
        return [], False
    fmt = json.loads(constraint)["format"]
    formats = fmt["elements"] if fmt["type"] == "or" else [fmt]
    tags = [t for f in formats for t in f.get("tags", [])]
    names = [json.loads(t["begin"].split('"name": ', 1)[1].split(", ", 1)[0]) for t in tags]
    return names, any(f["type"] == "json_schema" for f in formats)


def check_constraint(constraint: str, ids: list[int], tokenizer, stop: int) -> None:
    """Assert that xgrammar, compiling ``constraint`` for ``tokenizer``, accepts ``ids`` (a cut
    completion as far as it goes; a whole one up to its end). A no-op without xgrammar."""
    try:
        import xgrammar as xgr
    except ImportError:
        return
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[stop])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(constraint))
    for i, t in enumerate(ids):
        assert matcher.accept_token(t), f"the constraint refuses token {i} of {tokenizer.decode(ids)!r}"
    assert ids[-1] != stop or matcher.is_terminated()


@contextlib.asynccontextmanager
async def stack(policy: CalcPolicy | None = None, **gateway_config):
    """A generator (``ScriptedEngine``) and a gateway replica on 127.0.0.1; yields ``engine``,
    ``core`` (the gateway's sessions), ``rpc`` (its gRPC stub), ``port`` (its HTTP port) and
    ``open(episode_id, budget, **sampling)``, which opens a session (``budget``: its
    ``max_episode_tokens``) and returns its OpenSessionResponse."""
    from relayrl.gateway.config import GatewayConfig, HttpConfig
    from relayrl.gateway.server import build as build_gateway
    from relayrl.gateway.v1 import gateway_pb2 as gw
    from relayrl.gateway.v1 import gateway_pb2_grpc as gwg
    from relayrl.generator.v1 import generator_pb2 as g

    from tests.kit.serving import client

    engine = ScriptedEngine(policy)
    gen = build_generator(engine, GeneratorConfig())
    await start(gen, ready=True)
    config = GatewayConfig(
        serve=ServeConfig(port=0),
        http=HttpConfig(port=0),
        generators=[f"127.0.0.1:{gen.port}"],
        **gateway_config,
    )
    handle, core = await build_gateway(config)
    await start(handle, ready=True)
    (stop,) = engine.chat_codec().end_of_turn_ids
    try:
        async with client(handle, gwg.GatewayServiceStub) as rpc:

            async def open_(
                episode_id: str = "e/0", budget: int = 4096, **sampling
            ) -> gw.OpenSessionResponse:
                given = {"max_tokens": 64, "stop_token_ids": [stop], "tool_format": "hermes", "seed": 1}
                params = g.SamplingParams(**{**given, **sampling})
                req = gw.OpenSessionRequest(episode_id=episode_id, sampling=params, max_episode_tokens=budget)
                return await rpc.stub.OpenSession(req, timeout=10)

            async def close(key: str) -> gw.CloseSessionResponse:
                return await rpc.stub.CloseSession(gw.CloseSessionRequest(session_key=key), timeout=10)

            yield SimpleNamespace(
                engine=engine, core=core, rpc=rpc, port=urlsplit(core.base_url).port, open=open_, close=close
            )
    finally:
        await handle.stop(0)
        await gen.stop(0)


def segments_are_the_sampled_tokens(closed, engine: ScriptedEngine) -> None:
    """Every segment is its calls' samples, as the engine made them: the first call's prompt, then
    each completion and the bridge tokens between them (mask 0 exactly there)."""
    made = {tuple(s.prompt_ids + s.completion_ids): s for s in engine.sampled}
    for seg in closed.segments:
        assert list(seg.sample.prompt_token_ids) == list(seg.calls[0].prompt_token_ids)
        completion, mask = [], []
        for k, call in enumerate(seg.calls):
            s = made[tuple(call.prompt_token_ids) + tuple(call.completion_token_ids)]  # sampled, exactly
            if k:
                prefix = [*seg.sample.prompt_token_ids, *completion]
                assert s.prompt_ids[: len(prefix)] == prefix  # the bridge extended the exact ids
                bridge = s.prompt_ids[len(prefix) :]
                completion += bridge
                mask += [0.0] * len(bridge)
            completion += s.completion_ids
            mask += [1.0] * len(s.completion_ids)
        assert list(seg.sample.completion_token_ids) == completion
        assert list(seg.loss_mask) == mask
