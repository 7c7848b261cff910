"""verifiers environments (Prime Intellect's ``verifiers`` 0.4, ``verifiers.v1``; the Environments
Hub's): each rollout is the environment's own, run by verifiers in the replica's sandbox through
the gateway, one gateway session per rollout, and scored by the environment's own rubric.

Why a harness env, and not verifiers in this process: verifiers runs its rollouts itself (its
harness calls the model through its interception server), and its packages cannot share an
environment with the generator's (verifiers 0.4 pins ``openai < 3``; relayrl's gateway tests
and the frameworks they serve use openai 3). So a replica installs ``requirements`` (verifiers,
and the taskset's own package: a Hub environment's wheel) once for the sandbox's interpreter, as
for any framework agent (``HarnessEnv.agent_requirements``), and each episode's job runs
``relayrl.common.verifiers``'s ``agent.py``: it loads the taskset, picks the row's task, runs one episode with
``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` (the gateway session's) as verifiers' client, and
reports the rubric's reward. The gateway records every call token for token, as for any agent.

A row names its task by ``task_index`` (its place in the taskset) or ``task_id`` (``TaskData.id``);
``data.generate.task: verifiers/<name>`` writes such rows from the taskset
(``relayrl.common.verifiers.task_rows``), its prompts as the rows' prompts. A taskset that brings no harness of its own plays through relayrl's
in-process chat harness (``relayrl.common.verifiers``'s ``relayrl_vf_chat.py``): verifiers' default harness installs uv
from the internet at its first run, which a sandbox cannot reach.

Outcomes as for any harness env: the rubric's reward when the rollout ended; a rollout verifiers
ended with errors (a tool server that would not start, an endpoint error), an agent that crashed
or printed no report: masked ("agent_failed"), never scored 0; a replica whose requirements do not
install: redone elsewhere.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, ClassVar

from relayrl.common import verifiers as vfc
from relayrl.common.sandbox import RunResult, SandboxLimits
from relayrl.env.base import Outcome, Reward, TaskError, prompt_messages
from relayrl.env.config import VerifiersEnvSpec, resolved
from relayrl.env.harness import HarnessEnv

MAX_COMPONENTS = 64
"""Most reward functions a report may score by name."""


def requirements_file(spec: VerifiersEnvSpec) -> str:
    return spec.requirements or str(vfc.DEFAULT_REQUIREMENTS)


def env_data(spec: VerifiersEnvSpec) -> dict[str, Any]:
    return vfc.env_data(spec.taskset, spec.taskset_args, spec.harness, spec.max_turns)


class VerifiersEnv(HarnessEnv):
    """Base of the classes ``verifiers_env`` makes, one per ``env.verifiers`` entry."""

    spec: ClassVar[VerifiersEnvSpec]
    agent_program = str(vfc.AGENT)
    max_turns = 1

    def __init__(self) -> None:
        super().__init__()
        self.selector: dict[str, Any] = {}
        self.result: Reward | None = None

    def reset(self, task: dict, seed: int) -> list[dict]:
        self.check_reset()
        index, ident = task.get("task_index"), task.get("task_id")
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < 1 << 31:
            self.selector = {"index": index}
        elif isinstance(ident, str) and 0 < len(ident) <= 512:
            self.selector = {"id": ident}
        else:
            raise TaskError(
                f"{self.name}: a row names its verifiers task by task_index (an int >= 0) or task_id "
                f"(a string); got task_index={index!r:.40}, task_id={ident!r:.40}"
            )
        self.first_messages = prompt_messages(task) if "prompt" in task else []
        return self.first_messages

    def agent_input(self) -> dict:
        return {"env": env_data(self.spec), "task": self.selector, "model": self.gateway.model}

    def _report(self, r: RunResult, wall: float) -> dict | None:
        report = super()._report(r, wall)
        if report is None:
            return None
        extra = json.loads([line for line in r.stdout.splitlines() if line.strip()][-1])
        reward, parts = extra.get("reward"), extra.get("rewards", {})
        ok_parts = (
            isinstance(parts, dict)
            and len(parts) <= MAX_COMPONENTS
            and all(isinstance(k, str) and len(k) <= 128 and _finite(v) for k, v in parts.items())
        )
        if not _finite(reward) or not ok_parts:
            self.failure = ("agent_failed", f"the verifiers agent reported no finite reward: {reward!r:.80}")
            return None
        return {**report, "reward": float(reward), "rewards": {k: float(v) for k, v in parts.items()}}

    def take(self, report: dict) -> None:
        self.result = Reward(report["reward"], report["rewards"])

    def reward(self) -> Reward:
        if self.failure is not None:
            return Reward(0.0, {}, Outcome.MASK, *self.failure)
        if self.result is None:
            return Reward(0.0, {}, Outcome.MASK, "agent_not_run", "the episode closed before its step")
        return self.result


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def verifiers_env(spec: VerifiersEnvSpec) -> type[VerifiersEnv]:
    """The env class of one ``env.verifiers`` entry (its requirements installed by ``prepare``;
    relative paths against the working folder; ``ValueError`` names what is missing)."""
    limits = SandboxLimits(
        wall_seconds=spec.agent_seconds,
        cpu_seconds=spec.agent_seconds,
        memory_mb=spec.memory_mb,
        processes=256,  # threads count: verifiers' server, its clients, a tool server per task
        output_bytes=1 << 20,
    )
    attrs = {
        "name": spec.name,
        "description": f"verifiers taskset {spec.taskset}: its own rollout and rubric, through the gateway",
        "spec": spec,
        "agent_files": vfc.job_files(resolved(spec.folder, "folder", Path.cwd())),
        "agent_requirements": resolved(requirements_file(spec), "requirements", Path.cwd()),
        "agent_seconds": spec.agent_seconds,
        "agent_limits": limits,
    }
    return type(f"Verifiers_{spec.name}", (VerifiersEnv,), attrs)
