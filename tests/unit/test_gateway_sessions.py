"""The gateway's matching of an agent's requests to earlier calls (``gateway/sessions.py``): a
dialogue that extends an answer continues its exact tokens in the same segment; one that rewrote
its history opens a new segment, counted by reason; every segment assembles token-exactly."""

from __future__ import annotations

import json

import pytest
from relayrl.common.v1 import common_pb2 as c
from relayrl.gateway.api import BadRequest, ChatRequest, ContextFull
from relayrl.gateway.sessions import Session
from relayrl.generator.v1 import generator_pb2 as g

STOP = 99
TOOLS = json.dumps([{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}])
SYSTEM = c.ChatMessage(role="system", content="You can call calc.")
USER = c.ChatMessage(role="user", content="What is 12 * 34?")


def session(**kw) -> Session:
    sampling = g.SamplingParams(max_tokens=16, stop_token_ids=[STOP], tool_format="hermes")
    args = dict(key="k", episode_id="p/0", sampling=sampling, max_episode_tokens=200, max_calls=8,
                min_version=0, ttl_seconds=60)  # fmt: skip
    return Session(**{**args, **kw})


def sample(prompt: list[int], completion: list[int], call: tuple[str, str] | None = None, text: str = "x"):
    """A generator sample; ``call`` (name, arguments) makes it a turn with one parsed tool call."""
    calls = (
        [c.ToolCall(id="call_0_0", name=call[0], arguments_json=call[1], parse=c.TOOL_CALL_PARSE_OK)]
        if call
        else []
    )
    return c.Sample(prompt_token_ids=prompt, completion_token_ids=completion, logprobs=[-0.5] * len(completion),
                    finish_reason=c.FINISH_REASON_STOP, text=text, content="" if call else text, tool_calls=calls,
                    policy_version=3)  # fmt: skip


def assistant_call(args: str) -> c.ChatMessage:
    return c.ChatMessage(
        role="assistant", tool_calls=[c.ToolCall(id="mine", name="calc", arguments_json=args)]
    )


def tool(content: str) -> c.ChatMessage:
    return c.ChatMessage(role="tool", content=content, tool_call_id="mine")


def test_a_dialogue_that_extends_the_answer_continues_its_exact_tokens():
    s = session()
    first = ChatRequest([SYSTEM, USER], TOOLS)
    plan = s.plan(first)
    assert plan.parent is None and plan.prompt.prompt_id == "p/0/t0" and plan.prompt.HasField("messages")
    answer = s.record(plan, first, sample([1, 2, 3], [10, 11, STOP], ("calc", '{"expression": "12*34"}')))
    assert answer.finish_reason == "tool_calls" and answer.message.tool_calls[0].name == "calc"
    # The agent re-serializes the arguments and uses its own call id: still the same message.
    second = ChatRequest([SYSTEM, USER, assistant_call('{"expression":"12*34"}'), tool("408")], TOOLS)
    plan = s.plan(second)
    assert plan.parent == 0 and plan.reason == "" and plan.prompt.prompt_id == "p/0/t1"
    cont = plan.prompt.continuation
    assert list(cont.prefix_token_ids) == [1, 2, 3, 10, 11, STOP] and [m.role for m in cont.append] == [
        "tool"
    ]
    s.record(plan, second, sample([1, 2, 3, 10, 11, STOP, 20, 21], [12, STOP], text="408"))
    out = s.close()
    assert out.calls == 2 and out.history_breaks == 0 and len(out.segments) == 1
    seg = out.segments[0]
    assert list(seg.sample.prompt_token_ids) == [1, 2, 3]
    assert list(seg.sample.completion_token_ids) == [10, 11, STOP, 20, 21, 12, STOP]
    assert list(seg.loss_mask) == [1, 1, 1, 0, 0, 1, 1]


def test_a_rewritten_history_opens_a_counted_segment_and_both_train():
    s = session()
    first = ChatRequest([SYSTEM, USER], TOOLS)
    s.record(p := s.plan(first), first, sample([1, 2, 3], [10, STOP], ("calc", '{"expression": "1"}')))
    # The agent summarizes its history: the system message is edited.
    edited = ChatRequest([c.ChatMessage(role="system", content="Be brief."), USER], TOOLS)
    p = s.plan(edited)
    assert p.parent is None and p.reason == "history_rewritten" and p.prompt.HasField("messages")
    s.record(p, edited, sample([7, 2, 3], [30, STOP], text="408"))
    out = s.close()
    assert out.history_breaks == 1 and dict(out.break_reasons) == {"history_rewritten": 1}
    assert [list(x.sample.prompt_token_ids) for x in out.segments] == [[1, 2, 3], [7, 2, 3]]
    assert all(list(x.loss_mask) == [1, 1] for x in out.segments)


@pytest.mark.parametrize(
    ("tail", "tools", "reason"),
    [
        ([c.ChatMessage(role="user", content="a"), tool("1")], TOOLS, "tail_roles"),  # user then tool
        ([tool("1")], "", "tools_changed"),
    ],
)
def test_a_tail_that_cannot_extend_tokens_breaks_with_its_reason(tail, tools, reason):
    s = session()
    first = ChatRequest([SYSTEM, USER], TOOLS)
    s.record(s.plan(first), first, sample([1], [10, STOP], ("calc", "{}")))
    p = s.plan(ChatRequest([SYSTEM, USER, assistant_call("{}"), *tail], tools))
    assert p.parent is None and p.reason == reason


def test_a_turn_cut_at_its_budget_is_closed_and_extended_and_a_retry_forks():
    s = session()
    first = ChatRequest([SYSTEM, USER], TOOLS)
    cut = sample([1], [10, 11], ("calc", "{}"))
    cut.finish_reason = c.FINISH_REASON_LENGTH
    s.record(s.plan(first), first, cut)
    p = s.plan(ChatRequest([SYSTEM, USER, assistant_call("{}"), tool("1")], TOOLS))
    assert p.parent == 0 and p.reason == "" and p.prompt.continuation.close_turn
    assert list(p.prompt.continuation.prefix_token_ids) == [1, 10, 11]  # the generator adds the stop
    aborted = session()
    stopped_short = sample([1], [10, 11], ("calc", "{}"))  # ended without a stop token: not extended
    aborted.record(aborted.plan(first), first, stopped_short)
    assert aborted.plan(ChatRequest([SYSTEM, USER, assistant_call("{}"), tool("1")], TOOLS)).reason == "cut"
    s2 = session()
    s2.record(s2.plan(first), first, sample([1], [10, STOP], ("calc", "{}")))
    again = ChatRequest([SYSTEM, USER, assistant_call("{}"), tool("1")], TOOLS)
    for _ in range(2):  # the agent sends the same request twice (a retry): the second is a fork
        p = s2.plan(again)
        s2.record(p, again, sample([1, 10, STOP, 5], [6, STOP]))
    out = s2.close()
    assert [x.break_reason for x in out.segments] == ["", "fork"] and out.history_breaks == 1
    assert list(out.segments[1].sample.prompt_token_ids) == [1, 10, STOP, 5]


def test_budgets_and_call_limits_refuse_with_clear_errors():
    s = session(max_episode_tokens=70, max_calls=2)
    first = ChatRequest([SYSTEM, USER], TOOLS, max_tokens=4)
    p = s.plan(first)
    assert p.max_tokens == 4  # the agent can only lower the session's max_tokens
    s.record(p, first, sample([1], [10, STOP], ("calc", "{}")))
    with pytest.raises(ContextFull):  # 2 tokens used + a tool message's bound (64 + content) > 70
        s.plan(ChatRequest([SYSTEM, USER, assistant_call("{}"), tool("12345")], TOOLS))
    assert s.truncated == 1
    s.plan(first)
    with pytest.raises(BadRequest, match="2 calls"):
        s.plan(first)


def test_a_set_reward_and_the_prefix_check_reach_the_close():
    s = session()
    first = ChatRequest([SYSTEM, USER], TOOLS)
    s.record(s.plan(first), first, sample([1], [10, STOP], ("calc", "{}")))
    nxt = ChatRequest([SYSTEM, USER, assistant_call("{}"), tool("1")], TOOLS)
    p = s.plan(nxt)
    s.record(p, nxt, sample([2, 10, STOP, 5], [6, STOP]))  # the generator broke the prefix
    s.reward = (1.0, {"correct": 1.0})
    out = s.close()
    assert [x.break_reason for x in out.segments] == ["", "prefix_violation"]
    assert out.reward_set and out.reward == 1.0 and dict(out.components) == {"correct": 1.0}


def malformed_sample():
    bad = sample([1], [10, STOP], ("", "<tool ="), text="Let me see. <tool =")
    bad.tool_calls[0].parse = c.TOOL_CALL_PARSE_UNCLOSED_BLOCK
    bad.content = "Let me see."
    return bad


def test_a_malformed_call_reaches_the_agent_as_its_text_is_counted_and_its_echo_extends_the_turn():
    s = session()
    first = ChatRequest([SYSTEM, USER], TOOLS)
    answer = s.record(s.plan(first), first, malformed_sample())
    # What the model wrote, as text: a final answer every client takes, no call to choke on.
    assert answer.message.content == "Let me see. <tool =" and not answer.message.tool_calls
    assert answer.finish_reason == "stop"
    # The agent echoes it (stripped, as frameworks do) and asks again: the same segment.
    echoed = c.ChatMessage(role="assistant", content="Let me see. <tool =\n")
    nxt = ChatRequest([SYSTEM, USER, echoed, c.ChatMessage(role="user", content="Use the tool.")], TOOLS)
    p = s.plan(nxt)
    assert p.parent == 0 and p.prompt.HasField("continuation")
    s.record(p, nxt, sample([1, 10, STOP, 4], [12, STOP], text="ok"))
    out = s.close()
    assert out.malformed_calls == 1 and out.history_breaks == 0 and len(out.segments) == 1


def test_an_agent_that_asks_gets_a_malformed_call_as_a_call_and_its_answer_extends_the_turn():
    from relayrl.gateway.openai_api import _message_json
    from relayrl.gateway.sessions import reply_of

    s = session()
    first = ChatRequest([SYSTEM, USER], TOOLS, malformed_as_calls=True)
    bad = malformed_sample()
    answer = s.record(s.plan(first), first, bad)
    assert [(t.name, t.arguments_json) for t in answer.message.tool_calls] == [("", "<tool =")]
    assert answer.finish_reason == "tool_calls"
    call = _message_json(reply_of(bad, "hermes", True))["tool_calls"][0]
    assert call["relayrl_parse_error"] == "unclosed_block" and call["function"]["arguments"] == "<tool ="
    # The agent answers it (as the white-box env words it) and goes on: the same segment.
    echoed = c.ChatMessage(
        role="assistant",
        content="Let me see.",
        tool_calls=[c.ToolCall(id="mine", name="", arguments_json="<tool =")],
    )
    nxt = ChatRequest(
        [SYSTEM, USER, echoed, tool("error: the tool call has no closing tag (got: <tool =)")], TOOLS
    )
    p = s.plan(nxt)
    assert p.parent == 0 and p.prompt.HasField("continuation")
    assert s.close().malformed_calls == 1
