"""The Ray actor behind every service that ``relayrl launch ray`` starts.

One ``ServiceHost`` holds one placement-group bundle and runs one process in it, the same one the
embedded default runs locally: ``relayrl serve generator|reward`` or a learner rank
(``python -m relayrl.learner.rank``, with the torch.distributed environment torchrun would give
it). So the services themselves do not know Ray. The actor reports where it landed (node, IP,
GPUs), starts the process, waits for its port, answers whether it still runs, and stops it (the
whole process tree) on request. Ray kills an actor's child processes when the actor dies, so a
driver that vanishes leaves nothing behind either.

A plain class (Ray wraps it with ``ray.remote`` at launch time), importable without Ray or torch.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from relayrl.coordinator.launch.processes import ServiceProcess


class ServiceHost:
    """One service process inside one bundle."""

    def __init__(self) -> None:
        self.proc: ServiceProcess | None = None

    def where(self) -> dict:
        """The node this actor runs on: Ray's node id, its IP, and the GPU ids Ray gave us."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "gpus": [str(g) for g in ray.get_gpu_ids()],
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
        }

    def start(
        self,
        name: str,
        args: list[str],
        config_path: str,
        config_yaml: str,
        log_dir: str,
        env: dict[str, str],
        module: str | None = None,
        check_serve: tuple[str, dict] | None = None,
    ) -> list[str]:
        """Write the service's config section at ``config_path`` on this node and start the process:
        ``relayrl serve ARGS``, or ``python -m MODULE ARGS`` with this node's python (a learner
        rank); returns its command. ``check_serve`` (service, serve section): refuse an open bind
        or unreadable certificates here, before a learner rank spends minutes starting."""
        if check_serve is not None:
            from relayrl.common.security import SecurityError, server_security
            from relayrl.common.serving import ServeConfig

            try:
                server_security(ServeConfig.model_validate(check_serve[1]))
            except SecurityError as e:  # the driver wants the reason, on its own line
                raise RuntimeError(f"relayrl serve {check_serve[0]}: {e}") from None
        Path(config_path).parent.mkdir(parents=True, exist_ok=True)
        Path(config_path).write_text(config_yaml)
        entry = [sys.executable, "-m", module] if module else None
        self.proc = ServiceProcess(name, [*args], Path(log_dir), env=env, entry=entry)
        return self.proc.command

    def wait(self, timeout: float, host: str) -> str:
        """Block until the service serves; returns ``host:port``. Raises with its log's tail if it
        exits first or takes longer than ``timeout``."""
        assert self.proc is not None, "start() first"
        return self.proc.wait_ready(timeout, host)

    def poll(self) -> int | None:
        """None while the process runs, else its exit code."""
        return None if self.proc is None else self.proc.proc.poll()

    def tail(self) -> str:
        """The end of the process's log."""
        return "" if self.proc is None else self.proc.tail()

    def stop(self, grace: float) -> int | None:
        """SIGTERM the process group, SIGKILL what is left of the tree after ``grace`` seconds."""
        return None if self.proc is None else self.proc.stop(grace)
