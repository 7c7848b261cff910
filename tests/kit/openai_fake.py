"""A scripted OpenAI chat-completions server on 127.0.0.1 for tests of black-box agents (the
gateway's stand-in), and a black-box env plugin for tests of the env service's gateway plumbing:
``tests.kit.openai_fake:GatewayEcho``."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from relayrl.env.base import Action, Env, Reward, StepAnswer


def tool_calls(*calls: tuple[str, str, str], finish: str = "tool_calls") -> tuple[int, dict]:
    """A reply whose message calls tools: each call (id, name, arguments JSON text)."""
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
        ],
    }
    return 200, {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }


def answer(text: str, finish: str = "stop") -> tuple[int, dict]:
    """A reply whose message is text."""
    message = {"role": "assistant", "content": text}
    return 200, {
        "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
    }


def error(status: int, code: str, message: str = "refused") -> tuple[int, dict]:
    return status, {"error": {"message": message, "type": "invalid_request_error", "code": code}}


class FakeOpenAI:
    """``POST .../chat/completions`` answers each request with the next of ``replies`` (status,
    JSON body), then 500; ``requests`` records (path, Authorization header, body) of each."""

    def __init__(self, replies: list[tuple[int, dict]]):
        self.replies = list(replies)
        self.requests: list[tuple[str, str | None, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                fake.requests.append((self.path, self.headers.get("Authorization"), body))
                status, reply = fake.replies.pop(0) if fake.replies else error(500, "no_more_replies")
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 429:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, args=(0.05,), name="fake-openai", daemon=True
        )
        self.thread.start()
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def __enter__(self) -> FakeOpenAI:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class GatewayEcho(Env):
    """A black-box env without a sandbox: its first message shows the gateway it was given (the
    key only by length)."""

    name = "test/gateway-echo"
    description = "shows the gateway endpoint it got"
    black_box = True
    max_turns = 1

    def reset(self, task: dict, seed: int) -> list[dict]:
        g = self.gateway
        return [{"role": "user", "content": f"{g.base_url} {g.model} {len(g.api_key)}"}]

    def step(self, action: Action) -> StepAnswer:
        return [], True, []

    def reward(self) -> Reward:
        return Reward(1.0)
