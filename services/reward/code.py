"""The ``code`` reward: a completion's Python program run against test cases in the sandbox
(``relayrl.common.sandbox``), reward the fraction of tests passed.

In: the completion (the program is its last ```python fenced block, else the whole text), the
ground truth (the tests) and the row's ``extra_info``. Out: ``ScoreResult(pass_rate,
{"format", "correctness", "pass_rate"})``: ``format`` 1 when the program came in a fenced
block, ``correctness`` 1 when every test passed (``extra_info["all_or_nothing"]``: that is the
reward). Two kinds of tests:

* **stdin/stdout**: a JSON list of ``{"input": stdin, "output": expected stdout}`` (or APPS's
  ``{"inputs": [...], "outputs": [...]}``). The program runs once per test, its stdin the
  test's input; a test passes when it exits 0 and its stdout equals the expected text (line
  ends and trailing blank lines aside). The expected text never enters the sandbox.
* **asserts**: a test script of ``assert`` lines (``assert f(2) == 4``, ``assert f(1) != 0``,
  ``assert math.isclose(g(2), 1.41, rel_tol=1e-3)``, ``assert is_prime(7)``, ``assert not
  is_prime(8)``; ``import`` lines too). Each assert is split into the call the program must
  answer (``f(2)``) and the expected value (``4``), a literal, kept out here. The harness runs
  the program, then evaluates each call and writes ``repr`` of its value; the comparison runs
  here, on ``ast.literal_eval`` of that text (never ``eval``). A value that is not a literal (an
  object whose ``__eq__`` says yes to everything) fails.

So a program cannot skip the tests nor pass them without answering them: whatever it prints, an
early ``sys.exit(0)`` or ``os._exit(0)`` leaves its answers missing (failed); reading its
input or the harness finds calls and arguments but no expected value to copy. Tests after one
that ran past its time limit are not run (failed): a program that hangs costs one limit.

A sandbox that cannot run anything (``SandboxUnavailable``) is raised on: the reward service
makes the sample an ERROR, never a reward of 0. Each scoring worker has one sandbox: started and
probed before the worker reports ready when the reward config names one (``sandbox``), else a
default one started on the worker's first ``code`` sample. A sample's tests share the reward
service's per-sample timeout (``timeout_seconds``): with the sandbox's wall limit per run, a
hanging program costs one limit; many slow tests want a longer timeout.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from relayrl.common.sandbox import RunResult, Sandbox, SandboxConfig, SandboxLimits, Verdict, probe
from relayrl.reward.result import ScoreResult

MAX_TESTS = 100
"""More tests than this in one ground truth is a malformed sample (ValueError: ERROR)."""
MAX_VALUE_CHARS = 100_000
"""A value the harness reports longer than this fails its test unparsed."""
RUN_SECONDS = 2.0
"""Wall-clock and CPU limit of one run (at most the sandbox's own); a row may set its own in
``extra_info["time_limit_seconds"]``."""
SANDBOX_WORKERS = 2
"""Programs one scoring worker runs at once (the default sandbox's workers)."""
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
_COMPARE = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
_FLIP = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE}


# ---- the program and its tests ------------------------------------------------------------------


def extract_program(completion: str) -> tuple[str, bool]:
    """(program, came in a fenced block): the last ```python (or ```py, or unlabelled) block,
    else the whole completion.

    >>> extract_program("Here:\\n```python\\nprint(1)\\n```\\nand better:\\n```py\\nprint(2)\\n```")
    ('print(2)\\n', True)
    >>> extract_program("print(3)")
    ('print(3)', False)
    """
    blocks = _FENCE.findall(completion)
    return (blocks[-1], True) if blocks else (completion, False)


@dataclass(frozen=True)
class IOTest:
    stdin: str
    expected: str


@dataclass(frozen=True)
class CallTest:
    """One assert: ``expression`` runs in the sandbox; ``check(value)`` here."""

    expression: str
    op: str
    """"truth" (the value's truth is reported), "eq", ..., or "isclose"."""
    expected: Any = None
    tolerance: tuple[float, float] = (1e-9, 0.0)


def _literal(node: ast.AST) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def parse_asserts(script: str) -> tuple[list[str], list[CallTest]]:
    """(import lines, tests) of an assert script; ValueError for any other statement or an
    assert whose expected side is not a literal.

    >>> imports, tests = parse_asserts("import math\\nassert f(2) == 4\\nassert 9 > f(3)\\nassert not p(8)")
    >>> imports, [(t.expression, t.op, t.expected) for t in tests]
    (['import math'], [('f(2)', 'Eq', 4), ('f(3)', 'Lt', 9), ('p(8)', 'truth', False)])
    """
    try:
        tree = ast.parse(script)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"code: the test script does not parse: {e}") from None
    imports, tests = [], []
    for stmt in tree.body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            imports.append(ast.unparse(stmt))
            continue
        if not isinstance(stmt, ast.Assert):
            raise ValueError(
                f"code: test scripts hold asserts and imports only, got: {ast.unparse(stmt)[:80]}"
            )
        tests.append(_assert_test(stmt.test))
    return imports, tests


def _assert_test(test: ast.expr) -> CallTest:
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and type(test.ops[0]) in _COMPARE:
        op, left, right = type(test.ops[0]), test.left, test.comparators[0]
        ok_right, value = _literal(right)
        if not ok_right:
            ok_left, value = _literal(left)
            if not ok_left:
                raise ValueError(f"code: neither side of {ast.unparse(test)[:80]!r} is a literal")
            left, op = right, _FLIP.get(op, op)
        return CallTest(ast.unparse(left), op.__name__, value)
    if (
        isinstance(test, ast.Call)
        and ast.unparse(test.func) in ("math.isclose", "isclose")
        and len(test.args) == 2
    ):
        ok, value = _literal(test.args[1])
        kw = {k.arg: _literal(k.value) for k in test.keywords}
        if not ok or any(not good for good, _ in kw.values()) or set(kw) - {"rel_tol", "abs_tol"}:
            raise ValueError(
                f"code: {ast.unparse(test)[:80]!r}: expected value and tolerances must be literals"
            )
        tol = (kw.get("rel_tol", (True, 1e-9))[1], kw.get("abs_tol", (True, 0.0))[1])
        return CallTest(ast.unparse(test.args[0]), "isclose", value, tol)
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return CallTest(ast.unparse(test.operand), "truth", False)
    return CallTest(ast.unparse(test), "truth", True)


def parse_tests(ground_truth: Any) -> tuple[list[str], list[IOTest] | list[CallTest]]:
    """The tests of a ground truth (see the module docstring); ValueError when malformed."""
    gt = ground_truth
    if isinstance(gt, dict) and isinstance(gt.get("inputs"), list) and isinstance(gt.get("outputs"), list):
        gt = [{"input": i, "output": o} for i, o in zip(gt["inputs"], gt["outputs"], strict=True)]
    if isinstance(gt, list):
        if not all(isinstance(t, dict) and isinstance(t.get("output"), str) for t in gt):
            raise ValueError('code: stdin/stdout tests are a list of {"input": str, "output": str}')
        imports, tests = [], [IOTest(str(t.get("input") or ""), t["output"]) for t in gt]
    elif isinstance(gt, str):
        imports, tests = parse_asserts(gt)
    else:
        raise ValueError(
            f"code: ground truth must be a test list or an assert script, got {type(gt).__name__}"
        )
    if not 1 <= len(tests) <= MAX_TESTS:
        raise ValueError(f"code: {len(tests)} tests; 1..{MAX_TESTS} are allowed")
    return imports, tests


def same_output(got: str, expected: str) -> bool:
    """Stdout compared as a person reads it: trailing spaces, CRLF and trailing blank lines aside.

    >>> same_output("4  \\r\\n5\\n\\n", "4\\n5"), same_output("45", "4 5")
    (True, False)
    """

    def norm(s: str) -> list[str]:
        return [line.rstrip() for line in s.replace("\r\n", "\n").rstrip().split("\n")]

    return norm(got) == norm(expected)


def passes(test: CallTest, reported: str | None) -> bool:
    """Whether the value the harness reported (``repr`` text) passes ``test``.

    >>> passes(CallTest("f(2)", "Eq", 4), "4"), passes(CallTest("f(2)", "Eq", (1, 2)), "[1, 2]")
    (True, False)
    >>> passes(CallTest("f()", "Eq", 4), "<__main__.Yes object at 0x7f>"), passes(CallTest("f()", "Eq", 4), None)
    (False, False)
    >>> passes(CallTest("g()", "isclose", 1.414, (1e-3, 0.0)), "1.4142"), passes(CallTest("p(7)", "truth", True), "True")
    (True, True)
    """
    if reported is None or len(reported) > MAX_VALUE_CHARS:
        return False
    ok, value = _literal(ast.parse(reported, mode="eval").body) if _parses(reported) else (False, None)
    if not ok:
        return False
    try:
        if test.op == "truth":
            return value is test.expected
        if test.op == "isclose":
            rel, abs_ = test.tolerance
            return isinstance(value, int | float) and math.isclose(
                value, test.expected, rel_tol=rel, abs_tol=abs_
            )
        return bool(_COMPARE[getattr(ast, test.op)](value, test.expected))
    except (TypeError, ValueError, OverflowError):  # "<" between a str and an int
        return False


def _parses(text: str) -> bool:
    try:
        ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return True


# ---- running them ---------------------------------------------------------------------------------

HARNESS = r"""
import builtins, io, json, os, sys
payload = json.loads(sys.stdin.read())
sys.stdin = io.StringIO("")
report = os.fdopen(os.dup(1), "w")
sys.stdout = sys.stderr = io.StringIO()
space = {"__name__": "solution", "__builtins__": builtins}
try:
    exec(compile(payload["program"], "solution.py", "exec"), space)
except BaseException:
    pass
for line in payload["imports"]:
    try:
        exec(line, space)
    except BaseException:
        pass
for i, (expression, truth) in enumerate(payload["tests"]):
    try:
        value = eval(expression, space)
        text = repr(bool(value) if truth else value)
    except BaseException as e:
        text = None
    sys.stdout = sys.stderr = io.StringIO()
    report.write(payload["nonce"] + " " + json.dumps([i, text]) + "\n")
    report.flush()
"""
"""Runs in the sandbox: the program (its output discarded), then each test's call; one line per
test, ``<nonce> [index, repr or null]``, on a copy of stdout made before the program ran."""

_sandbox: Sandbox | None = None
_lock = threading.Lock()


def start_sandbox(config: SandboxConfig) -> Sandbox:
    """Start this process's sandbox from ``config`` and probe it (``SandboxUnsafe`` when isolation
    is missing and the tier is ``full``): a scoring worker does it before it reports ready when
    the reward config has a ``sandbox`` section."""
    global _sandbox
    with _lock:
        _sandbox = Sandbox.from_config(config)
        probe(_sandbox)
        return _sandbox


def sandbox() -> Sandbox:
    """This process's sandbox; without ``start_sandbox``, a default one (tier ``full``) started on
    first use, unprobed (the probe takes seconds, past a sample's timeout): bubblewrap still
    isolates every run, or the run raises ``SandboxUnavailable``."""
    global _sandbox
    with _lock:
        if _sandbox is None:
            _sandbox = Sandbox.from_config(SandboxConfig(workers=SANDBOX_WORKERS))
        return _sandbox


def run_limits(sb: Sandbox, seconds: float) -> SandboxLimits:
    """The sandbox's limits with time bounded by ``seconds``."""
    own = sb.limits
    t = min(float(seconds), own.wall_seconds)
    return own.model_copy(update={"wall_seconds": t, "cpu_seconds": min(t, own.cpu_seconds)})


def run_io(sb: Sandbox, program: str, tests: list[IOTest], limits: SandboxLimits | None = None) -> list[bool]:
    """Each test a run of its own, as many at once as the sandbox has workers; after a run that timed out the
    tests not yet started are failed unrun."""
    timed_out = threading.Event()

    def one(t: IOTest) -> bool:
        if timed_out.is_set():
            return False
        r = sb.run_sync(program, stdin=t.stdin, limits=limits)
        if r.verdict == Verdict.TIMEOUT:
            timed_out.set()
        return r.verdict == Verdict.OK and r.exit_code == 0 and same_output(r.stdout, t.expected)

    with ThreadPoolExecutor(sb.workers) as pool:
        return list(pool.map(one, tests))


def run_calls(
    sb: Sandbox, program: str, imports: list[str], tests: list[CallTest], limits: SandboxLimits | None = None
) -> list[bool]:
    """One run of the harness for all tests; a test without its line in the report fails."""
    nonce = secrets.token_hex(8)
    payload = {
        "program": program,
        "imports": imports,
        "tests": [[t.expression, t.op == "truth"] for t in tests],
        "nonce": nonce,
    }
    r: RunResult = sb.run_sync(HARNESS, stdin=json.dumps(payload), limits=limits)
    reported: dict[int, str | None] = {}
    for line in r.stdout.splitlines():
        head, _, body = line.partition(" ")
        if head != nonce:
            continue
        try:
            i, text = json.loads(body)
        except (ValueError, TypeError):
            continue
        if isinstance(i, int) and (text is None or isinstance(text, str)):
            reported[i] = text
    return [passes(t, reported.get(i)) for i, t in enumerate(tests)]


def score_code(
    completion: str, ground_truth: Any, extra_info: dict, sb: Sandbox | None = None
) -> ScoreResult:
    """The reward of ``completion`` on the tests of ``ground_truth`` (module docstring)."""
    imports, tests = parse_tests(ground_truth)
    program, fenced = extract_program(completion)
    seconds = extra_info.get("time_limit_seconds", RUN_SECONDS)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 < seconds <= 600:
        raise ValueError(f"code: extra_info.time_limit_seconds must be a number in (0, 600], got {seconds!r}")
    sb = sb or sandbox()
    limits = run_limits(sb, seconds)
    if isinstance(tests[0], IOTest):
        results = run_io(sb, program, tests, limits)
    else:
        results = run_calls(sb, program, imports, tests, limits)
    rate = sum(results) / len(results)
    correct = float(all(results))
    reward = correct if extra_info.get("all_or_nothing") else rate
    return ScoreResult(reward, {"format": float(fenced), "correctness": correct, "pass_rate": rate})
