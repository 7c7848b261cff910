"""The training group's rendezvous port, bound by rank 0 and published in a file, instead of a
port picked free beforehand (``RELAYRL_RENDEZVOUS_FILE``: the Ray and Slurm launchers).

A port found free and closed again, then handed to rank 0's store, can be taken by any process
of the node in between (seconds: rank 0 imports torch first); its store then fails with
EADDRINUSE and the learner never starts. Here rank 0's store binds port 0, so the kernel gives
it a port nobody holds, and rank 0 writes that port to the file; the other ranks, on any node,
wait for the file (the launchers require a filesystem every node shares, the run folder's) and
dial it. Each launch names a file of its own, so no rank reads an earlier launch's port."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from relayrl.learner.config import RENDEZVOUS_FILE_VAR

__all__ = ["RENDEZVOUS_FILE_VAR", "await_port", "join", "publish"]
WAIT_S = 900.0  # rank 0's start: its imports, and a model read from shared storage
POLL_S = 0.2
SAY_EVERY_S = 60.0
logger = logging.getLogger(__name__)


_STORE = None  # rank 0's store (join): the training group's, for as long as the rank runs


def join() -> None:
    """Before the training group forms (``rank.init_distributed``), with ``RELAYRL_RENDEZVOUS_FILE``
    set: rank 0 binds its store on a free port and publishes it; the others read the port into
    ``MASTER_PORT``. Without it, torchrun's or the launcher's ``MASTER_PORT`` stands."""
    global _STORE
    path = os.environ.get(RENDEZVOUS_FILE_VAR)
    if not path:
        return
    if os.environ.get("RANK", "0") != "0":
        os.environ["MASTER_PORT"] = str(await_port(Path(path)))
        return
    from torch.distributed.constants import default_pg_timeout

    addr, world = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["WORLD_SIZE"])
    _STORE = publish(Path(path), addr, world, default_pg_timeout.total_seconds())
    os.environ["MASTER_PORT"] = str(_STORE.port)
    # Rank 0 then joins its own store as a client, as torchrun's ranks join their agent's
    # (torch.distributed.rendezvous: every rank a client when the agent holds the store): the
    # group forms through env:// alike on every rank, DeepSpeed's init included.
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    logger.info("training rendezvous on port %d (published in %s)", _STORE.port, path)


def publish(path: Path, addr: str, world_size: int, timeout_s: float):
    """Rank 0: its store on a port the kernel picks, held from here on, written to ``path``
    (whole: a temporary file renamed into place). Returns the store, which the caller keeps."""
    from relayrl.common.weightsync.group import master_store  # the weight-sync groups' rank 0 alike

    store = master_store(addr, world_size, timeout_s)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(f"{store.port}\n")
    tmp.replace(path)
    return store


def await_port(path: Path, wait_s: float = WAIT_S, poll_s: float = POLL_S) -> int:
    """Another rank: the port rank 0 wrote to ``path``, once it is there. Raises RuntimeError,
    naming the file, when none appears within ``wait_s`` (the launcher ends a group whose rank 0
    died, so this bound is for a rank 0 that never started)."""
    start = time.monotonic()
    deadline, said = start + wait_s, start
    while True:
        try:
            text = path.read_text()
        except FileNotFoundError:
            text = ""
        if text.endswith("\n"):  # written whole (renamed into place), never half
            port = int(text) if text.strip().isdigit() else 0
            if not 0 < port < 65536:
                raise RuntimeError(f"rendezvous file {path} names no port: {text.strip()[:40]!r}")
            return port
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rank 0 published no rendezvous port in {path} within {wait_s:.0f} s "
                "(did it start? every rank must see that folder: a shared filesystem)"
            )
        if time.monotonic() - said >= SAY_EVERY_S:  # a wait that lasts says what it waits for
            said = time.monotonic()
            logger.warning("still waiting for rank 0's rendezvous port in %s (%.0f s)", path, said - start)
        time.sleep(poll_s)
