"""``relayrl launch slurm`` without Slurm: where each service goes in an allocation, the ``srun``
words of each step, the per-job access settings, the requeue marker, the per-job secrets removed
when the job ends (kept over a requeue; ``scontrol`` and ``squeue`` are stand-in scripts); and
``serve.term_linger_seconds`` on a real service (what lets the last checkpoint land after ``scancel``)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.launch.slurm import job_secrets
from relayrl.coordinator.launch.slurm.plan import Allocation, gpus, plan
from relayrl.coordinator.launch.slurm.services import SlurmServices, marker, requeued_run, visible_gpus
from relayrl.coordinator.run import launch_slurm as launch

from tests.procs import service


def _cfg(**sections) -> ExperimentConfig:
    return ExperimentConfig.model_validate({"model": {"path": "m"}, "data": {"train": "t"}, **sections})


def test_a_one_node_cpu_job_runs_everything_beside_the_coordinator():
    cfg = _cfg(learner={"world_size": 2}, services={"generator_replicas": 2, "reward_replicas": 1})
    p = plan(cfg, Allocation("5", ("n1",)))
    assert {n: (s.nodes, s.local) for n, s in p.steps.items()} == {
        "learner": (("n1",), True), "gen-0": (("n1",), True), "gen-1": (("n1",), True), "reward-0": (("n1",), True),
    }  # fmt: skip
    assert p.steps["learner"].tasks_per_node == 2 and not p.steps["learner"].gpu_ids


def test_gpu_nodes_split_between_learner_ranks_and_generators():
    cfg = _cfg(
        learner={"world_size": 16},
        services={"generator_replicas": 6, "reward_replicas": 2},
        generator={"engine": {"tensor_parallel_size": 2}},
        episodes={"env": "calc"},
    )
    p = plan(cfg, Allocation("9", ("a", "b", "c", "d"), gpus_per_node=8))
    learner = p.steps["learner"]
    assert learner.nodes == ("a", "b") and learner.tasks_per_node == 8 and not learner.local
    words = learner.srun("relayrl-9")
    assert words[:3] == ["srun", "--job-name=relayrl-9-learner", "--kill-on-bad-exit=1"]
    assert "--gres=gpu:8" in words and "--exact" in words and not any("per-task" in w for w in words)
    assert [p.steps[f"gen-{i}"].nodes[0] for i in range(6)] == ["c", "c", "c", "c", "d", "d"]
    gen = p.steps["gen-0"].srun("j")
    assert "--gres=gpu:2" in gen and "--overlap" not in gen  # GPUs of its own
    assert p.steps["reward-1"].nodes == ("a",) and p.steps["env-0"].local  # no GPU taken
    with pytest.raises(SystemExit, match="need 3 node"):
        plan(_cfg(learner={"world_size": 24}), Allocation("9", ("a", "b"), gpus_per_node=8))
    with pytest.raises(SystemExit, match="generator replica 0: no node has 2 GPUs left"):
        plan(_cfg(learner={"world_size": 8}, services={"generator_replicas": 1}, generator={"engine": {"tensor_parallel_size": 2}}),
             Allocation("9", ("a",), gpus_per_node=8))  # fmt: skip


def test_one_gpu_node_shares_its_gpus_between_local_services():
    cfg = _cfg(learner={"world_size": 4}, services={"generator_replicas": 2})
    p = plan(cfg, Allocation("3", ("a",), gpus_per_node=8))
    assert p.steps["learner"].gpu_ids == (0, 1, 2, 3) and p.steps["gen-1"].gpu_ids == (5,)
    assert visible_gpus(p.steps["gen-1"].gpu_ids, {"CUDA_VISIBLE_DEVICES": "2,3,4,5,6,7,8,9"}) == "7"


def test_the_allocation_is_read_from_slurms_variables():
    env = {
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NODELIST": "n1,n2",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_RESTART_COUNT": "1",
    }
    assert Allocation.from_env(env) == Allocation("42", ("n1", "n2"), 4, 1)
    assert gpus({"SLURM_GPUS_PER_NODE": "a100:2"}) == 2
    with pytest.raises(SystemExit, match="not inside a Slurm allocation"):
        Allocation.from_env({})


def _services(tmp_path, monkeypatch, nodes: str, secrets: str | None = None) -> SlurmServices:
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", nodes)
    if secrets:
        monkeypatch.setenv("RELAYRL_SLURM_SECRETS", secrets)
    else:
        monkeypatch.delenv("RELAYRL_SLURM_SECRETS", raising=False)
    cfg = _cfg(runs_dir=str(tmp_path / "runs"))
    return SlurmServices(cfg, tmp_path / "runs" / "r-1")


def test_services_bind_loopback_on_one_node_and_tls_across_nodes(tmp_path, monkeypatch):
    one = _services(tmp_path, monkeypatch, "n1")
    gen = one._secure(one.cfg.generator)
    assert (gen.serve.host, gen.serve.port, gen.serve.term_linger_seconds) == ("127.0.0.1", 0, 25.0)
    assert marker(tmp_path / "runs", "77").read_text().strip() == str((tmp_path / "runs" / "r-1").resolve())
    many = _services(tmp_path, monkeypatch, "n1,n2")
    with pytest.raises(SystemExit, match="need TLS and a token"):
        many._secure(many.cfg.generator)
    secured = _services(tmp_path, monkeypatch, "n1,n2", secrets="/s")
    learner = secured._secure(secured.cfg.learner, "security")
    assert (learner.serve.host, learner.serve.tls_cert, learner.serve.token_file) == (
        "0.0.0.0",
        "/s/tls.crt",
        "/s/token",
    )
    assert learner.security.ca == "/s/ca.crt"
    assert secured.cfg.services.security.token_file == "/s/token"  # the coordinator's own calls
    own = _cfg(
        runs_dir=str(tmp_path / "runs"),
        generator={"serve": {"tls_cert": "/mine.crt", "tls_key": "/mine.key"}},
    )
    kept = SlurmServices.__new__(SlurmServices)
    kept.__dict__.update(secured.__dict__)
    assert kept._secure(own.generator).serve.tls_cert == "/mine.crt"  # the experiment's own TLS stands


def test_a_requeued_job_finds_its_run_once_it_has_a_checkpoint(tmp_path):
    cfg = _cfg(runs_dir=str(tmp_path))
    alloc = Allocation("8", ("n1",))
    assert requeued_run(cfg, alloc) is None
    run = tmp_path / "r-1"
    marker(tmp_path, "8").write_text(f"{run}\n")
    assert requeued_run(cfg, alloc) is None  # started, no checkpoint yet: a new run
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "coordinator.json").write_text("{}")
    assert requeued_run(cfg, alloc) == run


def _fake_slurm(tmp_path, monkeypatch, scontrol: str = "", squeue: str = "", squeue_rc: int = 0) -> Path:
    """``scontrol`` and ``squeue`` on PATH that print what they are given (squeue's ``squeue_rc``
    exit status with its output on stderr); each appends its arguments to ``calls``."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for name, out, rc in (("scontrol", scontrol, 0), ("squeue", squeue, squeue_rc)):
        (bin_ / f"{name}.out").write_text(out + "\n")
        (bin_ / name).write_text(
            f'#!/bin/sh\necho "{name} $*" >> {tmp_path}/calls\ncat {bin_}/{name}.out >&{2 if rc else 1}\nexit {rc}\n'
        )
        (bin_ / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:{os.environ['PATH']}")
    return tmp_path / "calls"


def _made(submit: Path, *jobs: str) -> dict[str, Path]:
    """Per-job secrets as relayrl.sbatch leaves them."""
    out = {}
    for job in jobs:
        d = submit / ".relayrl-slurm" / job
        d.mkdir(parents=True)
        for f in ("ca.crt", "tls.crt", "tls.key", "token", "nodes"):
            (d / f).write_text("x")
        out[job] = d
    return out


def test_a_jobs_secrets_go_when_it_ends_and_stay_when_it_is_requeued(tmp_path, monkeypatch):
    made = _made(tmp_path, "77")
    _fake_slurm(
        tmp_path, monkeypatch, scontrol="JobId=77 JobState=COMPLETING Requeue=1 Restarts=1 BatchFlag=1"
    )
    # Slurm raised the restart count above the one this run started with: requeued, kept
    assert not job_secrets.forget(tmp_path, "77", restarts=0) and (made["77"] / "token").exists()
    # the requeued run's own end
    assert job_secrets.forget(tmp_path, "77", restarts=1) and not made["77"].exists()
    made = _made(tmp_path, "78")
    _fake_slurm(tmp_path, monkeypatch, scontrol="JobId=78 JobState=COMPLETING Restarts=0")
    assert job_secrets.forget(tmp_path, "78", restarts=0) and not made["78"].exists()  # scancel, or done
    made = _made(tmp_path, "79")
    _fake_slurm(tmp_path, monkeypatch, scontrol="slurm_load_jobs error: Unable to contact slurm controller")
    assert not job_secrets.forget(tmp_path, "79", restarts=0) and made["79"].exists()  # in doubt: kept


def test_launch_removes_the_jobs_secrets_however_its_run_ends(tmp_path, monkeypatch):
    import relayrl.coordinator.run as run_mod

    made = _made(tmp_path, "77")
    _fake_slurm(tmp_path, monkeypatch, scontrol="JobId=77 JobState=RUNNING Restarts=0", squeue="")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1,n2")
    monkeypatch.setenv("SLURM_SUBMIT_DIR", str(tmp_path))
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)

    def broken(*args, **kwargs):
        assert (made["77"] / "token").exists()  # there while the run runs
        raise KeyboardInterrupt

    monkeypatch.setattr(run_mod, "run", broken)
    with pytest.raises(KeyboardInterrupt):
        launch(_cfg(runs_dir=str(tmp_path / "runs")))
    assert not made["77"].exists()


def test_a_start_sweeps_the_secrets_of_jobs_that_ended(tmp_path, monkeypatch):
    made = _made(tmp_path, "100", "101", "102", "103", "104", "77")
    (tmp_path / ".relayrl-slurm" / "notes").mkdir()
    theirs = tmp_path / "mine"  # a RELAYRL_SLURM_SECRETS of the user's own: never touched
    theirs.mkdir()
    calls = _fake_slurm(
        tmp_path, monkeypatch, squeue="100 COMPLETED\n101 PENDING\n103 COMPLETING\n104 NODE_FAIL"
    )
    assert job_secrets.sweep(tmp_path, "77") == ["100", "102"]  # 102: Slurm no longer knows it
    assert [j for j, d in made.items() if d.exists()] == ["101", "103", "104", "77"]
    assert "--jobs 100,101,102,103,104 " in calls.read_text()  # one call, not this job's own id
    assert (tmp_path / ".relayrl-slurm" / "notes").is_dir() and theirs.is_dir()
    _fake_slurm(tmp_path, monkeypatch, squeue="slurm_load_jobs error: Invalid job id specified", squeue_rc=1)
    assert job_secrets.sweep(tmp_path, "77") == ["101", "103", "104"]  # all of them gone from Slurm
    _made(tmp_path, "105")
    _fake_slurm(
        tmp_path, monkeypatch, squeue="slurm_load_jobs error: Unable to contact slurm controller", squeue_rc=1
    )
    assert job_secrets.sweep(tmp_path, "77") == [] and (tmp_path / ".relayrl-slurm" / "105").is_dir()
    assert job_secrets.sweep(tmp_path / "elsewhere", "77") == []  # no secrets ever made there


def _serving(addr: str) -> bool:
    with grpc.insecure_channel(addr) as ch:
        try:
            got = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return got.status == health_pb2.HealthCheckResponse.SERVING


def test_a_service_lingers_after_a_first_sigterm_and_stops_at_a_second(tmp_path):
    with service(["env", "--set", "serve.term_linger_seconds=60"], tmp_path) as (addr, proc):
        os.kill(proc.proc.pid, signal.SIGTERM)
        time.sleep(1.5)
        assert proc.alive() and _serving(addr)  # still answering: the coordinator's last calls land
        os.kill(proc.proc.pid, signal.SIGTERM)
        proc.proc.wait(timeout=20)
    with service(["env"], tmp_path) as (addr, proc):  # without it: the first signal stops it
        os.kill(proc.proc.pid, signal.SIGTERM)
        proc.proc.wait(timeout=20)


def test_learner_ranks_across_nodes_meet_at_the_port_rank_0_publishes(tmp_path, monkeypatch):
    """No port is picked beforehand (it could be taken before rank 0 binds it): the ranks get a
    rendezvous file in the run folder, a new one per start, and rank 0 writes its store's port."""
    svc = _services(tmp_path, monkeypatch, "n1,n2,n3", secrets="/s")
    svc.cfg.learner.world_size = 2
    svc.plan = plan(svc.cfg, Allocation("77", ("n1", "n2", "n3"), gpus_per_node=1))  # a GPU a rank
    assert not svc.plan.steps["learner"].local and len(svc.plan.steps["learner"].nodes) == 2
    started = []

    class Ready:
        def wait_ready(self, timeout, host):
            return f"{host}:1"

    def start(step, args, section):
        started.append((step.name, args))
        return Ready()

    svc._start = start
    svc.start(timeout=1)
    svc.start(timeout=1)
    runs = [args for name, args in started if name == "learner"]
    assert len(runs) == 2 and all("--master-port" not in a for a in runs)
    files = [Path(a[a.index("--rendezvous-file") + 1]) for a in runs]
    assert all(f.parent == svc.run_dir / "rendezvous" for f in files) and files[0] != files[1]
    assert runs[0][:4] == [
        "learner",
        "--rank-from-slurm",
        "--master-addr",
        svc.plan.steps["learner"].nodes[0],
    ]
