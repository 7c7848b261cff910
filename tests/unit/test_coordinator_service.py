"""CoordinatorService over a real grpc.aio server: what StartExperiment checks before it answers
OK, and that no request (nor an experiment that fails) ends the coordinator.

Experiments here point at deployed service addresses where nothing listens, so an accepted
experiment starts, fails at its first call (UNAVAILABLE) and ends FAILED within a second: the
coordinator's own behaviour is what is under test, not the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2
from relayrl.common.data.dataset import write_rows
from relayrl.common.data.tasks import generate
from relayrl.common.grpc_server import start
from relayrl.coordinator.config import CoordinatorServeConfig
from relayrl.coordinator.service.registry import Registry
from relayrl.coordinator.service.server import build
from relayrl.coordinator.v1 import coordinator_pb2 as cp
from relayrl.coordinator.v1 import coordinator_pb2_grpc as cpg

from tests.kit.serving import client
from tests.kit.waits import error_of

NOWHERE = "127.0.0.1:1"  # nothing listens: calls fail at once with UNAVAILABLE


def experiment(**changes) -> dict:
    cfg = {
        "name": "probe",
        "runs_dir": "runs",
        "model": {"path": "model"},
        "data": {"train": "data/train.jsonl"},
        "schedule": {"steps": 2, "prompts_per_step": 2, "eval_every": 0, "checkpoint_every": 0},
        "services": {
            "generators": [NOWHERE],
            "rewards": [NOWHERE],
            "learner": NOWHERE,
            "deadline_seconds": 5,
            "replica_wait_seconds": 0,  # nothing will come back at NOWHERE: fail at once
        },
    }
    for key, value in changes.items():
        node = cfg
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return cfg


def start_request(cfg: dict | None = None, **fields) -> cp.StartExperimentRequest:
    return cp.StartExperimentRequest(config_yaml=yaml.safe_dump(cfg or experiment()), **fields)


@contextlib.asynccontextmanager
async def coordinator(root: Path, **config):
    (root / "data").mkdir(parents=True, exist_ok=True)
    write_rows(generate("reverse", 8, seed=0), root / "data" / "train.jsonl")
    cfg = CoordinatorServeConfig(root=str(root), **config)
    registry = Registry(max_running=cfg.max_running)
    handle = build(registry, cfg)
    await start(handle, ready=True)
    try:
        async with client(handle, cpg.CoordinatorServiceStub, registry=registry, root=root) as c:
            try:
                yield c
            finally:
                tasks = [h.task for h in registry.experiments.values() if h.task is not None]
                if tasks:  # a run stopped before its first step ends as a cancelled task
                    await asyncio.wait(tasks, timeout=30)
    finally:
        await handle.stop(0)


async def refused(call, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
    err = await error_of(call)
    assert err.code() == code, err.details()
    assert len(err.details()) < 1100
    return err.details()


async def still_serving(c) -> None:
    ok = await c.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert ok.status == health_pb2.HealthCheckResponse.SERVING
    await c.stub.ListExperiments(cp.ListExperimentsRequest(), timeout=5)


async def finished(c, run_id: str) -> cp.ExperimentStatus:
    for _ in range(300):
        st = (
            await c.stub.GetExperimentStatus(cp.GetExperimentStatusRequest(run_id=run_id), timeout=5)
        ).experiment
        if st.state in (
            cp.EXPERIMENT_STATE_COMPLETED,
            cp.EXPERIMENT_STATE_FAILED,
            cp.EXPERIMENT_STATE_STOPPED,
        ):
            return st
        await asyncio.sleep(0.05)
    raise AssertionError(f"{run_id} never finished")


async def test_an_experiment_whose_inputs_are_missing_is_refused_before_ok(tmp_path):
    async with coordinator(tmp_path) as c:
        cfg = experiment(**{"data.train": "data/missing.jsonl"})
        assert "data file" in await refused(c.stub.StartExperiment(start_request(cfg), timeout=10))
        cfg = experiment(**{"services": {}, "model.path": "no-model"})  # embedded: the model must exist
        assert "no-model has no config.json" in await refused(
            c.stub.StartExperiment(start_request(cfg), timeout=10)
        )
        assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
        await still_serving(c)


async def test_a_failing_experiment_fails_alone_and_the_coordinator_goes_on(tmp_path):
    async with coordinator(tmp_path) as c:
        st = (await c.stub.StartExperiment(start_request(), timeout=10)).experiment
        done = await finished(c, st.run_id)
        assert done.state == cp.EXPERIMENT_STATE_FAILED and "UNAVAILABLE" in done.message
        await still_serving(c)
        again = (await c.stub.StartExperiment(start_request(), timeout=10)).experiment  # and takes more
        assert again.run_id != st.run_id


async def test_run_id_names_the_run_and_makes_start_idempotent(tmp_path):
    async with coordinator(tmp_path) as c:
        first = (await c.stub.StartExperiment(start_request(run_id="mine-1"), timeout=10)).experiment
        assert first.run_id == "mine-1" and Path(first.run_dir) == tmp_path / "runs" / "mine-1"
        second = (await c.stub.StartExperiment(start_request(run_id="mine-1"), timeout=10)).experiment
        assert second.run_id == "mine-1"
        listed = (await c.stub.ListExperiments(cp.ListExperimentsRequest(), timeout=5)).experiments
        assert [e.run_id for e in listed] == ["mine-1"]
        await finished(c, "mine-1")
        (tmp_path / "runs" / "on-disk").mkdir()  # a folder this coordinator did not start
        details = await refused(
            c.stub.StartExperiment(start_request(run_id="on-disk"), timeout=10),
            grpc.StatusCode.ALREADY_EXISTS,
        )
        assert "resume_from" in details
        for bad in ["../x", "a/b", "-x", "x" * 200]:
            assert "run_id" in await refused(c.stub.StartExperiment(start_request(run_id=bad), timeout=10))


async def test_many_starts_of_one_name_at_once_get_a_folder_each(tmp_path):
    async with coordinator(tmp_path, max_running=64) as c:
        calls = [c.stub.StartExperiment(start_request(), timeout=30) for _ in range(40)]
        ids = [r.experiment.run_id for r in await asyncio.gather(*calls)]
        assert len(set(ids)) == 40
        assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == sorted(ids)


@contextlib.asynccontextmanager
async def held_learner():
    """A LearnerService whose RegisterGenerator waits until the test sets the event it yields:
    an experiment using it stays running exactly as long as the test wants."""
    from relayrl.common.grpc_server import create_server
    from relayrl.common.rpc import map_errors
    from relayrl.learner.v1 import learner_pb2, learner_pb2_grpc

    release = asyncio.Event()

    class Held(learner_pb2_grpc.LearnerServiceServicer):
        @map_errors
        async def RegisterGenerator(self, request, context):
            await release.wait()
            return learner_pb2.RegisterGeneratorResponse()

    handle = create_server(Held(), learner_pb2.DESCRIPTOR.services_by_name["LearnerService"])
    await start(handle, ready=True)
    try:
        yield f"127.0.0.1:{handle.port}", release
    finally:
        release.set()
        await handle.stop(0)


async def test_running_experiments_are_capped(tmp_path):
    async with coordinator(tmp_path, max_running=1) as c, held_learner() as (learner, release):
        held = start_request(experiment(**{"services.learner": learner}))
        first = (await c.stub.StartExperiment(held, timeout=10)).experiment
        details = await refused(
            c.stub.StartExperiment(start_request(), timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert "max_running" in details
        release.set()
        await finished(c, first.run_id)
        await c.stub.StartExperiment(start_request(), timeout=10)  # room again


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"runs_dir": "/tmp/elsewhere"}, "runs_dir"),
        ({"runs_dir": "../../up"}, "runs_dir"),
        ({"data.train": "/etc/hostname"}, "data.train"),
        ({"model.path": "../model"}, "model.path"),
    ],
)
async def test_paths_must_lie_in_the_coordinators_root(tmp_path, change, field):
    async with coordinator(tmp_path / "root") as c:
        details = await refused(c.stub.StartExperiment(start_request(experiment(**change)), timeout=10))
        assert f"{field} " in details and "outside the coordinator's root" in details
        assert not (tmp_path / "up").exists()


async def test_resume_from_must_lie_in_the_root_and_hold_a_checkpoint(tmp_path):
    async with coordinator(tmp_path / "root") as c:
        details = await refused(c.stub.StartExperiment(start_request(resume_from=str(tmp_path)), timeout=10))
        assert "resume_from" in details and "outside" in details
        (tmp_path / "root" / "runs" / "old").mkdir(parents=True)
        details = await refused(c.stub.StartExperiment(start_request(resume_from="runs/old"), timeout=10))
        assert "no checkpoint to resume from" in details


async def test_config_text_is_bounded(tmp_path):
    async with coordinator(tmp_path, max_config_kib=64) as c:
        big = cp.StartExperimentRequest(config_yaml="# " + "x" * (65 << 10))
        assert "max_config_kib" in await refused(c.stub.StartExperiment(big, timeout=10))
        bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{n}: &{n} [{', '.join([f'*{p}'] * 10)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
        )
        assert "aliases" in await refused(
            c.stub.StartExperiment(cp.StartExperimentRequest(config_yaml=bomb), timeout=10)
        )
        bad = cp.StartExperimentRequest(config_yaml="name: [unclosed")
        assert "not valid YAML" in await refused(c.stub.StartExperiment(bad, timeout=10))
        many = start_request(overrides=["seed=1"] * 300)
        assert "overrides" in await refused(c.stub.StartExperiment(many, timeout=10))
        await still_serving(c)


async def test_unknown_run_ids_are_not_found_with_a_bounded_message(tmp_path):
    async with coordinator(tmp_path) as c:
        details = await refused(
            c.stub.GetExperimentStatus(cp.GetExperimentStatusRequest(run_id="r" * 100_000), timeout=5),
            grpc.StatusCode.NOT_FOUND,
        )
        assert "more characters" in details


# -- what the coordinator reads and where it sends it (issue #27) ----------------------------------
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"services.security.token_file": "../secret"}, "services.security.token_file"),
        ({"services.security.ca": "/etc/hostname"}, "services.security.ca"),
        ({"learner.security.token_file": "../secret"}, "learner.security.token_file"),
        ({"generator.serve.token_file": "../secret"}, "generator.serve.token_file"),
        ({"learner.model": "/etc"}, "learner.model"),
        ({"learner.checkpoint_dir": "../../elsewhere"}, "learner.checkpoint_dir"),
        ({"generator.engine.model": "../model"}, "generator.engine.model"),
        # an agent's folder and requirements: read by the env replicas the embedded default starts
        ({"env.agents": [{"name": "a", "task": "calc", "folder": "../agent"}]}, "env.agents.0.folder"),
        (
            {"env.verifiers": [{"name": "v", "taskset": "t", "requirements": "../secret"}]},
            "env.verifiers.0.requirements",
        ),
    ],
)
async def test_secrets_models_and_checkpoints_must_lie_in_the_root(tmp_path, change, field):
    # The token is sent as "authorization: Bearer" to addresses the experiment names: a file
    # outside the root would hand this host's secrets to whoever calls StartExperiment. The
    # services of the embedded default read their sections' files on this host too.
    (tmp_path / "secret").write_text("s3cret\n")
    (tmp_path / "agent").mkdir()
    (tmp_path / "agent" / "agent.py").write_text("")
    embedded = {} if field.startswith("services.") else {"services": {}}
    async with coordinator(tmp_path / "root") as c:
        cfg = experiment(**embedded, **change)
        details = await refused(c.stub.StartExperiment(start_request(cfg), timeout=10))
        assert f"{field} " in details and "outside the coordinator's root" in details
        assert not (tmp_path / "root" / "runs").exists()


async def test_secret_files_must_be_small_regular_files_and_a_token_one_word(tmp_path):
    async with coordinator(tmp_path) as c:
        (tmp_path / "dir").mkdir()
        (tmp_path / "zero").symlink_to("/dev/zero")  # followed out of the root: refused as outside
        (tmp_path / "big").write_text("x" * (65 << 10))
        (tmp_path / "two").write_text("two words")
        for path, needle in [
            ("dir", "not a regular file"),
            ("zero", "outside the coordinator's root"),
            ("big", "larger than 65536 bytes"),
            ("two", "one word"),
            ("absent", "cannot read"),
        ]:
            cfg = experiment(**{"services.security.token_file": path})
            details = await refused(c.stub.StartExperiment(start_request(cfg), timeout=10))
            assert "services.security.token_file" in details and needle in details, details
        await still_serving(c)


@pytest.mark.parametrize(
    ("request_fields", "needle"),
    [
        ({"config_yaml": "a: " + "[" * 100_000 + "]" * 100_000}, "nested deeper than 64 levels"),
        ({"overrides": ["seed=" + "[" * 2000 + "]" * 2000]}, "nested deeper than 64 levels"),
        ({"resume_from": "r" * (1 << 20)}, "resume_from: not a usable path"),
        ({"resume_from": "runs/a\0b"}, "resume_from: not a usable path"),
    ],
)
async def test_absurd_requests_are_invalid_argument_not_internal(tmp_path, request_fields, needle):
    async with coordinator(tmp_path) as c:
        fields = {"config_yaml": yaml.safe_dump(experiment()), **request_fields}
        details = await refused(c.stub.StartExperiment(cp.StartExperimentRequest(**fields), timeout=30))
        assert needle in details
        await still_serving(c)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (  # the reference section is validated as a learner of its own: the field is named
            {"algorithm": {"advantage": "reinforce_pp", "kl_coef": 0.1}, "reference": {"loss": {"kl_coef": 0.5}},
             "services.reference": NOWHERE},
            "reference: Value error, loss.kl_coef",
        ),
        ({"data.train": "data/a\0b.jsonl"}, "a path cannot be resolved"),
        ({"data.generate": {"task": "reverse", "n_train": 10**9}}, "data.generate.n_train"),
        ({"data.generate": {"task": "reverse", "params": {"max_len": 10**9}}}, "max_len <= 4096"),
    ],
)  # fmt: skip
async def test_config_errors_found_while_resolving_are_invalid_argument(tmp_path, change, needle):
    async with coordinator(tmp_path) as c:
        details = await refused(c.stub.StartExperiment(start_request(experiment(**change)), timeout=10))
        assert needle in details


async def test_concurrent_starts_of_one_run_id_get_one_experiment(tmp_path, monkeypatch):
    # Every start passes the "known run_id?" check before any is registered: each waits in the
    # config check until all have arrived there. They must all get the one experiment, counted
    # once against max_running.
    from relayrl.coordinator.service import servicer

    starts = 5  # within the default thread pool of a 2-core machine (6 workers)
    barrier = threading.Barrier(starts, timeout=20)

    def admit_together(*args):
        barrier.wait()
        return admit(*args)

    admit = servicer.admit
    monkeypatch.setattr(servicer, "admit", admit_together)
    async with coordinator(tmp_path, max_running=1) as c:
        calls = [c.stub.StartExperiment(start_request(run_id="once"), timeout=30) for _ in range(starts)]
        answers = await asyncio.gather(*calls)
        assert {a.experiment.run_id for a in answers} == {"once"}
        assert list(c.registry.experiments) == ["once"]
        assert [p.name for p in (tmp_path / "runs").iterdir()] == ["once"]


async def test_list_is_newest_first(tmp_path):
    async with coordinator(tmp_path, max_running=3) as c:
        for run_id in ("first", "second", "third"):
            await c.stub.StartExperiment(start_request(run_id=run_id), timeout=10)
        listed = (await c.stub.ListExperiments(cp.ListExperimentsRequest(), timeout=5)).experiments
        assert [e.run_id for e in listed] == ["third", "second", "first"]


def slow_preparation() -> dict:
    """An experiment whose data preparation runs ~10^7 draws (a test split of a 10-problem space
    asked for 50,000 rows) before it would fail: it stays PENDING until stopped."""
    spec = {"task": "reverse", "n_test": 50_000, "params": {"min_len": 1, "max_len": 1}}
    return experiment(**{"data.test": "data/test.jsonl", "data.generate": spec})


async def test_a_stop_while_pending_ends_stopped_without_running(tmp_path):
    async with coordinator(tmp_path) as c:
        st = (await c.stub.StartExperiment(start_request(slow_preparation()), timeout=10)).experiment
        assert st.state == cp.EXPERIMENT_STATE_PENDING
        assert not st.HasField("started_at")  # set when it goes RUNNING, not before
        stopping = (
            await c.stub.StopExperiment(cp.StopExperimentRequest(run_id=st.run_id), timeout=5)
        ).experiment
        assert stopping.state == cp.EXPERIMENT_STATE_STOPPING
        done = await finished(c, st.run_id)  # data generation noticed the stop
        assert done.state == cp.EXPERIMENT_STATE_STOPPED, done.message
        assert not done.HasField("started_at") and "before its first step" in done.message
        assert not (tmp_path / "data" / "test.jsonl").exists()
        await still_serving(c)


async def test_started_at_is_set_when_running(tmp_path):
    async with coordinator(tmp_path) as c, held_learner() as (learner, release):
        held = start_request(experiment(**{"services.learner": learner}))
        st = (await c.stub.StartExperiment(held, timeout=10)).experiment
        for _ in range(300):
            st = (
                await c.stub.GetExperimentStatus(cp.GetExperimentStatusRequest(run_id=st.run_id), timeout=5)
            ).experiment
            if st.state != cp.EXPERIMENT_STATE_PENDING:
                break
            await asyncio.sleep(0.05)
        assert st.state == cp.EXPERIMENT_STATE_RUNNING and st.HasField("started_at")
        release.set()


# -- accepted means usable (issue #27) --------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("train.jsonl", b"not json\n", "line 1 (1-based): not valid JSON"),
        ("train.jsonl", b'{"prompt": []}\n', "column 'data_source': missing"),
        ("train.parquet", b"PAR1 garbage, not parquet", "not a readable parquet file"),
        ("train.jsonl", b"\xff\xfe\n", "not UTF-8"),
        ("train.jsonl", None, "not a regular file"),  # a FIFO: must not hold the check
    ],
)
async def test_data_files_that_do_not_parse_are_refused_before_ok(tmp_path, name, content, needle):
    async with coordinator(tmp_path) as c:
        bad = tmp_path / "data" / f"bad-{name}"
        if content is None:
            os.mkfifo(bad)
        else:
            bad.write_bytes(content)
        cfg = experiment(**{"data.train": f"data/{bad.name}"})
        details = await refused(c.stub.StartExperiment(start_request(cfg), timeout=10))
        assert "data.train" in details and needle in details, details
        assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("record", "needle"),
    [
        ("garbage", "is not JSON"),
        ('{"step": 3}', "does not name a checkpoint"),
        ('{"tag": "../../x", "step": 3}', "does not name a checkpoint"),
        ('{"tag": "step3", "step": -1}', "does not name a checkpoint"),
        ("[" * 100_000, "is not JSON"),
        (None, "not a regular file"),  # a FIFO
    ],
)
async def test_a_resume_folder_must_hold_a_checkpoint_record(tmp_path, record, needle):
    async with coordinator(tmp_path) as c:
        folder = tmp_path / "runs" / "old"
        (folder / "checkpoints").mkdir(parents=True)
        path = folder / "checkpoints" / "coordinator.json"
        if record is None:
            os.mkfifo(path)
        else:
            path.write_text(record)
        details = await refused(c.stub.StartExperiment(start_request(resume_from="runs/old"), timeout=10))
        assert "resume_from" in details and needle in details, details
        path.unlink()
        path.write_text('{"tag": "step3", "step": 3, "epoch": 0, "index": 6}\n')  # as the loop writes it
        st = (await c.stub.StartExperiment(start_request(resume_from="runs/old"), timeout=10)).experiment
        assert st.run_id == "old"
        await finished(c, "old")


async def test_a_run_stopped_before_its_task_ran_never_starts_its_services(tmp_path):
    from relayrl.common import config as cfg_mod
    from relayrl.coordinator.config import ExperimentConfig
    from relayrl.coordinator.derive import resolve_paths
    from relayrl.coordinator.service import registry as reg

    class Services:  # a ServiceSet that only counts its starts
        started = 0
        resume_command = "relayrl run --resume"

        def __init__(self, cfg, run_dir):
            pass

        def start(self):
            Services.started += 1

        def stop(self):
            pass

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    write_rows(generate("reverse", 8, seed=0), tmp_path / "train.jsonl")
    raw = {"model": {"path": "model"}, "data": {"train": "train.jsonl"}, "schedule": {"steps": 2}}
    cfg = resolve_paths(cfg_mod.build(ExperimentConfig, raw), tmp_path)
    registry = Registry(services_factory=Services)
    h = registry.start(cfg)
    registry.request_stop(h.run_id)  # nothing awaited since the start: the run's task has not run yet
    assert h.state == reg.STOPPING
    await asyncio.wait([h.task], timeout=30)
    assert (h.state, Services.started, h.started_at) == (reg.STOPPED, 0, None)


async def _state_soon(c, run_id: str, state, timeout: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        req = cp.GetExperimentStatusRequest(run_id=run_id)
        st = (await c.stub.GetExperimentStatus(req, timeout=5)).experiment
        if st.state == state:
            return
        assert asyncio.get_running_loop().time() < deadline, cp.ExperimentState.Name(st.state)
        await asyncio.sleep(0.05)


async def test_a_stop_ends_a_run_held_by_a_hung_service_within_its_grace_and_a_second_stop_at_once(tmp_path):
    """A service that never answers (here the learner, in the run's first call) must not turn a
    stop into a wait for its deadline and a FAILED run: the first stop gives the run its grace
    to reach a step boundary, then cancels it; a second stop cancels at once. Both end STOPPED."""
    async with coordinator(tmp_path) as c, held_learner() as (learner, _release):
        over = {"services.learner": learner, "services.deadline_seconds": 600}
        graced = start_request(experiment(**over, **{"services.stop_grace_seconds": 0.5}))
        run_id = (await c.stub.StartExperiment(graced, timeout=10)).experiment.run_id
        await _state_soon(c, run_id, cp.EXPERIMENT_STATE_RUNNING)
        await c.stub.StopExperiment(cp.StopExperimentRequest(run_id=run_id), timeout=5)
        st = await finished(c, run_id)
        assert st.state == cp.EXPERIMENT_STATE_STOPPED and "checkpoint" in st.message, st

        patient = start_request(experiment(**over, **{"services.stop_grace_seconds": 600}))
        run_id = (await c.stub.StartExperiment(patient, timeout=10)).experiment.run_id
        await _state_soon(c, run_id, cp.EXPERIMENT_STATE_RUNNING)
        await c.stub.StopExperiment(cp.StopExperimentRequest(run_id=run_id), timeout=5)
        await asyncio.sleep(0.3)
        await _state_soon(c, run_id, cp.EXPERIMENT_STATE_STOPPING, timeout=1)  # in its grace
        await c.stub.StopExperiment(cp.StopExperimentRequest(run_id=run_id), timeout=5)
        assert (await finished(c, run_id)).state == cp.EXPERIMENT_STATE_STOPPED
