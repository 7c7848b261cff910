"""The services of a run as local processes (the embedded default of ``relayrl run``), with a
supervisor that starts a crashed generator, reward, env or gateway replica again at its address."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from relayrl.common import config as cfg_mod
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.launch.processes import ServiceProcess, stop_all
from relayrl.coordinator.launch.replicas import learner_section, pick, replicas, service_of, service_section
from relayrl.coordinator.launch.service_set import Addresses

logger = logging.getLogger(__name__)


class LocalServices(Addresses):
    """The embedded default: the run's learner, generators and reward replicas (and the critic
    and reference learners where the algorithm uses them) as local processes (a ``ServiceSet``),
    each with its config section in ``services/`` and its log in ``logs/`` of the run folder,
    every command recorded in ``launch.jsonl``."""

    resume_command = "relayrl run --resume"
    """What a failed run's message tells the user to continue with."""

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        super().__init__()
        self.cfg = cfg
        self.run_dir = run_dir
        self.procs: list[ServiceProcess] = []
        self.restarted: dict[str, int] = {}  # name -> restarts so far
        self.restarting: set[str] = set()  # names being started again now
        self._lock = threading.Lock()  # procs, between the supervisor and stop()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None

    def _start(
        self, name: str, service: str, section, extra: list[str], devices: str = "", restart: int = 0
    ) -> ServiceProcess:
        path = self.run_dir / "services" / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        path.write_text(cfg_mod.dump_yaml(section))
        env = {"CUDA_VISIBLE_DEVICES": devices} if devices else {}
        if self.cfg.services.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.cfg.services.threads)
        proc = ServiceProcess(
            name, [service, "--config", str(path), "--port", "0", *extra], self.run_dir / "logs", env=env
        )
        entry = {"name": name, "command": proc.command, "env": env, "time": time.time()}
        with open(self.run_dir / "launch.jsonl", "a") as f:
            f.write(json.dumps({**entry, "restart": restart} if restart else entry) + "\n")
        with self._lock:
            late = self._stopping.is_set()  # a restart that raced stop(): not left behind
            if not late:
                self.procs.append(proc)
        if late:
            proc.stop(grace=10)
        return proc

    def start(self, timeout: float = 600.0) -> None:
        c = self.cfg
        dev = c.services.generator_devices
        devices = {
            "learner": c.services.learner_devices,
            "critic": c.services.critic_devices,
            "reference": c.services.reference_devices,
        }
        learners = {
            role: self._start(role, "learner", learner_section(c, self.run_dir, role), [], devices[role])
            for role in c.role_sections()
        }
        procs = [
            self._start(
                r.name,
                r.service,
                service_section(c, r.service),
                r.serve_args,
                dev[r.index] if r.service == "generator" and r.index < len(dev) else "",
            )
            for r in replicas(c, "generator", "reward", "env")
        ]
        ready = {role: p.wait_ready(timeout) for role, p in learners.items()}
        self.learner = ready.pop("learner")
        self.roles = ready
        up = {p.name: p.wait_ready(timeout) for p in procs}
        self.generators, self.rewards, self.envs = (pick(up, s) for s in ("generator", "reward", "env"))
        # The gateways sample on this run's generators: started once their addresses are known.
        self._gateway_section = c.gateway.model_copy(update={"generators": list(self.generators.values())})
        gateways = [
            self._start(r.name, r.service, self._gateway_section, r.serve_args)
            for r in replicas(c, "gateway")
        ]
        self.gateways = {p.name: p.wait_ready(timeout) for p in gateways}
        if c.services.restarts:
            self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
            self._supervisor.start()

    def _supervise(self, every_s: float = 1.0) -> None:
        """Start a generator, reward, env or gateway replica that exited again, at its address
        (its port): the coordinator's rotation probes it and takes it back, a generator after a
        push of the current weights. At most ``services.restarts`` times each. (A gateway comes
        back empty: the episodes whose sessions it held are lost and redone.)"""
        while not self._stopping.wait(every_s):
            with self._lock:
                dead = [p for p in self.procs if not p.alive() and service_of(p.name) is not None]
            for old in dead:
                n = self.restarted.get(old.name, 0) + 1
                if n > self.cfg.services.restarts or self._stopping.is_set():
                    continue
                self.restarted[old.name] = n
                self.restarting.add(old.name)
                try:
                    self._restart(old, n)
                except Exception:  # (out of memory, a full disk): the next round tries again
                    # The supervisor must not die of it: the kernel would then end every
                    # replica this thread started (PR_SET_PDEATHSIG follows the thread).
                    logger.exception("restarting %s failed", old.name)
                finally:
                    self.restarting.discard(old.name)

    def _restart(self, old: ServiceProcess, n: int) -> None:
        address = {**self.generators, **self.rewards, **self.envs, **self.gateways}[old.name]
        logger.warning(
            "%s exited (code %s); starting it again at %s (restart %d of %d)",
            old.name,
            old.proc.returncode,
            address,
            n,
            self.cfg.services.restarts,
        )
        with self._lock:
            self.procs.remove(old)
        old.stop(grace=0)  # reaps it and closes its log
        service = service_of(old.name)
        gen, i = service == "generator", int(old.name.rsplit("-", 1)[1])
        dev = self.cfg.services.generator_devices
        extra = ["--replica-id", old.name] if gen else []
        extra += ["--port", address.rsplit(":", 1)[1]]  # after --port 0: the last one counts
        proc = self._start(
            old.name,
            service,
            self._gateway_section if service == "gateway" else service_section(self.cfg, service),
            extra,
            dev[i] if gen and i < len(dev) else "",
            restart=n,
        )
        try:
            proc.wait_ready(600)
        except RuntimeError as e:  # it fails again: the next round tries once more, within budget
            logger.warning("%s did not come back: %s", old.name, e)

    def coming_back(self, name: str) -> bool:
        return name in self.restarting

    def stop(self) -> None:
        self._stopping.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=5)
        with self._lock:
            procs = list(self.procs)
        stop_all(procs)
