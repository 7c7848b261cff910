"""Every client one run talks through, opened on the addresses of its services (a started
``ServiceSet``): the learner and the learner roles its algorithm calls, the generator and reward
pools, and, with an ``episodes`` section, the env pool (and the gateway pool where gateways
serve). Closed together when the run ends.

A generator that fails leaves the rotation and the learner forgets it (a dead member must not
fail every later push); when it serves again it is readmitted (``readmit``): registered anew and
given the learner's current weights before it samples."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from relayrl.coordinator.clients.envs import EnvPool
from relayrl.coordinator.clients.gateways import GatewayPool
from relayrl.coordinator.clients.generators import GeneratorPool
from relayrl.coordinator.clients.learner import LearnerClient
from relayrl.coordinator.clients.rewards import RewardPool
from relayrl.coordinator.config import ExperimentConfig


class RunClients:
    def __init__(self, cfg: ExperimentConfig, services, roles: Iterable[str]):
        """``services``: the run's ``ServiceSet``, started (its addresses filled); ``roles``: the
        learner roles beside the actor its algorithm calls."""
        s = cfg.services
        deadline, security, wait_s = s.deadline_seconds, s.security, s.replica_wait_seconds
        self.learner = LearnerClient(services.learner, deadline, security)
        self.roles = {r: LearnerClient(services.roles[r], deadline, security, r) for r in roles}
        self.weights_lock = asyncio.Lock()
        """Held by the loop while the policy version moves (a train step and its push)."""
        self.version: Callable[[], int] | None = None
        """The policy version the loop holds, once it runs: what a readmitted generator gets."""
        # A dead generator must not fail every later push: the learner forgets it until it is back.
        self.generators = GeneratorPool(
            services.generators,
            deadline,
            on_down=self.learner.forget_soon,
            security=security,
            readmit=self.readmit,
            wait_s=wait_s,
            samples_per_call=s.generator_samples_per_call,
            max_attempts=s.max_attempts,
            coming_back=services.coming_back,
        )
        self.rewards = RewardPool(
            services.rewards,
            deadline,
            security=security,
            wait_s=wait_s,
            max_attempts=s.max_attempts,
            coming_back=services.coming_back,
        )
        self.envs = (
            EnvPool(services.envs, deadline, security, wait_s, coming_back=services.coming_back)
            if cfg.episodes is not None
            else None
        )
        self.gateways = (
            GatewayPool(services.gateways, deadline, security, wait_s, coming_back=services.coming_back)
            if services.gateways
            else None
        )

    async def register_generators(self) -> None:
        """Every generator replica registered with the learner for weight sync."""
        for rep in self.generators.replicas:
            await self.learner.register_generator(rep.name, rep.address)

    async def readmit(self, name: str, address: str) -> None:
        """A generator serving again after a failure (a restarted container holds the initial
        weights): registered anew, and given the learner's current weights before it samples.
        The registration runs beside training (the learner never holds a train step for it);
        the push waits for a train step and its push under way to end, so the version it names
        is still the learner's when it arrives."""
        reg = await self.learner.register_generator(name, address)
        try:
            # wait: the loop holds it only around a train step and its push (calls under deadlines)
            async with self.weights_lock:
                await self.learner.push_weights(self.version() if self.version else reg.policy_version)
        except BaseException:
            # Left registered, a replica that failed again would fail every later push. Not
            # awaited here: the clean-up's own failure would replace the push's error or a
            # cancellation (Ctrl-C); the next push or registration waits for it (_forgotten).
            self.learner.forget_soon(name)
            raise

    async def close(self) -> None:
        for pool in (self.generators, self.rewards, self.envs, self.gateways):
            if pool is not None:
                await pool.close()
        for client in (self.learner, *self.roles.values()):
            await client.close()
