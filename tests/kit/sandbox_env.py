"""An env plugin that needs the sandbox, for tests of the env service's sandbox start-up:
``tests.kit.sandbox_env:SandboxedEnv``. Its reset runs the task's ``code`` in the replica's
sandbox and shows the output as the first user message."""

from __future__ import annotations

from relayrl.env.base import Action, Env, Reward, StepAnswer


class SandboxedEnv(Env):
    name = "test/sandboxed"
    description = "runs the task's code in the sandbox at reset"
    needs_sandbox = True
    max_turns = 1

    def reset(self, task: dict, seed: int) -> list[dict]:
        result = self.sandbox.run_sync(task.get("code", "print('hi')"))
        if result.verdict != "ok":
            return [{"role": "user", "content": f"{result}"}]
        return [{"role": "user", "content": f"{result.verdict}: {result.stdout}"}]

    def step(self, action: Action) -> StepAnswer:
        return [], True, []

    def reward(self) -> Reward:
        return Reward(0.0)
