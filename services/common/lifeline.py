"""A service started by a parent that owns it (the embedded launcher) ends when that parent
dies, however it dies: SIGKILL and the OOM killer run no clean-up, and services left behind would
hold memory, ports and GPUs.

The launcher passes its pid in ``RELAYRL_PARENT_PID``; the service, first thing, asks the kernel
for SIGTERM when its parent goes (Linux ``PR_SET_PDEATHSIG``, kept across exec, so torchrun exec'd
by ``relayrl serve learner`` keeps it and passes the SIGTERM on to its ranks). Set in the child
rather than between fork and exec (``preexec_fn``), which is unsafe in a parent with threads.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "RELAYRL_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def exit_with_parent() -> None:
    """SIGTERM to this process when the parent named in ``RELAYRL_PARENT_PID`` dies; exits at
    once if it is gone already. No-op without the variable or off Linux. The variable is removed,
    so processes this one starts do not take it for their own parent."""
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent or sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        return
    if os.getppid() != int(parent):  # it died before the call: nobody would send the signal
        raise SystemExit(f"the process that started this one ({parent}) is gone")
