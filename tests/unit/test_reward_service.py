"""RewardService over a real grpc.aio server on port 0 and a real pool of 2 scoring processes.

What is checked: per-sample statuses (ok, error, timeout) side by side in one batch with plugins
that raise, hang, return garbage or kill their process; that the rest of the batch is scored and
the service keeps answering after a timeout (the worker is replaced); that a hung sample does
not hold up other calls; INVALID_ARGUMENT for bad requests; ListScorers; health; metrics; plugin
loading errors; and a real ``relayrl serve reward`` process that exits 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY
from relayrl.common.grpc_server import start
from relayrl.reward.config import RewardConfig
from relayrl.reward.pool import ScoringPool
from relayrl.reward.server import SERVICE, build
from relayrl.reward.v1 import reward_pb2 as r
from relayrl.reward.v1 import reward_pb2_grpc
from relayrl.reward.worker import PluginError

from tests.kit.serving import client
from tests.kit.waits import error_of, until, until_blocking
from tests.procs import service

PLUGINS = [f"tests.kit.reward_plugins:{f}" for f in ("length", "raises", "hangs", "garbage", "dies")]
SERVING = health_pb2.HealthCheckResponse.SERVING
COUNTDOWN_GT = json.dumps({"target": 24, "numbers": [3, 4, 6, 8]})


@contextlib.asynccontextmanager
async def serving(workers: int = 2, plugins=PLUGINS, **config):
    pool = ScoringPool(workers, plugins)
    handle = build(pool, RewardConfig(workers=workers, plugins=plugins, **config))
    await start(handle, ready=False)
    await pool.start()
    await handle.set_ready(True)
    try:
        async with client(handle, reward_pb2_grpc.RewardServiceStub, pool=pool) as s:
            yield s
    finally:
        await handle.stop(0)


# One server and pool for the module (starting 2 fresh interpreters costs ~1 s on a busy machine),
# so the async tests share the module's event loop.
in_module_loop = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def svc():
    async with serving() as s:
        yield s


def item(
    sample_id: str, data_source: str, completion: str = "x", ground_truth: str = "", **kw
) -> r.RewardInput:
    return r.RewardInput(sample_id=sample_id, data_source=data_source, completion=completion,
                         ground_truth=ground_truth, **kw)  # fmt: skip


def countdown(sample_id: str, answer: str = "(8 - 6) * 3 * 4") -> r.RewardInput:
    return item(sample_id, "countdown", f"<think>..</think>\n<answer>{answer}</answer>", COUNTDOWN_GT)


def counted(source: str, status: str) -> float:
    return (
        REGISTRY.get_sample_value("relayrl_reward_samples_total", {"data_source": source, "status": status})
        or 0.0
    )


@in_module_loop
async def test_one_batch_holds_ok_error_and_timeout_and_the_rest_is_scored(svc):
    before = {k: counted(*k) for k in [("countdown", "ok"), ("test/hang", "timeout"), ("unknown", "error")]}
    restarts = svc.pool.restarts
    items = [
        countdown("right"),
        item("raise", "test/raise"),
        countdown("wrong", "3 + 4 + 6 + 8"),
        item("hang", "test/hang"),
        item("garbage", "test/garbage"),
        item("nan", "test/garbage", "nan"),
        item("unknown", "no/such-source"),
        item("math", "math", r"so \boxed{0.5}", r"\frac{1}{2}"),
        item("plugin-ok", "test/length", "abcd", prompt="a prompt"),
        item("bad-gt", "countdown", "<answer>1</answer>", "not json"),
    ]
    t0 = time.monotonic()
    resp = await svc.stub.Score(r.ScoreRequest(request_id="t1", items=items, timeout_seconds=1.0))
    assert time.monotonic() - t0 < 5
    res = {x.sample_id: x for x in resp.results}
    assert [x.sample_id for x in resp.results] == [i.sample_id for i in items]  # request order
    ok, error, timeout = r.SCORE_STATUS_OK, r.SCORE_STATUS_ERROR, r.SCORE_STATUS_TIMEOUT
    assert {k: v.status for k, v in res.items()} == {
        "right": ok, "raise": error, "wrong": ok, "hang": timeout, "garbage": error, "nan": error,
        "unknown": error, "math": ok, "plugin-ok": ok, "bad-gt": error}  # fmt: skip
    assert res["right"].reward == 1.0 and dict(res["right"].components) == {"format": 1.0, "correctness": 1.0}
    assert res["wrong"].reward == pytest.approx(0.1) and res["wrong"].components["correctness"] == 0.0
    assert res["math"].reward == 1.0
    assert res["plugin-ok"].reward == 4.0 and dict(res["plugin-ok"].components) == {"has_prompt": 1.0}
    assert "RuntimeError: plugin exploded" in res["raise"].error
    assert "must return a number" in res["garbage"].error and "finite" in res["nan"].error
    assert (
        "unknown data_source 'no/such-source'" in res["unknown"].error and "countdown" in res["unknown"].error
    )
    assert "countdown ground_truth" in res["bad-gt"].error
    assert "1s" in res["hang"].error
    for x in resp.results:  # not OK: reward 0, no components, a message
        if x.status != ok:
            assert x.reward == 0.0 and not x.components and x.error
        else:
            assert not x.error
    assert svc.pool.restarts == restarts + 1  # the hung worker was killed and replaced
    assert counted("countdown", "ok") == before["countdown", "ok"] + 2
    assert counted("test/hang", "timeout") == before["test/hang", "timeout"] + 1
    assert counted("unknown", "error") == before["unknown", "error"] + 1
    # Still serving, on both workers: a batch wider than the pool is scored in full.
    again = await svc.stub.Score(r.ScoreRequest(items=[countdown(str(i)) for i in range(20)]))
    assert [x.reward for x in again.results] == [1.0] * 20


@in_module_loop
async def test_a_dying_worker_is_an_error_and_is_replaced(svc):
    resp = await svc.stub.Score(r.ScoreRequest(items=[item("die", "test/die"), countdown("c")]))
    assert resp.results[0].status == r.SCORE_STATUS_ERROR and "died (exit code 3)" in resp.results[0].error
    assert resp.results[1].reward == 1.0
    assert (await svc.stub.Score(r.ScoreRequest(items=[countdown("c")]))).results[0].reward == 1.0


@in_module_loop
async def test_a_hung_sample_does_not_hold_up_other_calls(svc):
    await until(lambda: svc.pool.live_workers == 2, timeout=10)  # earlier tests had workers replaced
    hung = asyncio.ensure_future(
        svc.stub.Score(r.ScoreRequest(items=[item("hang", "test/hang")], timeout_seconds=3.0))
    )
    await asyncio.sleep(0.2)  # the hang holds one worker now
    t0 = time.monotonic()
    fast = await svc.stub.Score(r.ScoreRequest(items=[countdown(str(i)) for i in range(50)]))
    assert time.monotonic() - t0 < 2.0 and not hung.done()
    assert all(x.status == r.SCORE_STATUS_OK for x in fast.results)
    assert (await hung).results[0].status == r.SCORE_STATUS_TIMEOUT


@pytest.mark.parametrize(
    ("request_", "problem"),
    [
        (r.ScoreRequest(), "items is empty"),
        (r.ScoreRequest(items=[countdown("a"), item("b", "")]), "items[1] ('b'): data_source is empty"),
        (r.ScoreRequest(items=[item("c", "test/length", extra_info_json="{oops")]), "not valid JSON"),
        (r.ScoreRequest(items=[item("d", "test/length", extra_info_json="[1]")]), "must be a JSON object"),
        (r.ScoreRequest(items=[countdown("e")], timeout_seconds=-1), "timeout_seconds must be in"),
        (r.ScoreRequest(items=[countdown("f")], timeout_seconds=float("nan")), "timeout_seconds must be in"),
        (r.ScoreRequest(items=[countdown("g")], timeout_seconds=601), "timeout_seconds must be in"),
        (
            r.ScoreRequest(items=[item("h", "countdown", completion="x" * (1 << 20 | 1))]),
            "completion is longer than",
        ),
        (
            r.ScoreRequest(items=[item("i", "countdown", extra_info_json="{}" + " " * 70000)]),
            "extra_info_json is longer",
        ),
        (
            r.ScoreRequest(items=[item(f"j{i}", "countdown") for i in range(65537)]),
            "at most 65536 (max_items_per_request)",
        ),
    ],
)
@in_module_loop
async def test_bad_requests_are_invalid_argument(svc, request_, problem):
    err = await error_of(svc.stub.Score(request_))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and problem in err.details()


async def test_queued_samples_are_capped_with_resource_exhausted():
    from prometheus_client import REGISTRY

    async with serving(workers=1, plugins=PLUGINS, max_pending_items=3) as s:
        two_hung = r.ScoreRequest(
            items=[item("h1", "test/hang"), item("h2", "test/hang")], timeout_seconds=3.0
        )
        hung = asyncio.ensure_future(s.stub.Score(two_hung))
        await until(
            lambda: REGISTRY.get_sample_value("relayrl_reward_samples_pending") == 2, timeout=10
        )  # it holds 2 places
        err = await error_of(s.stub.Score(r.ScoreRequest(items=[countdown("a"), countdown("b")])))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pending_items 3" in err.details()
        assert not hung.done()
        assert (await s.stub.Score(r.ScoreRequest(items=[countdown("c")]))).results[
            0
        ].status == r.SCORE_STATUS_OK
        await hung
        ok = await s.stub.Score(r.ScoreRequest(items=[countdown("d"), countdown("e"), countdown("f")]))
        assert [x.status for x in ok.results] == [r.SCORE_STATUS_OK] * 3  # room again


@in_module_loop
async def test_unknown_field_is_invalid_argument(svc):
    raw = r.ScoreRequest(items=[countdown("a")]).SerializeToString() + bytes([0xF8, 0x06, 0x01])  # field 111
    method = svc.channel.unary_unary(
        "/relayrl.reward.v1.RewardService/Score", request_serializer=None,
        response_deserializer=r.ScoreResponse.FromString)  # fmt: skip
    err = await error_of(method(raw))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "unknown field number 111" in err.details()


@in_module_loop
async def test_list_scorers_names_builtins_and_plugins(svc):
    scorers = (await svc.stub.ListScorers(r.ListScorersRequest())).scorers
    names = [s.data_source for s in scorers]
    assert names == sorted(names)
    by = {s.data_source: s for s in scorers}
    for builtin in ("countdown", "arithmetic", "reverse", "gsm8k", "openai/gsm8k", "math", "lighteval/MATH",
                    "DigitalLearningGmbH/MATH-lighteval"):  # fmt: skip
        assert not by[builtin].from_plugin and by[builtin].origin.startswith("relayrl.reward.scorers:score_")
    assert by["test/hang"].from_plugin and by["test/hang"].origin == "tests.kit.reward_plugins:hangs"


@in_module_loop
async def test_health_live_and_ready(svc):
    for name in ("", SERVICE):
        assert (await svc.health.Check(health_pb2.HealthCheckRequest(service=name))).status == SERVING


@pytest.mark.parametrize(
    ("plugin", "problem"),
    [
        ("tests.no_such_module:f", "cannot load: ModuleNotFoundError"),
        ("tests.kit.reward_plugins:missing", "cannot load: AttributeError"),
        ("tests.kit.reward_plugins:undeclared", "needs a data_sources attribute"),
    ],
)
@in_module_loop
async def test_plugins_that_cannot_load_stop_the_pool_from_starting(plugin, problem):
    pool = ScoringPool(1, [plugin])
    with pytest.raises(PluginError, match=problem):
        await pool.start()
    with pytest.raises(PluginError, match="already served by tests.kit.reward_plugins:raises"):
        await ScoringPool(1, ["tests.kit.reward_plugins:raises", "tests.kit.reward_plugins:raises"]).start()


def test_served_process_scores_and_exits_zero_on_sigterm(tmp_path):
    args = ["reward", "--workers", "2", "--plugin", PLUGINS[0], "--plugin", PLUGINS[1]]
    with service(args, tmp_path, timeout=60) as (addr, proc):
        with grpc.insecure_channel(addr) as channel:
            ready = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE))
            assert ready.status == SERVING
            resp = reward_pb2_grpc.RewardServiceStub(channel).Score(
                r.ScoreRequest(
                    items=[countdown("c"), item("p", "test/length", "abc"), item("x", "test/raise")]
                ),
                timeout=30,
            )
        assert [x.status for x in resp.results] == [
            r.SCORE_STATUS_OK,
            r.SCORE_STATUS_OK,
            r.SCORE_STATUS_ERROR,
        ]
        assert [x.reward for x in resp.results] == [1.0, 3.0, 0.0]
        workers = _children(proc.proc.pid)
        assert len(workers) >= 2
        assert proc.stop(grace=30) == 0  # SIGTERM to its process group, as the launcher does
    until_blocking(
        lambda: not any(_exists(pid) for pid in workers), 10, 0.1, "scoring workers outlived the server"
    )


def _children(pid: int) -> list[int]:
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.exists():
        pytest.skip("no /proc")
    return [int(c) for t in tasks.iterdir() for c in (t / "children").read_text().split()]


def _exists(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0] != "Z"
    except OSError:
        return False


# -- liveness: a replica that cannot start scoring workers says so, and exits if it stays so ------


def fail_spawns(pool: ScoringPool) -> None:
    """From now on no scoring worker of ``pool`` can start (as when fork fails: out of memory)."""

    async def cannot() -> None:
        raise OSError("fork: Cannot allocate memory (test)")

    pool._spawn = cannot
    pool.respawn_delays = (0.01, 0.05)


async def readiness(s) -> int:
    return (await s.health.Check(health_pb2.HealthCheckRequest(service=SERVICE))).status


async def test_a_replica_that_cannot_start_workers_fails_calls_unavailable_then_serves_again():
    async with serving(workers=1) as s:
        spawn = s.pool._spawn
        fail_spawns(s.pool)
        # The sample kills its worker (its own ERROR); the one queued behind it found no worker
        # that could start: the call fails UNAVAILABLE with the reason instead of waiting forever.
        err = await error_of(
            s.stub.Score(r.ScoreRequest(items=[item("die", "test/die"), countdown("c")]), timeout=30)
        )
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        assert (
            "failed to start 3 times in a row" in err.details() and "Cannot allocate memory" in err.details()
        )
        await until(lambda: s.pool.unready_reason is not None, timeout=10)
        assert await readiness(s) == health_pb2.HealthCheckResponse.NOT_SERVING
        later = await error_of(s.stub.Score(r.ScoreRequest(items=[countdown("d")]), timeout=30))
        assert later.code() == grpc.StatusCode.UNAVAILABLE and "cannot score" in later.details()
        s.pool._spawn = spawn  # fork works again: the replica comes back by itself
        await until(lambda: s.pool.live_workers == 1, timeout=10)
        await until(lambda: s.pool.unready_reason is None, timeout=10)
        assert await readiness(s) == SERVING
        again = await s.stub.Score(r.ScoreRequest(items=[countdown("e")]), timeout=30)
        assert again.results[0].status == r.SCORE_STATUS_OK and again.results[0].reward == 1.0


async def test_a_replica_that_never_recovers_gives_up():
    async with serving(workers=1, plugins=PLUGINS) as s:
        s.pool.give_up_seconds = 0.0
        fail_spawns(s.pool)
        await s.stub.Score(r.ScoreRequest(items=[item("die", "test/die")]), timeout=30)
        reason = await asyncio.wait_for(s.pool.died(), 30)
        assert "could not be started" in reason and "Cannot allocate memory" in reason


def test_error_results_carry_no_reward():
    from relayrl.reward.pool import ERROR, TIMEOUT, SampleResult
    from relayrl.reward.servicer import result_to_proto

    for status in (ERROR, TIMEOUT):
        out = result_to_proto("s", SampleResult(status, reward=0.7, components={"x": 1.0}, error="boom"))
        assert (out.reward, dict(out.components), out.error) == (0.0, {}, "boom")


def test_served_process_exits_1_when_its_workers_can_no_longer_start(tmp_path):
    marker = tmp_path / "break-the-plugin"
    args = ["reward", "--workers", "1", "--plugin", "tests.kit.reward_fragile:length", "--plugin", PLUGINS[4],
            "--set", "respawn_failures_unready=2", "--set", "respawn_give_up_seconds=1"]  # fmt: skip
    with service(args, tmp_path, timeout=60, env={"RELAYRL_TEST_BREAK": str(marker)}) as (addr, proc):
        marker.touch()  # the plugin no longer imports: a replacement worker cannot start
        with grpc.insecure_channel(addr) as channel:
            stub = reward_pb2_grpc.RewardServiceStub(channel)
            resp = stub.Score(r.ScoreRequest(items=[item("die", "test/die")]), timeout=30)
            assert resp.results[0].status == r.SCORE_STATUS_ERROR
        assert proc.proc.wait(timeout=60) == 1  # given up: exit 1, for the supervisor to restart it
        log = proc.tail()
        assert "could not be started" in log and "broken on purpose" in log, log


@pytest.mark.parametrize(
    "raw",
    [b'["ok", NaN, {}, ""]', b'["ok", "1.0", {}, ""]', b'["ok", 1.0, {"x": Infinity}, ""]', b"[1, 2]", b"{"],
)
def test_a_workers_reply_is_a_score_only_when_well_formed(raw):
    """What comes back over the pipe is checked again in the server: a worker whose scorer wrote to
    the pipe itself, or died mid-reply, cannot make garbage a score."""
    from relayrl.reward.pool import ERROR, OK, SampleResult, _reply

    result, replace = _reply(raw, 0.1)
    assert (result.status, result.reward, replace) == (ERROR, 0.0, "garbage") and "malformed" in result.error
    assert _reply(b'["ok", 2.0, {"format": 1}, ""]', 0.1) == (
        SampleResult(OK, 2.0, {"format": 1.0}, "", 0.1),
        None,
    )


async def test_closing_the_pool_fails_the_sample_being_scored_instead_of_leaving_its_caller_waiting():
    from relayrl.common.rpc import Unavailable
    from relayrl.reward.pool import ScoreItem

    def busy() -> float:
        return REGISTRY.get_sample_value("relayrl_reward_workers_busy") or 0.0

    pool = ScoringPool(1, PLUGINS)
    await pool.start()
    try:
        before = busy()
        call = asyncio.ensure_future(pool.score([ScoreItem("test/hang", "x")], timeout=60.0))
        await until(lambda: busy() > before, timeout=10)  # its worker has it: being scored, no longer queued
        await pool.close()
        # Before, close() cancelled the slot's driver with the sample in hand and nothing ever
        # answered it: the caller waited forever (asyncio.wait_for here timed out).
        with pytest.raises(Unavailable, match="shutting down"):
            await asyncio.wait_for(call, 10)
    finally:
        await pool.close()
