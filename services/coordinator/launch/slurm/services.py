"""``relayrl launch slurm``: run an experiment inside a Slurm allocation, each service beside it.

Flow (``deploy/slurm/relayrl.sbatch`` runs this as its batch step, on the job's first node): the
allocation (``plan.Allocation``) -> where every service goes (``plan.plan``) -> each service
started: on the first node as a child process, on the others as an ``srun`` step of this job (the
learner's ranks one task each, ``--rank-from-slurm``: no torchrun; rank 0's rendezvous store binds
a free port and publishes it in a file of the run folder, ``--rendezvous-file``); every one binds a
free port and announces it in a port file in the run folder (shared storage), so two jobs on one
node never collide -> the coordinator loop runs in this process exactly as ``relayrl run`` does
(``run.launch_slurm``, inside ``job``) -> every service stopped, however the run ends.

Stopping. SIGTERM to this process (``--signal=B:TERM@<seconds>`` before the time limit, or
``scancel --batch --signal=TERM``) ends the run at a step boundary with a checkpoint, as Ctrl-C
does; then each service gets SIGTERM (an srun step through ``scancel --signal=TERM <job>.<step>``:
srun itself answers a SIGTERM by killing its tasks) and ends as it does under any supervisor.
A plain ``scancel`` signals every process of the job at once. The services on the first node then
serve on for ``serve.term_linger_seconds`` (``RELAYRL_SLURM_LINGER``, default 25 s, under Slurm's
default KillWait of 30 s), so a one-node run still gets its last checkpoint to the learner; srun
steps on other nodes end at once (their srun kills them), and the run keeps its last periodic
checkpoint (``schedule.checkpoint_every``). A requeued job finds its run folder by job id
(``<runs_dir>/slurm-<job id>.run``) and resumes from its last checkpoint.

Access. On one node every service binds loopback. Across nodes they bind every interface and
need TLS and a token: the experiment's own (``services.security`` and each section's ``serve``),
or the per-job set ``deploy/slurm/relayrl.sbatch`` makes with ``deploy/make-secrets.sh``
(``RELAYRL_SLURM_SECRETS``: ca.crt, tls.crt, tls.key, token), used only where the experiment sets
none and never written into the run's config (a resumed job gets its own). The per-job set is
removed when the job ends, kept over a requeue (``job_secrets``).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from relayrl.common import config as cfg_mod
from relayrl.common.serving import ClientSecurity
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.launch.processes import ServiceProcess, stop_all
from relayrl.coordinator.launch.replicas import (
    learner_section,
    pick,
    rendezvous_file,
    replicas,
    service_section,
)
from relayrl.coordinator.launch.service_set import Addresses
from relayrl.coordinator.launch.slurm import job_secrets
from relayrl.coordinator.launch.slurm.plan import Allocation, Step, plan

logger = logging.getLogger(__name__)
LINGER_ENV = "RELAYRL_SLURM_LINGER"
SECRETS_ENV = "RELAYRL_SLURM_SECRETS"
SERVE = [sys.executable, "-m", "relayrl.cli", "--log-level", "INFO", "serve"]
STOP_GRACE_S = 60.0


def marker(runs_dir: str | Path, job_id: str) -> Path:
    """Where a job records its run folder, so that the job requeued finds it again."""
    return Path(runs_dir) / f"slurm-{job_id}.run"


def requeued_run(cfg: ExperimentConfig, alloc: Allocation) -> Path | None:
    """The run folder this job started before it was requeued, if it holds a checkpoint."""
    m = marker(cfg.runs_dir, alloc.job_id)
    if not m.exists():
        return None
    run_dir = Path(m.read_text().strip())
    return run_dir if (run_dir / "checkpoints" / "coordinator.json").exists() else None


def visible_gpus(ids: tuple[int, ...], env: dict[str, str]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a local service taking the batch step's GPUs ``ids``.

    >>> visible_gpus((1, 2), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}), visible_gpus((0,), {})
    ('5,6', '0')
    """
    have = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]
    return ",".join(have[i] if i < len(have) else str(i) for i in ids)


class SlurmServices(Addresses):
    """The run's services in this Slurm job (a ``ServiceSet``)."""

    resume_command = "sbatch deploy/slurm/relayrl.sbatch --resume"

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        super().__init__()
        self.alloc = Allocation.from_env()
        self.cfg = cfg
        self.run_dir = run_dir
        self.plan = plan(cfg, self.alloc)
        self.single = len(set(self.alloc.nodes)) == 1
        self.linger = float(os.environ.get(LINGER_ENV, "25"))
        secrets = os.environ.get(SECRETS_ENV)
        self.secrets = Path(secrets) if secrets and not self.single else None
        self.procs: list[ServiceProcess] = []
        self.steps: dict[str, ServiceProcess] = {}  # srun steps by name
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        if self.secrets is not None and cfg.services.security == ClientSecurity():
            # The coordinator's own calls; the run's config.yaml is written already, without it.
            cfg.services.security = self._client()
        m = marker(cfg.runs_dir, self.alloc.job_id)
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text(f"{run_dir.resolve()}\n")

    # -- sections -------------------------------------------------------------------------------
    def _client(self) -> ClientSecurity:
        return ClientSecurity(ca=str(self.secrets / "ca.crt"), token_file=str(self.secrets / "token"))

    def _secure(self, section, client_field: str | None = None):
        """``section`` as it runs in this job: a free port, lingering after a first SIGTERM,
        bound to loopback on one node; across nodes to every interface, with TLS and a token
        (the per-job set where the section brings none)."""
        serve = {"port": 0, "term_linger_seconds": self.linger}
        update = {}
        if not self.single:
            serve["host"] = "0.0.0.0"
            if not section.serve.tls_cert:
                if self.secrets is None:
                    raise SystemExit(
                        "relayrl launch slurm: services on several nodes need TLS and a token: run "
                        f"from deploy/slurm/relayrl.sbatch (it makes a per-job set, {SECRETS_ENV}), or "
                        "give services.security and each section's serve.tls_cert/tls_key/token_file"
                    )
                d = self.secrets
                serve.update(
                    tls_cert=str(d / "tls.crt"), tls_key=str(d / "tls.key"), token_file=str(d / "token")
                )
            if client_field and getattr(section, client_field) == ClientSecurity() and self.secrets:
                update[client_field] = self._client()
        return section.model_copy(update={"serve": section.serve.model_copy(update=serve), **update})

    # -- start ------------------------------------------------------------------------------------
    def _start(self, step: Step, args: list[str], section) -> ServiceProcess:
        path = self.run_dir / "services" / f"{step.name}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(cfg_mod.dump_yaml(section))
        env = {"CUDA_VISIBLE_DEVICES": visible_gpus(step.gpu_ids, dict(os.environ))} if step.gpu_ids else {}
        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("stopped while starting")
            proc = ServiceProcess(
                step.name,
                [*args, "--config", str(path)],
                self.run_dir / "logs",
                env=env,
                entry=None if step.local else [*step.srun(self._job_name), *SERVE],
                lifeline=step.local,  # srun ends a step with this process; a pid means nothing elsewhere
            )
            self.procs.append(proc)
            if not step.local:
                self.steps[step.name] = proc
        record = {
            "name": step.name,
            "command": proc.command,
            "nodes": step.nodes,
            "env": env,
            "time": time.time(),
        }
        with open(self.run_dir / "launch.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        return proc

    @property
    def _job_name(self) -> str:
        return f"relayrl-{self.alloc.job_id}"

    def _host(self, step: Step) -> str:
        return "127.0.0.1" if self.single else step.nodes[0]

    def start(self, timeout: float = 900.0) -> None:
        c = self.cfg
        started: dict[str, tuple[ServiceProcess, Step]] = {}
        for role in c.role_sections():
            step = self.plan.steps[role]
            section = self._secure(learner_section(c, self.run_dir, role), "security")
            if step.local:  # torchrun, one rank per GPU it was given
                args = ["learner"]
            else:
                args = [
                    "learner",
                    "--rank-from-slurm",
                    "--master-addr",
                    step.nodes[0],
                    "--rendezvous-file",
                    str(rendezvous_file(self.run_dir, role)),
                ]
            started[role] = (self._start(step, args, section), step)
        for r in replicas(c, "generator", "reward", "env"):
            step, section = self.plan.steps[r.name], self._secure(service_section(c, r.service))
            started[r.name] = (self._start(step, [r.service, *r.serve_args], section), step)
        addresses = {name: p.wait_ready(timeout, self._host(step)) for name, (p, step) in started.items()}
        self.learner = addresses["learner"]
        self.roles = {r: addresses[r] for r in c.role_sections() if r != "learner"}
        self.generators, self.rewards, self.envs = (
            pick(addresses, s) for s in ("generator", "reward", "env")
        )
        gateways = {}
        for r in replicas(c, "gateway"):
            section = c.gateway.model_copy(update={"generators": list(self.generators.values())})
            step = self.plan.steps[r.name]
            gateways[r.name] = (self._start(step, ["gateway"], self._secure(section, "client")), step)
        self.gateways = {n: p.wait_ready(timeout, self._host(s)) for n, (p, s) in gateways.items()}
        for name, addr in {**addresses, **self.gateways}.items():
            print(f"slurm: {name} serving on {addr}", flush=True)

    def coming_back(self, name: str) -> bool:
        return False  # nothing is started again within a job: a requeue restarts the whole run

    # -- stop -------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Every service ends as under any supervisor: SIGTERM, twice (one lingering after the
        first stops at the second), then SIGKILL past the grace. srun steps get theirs from
        ``scancel --signal=TERM <job>.<step>``: srun answers a SIGTERM of its own by killing."""
        self._stopping.set()
        with self._lock:
            procs = list(self.procs)
        ids = step_ids(self.alloc.job_id, self._job_name) if self.steps else {}
        for _ in range(2):
            for p in procs:
                if p.name in self.steps:
                    if step := ids.get(p.name):
                        signal_step(f"{self.alloc.job_id}.{step}")
                else:
                    p._terminate()
            time.sleep(1.0)
        deadline = time.monotonic() + STOP_GRACE_S
        for p in procs:  # srun exits once its step has ended
            if p.name in self.steps:
                try:
                    p.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        stop_all(procs, grace=max(1.0, deadline - time.monotonic()))


def step_ids(job_id: str, prefix: str) -> dict[str, str]:
    """This job's running srun steps, service name -> step id (from their step names)."""
    out = subprocess.run(
        ["squeue", "-h", "--steps", "--jobs", job_id, "-o", "%i %j"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    ids = {}
    for line in out.stdout.splitlines():
        step, _, name = line.strip().partition(" ")
        if name.startswith(prefix + "-") and "." in step:
            ids[name[len(prefix) + 1 :]] = step.split(".", 1)[1]
    return ids


def signal_step(step: str) -> None:
    """SIGTERM to every task of one step, without ending the step."""
    got = subprocess.run(["scancel", "--signal=TERM", step], capture_output=True, text=True, timeout=30)
    if got.returncode:
        logger.warning("scancel --signal=TERM %s: %s", step, got.stderr.strip()[:300])


@contextmanager
def job(cfg: ExperimentConfig) -> Iterator[Path | None]:
    """The Slurm job a ``relayrl launch slurm`` run is in, around the run: yields the run folder
    this job started before it was requeued (None on its first start), to resume; removes the
    job's secrets when the run ends, however, unless the job is being requeued. An experiment that
    names service addresses is refused first: this launcher starts them itself."""
    if not cfg.services.embedded or cfg.services.gateways or cfg.services.envs:
        raise SystemExit(
            "relayrl launch slurm starts the services itself: remove services.generators, rewards, "
            "learner, envs and gateways from the experiment (replica counts: services.*_replicas)"
        )
    alloc = Allocation.from_env()
    submit_dir = os.environ.get("SLURM_SUBMIT_DIR") or os.getcwd()  # where relayrl.sbatch made them
    job_secrets.sweep(submit_dir, alloc.job_id)  # of earlier jobs killed before they could
    try:
        # A requeued job runs its script again with the same arguments: the run it started (the
        # one it resumed included) is in its marker, with the checkpoint of its last steps.
        if (again := requeued_run(cfg, alloc)) is not None:
            print(
                f"slurm: job {alloc.job_id} requeued (restart {alloc.restarts}): resuming {again}", flush=True
            )
        yield again
    finally:
        job_secrets.forget(submit_dir, alloc.job_id, alloc.restarts)
