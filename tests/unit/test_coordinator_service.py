"""CoordinatorService over a real grpc.aio server: what StartExperiment checks before it answers
OK, and that no request (nor an experiment that fails) ends the coordinator.

Experiments here point at deployed service addresses where nothing listens, so an accepted
experiment starts, fails at its first call (UNAVAILABLE) and ends FAILED within a second: the
coordinator's own behaviour is what is under test, not the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from relayrl.common.data.dataset import write_rows
from relayrl.common.data.tasks import generate
from relayrl.common.grpc_server import start
from relayrl.coordinator.config import CoordinatorServeConfig
from relayrl.coordinator.registry import Registry
from relayrl.coordinator.server import build
from relayrl.coordinator.v1 import coordinator_pb2 as cp
from relayrl.coordinator.v1 import coordinator_pb2_grpc as cpg

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
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{handle.port}")
    try:
        yield SimpleNamespace(
            stub=cpg.CoordinatorServiceStub(channel),
            health=health_pb2_grpc.HealthStub(channel),
            registry=registry,
            root=root,
        )
    finally:
        for h in registry.experiments.values():
            if h.task is not None:
                await asyncio.wait_for(h.task, 30)
        await channel.close()
        await handle.stop(0)


async def refused(call, code=grpc.StatusCode.INVALID_ARGUMENT) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call
    assert e.value.code() == code, e.value.details()
    assert len(e.value.details()) < 1100
    return e.value.details()


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
