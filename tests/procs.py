"""Start relayrl services as real subprocesses for tests; stop them by handle, never by name."""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from pathlib import Path

from relayrl.coordinator.launch.processes import ServiceProcess

_ids = itertools.count()


@contextmanager
def service(args: list[str], tmp: Path, timeout: float = 180.0, env: dict | None = None):
    """Run ``relayrl serve ...args`` until it writes its port; yield (address, ServiceProcess)."""
    proc = ServiceProcess(f"{args[0]}-{next(_ids)}", args, Path(tmp), env=env)
    try:
        yield proc.wait_ready(timeout), proc
    finally:
        proc.stop()
