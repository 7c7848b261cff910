"""Weight transports: which one the learner picks for every topology, and the shared-memory
segment the shm transport moves buckets through (real ``/dev/shm``, a second process)."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
from relayrl.common.placement import host_id
from relayrl.common.weightsync.buckets import checksum, pack, unpack
from relayrl.common.weightsync.group import master_store, open_group_with_store
from relayrl.common.weightsync.plan import TensorMeta, plan_buckets
from relayrl.common.weightsync.shm import ROOT, ReadyTable, Segment, valid_name
from relayrl.common.weightsync.transports import Place, choose

CPU_A, CPU_B = Place("host-a", "cpu"), Place("host-b", "cpu")
GPU0_A = Place("host-a", "cuda", ("GPU-0",))


@pytest.mark.parametrize(
    ("learner", "replica", "expected"),
    [
        (CPU_A, Place("host-a", "cpu"), "shm"),  # one host, CPU: shared memory
        (CPU_A, CPU_B, "gloo"),  # across CPU hosts
        (CPU_A, Place("host-a", "cuda", ("GPU-3",)), "shm"),  # CPU learner, GPU replica, one host
        (CPU_A, Place("host-b", "cuda", ("GPU-3",)), "gloo"),
        (GPU0_A, Place("host-a", "cuda", ("GPU-0",)), "ipc"),  # on the learner's GPU: NCCL would refuse
        (GPU0_A, Place("host-a", "cuda", ("GPU-1",)), "nccl"),  # another GPU of this host
        (GPU0_A, Place("host-b", "cuda", ("GPU-7",)), "nccl"),  # another node
        (GPU0_A, Place("host-a", "cuda", ("GPU-0", "GPU-1")), "shm"),  # TP over the learner's GPU and another
        (GPU0_A, Place("host-a", "cpu"), "shm"),
        (GPU0_A, Place("host-b", "cpu"), "gloo"),
    ],
)
def test_the_transport_follows_the_topology(learner, replica, expected):
    assert choose(learner, replica) == expected


@pytest.mark.parametrize("forced", ["ipc", "shm", "nccl", "gloo"])
def test_a_forced_transport_is_taken_as_is(forced):
    assert choose(CPU_A, CPU_B, forced) == forced


def _read(name: str, offset: int, n: int, out) -> None:
    seg = Segment.attach(name)
    try:
        buf = torch.empty(n, dtype=torch.uint8)
        seg.read_into(offset, buf)
        out.put((bytes(buf.tolist()), host_id()))
    finally:
        seg.close()


def test_a_segment_made_here_is_read_by_another_process_and_gone_when_closed():
    metas = [TensorMeta("a", "float32", (3,)), TensorMeta("b", "int64", (2,))]
    (bucket,) = plan_buckets(metas, 1 << 20)
    seg = Segment.create(bucket.nbytes + 64)
    try:
        tensors = [torch.tensor([1.5, -2.0, 3.25]), torch.tensor([7, 9])]
        buf = pack(bucket, tensors, out=seg.view()[64 : 64 + bucket.nbytes])
        assert checksum(buf) == checksum(pack(bucket, tensors))
        q = mp.get_context("spawn").Queue()
        p = mp.get_context("spawn").Process(target=_read, args=(seg.name, 64, bucket.nbytes, q))
        p.start()
        data, their_host = q.get(timeout=60)
        p.join(30)
        assert data == bytes(buf.tolist()) and their_host == host_id()
        assert [
            t.tolist() for _, t in unpack(bucket, torch.frombuffer(bytearray(data), dtype=torch.uint8))
        ] == [
            [1.5, -2.0, 3.25],
            [7, 9],
        ]
        assert oct((ROOT / seg.name).stat().st_mode & 0o777) == "0o600"  # this user's weights only
    finally:
        seg.close()
    assert not (ROOT / seg.name).exists()


@pytest.mark.parametrize("name", ["../etc/passwd", "relayrl-/x", "other-name", "relayrl-" + "x" * 200, ""])
def test_only_relayrl_segment_names_are_opened(name):
    assert not valid_name(name)
    with pytest.raises(ValueError, match="not a relayrl shared-memory segment name"):
        Segment.attach(name)


def test_host_id_names_boot_and_ipc_namespace():
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    assert host_id() == f"{boot}/{os.readlink('/proc/self/ns/ipc')}"


def test_a_dead_creators_segment_is_removed_by_the_next_one():
    import subprocess
    import sys

    child = subprocess.run(
        [sys.executable, "-c", "from relayrl.common.weightsync.shm import Segment; print(Segment.create(4096, 't').name)"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    name = child.stdout.strip()  # its creator exited without closing it (as a killed learner would)
    assert (ROOT / name).exists()
    fresh = Segment.create(16, "t")
    try:
        assert not (ROOT / name).exists() and (ROOT / fresh.name).exists()
    finally:
        fresh.close()


def _wait_all(name: str, n: int, size: int, push_id: int, out, progress=None) -> None:
    import time as _time

    seg = Segment.attach(name)
    try:
        table, data = ReadyTable(seg, 0, n), torch.empty(size, dtype=torch.uint8)
        got = []
        if progress is not None:
            progress.put("up")
        for i in range(n):
            try:
                expected = table.wait(i, push_id, _time.monotonic() + 60)
            except (RuntimeError, TimeoutError) as e:
                got.append(str(e))
                break
            seg.read_into(64 + i * size, data)
            got.append((expected, checksum(data)))
            if progress is not None:
                progress.put(i)
        out.put(got)
    finally:
        seg.close()


def test_a_pipelined_push_is_read_bucket_by_bucket_as_the_ready_table_marks_them():
    """The reader takes bucket i as soon as it is marked, while later ones are still being written;
    marks of an earlier push never pass for this one; a push given up stops the reader at once.

    Ordered by the reader's own reports, not by sleeps: the writer writes bucket i+1 only after
    the reader said it read bucket i, so a reader that waited for the whole push would leave the
    writer waiting (and the test failing at its deadline) whatever the machine's speed."""
    import queue

    n, size = 3, 4096
    seg = Segment.create(64 + n * size)
    try:
        table, view = ReadyTable(seg, 0, n), seg.view()
        for i in range(n):  # push 1 complete: its marks stay in the table
            table.mark(i, 1, 0)
        ctx = mp.get_context("spawn")
        q, progress = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=_wait_all, args=(seg.name, n, size, 2, q, progress))
        p.start()
        assert progress.get(timeout=120) == "up"
        # push 1's marks must not satisfy a reader of push 2: nothing read before push 2 writes
        with pytest.raises(queue.Empty):
            progress.get(timeout=0.5)
        for i in range(n):
            data = view[64 + i * size : 64 + (i + 1) * size]
            data.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
            table.mark(i, 2, checksum(data))
            # the reader takes bucket i before bucket i+1 exists
            assert progress.get(timeout=60) == i
        got = q.get(timeout=60)
        p.join(30)
        assert got == [(checksum(view[64 + i * size : 64 + (i + 1) * size]),) * 2 for i in range(n)]

        p = ctx.Process(target=_wait_all, args=(seg.name, n, size, 3, q))
        p.start()
        table.mark(0, 3, checksum(view[64 : 64 + size]))
        table.abort(3)
        got = q.get(timeout=60)
        p.join(30)
        assert len(got) == 2 and got[1] == "the learner gave up push 3 before bucket 1 was complete"
        del view
    finally:
        seg.close()


def test_waiting_for_a_bucket_never_marked_ends_at_the_deadline():
    import time

    seg = Segment.create(64)
    try:
        with pytest.raises(TimeoutError, match="bucket 0 of push 5 was not complete in time"):
            ReadyTable(seg, 0, 1).wait(0, 5, time.monotonic() + 0.2)
        with pytest.raises(ValueError, match="does not fit"):
            ReadyTable(seg, 0, 5)
    finally:
        seg.close()


_RECEIVER = """
import os, sys, torch
from relayrl.common.weightsync import groupwait
from relayrl.common.weightsync.group import open_group_with_store
rank, port, n, size, die = (int(a) for a in sys.argv[1:])
pg, store = open_group_with_store("127.0.0.1", port, 3, rank, "gloo", timeout_s=120)
buf = torch.empty(size, dtype=torch.uint8)
for i in range(n):
    try:
        groupwait.wait_received(pg.broadcast(buf, 0), store)  # as a generator's worker receives
    except RuntimeError as e:
        print(f"failed at bucket {i}: {e}", flush=True)
        pg.shutdown()  # what the worker does next (relayrl_close_group): it lives on
        groupwait.retire([pg], 125)
        del pg
        print("closed", flush=True)
        os._exit(3)
    if die:
        os._exit(1)  # a generator killed after its first bucket
print("received all", flush=True)
"""


def test_a_broadcast_that_loses_a_member_frees_the_others_at_once():
    """A generator dies mid-push: the learner's broadcast fails, and the generators still waiting
    for the next bucket must stop now, not at the group's timeout (here 120 s; minutes in
    production), or they stay unable to serve or join the next group that long. Closing the
    learner's side alone frees them only some of the time (a gloo receive posted before the
    connection closed can miss it): the abandon mark in the group's store does it every time."""
    import subprocess
    import sys
    import time

    from relayrl.common.rpc import Unavailable
    from relayrl.learner.push import Sinks, WeightGroup, send_buckets

    master = master_store("127.0.0.1", 3, 120)  # bound now: no other socket can take its port
    port = master.port
    n, size = 6, 4 << 20
    kids = [
        subprocess.Popen(
            [sys.executable, "-c", _RECEIVER, str(r), str(port), str(n), str(size), str(int(r == 2))],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in (1, 2)
    ]
    try:
        pg, store = open_group_with_store("127.0.0.1", port, 3, 0, "gloo", timeout_s=120, store=master)
        group = WeightGroup(pg, {"a": 1, "b": 2}, 3, store=store)
        del pg, store
        metas = [TensorMeta(f"w{i}", "uint8", (size,)) for i in range(n)]
        buckets = plan_buckets(metas, size)
        assert len(buckets) == n

        def items():
            for i, b in enumerate(buckets):
                if i == 1:
                    kids[1].wait(60)  # the second bucket goes to a dead member
                yield torch.full((b.nbytes,), i, dtype=torch.uint8)

        with pytest.raises(Unavailable, match="weight broadcast failed"):
            send_buckets(buckets, items(), Sinks(groups=[group]))
        t0 = time.monotonic()
        survivor = kids[0]
        out, _ = survivor.communicate(timeout=60)
        assert survivor.returncode == 3 and out.startswith("failed at bucket") and "closed" in out, out
        assert time.monotonic() - t0 < 10, "the survivor waited for the group's timeout"
        assert group.pg is None
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_a_receive_stops_within_a_second_of_the_abandon_mark():
    """The learner's side of ``groupwait``: the sender is alive, its connections open, and sends
    nothing more; the mark alone ends the receive."""
    import threading
    import time

    from relayrl.common.weightsync import groupwait

    master = master_store("127.0.0.1", 2, 10)  # bound now: no other socket can take its port
    port = master.port
    opened: dict = {}

    def join(rank: int) -> None:
        store = master if rank == 0 else None
        opened[rank] = open_group_with_store("127.0.0.1", port, 2, rank, "gloo", timeout_s=10, store=store)

    t = threading.Thread(target=join, args=(1,))
    t.start()
    join(0)
    t.join(60)
    (_, learner_store), (pg, store) = opened[0], opened[1]
    work = pg.broadcast(torch.empty(8, dtype=torch.uint8), 0)
    assert not groupwait.abandoned(store)
    threading.Timer(0.5, groupwait.abandon, args=(learner_store,)).start()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="abandoned"):
        groupwait.wait_received(work, store, check_every_s=0.2)
    assert 0.4 < time.monotonic() - t0 < 5
    # Dropped now, the group would wait for the pending receive (holding the GIL): retired.
    holder = [pg]
    del pg, work, opened[1]
    groupwait.retire(holder, after_s=11)


def test_a_retired_group_is_dropped_after_the_delay_and_not_before():
    import time

    from relayrl.common.weightsync import groupwait

    holder = [object()]
    groupwait.retire(holder, after_s=0.3)
    assert holder
    time.sleep(1.0)
    assert not holder


def _open_in_thread(name: str) -> BaseException | None:
    """``Segment.attach(name)`` in a thread that may not return (a FIFO blocks an ordinary open)."""
    import threading

    box: list = []

    def run() -> None:
        try:
            Segment.attach(name).close()
            box.append(None)
        except BaseException as e:
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    assert box, f"opening {name} blocked"
    return box[0]


@pytest.mark.parametrize("kind", ["symlink", "fifo", "directory", "hard link"])
def test_a_name_opens_only_a_real_segment_and_no_error_quotes_what_it_holds(tmp_path, kind):
    """A caller names the segment: a symbolic link named like one would let it read any file the
    generator can (the probe's error quoted the first 8 bytes), and a FIFO would block it."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"TOPSECRETBYTES!!" * 4)
    name = f"relayrl-t-{os.getpid()}-{kind.replace(' ', '')}"
    path = ROOT / name
    mine = Segment.create(64, "t") if kind == "hard link" else None
    try:
        if kind == "symlink":
            path.symlink_to(secret)
        elif kind == "fifo":
            os.mkfifo(path, 0o600)
        elif kind == "directory":
            path.mkdir()
        else:
            os.link(ROOT / mine.name, path)
        err = _open_in_thread(name)
        assert isinstance(err, ValueError), err
        assert "SECRET" not in str(err) and str(int.from_bytes(b"TOPSECRE", "little")) not in str(err)
    finally:
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink(missing_ok=True)
        if mine is not None:
            mine.close()


def test_a_missing_segment_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="relayrl-t-0-gone does not exist"):
        Segment.attach("relayrl-t-0-gone")


_TRUNCATED_READER = """
import sys, time
from relayrl.common.weightsync.shm import ReadyTable, Segment
seg = Segment.attach(sys.argv[1])
table = ReadyTable(seg, 0, 4)
print("open", flush=True)
sys.stdin.readline()  # the learner's side truncates the segment meanwhile
try:
    table.wait(3, 7, time.monotonic() + 5)
except ValueError as e:
    print("refused:", e, flush=True)
"""


def test_a_segment_truncated_while_a_reader_waits_is_an_error_not_a_signal():
    """A mapped segment read past the end its owner truncated it to kills the reader with SIGBUS:
    in a generator, the EngineCore, and the process with it. Read, it is an error of the call."""
    import subprocess
    import sys

    seg = Segment.create(4096, "t")
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", _TRUNCATED_READER, seg.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert child.stdout.readline().strip() == "open"
        os.truncate(ROOT / seg.name, 0)
        out, err = child.communicate("go\n", timeout=60)
        assert child.returncode == 0, (child.returncode, err)
        assert "refused:" in out and "truncated" in out
    finally:
        seg.close()
