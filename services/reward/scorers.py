"""Rule-based verifiers: pure functions from a completion to a reward, chosen by data source.

In flows one sample: the completion text, its ground truth (already decoded by
:func:`decode_ground_truth`: a dict or list for JSON objects and arrays, else the string as sent)
and the row's ``extra_info`` dict. Out flows a :class:`ScoreResult`: the total reward and its named
parts, ``{"format": 0|1, "correctness": 0|1}`` for every built-in scorer.

Reward shaping per scorer (``FORMAT_SCORE`` is TinyZero's partial credit for a well-formed answer):

============ =============================== ====== ===========================================
scorer       answer read from                format correct
============ =============================== ====== ===========================================
countdown    last <answer>...</answer>        0.1    each given number once, + - * / only, = target
arithmetic   last <answer>...</answer>        0.1    numerically equal to the ground truth
reverse      last <answer>...</answer>        0.1    exactly the ground truth string
gsm8k        last ``#### n``, else <answer>   0.0    numerically equal (commas stripped)
math         last \\boxed{...}                 0.0    equivalent under math-verify
format       <think>...</think><answer>...    --     1.0 when the completion has exactly that shape
code         last ```python block, else all  0.0    fraction of the tests passed, in the sandbox
============ =============================== ====== ===========================================

Nothing here evaluates model output with ``eval``: countdown walks the ``ast`` of the equation and
accepts plain decimal integers, + - * /, unary signs and parentheses only (no ``**``:
``9**9**9**9`` would never finish), with exact rational arithmetic and caps on magnitudes and
nesting. Every scorer but ``math`` does work linear in the completion's length: extraction uses
``rfind`` or regexes without two adjacent quantifiers over the same characters (``\\s*\\$?\\s*``
backtracks quadratically on a long run of spaces). math-verify runs sympy, so its answers are
capped in length, and the service still runs every scorer in worker processes with a per-sample
timeout (``relayrl.reward.pool``) as the last line of defence.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from relayrl.reward.result import ScoreResult

FORMAT_SCORE = 0.1
"""TinyZero's reward for an answer in the right format that is wrong."""
MAX_EQUATION_CHARS = 1000
"""Countdown equations longer than this are rejected unparsed (a real one is ~30 characters)."""
MAX_MAGNITUDE = 10**18
"""Countdown: an intermediate value (numerator or denominator) beyond this rejects the equation."""
MAX_NUMBER_CHARS = 200
"""Numeric answers longer than this are not parsed (wrong, not slow)."""
MAX_EQUATION_DEPTH = 64
"""Countdown: deeper nesting (parentheses, unary signs) rejects the equation (a real one has ~3)."""
MAX_MATH_ANSWER_CHARS = 2000
"""MATH: a boxed answer longer than this is wrong unparsed (sympy on it could take minutes)."""
_EQUATION_CHARS = frozenset("0123456789+-*/() \t\n")
"""What a countdown equation may be written with: Python's other integer spellings (``0x3d``,
``0b1010001``, ``9_1``), comments and names never reach the parser."""


Scorer = Callable[[str, Any, dict], ScoreResult]
"""``scorer(completion, ground_truth, extra_info) -> ScoreResult``; plugins share this signature."""


def _result(formatted: bool, correct: bool, format_score: float) -> ScoreResult:
    reward = 1.0 if correct else (format_score if formatted else 0.0)
    return ScoreResult(reward, {"format": float(formatted), "correctness": float(correct)})


# ---- extraction -------------------------------------------------------------------------------------


def encode_ground_truth(value: Any) -> str:
    """A dataset row's ground truth as ``RewardInput.ground_truth`` text (what the client sends).

    >>> encode_ground_truth({"target": 24, "numbers": [3, 4, 6, 8]}), encode_ground_truth("04821")
    ('{"target": 24, "numbers": [3, 4, 6, 8]}', '04821')
    """
    return value if isinstance(value, str) else json.dumps(value)


def decode_ground_truth(text: str) -> Any:
    """The wire's ground truth: JSON objects and arrays decoded, anything else kept as text.

    >>> decode_ground_truth('{"target": 24, "numbers": [3, 4, 6, 8]}')
    {'target': 24, 'numbers': [3, 4, 6, 8]}
    >>> decode_ground_truth("04821"), decode_ground_truth("72"), decode_ground_truth("[oops")
    ('04821', '72', '[oops')
    """
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        try:
            return json.loads(stripped)
        except (ValueError, RecursionError):
            pass
    return text


def extract_answer(text: str) -> str | None:
    """The content of the last complete ``<answer>...</answer>``, stripped; None when there is none.

    Linear time whatever the input (``rfind``, no backtracking regex).

    >>> extract_answer("<think>3 + 4 = 7</think>\\n<answer> 3 + 4 </answer>")
    '3 + 4'
    >>> extract_answer("<answer>1</answer> then <answer>2</answer>")
    '2'
    >>> extract_answer("<answer>a<answer>b</answer>"), extract_answer("<answer>unclosed")
    ('b', None)
    """
    end = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, end) if end >= 0 else -1
    if start < 0:
        return None
    return text[start + len("<answer>") : end].strip()


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; else None.

    >>> extract_boxed(r"so x = \\boxed{\\frac{1}{2}}.")
    '\\\\frac{1}{2}'
    >>> extract_boxed(r"\\boxed{1} or \\boxed {2}"), extract_boxed(r"\\boxed{unclosed"), extract_boxed("7")
    ('2', None, None)
    """
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    if not starts:
        return None
    i = start = starts[-1]
    depth = 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":  # an escaped brace (\{) does not count
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start:i].strip()
        i += 1
    return None


def parse_number(text: str) -> Fraction | None:
    """A plain number (int, decimal, fraction ``a/b``; commas, ``$`` and a final ``.`` ignored), or None.

    >>> parse_number("1,234"), parse_number("-7"), parse_number(" $4.50. "), parse_number("3/4")
    (Fraction(1234, 1), Fraction(-7, 1), Fraction(9, 2), Fraction(3, 4))
    >>> parse_number("seven"), parse_number("1e999999999"), parse_number("")
    (None, None, None)
    """
    s = text.strip().replace(",", "").replace("$", "").strip().rstrip(".")
    if not s or len(s) > MAX_NUMBER_CHARS or not re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)(/\d+)?", s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


# ---- countdown --------------------------------------------------------------------------------------


class _BadEquation(ValueError):
    pass


def _eval_equation(equation: str, numbers: list[int]) -> Fraction:
    """Exact value of a countdown equation that uses each of ``numbers`` exactly once.

    Raises ``_BadEquation`` (not well-formed, disallowed element, wrong numbers, too big) or
    ``ZeroDivisionError``.
    """
    if len(equation) > MAX_EQUATION_CHARS:
        raise _BadEquation("equation too long")
    if bad := set(equation) - _EQUATION_CHARS:
        raise _BadEquation(f"characters {''.join(sorted(bad))!r} are not digits, + - * / or parentheses")
    try:
        tree = ast.parse(equation, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise _BadEquation(f"not an expression: {e}") from None
    used: list[int] = []

    def walk(node: ast.AST, depth: int = 0) -> Fraction:
        if depth > MAX_EQUATION_DEPTH:
            raise _BadEquation("nested too deeply")
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = walk(node.operand, depth + 1)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
            a, b = walk(node.left, depth + 1), walk(node.right, depth + 1)
            if isinstance(node.op, ast.Add):
                v = a + b
            elif isinstance(node.op, ast.Sub):
                v = a - b
            elif isinstance(node.op, ast.Mult):
                v = a * b
            else:
                v = a / b  # ZeroDivisionError propagates
            if abs(v.numerator) > MAX_MAGNITUDE or v.denominator > MAX_MAGNITUDE:
                raise _BadEquation("intermediate value too large")
            return v
        raise _BadEquation(f"{type(node).__name__} is not allowed")

    value = walk(tree.body)
    if sorted(used) != sorted(numbers):
        raise _BadEquation(f"uses {sorted(used)}, must use each of {sorted(numbers)} exactly once")
    return value


def score_countdown(completion: str, ground_truth: Any, extra_info: dict) -> ScoreResult:
    """TinyZero's countdown reward: 1.0 for a correct equation in <answer> tags, 0.1 for a wrong one
    in tags, 0 without tags. ``ground_truth`` is ``{"target": int, "numbers": [int, ...]}``.

    >>> gt = {"target": 24, "numbers": [3, 4, 6, 8]}
    >>> score_countdown("<think>...</think>\\n<answer>(8 - 6) * 3 * 4</answer>", gt, {})
    ScoreResult(reward=1.0, components={'format': 1.0, 'correctness': 1.0})
    >>> [score_countdown(f"<answer>{eq}</answer>", gt, {}).reward for eq in (
    ...     "8 * 3 + 6 - 4",     # uses every number once, but equals 26
    ...     "8 * 3",             # numbers missing
    ...     "8 * 3 * 4 / 4",     # 4 used twice, 6 missing
    ...     "8 * 3 + (6 - 4) * 0 + 6 - 6 - 4 + 4",  # extra numbers
    ...     "(8 * 3 + 6 - 4",    # unbalanced parenthesis
    ...     "3 * 4 * 6 / (8 - 8)",  # division by zero
    ...     "3 ** 4 + 6 + 8",    # no powers
    ...     "0x8 * 3 + 6 - 6",   # decimal integers only: no 0x, 0o, 0b, 1_0
    ...     "8 * 3 + 6 - 6  # comment",
    ...     "-" * 900 + "8 * 3 + 6 - 6",  # nested beyond any real equation
    ... )]
    [0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]
    >>> score_countdown("(8 - 6) * 3 * 4", gt, {}).reward  # right, but no tags
    0.0
    >>> score_countdown("<answer>24 / (1 - 3 / 4)</answer>", {"target": 96, "numbers": [24, 1, 3, 4]}, {}).reward
    1.0
    """
    if not isinstance(ground_truth, dict) or "target" not in ground_truth or "numbers" not in ground_truth:
        raise ValueError(
            f'countdown ground_truth must be {{"target": .., "numbers": [..]}}, got {ground_truth!r}'
        )
    target = Fraction(ground_truth["target"])
    numbers = [int(n) for n in ground_truth["numbers"]]
    equation = extract_answer(completion)
    if equation is None:
        return _result(False, False, FORMAT_SCORE)
    try:
        correct = _eval_equation(equation, numbers) == target
    except (_BadEquation, ZeroDivisionError):
        correct = False
    return _result(True, correct, FORMAT_SCORE)


# ---- arithmetic, reverse ------------------------------------------------------------------------------


def score_arithmetic(completion: str, ground_truth: Any, extra_info: dict) -> ScoreResult:
    """1.0 when the <answer> is numerically the ground truth, 0.1 when wrong but tagged, else 0.

    >>> score_arithmetic("<answer>42</answer>", "42", {}).reward, score_arithmetic("<answer>42.0</answer>", 42, {}).reward
    (1.0, 1.0)
    >>> score_arithmetic("<answer>41</answer>", "42", {}), score_arithmetic("42", "42", {}).reward
    (ScoreResult(reward=0.1, components={'format': 1.0, 'correctness': 0.0}), 0.0)
    """
    expected = parse_number(str(ground_truth))
    if expected is None:
        raise ValueError(f"arithmetic ground_truth must be a number, got {ground_truth!r}")
    answer = extract_answer(completion)
    if answer is None:
        return _result(False, False, FORMAT_SCORE)
    return _result(True, parse_number(answer) == expected, FORMAT_SCORE)


def score_reverse(completion: str, ground_truth: Any, extra_info: dict) -> ScoreResult:
    """1.0 when the <answer> is exactly the ground truth string, 0.1 when wrong but tagged, else 0.

    >>> trace = "<think>digits 4 8 2 1; last digit 1, then 2, then 8, then 4; so 1284</think>\\n"
    >>> score_reverse(trace + "<answer>1284</answer>", "1284", {}).reward
    1.0
    >>> score_reverse("<answer>1248</answer>", "1284", {}).reward, score_reverse("1284", "1284", {}).reward
    (0.1, 0.0)
    """
    answer = extract_answer(completion)
    if answer is None:
        return _result(False, False, FORMAT_SCORE)
    return _result(True, answer == str(ground_truth).strip(), FORMAT_SCORE)


# ---- GSM8K, MATH --------------------------------------------------------------------------------------

# Whitespace, then "$" and whitespace only after a "$": ``\s*\$?\s*`` would try every split of a
# long run of spaces between its two stars (77 s for "#### " + 100,000 spaces).
_HASHES = re.compile(r"####\s*(?:\$\s*)?(-?[0-9][0-9,]*(?:\.[0-9]+)?)")
_NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\.[0-9]+)?")


def _gsm8k_answer(text: str) -> str | None:
    """The last ``#### n``, else the last number inside the last <answer> tag."""
    hashes = _HASHES.findall(text)
    if hashes:
        return hashes[-1]
    answer = extract_answer(text)
    numbers = _NUMBER.findall(answer) if answer is not None else []
    return numbers[-1] if numbers else None


def score_gsm8k(completion: str, ground_truth: Any, extra_info: dict) -> ScoreResult:
    """GSM8K: the last ``#### n`` (or <answer> tag) equals the ground truth, commas stripped.

    The ground truth is the number, or GSM8K's whole solution ending in ``#### n``.

    >>> score_gsm8k("She pays 1200 + 34 = 1,234 dollars.\\n#### 1,234", "1234", {})
    ScoreResult(reward=1.0, components={'format': 1.0, 'correctness': 1.0})
    >>> score_gsm8k("<answer>$1,234.00</answer>", "... so 1234\\n#### 1234", {}).reward
    1.0
    >>> score_gsm8k("#### 1235", "1234", {}).reward, score_gsm8k("the answer is 1234", "1234", {}).reward
    (0.0, 0.0)
    """
    gt = str(ground_truth)
    expected = parse_number(_HASHES.findall(gt)[-1] if "####" in gt and _HASHES.search(gt) else gt)
    if expected is None:
        raise ValueError(f"gsm8k ground_truth must be a number or end in '#### n', got {ground_truth!r}")
    answer = _gsm8k_answer(completion)
    if answer is None:
        return _result(False, False, 0.0)
    return _result(True, parse_number(answer) == expected, 0.0)


def score_math(completion: str, ground_truth: Any, extra_info: dict) -> ScoreResult:
    """MATH: the last ``\\boxed{}`` of the completion is equivalent to the ground truth (math-verify).

    The ground truth is the answer in LaTeX, or a whole solution with a ``\\boxed{}`` answer.

    >>> score_math(r"Half of it: \\boxed{0.5}", r"\\frac{1}{2}", {})
    ScoreResult(reward=1.0, components={'format': 1.0, 'correctness': 1.0})
    >>> score_math(r"\\boxed{\\dfrac{\\sqrt{2}}{2}}", r"... hence $\\boxed{\\sqrt{2}/2}$.", {}).reward
    1.0
    >>> score_math(r"\\boxed{\\frac{1}{3}}", r"\\frac{1}{2}", {}).reward, score_math("0.5", r"\\frac{1}{2}", {}).reward
    (0.0, 0.0)
    """
    from math_verify import parse, verify  # sympy behind it: imported where scoring runs

    gt = str(ground_truth)
    gold_text = extract_boxed(gt) if "\\boxed" in gt or "\\fbox" in gt else gt.strip()
    if not gold_text:
        raise ValueError(f"math ground_truth has no answer: {ground_truth!r}")
    gold = parse("\\boxed{" + gold_text + "}")
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {gold_text!r}")
    answer = extract_boxed(completion)
    if answer is None:
        return _result(False, False, 0.0)
    if len(answer) > MAX_MATH_ANSWER_CHARS:
        return _result(True, False, 0.0)
    parsed = parse("\\boxed{" + answer + "}") if answer else []
    return _result(True, bool(parsed) and bool(verify(gold, parsed)), 0.0)


# ---- format -------------------------------------------------------------------------------------------

_THINK_ANSWER = re.compile(
    r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)*</answer>\s*", re.DOTALL
)


def score_format(completion: str, ground_truth: Any, extra_info: dict) -> ScoreResult:
    """1.0 when the completion is one ``<think>...</think>`` then one ``<answer>...</answer>``, else 0.

    Ignores the ground truth (R1-Zero's format reward; combine it with a correctness scorer in a
    plugin when both are wanted).

    >>> score_format("<think>7 * 6</think>\\n<answer>42</answer>", "", {})
    ScoreResult(reward=1.0, components={'format': 1.0})
    >>> [score_format(c, "", {}).reward for c in (
    ...     "<answer>42</answer>", "<think>a</think><answer>1</answer> extra", "<think><think>a</think><answer>1</answer>")]
    [0.0, 0.0, 0.0]
    """
    ok = _THINK_ANSWER.fullmatch(completion) is not None
    return ScoreResult(float(ok), {"format": float(ok)})


# ---- code ---------------------------------------------------------------------------------------------


def score_code(completion: str, ground_truth: Any, extra_info: dict) -> ScoreResult:
    """A Python program (the completion's last ```python block) run against the ground truth's
    tests in the sandbox: the fraction passed (``relayrl.reward.code``). A sandbox that cannot run
    raises: the sample is an ERROR, never a reward of 0."""
    from relayrl.reward.code import score_code as run  # the sandbox: imported where scoring runs

    return run(completion, ground_truth, extra_info)


# ---- registry -----------------------------------------------------------------------------------------

SCORERS: dict[str, Scorer] = {
    "countdown": score_countdown,
    "arithmetic": score_arithmetic,
    "reverse": score_reverse,
    "gsm8k": score_gsm8k,
    "openai/gsm8k": score_gsm8k,
    "math": score_math,
    "lighteval/MATH": score_math,
    "DigitalLearningGmbH/MATH-lighteval": score_math,
    "format": score_format,
    "code": score_code,
}
"""Built-in scorers by ``data_source`` (the dataset row's field)."""


def check_result(value: Any) -> ScoreResult:
    """A scorer's return value as a valid :class:`ScoreResult`, or ``TypeError``/``ValueError``.

    Accepted: a ScoreResult (or any object with ``reward`` and ``components``), a dict with
    ``reward`` and optional ``components``, or a bare real number. Rewards and components must be
    finite; component names strings.

    >>> check_result(0.5), check_result({"reward": 1, "components": {"format": 1}})
    (ScoreResult(reward=0.5, components={}), ScoreResult(reward=1.0, components={'format': 1.0}))
    >>> check_result(float("nan"))
    Traceback (most recent call last):
    ...
    ValueError: reward must be finite, got nan
    >>> check_result("1.0")
    Traceback (most recent call last):
    ...
    TypeError: a scorer must return a number, a dict or a ScoreResult, got str
    """
    if isinstance(value, dict):
        reward, components = value.get("reward"), value.get("components") or {}
    elif hasattr(value, "reward") and hasattr(value, "components"):
        reward, components = value.reward, value.components or {}
    elif _is_real(value):
        reward, components = value, {}
    else:
        raise TypeError(f"a scorer must return a number, a dict or a ScoreResult, got {type(value).__name__}")
    if not _is_real(reward):
        raise TypeError(f"reward must be a number, got {type(reward).__name__}")
    if not math.isfinite(float(reward)):
        raise ValueError(f"reward must be finite, got {float(reward)}")
    if not isinstance(components, dict):
        raise TypeError(f"components must be a dict, got {type(components).__name__}")
    out: dict[str, float] = {}
    for k, v in components.items():
        if not isinstance(k, str) or not _is_real(v) or not math.isfinite(float(v)):
            raise ValueError(f"component {k!r} must map a name to a finite number, got {v!r}")
        out[k] = float(v)
    return ScoreResult(float(reward), out)


def _is_real(x: Any) -> bool:
    import numbers

    return isinstance(x, numbers.Real) and not isinstance(x, bool)
