"""``scripts/test.sh``, the test command CI runs, ends with pytest's exit status: 0 after a green
run, pytest's own code after a red one, a failed check's code before it. Run here as it is, in a
copy of the tree whose installer, interpreter and tools are stubs (seconds, nothing installed or
fetched); the background fetch, its ending and the temporary docs folder are the real ones."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COPIED = (
    "scripts/test.sh",
    "scripts/uv_index.sh",
    "examples/agents/langchain_calc/requirements.txt",
    "tests/kit/verifiers_envs/requirements.txt",
)
# Each stub logs its argv; `python -m pytest` exits with $STUB_PYTEST_RC, `ruff check` with
# $STUB_RUFF_RC; everything else succeeds.
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
case "$(basename "$0") $1 $2" in
  "python -m pytest") exit "${STUB_PYTEST_RC:-0}" ;;
  "ruff check "*) exit "${STUB_RUFF_RC:-0}" ;;
esac
exit 0
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    for rel in COPIED:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / rel, root / rel)
    (root / "scripts" / "install.sh").write_text("exit 0\n")
    stubs = root / "stubs"
    stubs.mkdir()
    for tool in ("python", "ruff", "mkdocs"):
        (stubs / tool).write_text(STUB)
        (stubs / tool).chmod(0o755)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "activate").write_text(f'PATH="{stubs}:$PATH"\n')
    return root


def run(tree: Path, **env: str) -> tuple[int, list[str]]:
    log = tree / "stub.log"
    proc = subprocess.run(
        ["bash", str(tree / "scripts" / "test.sh"), "-q"],
        env={**os.environ, "STUB_LOG": str(log), "RELAYRL_TEST_CACHE": str(tree / "cache"), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return proc.returncode, log.read_text().splitlines() if log.exists() else []


def test_a_green_run_exits_0(tree: Path):
    rc, calls = run(tree)
    assert rc == 0
    assert calls[-1].startswith("python -m pytest -n 2 --dist loadfile") and calls[-1].endswith("-q")


def test_a_red_run_exits_with_pytests_code(tree: Path):
    assert run(tree, STUB_PYTEST_RC="1")[0] == 1
    assert run(tree, STUB_PYTEST_RC="5")[0] == 5  # no tests collected


def test_a_failed_check_stops_before_pytest(tree: Path):
    rc, calls = run(tree, STUB_RUFF_RC="3")
    assert rc == 3
    assert not any(call.startswith("python -m pytest") for call in calls)
