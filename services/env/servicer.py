"""EnvService RPCs: proto -> domain (bounds checked), the session table, domain -> proto.

A request past the contract's bounds is INVALID_ARGUMENT naming the field. What the table raises
maps as ``common.rpc`` says: an unknown env or refused task INVALID_ARGUMENT, an unknown, closed
or expired session NOT_FOUND, a step out of order FAILED_PRECONDITION, a full replica
RESOURCE_EXHAUSTED, an env that crashed while opening INTERNAL.
"""

from __future__ import annotations

import json
import os
import socket

from relayrl.common.rpc import DeadlineExceeded, InvalidRequest, ServiceError, map_errors
from relayrl.common.v1 import common_pb2
from relayrl.env import metrics
from relayrl.env.base import Action, GatewayEndpoint, Outcome, ToolCall, ToolStatus
from relayrl.env.config import EnvConfig
from relayrl.env.forward import gateway_address
from relayrl.env.sessions import SessionTable
from relayrl.env.v1 import env_pb2, env_pb2_grpc

MAX_ID_CHARS = 256
MAX_TASK_BYTES = 1 << 20
MAX_TEXT_BYTES = 256 << 10
MAX_TOOL_CALLS = 64
MAX_ARGUMENTS_BYTES = 64 << 10
MAX_CALL_ID_CHARS = 64
MAX_TOOL_NAME_CHARS = 128
MAX_GATEWAY_URL_CHARS = 512
MAX_GATEWAY_KEY_CHARS = 256
MAX_GATEWAY_MODEL_CHARS = 256
MIN_TIME_SECONDS = 0.05
"""A call with less time left than this is DEADLINE_EXCEEDED before any env code runs."""

_FINISH = {
    common_pb2.FINISH_REASON_UNSPECIFIED: "",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
_PARSE = {
    common_pb2.TOOL_CALL_PARSE_OK: "ok",
    common_pb2.TOOL_CALL_PARSE_INVALID_JSON: "invalid_json",
    common_pb2.TOOL_CALL_PARSE_UNCLOSED_BLOCK: "unclosed_block",
    common_pb2.TOOL_CALL_PARSE_MISSING_NAME: "missing_name",
    common_pb2.TOOL_CALL_PARSE_INVALID_ARGUMENTS: "invalid_arguments",
}
_TOOL_STATUS = {s: getattr(env_pb2, f"TOOL_STATUS_{s.name}") for s in ToolStatus}
_OUTCOME = {o: getattr(env_pb2, f"OUTCOME_{o.name}") for o in Outcome}


def _check_id(value: str, field: str, required: bool = False) -> None:
    if required and not value:
        raise InvalidRequest(f"{field} is required")
    if len(value) > MAX_ID_CHARS:
        raise InvalidRequest(f"{field} is longer than {MAX_ID_CHARS} characters")


def task_from_json(text: str) -> dict:
    if len(text.encode()) > MAX_TASK_BYTES:
        raise InvalidRequest(f"task_json is larger than {MAX_TASK_BYTES} bytes")
    try:
        task = json.loads(text) if text else {}
    except (ValueError, RecursionError) as e:
        raise InvalidRequest(f"task_json is not valid JSON: {e}") from None
    if not isinstance(task, dict):
        raise InvalidRequest(f"task_json must be a JSON object, got {type(task).__name__}")
    return task


def gateway_from_proto(request: env_pb2.ResetRequest) -> GatewayEndpoint | None:
    """ResetRequest.gateway, bounds checked; None when unset."""
    if not request.HasField("gateway"):
        return None
    g = request.gateway
    if not g.base_url:
        raise InvalidRequest("gateway.base_url is required")
    if len(g.base_url) > MAX_GATEWAY_URL_CHARS:
        raise InvalidRequest(f"gateway.base_url is longer than {MAX_GATEWAY_URL_CHARS} characters")
    if not g.base_url.isprintable() or " " in g.base_url:
        raise InvalidRequest("gateway.base_url has spaces or control characters")
    try:
        gateway_address(g.base_url)
    except ValueError as e:  # not http(s), no host, a port out of range
        raise InvalidRequest(str(e)) from None
    for field, value, limit in (
        ("api_key", g.api_key, MAX_GATEWAY_KEY_CHARS),
        ("model", g.model, MAX_GATEWAY_MODEL_CHARS),
    ):
        if len(value) > limit:
            raise InvalidRequest(f"gateway.{field} is longer than {limit} characters")
        if not value.isprintable():  # it goes into an HTTP header and an environment variable
            raise InvalidRequest(f"gateway.{field} has control characters")
    return GatewayEndpoint(g.base_url, g.api_key, g.model)


def action_from_proto(a: env_pb2.Action) -> Action:
    if len(a.text.encode()) > MAX_TEXT_BYTES:
        raise InvalidRequest(f"action.text is larger than {MAX_TEXT_BYTES} bytes")
    if len(a.tool_calls) > MAX_TOOL_CALLS:
        raise InvalidRequest(f"action.tool_calls has {len(a.tool_calls)} calls; at most {MAX_TOOL_CALLS}")
    calls = []
    for i, c in enumerate(a.tool_calls):
        if len(c.arguments_json.encode()) > MAX_ARGUMENTS_BYTES:
            raise InvalidRequest(
                f"action.tool_calls[{i}].arguments_json is larger than {MAX_ARGUMENTS_BYTES} bytes"
            )
        if len(c.id) > MAX_CALL_ID_CHARS:
            raise InvalidRequest(f"action.tool_calls[{i}].id is longer than {MAX_CALL_ID_CHARS} characters")
        if len(c.name) > MAX_TOOL_NAME_CHARS:
            raise InvalidRequest(
                f"action.tool_calls[{i}].name is longer than {MAX_TOOL_NAME_CHARS} characters"
            )
        calls.append(ToolCall(c.id, c.name, c.arguments_json, _PARSE.get(c.parse, "unspecified")))
    return Action(a.text, tuple(calls), _FINISH.get(a.finish_reason, ""))


def message_to_proto(m: dict) -> common_pb2.ChatMessage:
    return common_pb2.ChatMessage(
        role=m["role"], content=m["content"], tool_call_id=m.get("tool_call_id", ""), name=m.get("name", "")
    )


def _code(e: BaseException) -> str:
    if isinstance(e, ServiceError):
        return e.code.name
    return "INTERNAL" if isinstance(e, Exception) else "CANCELLED"


class EnvServicer(env_pb2_grpc.EnvServiceServicer):
    def __init__(self, table: SessionTable, config: EnvConfig):
        self.table = table
        self.config = config
        self.replica_id = config.replica_id or f"{socket.gethostname()}:{os.getpid()}"

    def _limit(self, context) -> float:
        """Time env code may take in this call: the configured limit, within the caller's deadline."""
        left = context.time_remaining() if context is not None else None
        if left is not None and left < MIN_TIME_SECONDS:
            raise DeadlineExceeded(f"{left:.3f}s left of the caller's deadline: nothing was run")
        limit = self.config.step_timeout_seconds
        return limit if left is None else min(limit, left - MIN_TIME_SECONDS / 2)

    async def _counted(self, rpc: str, work):
        code = "OK"
        try:
            return await work  # wait: the session table bounds env code by _limit (within the deadline)
        except BaseException as e:
            code = _code(e)
            raise
        finally:
            metrics.REQUESTS.labels(rpc, code).inc()

    @map_errors
    async def ListEnvs(self, request, context):
        return env_pb2.ListEnvsResponse(
            envs=[
                env_pb2.EnvInfo(
                    name=s.name,
                    tools_json=s.tools_json,
                    expects_tools=s.cls.expects_tools,
                    max_turns=s.cls.max_turns,
                    description=s.cls.description,
                    black_box=s.cls.black_box,
                )
                for s in self.table.specs.values()
            ],
            max_sessions=self.config.max_sessions,
            open_sessions=self.table.open_count(),
            replica_id=self.replica_id,
            sandbox_tier=self.table.sandbox.tier if self.table.sandbox is not None else "",
        )

    @map_errors
    async def Reset(self, request, context):
        return await self._counted("Reset", self._reset(request, context))

    async def _reset(self, request, context):
        _check_id(request.request_id, "request_id")
        _check_id(request.episode_id, "episode_id", required=True)
        if not request.env:
            raise InvalidRequest("env is required")
        task = task_from_json(request.task_json)
        gateway = gateway_from_proto(request)
        opened = await self.table.open(
            request.env,
            task,
            request.seed,
            request.episode_id,
            request.attempt,
            self._limit(context),
            gateway,
        )
        return env_pb2.ResetResponse(
            session_id=opened.session_id,
            messages=[message_to_proto(m) for m in opened.messages],
            tools_json=opened.tools_json,
            lease_seconds=opened.lease_seconds,
            max_turns=opened.max_turns,
        )

    @map_errors
    async def Step(self, request, context):
        return await self._counted("Step", self._step(request, context))

    async def _step(self, request, context):
        _check_id(request.request_id, "request_id")
        _check_id(request.session_id, "session_id", required=True)
        action = action_from_proto(request.action)
        out = await self.table.step(request.session_id, request.step_index, action, self._limit(context))
        return env_pb2.StepResponse(
            observations=[message_to_proto(m) for m in out.observations],
            done=out.done,
            tool_results=[
                env_pb2.ToolResult(tool_call_id=r.tool_call_id, name=r.name, status=_TOOL_STATUS[r.status])
                for r in out.tool_results
            ],
        )

    @map_errors
    async def Close(self, request, context):
        return await self._counted("Close", self._close(request, context))

    async def _close(self, request, context):
        _check_id(request.request_id, "request_id")
        _check_id(request.session_id, "session_id", required=True)
        r = await self.table.close(request.session_id, self._limit(context))
        return env_pb2.CloseResponse(
            reward=r.reward,
            components=r.components,
            outcome=_OUTCOME[r.outcome],
            failure_kind=r.failure_kind,
            failure_reason=r.failure_reason,
        )
