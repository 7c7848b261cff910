"""An OpenEnv MCP environment as OpenEnv's docs write one (``MCPEnvironment`` with FastMCP tools,
served by ``create_app(..., CallToolAction, CallToolObservation)``), for tests of the env service's
OpenEnv client: tools ``calc(expression)`` and ``submit(answer)``; ``submit`` ends the episode
with reward 1.0 for the row's answer, else 0.0; ``calc`` of a bad expression raises (the tool's
error). ``reset(answer=...)`` takes the row's answer column.

Runs under its own interpreter with ``openenv-core`` 0.3 (fastmcp 4) installed, never imported by
relayrl's: ``python openenv_mcp_calc.py`` binds 127.0.0.1 on a free port, prints it, and serves.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State


class McpCalcEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("mcp_calc")

        @mcp.tool
        def calc(expression: str) -> str:
            """Evaluate an arithmetic expression of integers, + - * and parentheses.

            Args:
                expression: the expression, e.g. "12 * 34"
            """
            if not set(expression) <= set("0123456789+-*() ") or "**" in expression:
                raise ValueError(f"not an arithmetic expression: {expression!r}")
            return str(eval(expression, {"__builtins__": {}}))  # checked to digits and operators

        @mcp.tool
        def submit(answer: str) -> str:
            """Submit the final answer; ends the episode.

            Args:
                answer: the number
            """
            return f"submitted {answer}"

        super().__init__(mcp)
        self.answer = ""

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self.answer = str(kwargs.get("answer", ""))
        return Observation(done=False, reward=None)

    @property
    def state(self) -> State:
        return State(step_count=0)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": "MCP actions only"})

    def _scored(self, action: Action, obs: Observation) -> Observation:
        if isinstance(action, CallToolAction) and action.tool_name == "submit":
            obs.done = True
            obs.reward = 1.0 if str(action.arguments.get("answer", "")).strip() == self.answer else 0.0
        return obs

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, super().step(action, timeout_s=timeout_s, **kwargs))

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._scored(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))


app = create_app(
    McpCalcEnvironment, CallToolAction, CallToolObservation, env_name="mcp_calc", max_concurrent_envs=16
)

if __name__ == "__main__":
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)  # connections wait in the backlog until the server serves
    print(sock.getsockname()[1], flush=True)
    config = uvicorn.Config(app, log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])
    sys.exit(0)
