"""Tool choices the generator enforces (``generator/constraints.py``, ``SamplingParams.tool_choice``):
the structural tag handed to vLLM's structured output, checked with xgrammar on real tokenizers
(the tiny model's, and Qwen2.5's family where ``<tool_call>`` is one added token) for what it lets
through and what it masks; the servicer builds it from each prompt's own tools (messages or
continuation) and refuses a choice it cannot enforce, naming the field; a Continuation of a turn
cut at its budget is closed with the end-of-turn token first (``close_turn``). vLLM's own use of
the tag, with real sampling, is tests/integration/test_gateway.py's."""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import grpc
import pytest
from relayrl.common.rpc import InvalidRequest
from relayrl.common.v1 import common_pb2 as c
from relayrl.generator.constraints import _compiles, output_constraint, tool_call_constraint
from relayrl.generator.v1 import generator_pb2 as g

from tests.kit.agent_stack import ScriptedEngine
from tests.kit.chat import chat_tokenizer
from tests.kit.generator import serving

CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}  # fmt: skip
ANSWER = {"type": "function", "function": {"name": "final_answer", "parameters": {
    "type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}}}  # fmt: skip
TOOLS = [CALC, ANSWER]
CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
GOOD = CALL.format("calc", '{"expression": "12 * 34"}')
DONE = CALL.format("final_answer", '{"answer": 408}')


class Grammar:
    """xgrammar's matcher for a structural tag on one of the kit's tokenizers, fed token ids."""

    def __init__(self, tag: str, family: str = "tiny"):
        xgr = pytest.importorskip("xgrammar")
        self.tok = chat_tokenizer(family)
        self.stop = self.tok.convert_tokens_to_ids("<|im_end|>")
        info = xgr.TokenizerInfo.from_huggingface(
            self.tok, vocab_size=len(self.tok), stop_token_ids=[self.stop]
        )
        self.matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_structural_tag(tag))

    def takes(self, text: str, then_stop: bool = True) -> bool:
        """Whether the tokens of ``text`` (and then the stop token) are all accepted."""
        ids = self.tok.encode(text, add_special_tokens=False) + ([self.stop] if then_stop else [])
        ok = all(self.matcher.accept_token(t) for t in ids)
        self.matcher.reset()
        return ok


@pytest.mark.parametrize("family", ["tiny", "qwen2_5"])
def test_required_lets_through_calls_of_the_tools_in_the_models_own_syntax_and_nothing_else(family):
    grammar = Grammar(tool_call_constraint(TOOLS, "hermes", "required"), family)
    assert grammar.takes(GOOD) and grammar.takes(DONE) and grammar.takes(f"{GOOD}\n{DONE}")
    assert not grammar.takes("It is 408.")  # text instead of a call
    assert not grammar.takes(f"Let me compute.\n{GOOD}")  # text before it
    assert not grammar.takes("", then_stop=True)  # the turn may not end without a call
    assert not grammar.takes(CALL.format("search", "{}"))  # a tool the prompt does not have
    assert not grammar.takes(CALL.format("calc", "{}"))  # its schema's required argument missing
    assert not grammar.takes(CALL.format("final_answer", '{"answer": "408"}'))  # the wrong type
    assert not grammar.takes(f"{GOOD} and then some text")  # after the calls: only the stop token


def test_a_named_function_is_one_call_of_it_and_single_calls_stop_after_one():
    named = Grammar(tool_call_constraint(TOOLS, "hermes", "function", "final_answer"))
    assert named.takes(DONE) and not named.takes(GOOD) and not named.takes(f"{DONE}\n{DONE}")
    single = Grammar(tool_call_constraint(TOOLS, "hermes", "required", single=True))
    assert single.takes(GOOD) and not single.takes(f"{GOOD}\n{DONE}")


def test_llama3_json_calls_are_one_object_with_parameters():
    grammar = Grammar(tool_call_constraint(TOOLS, "llama3_json", "required"))
    assert grammar.takes('{"name": "calc", "parameters": {"expression": "1 + 1"}}')
    assert not grammar.takes('{"name": "calc", "arguments": {"expression": "1 + 1"}}')


SCHEMA = json.dumps({"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
                     "additionalProperties": False})  # fmt: skip


def test_an_answer_schema_is_json_of_it_or_calls_where_the_prompt_has_tools():
    alone = Grammar(output_constraint(None, "hermes", "", json_schema=SCHEMA))
    assert alone.takes('{"answer": 408}') and not alone.takes('{"answer": "408"}')
    assert (
        not alone.takes("408") and not alone.takes('{"answer": 408, "why": "calc"}') and not alone.takes(GOOD)
    )
    with_tools = Grammar(output_constraint(TOOLS, "hermes", "", json_schema=SCHEMA))
    assert (
        with_tools.takes('{"answer": 408}') and with_tools.takes(GOOD) and not with_tools.takes("It is 408.")
    )
    # tool_choice "none" reads no calls (no tool format): the answer alone
    assert not Grammar(output_constraint(TOOLS, "", "", json_schema=SCHEMA)).takes(GOOD)
    # a tool choice wins: calls only
    assert output_constraint(TOOLS, "hermes", "required", json_schema=SCHEMA) == tool_call_constraint(
        TOOLS, "hermes", "required"
    )


def test_a_schema_the_grammar_compiler_cannot_take_constrains_to_any_object(caplog):
    pytest.importorskip("xgrammar")
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"$ref": "#/$defs/missing"}}}
    assert not _compiles(json.dumps(odd["function"]["parameters"]))
    with caplog.at_level(logging.WARNING, "relayrl.generator.constraints"):
        tag = json.loads(tool_call_constraint([odd], "hermes", "required"))
    assert tag["format"]["tags"][0]["content"]["json_schema"] == {"type": "object"}
    assert "does not compile" in caplog.text
    assert Grammar(json.dumps(tag)).takes(CALL.format("odd", '{"any": [1, 2]}'))


@pytest.mark.parametrize(
    ("tools", "fmt", "choice", "name", "words"),
    [
        ([], "hermes", "required", "", "needs a prompt with tools"),
        (TOOLS, "", "required", "", "needs sampling.tool_format"),
        (TOOLS, "hermes", "function", "search", "is not one of the prompt's tools"),
    ],
)
def test_a_choice_that_cannot_be_enforced_is_refused_naming_why(tools, fmt, choice, name, words):
    with pytest.raises(InvalidRequest, match=words):
        tool_call_constraint(tools, fmt, choice, name)


# -- through the servicer -----------------------------------------------------------------------


@pytest.fixture
async def svc():
    async with serving(ScriptedEngine()) as s:  # room for tools in its context
        yield s


def first_turn(codec, cut: bool = False) -> list[int]:
    ids = codec.render([{"role": "user", "content": "What is 12 * 34?"}], TOOLS)
    if cut:  # the turn ran out of tokens mid-call
        return ids + codec.encode('<tool_call>\n{"name": "calc", "argu')
    return ids + codec.encode(GOOD) + [min(codec.end_of_turn_ids)]


async def generate(s, prompt: c.Prompt, **sampling) -> list[c.Sample]:
    req = g.GenerateRequest(prompts=[prompt], sampling=g.SamplingParams(n=1, **sampling))
    return [x async for r in s.stub.Generate(req) for x in r.samples]


async def test_the_engine_gets_each_prompts_constraint_from_its_own_tools(svc):
    messages = c.Prompt(prompt_id="m", messages=c.ChatMessages(
        messages=[c.ChatMessage(role="user", content="What is 12 * 34?")], tools_json=json.dumps(TOOLS)))  # fmt: skip
    await generate(
        svc, messages, tool_format="hermes", tool_choice=g.TOOL_CHOICE_REQUIRED, single_tool_call=True
    )
    cont = c.Prompt(prompt_id="c", continuation=c.Continuation(
        prefix_token_ids=first_turn(svc.engine.chat_codec()), tools_json=json.dumps([CALC]),
        append=[c.ChatMessage(role="tool", content="408")]))  # fmt: skip
    await generate(
        svc, cont, tool_format="hermes", tool_choice=g.TOOL_CHOICE_FUNCTION, tool_choice_function="calc"
    )
    await generate(svc, messages, tool_format="hermes")  # free: no constraint
    (_, (p1,), spec1), (_, (p2,), spec2), (_, (p3,), _) = svc.engine.calls
    assert p1.constraint == tool_call_constraint(TOOLS, "hermes", "required", single=True)
    assert p2.constraint == tool_call_constraint([CALC], "hermes", "function", "calc")
    assert p3.constraint == ""
    assert (spec1.tool_choice, spec1.single_tool_call, spec2.tool_choice_function) == (
        "required",
        True,
        "calc",
    )


@pytest.mark.parametrize(
    ("sampling", "words"),
    [
        ({"tool_choice": g.TOOL_CHOICE_REQUIRED}, "needs sampling.tool_format"),
        ({"tool_choice": g.TOOL_CHOICE_FUNCTION, "tool_format": "hermes"}, "tool_choice_function"),
        ({"tool_choice_function": "calc", "tool_format": "hermes"}, "tool_choice_function"),
        ({"tool_choice": 7, "tool_format": "hermes"}, "not one this contract knows"),
        ({"tool_choice": g.TOOL_CHOICE_REQUIRED, "tool_format": "hermes"}, "needs a prompt with tools"),
        ({"json_schema": "[1, 2]"}, "sampling.json_schema must be a JSON schema object"),
        ({"json_schema": "{" * 70_000}, "sampling.json_schema: 70000 characters"),
    ],
)
async def test_a_tool_choice_the_generator_cannot_enforce_is_invalid_argument(svc, sampling, words):
    prompt = c.Prompt(prompt_id="t", token_ids=c.TokenIds(ids=[1, 2, 3]))
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await generate(svc, prompt, **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


async def test_a_turn_cut_at_its_budget_is_closed_before_it_is_extended(svc):
    codec = svc.engine.chat_codec()
    prefix = first_turn(codec, cut=True)
    tail = [c.ChatMessage(role="user", content="Go on.")]
    cont = c.Continuation(prefix_token_ids=prefix, append=tail, tools_json=json.dumps(TOOLS))
    with pytest.raises(grpc.aio.AioRpcError) as e:  # without close_turn: refused, as before
        await generate(svc, c.Prompt(prompt_id="a", continuation=cont))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "end-of-turn" in e.value.details()
    cont.close_turn = True
    (s,) = await generate(svc, c.Prompt(prompt_id="b", continuation=cont))
    ids = list(s.prompt_token_ids)
    assert ids[: len(prefix)] == prefix and ids[len(prefix)] == min(codec.end_of_turn_ids)
    closed = c.Continuation(prefix_token_ids=[*prefix, min(codec.end_of_turn_ids)], append=tail,
                            tools_json=json.dumps(TOOLS))  # fmt: skip
    (same,) = await generate(svc, c.Prompt(prompt_id="c", continuation=closed))
    assert list(same.prompt_token_ids) == ids  # what the prompt is once the turn is closed


# -- a weight swap in the middle of a constrained sample ------------------------------------------


class FakeLLM:
    """vLLM's AsyncLLM as ``VLLMEngine._segment`` uses it: the first request writes two tokens, a
    weight swap lands (the engine's version goes 0 -> 1) and vLLM aborts it; every later request
    writes ``[7, 8, STOP]`` and stops."""

    errored = False

    def __init__(self, engine):
        self.engine, self.requests = engine, []

    async def add_request(self, rid, prompt, params, lora_request=None):
        self.requests.append((list(prompt["prompt_token_ids"]), params))
        queue: asyncio.Queue = asyncio.Queue()

        def out(ids, reason):
            lps = [{t: SimpleNamespace(logprob=-0.5)} for t in ids]
            return SimpleNamespace(
                outputs=[SimpleNamespace(index=0, token_ids=ids, logprobs=lps, finish_reason=reason)]
            )

        async def run():
            if len(self.requests) == 1:
                queue.put_nowait(out([5, 6], None))
                async with self.engine._gate.swap():
                    self.engine.version = 1
                queue.put_nowait(out([], "abort"))
            else:
                queue.put_nowait(out([7, 8, 2], "stop"))

        self.task = asyncio.ensure_future(run())
        return SimpleNamespace(
            get_nowait=lambda: None if queue.empty() else queue.get_nowait(), get=queue.get
        )

    async def abort(self, rid):
        pass


@pytest.mark.parametrize("constrained", [True, False], ids=["constrained", "free"])
async def test_a_constrained_sample_cut_by_a_swap_starts_again_under_the_new_weights(tmp_path, constrained):
    pytest.importorskip("vllm")
    from relayrl.generator.config import GeneratorConfig
    from relayrl.generator.engine import PromptIn, SamplingSpec, prompt_seed
    from relayrl.generator.vllm_engine import VLLMEngine

    engine = VLLMEngine(GeneratorConfig(engine={"model": str(tmp_path)}), "r0")
    engine._llm, engine._tokenizer, engine.max_model_len = FakeLLM(engine), chat_tokenizer("tiny"), 512
    tag = tool_call_constraint(TOOLS, "hermes", "required") if constrained else ""
    prompt = PromptIn("e/0/t0", (1, 2, 3), tag)
    spec = SamplingSpec(max_tokens=16, seed=11, tool_format="hermes", tool_choice="required" if tag else "")
    (s,) = [x async for x in engine.generate("r", [prompt], spec)]
    (first_ids, first), (again_ids, again) = engine._llm.requests
    if constrained:  # the grammar cannot resume mid-call: the sample starts over, on version 1 only
        assert first.structured_outputs.structural_tag == again.structured_outputs.structural_tag == tag
        assert again_ids == [1, 2, 3]
        assert (s.token_ids, s.version_spans) == ([7, 8, 2], [(1, 0, 3)])
        assert again.seed == prompt_seed(11, "e/0/t0/0/0") and again.max_tokens == 16
    else:  # a free one continues after its tokens so far, its spans exact
        assert first.structured_outputs is again.structured_outputs is None
        assert again_ids == [1, 2, 3, 5, 6]
        assert (s.token_ids, s.version_spans) == ([5, 6, 7, 8, 2], [(0, 0, 2), (1, 2, 5)])
