"""GeneratorService over a real grpc.aio server on port 0, around a fake engine.

What is checked: the proto <-> domain mapping of Generate, status codes for bad input, load,
cancellation, deadlines and engine failures, health transitions around weight swaps and
shutdown, weight-plan and LoadWeights stream validation, and reflection. The fake engine
(``tests/kit/generator.py``) is deterministic (completion = prompt ids reversed, logprob -0.5 per
token) and records what the servicer hands it; real-engine behaviour is covered by
tests/integration.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from relayrl.common.grpc_server import start
from relayrl.common.rpc import InvalidRequest
from relayrl.common.v1 import common_pb2 as c
from relayrl.generator.config import GeneratorConfig
from relayrl.generator.server import SERVICE, build
from relayrl.generator.v1 import generator_pb2 as g

from tests.kit.generator import FakeEngine, serving
from tests.kit.waits import error_of, until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
async def svc():
    async with serving(FakeEngine()) as s:
        yield s


def req(*prompts: c.Prompt, **sampling) -> g.GenerateRequest:
    prompts = prompts or (tok("p0", 1, 2, 3),)
    return g.GenerateRequest(prompts=prompts, sampling=g.SamplingParams(**{"n": 1, **sampling}))


def tok(pid: str, *ids: int) -> c.Prompt:
    return c.Prompt(prompt_id=pid, token_ids=c.TokenIds(ids=ids))


async def collect(call) -> list[c.Sample]:
    return [s async for r in call for s in r.samples]


async def ready_state(s, service: str = SERVICE) -> int:
    return (await s.health.Check(health_pb2.HealthCheckRequest(service=service))).status


# -- Generate ---------------------------------------------------------------------------------


async def test_generate_streams_one_message_per_sample_with_fields_mapped(svc):
    prompts = (
        tok("ids", 5, 6, 7),
        c.Prompt(prompt_id="chat-split", messages=c.ChatMessages(messages=[c.ChatMessage(role="u", content="hi")])),
        c.Prompt(prompt_id="txt", text="ab"),
    )  # fmt: skip
    msgs = [m async for m in svc.stub.Generate(req(*prompts, n=3, temperature=0.5, top_k=0, seed=7))]
    assert all(len(m.samples) == 1 for m in msgs) and len(msgs) == 9
    by = {(s.prompt_id, s.sample_index): s for m in msgs for s in m.samples}
    s = by["ids", 1]
    assert list(s.prompt_token_ids) == [5, 6, 7] and list(s.completion_token_ids) == [7, 6, 5]
    assert list(s.logprobs) == [-0.5] * 3 and s.text == "7 6 5" and s.replica_id == "fake-0"
    assert [by["ids", i].finish_reason for i in range(3)] == [
        c.FINISH_REASON_STOP, c.FINISH_REASON_LENGTH, c.FINISH_REASON_ABORT]  # fmt: skip
    assert s.policy_version == 0 and not s.version_spans  # one span: implied by policy_version
    chat = by["chat-split", 0]
    assert list(chat.prompt_token_ids) == [ord(ch) for ch in "u:hi|"]
    assert [(v.version, v.start, v.end) for v in chat.version_spans] == [(0, 0, 1), (1, 1, 5)]
    assert list(by["txt", 0].prompt_token_ids) == [97, 98]
    _, _, spec = svc.engine.calls[0]
    assert (spec.n, spec.temperature, spec.top_p, spec.top_k, spec.seed) == (3, 0.5, 1.0, -1, 7)


@pytest.mark.parametrize(
    ("request_", "problem"),
    [
        (g.GenerateRequest(), "prompts is empty"),
        (req(tok("a", 1), tok("a", 2)), "prompt_id values must be unique"),
        (req(n=0), "sampling.n must be at least 1"),
        (req(top_p=0.0), "sampling.top_p must be in (0, 1]"),
        (req(top_p=1.5), "sampling.top_p must be in (0, 1]"),
        (req(temperature=-0.1), "sampling.temperature must be in [0, 100]"),
        (req(temperature=float("nan")), "sampling.temperature must be in [0, 100]"),
        (req(temperature=float("inf")), "sampling.temperature must be in [0, 100]"),
        (req(temperature=2.5), "sampling: temperature must be at most 2"),  # engine.check_sampling
        (req(top_k=-2), "sampling.top_k must be -1, 0 (off) or positive"),
        (req(stop=["ok", ""]), "sampling.stop strings must have 1 to 256 characters"),
        (req(stop=["x" * 257]), "sampling.stop strings must have 1 to 256 characters"),
        (req(stop=["s"] * 65), "at most 64 values each"),
        (req(n=20000), "exceeds 16384 (max_samples_per_request)"),
        (req(tok("a", 1), tok("", 2)), "every prompt needs a prompt_id"),
        (g.GenerateRequest(request_id="r" * 300, prompts=[tok("a", 1)]), "request_id takes at most 256"),
        (req(c.Prompt(prompt_id="x")), "prompt 'x': no input"),
        (req(c.Prompt(prompt_id="m", messages=c.ChatMessages())), "prompt 'm': messages is empty"),
        (req(tok("e")), "prompt 'e': prompt is empty"),  # engine.check_prompt, prompt id added
        (req(c.Prompt(prompt_id="t", text="")), "prompt 't': prompt is empty"),
        # the fake's context is 64 tokens: 32 characters per token is the default ceiling
        (req(c.Prompt(prompt_id="big", text="x" * 2049)), "prompt 'big': 2049 characters; at most 2048"),
        (
            req(
                c.Prompt(
                    prompt_id="chat",
                    messages=c.ChatMessages(messages=[c.ChatMessage(role="user", content="x" * 5000)]),
                )
            ),
            "prompt 'chat': 5004 characters",
        ),
        (req(c.Prompt(prompt_id="q" * 5000, token_ids=c.TokenIds())), "prompt 'qqqqq"),  # name bounded
    ],
)
async def test_generate_bad_input_is_invalid_argument(svc, request_, problem):
    err = await error_of(collect(svc.stub.Generate(request_)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in err.details()
    assert not svc.engine.calls


async def test_generate_unknown_field_is_invalid_argument(svc):
    raw = req().SerializeToString() + bytes([0xF8, 0x06, 0x01])  # field 111, varint 1
    method = svc.channel.unary_stream(
        "/relayrl.generator.v1.GeneratorService/Generate",
        request_serializer=None,  # bytes as they are
        response_deserializer=g.GenerateResponse.FromString,
    )
    err = await error_of(collect(method(raw)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown field number 111" in err.details()


async def test_generate_beyond_max_pending_is_resource_exhausted():
    async with serving(FakeEngine(), max_pending_requests=2) as s:
        s.engine.gate = asyncio.Event()
        running = [asyncio.create_task(collect(s.stub.Generate(req()))) for _ in range(2)]
        await until(lambda: s.engine.active == 2)
        err = await error_of(collect(s.stub.Generate(req())))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pending" in err.details()
        s.engine.gate.set()
        assert [len(r) for r in await asyncio.gather(*running)] == [1, 1]
        assert len(await collect(s.stub.Generate(req()))) == 1  # the slots were given back


async def test_client_cancel_reaches_the_engine_and_frees_the_slot():
    async with serving(FakeEngine(delay=30), max_pending_requests=1) as s:
        call = s.stub.Generate(req())
        await until(lambda: s.engine.active == 1)
        call.cancel()
        await until(lambda: s.engine.cancelled == 1 and s.engine.active == 0)
        s.engine.delay = 0
        assert len(await collect(s.stub.Generate(req()))) == 1


async def test_deadline_exceeded_on_a_slow_engine(svc):
    svc.engine.delay = 30
    err = await error_of(collect(svc.stub.Generate(req(), timeout=0.2)))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await until(lambda: svc.engine.cancelled == 1)  # the server stopped working on it too


@pytest.mark.parametrize("rpc", ["generate", "update"])
async def test_unexpected_engine_error_is_internal_and_server_keeps_serving(svc, rpc):
    svc.engine.fail = RuntimeError("kaboom")
    call = collect(svc.stub.Generate(req())) if rpc == "generate" else svc.stub.UpdateWeights(plan())
    err = await error_of(call)
    assert err.code() == grpc.StatusCode.INTERNAL and "RuntimeError: kaboom" in err.details()
    svc.engine.fail = None
    assert len(await collect(svc.stub.Generate(req()))) == 1
    assert await ready_state(svc) == SERVING


# -- health, status, weights ------------------------------------------------------------------


def spec(name: str, shape=(4,), dtype=c.DTYPE_FLOAT32) -> c.TensorSpec:
    return c.TensorSpec(name=name, dtype=dtype, shape=shape)


def plan(*buckets: c.Bucket, version: int = 1) -> g.UpdateWeightsRequest:
    if not buckets:
        buckets = (c.Bucket(tensors=[spec("a"), spec("b", (2,))], offsets=[0, 64], nbytes=72),)
    return g.UpdateWeightsRequest(version=version, plan=c.BucketPlan(buckets=buckets))


async def test_health_and_status_follow_a_weight_swap(svc):
    assert await ready_state(svc, "") == SERVING and await ready_state(svc) == SERVING
    svc.engine.gate = asyncio.Event()
    swap = asyncio.ensure_future(svc.stub.UpdateWeights(plan(version=3)))
    await until(lambda: svc.engine.swapping)
    assert await ready_state(svc) == NOT_SERVING and await ready_state(svc, "") == SERVING
    st = await svc.stub.GetStatus(g.GetStatusRequest())
    assert st.swapping and not st.ready and st.policy_version == 0
    svc.engine.gate.set()
    resp = await swap
    assert (resp.version, resp.nbytes) == (3, 72) and resp.swap_seconds == pytest.approx(0.01)
    assert await ready_state(svc) == SERVING
    st = await svc.stub.GetStatus(g.GetStatusRequest())
    assert (st.swapping, st.ready, st.policy_version, st.model) == (False, True, 3, "fake")
    assert svc.engine.buckets == [(3, [72])]  # (version, nbytes of each bucket)


async def test_a_swap_whose_caller_went_away_still_ends_and_serves_again(svc):
    """The learner cancels the UpdateWeights calls of a push that broke. A swap cut short there
    would serve the weights loaded so far under the old version, and stay NOT_SERVING."""
    svc.engine.gate = asyncio.Event()
    swap = svc.stub.UpdateWeights(plan(version=3))
    await until(lambda: svc.engine.swapping)
    swap.cancel()
    with pytest.raises(asyncio.CancelledError):
        await swap
    await asyncio.sleep(0.1)  # the server has seen the cancellation
    assert svc.engine.swapping and await ready_state(svc) == NOT_SERVING
    svc.engine.gate.set()
    await until(lambda: not svc.engine.swapping)
    await until_async(lambda: ready_state(svc), SERVING)
    st = await svc.stub.GetStatus(g.GetStatusRequest())
    assert (st.ready, st.policy_version) == (True, 3) and svc.engine.buckets == [(3, [72])]


async def until_async(get, wanted, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := await get()) != wanted:
        assert time.monotonic() < deadline, f"{got} != {wanted}"
        await asyncio.sleep(0.01)


async def test_refused_swap_is_invalid_argument_and_readiness_returns(svc):
    svc.engine.fail = InvalidRequest("weight plan does not match the model: a")
    err = await error_of(svc.stub.UpdateWeights(plan()))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not match" in err.details()
    assert await ready_state(svc) == SERVING


@pytest.mark.parametrize(
    ("bucket", "problem"),
    [
        (c.Bucket(tensors=[spec("a"), spec("b")], offsets=[0], nbytes=80), "2 tensors but 1 offsets"),
        (c.Bucket(tensors=[spec("a"), spec("b")], offsets=[0, 16], nbytes=80), "b: offset 16 is unaligned"),
        (c.Bucket(tensors=[spec("a"), spec("b")], offsets=[0, 0], nbytes=16), "b: offset 0 is unaligned or overlaps"),
        (c.Bucket(tensors=[spec("a"), spec("b")], offsets=[0, 64], nbytes=70), "bucket nbytes 70 does not match its tensors (they end at 80)"),
        (c.Bucket(tensors=[spec("a")], offsets=[0], nbytes=1 << 40), "bucket nbytes 1099511627776 does not match"),
        (c.Bucket(tensors=[spec("a", shape=(-4,))], offsets=[0], nbytes=0), "a: negative dimension"),
        (c.Bucket(tensors=[spec("a", dtype=c.DTYPE_UNSPECIFIED)], offsets=[0], nbytes=16), "a: dtype missing"),
        (None, "plan has no buckets"),
    ],
)  # fmt: skip
async def test_bad_weight_plan_is_invalid_argument(svc, bucket, problem):
    request = plan(bucket) if bucket is not None else g.UpdateWeightsRequest(version=1, plan=c.BucketPlan())
    err = await error_of(svc.stub.UpdateWeights(request))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in err.details()
    assert not svc.engine.buckets and await ready_state(svc) == SERVING


def chunk(name, data: bytes, offset=0, shape=(4,), dtype=c.DTYPE_FLOAT32, **first) -> g.LoadWeightsRequest:
    tensor = c.Tensor(name=name, data=data, dtype=dtype, shape=shape)
    return g.LoadWeightsRequest(tensor=tensor, offset=offset, **first)


W = bytes(range(16))  # a float32[4] tensor's bytes


async def test_load_weights_reassembles_chunked_tensors(svc):
    stream = [
        chunk("w", W[:6], 0, version=5, num_tensors=2),
        chunk("b", b"\x01" * 8, 0, shape=(1,), dtype=c.DTYPE_INT64),
        chunk("w", W[6:12], 6),
        chunk("w", W[12:], 12),
    ]
    resp = await svc.stub.LoadWeights(iter(stream))
    assert (resp.version, resp.nbytes, resp.num_tensors) == (5, 24, 2)
    assert svc.engine.loaded == [{"w": ("float32", [4], W), "b": ("int64", [1], b"\x01" * 8)}]
    assert svc.engine.version == 5 and await ready_state(svc) == SERVING


@pytest.mark.parametrize(
    ("stream", "problem"),
    [
        ([chunk("w", W[:6]), chunk("w", W[8:], 8)], "w: chunk [8, +8) does not continue the tensor"),
        ([chunk("w", W + b"xx")], "w: chunk [0, +18) does not continue the tensor"),
        ([chunk("w", W[:8]), chunk("w", W[8:], 8, shape=(2, 2))], "w: dtype or shape changed between chunks"),
        ([chunk("w", W), chunk("w", W)], "w: sent twice"),
        ([], "stream carried no tensors"),
        ([chunk("w", W, num_tensors=3)], "stream announced 3 tensors, carried 1"),
        ([chunk("w", W[:6]), chunk("v", W)], "incomplete tensors: w"),
        ([chunk("w", W, dtype=c.DTYPE_UNSPECIFIED)], "w: dtype missing"),
    ],
)
async def test_bad_load_weights_stream_is_invalid_argument(svc, stream, problem):
    err = await error_of(svc.stub.LoadWeights(iter(stream)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in err.details()
    assert not svc.engine.loaded


async def test_a_tensor_the_model_does_not_hold_is_refused_at_its_first_chunk(svc):
    """LoadWeights buffers a stream: a client sending names the model does not hold must be
    stopped at once, not after it has filled the replica's memory."""

    async def stream():
        yield chunk("not-a-weight", W[:8], version=1)
        await asyncio.Event().wait()  # the rest would never end

    err = await error_of(asyncio.wait_for(svc.stub.LoadWeights(stream()), 10))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "not-a-weight" in err.details()
    assert not svc.engine.loaded


# -- server plumbing --------------------------------------------------------------------------


async def test_reflection_lists_the_service(svc):
    stub = reflection_pb2_grpc.ServerReflectionStub(svc.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE),
    ]
    listed, found = [r async for r in stub.ServerReflectionInfo(iter(requests))]
    assert SERVICE == "relayrl.generator.v1.GeneratorService"
    assert SERVICE in {s.name for s in listed.list_services_response.service}
    assert found.file_descriptor_response.file_descriptor_proto  # grpcurl can describe it


async def test_graceful_stop_drains_then_shuts_the_engine_down():
    async with serving(FakeEngine(delay=0.2)) as s:
        call = asyncio.create_task(collect(s.stub.Generate(req(n=3))))
        await until(lambda: s.engine.active == 1)
        t0 = time.monotonic()
        stopping = asyncio.create_task(s.handle.stop(5.0))
        await asyncio.sleep(0.05)
        for name in ("", SERVICE):  # the health servicer itself: new RPCs are refused now
            check = await s.handle.health.Check(health_pb2.HealthCheckRequest(service=name), None)
            assert check.status == NOT_SERVING
        assert s.engine.shutdowns == 0  # not while a call is draining
        assert [x.sample_index for x in await call] == [0, 1, 2]
        await stopping
        assert s.engine.shutdowns == 1 and s.engine.cancelled == 0
        assert time.monotonic() - t0 < 3.0  # returned once drained, not after the whole grace


# -- weight transports -----------------------------------------------------------------------


def init(**fields) -> g.InitWeightSyncRequest:
    return g.InitWeightSyncRequest(**fields)


@pytest.mark.parametrize(
    ("request_", "spec"),
    [
        (init(master_addr="h", master_port=5, world_size=2, rank=1), ("gloo", "h", 5, 2, 1)),
        (init(master_addr="h", master_port=5, world_size=2, rank=1, backend="nccl"), ("nccl", "h", 5, 2, 1)),
        (
            init(transport=g.WEIGHT_TRANSPORT_GLOO, master_addr="h", master_port=5, world_size=3, rank=2),
            ("gloo", "h", 5, 3, 2),
        ),
        (
            init(transport=g.WEIGHT_TRANSPORT_SHM, shm_probe="relayrl-probe-1-ab", probe_checksum=7),
            ("shm", "", 0, 0, 0),
        ),
    ],
)
async def test_init_weight_sync_maps_the_transport(svc, request_, spec):
    resp = await svc.stub.InitWeightSync(request_)
    got = svc.engine.syncs[-1]
    assert (got.transport, got.master_addr, got.master_port, got.world_size, got.rank) == spec
    assert (
        resp.transport
        == {"gloo": g.WEIGHT_TRANSPORT_GLOO, "nccl": g.WEIGHT_TRANSPORT_NCCL, "shm": g.WEIGHT_TRANSPORT_SHM}[
            spec[0]
        ]
    )
    if spec[0] == "shm":
        assert (got.shm_probe, got.probe_checksum) == ("relayrl-probe-1-ab", 7)


@pytest.mark.parametrize(
    ("request_", "problem"),
    [
        (
            init(transport=g.WEIGHT_TRANSPORT_SHM, shm_probe="../../etc/passwd"),
            "is not a relayrl segment name",
        ),
        (init(transport=g.WEIGHT_TRANSPORT_SHM), "is not a relayrl segment name"),
        (init(transport=g.WEIGHT_TRANSPORT_IPC), "ipc_probe is required"),
        (init(transport=9, master_addr="h", master_port=5), "transport 9 is not one this contract knows"),
        (init(transport=g.WEIGHT_TRANSPORT_NCCL), "master_addr and master_port are required"),
    ],
)
async def test_init_weight_sync_refuses_what_cannot_work(svc, request_, problem):
    err = await error_of(svc.stub.InitWeightSync(request_))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in err.details()
    assert not svc.engine.syncs


async def test_update_weights_names_where_shm_and_ipc_buckets_are(svc):
    req = plan()
    req.shm.segment, req.shm.offsets[:] = "relayrl-w-1-ab", [0]
    await svc.stub.UpdateWeights(req)
    assert svc.engine.sources[-1].shm_segment == "relayrl-w-1-ab" and svc.engine.sources[-1].shm_offsets == (
        0,
    )
    req = plan(version=2)
    req.ipc.buffers.add(handle=b"h", storage_size_bytes=128, nbytes=72, device=0)
    await svc.stub.UpdateWeights(req)
    assert svc.engine.sources[-1].ipc[0].nbytes == 72
    await svc.stub.UpdateWeights(plan(version=3))
    assert svc.engine.sources[-1] is None  # over the open group
    bad = plan(version=4)
    bad.shm.segment, bad.shm.offsets[:] = "relayrl-w-1-ab", [0, 64]
    err = await error_of(svc.stub.UpdateWeights(bad))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "2 entries for 1 buckets" in err.details()


async def test_a_dead_engine_stops_the_server_and_says_why():
    """vLLM's EngineCore can die for good (a kernel error, an out-of-memory): the process must
    not live on answering errors, with a liveness probe that says SERVING. It stops serving,
    shuts the engine down and returns the reason, which ``relayrl serve generator`` turns into
    exit status 1, for its supervisor to restart it."""
    from relayrl.common.grpc_server import serve_forever

    engine = FakeEngine()
    handle = build(engine, GeneratorConfig())
    await start(handle, ready=True)
    died = asyncio.get_running_loop().create_future()
    served = asyncio.ensure_future(serve_forever(handle, 0.5, died))
    await asyncio.sleep(0.2)
    assert not served.done() and not engine.shutdowns  # serves while the engine lives
    died.set_result("generator fake-0: the vLLM engine died")
    assert await asyncio.wait_for(served, 10) == "generator fake-0: the vLLM engine died"  # exit 1
    assert engine.shutdowns == 1


async def test_a_failing_engine_monitor_is_a_reason_to_exit_too():
    from relayrl.common.grpc_server import serve_forever

    handle = build(FakeEngine(), GeneratorConfig())
    await start(handle, ready=True)
    died = asyncio.get_running_loop().create_future()
    served = asyncio.ensure_future(serve_forever(handle, 0.1, died))
    await asyncio.sleep(0.05)
    died.set_exception(RuntimeError("poll broke"))
    assert await asyncio.wait_for(served, 10) == "the engine monitor failed: RuntimeError('poll broke')"


def test_serve_cli_turns_a_dead_engine_into_exit_status_1(monkeypatch, tmp_path):
    """What ``relayrl serve generator`` does with the reason ``run`` returns."""
    import relayrl.generator.server as gen_server
    from relayrl import serve_cli
    from relayrl.cli import main

    async def died(config, port_file=None):
        return "generator x: the vLLM engine died"

    monkeypatch.setattr(gen_server, "run", died)
    monkeypatch.setattr(serve_cli, "eager_without_compiler", lambda: None)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(SystemExit) as e:
        main(["serve", "generator", "--model", str(tmp_path)])
    assert "engine died" in str(e.value.code)  # a message, not a number: Python exits with status 1
