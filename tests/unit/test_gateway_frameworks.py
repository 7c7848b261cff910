"""The agent frameworks users write agents in, each configured only with the gateway's base URL,
a session key and the model name, playing a calc episode through the gateway
(``tests/kit/agent_stack.py``: a real generator servicer on a scripted model, a real gateway
replica, all on 127.0.0.1): OpenAI's Agents SDK and pydantic-ai (the Responses API by default,
chat completions when asked), smolagents' ``ToolCallingAgent`` (chat completions with
``tool_choice: "required"``, its earlier calls re-sent as text and tool results as user
messages) and LangChain's ``ChatOpenAI.bind_tools``, streamed and not.

What is checked: each completes a tool round trip; the session is one segment (no history
break), and that segment is exactly the tokens the model sampled plus the bridges between them
(mask 0 exactly there); a call the model wrote malformed reaches each as text it takes (no
crash, no 400), is counted (``malformed_calls``), and the agent's next request, which echoes it,
continues the same segment. Each test takes about a second (the frameworks import once).
"""

from __future__ import annotations

import asyncio

import pytest

from tests.kit.agent_stack import ANSWER, QUESTION, CalcPolicy, segments_are_the_sampled_tokens, stack

pytest.importorskip("openai")
FRAMEWORKS = ("openai_agents", "pydantic_ai", "smolagents", "langchain")
FOLLOW_UP = "Call the calc tool, please."


def calc(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. "123 * 456"
    """
    return ANSWER if expression.replace(" ", "") == "12*34" else "error: not 12 * 34"


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch):
    """Frameworks read proxies and OpenAI settings from the environment: none of it may apply."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy",
                 "OPENAI_BASE_URL", "OPENAI_API_KEY", "OPENAI_PROXY"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")  # nothing leaves this machine


# -- each framework: one episode, and (``again``) one more request with the history it kept --------


class OpenAIAgents:
    """OpenAI Agents SDK: ``Agent(model=<name>)`` over a client with the gateway's URL and key."""

    def __init__(self, url: str, key: str, model: str, stream: bool, api: str):
        agents = pytest.importorskip("agents")
        from openai import AsyncOpenAI

        agents.set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=url, api_key=key, max_retries=0)
        model_cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        self.agent = agents.Agent(
            name="calc",
            instructions="Answer with the calc tool.",
            model=model_cls(model=model, openai_client=client),
            tools=[agents.function_tool(calc)],
        )
        self.stream, self.result = stream, None

    async def run(self, prompt: str) -> str:
        import agents

        history = (
            prompt
            if self.result is None
            else [*self.result.to_input_list(), {"role": "user", "content": prompt}]
        )
        if self.stream:
            self.result = agents.Runner.run_streamed(self.agent, history)
            async for _ in self.result.stream_events():
                pass
        else:
            self.result = await agents.Runner.run(self.agent, history)
        return str(self.result.final_output)


class PydanticAI:
    """pydantic-ai: ``Agent("openai-responses:<name>")`` (``"openai:"`` the same API) or
    ``"openai-chat:<name>"``, the URL and key from OpenAI's environment variables."""

    def __init__(self, url: str, key: str, model: str, stream: bool, api: str):
        pydantic_ai = pytest.importorskip("pydantic_ai")
        mp = pytest.MonkeyPatch()
        mp.setenv("OPENAI_BASE_URL", url)
        mp.setenv("OPENAI_API_KEY", key)
        self.undo = mp.undo
        prefix = "openai" if api == "responses" else "openai-chat"
        self.agent = pydantic_ai.Agent(
            f"{prefix}:{model}", instructions="Answer with the calc tool.", tools=[calc]
        )
        self.stream, self.history = stream, None

    async def run(self, prompt: str) -> str:
        if self.stream:
            async with self.agent.run_stream(prompt, message_history=self.history) as r:
                out = await r.get_output()
                self.history = r.all_messages()
                return out
        r = await self.agent.run(prompt, message_history=self.history)
        self.history = r.all_messages()
        return r.output


class SmolAgents:
    """smolagents: ``ToolCallingAgent`` on ``OpenAIModel(model_id, api_base, api_key)``."""

    def __init__(self, url: str, key: str, model: str, stream: bool, api: str):
        smolagents = pytest.importorskip("smolagents")
        self.agent = smolagents.ToolCallingAgent(
            tools=[smolagents.tool(calc)],
            model=smolagents.OpenAIModel(model_id=model, api_base=url, api_key=key),
            max_steps=4,
            stream_outputs=stream,
            verbosity_level=0,
        )
        self.runs = 0

    async def run(self, prompt: str) -> str:
        self.runs += 1
        return str(await asyncio.to_thread(self.agent.run, prompt, reset=self.runs == 1))


class LangChain:
    """LangChain: ``ChatOpenAI(model, base_url, api_key).bind_tools([calc])``, and the loop its
    tool-calling guide writes (invoke, run the calls, invoke again)."""

    def __init__(self, url: str, key: str, model: str, stream: bool, api: str):
        pytest.importorskip("langchain_openai")
        from langchain_core.tools import tool
        from langchain_openai import ChatOpenAI

        self.tool = tool(calc)
        self.model = ChatOpenAI(
            model=model, base_url=url, api_key=key, streaming=stream, max_retries=0
        ).bind_tools([self.tool])
        self.messages: list = []

    async def run(self, prompt: str) -> str:
        return await asyncio.to_thread(self._run, prompt)

    def _run(self, prompt: str) -> str:
        from langchain_core.messages import HumanMessage, ToolMessage

        self.messages.append(HumanMessage(prompt))
        for _ in range(4):
            reply = self.model.invoke(self.messages)
            self.messages.append(reply)
            if not reply.tool_calls:
                return reply.content
            for call in reply.tool_calls:
                self.messages.append(ToolMessage(self.tool.invoke(call["args"]), tool_call_id=call["id"]))
        raise AssertionError("no answer in 4 calls")


AGENTS = {
    "openai_agents": OpenAIAgents,
    "pydantic_ai": PydanticAI,
    "smolagents": SmolAgents,
    "langchain": LangChain,
}
CASES = [
    (name, api, stream)
    for name in FRAMEWORKS
    for api in (("responses", "chat") if name in ("openai_agents", "pydantic_ai") else ("chat",))
    for stream in (False, True)
]
IDS = [f"{n}-{a}-{'stream' if s else 'plain'}" for n, a, s in CASES]


async def _agent(st, name: str, api: str, stream: bool):
    opened = await st.open(f"{name}/0")
    agent = AGENTS[name](opened.base_url, opened.session_key, opened.model, stream, api)
    return opened, agent


@pytest.mark.parametrize(("name", "api", "stream"), CASES, ids=IDS)
async def test_a_framework_plays_a_tool_episode_in_one_segment_of_the_sampled_tokens(name, api, stream):
    async with stack(CalcPolicy(steps=2)) as st:  # two tool round trips, then the answer
        opened, agent = await _agent(st, name, api, stream)
        try:
            out = await agent.run(QUESTION)
        finally:
            getattr(agent, "undo", lambda: None)()
        assert ANSWER in out
        (session,) = st.core.sessions.values()
        calls = session.calls
        closed = await st.close(opened.session_key)
    assert closed.calls == len(calls) == 3 and closed.history_breaks == 0 and len(closed.segments) == 1
    assert [c.reply.tool_calls[0].name for c in calls[:2]] == ["calc", "calc"]  # real tool round trips
    # The API it used: the Responses API's instructions are a system message the gateway marks.
    assert calls[0].instructions == (api == "responses")
    assert closed.malformed_calls == 0
    # smolagents asks for tool_choice "required" on every call: enforced, so counted
    assert closed.constrained_calls == (closed.calls if name == "smolagents" else 0)
    segments_are_the_sampled_tokens(closed, st.engine)


@pytest.mark.parametrize(("name", "api", "stream"), CASES, ids=IDS)
async def test_a_malformed_call_leaves_every_framework_going_and_its_echo_continues_the_segment(
    name, api, stream
):
    async with stack(CalcPolicy(malformed=True)) as st:
        opened, agent = await _agent(st, name, api, stream)
        try:
            first = await agent.run(QUESTION)
            if name != "smolagents":
                # The model's malformed text was the agent's final answer; its user asks again,
                # and the framework sends its history, with that answer in it, back.
                assert "<tool_call>" in first
                out = await agent.run(FOLLOW_UP)
            else:
                out = first  # smolagents reads the text as a failed step and retries by itself
        finally:
            getattr(agent, "undo", lambda: None)()
        assert ANSWER in out
        closed = await st.close(opened.session_key)
    assert closed.malformed_calls == 1
    assert closed.history_breaks == 0 and len(closed.segments) == 1, dict(closed.break_reasons)
    segments_are_the_sampled_tokens(closed, st.engine)


# -- typed answers: response formats with a JSON schema, enforced ------------------------------------


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_an_agents_sdk_agent_with_a_typed_output_calls_its_tool_then_answers_in_its_schema(api):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    class Result(BaseModel):
        answer: int

    async with stack() as st:
        opened = await st.open("typed/0")
        agents.set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=opened.base_url, api_key=opened.session_key, max_retries=0)
        model_cls = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        agent = agents.Agent(
            name="calc", instructions="Answer with the calc tool.", tools=[agents.function_tool(calc)],
            model=model_cls(model=opened.model, openai_client=client), output_type=Result,
        )  # fmt: skip
        result = await agents.Runner.run(agent, QUESTION)
        closed = await st.close(opened.session_key)
    assert result.final_output == Result(answer=int(ANSWER))
    assert closed.calls == 2 and closed.history_breaks == 0 and len(closed.segments) == 1
    # Both turns were sampled under the answer's schema (calls still allowed): checked against the
    # structural tag by xgrammar in the kit's engine.
    assert [bool(s.constraint) for s in st.engine.sampled] == [True, True]
    segments_are_the_sampled_tokens(closed, st.engine)


async def test_langchain_structured_output_is_json_of_its_schema():
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Result(BaseModel):
        answer: int

    async with stack() as st:
        opened = await st.open("typed/1")
        model = ChatOpenAI(
            model=opened.model, base_url=opened.base_url, api_key=opened.session_key, max_retries=0
        )
        out = await asyncio.to_thread(
            model.with_structured_output(Result).invoke, f"{QUESTION} It is {ANSWER}."
        )
        await st.close(opened.session_key)
    assert out == Result(answer=int(ANSWER))
    (sampled,) = st.engine.sampled
    assert sampled.constraint
