"""``serve_mcp``: the OpenEnv MCP environment of ``openenv_mcp_calc.py`` served on loopback by a
process of its own, under openenv-core 0.3 installed in a folder of its own by ``scripts/test.sh``
(fastmcp 4 and gradio, which relayrl's environment does not hold)."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parent / "openenv_mcp_calc.py"


def openenv_site() -> Path:
    """The folder openenv-core 0.3 is installed in; the test is skipped, saying why, without it."""
    cache = Path(os.environ.get("RELAYRL_TEST_CACHE", Path.home() / ".cache" / "relayrl-tests"))
    folder = cache / f"openenv-core-0.3.0-py{sys.version_info[0]}.{sys.version_info[1]}"
    if not (folder / ".complete").exists():
        pytest.skip(f"no openenv-core 0.3.0 in {folder}: the test command (scripts/test.sh) installs it")
    return folder


@contextmanager
def serve_mcp(timeout: float = 60.0) -> Iterator[str]:
    """The MCP calc env's server on 127.0.0.1 (a free port); yields its base URL."""
    env = {
        "PYTHONPATH": str(openenv_site()),
        "PATH": os.environ.get("PATH", ""),
        "HOME": os.environ.get("HOME", "/"),
    }
    # -S: the base interpreter's own site-packages stay out; -P: nor this folder (the server's
    # own) on sys.path, where a module could shadow a dependency. The folder above is all it imports.
    log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a full pipe would stall the server
    proc = subprocess.Popen(
        [sys._base_executable, "-s", "-S", "-P", str(SERVER)],
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env=env,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line.strip().isdigit():
            proc.kill()
            log.seek(0)
            raise AssertionError(f"the MCP env server did not start: {log.read()[-2000:]}")
        yield f"http://127.0.0.1:{int(line)}"
    finally:
        log.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
