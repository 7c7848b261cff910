"""A sandbox job's output is read to its end (``relayrl.common.sandbox.pipes``): what the job wrote
just before it exited is never lost, whatever the moment the reader looked.

The race this pins down (2026-12-06: 13 of 3,840 episodes of ``examples/calc-harness-tiny.yaml``
masked as "the agent printed no report", with exit status 0 and empty output): the reader's
select timed out with nothing to read, the job then wrote its last line and exited, and the reader,
seeing the exit, stopped without reading the pipes."""

from __future__ import annotations

import os
import selectors
import subprocess
import sys
import time

from relayrl.common.sandbox import pipes


class LateSelector(selectors.DefaultSelector):
    """A selector whose every select times out with nothing to read, as one that returned a
    moment before the job's last write would."""

    def select(self, timeout=None):
        return []


def _exited_job(code: str) -> subprocess.Popen:
    """A job that has written (under a pipe's 64 KiB, so it never waits on the reader) and exited."""
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:  # not reaped
        time.sleep(0.01)
    return proc


def test_what_a_job_wrote_before_it_exited_is_read_even_if_the_select_missed_it(monkeypatch):
    monkeypatch.setattr(pipes.selectors, "DefaultSelector", LateSelector)
    proc = _exited_job("import sys; print('{\"final\": \"42\"}'); sys.stderr.write('log' * 3000)")
    try:
        out, err, truncated, timed_out = pipes.read_capped(proc, time.monotonic() + 10, 1 << 20)
    finally:
        proc.wait()
    assert out == b'{"final": "42"}\n' and err == b"log" * 3000 and not truncated and not timed_out


def test_the_cap_holds_when_the_rest_is_read_after_the_exit(monkeypatch):
    monkeypatch.setattr(pipes.selectors, "DefaultSelector", LateSelector)
    proc = _exited_job("print('x' * 50000)")
    try:
        out, _, truncated, timed_out = pipes.read_capped(proc, time.monotonic() + 10, 1000)
    finally:
        proc.wait()
    assert out == b"x" * 1000 and truncated and not timed_out
