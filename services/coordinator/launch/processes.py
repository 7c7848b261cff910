"""Local service processes for the embedded default (and for tests): start, wait, stop by handle.

Each service runs as ``relayrl serve <svc> --config <its section> --port 0 --port-file F`` in its
own process group, logs to a file, and is stopped by SIGTERM to that group (then SIGKILL after a
grace period). Every command is returned so the run folder can record it. A service also ends when the
process that started it dies (``relayrl.common.lifeline``, given this process's pid): a
coordinator killed with SIGKILL or by the OOM killer leaves no services behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from relayrl.common.lifeline import PARENT_ENV


class ServiceProcess:
    """One ``relayrl serve`` process."""

    def __init__(
        self,
        name: str,
        args: list[str],
        log_dir: Path,
        env: dict[str, str] | None = None,
        entry: list[str] | None = None,
        cwd: Path | None = None,
        lifeline: bool = True,
    ):
        """``entry`` replaces ``relayrl serve`` as the program ``args`` go to (a learner rank that
        a Ray actor starts without torchrun: ``[python, -m, relayrl.learner.rank]``; a service
        started inside a network namespace: ``[ip, netns, exec, NS, python, -m, relayrl.cli,
        serve]``; a Slurm job step: ``[srun, ..., python, -m, relayrl.cli, serve]``). ``cwd``: the
        process's working folder (default: this one's). ``lifeline``: the service ends when this
        process dies (off where something between them owns that: srun ends its step)."""
        self.name = name
        log_dir.mkdir(parents=True, exist_ok=True)
        self.port_file = log_dir / f"{name}.port"
        self.port_file.unlink(missing_ok=True)
        self.log_path = log_dir / f"{name}.log"
        entry = entry or [sys.executable, "-m", "relayrl.cli", "--log-level", "INFO", "serve"]
        self.command = [*entry, *args, "--port-file", str(self.port_file)]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            self.command,
            cwd=cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={
                **{k: v for k, v in os.environ.items() if k != PARENT_ENV},
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
                **({PARENT_ENV: str(os.getpid())} if lifeline else {}),
                **(env or {}),
            },
        )
        self.address: str | None = None

    def wait_ready(self, timeout: float, host: str = "127.0.0.1") -> str:
        """Block until the service wrote its port; returns ``HOST:PORT`` (the address callers dial)."""
        deadline = time.monotonic() + timeout
        while True:
            text = self.port_file.read_text().strip() if self.port_file.exists() else ""
            if text:
                self.address = f"[{host}]:{text}" if ":" in host else f"{host}:{text}"
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self.proc.returncode} before serving:\n{self.tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start within {timeout:.0f}s:\n{self.tail()}")
            time.sleep(0.2)

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _tree(self) -> list:
        """This process and all its descendants. torchrun starts its workers in sessions of
        their own, so a process-group signal would miss them."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """Hard kill of the whole tree (fault injection: a crashed node)."""
        for p in self._tree():
            try:
                p.kill()
            except Exception:  # already gone
                pass
        self.proc.wait()

    def stop(self, grace: float = 60.0) -> int | None:
        """SIGTERM the process group (torchrun forwards it to its workers), wait ``grace``
        seconds, then SIGKILL whatever is left of the tree."""
        stop_all([self], grace)
        return self.proc.returncode

    def _terminate(self) -> list:
        """SIGTERM to the process group; returns the tree as it was (to reap or kill later)."""
        if not self.alive():
            return []
        tree = self._tree()
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        for p in tree:  # a stopped (SIGSTOP) process handles it only once continued
            try:
                p.resume()
            except Exception:  # gone already
                pass
        return tree

    def _finish(self, tree: list, deadline: float) -> None:
        """Wait for the tree until ``deadline`` (monotonic), then SIGKILL what is left."""
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        for p in tree:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except Exception:
                try:
                    p.kill()
                except Exception:
                    pass
        if self.alive():
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def stop_all(procs: list[ServiceProcess], grace: float = 60.0) -> None:
    """Stop ``procs`` together: SIGTERM to every group first, then one shared ``grace`` for all
    of them, then SIGKILL. One by one, a run's teardown took the sum of their drains (minutes
    with several generators, each draining requests and leaving its weight-sync group)."""
    trees = [(p, p._terminate()) for p in procs]
    deadline = time.monotonic() + grace
    for p, tree in trees:
        p._finish(tree, deadline)
