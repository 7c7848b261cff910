"""Trackers (``tracking``): TensorBoard event files and an offline W&B run hold every step's
metrics, read back with TensorBoard's and wandb's own readers; nothing is written when off."""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path

import pytest
from relayrl.coordinator.config import TrackingSection, WandbSection
from relayrl.coordinator.records.trackers import Trackers, missing_packages

from tests.kit.waits import until_blocking

RECORDS = [
    {"step": 0, "time": 1.0, "eval_accuracy": 0.25},
    {"step": 1, "time": 2.0, "reward_mean": 0.5, "loss": -0.1, "critic_explained_var": float("nan")},
    {"step": 2, "time": 3.0, "reward_mean": 0.75, "loss": 0.2, "eval_accuracy": 0.5, "synced": True},
]


def _log(t: TrackingSection, run_dir: Path, records=RECORDS) -> None:
    trackers = Trackers(t, run_dir, {"name": "x"})
    for r in records:
        trackers.log(r)
    trackers.close()


def test_nothing_is_written_unless_asked(tmp_path):
    _log(TrackingSection(), tmp_path)
    assert list(tmp_path.iterdir()) == []
    assert missing_packages(TrackingSection()) == []


def test_tensorboard_event_files_hold_every_scalar_per_step(tmp_path):
    pytest.importorskip("tensorboardX")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(TrackingSection(tensorboard=True), tmp_path)
    # a resumed run writes a second event file in the same folder; TensorBoard reads both
    _log(TrackingSection(tensorboard=True), tmp_path, [{"step": 3, "time": 4.0, "reward_mean": 0.9}])
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    got = {tag: [(e.step, round(e.value, 6)) for e in ea.Scalars(tag)] for tag in ea.Tags()["scalars"]}
    assert got == {
        "eval_accuracy": [(0, 0.25), (2, 0.5)],
        "reward_mean": [(1, 0.5), (2, 0.75), (3, 0.9)],
        "loss": [(1, -0.1), (2, 0.2)],
    }  # NaN (no variance to explain) and booleans are left out
    assert [e.wall_time for e in ea.Scalars("loss")] == [2.0, 3.0]


def test_a_resume_from_an_earlier_checkpoint_replaces_the_steps_logged_after_it(tmp_path):
    """A run that crashed at step 2 with its checkpoint at step 1 resumes there: TensorBoard
    shows steps 2 and 3 of the continued run only, not the crashed run's step 2 beside them."""
    pytest.importorskip("tensorboardX")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log(TrackingSection(tensorboard=True), tmp_path)
    trackers = Trackers(TrackingSection(tensorboard=True), tmp_path, resume_step=1)
    for r in ({"step": 2, "time": 5.0, "reward_mean": 0.6}, {"step": 3, "time": 6.0, "reward_mean": 0.9}):
        trackers.log(r)
    trackers.close()
    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    assert [(e.step, round(e.value, 6)) for e in ea.Scalars("reward_mean")] == [(1, 0.5), (2, 0.6), (3, 0.9)]
    assert [e.step for e in ea.Scalars("loss")] == [1]  # the crashed run's step 2 is gone


def read_wandb_history(path: Path) -> tuple[list[tuple[int, dict]], bool]:
    """(step, values) of every history record of a ``.wandb`` file: wandb's protobuf ``Record``s
    in the LevelDB log format (32 KiB blocks, 7-byte chunk headers: crc, length, type) after a
    7-byte W&B header. wandb >= 0.19 reads these in Go only, hence this reader."""
    from wandb.proto import wandb_internal_pb2

    data, i, buf, out, ended = path.read_bytes(), 7, b"", [], False
    assert data[:4] == b":W&B"
    while i + 7 <= len(data):
        if 32768 - i % 32768 < 7:  # a block's tail too short for a header is padding
            i += 32768 - i % 32768
            continue
        length, kind = int.from_bytes(data[i + 4 : i + 6], "little"), data[i + 6]
        if length == 0 and kind == 0:
            break
        buf += data[i + 7 : i + 7 + length]
        i += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            buf = b""
            ended |= rec.WhichOneof("record_type") == "exit"
            if rec.WhichOneof("record_type") == "history":
                items = {
                    (it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item
                }
                out.append((rec.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return out, ended


def test_wandb_offline_run_holds_every_scalar_per_step(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)  # offline needs no key and no network
    _log(TrackingSection(wandb=WandbSection(project="p", tags=["t"])), tmp_path)
    (run,) = list((tmp_path / "wandb").glob(f"offline-run-*-{tmp_path.name}/run-*.wandb"))
    # wandb's writer (a process of its own) may still be appending when finish() returns: the
    # run's file is whole once its exit record is in (seen missing about 1 run in 15 under load).
    deadline = time.monotonic() + 30
    history, ended = read_wandb_history(run)
    while not ended and time.monotonic() < deadline:
        time.sleep(0.1)
        history, ended = read_wandb_history(run)
    assert ended, "the offline run's file never got its exit record"
    assert history == [
        (0, {"eval_accuracy": 0.25}),
        (1, {"reward_mean": 0.5, "loss": -0.1}),
        (2, {"reward_mean": 0.75, "loss": 0.2, "eval_accuracy": 0.5}),
    ]
    assert all(math.isfinite(v) for _, h in history for v in h.values())


# -- off the event loop ---------------------------------------------------------------------------


class SlowWriter:
    """A TensorBoard writer that writes nothing until ``gate`` opens (a slow disk, a hung mount)."""

    def __init__(self, wait: float = 30.0, fail_at: int | None = None):
        self.gate, self.wait, self.fail_at = threading.Event(), wait, fail_at
        self.entered = threading.Event()  # the tracker's thread is at the gate
        self.caller = threading.get_ident()
        self.scalars: list[tuple[str, float, int]] = []
        self.closed = False

    def add_scalar(self, tag, value, step, walltime=None):
        # Written by the test's own thread (synchronously) it would wait here for the gate that
        # only the test opens, later: the wait's end would be a failure.
        assert threading.get_ident() != self.caller, "the tracker wrote on the caller's thread"
        self.entered.set()
        if not self.gate.wait(self.wait):
            raise TimeoutError("gate never opened")
        if step == self.fail_at:
            raise OSError("disk full (test)")
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def slow_trackers(tmp_path, writer: SlowWriter, **kw) -> Trackers:
    trackers = Trackers(TrackingSection(), tmp_path, **kw)
    trackers.tb = writer  # as TrackingSection(tensorboard=True) would, with a writer that stalls
    return trackers


def test_a_slow_tracker_never_holds_the_caller_and_gets_every_record_in_order(tmp_path):
    writer = SlowWriter()
    trackers = slow_trackers(tmp_path, writer)
    for step in range(5):
        trackers.log({"step": step, "time": 1.0, "reward_mean": step / 10})  # returns, gate closed
    assert writer.scalars == []
    writer.gate.set()
    trackers.close()
    assert writer.scalars == [("reward_mean", step / 10, step) for step in range(5)] and writer.closed


def test_close_waits_no_longer_than_its_deadline_for_a_hung_tracker(tmp_path, caplog):
    writer = SlowWriter(wait=60.0)
    trackers = slow_trackers(tmp_path, writer)
    trackers.log({"step": 1, "reward_mean": 0.5})
    done = threading.Event()
    closer = threading.Thread(target=lambda: (trackers.close(timeout=0.2), done.set()), daemon=True)
    closer.start()
    closer.join(30)  # a generous bound: close gives up after 0.2 s, not after the writer's 60 s
    assert done.is_set(), "close() waited for the hung tracker"
    assert "trackers did not finish within" in caplog.text
    writer.gate.set()  # let the abandoned thread end


def test_a_tracker_far_behind_loses_records_to_itself_not_to_the_run(tmp_path, caplog):
    writer = SlowWriter()
    trackers = slow_trackers(tmp_path, writer, queue_records=3)
    trackers.log({"step": 0, "reward_mean": 1.0})
    assert writer.entered.wait(30)  # the thread holds step 0 at the gate
    for step in range(1, 10):
        trackers.log({"step": step, "reward_mean": 1.0})  # never waits for room
    # Steps 1-3 fill the queue; the 6 after them are left out.
    assert trackers.dropped == 6 and "not sent to them" in caplog.text
    writer.gate.set()
    trackers.close()
    assert [s for *_, s in writer.scalars] == [0, 1, 2, 3]


def test_a_tracker_that_fails_fails_the_next_call(tmp_path):
    writer = SlowWriter(fail_at=1)
    writer.gate.set()
    trackers = slow_trackers(tmp_path, writer)
    trackers.log({"step": 1, "reward_mean": 0.5})
    # the writer's thread tries step 1 in its own time
    until_blocking(lambda: trackers.failure is not None, 30, 0.01, "the tracker's failure was never seen")
    with pytest.raises(RuntimeError, match="a tracker failed: OSError: disk full"):
        trackers.log({"step": 2, "reward_mean": 0.6})
    trackers.log({"step": 3, "reward_mean": 0.7})  # said once: the run decides what to do
    trackers.close()
    assert writer.scalars == [] and writer.closed


def test_a_failure_on_the_last_record_is_logged_by_close_which_never_raises(tmp_path, caplog):
    writer = SlowWriter(fail_at=1)
    writer.gate.set()
    trackers = slow_trackers(tmp_path, writer)
    trackers.log({"step": 1, "reward_mean": 0.5})
    trackers.close()
    assert "a tracker failed: OSError: disk full" in caplog.text
