"""The model's chat template as a codec over token ids: render a dialogue (with tools), extend
exact ids by new turns without re-tokenizing them (the bridge), and check what the template
does with tool calls and turns.

In: the model's HF tokenizer (the one that encodes chat prompts; vLLM's in the engine) with its
chat template. Out: token ids.

The bridge. A multi-turn episode's next prompt is ``prefix + bridge``: ``prefix`` the exact ids
the model saw and produced (ending with the end-of-turn token it emitted), ``bridge`` what the
template puts after an assistant turn's end-of-turn token (its ``glue``, e.g. "\\n" in ChatML,
none in Llama-3), then the appended messages and the generation prompt. It is read off the
template with a fixed synthetic dialogue ``B`` ending with an assistant turn (carrying a tool
call with a real tool name when tools are given): render ``B + append`` and keep what follows
``B``'s last end-of-turn token. When ``render(B)`` is a prefix of ``render(B + append)`` (the
template does not rewrite earlier turns), that is ``render(B + append)[len(render(B)) -
len(glue):]``; when it is not (Qwen3 strips ``<think>`` from turns before the last user query),
the end of ``B``'s assistant turn is found by a marker in it. Either way the ids are checked to
be a token suffix of the full render's ids (no token straddles the cut), else ``BridgeError``.

``check`` runs probe dialogues turn by turn through the bridge and compares with a full render:
``prefix_preserving`` is True when a multi-turn episode trains on exactly what the template
would show for the whole dialogue.

Content is text, never markup. A tool's output, an agent's or a user's message (any string the
template is given: content, names, tool-call arguments, tool schemas) that holds a special
token's text, ``<|im_end|><|im_start|>user`` say, would otherwise be tokenized into real turn
tokens: a forged turn in the episode the model is trained on. ``ContentGuard`` tokenizes such
text as text, in whole renders and in bridges alike, and ``ChatCodec`` counts each message that
held some (``relayrl_generator_special_token_text_total``, by role) and logs it. Content without
special-token text is rendered and encoded exactly as before. The model's own turns are never
re-rendered in a bridge (their exact ids are the prefix), so what it generated stays as it was.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from relayrl.common.rpc import FailedPrecondition, InvalidRequest
from relayrl.generator import metrics
from relayrl.generator.content import ContentGuard
from relayrl.generator.toolcalls import Parse, openai_tool_call, parse_tool_calls

logger = logging.getLogger(__name__)

Message = dict[str, Any]
Tools = Sequence[Mapping[str, Any]] | None

MAX_APPEND = 64
"""Most messages one continuation appends."""
MAX_ROUND_TRIPS = 64
"""Most tools whose calls ``check`` renders and reads back (each is one render with every tool)."""
MARK = "relayrl-bridge-base"
"""Content of the base dialogue's assistant turn: found in a full render when the template
rewrites earlier turns (see the module docstring)."""
ALARM_LOG_EVERY_S = 10.0
"""At most one alarm log line this often per codec (the counter has every message)."""
_PROBE_TOOL = {
    "type": "function",
    "function": {"name": "probe_tool", "description": "A probe.", "parameters": {}},
}


class BridgeError(FailedPrecondition):
    """The chat template cannot extend a dialogue token-exactly (FAILED_PRECONDITION)."""


@dataclass
class ChatCheck:
    """What ``ChatCodec.check`` found (``generator.v1.CheckChatResponse``)."""

    tools_missing_from_prompt: list[str] = field(default_factory=list)
    round_trip_ok: bool = False
    round_trip_detail: str = ""
    prefix_preserving: bool = False
    bridge_detail: str = ""
    glue_token_ids: list[int] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)


def tool_names(tools: Tools) -> list[str]:
    """The function names of OpenAI-style tool schemas (``{"type": "function", "function":
    {"name": ...}}``; a bare ``{"name": ...}`` is accepted too)."""
    return [str(t.get("function", t).get("name", "")) for t in tools or ()]


class ChatCodec:
    """Renders and bridges with one tokenizer's chat template. Thread-safe as far as the
    tokenizer is (vLLM's is); caches are filled idempotently."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.guard = ContentGuard(tokenizer)  # one nonce for the codec's life: escape and encode agree
        self._base_texts: dict[str, str] = {}  # render(B) per tools (an episode's turns share one)
        self._alarm_lock = threading.Lock()
        self._alarms, self._alarm_logged = 0, float("-inf")  # prompts not logged yet; last line

    # -- rendering ---------------------------------------------------------------------------
    def render_text(
        self, messages: Sequence[Message], tools: Tools = None, add_generation_prompt: bool = True
    ) -> str:
        kwargs = {"tools": list(tools)} if tools else {}
        return self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(
        self, messages: Sequence[Message], tools: Tools = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a dialogue: render, then encode (as the SFT warm start and the learner).
        Without tools, exactly what a tool-free template call gives. Special-token text in the
        dialogue is tokenized as text (``ContentGuard``)."""
        messages, tools = self._escape(messages, tools)
        return self.guard.encode(self.render_text(messages, tools, add_generation_prompt))

    # -- content is text ----------------------------------------------------------------------
    def _escape(self, messages: Sequence[Message], tools: Tools) -> tuple[list[Message], Tools]:
        """The dialogue with special-token text escaped; each message that held some is counted
        (by role) and the prompt logged, at most one line every ``ALARM_LOG_EVERY_S``."""
        messages, tools, roles, found = self.guard.escape(messages, tools)
        if not roles:
            return messages, tools
        for role in roles:
            metrics.SPECIAL_TEXT.labels(role).inc()
        now = time.monotonic()
        with self._alarm_lock:
            self._alarms += 1
            if now - self._alarm_logged < ALARM_LOG_EVERY_S:
                return messages, tools
            prompts, self._alarms, self._alarm_logged = self._alarms, 0, now
        logger.warning(
            "special-token text in chat content (roles: %s; tokens: %s), tokenized as text, not "
            "as turns: %d prompt(s) with such content since the last line",
            ", ".join(sorted(set(roles))),
            ", ".join(sorted(found)[:4])[:200],
            prompts,
        )
        return messages, tools

    def decode(self, ids: Sequence[int]) -> str:
        """Text with special tokens kept."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def completion_text(self, ids: Sequence[int]) -> str:
        """A completion's text for the tool-call parsers: special tokens kept, its final
        end-of-turn (or eos) token left out."""
        ids = list(ids)
        try:
            ends = self.end_of_turn_ids
        except (BridgeError, ValueError):  # no chat template: the eos token ends a completion
            ends = frozenset()
        if ids and (ids[-1] in ends or ids[-1] == self.tokenizer.eos_token_id):
            ids = ids[:-1]
        return self.decode(ids)

    # -- what the template puts around an assistant turn --------------------------------------
    @cached_property
    def _turn_end(self) -> tuple[int, str, list[int]]:
        """(end-of-turn id, its text, glue ids): the special token right after an assistant
        turn's content, and the ids the template writes after it."""
        head = [{"role": "user", "content": "Hello."}]
        opened = self.render_text(head, add_generation_prompt=True)
        closed = self.render_text(
            [*head, {"role": "assistant", "content": MARK}], add_generation_prompt=False
        )
        at = closed.find(MARK, len(opened))
        if not closed.startswith(opened) or at < 0:
            raise BridgeError(
                "the chat template's generation prompt is not how it renders an assistant turn; "
                "turns cannot be extended token-exactly"
            )
        tail, closed_ids = self.encode(closed[at + len(MARK) :]), self.encode(closed)
        if not tail or tail[0] not in self._special_ids or closed_ids[len(closed_ids) - len(tail) :] != tail:
            raise BridgeError("the chat template does not end an assistant turn with a special token")
        return tail[0], self.decode(tail[:1]), tail[1:]

    @cached_property
    def _special_ids(self) -> set[int]:
        added = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        ids = {i for i, t in added.items() if getattr(t, "special", True)}
        return ids | set(getattr(self.tokenizer, "all_special_ids", ()) or ())

    @property
    def end_of_turn_ids(self) -> frozenset[int]:
        """Ids that end an assistant turn in the template: a continuation's prefix ends with one."""
        return frozenset([self._turn_end[0]])

    @property
    def glue(self) -> list[int]:
        """Ids the template writes after an assistant turn's end-of-turn token."""
        return list(self._turn_end[2])

    # -- the bridge ---------------------------------------------------------------------------
    def _base(self, tools: Tools) -> list[Message]:
        """The fixed dialogue a continuation is read against: ends with an assistant turn that
        calls a real tool (templates may render a tool answer after a call differently)."""
        assistant: Message = {"role": "assistant", "content": MARK}
        if tools:
            name = tool_names(tools)[0]
            assistant["tool_calls"] = [openai_tool_call("call_base", name, {"mark": MARK})]
        return [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello."},
            assistant,
        ]

    def _base_text(self, tools: Tools) -> str:
        key = json.dumps(tools, sort_keys=True) if tools else ""
        if (text := self._base_texts.get(key)) is None:
            if len(self._base_texts) >= 256:  # many distinct tool sets: start over
                self._base_texts.clear()
            text = self._base_texts[key] = self.render_text(
                self._base(tools), tools, add_generation_prompt=False
            )
        return text

    def delta(self, append: Sequence[Message], tools: Tools = None) -> list[int]:
        """The ids that follow an assistant turn's end-of-turn token when ``append`` comes next:
        glue, the rendered messages and the generation prompt."""
        check_append(append)
        append, tools = self._escape(append, tools)
        eot, eot_text, _ = self._turn_end
        base = self._base(tools)
        full = self.render_text([*base, *append], tools, add_generation_prompt=True)
        base_text = self._base_text(tools)
        if full.startswith(base_text):
            cut = base_text.rfind(eot_text)
        else:  # the template rewrote the base: find the end of its assistant turn by the mark
            mark = full.find(MARK)
            cut = full.find(eot_text, mark) if mark >= 0 else -1
        if cut < 0:
            raise BridgeError(
                "the chat template's rendering of an assistant turn has no end-of-turn token to extend from"
            )
        cut += len(eot_text)
        ids, full_ids = self.guard.encode(full[cut:]), self.guard.encode(full)
        at = len(full_ids) - len(ids)
        if at < 1 or full_ids[at:] != ids or full_ids[at - 1] != eot:
            raise BridgeError(
                "the appended turns do not start on a token boundary after the end-of-turn token "
                f"(the template's text there: {full[cut : cut + 40]!r}); turns cannot be extended token-exactly"
            )
        return ids

    def bridge(self, prefix: Sequence[int], append: Sequence[Message], tools: Tools = None) -> list[int]:
        """``prefix`` (exact ids ending with an end-of-turn token) extended by ``append`` (tool
        turns, then at most one user turn) and the generation prompt: ``prefix + glue + delta``.
        ``InvalidRequest`` for a prefix that does not end a turn or a bad append;
        ``BridgeError`` when the template cannot do it."""
        if not prefix:
            raise InvalidRequest("continuation prefix_token_ids is empty")
        if prefix[-1] not in self.end_of_turn_ids:
            raise InvalidRequest(
                f"continuation prefix_token_ids must end with an end-of-turn token "
                f"{sorted(self.end_of_turn_ids)}, ends with {prefix[-1]}: a turn must stop on one"
            )
        return [*prefix, *self.delta(append, tools)]

    # -- the check ----------------------------------------------------------------------------
    def check(self, tools: Tools = None, tool_format: str = "") -> ChatCheck:
        """Tools in the prompt, tool calls read back, and bridge == full render on probe
        dialogues (``generator.v1.CheckChat``). Raises nothing the template does: a template that
        fails is reported."""
        out = ChatCheck()
        try:
            out.glue_token_ids, out.stop_token_ids = self.glue, sorted(self.end_of_turn_ids)
        except Exception as e:  # a template that cannot say where a turn ends
            out.round_trip_detail = out.bridge_detail = f"{type(e).__name__}: {e}"
            return out
        if tools:
            try:
                out.tools_missing_from_prompt = self._missing_tools(tools)
                out.round_trip_ok, out.round_trip_detail = self._round_trip(tools, tool_format)
            except Exception as e:  # the template fails on a dialogue with tools
                out.tools_missing_from_prompt = tool_names(tools)
                out.round_trip_detail = f"the template cannot render the tools: {type(e).__name__}: {e}"
        else:
            out.round_trip_detail = "no tools given: no tool call to read back"
        out.prefix_preserving, out.bridge_detail = self._probe(tools)
        return out

    def _missing_tools(self, tools: Tools) -> list[str]:
        head = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello."},
        ]
        text = self.decode(self.render(head, tools))
        return [n for n in tool_names(tools) if n not in text]

    def _round_trip(self, tools: Tools, tool_format: str) -> tuple[bool, str]:
        if not tool_format:
            return False, "tool_format is empty: the model's tool calls would not be read"
        head = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello."},
        ]
        opened = self.render(head, tools)
        for i, tool in enumerate(list(tools or ())[:MAX_ROUND_TRIPS]):
            name, args = tool_names([tool])[0], _example_arguments(tool)
            msg = {
                "role": "assistant",
                "content": "",
                "tool_calls": [openai_tool_call(f"call_{i}", name, args)],
            }
            try:
                closed = self.render([*head, msg], tools, add_generation_prompt=False)
            except Exception as e:
                return False, f"{name}: the template cannot render a call: {type(e).__name__}: {e}"
            if closed[: len(opened)] != opened:
                return False, f"{name}: a rendered call does not follow the generation prompt"
            _, calls = parse_tool_calls(
                self.completion_text(_cut_turn(closed[len(opened) :], self.end_of_turn_ids)), tool_format
            )
            got = [(c.name, json.loads(c.arguments_json)) for c in calls if c.parse == Parse.OK]
            if got != [(name, args)]:
                shown = [(c.name, c.arguments_json[:80], c.parse.name) for c in calls]
                return (
                    False,
                    f"{name}: rendered with arguments {json.dumps(args)[:200]}, read back as {shown}",
                )
        return True, ""

    def _probe(self, tools: Tools) -> tuple[bool, str]:
        """Each probe dialogue turn by turn (first prompt, then the template's rendering of each
        assistant turn as the model's output, then the bridge) against a full render."""
        names = tool_names(tools) or tool_names([_PROBE_TOOL])
        ran = 0
        for n, dialogue in enumerate(probe_dialogues(names)):
            try:
                self.render(dialogue, tools, add_generation_prompt=False)
            except Exception:  # a dialogue this template refuses (Llama-3.1: one call per turn)
                continue
            ran += 1
            try:
                diff = self._replay(dialogue, tools)
            except Exception as e:  # the template fails on a part of a dialogue it renders whole
                diff = f"{type(e).__name__}: {e}"
            if diff is not None:
                return False, f"probe dialogue {n} ({_roles(dialogue)}): {diff}"
        return (True, "") if ran else (False, "the template rendered none of the probe dialogues")

    def _replay(self, dialogue: list[Message], tools: Tools) -> str | None:
        turns = [i for i, m in enumerate(dialogue) if m["role"] == "assistant"]
        ids: list[int] = []
        for k, a in enumerate(turns):
            want = self.render(dialogue[:a], tools, add_generation_prompt=True)
            if k == 0:
                ids = want
            else:
                try:
                    ids = self.bridge(ids, dialogue[turns[k - 1] + 1 : a], tools)
                except (BridgeError, InvalidRequest) as e:
                    return f"turn {k}: {e}"
            if ids != want:
                at = next(
                    (i for i, (x, y) in enumerate(zip(ids, want, strict=False)) if x != y),
                    min(len(ids), len(want)),
                )
                return (
                    f"turn {k}: bridge ids differ from a full render at position {at}: "
                    f"bridge {self.decode(ids[at : at + 8])!r} vs full {self.decode(want[at : at + 8])!r}"
                )
            done = self.render(dialogue[: a + 1], tools, add_generation_prompt=False)
            if done[: len(want)] != want:
                return f"turn {k}: the assistant turn does not follow the generation prompt"
            ids = want + _cut_turn(done[len(want) :], self.end_of_turn_ids, keep_end=True)
        return None


def check_append(append: Sequence[Message]) -> None:
    """Appended messages are tool turns, then at most one user turn (``InvalidRequest``)."""
    roles = [m.get("role") for m in append]
    if not roles:
        raise InvalidRequest("continuation append is empty")
    if len(roles) > MAX_APPEND:
        raise InvalidRequest(f"continuation append has {len(roles)} messages; at most {MAX_APPEND}")
    tools = roles[:-1] if roles[-1] == "user" else roles
    if any(r != "tool" for r in tools):
        raise InvalidRequest(
            f"continuation append must be 'tool' turns then at most one 'user' turn, got roles {_roles(append)}"
        )


def _cut_turn(ids: list[int], ends: frozenset[int], keep_end: bool = False) -> list[int]:
    """An assistant turn's ids up to its first end-of-turn token (kept or not)."""
    k = next((i for i, t in enumerate(ids) if t in ends), len(ids))
    return ids[: k + 1] if keep_end else ids[:k]


def _roles(msgs: Sequence[Message]) -> str:
    roles = [str(m.get("role"))[:16] for m in msgs]
    return ", ".join(roles[:12]) + (f", ... ({len(roles)} in all)" if len(roles) > 12 else "")


def _example_arguments(tool: Mapping[str, Any]) -> dict[str, Any]:
    """Arguments for a tool's schema: one value of each property's type."""
    props = tool.get("function", tool).get("parameters", {}).get("properties", {}) or {}
    values = {
        "string": '2 + 3 = 5, "ok"',
        "integer": 7,
        "number": 1.5,
        "boolean": True,
        "array": [1, "a"],
        "object": {"k": "v"},
    }
    out = {
        str(k): values.get(v.get("type") if isinstance(v, Mapping) else None, "x") for k, v in props.items()
    }
    return out or {"query": "probe"}


def probe_dialogues(names: Sequence[str]) -> list[list[Message]]:
    """Synthetic dialogues for ``check``: tool calls (one and several per turn), tool answers,
    user turns, reasoning in earlier assistant turns, several rounds."""
    a, b = names[0], names[-1]

    def call(k: int, name: str) -> dict[str, Any]:
        return openai_tool_call(f"call_{k}", name, {"q": f"{k} + 1", "n": k})

    def asks(content: str, *calls: dict[str, Any]) -> Message:
        m: Message = {"role": "assistant", "content": content}
        if calls:
            m["tool_calls"] = list(calls)
        return m

    def answer(k: int, name: str, text: str) -> Message:
        return {"role": "tool", "content": text, "tool_call_id": f"call_{k}", "name": name}

    sys_ = {"role": "system", "content": "You are a helpful assistant. Use tools when useful."}
    user = {"role": "user", "content": "What is 12 * 34?"}
    return [
        [sys_, user, asks("", call(0, a)), answer(0, a, "408"), asks("The answer is 408.")],
        [
            sys_,
            user,
            asks("Let me compute.", call(0, a), call(1, b)),
            answer(0, a, "408"),
            answer(1, b, '{"ok": true}'),
            asks("", call(2, a)),
            answer(2, a, "line one\nline two"),
            {"role": "user", "content": "And 5 * 6?"},
            asks("<think>\nsmall\n</think>\n\n30."),
            {"role": "user", "content": "Thanks."},
            asks("You are welcome."),
        ],
        [
            user,
            asks("<think>\nI should call a tool.\n</think>\n\n", call(0, a)),
            answer(0, a, "408"),
            {"role": "user", "content": "Sure?"},
            asks("<think>\nYes.\n</think>\n\nYes, 408."),
            {"role": "user", "content": "Once more."},
            asks("408."),
        ],
        [
            sys_,
            user,
            asks("Hmm."),
            {"role": "user", "content": "Go on."},
            asks("", call(0, b)),
            answer(0, b, "done"),
            asks("Done."),
        ],
    ]
