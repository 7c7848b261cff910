"""Start relayrl services as real subprocesses for tests; stop them by handle, never by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def service(args: list[str], tmp: Path, timeout: float = 180.0, env: dict | None = None):
    """Run ``relayrl serve ...args`` until it writes its port; yield (address, Popen)."""
    port_file = tmp / f"port-{time.monotonic_ns()}"
    log = open(tmp / f"{args[0]}-{time.monotonic_ns()}.log", "w+")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "relayrl.cli",
            "--log-level",
            "INFO",
            "serve",
            *args,
            "--port-file",
            str(port_file),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    try:
        deadline = time.monotonic() + timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"service {args} did not start (rc={proc.poll()}):\n{log.read()[-4000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port_file.read_text().strip()}", proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def log_text(tmp: Path, name: str) -> str:
    return "\n".join(p.read_text() for p in sorted(tmp.glob(f"{name}-*.log")))
