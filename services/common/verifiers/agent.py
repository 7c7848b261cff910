"""One rollout of a verifiers environment (Prime Intellect's ``verifiers`` 0.4, ``verifiers.v1``),
run by the harness env ``relayrl.env.verifiers`` in its sandbox job: the environment's own
harness plays the task, its model calls go through the gateway (``OPENAI_BASE_URL``, and
``OPENAI_API_KEY``: the episode's session, so one session per rollout), and the environment's own
rubric scores it.

stdin: ``{"env": <verifiers EnvConfig data>, "task": {"index": i} | {"id": s}, "model": m}``;
``env`` names the taskset (``{"taskset": {"id": ...}, "agent": {...}}``); the agent's runtime is
this process's (``subprocess``: the sandbox is the box). The last stdout line is the harness
report, ``{"final", "turns", "tool_calls", "truncated"}``, with ``reward``, ``rewards`` (each
reward function's score) and ``ok``; a rollout verifiers ends with errors exits 2, saying why on
stderr (no reward: the episode is masked, not scored 0).

With ``"list": N`` in stdin it prints the taskset's first N tasks instead, one JSON line each: ``{"index", "id",
"prompt"}`` (the prompt as chat messages): what ``relayrl.common.verifiers.list_tasks`` reads to
write a run's data. Standard library and verifiers only: nothing of relayrl is importable here.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

DEFAULT_HARNESS = "relayrl_vf_chat"
"""The harness of a taskset that brings none (verifiers' own default, ``bash``, installs uv from
the internet at its first run: a sandbox has none)."""


def _env_config(data: dict):
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import default_harness_id

    data = json.loads(json.dumps(data))
    agent = data.setdefault("agent", {})
    agent["runtime"] = {"type": "subprocess"}
    taskset_id = data.get("taskset", {}).get("id", "")
    if not agent.get("harness") and default_harness_id(taskset_id) == "bash":
        agent["harness"] = {"id": DEFAULT_HARNESS}
    return vf.resolve_env_config(data)


def _messages(task) -> list[dict]:
    """The task's first messages as chat messages (its system prompt, then its prompt)."""
    data = task.data
    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    prompt = data.prompt
    if isinstance(prompt, str):
        return [*out, {"role": "user", "content": prompt}]
    for m in prompt or []:
        m = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        content = m.get("content")
        out.append(
            {
                "role": m.get("role", "user"),
                "content": content if isinstance(content, str) else json.dumps(content),
            }
        )
    return out


def _tasks(config, limit: int | None = None):
    from verifiers.v1.utils.loaders import load_taskset

    for i, task in enumerate(load_taskset(config.taskset)):
        if limit is not None and i >= limit:
            return
        yield i, task


def list_tasks(spec: dict, n: int) -> None:
    for i, task in _tasks(_env_config(spec["env"]), n):
        print(json.dumps({"index": i, "id": str(task.data.id or i), "prompt": _messages(task)}), flush=True)


def _pick(config, want: dict):
    for i, task in _tasks(config):
        if ("index" in want and want["index"] == i) or ("id" in want and str(task.data.id) == want["id"]):
            return task
    raise SystemExit(f"verifiers taskset {config.taskset.id!r} has no task {want}")


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


async def rollout(spec: dict) -> dict:
    import verifiers.v1 as vf

    config = _env_config(spec["env"])
    task = _pick(config, spec["task"])
    env = vf.load_environment(config)
    # verifiers reads the key from the variable the client config names, when the rollout opens
    client = vf.EvalClientConfig(base_url=os.environ["OPENAI_BASE_URL"], api_key_var="OPENAI_API_KEY")
    ctx = vf.ModelContext(model=spec["model"], client=client, sampling=vf.SamplingConfig())
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    trace = episode.traces[0]
    if not episode.ok or not trace.ok:
        errors = [getattr(e, "message", str(e)) for e in [*episode.errors, *trace.errors]]
        print(f"the verifiers rollout failed: {errors}"[:4000], file=sys.stderr, flush=True)
        raise SystemExit(2)
    replies = [m for m in trace.messages if m.role == "assistant"]
    calls = sum(len(getattr(m, "tool_calls", None) or []) for m in replies)
    return {
        "final": _text(replies[-1].content) if replies else None,
        "turns": trace.num_turns,
        "tool_calls": calls,
        "truncated": str(trace.stop_condition) == "max_turns",  # the policy used up its calls
        "stop": str(trace.stop_condition or ""),
        "reward": float(trace.reward),
        "rewards": {k: float(v.score) for k, v in trace.rewards.items()},
        "ok": True,
    }


def main() -> None:
    # What verifiers starts (a task's MCP tool servers, ``python -m <module>``) imports the agent's
    # modules and packages as this process does: from its folder, then its installed requirements.
    here = os.path.dirname(os.path.abspath(sys.argv[0] or __file__))
    packages = os.environ.get("RELAYRL_AGENT_PACKAGES", "")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, packages) if p)
    spec = json.loads(sys.stdin.read())
    if "list" in spec:
        list_tasks(spec, int(spec["list"]))
        return
    report = asyncio.run(rollout(spec))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
