"""Integer expressions for the task generators: evaluation with worked steps, random trees.

Pure and stdlib only. ``expression_steps`` evaluates with ``ast`` (never ``eval``) and records one
``"a op b = c"`` per operation, for worked examples and countdown references; ``random_tree``
builds countdown's hidden solutions; ``reverse_trace`` is the reverse task's worked completion.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

_OPS: dict[type, tuple[str, Callable[[Fraction, Fraction], Fraction]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
}


def _fmt(x: Fraction) -> str:
    return str(x.numerator) if x.denominator == 1 else f"{x.numerator}/{x.denominator}"


def expression_steps(expr: str) -> tuple[Fraction, list[str]]:
    """Evaluate an integer + - * / expression with ``ast`` (never ``eval``), recording each step.

    Steps come in evaluation order, one ``"a op b = c"`` per binary operation.

    >>> value, steps = expression_steps("(19 + 36) * 7 / 5")
    >>> value, steps
    (Fraction(77, 1), ['19 + 36 = 55', '55 * 7 = 385', '385 / 5 = 77'])
    >>> expression_steps("2 ** 3")
    Traceback (most recent call last):
    ...
    ValueError: unsupported expression element: BinOp with Pow
    """
    steps: list[str] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            sym, fn = _OPS[type(node.op)]
            if sym == "/" and right == 0:
                raise ValueError("division by zero")
            out = fn(left, right)
            steps.append(f"{_fmt(left)} {sym} {_fmt(right)} = {_fmt(out)}")
            return out
        detail = f" with {type(node.op).__name__}" if isinstance(node, ast.BinOp) else ""
        raise ValueError(f"unsupported expression element: {type(node).__name__}{detail}")

    return walk(ast.parse(expr, mode="eval").body), steps


def reverse_trace(digits: str) -> str:
    """The step-by-step reference completion for reversing ``digits``.

    Regular on purpose so a tiny model can learn it: copy the digits one by one (a byte-level
    BPE merges digit runs; spaced digits are one token each), read them back from the last one,
    state the result, then answer. For 8-12 digits this is about 55-90 tokens under a small
    byte-level BPE, so generation carries real weight.

    >>> reverse_trace("4821")
    '<think>digits 4 8 2 1; last digit 1, then 2, then 8, then 4; so 1284</think>\\n<answer>1284</answer>'
    >>> reverse_trace("7")
    '<think>digits 7; last digit 7; so 7</think>\\n<answer>7</answer>'
    """
    rev = digits[::-1]
    return f"<think>digits {' '.join(digits)}; last digit {', then '.join(rev)}; so {rev}</think>\n<answer>{rev}</answer>"


_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


@dataclass(frozen=True)
class _Node:
    """An expression tree node: a number (``op`` empty) or ``left op right``."""

    value: int
    op: str = ""
    left: _Node | None = None
    right: _Node | None = None

    def render(self) -> str:
        if not self.op:
            return str(self.value)
        assert self.left is not None and self.right is not None
        lhs, rhs = self.left.render(), self.right.render()
        p = _PREC[self.op]
        if self.left.op and _PREC[self.left.op] < p:
            lhs = f"({lhs})"
        # Right operand of - and / needs parentheses at equal precedence: a - (b - c) != a - b - c.
        if self.right.op and (_PREC[self.right.op] < p or (_PREC[self.right.op] == p and self.op in "-/")):
            rhs = f"({rhs})"
        return f"{lhs} {self.op} {rhs}"


def random_tree(rng: random.Random, numbers: list[int]) -> _Node:
    """Combine random pairs until one node is left; every intermediate stays a positive integer."""
    nodes = [_Node(n) for n in numbers]
    while len(nodes) > 1:
        i, j = rng.sample(range(len(nodes)), 2)
        a, b = nodes[i], nodes[j]
        ops = ["+", "*"]
        if a.value > b.value:
            ops.append("-")
        if a.value % b.value == 0:
            ops.append("/")
        op = rng.choice(ops)
        node = _Node(_APPLY[op](a.value, b.value), op, a, b)  # "/" is exact: checked just above
        nodes = [n for k, n in enumerate(nodes) if k not in (i, j)] + [node]
    return nodes[0]
