"""What the gateway's HTTP layer (``http.py``) and its sessions (``core.py``) say to each other:
a chat request already read out of OpenAI's JSON, the answer to render back, and the errors with
the HTTP status each one maps to. Nothing here knows HTTP or gRPC."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from relayrl.common.v1 import common_pb2

CHAT, RESPONSES = "chat", "responses"
"""``ChatRequest.api``: which OpenAI API the request came in by."""


@dataclass(frozen=True)
class ChatRequest:
    """A ``POST /v1/chat/completions`` or ``POST /v1/responses`` body, validated: both APIs are
    read into this one request, which the sessions sample and record the same way."""

    messages: list[common_pb2.ChatMessage]
    """The dialogue, oldest first (roles system, user, assistant, tool)."""
    tools_json: str = ""
    """The request's ``tools`` as a JSON array (``json.dumps`` of the list as sent), "" for none."""
    max_tokens: int | None = None
    """The agent's ``max_tokens`` / ``max_completion_tokens``: it can only lower the session's."""
    model: str = ""
    stream: bool = False
    tool_choice: str = "auto"
    """"auto" (the model may call the tools), "none" (its answer is text, calls not read out),
    "required" (one or more calls, enforced while sampling) or "function" (one call of
    ``tool_name``, enforced)."""
    tool_name: str = ""
    """With ``tool_choice`` "function": the tool to call."""
    parallel_tool_calls: bool = True
    """False: at most one call per answer (enforced under "required")."""
    json_schema: str = ""
    """The answer's JSON schema (``response_format`` / ``text.format`` json_schema or
    json_object), JSON text, enforced while the model samples; "" for free text."""
    prefix_keys: tuple[bytes, ...] = ()
    """``history.prefix_keys(messages)``: what the session matches against its calls. Filled by
    the parsers (off the event loop for a large body); empty: the session computes it."""
    api: str = CHAT
    """``CHAT`` or ``RESPONSES``: the answer's id ("chatcmpl-..." or "resp_...") and shape."""
    previous_response_id: str = ""
    """Responses API: the answer this request continues (its dialogue goes before
    ``messages``); "" for none."""
    instructions: bool = False
    """Responses API: ``messages[0]`` is the request's ``instructions`` (a system message),
    which a later request's ``previous_response_id`` does not carry over (OpenAI's rule)."""
    malformed_as_calls: bool = False
    """The agent asked for a call the model wrote malformed as a call (``relayrl_parse_error``)
    rather than as text (``relayrl_malformed_calls: "calls"``)."""


@dataclass(frozen=True)
class Answer:
    """The model's turn, for the agent."""

    message: common_pb2.ChatMessage
    """role "assistant"; ``content`` the text outside the tool calls; ``tool_calls`` the calls
    that parsed (with their ids)."""
    finish_reason: str
    """"stop", "tool_calls" or "length"."""
    prompt_tokens: int
    completion_tokens: int
    id: str = ""
    """The answer's id ("chatcmpl-..." or, for the Responses API, "resp_...")."""
    created: int = 0
    """Unix time the answer was made."""


class GatewayError(Exception):
    """A request the gateway refuses: ``status`` is the HTTP status, ``code`` OpenAI's error code."""

    status = 500
    code = "internal_error"
    kind = "server_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None):
        super().__init__(message[:1000])
        if code is not None:
            self.code = code
        self.param = param


class BadRequest(GatewayError):
    status, code, kind = 400, "invalid_request", "invalid_request_error"


class ContextFull(BadRequest):
    """The segment's token budget or the model's context has no room for another turn."""

    code = "context_length_exceeded"


class Unauthorized(GatewayError):
    status, code, kind = 401, "invalid_api_key", "authentication_error"


class Forbidden(GatewayError):
    status, code, kind = 403, "permission_denied", "permission_error"


class NotFound(GatewayError):
    status, code, kind = 404, "model_not_found", "invalid_request_error"


class TooLarge(GatewayError):
    status, code, kind = 413, "request_too_large", "invalid_request_error"


class Busy(GatewayError):
    """Admission is full (too many requests in flight, or the generators refuse more): try
    again after ``retry_after`` seconds (HTTP 429 with ``Retry-After``)."""

    status, code, kind = 429, "rate_limit_exceeded", "rate_limit_error"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(GatewayError):
    """No generator can answer now (HTTP 503)."""

    status, code, kind = 503, "service_unavailable", "server_error"


class UpstreamTimeout(GatewayError):
    status, code, kind = 504, "timeout", "server_error"


@dataclass
class RewardSet:
    reward: float
    components: dict[str, float] = field(default_factory=dict)


class Sessions(Protocol):
    """The sessions the HTTP layer serves (``core.GatewayCore``)."""

    model: str
    """The one model name served (``GET /v1/models``)."""

    def check_key(self, key: str) -> None:
        """Raise ``Unauthorized`` unless ``key`` is an open session's."""

    async def complete(self, key: str, request: ChatRequest) -> Answer:
        """Sample the model's next turn of ``request`` in session ``key``. Raises a
        ``GatewayError`` (Unauthorized, BadRequest, ContextFull, Busy, Unavailable, ...)."""

    def set_reward(self, key: str, reward: RewardSet, *, by_agent: bool = False) -> None:
        """Record the session's reward (``POST /rl/set_reward``: ``by_agent``). Unauthorized,
        BadRequest; Forbidden when the agent sets it and its session does not allow that."""
