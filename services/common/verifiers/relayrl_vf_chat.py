"""relayrl's harness for verifiers tasksets that bring none: a chat loop in the rollout's own
process (verifiers' default harness, ``bash``, runs a uv script and installs uv from the internet
at its first run, which a sandbox cannot reach). It sends the task's messages, and the tools of
the task's MCP tool servers, to the rollout's endpoint (verifiers' interception server, which
forwards to the gateway), calls each tool the model asks for, and sends the answers back, until
a reply calls none; verifiers' ``max_turns`` bounds the calls. A call whose arguments are not a
JSON object is answered with an error, as a tool that refused it would be: the model's mistake
is the policy's, scored by the rubric.

A verifiers harness module (``__all__`` exports its one Harness), copied beside the agent.
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

MAX_CALLS = 1000
"""A bound of its own; verifiers' ``max_turns`` (the env's ``max_turns``) ends the loop first."""


class RelayrlChatHarness(vf.Harness[vf.HarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        from openai import AsyncOpenAI
        from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        async with AsyncExitStack() as stack:
            tools, dispatch, servers = [], {}, {}
            if mcp_urls:
                servers_cfg = {"mcpServers": {k: {"url": u} for k, u in mcp_urls.items()}}
                tools, dispatch, servers = await connect_mcp(servers_cfg, stack)
            client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            stack.push_async_callback(client.close)
            for _ in range(MAX_CALLS):
                extra = {"tools": tools} if tools else {}
                resp = await client.chat.completions.create(model=ctx.model, messages=messages, **extra)
                msg = resp.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    break
                for call in msg.tool_calls:
                    try:
                        args = json.loads(call.function.arguments or "{}")
                        if not isinstance(args, dict):
                            raise ValueError("not a JSON object")
                    except ValueError as e:
                        out = f"error: the arguments of {call.function.name!r} are not a JSON object ({e})"
                    else:
                        try:
                            out = await call_mcp(servers, dispatch, call.function.name, args)
                        except Exception as e:  # an unknown name, a tool that raised: the model's to read
                            out = f"error: {type(e).__name__}: {e}"[:2000]
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": out})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["RelayrlChatHarness"]
