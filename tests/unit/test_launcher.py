"""Local service processes (``coordinator/launch/processes.py``): a run's services are stopped together,
so its teardown takes one drain, not the sum of them."""

from __future__ import annotations

import sys
import textwrap
import time

from relayrl.coordinator.launch.processes import ServiceProcess, stop_all

# Drains on SIGTERM until every one of the three has been signalled (a file each), then exits 0.
# Stopped one by one, the first would wait for signals that only come after it ended: its grace
# would run out and it would be SIGKILLed.
DRAINER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path
    folder, me = Path(sys.argv[1]), sys.argv[2]
    def term(*_):
        (folder / me).touch()
        deadline = time.monotonic() + 60
        while len(list(folder.glob("p*"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    (folder / f"ready-{me}").touch()
    while True:
        time.sleep(1)
    """
)


def test_services_are_stopped_together_not_one_after_another(tmp_path):
    procs = [
        ServiceProcess(
            f"p{i}", [str(tmp_path), f"p{i}"], tmp_path / "logs", entry=[sys.executable, "-c", DRAINER]
        )
        for i in range(3)
    ]
    try:
        while len(list(tmp_path.glob("ready-*"))) < 3:
            assert all(p.alive() for p in procs), [p.tail() for p in procs]
            time.sleep(0.05)
        stop_all(procs, grace=20)
    finally:
        for p in procs:
            if p.alive():
                p.kill()
    assert [p.proc.returncode for p in procs] == [0, 0, 0], [p.tail() for p in procs]


def test_services_end_when_the_process_that_started_them_is_killed(tmp_path):
    """A coordinator killed with SIGKILL (or by the OOM killer) runs no clean-up: its services
    must not live on as orphans holding memory, ports and GPUs. (A service asks for it first
    thing: ``relayrl serve`` and a learner rank call ``exit_with_parent``.)"""
    import os
    import signal
    import subprocess

    import psutil

    starter = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from relayrl.coordinator.launch.processes import ServiceProcess
        service = "from relayrl.common.lifeline import exit_with_parent; exit_with_parent(); import time; time.sleep(600)"
        p = ServiceProcess("svc", [], Path({str(tmp_path)!r}), entry=[sys.executable, "-c", service])
        print(p.proc.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        assert child.is_running()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        child.wait(10)  # the kernel's SIGTERM ends it at once (psutil.TimeoutExpired otherwise)
        assert not child.is_running()
    finally:
        if child.is_running():
            child.kill()
