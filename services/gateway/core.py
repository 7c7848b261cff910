"""The gateway's sessions: opened and closed by the coordinator (``servicer.py``), used by the
agents over HTTP (``http.py``). One key per session; a closed or expired key stops working at
once. Admission is bounded: past ``max_in_flight`` requests being sampled, an agent gets 429
with Retry-After, as it does when the generators' own admission is full."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections import OrderedDict

from relayrl.gateway.api import (
    RESPONSES,
    Answer,
    BadRequest,
    Busy,
    ChatRequest,
    Forbidden,
    GatewayError,
    RewardSet,
    Unauthorized,
)
from relayrl.gateway.config import GatewayConfig
from relayrl.gateway.sessions import Session
from relayrl.gateway.upstream import Generators
from relayrl.gateway.v1 import gateway_pb2 as gw
from relayrl.generator.v1 import generator_pb2 as g

logger = logging.getLogger(__name__)
MAX_COMPONENTS = 32


class SessionLimit(RuntimeError):
    """``max_sessions`` sessions are open (OpenSession: RESOURCE_EXHAUSTED)."""


class UnknownSession(KeyError):
    """No open session has this key (CloseSession, SetReward: NOT_FOUND)."""


class GatewayCore:
    """Sessions by key, the generators, and the bound on requests in flight."""

    def __init__(self, config: GatewayConfig, generators: Generators, metrics=None):
        self.config = config
        self.model = config.model_name
        self.generators = generators
        self.metrics = metrics
        self.base_url = ""  # set once the HTTP API is bound
        self.http_port = 0  # the port it bound (http.port, or the free one 0 picked)
        self.sessions: dict[str, Session] = {}
        self.closed: OrderedDict[str, tuple[float, gw.CloseSessionResponse]] = OrderedDict()
        self.in_flight = 0

    # -- the coordinator's side --------------------------------------------------------------

    def open(self, req: gw.OpenSessionRequest) -> gw.OpenSessionResponse:
        self.sweep()
        if len(self.sessions) >= self.config.max_sessions:
            raise SessionLimit(f"{len(self.sessions)} sessions are open (gateway max_sessions)")
        sampling = g.SamplingParams()
        sampling.CopyFrom(req.sampling)
        sampling.n, sampling.fit_to_context = 1, True
        if not sampling.max_tokens:
            raise ValueError("sampling.max_tokens must be set: the most one call may generate")
        key = "rrl-" + secrets.token_urlsafe(24)
        self.sessions[key] = Session(
            key=key,
            episode_id=req.episode_id,
            sampling=sampling,
            max_episode_tokens=req.max_episode_tokens,
            max_calls=min(
                req.max_calls or self.config.max_calls_per_session, self.config.max_calls_per_session
            ),
            min_version=req.min_version,
            ttl_seconds=req.ttl_seconds or self.config.session_ttl_seconds,
            agent_reward=req.agent_reward,
        )
        self._gauge()
        return gw.OpenSessionResponse(session_key=key, base_url=self.base_url, model=self.model)

    def close(self, key: str) -> gw.CloseSessionResponse:
        if key in self.closed:
            return self.closed[key][1]
        session = self.sessions.get(key)
        if session is None:
            raise UnknownSession("no open session has this key (never opened, or expired)")
        out = session.close()  # before the session goes: should it fail, a retry finds it all
        del self.sessions[key]
        self.closed[key] = (time.monotonic(), out)
        while len(self.closed) > self.config.max_sessions:  # bounded, whatever the keep time
            self.closed.popitem(last=False)
        if self.metrics is not None:
            self.metrics.closed(out)
        self._gauge()
        return out

    def sweep(self) -> None:
        """Drop sessions past their TTL (none with a request being sampled) and closed answers
        past ``closed_keep_seconds``."""
        now = time.monotonic()
        idle = [k for k, s in self.sessions.items() if not s.in_flight and now - s.touched > s.ttl_seconds]
        for key in idle:
            logger.warning("session %s expired (no request for its TTL)", self.sessions[key].episode_id)
            del self.sessions[key]
        while self.closed and now - next(iter(self.closed.values()))[0] > self.config.closed_keep_seconds:
            self.closed.popitem(last=False)
        self._gauge()

    async def sweep_forever(self, every_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            self.sweep()

    # -- the agent's side --------------------------------------------------------------------

    def _session(self, key: str) -> Session:
        s = self.sessions.get(key)
        if s is None:
            why = "this session is closed" if key in self.closed else "unknown API key"
            raise Unauthorized(why)
        s.touched = time.monotonic()
        return s

    def check_key(self, key: str) -> None:
        self._session(key)

    async def complete(self, key: str, request: ChatRequest) -> Answer:
        session = self._session(key)
        if self.in_flight >= self.config.max_in_flight:
            raise Busy(
                f"{self.in_flight} requests are being sampled (gateway max_in_flight)",
                self.config.retry_after_seconds,
            )
        if session.in_flight >= self.config.max_in_flight_per_session:
            raise Busy(
                f"this session has {session.in_flight} requests being sampled "
                "(gateway max_in_flight_per_session)",
                self.config.retry_after_seconds,
            )
        request = session.resolve(request)  # previous_response_id: the dialogue it continues
        sampling = tool_sampling(session.sampling, request)
        plan = session.plan(request)
        sampling.max_tokens = plan.max_tokens
        self.in_flight += 1
        session.in_flight += 1
        t0 = time.monotonic()
        try:
            sample = await self.generators.generate(
                plan.prompt, sampling, session.episode_id, session.min_version, f"gw-{plan.prompt.prompt_id}"
            )
        except BaseException as e:  # no answer (an error, or the agent's request cancelled)
            session.unplan(plan)
            if self.metrics is not None and isinstance(e, GatewayError):
                self.metrics.failed(type(e).__name__)
            raise
        finally:
            self.in_flight -= 1
            session.in_flight -= 1
            session.touched = time.monotonic()  # its TTL counts from the answer, not the request
        if self.metrics is not None:
            self.metrics.call(time.monotonic() - t0, len(sample.completion_token_ids))
        if self.sessions.get(key) is not session:  # closed while it was sampled: nothing to record
            raise Unauthorized("this session was closed while the request was sampled")
        responses = request.api == RESPONSES
        answer_id = f"resp_{secrets.token_hex(24)}" if responses else f"chatcmpl-{secrets.token_hex(12)}"
        answer = session.record(plan, request, sample, answer_id if responses else "")
        return Answer(
            message=answer.message,
            finish_reason=answer.finish_reason,
            prompt_tokens=answer.prompt_tokens,
            completion_tokens=answer.completion_tokens,
            id=answer_id,
            created=int(time.time()),
        )

    def set_reward(self, key: str, reward: RewardSet, *, by_agent: bool = False) -> None:
        session = self.sessions.get(key)
        if session is None:
            raise Unauthorized("this session is closed" if key in self.closed else "unknown API key")
        if by_agent and not session.agent_reward:
            raise Forbidden(
                "this session's reward is not the agent's to set (the coordinator opens sessions "
                "with agent_reward only where the model cannot reach the reward call)"
            )
        check_reward(reward)
        session.reward = (float(reward.reward), dict(reward.components))

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.sessions(len(self.sessions))


def tool_sampling(session: g.SamplingParams, req: ChatRequest) -> g.SamplingParams:
    """The session's sampling with the request's tool choice and answer schema: "none" reads no
    calls out of the answer (it is all text); "required" and a named function are enforced by the
    generator while it samples, which needs the session's tool format, and so is the schema.

    >>> req = ChatRequest([], tool_choice="function", tool_name="calc")
    >>> s = tool_sampling(g.SamplingParams(tool_format="hermes", max_tokens=8), req)
    >>> g.ToolChoice.Name(s.tool_choice), s.tool_choice_function, s.max_tokens
    ('TOOL_CHOICE_FUNCTION', 'calc', 8)
    """
    out = g.SamplingParams()
    out.CopyFrom(session)
    out.json_schema = req.json_schema
    if req.tool_choice == "none":  # the agent wants text: calls are not read out of it
        out.tool_format = ""
    elif req.tool_choice in ("required", "function"):
        if not session.tool_format:
            raise BadRequest(
                f"tool_choice {req.tool_choice!r} cannot be enforced: this session reads no tool "
                "calls (its sampling has no tool_format)",
                param="tool_choice",
            )
        if req.tool_choice == "required":
            out.tool_choice = g.TOOL_CHOICE_REQUIRED
            out.single_tool_call = not req.parallel_tool_calls
        else:
            out.tool_choice, out.tool_choice_function = g.TOOL_CHOICE_FUNCTION, req.tool_name
    return out


def check_reward(r: RewardSet) -> None:
    """BadRequest unless the reward and its components are finite and few.

    >>> check_reward(RewardSet(1.0, {"correct": 1.0}))
    >>> check_reward(RewardSet(float("nan")))
    Traceback (most recent call last):
    ...
    relayrl.gateway.api.BadRequest: reward must be a finite number
    """
    if not isinstance(r.reward, int | float) or isinstance(r.reward, bool) or not math.isfinite(r.reward):
        raise BadRequest("reward must be a finite number", param="reward")
    if len(r.components) > MAX_COMPONENTS:
        raise BadRequest(f"at most {MAX_COMPONENTS} components", param="components")
    for name, v in r.components.items():
        if not isinstance(name, str) or not 0 < len(name) <= 64:
            raise BadRequest("component names are 1 to 64 characters", param="components")
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            raise BadRequest(f"component {name!r} must be a finite number", param="components")
