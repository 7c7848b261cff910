"""``relayrl launch slurm``: run an experiment inside a Slurm allocation, each service one job step.

Flow (``deploy/slurm/relayrl.sbatch`` runs this as its batch step): the allocation
(``plan.Allocation``) -> where every service goes (``plan.plan``) -> each service started with
``srun`` as a step of this job, bound to a free port (two jobs on one node never collide) and
announcing it in a port file in the run folder (shared storage), the learner's ranks one task
each (``--rank-from-slurm``: no torchrun) -> the coordinator loop runs in this process exactly as
``relayrl run`` does -> every step stopped, however the run ends.

Stopping: SIGTERM to this process (``scancel``, or ``--signal=B:TERM@<seconds>`` before the time
limit) ends the run at a step boundary with a checkpoint, as Ctrl-C does. ``scancel`` signals
every process of the job at once: the services then go on serving for
``serve.term_linger_seconds`` (``RELAYRL_SLURM_LINGER``, default 25 s, under Slurm's default
KillWait of 30 s), so the checkpoint still reaches the learner; their steps get a second SIGTERM
once the run has ended. A requeued job (``--requeue``, ``scontrol requeue``, a node failure) finds
its run folder by job id (``<runs_dir>/slurm-<job id>.run``) and resumes from its last checkpoint.

Access: on one node every service binds loopback. Across nodes they bind every interface and
need TLS and a token: the experiment's own (``services.security`` and each section's ``serve``),
or the per-job set ``deploy/slurm/relayrl.sbatch`` makes with ``deploy/make-secrets.sh``
(``RELAYRL_SLURM_SECRETS``: ca.crt, tls.crt, tls.key, token).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

from relayrl.common import config as cfg_mod
from relayrl.common.serving import ClientSecurity
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.launcher import ServiceProcess, stop_all
from relayrl.coordinator.local_services import learner_section
from relayrl.coordinator.service_set import Addresses
from relayrl.coordinator.slurm.plan import Allocation, Step, plan

logger = logging.getLogger(__name__)
LINGER_ENV = "RELAYRL_SLURM_LINGER"
SECRETS_ENV = "RELAYRL_SLURM_SECRETS"
SERVE = [sys.executable, "-m", "relayrl.cli", "--log-level", "INFO", "serve"]


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


class SlurmServices(Addresses):
    """The run's services as steps of this Slurm job (a ``ServiceSet``)."""

    resume_command = "sbatch deploy/slurm/relayrl.sbatch --resume"

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        super().__init__()
        self.alloc = Allocation.from_env()
        self.cfg = cfg
        self.run_dir = run_dir
        self.plan = plan(cfg, self.alloc)
        self.single = len(set(self.alloc.nodes)) == 1
        self.linger = float(os.environ.get(LINGER_ENV, "25"))
        self.procs: list[ServiceProcess] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        m = marker(cfg.runs_dir, self.alloc.job_id)
        m.parent.mkdir(parents=True, exist_ok=True)
        m.write_text(f"{run_dir.resolve()}\n")

    # -- sections -------------------------------------------------------------------------------
    def _secure(self, section, client_field: str | None = None):
        """``section`` as it runs in this job: its port free, lingering after a first SIGTERM,
        bound to loopback on one node, to every interface with TLS and a token across nodes."""
        serve = {"port": 0, "term_linger_seconds": self.linger}
        update = {}
        if not self.single:
            serve["host"] = "0.0.0.0"
            secrets = os.environ.get(SECRETS_ENV)
            if secrets:
                d = Path(secrets)
                serve.update(
                    tls_cert=str(d / "tls.crt"), tls_key=str(d / "tls.key"), token_file=str(d / "token")
                )
                if client_field:
                    update[client_field] = ClientSecurity(ca=str(d / "ca.crt"), token_file=str(d / "token"))
            elif not section.serve.tls_cert:
                raise SystemExit(
                    "relayrl launch slurm: services on several nodes need TLS and a token: run from "
                    f"deploy/slurm/relayrl.sbatch (it makes a per-job set, {SECRETS_ENV}), or give "
                    "services.security and each section's serve.tls_cert/tls_key/token_file"
                )
        return section.model_copy(update={"serve": section.serve.model_copy(update=serve), **update})

    def client_security(self) -> ClientSecurity | None:
        """How the coordinator calls the services (across nodes, with the per-job secrets)."""
        secrets = os.environ.get(SECRETS_ENV)
        if self.single or not secrets:
            return None
        return ClientSecurity(ca=str(Path(secrets) / "ca.crt"), token_file=str(Path(secrets) / "token"))

    # -- start ------------------------------------------------------------------------------------
    def _start(self, step: Step, args: list[str], section) -> ServiceProcess:
        path = self.run_dir / "services" / f"{step.name}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(cfg_mod.dump_yaml(section))
        proc = ServiceProcess(
            step.name,
            [*args, "--config", str(path)],
            self.run_dir / "logs",
            entry=[*step.srun(f"relayrl-{self.alloc.job_id}"), *SERVE],
            lifeline=False,  # srun ends the step when this process goes; a pid means nothing on other nodes
        )
        with open(self.run_dir / "launch.jsonl", "a") as f:
            f.write(
                json.dumps(
                    {"name": step.name, "command": proc.command, "nodes": step.nodes, "time": time.time()}
                )
                + "\n"
            )
        with self._lock:
            late = self._stopping.is_set()
            if not late:
                self.procs.append(proc)
        if late:
            proc.stop(grace=10)
            raise RuntimeError("stopped while starting")
        return proc

    def _host(self, step: Step) -> str:
        return "127.0.0.1" if self.single else step.nodes[0]

    def start(self, timeout: float = 900.0) -> None:
        c = self.cfg
        started: dict[str, tuple[ServiceProcess, Step]] = {}
        for role in c.role_sections():
            step = self.plan.steps[role]
            section = self._secure(learner_section(c, self.run_dir, role), "security")
            port = free_port(step.nodes[0], self.single)
            args = ["learner", "--rank-from-slurm", "--master-addr", step.nodes[0] if not self.single else "127.0.0.1",
                    "--master-port", str(port)]  # fmt: skip
            started[role] = (self._start(step, args, section), step)
        kinds = {"gen": ("generator", c.generator), "reward": ("reward", c.reward), "env": ("env", c.env)}
        for name, step in self.plan.steps.items():
            kind = name.rsplit("-", 1)[0]
            if kind in kinds:
                service, section = kinds[kind]
                extra = ["--replica-id", name] if kind == "gen" else []
                started[name] = (self._start(step, [service, *extra], self._secure(section)), step)
        addresses = {name: p.wait_ready(timeout, self._host(step)) for name, (p, step) in started.items()}
        self.learner = addresses["learner"]
        self.roles = {r: addresses[r] for r in c.role_sections() if r != "learner"}
        self.generators = {n: a for n, a in addresses.items() if n.startswith("gen-")}
        self.rewards = {n: a for n, a in addresses.items() if n.startswith("reward-")}
        self.envs = {n: a for n, a in addresses.items() if n.startswith("env-")}
        gateways = {}
        for name, step in self.plan.steps.items():
            if name.startswith("gateway-"):
                section = self._secure(
                    c.gateway.model_copy(update={"generators": list(self.generators.values())}), "client"
                )
                gateways[name] = (self._start(step, ["gateway"], section), step)
        self.gateways = {n: p.wait_ready(timeout, self._host(s)) for n, (p, s) in gateways.items()}
        for name, addr in addresses.items():
            print(f"slurm: {name} serving on {addr}", flush=True)

    def coming_back(self, name: str) -> bool:
        return False  # no step is started again within a job: a requeue restarts the whole run

    def stop(self) -> None:
        """Every step ends: two SIGTERMs to each ``srun`` (it forwards them to its tasks; a
        service lingering after the first stops at the second), then SIGKILL past the grace."""
        self._stopping.set()
        with self._lock:
            procs = list(self.procs)
        for p in procs:
            p._terminate()
        time.sleep(1.0)
        stop_all(procs, grace=60.0)


def free_port(node: str, single: bool) -> int:
    """A free TCP port on ``node`` (the learner's rendezvous): asked there, by a short step."""
    import subprocess

    probe = [
        sys.executable,
        "-c",
        "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])",
    ]
    cmd = probe if single else ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={node}", *probe]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


def launch(cfg: ExperimentConfig, resume_dir: Path | None = None) -> Path:
    """``relayrl launch slurm``: returns the run folder; exits non-zero with the reason if the run
    failed. A requeued job resumes the run it started."""
    if not cfg.services.embedded or cfg.services.gateways or cfg.services.envs:
        raise SystemExit(
            "relayrl launch slurm starts the services itself: remove services.generators, rewards, "
            "learner, envs and gateways from the experiment (replica counts: services.*_replicas)"
        )
    from relayrl.coordinator.run import run

    alloc = Allocation.from_env()
    if resume_dir is None and (again := requeued_run(cfg, alloc)) is not None:
        print(f"slurm: job {alloc.job_id} requeued (restart {alloc.restarts}): resuming {again}", flush=True)
        from relayrl.coordinator.derive import load_experiment

        cfg, resume_dir = load_experiment(again / "config.yaml"), again
    secrets = os.environ.get(SECRETS_ENV)
    if secrets and len(set(alloc.nodes)) > 1 and cfg.services.security == ClientSecurity():
        cfg.services.security = ClientSecurity(ca=f"{secrets}/ca.crt", token_file=f"{secrets}/token")
    return run(cfg, resume_dir, services_factory=SlurmServices, prog="relayrl launch slurm")
