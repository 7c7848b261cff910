"""The episode warm start (``relayrl.warmstart``, ``common.modelkit.episodes``): calc traces are
the env's own episodes rendered through the generator's chat codec, the loss mask is on the
model's turns only, and the ids are exactly what the coordinator's RL episode of the same actions
gives (prompt, completion, bridge, completion). No torch model, no vLLM: a tiny tokenizer."""

from __future__ import annotations

import asyncio
import json
import subprocess
from types import SimpleNamespace

import pytest
from relayrl.common.data.tasks import generate
from relayrl.common.modelkit.episodes import episode_trace
from relayrl.common.modelkit.tiny import tokenizer_corpus
from relayrl.common.modelkit.tokenizer import save_tokenizer, train_bpe
from relayrl.common.v1 import common_pb2
from relayrl.coordinator import assets
from relayrl.coordinator.config import (
    AlgorithmSection,
    EpisodesSection,
    SamplingSection,
    ScheduleSection,
    ServicesSection,
    TinyModelSpec,
)
from relayrl.coordinator.rollout import make
from relayrl.env.base import Action, ToolCall
from relayrl.env.calc import CalcEnv
from relayrl.env.v1 import env_pb2 as ev
from relayrl.generator.bridge import ChatCodec
from relayrl.generator.toolcalls import parse_tool_calls
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.warmstart import TASKS, ToolPlayer, tool_corpus, tool_trace

ROWS = generate("calc", 6, seed=3, split="train")


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    """The calc model's tokenizer (tools and calc's texts in its corpus), no weights."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("calc-tok")
    save_tokenizer(train_bpe(tokenizer_corpus(0, tools=True, extra=tool_corpus(0))), out, 1024)
    return ChatCodec(AutoTokenizer.from_pretrained(out))


@pytest.fixture(scope="module")
def sandbox():
    from relayrl.common.sandbox import Sandbox, SandboxConfig

    return Sandbox.from_config(SandboxConfig(workers=1))


def _model_text(codec, trace) -> list[str]:
    """The masked-in runs of a trace, decoded (the model's turns)."""
    runs, run = [], []
    for t, m in zip(trace.ids, trace.mask, strict=True):
        if m:
            run.append(t)
        elif run:
            runs, run = [*runs, run], []
    return [codec.decode(r) for r in [*runs, *([run] if run else [])]]


def test_the_tool_branch_calls_calc_copies_its_answer_and_trains_on_the_model_turns_only(codec):
    row = ROWS[0]
    a, b = row["extra_info"]["expression"].split(" * ")
    product = int(a) * int(b)
    trace = tool_trace(codec, row, 0, tool=True)
    call = (
        f'<tool_call>\n{{"name": "calc", "arguments": {{"expression": "{a} * {b}"}}}}\n</tool_call><|im_end|>'
    )
    assert _model_text(codec, trace) == [call, f"The answer is {product}.<|im_end|>"]
    text = codec.decode(trace.ids)
    # the env's own first messages and tools, the tool's answer as the template renders it
    first = CalcEnv().reset(row, 0)
    assert [m["role"] for m in first] == ["system", "user"]
    assert (
        codec.decode(codec.render(first, TASKS["calc"].tools()))
        == text[: text.index('<tool_call>\n{"name": "calc", "arguments": {"expression')]
    )
    assert (
        f"<|im_start|>user\n<tool_response>\n{product}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        in text
    )
    assert trace.ids[: len(codec.render(first, TASKS["calc"].tools()))] == codec.render(
        first, TASKS["calc"].tools()
    )


def test_the_pyexec_tool_branch_runs_print_a_times_b_in_the_sandbox(codec, sandbox):
    row = ROWS[0]
    expression = row["extra_info"]["expression"]
    trace = tool_trace(codec, row, 0, True, "pyexec", sandbox)
    call = f'<tool_call>\n{{"name": "python", "arguments": {{"code": "print({expression})"}}}}\n</tool_call><|im_end|>'
    answer = row["reward_model"]["ground_truth"]
    assert _model_text(codec, trace) == [call, f"The answer is {answer}.<|im_end|>"]
    assert f"<tool_response>\n{answer}\n\n</tool_response>" in codec.decode(
        trace.ids
    )  # stdout, its newline kept
    assert "python tool" in codec.decode(trace.ids[:40])  # pyexec's own system message


def test_the_direct_branch_answers_at_once(codec):
    row = ROWS[1]
    trace = tool_trace(codec, row, 0, tool=False)
    assert _model_text(codec, trace) == [f"The answer is {row['reward_model']['ground_truth']}.<|im_end|>"]
    assert trace.ids == codec.render(CalcEnv().reset(row, 0), TASKS["calc"].tools()) + [
        t for t, m in zip(trace.ids, trace.mask, strict=True) if m
    ]


def test_a_trace_is_a_full_render_of_the_dialogue_on_this_prefix_preserving_template(codec):
    """Bridged ids equal rendering the whole dialogue (the template is prefix-preserving), so SFT
    and a re-rendered prompt agree too."""
    row = ROWS[2]
    env = CalcEnv()
    first = env.reset(row, 0)
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c",
                "type": "function",
                "function": {"name": "calc", "arguments": {"expression": "1 + 2"}},
            }
        ],
    }
    answer, _, _ = env.step(Action("", (ToolCall("c", "calc", '{"expression": "1 + 2"}'),)))
    final = {"role": "assistant", "content": "The answer is 3."}
    trace = episode_trace(codec, first, TASKS["calc"].tools(), [(call, answer), (final, [])])
    whole = codec.render([*first, call, *answer, final], TASKS["calc"].tools(), add_generation_prompt=False)
    assert whole[: len(trace.ids)] == trace.ids and codec.decode(whole[len(trace.ids) :]) == "\n"


class _Generator:
    """The generator as the coordinator calls it, on the real chat codec: a messages prompt is
    rendered, a continuation bridged; the completions are the scripted turns' ids, their tool
    calls read by the generator's parser."""

    def __init__(self, codec, turns):
        self.codec, self.turns = codec, list(turns)

    async def check_chat(self, tools_json, tool_format):
        check = self.codec.check(json.loads(tools_json), tool_format)
        return g.CheckChatResponse(
            round_trip_ok=check.round_trip_ok,
            prefix_preserving=check.prefix_preserving,
            stop_token_ids=check.stop_token_ids,
        )

    async def generate(self, prompts, sampling, request_id, min_version=0, affinity=""):
        (p,) = prompts
        if p.WhichOneof("input") == "messages":
            msgs = [{"role": m.role, "content": m.content} for m in p.messages.messages]
            ids = self.codec.render(msgs, json.loads(p.messages.tools_json))
        else:
            c = p.continuation
            append = [{"role": m.role, "content": m.content} for m in c.append]
            ids = self.codec.bridge(list(c.prefix_token_ids), append, json.loads(c.tools_json))
        out = self.turns.pop(0)
        _, calls = parse_tool_calls(self.codec.completion_text(out), sampling.tool_format, "call_0_")
        s = common_pb2.Sample(
            prompt_id=p.prompt_id,
            prompt_token_ids=ids,
            completion_token_ids=out,
            logprobs=[-0.5] * len(out),
            finish_reason=common_pb2.FINISH_REASON_STOP,
            text=self.codec.tokenizer.decode(out, skip_special_tokens=True),
            tool_calls=[
                common_pb2.ToolCall(id=c.id, name=c.name, arguments_json=c.arguments_json, parse=int(c.parse))
                for c in calls
            ],
        )
        return {p.prompt_id: [s]}


class _Envs:
    """The env service as the coordinator calls it, on a real env of the task in this process."""

    def __init__(self, task="calc", sandbox=None):
        self.env = TASKS[task].make_env(sandbox)
        self.tools = json.dumps(TASKS[task].env.tools)

    async def env_info(self, name):
        return ev.EnvInfo(name=name, tools_json=self.tools, expects_tools=True, max_turns=4)

    async def reset(self, req):
        msgs = self.env.reset(json.loads(req.task_json), req.seed)
        return "env-0", ev.ResetResponse(
            session_id="s",
            messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in msgs],
            tools_json=self.tools,
            max_turns=4,
        )

    async def step(self, rep, req):
        a = req.action
        calls = tuple(ToolCall(c.id, c.name, c.arguments_json) for c in a.tool_calls)
        obs, done, _ = self.env.step(Action(a.text, calls))
        return ev.StepResponse(
            observations=[
                common_pb2.ChatMessage(
                    role=m["role"], content=m["content"], tool_call_id=m["tool_call_id"], name=m["name"]
                )
                for m in obs
            ],
            done=done,
        )

    async def close_session(self, rep, req):
        r = self.env.reward()
        return ev.CloseResponse(reward=r.reward, outcome=ev.OUTCOME_OK)


@pytest.mark.parametrize("task, tool", [("calc", True), ("calc", False), ("pyexec", True)])
def test_sft_ids_are_the_ids_of_the_rl_episode_of_the_same_actions(codec, sandbox, task, tool):
    """Parity: the coordinator's episode (``rollout.make``'s tool episodes) through the generator's codec and the env,
    whose model turns are the trace's, gives the trace's ids and loss mask, and reward 1."""
    row = ROWS[3]
    trace = tool_trace(codec, row, 0, tool, task, sandbox)
    turns, run = [], []
    for t, m in zip(trace.ids, trace.mask, strict=True):  # the model's turns, as sampled
        if m:
            run.append(t)
        elif run:
            turns, run = [*turns, run], []
    turns.append(run)
    cfg = SimpleNamespace(
        seed=0,
        episodes=EpisodesSection(env=task),
        sampling=SamplingSection(n=1, max_tokens=64),
        schedule=ScheduleSection(max_staleness=0),
        algorithm=AlgorithmSection(advantage="grpo"),
        services=ServicesSection(),
    )
    envs = _Envs(task, sandbox)
    source = asyncio.run(make(cfg, _Generator(codec, turns), None, envs))
    ro = asyncio.run(source.rollout([("p0", row)], False, "s1", 0))
    ((_, (s,), (result,)),) = ro.groups
    assert [*s.prompt_token_ids, *s.completion_token_ids] == trace.ids
    mask = ro.mask(s) or [1.0] * len(s.completion_token_ids)  # None: every token the model's
    assert mask == [float(m) for m in trace.mask[len(s.prompt_token_ids) :]]
    assert all(m == 0 for m in trace.mask[: len(s.prompt_token_ids)])
    assert result.reward == 1.0 and ro.stats["tool_calls_per_episode"] == int(tool)


def test_a_held_out_player_reads_calls_as_the_generator_does_and_scores_by_the_env(codec):
    row = ROWS[4]
    trace = tool_trace(codec, row, 0, tool=True)
    first = codec.render(CalcEnv().reset(row, 0), TASKS["calc"].tools())
    model = [t for t, m in zip(trace.ids, trace.mask, strict=True) if m]
    cut = model.index(codec.tokenizer.convert_tokens_to_ids("<|im_end|>")) + 1
    p = ToolPlayer(codec, row, 0)
    assert p.ids == first
    answer = p.step(model[:cut])
    assert [m["content"] for m in answer] == [row["reward_model"]["ground_truth"]]
    assert (
        codec.bridge([*first, *model[:cut]], answer, TASKS["calc"].tools())
        == trace.ids[: len(trace.ids) - len(model) + cut]
    )
    assert p.step(model[cut:]) is None and p.correct() and p.tool_calls == 1
    wrong = ToolPlayer(codec, row, 0)
    assert wrong.step(codec.encode("The answer is 12.<|im_end|>")) is None
    assert not wrong.correct() and wrong.tool_calls == 0


def test_the_tokenizer_corpus_without_extra_texts_is_unchanged():
    assert tokenizer_corpus(0, tools=True, extra=()) == tokenizer_corpus(0, tools=True)
    assert tokenizer_corpus(0, extra=["x"]) == [*tokenizer_corpus(0), "x"]


def test_a_calc_tiny_model_is_built_by_the_warm_start_process_and_moved_in_when_complete(
    tmp_path, monkeypatch
):
    seen = []

    def run(cmd, **kw):
        seen.append(cmd)
        out = tmp_path / "m.part"
        out.mkdir()
        for name in ("model.safetensors", "config.json"):
            (out / name).write_text("{}")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(assets.subprocess, "run", run)
    spec = TinyModelSpec(task="calc", sft_steps=7, tool_share=0.25, sft_tool_bar=0.5, sft_max_steps=9)
    assets.build_episode_model(tmp_path / "m", spec)
    (cmd,) = seen
    assert cmd[1:4] == ["-m", "relayrl.warmstart", "--out"] and "--sft-steps" in cmd and "0.25" in cmd
    assert cmd[cmd.index("--tool-bar") + 1] == "0.5" and cmd[cmd.index("--max-steps") + 1] == "9"
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "m.part").exists()


def _tiny_qwen2(hidden: int, layers: int):
    """A random Qwen2 over the calc tokenizer's ids, seeded."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=576,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=1024,
        )
    )


def test_the_shared_prefix_runs_once_with_the_same_loss_and_gradients(codec):
    import torch
    from relayrl.common.modelkit.episodes import batch_loss, shared_prefix

    traces = [tool_trace(codec, r, i, i % 2 == 0) for i, r in enumerate(ROWS)]
    shared = shared_prefix(traces)
    assert shared > 200 and all(t.ids[:shared] == traces[0].ids[:shared] for t in traces)
    model = _tiny_qwen2(hidden=64, layers=2)
    grads = []
    for n in (0, shared):
        model.zero_grad()
        loss = batch_loss(model, traces, codec.tokenizer.pad_token_id, n)
        loss.backward()
        grads.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
    (l0, g0), (l1, g1) = grads
    assert abs(l0 - l1) < 1e-5
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(g0, g1, strict=True))


class _Oracle:
    """A stand-in model whose argmax after each position of the n-th sequence it is given is
    ``truth[n]``'s next token."""

    def __init__(self, truth: list[list[int]], vocab: int = 16):
        self.truth, self.vocab, self.seen = truth, vocab, 0

    def train(self, mode: bool = True):
        return self

    def __call__(self, input_ids, attention_mask):
        import torch

        logits = torch.zeros((*input_ids.shape, self.vocab))
        for i in range(input_ids.shape[0]):
            for k, t in enumerate(self.truth[self.seen + i][1:]):
                logits[i, k, t] = 1.0
        self.seen = (self.seen + input_ids.shape[0]) % len(self.truth)
        return SimpleNamespace(logits=logits)


def test_reproduced_counts_traces_whose_trained_tokens_after_the_first_are_all_argmax():
    from relayrl.common.modelkit.episodes import Trace, reproduced

    mask = [0, 0, 1, 1, 0, 1]
    traces = [Trace([1, 2, 3, 4, 5, 6], mask)] * 4
    model = _Oracle(
        [
            [1, 2, 3, 4, 5, 6],  # every token
            [1, 2, 9, 4, 5, 6],  # the first trained token (the branch) only is wrong
            [1, 2, 3, 4, 5, 9],  # a later trained token is wrong
            [1, 2, 3, 4, 9, 6],  # an untrained token (the env's) is wrong
        ]
    )
    assert reproduced(model, traces, pad_id=0) == 3 / 4
    assert reproduced(model, traces, pad_id=0, skip=0) == 2 / 4
    assert reproduced(model, traces, pad_id=0, batch_size=1) == 3 / 4


def test_training_goes_on_past_its_steps_until_the_check_passes_or_the_most_steps(codec):
    from relayrl.common.modelkit.episodes import train_traces

    traces = [tool_trace(codec, r, i, i % 2 == 0) for i, r in enumerate(ROWS)]
    model = _tiny_qwen2(hidden=32, layers=1)
    pad = codec.tokenizer.pad_token_id
    answers = iter([False, False, True])
    calls = []
    passed = lambda: calls.append(1) or next(answers)  # noqa: E731
    _, ran = train_traces(model, traces, pad, 2, 0, 1e-3, 2, passed, max_steps=20, check_every=3)
    assert ran == 2 + 3 + 3 and len(calls) == 3
    calls.clear()
    _, ran = train_traces(model, traces, pad, 2, 0, 1e-3, 2, lambda: calls.append(1) or False, 6, 3)
    assert ran == 6 and len(calls) == 2  # checked at 2 and 5; at 6, the most, the caller checks
    _, ran = train_traces(model, traces, pad, 2, 0, 1e-3, 2)
    assert ran == 2


def test_a_warm_start_that_never_reaches_its_bar_fails_naming_what_to_change(tmp_path, capsys):
    from relayrl.warmstart import main

    argv = ["--out", str(tmp_path / "m"), "--task", "calc", "--sft-steps", "1", "--max-steps", "2"]
    argv += ["--batch-size", "2", "--heldout", "2", "--tool-bar", "1"]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert "after 2 warm-start steps" in err and "under the bar of 1.00" in err
    assert "sft_max_steps" in err and "sft_tool_bar: 0" in err
