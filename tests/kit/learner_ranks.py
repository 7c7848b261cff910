"""Two learner ranks' command channel and heartbeat (``relayrl.learner.control``), without a model:
``python -m tests.kit.learner_ranks RANK PORT HEARTBEAT_SECONDS``, HEARTBEAT_SECONDS 0 for none.

Rank 0 is started with PORT 0: it hosts the group's store on a port the kernel picks and prints
``port N`` (a port chosen free beforehand can be taken before the store binds it); rank 1 is then
started with that port. Each rank prints ``ready`` once both are connected. Rank 0 then waits for a line on stdin and
sends the ``stop`` command within HEARTBEAT_SECONDS (or 2 s), then ends the heartbeat; the other
rank follows commands until ``stop``. Both exit 0 after a clean stop, and through
``relayrl.learner.rank.exit_now`` (status 1, the reason logged) when the other is out of reach."""

from __future__ import annotations

import logging
import sys
from datetime import timedelta


def main(rank: int, port: int, heartbeat_s: float) -> None:
    import torch.distributed as dist
    from relayrl.learner.control import Control, Heartbeat
    from relayrl.learner.rank import exit_now

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    timeout = timedelta(seconds=120)
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=(rank == 0), timeout=timeout, wait_for_workers=False
    )
    if rank == 0:
        print(f"port {store.port}", flush=True)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    control = Control()
    heartbeat = Heartbeat(heartbeat_s, lambda reason: exit_now(1, reason)).start() if heartbeat_s else None
    dist.barrier(group=control.group)
    print("ready", flush=True)
    if rank == 0:
        sys.stdin.readline()
        try:
            control.send({"op": "stop"}, timeout=heartbeat_s or 2.0)
        except Exception:
            exit_now(1, control.broken)
        if heartbeat:
            heartbeat.stop()
    else:
        while control.recv()[0]["op"] != "stop":
            pass
        if heartbeat:
            heartbeat.stop()
    print("stopped", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]))
