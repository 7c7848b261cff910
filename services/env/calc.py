"""Built-in env ``calc``: arithmetic questions with a calculator tool.

Task rows: ``{"prompt": [{"role": "user", "content": "What is 123 * 456?"}], "reward_model":
{"ground_truth": "56088"}, "data_source": "calc", ...}``. Reset gives a short system message
(the tool is there) and the row's prompt. A turn with tool calls gets one "tool" message per
call (the result, or "error: ..."); a turn without calls is the final answer and ends the
episode, as does the 4th turn. Reward at Close: 1.0 when the last number in the final answer
equals the ground truth, else 0.0 (no final answer, or one cut at its token budget, is 0.0);
components ``correctness``, ``tool_calls``, ``turns``.

The tool never runs ``eval``: ``evaluate`` (``arith.py``, with ``format_number`` and
``last_number``; re-exported here) walks the ``ast`` of the expression and allows only numbers,
``+ - * / // % **``, unary minus and plus, and parentheses, with bounded size.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from relayrl.env import arith
from relayrl.env.arith import MAX_EXPRESSION_CHARS, evaluate, format_number, last_number
from relayrl.env.base import Reward, TaskError, ground_truth, prompt_messages
from relayrl.env.tools import ToolEnv, tool

__all__ = ["MAX_EXPRESSION_CHARS", "CalcEnv", "CalcTask", "evaluate", "format_number", "last_number"]


class CalcTask:
    """The calc task's side of an env (a mixin before ``ToolEnv``): the row's question after a
    system message ``SYSTEM``, and the reward of the final answer. ``CalcEnv`` and ``PyExecEnv``
    (``pyexec.py``) share it and differ only in their tool."""

    SYSTEM = ""

    def reset(self, task: dict, seed: int) -> list[dict]:
        try:
            self.answer_key = Decimal(str(ground_truth(task)).strip().replace(",", ""))
        except InvalidOperation:
            raise TaskError(f"{self.name}: ground_truth {ground_truth(task)!r:.60} is not a number") from None
        return [{"role": "system", "content": self.SYSTEM}, *prompt_messages(task)]

    def reward(self) -> Reward:
        t = self.transcript
        given = last_number(t.final_text) if t.final_text is not None else None
        correct = float(given is not None and given == self.answer_key)
        return Reward(
            correct, {"correctness": correct, "tool_calls": float(t.tool_calls), "turns": float(t.turns)}
        )


class CalcEnv(CalcTask, ToolEnv):
    name = "calc"
    description = "Arithmetic questions with a calc(expression) tool; reward 1 for the right final number."
    max_turns = 4
    agent_kit = {"arith.py": arith.__file__}
    SYSTEM = (
        "You can call the calc tool to evaluate an arithmetic expression. "
        "When you know the answer, reply with the number."
    )

    @tool
    def calc(self, expression: str) -> str:
        """Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.

        Args:
            expression: the expression, e.g. "123 * 456"
        """
        return format_number(evaluate(expression))
