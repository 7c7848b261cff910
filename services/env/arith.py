"""Arithmetic for the calc task, standard library only: ``evaluate`` (an expression, never
``eval``), ``format_number`` (how a result is written) and ``last_number`` (the number an answer
ends on).

Imports nothing of relayrl on purpose: the ``calc-harness`` env copies this file into the sandbox,
where a scripted agent (``agents/calc_agent.py``) imports it under Debian's own python3 to answer
its calc calls exactly as ``CalcEnv``'s tool does. ``relayrl.env.calc`` imports it from here.

``evaluate`` walks the ``ast`` of the expression and allows only numbers, ``+ - * / // % **``,
unary minus and plus, and parentheses, with bounded size.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from decimal import Decimal

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 100
MAX_EXPONENT = 100
MAX_MAGNITUDE = 10**100
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_NAMES = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes"}


def _bounded(x: int | float) -> int | float:
    if isinstance(x, float) and not math.isfinite(x):
        raise ValueError("the result is not a finite number")
    if abs(x) > MAX_MAGNITUDE:
        raise ValueError("a number is too large (at most 1e100)")
    return x


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise ValueError(f"only numbers are allowed, got {node.value!r:.40}")
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            if abs(b) > MAX_EXPONENT:
                raise ValueError(f"exponent {b} is too large (at most {MAX_EXPONENT})")
            if a == 0 and b < 0:
                raise ValueError("division by zero")
            if isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b * math.log10(abs(a)) > 100:
                raise ValueError("a number is too large (at most 1e100)")
        elif isinstance(node.op, ast.Div | ast.FloorDiv | ast.Mod) and b == 0:
            raise ValueError("division by zero")
        try:
            value = _BINARY[type(node.op)](a, b)
        except OverflowError:
            raise ValueError("a number is too large (at most 1e100)") from None
        if isinstance(value, complex):
            raise ValueError("the result is not a real number")
        return _bounded(value)
    what = next((v for k, v in _NAMES.items() if isinstance(node, k)), type(node).__name__)
    raise ValueError(f"{what} are not allowed: only numbers, + - * / // % **, and parentheses")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ValueError for anything else.

    >>> evaluate("123 * 456"), evaluate("-(2 + 3) ** 2 % 7"), evaluate("7 / 2"), evaluate("7 // 2")
    (56088, 3, 3.5, 3)
    >>> evaluate("__import__('os')")
    Traceback (most recent call last):
    ...
    ValueError: function calls are not allowed: only numbers, + - * / // % **, and parentheses
    >>> evaluate("9 ** 9 ** 9")
    Traceback (most recent call last):
    ...
    ValueError: exponent 387420489 is too large (at most 100)
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression is empty")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an arithmetic expression: {getattr(e, 'msg', None) or e}") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise ValueError(f"expression has more than {MAX_NODES} parts")
    try:
        return _eval(tree.body)
    except RecursionError:
        raise ValueError("expression is nested too deeply") from None


def format_number(x: int | float) -> str:
    """How the tool writes a result: integers without a fraction, floats to 12 digits.

    >>> format_number(56088), format_number(5.0), format_number(1 / 3)
    ('56088', '5', '0.333333333333')
    """
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return str(x) if isinstance(x, int) else format(x, ".12g")


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def last_number(text: str) -> Decimal | None:
    """The last number written in ``text`` (thousands separators allowed), or None.

    >>> last_number("so 123 * 456 = 56,088."), last_number("no digits")
    (Decimal('56088'), None)
    """
    found = _NUMBER.findall(_THOUSANDS.sub("", text))
    return Decimal(found[-1]) if found else None
