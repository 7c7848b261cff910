"""verifiers environments (Prime Intellect's ``verifiers`` 0.4, ``verifiers.v1``) as relayrl runs
them, shared by the env service (each rollout: ``relayrl.env.verifiers``) and the coordinator (a
run's data listed from a taskset): the program that runs inside (``agent.py``), relayrl's harness
for tasksets that bring none (``relayrl_vf_chat.py``), and the listing of a taskset's tasks.

verifiers pins ``openai < 3`` and cannot share the services' environment: it runs under the
sandbox's interpreter with its requirements installed for it (``relayrl.common.sandbox.packages``).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
AGENT = HERE / "agent.py"
"""Run in each rollout's job (as its ``agent.py``), and on the host to list a taskset's tasks."""
CHAT_HARNESS = HERE / "relayrl_vf_chat.py"
"""relayrl's verifiers harness (its module name is its harness id), beside the agent."""
DEFAULT_REQUIREMENTS = HERE / "requirements.txt"
"""``verifiers==0.4.0`` alone: a taskset in a folder of modules that needs nothing more."""
DATA_PREFIX = "verifiers/"
"""``data.generate.task: verifiers/<name>``: rows from the tasks of ``env.verifiers``'s ``name``."""
LIST_SECONDS = 600.0
"""Longest the listing of a taskset's tasks may take (after its requirements installed)."""
_LISTER = """
import runpy, site, sys
site.addsitedir(sys.argv[1])
sys.path.insert(0, sys.argv[2])
sys.argv = [sys.argv[2] + "/agent.py"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


MAX_FOLDER_MODULES = 64
"""Most modules a taskset's folder may hand each job."""


def job_files(folder: str) -> dict[str, str]:
    """Files beside the agent in a job (name -> host path): relayrl's chat harness, then the
    modules of the taskset's ``folder`` (empty: none)."""
    files = {CHAT_HARNESS.name: str(CHAT_HARNESS)}
    if folder:
        modules = sorted(Path(folder).glob("*.py"))
        if len(modules) > MAX_FOLDER_MODULES:
            raise ValueError(f"a verifiers folder holds at most {MAX_FOLDER_MODULES} modules: {folder}")
        files.update({p.name: str(p) for p in modules})
    return files


def env_data(taskset: str, taskset_args: Mapping[str, Any], harness: str, max_turns: int) -> dict[str, Any]:
    """verifiers' EnvConfig data (``agent.py`` adds the runtime, and its harness when none).

    >>> env_data("calc_vf", {}, "", 3)
    {'taskset': {'id': 'calc_vf'}, 'agent': {'max_turns': 3}}
    """
    agent: dict[str, Any] = {"max_turns": max_turns}
    if harness:
        agent["harness"] = {"id": harness}
    return {"taskset": {**taskset_args, "id": taskset}, "agent": agent}


def list_tasks(
    env: Mapping[str, Any],
    files: Mapping[str, str],
    requirements: str,
    n: int,
    python: str,
    packages_root: Path | None,
    timeout: float,
) -> list[dict]:
    """The taskset's first ``n`` tasks, ``[{"index", "id", "prompt"}]``: ``agent.py`` run once on
    this host under ``python`` (the sandbox's interpreter; not sandboxed: a taskset's ``load`` is
    its author's code, as a plugin's is), ``requirements`` installed for it as a replica installs
    them, ``files`` (name -> host path) beside it. ValueError saying why when it cannot."""
    from relayrl.common.sandbox.packages import install

    site = install(requirements, python, packages_root, timeout)
    with tempfile.TemporaryDirectory(prefix="relayrl-vf-") as tmp:
        for name, path in files.items():
            shutil.copy(path, Path(tmp) / name)
        shutil.copy(AGENT, Path(tmp) / "agent.py")
        out = subprocess.run(
            [python, "-I", "-S", "-B", "-c", _LISTER, str(site), tmp],
            input=json.dumps({"env": dict(env), "list": n}),
            capture_output=True,
            text=True,
            timeout=LIST_SECONDS,
            env={
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "HOME": tmp,
                "RELAYRL_AGENT_PACKAGES": str(site),
            },
            cwd=tmp,
        )
    taskset = env.get("taskset", {}).get("id", "")
    if out.returncode != 0:
        raise ValueError(
            f"verifiers taskset {taskset!r}: listing its tasks failed: {out.stderr.strip()[-1500:]}"
        )
    tasks = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if not tasks:
        raise ValueError(f"verifiers taskset {taskset!r} holds no task")
    return tasks


def task_rows(tasks: list[dict], name: str, n: int, seed: int, split: str, n_test: int) -> list[dict]:
    """Rows of ``split`` from the listed tasks: a seeded shuffle, the first ``n_test`` held out
    for "test", the rest for "train"; each row its task's prompt, ``task_index`` and ``task_id``.

    >>> ts = [{"index": i, "id": f"t{i}", "prompt": [{"role": "user", "content": str(i)}]} for i in range(5)]
    >>> test = task_rows(ts, "x", 2, 0, "test", 2); train = task_rows(ts, "x", 9, 0, "train", 2)
    >>> sorted(r["task_index"] for r in test + train), len(train)
    ([0, 1, 2, 3, 4], 3)
    >>> test[0]["data_source"]
    'verifiers/x'
    """
    order = list(tasks)
    random.Random(seed).shuffle(order)
    picked = order[:n_test] if split == "test" else order[n_test:]
    return [
        {
            "data_source": f"{DATA_PREFIX}{name}",
            "prompt": t["prompt"],
            "reward_model": {"style": "env", "ground_truth": ""},  # the env's rubric scores it
            "task_index": t["index"],
            "task_id": t["id"],
        }
        for t in picked[:n]
    ]
