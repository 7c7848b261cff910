"""A scripted agent that plays the calc task through an OpenAI-compatible chat API: the
``calc-harness`` env's agent, and the model of a user's own harness agent.

Standard library only (``urllib``, ``json``): it runs under Debian's python3 in the sandbox, where
relayrl cannot be imported; ``arith.py`` (calc's arithmetic) is copied in beside it.

In: on stdin ``{"messages": [...], "tools": [...], "max_turns": N}`` (the task env's first
messages and tools); ``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL`` in the environment.
Loop, at most N requests: POST ``chat/completions`` with the dialogue so far; append the assistant
message as returned; answer each tool call it makes with a "tool" message (the calc result, or
``error: ...`` worded as ``relayrl.env.tools`` words calc's errors) and go on; a message without
calls is the final answer. A reply cut at its token budget (finish reason "length") or a request
refused because the dialogue outgrew the context (HTTP 400, code ``context_length_exceeded``)
ends the episode cut, without an answer.

Out: one JSON line on stdout, ``{"final": <text or null>, "turns": n, "tool_calls": k,
"truncated": bool}``, exit status 0. An HTTP error (after up to ``MAX_RETRIES`` waits on 429, the
gateway's "come back later", as OpenAI's own client does) or a reply that is not a chat
completion: the error on stderr, exit status 3, no report (the harness masks the episode).
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request

if __package__:  # imported as relayrl.env.agents.calc_agent (tests, the host)
    from relayrl.env import arith
else:  # run as a program in the sandbox: arith.py is beside it
    import arith

REQUEST_SECONDS = 120.0
"""Longest wait for one reply."""
MAX_RETRIES = 4
"""Waits on HTTP 429 before a request is given up."""
MAX_RETRY_SECONDS = 30.0
MAX_REPLY_BYTES = 16 << 20
MAX_ERROR_CHARS = 500
"""An error the model reads is cut to this many characters (as ``relayrl.env.tools`` cuts it)."""
TOOL = "calc"
PARSE_ERRORS = {  # what the model reads of a call that did not parse, as relayrl.env.tools words it
    "invalid_json": "the tool call's body is not a JSON object",
    "unclosed_block": "the tool call has no closing tag",
    "missing_name": 'the tool call has no string "name"',
    "invalid_arguments": 'the tool call\'s "arguments" is not a JSON object',
}
GATEWAY_FAILED = 3
"""Exit status when the API failed (no report printed)."""


class GatewayError(Exception):
    """The API answered with an error, or not with a chat completion."""


class ContextFull(Exception):
    """The API refused the request: the dialogue is longer than the model's context."""


def cut(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how much was left out.

    >>> cut("abcdef", 3)
    'abc... (3 more characters)'
    """
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def answer(call: dict) -> str:
    """What the model reads for one tool call: calc's result, or the error as ``ToolEnv`` words it.

    >>> answer({"function": {"name": "calc", "arguments": '{"expression": "123 * 456"}'}})
    '56088'
    >>> answer({"function": {"name": "calc", "arguments": '{"expression": "2 / 0"}'}})
    'error: division by zero'
    >>> answer({"function": {"name": "calc", "arguments": "{}"}})
    "error: calc: missing a required argument: 'expression'"
    >>> answer({"function": {"name": "calc", "arguments": '{"expression": 5}'}})
    "error: calc: argument 'expression' must be string, got 5"
    >>> answer({"function": {"name": "python", "arguments": "{}"}})
    "error: no tool named 'python'; tools: calc"
    >>> answer({"function": {"name": "", "arguments": "<tool ="}, "relayrl_parse_error": "unclosed_block"})
    'error: the tool call has no closing tag (got: <tool =)'
    """
    function = _function(call)
    name = function.get("name")
    parse = call.get("relayrl_parse_error") if isinstance(call, dict) else None
    if parse:  # the gateway read a call it could not parse (its raw text as the arguments)
        raw = function.get("arguments")
        got = f" (got: {cut(str(raw), 200)})" if raw else ""
        return f"error: {PARSE_ERRORS.get(str(parse), 'the tool call was not parsed')}{got}"
    if name != TOOL:
        return f"error: no tool named {cut(str(name), 128)!r}; tools: {TOOL}"
    raw = function.get("arguments")
    if isinstance(raw, dict):
        args = raw
    else:
        try:
            args = json.loads(raw or "{}")
        except (ValueError, TypeError, RecursionError) as e:
            return f"error: {TOOL}: {cut(f'arguments are not valid JSON: {e}')}"
    if not isinstance(args, dict):
        return f"error: {TOOL}: arguments must be a JSON object, got {type(args).__name__}"
    # In the order ``inspect.Signature.bind`` finds them (``ToolEnv`` checks arguments with it).
    if "expression" not in args:
        return f"error: {TOOL}: missing a required argument: 'expression'"
    extra = [k for k in args if k != "expression"]
    if extra:
        return f"error: {TOOL}: {cut(f'got an unexpected keyword argument {extra[0]!r}')}"
    if not isinstance(args["expression"], str):
        return (
            f"error: {TOOL}: argument 'expression' must be string, got {json.dumps(args['expression'])[:60]}"
        )
    try:
        return arith.format_number(arith.evaluate(args["expression"]))
    except ValueError as e:
        return f"error: {cut(str(e))}"


def _function(call: object) -> dict:
    """The ``function`` object of a tool call ({} when it has none)."""
    function = call.get("function") if isinstance(call, dict) else None
    return function if isinstance(function, dict) else {}


class Client:
    """POSTs chat completions to ``base_url`` with a bearer key; never through a proxy."""

    def __init__(self, base_url: str, api_key: str, model: str, timeout: float = REQUEST_SECONDS):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key, self.model, self.timeout = api_key, model, timeout
        # No proxy from the environment: the gateway is the only place this agent talks to.
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def complete(self, messages: list, tools: list) -> dict:
        """The first choice of a chat completion: ``{"message": ..., "finish_reason": ...}``."""
        # A call the model wrote malformed comes as a call with its relayrl_parse_error (not the
        # gateway's default, text), so this agent answers it as the white-box env does.
        body = {"model": self.model, "messages": messages, "relayrl_malformed_calls": "calls"}
        if tools:
            body["tools"] = tools
        data = json.dumps(body).encode()
        for attempt in range(MAX_RETRIES + 1):
            request = urllib.request.Request(self.url, data=data, method="POST")
            request.add_header("Content-Type", "application/json")
            request.add_header("Authorization", f"Bearer {self.api_key}")
            try:
                with self.opener.open(request, timeout=self.timeout) as response:
                    return _choice(response.read(MAX_REPLY_BYTES + 1))
            except urllib.error.HTTPError as e:
                text = e.read(64 << 10).decode("utf-8", "replace")
                if e.code == 429 and attempt < MAX_RETRIES:
                    time.sleep(_retry_after(e.headers.get("Retry-After"), attempt))
                    continue
                if e.code == 400 and _error_code(text) == "context_length_exceeded":
                    raise ContextFull(cut(text)) from None
                raise GatewayError(f"HTTP {e.code} from {self.url}: {cut(text)}") from None
            except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
                raise GatewayError(f"no reply from {self.url}: {e}") from None
        raise AssertionError("unreachable")  # the last attempt returns or raises


def _retry_after(header: str | None, attempt: int) -> float:
    """Seconds to wait before retrying a 429: the server's Retry-After, else 1, 2, 4, ... (capped).

    >>> _retry_after("3", 0), _retry_after(None, 2), _retry_after("soon", 9)
    (3.0, 4.0, 30.0)
    """
    try:
        wait = float(header)
    except (TypeError, ValueError):
        wait = 2.0**attempt
    return min(max(wait, 0.0), MAX_RETRY_SECONDS)


def _error_code(text: str) -> str:
    """The ``error.code`` of an OpenAI error body, or "".

    >>> _error_code('{"error": {"code": "context_length_exceeded"}}'), _error_code("oops")
    ('context_length_exceeded', '')
    """
    try:
        error = json.loads(text).get("error")
        return str(error.get("code") or "") if isinstance(error, dict) else ""
    except (ValueError, AttributeError):
        return ""


def _choice(raw: bytes) -> dict:
    if len(raw) > MAX_REPLY_BYTES:
        raise GatewayError(f"the reply is larger than {MAX_REPLY_BYTES} bytes")
    try:
        choice = json.loads(raw)["choices"][0]
        if not isinstance(choice["message"], dict):
            raise TypeError("message is not an object")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise GatewayError(
            f"the reply is not a chat completion ({e!r:.100}): {cut(raw.decode('utf-8', 'replace'))}"
        ) from None
    return choice


def play(spec: dict, client: Client) -> dict:
    """Play one episode; the report. Raises GatewayError when the API fails."""
    messages = list(spec["messages"])
    tools = list(spec.get("tools") or [])
    report = {"final": None, "turns": 0, "tool_calls": 0, "truncated": False}
    for _ in range(int(spec["max_turns"])):
        try:
            choice = client.complete(messages, tools)
        except ContextFull:
            report["truncated"] = True
            break
        message = dict(choice["message"])
        message["role"] = "assistant"
        messages.append(message)
        report["turns"] += 1
        if choice.get("finish_reason") == "length":  # cut at its token budget: no answer
            report["truncated"] = True
            break
        calls = message.get("tool_calls") or []
        if not calls:
            report["final"] = message.get("content") or ""
            break
        for call in calls:
            call_id = call.get("id", "") if isinstance(call, dict) else ""
            name = str(_function(call).get("name", ""))[:128]
            messages.append(
                {"role": "tool", "tool_call_id": str(call_id), "name": name, "content": answer(call)}
            )
            report["tool_calls"] += 1
    return report


def main() -> int:
    spec = json.load(sys.stdin)
    client = Client(
        os.environ["OPENAI_BASE_URL"],
        os.environ.get("OPENAI_API_KEY", ""),
        os.environ.get("OPENAI_MODEL", ""),
    )
    try:
        report = play(spec, client)
    except GatewayError as e:
        print(f"calc_agent: {e}", file=sys.stderr)
        return GATEWAY_FAILED
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
