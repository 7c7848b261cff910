"""One black-box episode's calls, and how each new request extends them (pure: no I/O).

An agent owns its loop and sends its whole dialogue with every request. To train on exactly the
tokens the model sampled, each request is matched to the earlier call whose messages plus the
answer the gateway returned are the longest prefix of the new messages, compared by meaning
(contents equal, tool-call names equal and arguments JSON-equal, an answer's calls re-sent as
text read as calls, tools equal whatever their spelling: ``history.py``'s keys, so matching
takes one lookup per message of the request, however many calls the session made). A matched
answer is never re-rendered: its exact tokens stand for it. When the rest is tool answers and
at most one user message, the new call extends that call's exact tokens
(``common.v1.Continuation``: the generator renders only the appended messages), in the same
segment (a turn cut at its token budget too: the generator closes it with the end-of-turn token
a render would put there, ``Continuation.close_turn``, a prompt token that does not train).
Anything else (the agent dropped, edited or reordered its history or changed its tools) is
rendered whole and opens a new segment: a history break, counted by reason. Segments become
learner samples of their own; each trains.

Call ``k`` of a session is the generator prompt ``<episode_id>/t<k>``, as turn ``k`` of a
white-box episode (``coordinator/rollout/tool_episodes.py``): the same seed and episode give the same tokens
through the gateway as without it."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field

from relayrl.common.trajectories import PrefixViolation, assemble, check_prefix, turn_room
from relayrl.common.v1 import common_pb2
from relayrl.gateway import history
from relayrl.gateway.api import Answer, BadRequest, ChatRequest, ContextFull
from relayrl.gateway.v1 import gateway_pb2 as gw
from relayrl.generator.v1 import generator_pb2 as g

ROLES_AFTER_ANSWER = ("tool", "user")
PARSED = (common_pb2.TOOL_CALL_PARSE_OK, common_pb2.TOOL_CALL_PARSE_UNSPECIFIED)
"""Parse statuses of a call that parsed (UNSPECIFIED: an agent's own call, never parsed)."""


@dataclass
class Call:
    """One answered request."""

    messages: list[common_pb2.ChatMessage]
    tools_json: str
    reply: common_pb2.ChatMessage
    sample: common_pb2.Sample
    extendable: bool
    """It ended on an end-of-turn token, or was cut at its token budget (the generator closes
    the turn before it extends it: ``Continuation.close_turn``): the next turn can extend its
    tokens exactly."""
    key: bytes = b""
    """``history`` key of ``[*messages, reply]``: a request whose prefix has it extends this call."""
    tools_key: str = ""
    """``history.tools_key(tools_json)``: the tools, whatever their spelling."""
    instructions: bool = False
    """``messages[0]`` was the Responses API's ``instructions`` (not carried over by a later
    request's ``previous_response_id``)."""


@dataclass
class Plan:
    """How to sample a request: the generator prompt, the token budget, and where it goes."""

    index: int
    prompt: common_pb2.Prompt
    max_tokens: int
    parent: int | None
    """The call whose tokens the prompt extends (None: rendered whole)."""
    reason: str
    """Why it does not extend a call ("" when it does, or for the session's first call)."""
    keys: tuple[bytes, ...] = ()
    """The request's prefix keys (``history.prefix_keys``), for ``record``."""


@dataclass
class Segment:
    calls: list[int]
    reason: str


def tail_extends(tail: list[common_pb2.ChatMessage]) -> bool:
    """Whether ``tail`` can follow an answer token-exactly: tool answers, then at most one user
    message, and something at all.

    >>> tool, user = common_pb2.ChatMessage(role="tool"), common_pb2.ChatMessage(role="user")
    >>> tail_extends([tool, tool, user]), tail_extends([user]), tail_extends([user, tool]), tail_extends([])
    (True, True, False, False)
    """
    if not tail or any(m.role not in ROLES_AFTER_ANSWER for m in tail):
        return False
    return all(m.role == "tool" for m in tail[:-1])


def renderable(messages) -> list[common_pb2.ChatMessage]:
    """``messages`` as a chat template can render them whole: an assistant's call that did not
    parse has no arguments object to render and is left out (its text stays in the content), as
    the white-box env's stepwise turns leave it out.

    >>> bad = common_pb2.ToolCall(id="c", arguments_json="<x", parse=common_pb2.TOOL_CALL_PARSE_UNCLOSED_BLOCK)
    >>> [len(m.tool_calls) for m in renderable([common_pb2.ChatMessage(role="assistant", tool_calls=[bad])])]
    [0]
    """
    out = []
    for m in messages:
        bad = [c for c in m.tool_calls if c.parse not in PARSED]
        if bad:
            kept = [c for c in m.tool_calls if c not in bad]
            m, original = common_pb2.ChatMessage(), m
            m.CopyFrom(original)
            del m.tool_calls[:]
            m.tool_calls.extend(kept)
        out.append(m)
    return out


def malformed(s: common_pb2.Sample) -> int:
    """How many of the sample's tool calls did not parse."""
    return sum(c.parse not in PARSED for c in s.tool_calls)


def reply_of(
    s: common_pb2.Sample, tool_format: str, malformed_as_calls: bool = False
) -> common_pb2.ChatMessage:
    """The assistant message the agent gets for a sample: its text outside the tool calls and
    every call it made. A turn with a call that did not parse is the model's whole text, as it
    wrote it (no calls: every client takes that, as a final answer); with
    ``malformed_as_calls`` its calls are given as calls all the same, a malformed one with its
    raw text as the arguments and its parse status beside it (``openai_api``:
    ``relayrl_parse_error``), for an agent that answers it as the white-box env does. Either
    form, echoed back, continues the segment (it is what the session recorded)."""
    if not tool_format or (malformed(s) and not malformed_as_calls):
        return common_pb2.ChatMessage(role="assistant", content=s.text)
    return common_pb2.ChatMessage(role="assistant", content=s.content, tool_calls=list(s.tool_calls))


def finish_reason(s: common_pb2.Sample, reply: common_pb2.ChatMessage) -> str:
    if reply.tool_calls:
        return "tool_calls"
    return "length" if s.finish_reason == common_pb2.FINISH_REASON_LENGTH else "stop"


@dataclass
class Session:
    """One episode's gateway session."""

    key: str
    episode_id: str
    sampling: g.SamplingParams
    max_episode_tokens: int
    max_calls: int
    min_version: int
    ttl_seconds: float
    agent_reward: bool = False
    """The agent may set the reward over HTTP (OpenSessionRequest.agent_reward)."""
    touched: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    """Requests of this session being sampled now (a session is never swept while one is)."""
    calls: list[Call] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    planned: int = 0
    """Calls planned so far (their indexes; some may not have answered)."""
    truncated: int = 0
    malformed_calls: int = 0
    """Tool calls the model wrote that did not parse (CloseSessionResponse.malformed_calls)."""
    constrained_calls: int = 0
    """Calls sampled under an enforced tool choice (CloseSessionResponse.constrained_calls)."""
    reward: tuple[float, dict[str, float]] | None = None
    by_key: dict[bytes, int] = field(default_factory=dict)
    """The first call of each ``Call.key``: the calls a request can extend, by its prefix keys."""
    responses: dict[str, int] = field(default_factory=dict)
    """Responses API answer ids -> their calls (``previous_response_id``)."""

    def resolve(self, req: ChatRequest) -> ChatRequest:
        """``req`` with the dialogue of its ``previous_response_id`` before its own input: that
        answer's messages (without its ``instructions``, which OpenAI does not carry over) and
        its reply, then ``req``'s instructions first. A request without one is returned as is."""
        if not req.previous_response_id:
            return req
        at = self.responses.get(req.previous_response_id)
        if at is None:
            raise BadRequest(
                "previous_response_id is not an answer of this session",
                code="previous_response_not_found",
                param="previous_response_id",
            )
        c = self.calls[at]
        head = req.messages[:1] if req.instructions else []
        messages = [*head, *c.messages[1 if c.instructions else 0 :], c.reply, *req.messages[len(head) :]]
        return dataclasses.replace(
            req, messages=messages, prefix_keys=history.prefix_keys(messages), previous_response_id=""
        )

    def plan(self, req: ChatRequest) -> Plan:
        """The generator prompt for ``req``: extending the best-matching call, or rendered whole."""
        if self.planned >= self.max_calls:
            raise BadRequest(f"this session made its {self.max_calls} calls: it is over")
        keys = req.prefix_keys or history.prefix_keys(req.messages)
        parent, reason = self._match(req, keys)
        index = self.planned
        pid = f"{self.episode_id}/t{index}"
        budget = self.max_episode_tokens or 1 << 30
        room = min(self.sampling.max_tokens, budget)
        if parent is None:
            prompt = common_pb2.Prompt(
                prompt_id=pid,
                messages=common_pb2.ChatMessages(
                    messages=renderable(req.messages), tools_json=req.tools_json
                ),
            )
        else:
            p = self.calls[parent]
            prefix = [*p.sample.prompt_token_ids, *p.sample.completion_token_ids]
            tail = req.messages[len(p.messages) + 1 :]
            first = self.calls[self._segment_of(parent).calls[0]]
            used = len(prefix) - len(first.sample.prompt_token_ids)
            room = turn_room(self.sampling.max_tokens, budget, used, tail)
            prompt = common_pb2.Prompt(
                prompt_id=pid,
                continuation=common_pb2.Continuation(
                    prefix_token_ids=prefix,
                    append=tail,
                    tools_json=req.tools_json,
                    close_turn=p.sample.finish_reason == common_pb2.FINISH_REASON_LENGTH,
                ),
            )
        if req.max_tokens is not None:
            room = min(room, req.max_tokens)
        if room < 1:
            self.truncated += 1
            raise ContextFull(
                f"the episode's token budget ({self.max_episode_tokens} after its first prompt) is spent"
            )
        self.planned += 1
        return Plan(index, prompt, room, parent, reason, keys)

    def unplan(self, plan: Plan) -> None:
        """Give back a plan whose call got no answer, when no later one was made: a retry of
        the request is then the same call (the same prompt id, so the same random stream)."""
        if plan.index == self.planned - 1:
            self.planned -= 1

    def _match(self, req: ChatRequest, keys: tuple[bytes, ...]) -> tuple[int | None, str]:
        # The longest prefix of the request that is a call's messages plus its answer; among calls
        # with one such prefix, the first (``by_key`` keeps it). One lookup per message.
        best = next((self.by_key[k] for k in reversed(keys) if k in self.by_key), None)
        if best is None:
            return None, "history_rewritten" if self.calls else ""
        c = self.calls[best]
        if not tail_extends(req.messages[len(c.messages) + 1 :]):
            return None, "tail_roles"
        if history.tools_key(req.tools_json) != c.tools_key:
            return None, "tools_changed"
        if not c.extendable:
            return None, "cut"
        return best, ""

    def _segment_of(self, call: int) -> Segment:
        return next(s for s in self.segments if call in s.calls)

    def record(self, plan: Plan, req: ChatRequest, s: common_pb2.Sample, answer_id: str = "") -> Answer:
        """Keep the answered call in its segment; the answer for the agent (``answer_id``: its
        id, which a Responses API request may name as ``previous_response_id``)."""
        reason = plan.reason
        seg = None
        if plan.parent is not None:
            try:
                check_prefix(plan.prompt.continuation.prefix_token_ids, s, f"call {plan.index}")
                seg = self._segment_of(plan.parent)
                if seg.calls[-1] != plan.parent:  # a retry or a second branch from one answer
                    seg, reason = None, "fork"
            except PrefixViolation:
                seg, reason = None, "prefix_violation"
        # tool_choice "none": the calls were not read out of the answer; all of it is text
        fmt = self.sampling.tool_format if req.tool_choice != "none" else ""
        reply = reply_of(s, fmt, req.malformed_as_calls)
        for k, call in enumerate(reply.tool_calls):
            # Unique in the session (the generator numbers each turn's calls from 0): frameworks
            # pair calls with their outputs by id across the whole dialogue. Ids are not matched.
            call.id = f"call_{plan.index}_{k}"
        if fmt:
            self.malformed_calls += malformed(s)
        self.constrained_calls += req.tool_choice in ("required", "function")
        ended = bool(s.completion_token_ids) and s.completion_token_ids[-1] in self.sampling.stop_token_ids
        keys = plan.keys or history.prefix_keys(req.messages)
        key = history.extend(keys[-1] if keys else b"", history.message_key(reply))
        self.calls.append(
            Call(
                list(req.messages),
                req.tools_json,
                reply,
                s,
                (s.finish_reason == common_pb2.FINISH_REASON_STOP and ended)
                or s.finish_reason == common_pb2.FINISH_REASON_LENGTH,
                key,
                history.tools_key(req.tools_json),
                req.instructions,
            )
        )
        self.by_key.setdefault(key, len(self.calls) - 1)
        if answer_id:
            self.responses[answer_id] = len(self.calls) - 1
        if seg is None:
            seg = Segment([], reason)
            self.segments.append(seg)
        seg.calls.append(len(self.calls) - 1)
        return Answer(
            message=reply,
            finish_reason=finish_reason(s, reply),
            prompt_tokens=len(s.prompt_token_ids),
            completion_tokens=len(s.completion_token_ids),
        )

    def close(self) -> gw.CloseSessionResponse:
        """The session's segments, each assembled as one sample with its loss mask."""
        out = gw.CloseSessionResponse(
            calls=len(self.calls),
            truncated=self.truncated,
            malformed_calls=self.malformed_calls,
            constrained_calls=self.constrained_calls,
        )
        breaks = Counter(seg.reason for seg in self.segments[1:])
        for seg in self.segments:
            turns = [self.calls[i].sample for i in seg.calls]
            sample, mask = assemble(turns, "", 0)
            out.segments.append(
                gw.Segment(sample=sample, loss_mask=mask, calls=turns, break_reason=seg.reason)
            )
        out.history_breaks = sum(breaks.values())
        out.break_reasons.update(breaks)
        if self.reward is not None:
            out.reward_set = True
            out.reward, components = self.reward
            out.components.update(components)
        return out
