"""The ``code`` reward: programs run against tests in the real sandbox, scored as a person would.

A small set of right and wrong programs for each kind of test (stdin/stdout, asserts), with the
ways a program may try to pass without answering: exit early with success (``sys.exit(0)``,
``os._exit(0)``), read the tests (its /tmp, its stdin, the harness's memory), forge the
harness's report, return an object equal to everything, or hang. Then: a sandbox that cannot
run is an ERROR of the reward service's worker, never a reward of 0.
"""

from __future__ import annotations

import time

import pytest
from relayrl.common.sandbox import Sandbox, SandboxConfig, SandboxUnavailable
from relayrl.reward.code import parse_tests, score_code
from relayrl.reward.scorers import encode_ground_truth
from relayrl.reward.worker import ERROR, score_one


@pytest.fixture(scope="module")
def sb():
    return Sandbox.from_config(SandboxConfig(workers=2))


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code.strip()}\n```\nIt reads the input and prints the sum."


IO_TESTS = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "10 -4\n", "output": "6\n"},
    {"input": "0 0\n", "output": "0\n"},
    {"input": "123456789 987654321\n", "output": "1111111110\n"},
]
IO_CASES = {
    # name: (completion, reward a person gives)
    "right": (fenced("a, b = map(int, input().split())\nprint(a + b)"), 1.0),
    "right, unfenced, trailing spaces": (
        "import sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b, ' ')",
        1.0,
    ),
    "multiplies": (fenced("a, b = map(int, input().split())\nprint(a * b)"), 0.25),  # 0 * 0 == 0 + 0
    "prints 3 whatever": (fenced("print(3)"), 0.25),
    "exits early with success": (
        fenced("import sys\nsys.exit(0)\na, b = map(int, input().split())\nprint(a + b)"),
        0.0,
    ),
    "os._exit(0)": (fenced("import os\nos._exit(0)"), 0.0),
    "says it passed": (fenced("print('All tests passed!')\nprint('OK')"), 0.0),
    "looks for the tests": (
        fenced(
            "import os, sys\n"
            "seen = [os.listdir(d) for d in ('/tmp', '.', '/')]\n"
            "for p in ('/proc/1/cmdline', '/proc/self/environ', '/etc/shadow', '../tests.json'):\n"
            "    try:\n        print(open(p).read())\n    except Exception as e:\n        print(e)\n"
            "print(seen, sys.stdin.read())"
        ),
        0.0,
    ),
    "right, then crashes": (
        fenced("a, b = map(int, input().split())\nprint(a + b)\nraise SystemExit(1)"),
        0.0,
    ),
    "syntax error": (fenced("a, b = map(int input().split())\nprint(a + b)"), 0.0),
    "hangs": (fenced("while True:\n    pass"), 0.0),
}


@pytest.mark.parametrize("name", IO_CASES)
def test_stdin_stdout_tests_are_scored_as_a_person_would(sb, name):
    completion, want = IO_CASES[name]
    t0 = time.monotonic()
    r = score_code(completion, IO_TESTS, {"time_limit_seconds": 1.0}, sb=sb)
    assert r.reward == pytest.approx(want), (name, r)
    assert r.components["correctness"] == float(want == 1.0)
    assert r.components["format"] == float("```" in completion)
    assert time.monotonic() - t0 < 12, name  # a hanging program costs a limit, not one per test


ASSERTS = "import math\nassert add(1, 2) == 3\nassert add(-1, 1) == 0\nassert 15 == add(10, 5)\nassert add(2, 2) == 4"
CALL_CASES = {
    "right": (fenced("def add(a, b):\n    return a + b"), 1.0),
    "right, with a main that reads stdin": (
        fenced(
            "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(*map(int, input().split())))"
        ),
        1.0,
    ),
    "off by one": (fenced("def add(a, b):\n    return a + b + 1"), 0.0),
    "fails one": (
        fenced("def add(a, b):\n    if a == 10:\n        raise ValueError\n    return a + b"),
        0.75,
    ),
    "equal to everything": (
        fenced(
            "class Yes:\n    def __eq__(self, other):\n        return True\n    __ne__ = lambda s, o: False\n\ndef add(a, b):\n    return Yes()"
        ),
        0.0,
    ),
    "exits early with success": (fenced("import sys\nsys.exit(0)\ndef add(a, b):\n    return a + b"), 0.0),
    "os._exit(0) when called": (fenced("import os\ndef add(a, b):\n    os._exit(0)"), 0.0),
    "os._exit(0) at the top": (fenced("import os\nos._exit(0)"), 0.0),
    "forges the harness's report": (
        fenced(
            "import sys, os, json\n"
            "h = sys.modules['__main__']\n"
            "p = getattr(h, 'payload', {})\n"
            "for i in range(len(p.get('tests', [0] * 4))):\n"
            "    os.write(1, (p.get('nonce', '') + ' ' + json.dumps([i, 'True']) + '\\n').encode())\n"
            "os._exit(0)"
        ),
        0.0,
    ),
    "reads the tests and answers from them": (
        fenced(
            "import sys, os, re\n"
            "seen = repr(vars(sys.modules['__main__'])) + repr(os.listdir('/tmp'))\n"
            "expected = [int(x) for x in re.findall(r'== (-?\\d+)', seen)]\n"
            "calls = iter(expected)\n"
            "def add(a, b):\n    return next(calls, None)"
        ),
        0.0,
    ),
    "patches repr": (
        fenced("import builtins\nbuiltins.repr = lambda v: 'True'\ndef add(a, b):\n    return 0"),
        0.0,
    ),
    "hangs": (fenced("def add(a, b):\n    while True:\n        pass"), 0.0),
}


@pytest.mark.parametrize("name", CALL_CASES)
def test_assert_tests_are_scored_as_a_person_would(sb, name):
    completion, want = CALL_CASES[name]
    r = score_code(completion, ASSERTS, {"time_limit_seconds": 1.0}, sb=sb)
    assert r.reward == pytest.approx(want), (name, r)


def test_isclose_truth_and_all_or_nothing(sb):
    tests = "assert math.isclose(root2(), 1.4142, rel_tol=1e-3)\nassert is_even(4)\nassert not is_even(7)\nassert half(None) is None"
    right = "import math\nroot2 = lambda: math.sqrt(2)\nis_even = lambda n: n % 2 == 0\nhalf = lambda x: None if x is None else x / 2"
    assert score_code(right, tests, {}, sb=sb).reward == 1.0
    r = score_code(right.replace("n % 2 == 0", "True"), tests, {"all_or_nothing": True}, sb=sb)
    assert (r.reward, r.components["pass_rate"]) == (0.0, 0.75)


def test_the_expected_values_never_enter_the_sandbox():
    """What the harness gets: the calls, never the literals they are compared with."""
    _, tests = parse_tests("assert add(1, 2) == 3\nassert 15 == add(10, 5)\nassert math.isclose(f(), 2.5)")
    assert [t.expression for t in tests] == ["add(1, 2)", "add(10, 5)", "f()"]


@pytest.mark.parametrize(
    "truth",
    [
        "assert add(1, 2) == x",  # expected side not a literal
        "x = 3\nassert add(1, 2) == x",  # other statements
        "assert (",
        [],
        [{"input": "1"}],
        42,
    ],
)
def test_malformed_tests_are_an_error_not_a_zero(truth):
    status, reward, _, error = score_one(
        {"code": score_code}, ["code", "print(1)", encode_ground_truth(truth), {}, ""]
    )
    assert (status, reward) == (ERROR, 0.0) and error.startswith("ValueError: code:")


class Down:
    """A sandbox that cannot start anything."""

    workers = 1
    limits = SandboxConfig().limits

    def run_sync(self, *args, **kwargs):
        raise SandboxUnavailable("bwrap: No permissions to create a new namespace")


def test_a_sandbox_that_cannot_run_is_an_error_never_a_score():
    registry = {"code": lambda c, gt, info: score_code(c, gt, info, sb=Down())}
    for truth in (IO_TESTS, ASSERTS):
        status, reward, components, error = score_one(
            registry, ["code", "print(3)", encode_ground_truth(truth), {}, ""]
        )
        assert status == ERROR and components == {} and "SandboxUnavailable" in error


# ---- through the reward service's scoring pool -----------------------------------------------


async def test_a_pool_with_a_sandbox_section_starts_it_in_every_worker_and_scores_code():
    from relayrl.reward.pool import OK, ScoreItem, ScoringPool

    pool = ScoringPool(1, sandbox_json=SandboxConfig(workers=1).model_dump_json())
    await pool.start()
    try:
        items = [
            ScoreItem(
                "code",
                fenced("a, b = map(int, input().split())\nprint(a + b)"),
                encode_ground_truth(IO_TESTS),
            ),
            ScoreItem("code", fenced("import os\nos._exit(0)"), encode_ground_truth(IO_TESTS)),
        ]
        right, early_exit = await pool.score(items, timeout=20)
        assert (right.status, right.reward, early_exit.status, early_exit.reward) == (OK, 1.0, OK, 0.0)
    finally:
        await pool.close()


async def test_a_pool_refuses_to_start_when_its_sandbox_is_not_isolated(tmp_path):
    """A bwrap that cannot make namespaces: the probe fails, the workers never report ready."""
    from relayrl.reward.pool import PluginError, ScoringPool

    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    pool = ScoringPool(1, sandbox_json=SandboxConfig(bwrap=str(fake)).model_dump_json())
    with pytest.raises(PluginError, match="sandbox tier full cannot run code"):
        await pool.start()
    await pool.close()
