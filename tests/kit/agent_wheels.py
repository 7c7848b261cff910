"""Wheels that ``scripts/test.sh`` fetched for the sandbox's interpreter (Debian's python3), one
folder per requirements file, for tests that install packages into the sandbox offline."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest


def agent_wheels(requirements: Path) -> Path:
    """The folder of ``requirements``'s wheels; the test is skipped, saying why, without it."""
    from relayrl.common.sandbox.packages import interpreter_version
    from relayrl.common.sandbox.runner import resolve_python

    cache = Path(os.environ.get("RELAYRL_TEST_CACHE", Path.home() / ".cache" / "relayrl-tests"))
    version = interpreter_version(resolve_python(""))
    digest = hashlib.sha256(requirements.read_bytes()).hexdigest()[:12]
    folder = cache / "agent-wheels" / f"py{version}-{digest}"
    if not (folder / ".complete").exists():
        pytest.skip(f"no wheels in {folder}: the test command (scripts/test.sh) fetches them")
    return folder


def offline(wheels: Path, *requirements: str) -> str:
    """A requirements file's text that installs ``requirements`` from ``wheels`` alone."""
    return "\n".join(["--no-index", f"--find-links {wheels}", *requirements]) + "\n"
