"""Processes an engine starts for a service end with it (``common/lifeline.py``, loaded into
vLLM's processes by the plugin ``generator/vllm_plugin.py``): a generator killed with SIGKILL
must not leave its EngineCore and workers behind holding the GPU memory its restart needs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import psutil
import pytest

# A service (owner) that starts an engine process, which starts a worker; both load the plugin as
# vLLM's processes do. Prints the engine's and the worker's pids.
OWNER = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    from relayrl.common.lifeline import own_engine_processes

    def worker():
        from relayrl.generator.vllm_plugin import register
        register()
        time.sleep(600)

    def engine(pids):
        from relayrl.generator.vllm_plugin import register
        register()
        w = mp.get_context("spawn").Process(target=worker)
        w.start()
        pids.put(w.pid)
        time.sleep(600)

    if __name__ == "__main__":
        from relayrl.generator.vllm_plugin import register
        own_engine_processes()
        register()  # loaded in the owner too (vLLM loads plugins in every process): no effect there
        ctx = mp.get_context("spawn")
        pids = ctx.Queue()
        e = ctx.Process(target=engine, args=(pids,))
        e.start()
        print(e.pid, pids.get(timeout=60), flush=True)
        time.sleep(600)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engines_processes_end_when_the_service_that_started_them_is_killed(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    procs = []
    try:
        procs = [psutil.Process(int(p)) for p in owner.stdout.readline().split()]
        assert len(procs) == 2 and all(p.is_running() for p in procs)
        assert owner.poll() is None  # the plugin left the owner alone
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(10)
        for p in procs:  # the engine at once, then the worker whose parent the engine was
            p.wait(10)  # psutil.TimeoutExpired if it lives on
    finally:
        owner.kill()
        for p in procs:
            if p.is_running():
                p.kill()


def test_the_plugin_does_nothing_in_a_process_no_service_owns(monkeypatch):
    from relayrl.common import lifeline
    from relayrl.generator.vllm_plugin import register

    monkeypatch.delenv(lifeline.OWNER_ENV, raising=False)
    calls = []
    monkeypatch.setattr(lifeline, "_on_parent_death", lambda sig: calls.append(sig) or True)
    register()
    monkeypatch.setenv(lifeline.OWNER_ENV, str(os.getpid()))
    register()  # the owner itself
    assert calls == []
    monkeypatch.setenv(lifeline.OWNER_ENV, str(os.getpid() + 1))
    register()
    assert calls == [signal.SIGKILL]


def test_vllm_finds_the_plugin():
    """vLLM loads every ``vllm.general_plugins`` entry point of the environment in its processes."""
    found = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "relayrl.generator.vllm_plugin:register" in found
