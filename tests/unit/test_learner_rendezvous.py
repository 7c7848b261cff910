"""The training rendezvous through a file (``relayrl.learner.rendezvous``, the Ray and Slurm
launchers): rank 0's store binds a port the kernel picks and publishes it; the other ranks read
it and join through DeepSpeed, as every learner rank does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from relayrl.learner.rendezvous import await_port

RANK = textwrap.dedent(
    """
    import os, sys
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=sys.argv[1], LOCAL_RANK=sys.argv[1], WORLD_SIZE="2")
    os.environ.pop("MASTER_PORT", None)  # none is given: rank 0 publishes the one its store holds
    from relayrl.learner.rank import init_distributed

    init_distributed(with_deepspeed=True)
    import torch
    import torch.distributed as dist

    t = torch.tensor([int(os.environ["RANK"]) + 1.0])
    dist.all_reduce(t)
    print("sum", float(t), "port", os.environ["MASTER_PORT"], flush=True)
    dist.destroy_process_group()
    """
)


def test_two_ranks_meet_on_the_port_rank_0_published(tmp_path):
    """The follower starts first and waits for the file; both then train as one group (an
    all-reduce), on the port written there, which rank 0's store holds."""
    pytest.importorskip("deepspeed")
    path = tmp_path / "shared" / "learner-1a2b.port"  # its folder is made by rank 0
    env = {**os.environ, "RELAYRL_RENDEZVOUS_FILE": str(path)}
    run = [sys.executable, "-c", RANK]
    follower = subprocess.Popen(
        [*run, "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    time.sleep(1.0)  # the follower is waiting on a file that is not there yet
    assert follower.poll() is None and not path.exists()
    leader = subprocess.run([*run, "0"], env=env, capture_output=True, text=True, timeout=180)
    out1, err1 = follower.communicate(timeout=180)
    assert leader.returncode == 0 and follower.returncode == 0, leader.stderr[-2000:] + err1[-2000:]
    port = int(path.read_text())
    assert f"sum 3.0 port {port}" in leader.stdout and f"sum 3.0 port {port}" in out1
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_a_follower_waits_for_the_whole_file_then_reads_it(tmp_path):
    path = tmp_path / "r.port"
    path.write_text("4")  # being written: no newline yet

    def finish():
        time.sleep(0.3)
        path.write_text("41234\n")

    threading.Thread(target=finish).start()
    assert await_port(path, wait_s=10, poll_s=0.05) == 41234


def test_no_file_within_the_bound_is_an_error_naming_it(tmp_path, monkeypatch, caplog):
    from relayrl.learner import rendezvous

    monkeypatch.setattr(rendezvous, "SAY_EVERY_S", 0.1)
    path = tmp_path / "never.port"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="never.port") as err:
        await_port(path, wait_s=0.5, poll_s=0.05)
    assert time.monotonic() - start < 5 and "shared filesystem" in str(err.value)
    assert "still waiting for rank 0's rendezvous port in" in caplog.text  # a long wait says why


def test_a_file_that_names_no_port_is_refused(tmp_path):
    path = tmp_path / "bad.port"
    for text in ("0\n", "70000\n", "port\n"):
        path.write_text(text)
        with pytest.raises(RuntimeError, match="names no port"):
            await_port(path, wait_s=1)
