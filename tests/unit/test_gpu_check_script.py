"""``scripts/gpu_check.sh`` fits a lent GPU machine before one is lent: it parses; the test files it
runs by name exist, carry the ``gpu`` marker, are every such file, and collect without the
modules those machines lack; its parts come most important first, each with a limit no shorter
than its expected time, and the expected times fit the budget of one 10-minute call."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
ABSENT = ("cryptography", "openai", "math_verify", "vllm", "ray")  # not on the lent H200's image
CALL_S = 600  # one call on a lent machine


def gpu_tests() -> list[str]:
    block = re.search(r"^GPU_TESTS=\((.*?)^\)", SCRIPT.read_text(), re.S | re.M)
    assert block, "scripts/gpu_check.sh names its gpu test files in GPU_TESTS=( ... )"
    return block.group(1).split()


def marks_gpu(path: Path) -> bool:
    """Whether a test file marks anything ``gpu`` (pytestmark or a decorator)."""
    tree = ast.parse(path.read_text())
    return any(
        isinstance(node, ast.Attribute) and node.attr == "gpu" and ast.unparse(node).endswith("mark.gpu")
        for node in ast.walk(tree)
    )


def plan() -> list[tuple[str, int, int, str]]:
    out = subprocess.run(
        ["bash", str(SCRIPT), "--plan"], capture_output=True, text=True, timeout=60, check=True
    )
    rows = [line.split("\t") for line in out.stdout.splitlines()]
    return [(name, int(expect), int(limit), cmd) for name, expect, limit, cmd in rows]


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=60)


def test_it_runs_every_gpu_test_file_by_name_and_nothing_else():
    named = gpu_tests()
    assert named and len(set(named)) == len(named)
    for rel in named:
        assert (REPO / rel).is_file(), f"{rel} does not exist"
        assert marks_gpu(REPO / rel), f"{rel} carries no gpu marker"
    marked = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py") if marks_gpu(p))
    assert sorted(named) == marked, "a gpu-marked test file is missing from GPU_TESTS"
    for _, _, _, cmd in plan():  # never `pytest -m gpu tests`: every pytest run names its file
        if " pytest " in cmd:
            assert cmd.split()[-1].endswith(".py"), cmd
    text = SCRIPT.read_text()
    assert "--wheels" in text and "--no-index" in text  # the offline install stays


def test_the_gpu_test_files_collect_without_what_a_lent_machine_lacks():
    """`pytest -m gpu tests` stopped at collection there: modules importing cryptography. The
    files run by name must collect with those packages made unimportable."""
    blocker = f"""
import sys, importlib.abc
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (absent on the lent machine)")
sys.meta_path.insert(0, Absent())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""
    out = subprocess.run(
        [sys.executable, "-c", blocker, *gpu_tests()], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "error" not in out.stdout.lower().split("collected")[-1]


def test_the_parts_come_most_important_first_and_fit_one_call():
    parts = plan()
    names = [p[0] for p in parts]
    assert names[:3] == ["install", "learner-0.5b", "sync-ipc"]
    assert names[3 : 3 + len(gpu_tests())] == gpu_tests()
    assert names.index("learner-1.5b") < names.index("long-tailed-0.5b") and names[-1] == "lora-cpu"
    for name, expect, limit, _ in parts:
        assert 0 < expect <= limit, name
    budget = int(re.search(r'budget="\$\{GPU_CHECK_BUDGET_S:-(\d+)\}"', SCRIPT.read_text()).group(1))
    assert budget < CALL_S
    assert sum(expect for name, expect, _, _ in parts if name != "lora-cpu") <= budget
    cmds = dict((p[0], p[3]) for p in parts)
    assert "--sizes 0.5b" in cmds["learner-0.5b"] and "--sizes 1.5b" in cmds["learner-1.5b"]
    assert "--skewed 0.5b-skewed" in cmds["long-tailed-0.5b"]


def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    report = REPO / "bench" / "results" / "gpu.md"
    before = report.read_bytes() if report.exists() else None
    out = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120)
    if "needs a CUDA GPU" not in out.stderr:  # a machine with a GPU: nothing to check here
        return
    assert out.returncode == 2
    assert (report.read_bytes() if report.exists() else None) == before
