"""``relayrl launch ray``: an experiment whose services run as Ray actors on a Ray cluster.

Flow: join the cluster (``cluster``; ``ray.address``, none: a private one-node instance on
loopback) -> reserve the placement groups (``plan.plan``: one bundle per learner rank, one per
generator, reward, env and gateway replica) -> one ``ServiceHost`` actor per bundle -> number the
learner ranks from where their bundles landed (``plan.assign_ranks``) and start one DeepSpeed rank
per actor, rank 0 serving gRPC; start ``relayrl serve generator|reward|env`` in the other actors,
bound to their node's IP, then the gateways -> collect the announced addresses -> the coordinator
loop runs in this process exactly as ``relayrl run`` does (``run.launch_ray``: progress, ``relayrl
status``, metrics, checkpoints) -> stop the processes, kill the actors and remove the placement
groups, however the run ends (Ctrl-C included).

Why one actor per rank rather than one torchrun per node: a bundle per rank is what Ray schedules
well (PACK spills ranks onto a second node when one is full, unevenly if need be, which torchrun's
equal ``--nproc-per-node`` cannot express), Ray then is the agent that watches every rank, and
each rank is a direct child of its actor, so it dies with it. What torchrun would do is kept: the
same environment per rank, and when one rank dies the others are stopped (``_watch``), so rank 0
stops serving and the run fails with the reason instead of hanging in a collective.

The run folder gets, beside what ``relayrl run`` writes, ``ray.json``: the placement groups
(bundles, strategy, the node of each bundle, their final state) and where each service ran.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from relayrl.common import config as cfg_mod
from relayrl.coordinator.config import ExperimentConfig, RaySection
from relayrl.coordinator.launch.ray.plan import GroupPlan, Slot, assign_ranks, needs, plan
from relayrl.coordinator.launch.replicas import (
    learner_section,
    pick,
    rendezvous_file,
    replicas,
    service_of,
    service_section,
)
from relayrl.coordinator.launch.service_set import Addresses

logger = logging.getLogger(__name__)

STOP_GRACE = 30.0
WATCH_EVERY = 2.0
"""Seconds between two health checks of the learner ranks."""
TIMED_OUT = "timed out"
"""A health check that got no answer within ``ray.call_timeout_seconds`` (not a death by itself)."""


def poll_outcome(error: BaseException) -> int | str:
    """What a failed health check of a service's actor says: -9 when Ray reports the actor dead
    (it and its process are gone), ``TIMED_OUT`` when it only did not answer in time or is
    unreachable for now (Ray may still reach it). Other errors are raised."""
    import ray

    if isinstance(error, ray.exceptions.GetTimeoutError | ray.exceptions.ActorUnavailableError):
        return TIMED_OUT  # ActorUnavailableError is a RayActorError, but a temporary one
    if isinstance(error, ray.exceptions.RayActorError):  # ActorDiedError and the like
        return -9
    raise error


class RankLiveness:
    """Which learner ranks count as dead, from one health check after another: a rank whose
    process exited, or whose actor Ray reports dead, at once; one whose check went unanswered only
    after ``dead_after`` in a row (a slow answer is not a death: counting one as such stopped every
    rank of a healthy learner).

    >>> live = RankLiveness(dead_after=2)
    >>> live.dead({"learner": None, "learner-rank1": TIMED_OUT})
    {}
    >>> live.dead({"learner": None, "learner-rank1": TIMED_OUT})
    {'learner-rank1': 'no answer to 2 health checks in a row'}
    >>> live.dead({"learner": 1, "learner-rank1": None})
    {'learner': 1}
    """

    def __init__(self, dead_after: int):
        self.dead_after = dead_after
        self.misses: dict[str, int] = {}

    def dead(self, polled: dict[str, int | str | None]) -> dict[str, int | str]:
        """The dead among ``polled`` (name -> exit code, None while running, or ``TIMED_OUT``),
        each with its exit code or why it counts as dead."""
        out: dict[str, int | str] = {}
        for name, code in polled.items():
            if code == TIMED_OUT:
                self.misses[name] = self.misses.get(name, 0) + 1
                if self.misses[name] >= self.dead_after:
                    out[name] = f"no answer to {self.misses[name]} health checks in a row"
                continue
            self.misses.pop(name, None)
            if code is not None:
                out[name] = code
        return out


def init_ray(r: RaySection) -> None:
    """Join the configured cluster, or start a private one-node instance on loopback."""
    if r.address is None:
        # A private instance is never joined by other nodes: Ray's one-machine mode keeps every
        # address on loopback, so the services need no TLS (read when ray is imported).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    kw = {"namespace": r.namespace, "runtime_env": {"env_vars": dict(r.env)} if r.env else None}
    if r.address is None:
        ray.init(address="local", num_cpus=r.num_cpus, num_gpus=r.num_gpus, include_dashboard=False, **kw)
    else:
        ray.init(address=r.address, **kw)


class RayServices(Addresses):
    """The services of one run as Ray actors in placement groups (a ``ServiceSet``: ``start``
    fills the addresses, ``stop`` tears everything down, idempotently)."""

    resume_command = "relayrl launch ray --resume"

    def __init__(self, cfg: ExperimentConfig, run_dir: Path):
        super().__init__()
        self.cfg = cfg
        self.run_dir = run_dir
        self.hosts: dict[str, object] = {}  # name -> actor handle
        self.ranks: list[str] = []  # learner host names, rank order
        self.pgs: list[tuple[GroupPlan, object]] = []
        self.record: dict = {"placement_groups": [], "services": {}}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    # -- start ----------------------------------------------------------------------------------
    def start(self, timeout: float | None = None) -> None:
        import ray

        c = self.cfg
        deadline = time.monotonic() + (timeout or c.ray.start_timeout_seconds)
        gpus = c.ray.accelerator == "gpu" or (
            c.ray.accelerator == "auto" and ray.cluster_resources().get("GPU", 0) > 0
        )
        self._reserve(plan(c, gpus, self.run_dir.name), deadline)
        roles = [(role, pg, i, g.bundles[i]) for g, pg in self.pgs for i, role in enumerate(g.roles)]
        for role, pg, i, bundle in roles:
            self._actor(role, pg, i, bundle)
        with self._lock:
            hosts = list(self.hosts.items())
        # Actors may take a while to start (a runtime_env to set up): the start deadline bounds it.
        places = self._get("actors", [h.where.remote() for _, h in hosts], deadline - time.monotonic())
        where = dict(zip([n for n, _ in hosts], places, strict=True))
        for g, _pg in self.pgs:
            entry = next(e for e in self.record["placement_groups"] if e["name"] == g.name)
            entry["bundle_nodes"] = [where[role]["ip"] for role in g.roles]
        for g, _pg in self.pgs:
            role = g.roles[0].rsplit("-", 1)[0]
            if role in c.role_sections():
                self._start_learner(g, where, role)
        for r in replicas(c, "generator", "reward", "env"):
            self._start_service(r.name, r.service, service_section(c, r.service), where, r.serve_args)
        self._wait_serving(where, deadline)
        self._start_gateways(where, deadline)
        self._write_record()
        threading.Thread(target=self._watch, name="ray-learner-watch", daemon=True).start()

    def _reserve(self, groups: list[GroupPlan], deadline: float) -> None:
        import ray
        from ray.util.placement_group import placement_group, placement_group_table

        want, have = needs(groups), ray.cluster_resources()
        if any(have.get(k, 0.0) < v for k, v in want.items()):
            has = {k: have.get(k, 0.0) for k in want}
            print(
                f"ray: the run needs {want}, the cluster has {has}: waiting (an autoscaler may add nodes)",
                flush=True,
            )
        for g in groups:
            with self._lock:
                if self._stopping.is_set():
                    raise RuntimeError("stopped while starting")
                pg = placement_group(g.bundles, strategy=g.strategy, name=g.name)
                self.pgs.append((g, pg))
        for g, pg in self.pgs:
            while not pg.wait(timeout_seconds=1):
                if self._stopping.is_set():
                    raise RuntimeError("stopped while starting")
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"placement group {g.name} ({len(g.bundles)} bundles {g.bundles[0]}..., "
                        f"{g.strategy}) not placed within {self.cfg.ray.start_timeout_seconds:.0f}s: the "
                        f"run needs {needs(groups)}, the cluster has {ray.cluster_resources()}"
                    )
            table = placement_group_table(pg)
            self.record["placement_groups"].append(
                {
                    "name": g.name,
                    "id": pg.id.hex(),
                    "strategy": g.strategy,
                    "bundles": g.bundles,
                    "roles": g.roles,
                    "bundle_node_ids": [table["bundles_to_node_id"][i] for i in range(len(g.bundles))],
                }
            )
            print(f"ray: placement group {g.name}: {len(g.bundles)} bundles, {g.strategy}", flush=True)

    def _actor(self, role: str, pg, index: int, bundle: dict[str, float]) -> None:
        """A ``ServiceHost`` holding the whole of bundle ``index`` (so Ray hands it the bundle's GPUs)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        from relayrl.coordinator.launch.ray.actor import ServiceHost

        with self._lock:
            if self._stopping.is_set():
                raise RuntimeError("stopped while starting")
            self.hosts[role] = (
                ray.remote(ServiceHost)
                .options(
                    name=f"{self.run_dir.name}-{role}",
                    num_cpus=bundle.get("CPU", 0.0),
                    num_gpus=bundle.get("GPU", 0.0),
                    max_concurrency=4,  # stop() and poll() while wait() blocks
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=index
                    ),
                )
                .remote()
            )

    def _bind(self, ip: str) -> str:
        return ip if self.cfg.ray.bind == "node" else ("::" if ":" in ip else "0.0.0.0")

    def _launch(self, name: str, where: dict, section, args: list[str], env=None, module=None, check=None):
        """Record the section in the run folder, write it on the node, start the process there."""

        path = self.run_dir / "services" / f"{name}.yaml"
        path.parent.mkdir(exist_ok=True)
        text = cfg_mod.dump_yaml(section)
        path.write_text(text)
        logs = str(self.run_dir / "logs")
        start = self.hosts[name].start.remote(
            name, [*args, "--config", str(path)], str(path), text, logs, env or {}, module, check
        )
        command = self._get(name, start)
        self.record["services"][name] = {k: where[k] for k in ("ip", "hostname", "gpus")}
        with open(self.run_dir / "launch.jsonl", "a") as f:
            rec = {
                "name": name,
                "command": command,
                "env": env or {},
                "node": where["ip"],
                "time": time.time(),
            }
            f.write(json.dumps(rec) + "\n")

    def _start_learner(self, g: GroupPlan, where: dict, role: str) -> None:
        """One DeepSpeed rank per bundle of a learner ``role`` (``learner``: the actor, ``critic``,
        ``reference``); rank 0 (named as the role) serves gRPC."""
        c = self.cfg
        slots = [Slot(where[r]["node_id"], where[r]["ip"], tuple(where[r]["gpus"])) for r in g.roles]
        # Rank 0 binds its rendezvous store on a free port and writes it here, for the other
        # ranks to read (the run folder is on every node: docs/ray.md); a file per launch.
        ranks = assign_ranks(slots, str(rendezvous_file(self.run_dir, role)))
        first = next(i for i, e in enumerate(ranks) if e.rank == 0)
        ip0 = slots[first].ip
        section = c.role_sections()[role]
        update = {"serve": section.serve.model_copy(update={"host": self._bind(ip0), "port": 0})}
        if not section.weight_sync_host:  # what the generators dial to join the weight sync
            update["weight_sync_host"] = ip0
        lcfg = learner_section(c, self.run_dir, role).model_copy(update=update)
        for i in sorted(range(len(slots)), key=lambda i: ranks[i].rank):
            rank = ranks[i].rank
            name = role if rank == 0 else f"{role}-rank{rank}"
            with self._lock:
                self.hosts[name] = self.hosts.pop(g.roles[i])
            where[name] = where.pop(g.roles[i])
            self.ranks.append(name)
            check = ("learner", lcfg.serve.model_dump()) if rank == 0 else None
            self._launch(name, where[name], lcfg, [], ranks[i].env, "relayrl.learner.rank", check)

    def _start_service(self, name: str, service: str, section, where: dict, args: list[str]) -> None:
        serve = section.serve.model_copy(update={"host": self._bind(where[name]["ip"]), "port": 0})
        self._launch(name, where[name], section.model_copy(update={"serve": serve}), [service, *args])

    def _start_gateways(self, where: dict, deadline: float) -> None:
        """The gateways, once the generators they sample on serve. Each serves its OpenAI API on
        a free port of its node, announced to the agents with the node's IP (``http.public_host``): env
        replicas on other nodes reach it there. Off loopback that API needs ``gateway.http``'s
        TLS or ``insecure``, as any service does (the config names the field)."""
        from pydantic import ValidationError
        from relayrl.gateway.config import GatewayConfig

        c = self.cfg
        names = [r.name for r in replicas(c, "gateway")]
        for name in names:
            ip = where[name]["ip"]
            # Port 0: the gateway binds a free one and announces it at its node's address (a
            # port picked here and bound there later could be taken in between).
            http = {"host": self._bind(ip), "port": 0, "public_host": ip, "public_url": ""}
            given = c.gateway.model_dump(exclude_unset=True)
            try:
                section = GatewayConfig.model_validate(
                    {
                        **given,
                        "generators": list(self.generators.values()),
                        "replica_id": name,
                        "serve": {**given.get("serve", {}), "host": self._bind(ip), "port": 0},
                        "http": {**given.get("http", {}), **http},
                    }
                )
            except ValidationError as e:
                raise cfg_mod.ConfigError(cfg_mod.format_validation_error(e, within="gateway")) from None
            self._launch(name, where[name], section, ["gateway"])
        self.gateways = dict(sorted(self._addresses(names, where, deadline).items()))
        for name, addr in self.gateways.items():
            self.record["services"][name]["address"] = addr
            print(f"ray: {name} serving on {addr}", flush=True)

    def _wait_serving(self, where: dict, deadline: float) -> None:
        """Collect the address of every service but the gateways (started after the generators)."""
        names = [
            *self.cfg.role_sections(),
            *(n for n in self.hosts if service_of(n) in ("generator", "reward", "env")),
        ]
        addresses = self._addresses(names, where, deadline)
        self.learner = addresses.pop("learner")
        self.roles = {r: addresses.pop(r) for r in self.cfg.role_sections() if r != "learner"}
        addresses = dict(sorted(addresses.items()))
        self.generators, self.rewards, self.envs = (
            pick(addresses, s) for s in ("generator", "reward", "env")
        )
        for name, addr in [
            ("learner", self.learner),
            *self.roles.items(),
            *self.generators.items(),
            *self.rewards.items(),
            *self.envs.items(),
        ]:
            self.record["services"][name]["address"] = addr
            print(f"ray: {name} serving on {addr}", flush=True)

    def _addresses(self, names: list[str], where: dict, deadline: float) -> dict[str, str]:
        """The address each of ``names`` announces once it serves; fails with a log's tail as
        soon as any process exits (a learner follower included: rank 0 would wait for it
        forever)."""
        import ray

        pending = {
            name: self.hosts[name].wait.remote(max(1.0, deadline - time.monotonic()), where[name]["ip"])
            for name in names
        }
        addresses: dict[str, str] = {}
        while pending:
            if self._stopping.is_set():
                raise RuntimeError("stopped while starting")
            done, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=1.0)
            for name, ref in list(pending.items()):
                if ref in done:
                    addresses[name] = self._get(name, ref)
                    del pending[name]
            # A check that went unanswered is not an exit: the start deadline bounds the wait.
            exited = {n: code for n, code in self._poll().items() if isinstance(code, int)}
            if exited:
                name, code = next(iter(exited.items()))
                raise RuntimeError(
                    f"{name} on {where[name]['ip']} exited with code {code} before serving:\n"
                    + self._tail(name)
                )
            if time.monotonic() > deadline and pending:
                raise RuntimeError(
                    f"not serving within {self.cfg.ray.start_timeout_seconds:.0f}s: {sorted(pending)}"
                )
        return addresses

    def _get(self, name: str, ref, timeout: float | None = None):
        """``ray.get`` with a deadline (``ray.call_timeout_seconds`` unless given)."""
        import ray

        limit = self.cfg.ray.call_timeout_seconds if timeout is None else max(1.0, timeout)
        try:
            return ray.get(ref, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"{name}: no answer from its Ray actor within {limit:.0f}s") from None
        except ray.exceptions.RayTaskError as e:  # the actor's own exception, not Ray's wrapper
            cause = getattr(e, "cause", None)
            raise RuntimeError(str(cause) if cause is not None else f"{name}: {e}") from None

    def _tail(self, name: str) -> str:
        """The end of ``name``'s log, or why it could not be read."""
        import ray

        try:
            return self._get(name, self.hosts[name].tail.remote())
        except (RuntimeError, ray.exceptions.RayError) as e:
            return f"(its log could not be read: {e})"

    def _poll(self, names=None) -> dict[str, int | str | None]:
        """Exit code of each process (None: running; -9: Ray reports its actor dead; ``TIMED_OUT``:
        no answer within ``ray.call_timeout_seconds``, for all of them together)."""
        import ray

        with self._lock:
            items = [(n, h) for n, h in self.hosts.items() if names is None or n in names]
        refs = [h.poll.remote() for _n, h in items]
        ready, _ = (
            ray.wait(refs, num_returns=len(refs), timeout=self.cfg.ray.call_timeout_seconds)
            if refs
            else ([], [])
        )
        out: dict[str, int | str | None] = {}
        for (n, _h), ref in zip(items, refs, strict=True):
            try:
                out[n] = ray.get(ref, timeout=0) if ref in ready else TIMED_OUT
            except ray.exceptions.RayError as e:
                out[n] = poll_outcome(e)
        return out

    def _watch(self) -> None:
        """torchrun's rule: when one learner rank dies, stop them all (rank 0 then stops serving
        and the coordinator fails the run with the reason, instead of a collective hanging). Dead
        means exited, or Ray says its actor died, or ``ray.dead_after_timeouts`` checks in a row
        went unanswered (``RankLiveness``)."""
        live = RankLiveness(self.cfg.ray.dead_after_timeouts)
        while not self._stopping.wait(WATCH_EVERY):
            try:
                polled = self._poll(self.ranks)
            except Exception:  # an error Ray did not foresee: the watch goes on (a dead watch
                logger.exception("checking the learner ranks failed")  # would watch nothing)
                continue
            dead = live.dead(polled)
            if live.misses and not dead:
                logger.warning("learner rank(s) slow to answer a health check: %s", live.misses)
            if dead and not self._stopping.is_set():
                logger.error("learner rank(s) exited: %s; stopping the other ranks", dead)
                print(f"ray: learner rank(s) exited {dead}; stopping the learner", flush=True)
                self._stop_hosts(self.ranks)
                return

    # -- stop -----------------------------------------------------------------------------------
    def _stop_hosts(self, names) -> None:
        import ray

        with self._lock:
            hosts = [self.hosts[n] for n in names if n in self.hosts]
        refs = [h.stop.remote(STOP_GRACE) for h in hosts]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=STOP_GRACE + 30)

    def coming_back(self, name: str) -> bool:
        return False  # Ray restarts no service here: replica_wait_seconds decides

    def stop(self) -> None:
        """Stop every process, kill the actors, remove the placement groups. Safe to call twice,
        and from another thread while ``start`` is still starting things."""
        import ray
        from ray.util.placement_group import placement_group_table, remove_placement_group

        self._stopping.set()
        if not ray.is_initialized():
            return
        with self._lock:
            names = list(self.hosts)
        self._stop_hosts(names)
        with self._lock:
            hosts, self.hosts = self.hosts, {}
            pgs, self.pgs = self.pgs, []

        def remove() -> None:
            for h in hosts.values():
                try:
                    ray.kill(h)
                except Exception:  # already gone
                    pass
            for _g, pg in pgs:
                remove_placement_group(pg)
            for _g, pg in pgs:
                state = placement_group_table(pg).get("state")
                for entry in self.record["placement_groups"]:
                    if entry["id"] == pg.id.hex():
                        entry["state"] = state

        # Each is a call to Ray's control store, which can hang with it: a teardown ends all
        # the same, saying what it could not confirm.
        done = threading.Thread(target=remove, name="ray-teardown", daemon=True)
        done.start()
        done.join(self.cfg.ray.call_timeout_seconds)
        if done.is_alive():
            logger.error(
                "ray: actors and placement groups not confirmed removed within %gs",
                self.cfg.ray.call_timeout_seconds,
            )
            print("ray: teardown not confirmed (Ray's control store did not answer)", flush=True)
        elif pgs:
            self._write_record()
            print("ray: services stopped, placement groups removed", flush=True)

    def _write_record(self) -> None:
        (self.run_dir / "ray.json").write_text(json.dumps(self.record, indent=2) + "\n")


@contextmanager
def cluster(cfg: ExperimentConfig) -> Iterator[None]:
    """The Ray cluster a ``relayrl launch ray`` run holds its services on: joined for the run (a
    private instance started), left however it ends (a private instance stops). An experiment
    that names service addresses is refused first: this launcher starts them itself."""
    if not cfg.services.embedded or cfg.services.gateways:
        raise SystemExit(
            "relayrl launch ray starts the services itself: remove services.generators, "
            "services.rewards, services.learner and services.gateways from the experiment (gateways: "
            "services.gateway_replicas), or use relayrl run"
        )
    init_ray(cfg.ray)
    import ray

    try:
        yield
    except KeyboardInterrupt:  # the services were stopped on the way out (Registry's finally)
        raise SystemExit(
            "relayrl launch ray: interrupted; services stopped, placement groups removed"
        ) from None
    finally:
        ray.shutdown()
