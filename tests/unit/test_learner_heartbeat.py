"""Learner ranks never wait on each other for ever: two real processes over gloo on loopback
(``tests/kit/learner_ranks.py``: the command channel and the heartbeat, no model). A rank that stops
answering (SIGSTOP: hung, or cut off without its connections closing) makes the other exit with
status 1 and the reason within the heartbeat's bound; rank 0's last command at shutdown is
bounded too; a clean stop exits 0."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytest.importorskip("torch.distributed")

BOUND = 90  # seconds: far past the 3 s heartbeat, for a loaded 2-core machine


def _rank(rank: int, port: int, heartbeat: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.kit.learner_ranks", str(rank), str(port), str(heartbeat)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _until(p: subprocess.Popen, prefix: str) -> str:
    """Read ``p``'s output up to a line starting with ``prefix`` (that line)."""
    seen = []
    line = p.stdout.readline()
    while line and not line.startswith(prefix):
        seen.append(line)
        line = p.stdout.readline()
    assert line, f"a rank exited before {prefix!r}: {p.wait()}\n{''.join(seen)[-3000:]}"
    return line


def start_ranks(heartbeat: float) -> list[subprocess.Popen]:
    rank0 = _rank(0, 0, heartbeat)  # its store on a port the kernel picks, printed
    port = int(_until(rank0, "port ").split()[1])
    procs = [rank0, _rank(1, port, heartbeat)]
    for p in procs:
        _until(p, "ready")
    return procs


def finish(p: subprocess.Popen) -> tuple[int, str]:
    code = p.wait(timeout=BOUND)  # TimeoutExpired: it waited for the other rank without end
    return code, p.stdout.read()


@pytest.fixture
def ranks():
    started: list[subprocess.Popen] = []

    def start(heartbeat: float) -> list[subprocess.Popen]:
        started.extend(start_ranks(heartbeat))
        return started[-2:]

    yield start
    for p in started:  # only what this test started, by handle
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        p.wait()


def test_a_clean_stop_ends_both_ranks_with_status_0(ranks):
    rank0, rank1 = ranks(20.0)  # long: a loaded machine's pause must not read as a lost rank
    rank0.stdin.write("stop\n")
    rank0.stdin.flush()
    assert finish(rank0)[0] == 0 and finish(rank1)[0] == 0


def test_a_follower_exits_when_rank_0_stops_answering(ranks):
    rank0, rank1 = ranks(3.0)
    rank0.send_signal(signal.SIGSTOP)  # hung: its connections stay open, nothing closes them
    code, out = finish(rank1)
    assert code == 1 and "has not heard rank 0's heartbeat for 3s" in out, out


def test_rank_0_exits_when_a_follower_stops_answering(ranks):
    rank0, rank1 = ranks(3.0)
    rank1.send_signal(signal.SIGSTOP)
    code, out = finish(rank0)
    assert code == 1 and "did not take rank 0's heartbeat within 3s" in out, out


def test_rank_0s_last_command_is_bounded(ranks):
    rank0, rank1 = ranks(0.0)  # no heartbeat: only the stop command's own limit (2 s)
    rank1.send_signal(signal.SIGSTOP)
    rank0.stdin.write("stop\n")
    rank0.stdin.flush()
    code, out = finish(rank0)
    assert code == 1 and "command 'stop' not taken by every rank" in out, out
