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
OWNER_ENV = "RELAYRL_ENGINE_OWNER"
_PR_SET_PDEATHSIG = 1


def _on_parent_death(sig: int) -> bool:
    """Ask the kernel for ``sig`` when this process's parent dies; False where it cannot."""
    if sys.platform != "linux":
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig) == 0


def exit_with_parent() -> None:
    """SIGTERM to this process when the parent named in ``RELAYRL_PARENT_PID`` dies; exits at
    once if it is gone already. No-op without the variable or off Linux. The variable is removed,
    so processes this one starts do not take it for their own parent."""
    parent = os.environ.pop(PARENT_ENV, None)
    if not parent or not _on_parent_death(signal.SIGTERM):
        return
    if os.getppid() != int(parent):  # it died before the call: nobody would send the signal
        raise SystemExit(f"the process that started this one ({parent}) is gone")


def own_engine_processes() -> None:
    """Called by a service before it starts an engine that runs processes of its own (vLLM's
    EngineCore and its workers): they end when their parent does (``die_with_parent``). Without
    it a SIGKILLed generator leaves its EngineCore behind, holding the GPU memory that the
    generator started again in its place then cannot get."""
    os.environ[OWNER_ENV] = str(os.getpid())


def die_with_parent() -> None:
    """In a process an engine started for a service that called ``own_engine_processes``: SIGKILL
    when its parent dies (its parent is gone for good: nothing is left to hand work back to, and
    the signal cannot be caught by a process stuck in a kernel call). No-op elsewhere, so an
    engine that loads this from a plugin hook in another program is left alone. A process whose
    parent died before the call (re-parented to init or a container's init) exits at once."""
    owner = os.environ.get(OWNER_ENV)
    if not owner or os.getpid() == int(owner) or not _on_parent_death(signal.SIGKILL):
        return
    if os.getppid() == 1:
        os._exit(1)
