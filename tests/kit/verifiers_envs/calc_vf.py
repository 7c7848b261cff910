"""A verifiers (0.4) environment with a tool: what is 12 * 34, with a ``calc`` tool served by the
task's MCP tool server (verifiers starts it as ``python -m calc_vf``), scored by a reward of its
own. Played by relayrl's chat harness in the tests, through the gateway."""

import ast
import operator
import re

import verifiers.v1 as vf

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _eval(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return OPS[type(node.op)](_eval(node.left), _eval(node.right))
    raise ValueError("only + - * of integers")


class CalcTools(vf.Toolset[vf.ToolsetConfig, vf.State]):
    TOOL_PREFIX = None

    @vf.tool
    async def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression (integers, + - *)."""
        return str(_eval(ast.parse(expression, mode="eval").body))


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [CalcTools(vf.ToolsetConfig())]

    @vf.reward
    async def right_number(self, task: CalcData, trace: vf.Trace) -> float:
        return 1.0 if task.answer in re.findall(r"\d+", trace.last_reply or "") else 0.0


class CalcTaskset(vf.Taskset[CalcTask, vf.TasksetConfig]):
    def load(self):
        yield CalcTask(
            CalcData(id="calc-0", prompt="What is 12 * 34? Use the calc tool.", answer="408"),
            self.config.task,
        )


__all__ = ["CalcTaskset"]

if __name__ == "__main__":
    CalcTools.run()
