"""A push near the cost of its bytes, checked where it can be counted (the CPU): one staging buffer
with a view per bucket, filled in one batched copy per bucket; checksums computed where the bucket
is and read back once per push, on both sides; IPC readers that take each bucket as the ready
table marks it, while the sender stages the next; the IPC transport's request (a window per
bucket of one shared buffer, the ready table's segment) and its checks on the generator's side."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from relayrl.common.rpc import InvalidRequest
from relayrl.common.weightsync import buckets as bk
from relayrl.common.weightsync.buckets import Staging, Sums, checksum, device_checksum, non_finite, pack
from relayrl.common.weightsync.cudaipc import Shared
from relayrl.common.weightsync.plan import TensorMeta, aligned, plan_buckets, plan_to_plain
from relayrl.common.weightsync.shm import ROOT, ReadyTable, Segment
from relayrl.generator import wire
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.generator.worker_ext import WeightSyncExtension, ipc_sources
from relayrl.learner.push import Sinks, WeightGroup, send_buckets

REPO = Path(__file__).resolve().parents[2]
METAS = [
    TensorMeta("emb", "bfloat16", (33, 7)),  # 462 bytes: padding follows it
    TensorMeta("norm", "float32", (5,)),
    TensorMeta("ids", "int64", (3,)),
    TensorMeta("mask", "bool", (9,)),
    TensorMeta("scale", "float32", ()),
    TensorMeta("big", "float16", (300,)),  # alone: at least solo_bytes
    TensorMeta("w1", "bfloat16", (17, 3)),
    TensorMeta("w2", "float32", (11,)),
]


def tensors_for(metas, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for m in metas:
        if m.dtype == "bool":
            out[m.name] = torch.rand(m.shape, generator=gen) > 0.5
        elif m.dtype == "int64":
            out[m.name] = torch.randint(-(1 << 40), 1 << 40, m.shape, generator=gen)
        else:
            out[m.name] = torch.randn(m.shape, generator=gen).to(bk.torch_dtype(m.dtype))
    return out


def plan():
    return plan_buckets(METAS, bucket_bytes=1024, solo_bytes=600)


def reference_checksum(data: bytes) -> int:
    """The checksum's definition, spelled out: little-endian int64 words (a trailing partial word
    as bytes), summed modulo 2^64."""
    n8 = len(data) // 8 * 8
    words = sum(int.from_bytes(data[i : i + 8], "little", signed=True) for i in range(0, n8, 8))
    return (words + sum(data[n8:])) % (1 << 64)


@pytest.fixture
def reads(monkeypatch):
    """Calls of ``buckets.read_checksums`` (the one place a checksum leaves its device), by thread."""
    got: dict[str, int] = {}
    real = bk.read_checksums

    def counted(values):
        name = threading.current_thread().name
        got[name] = got.get(name, 0) + 1
        return real(values)

    monkeypatch.setattr(bk, "read_checksums", counted)
    return got


# -- staging -------------------------------------------------------------------------------
def test_a_staging_buffer_holds_every_bucket_as_packing_did_in_one_allocation():
    buckets = plan()
    assert len(buckets) >= 3 and any(len(b.tensors) > 2 for b in buckets)
    ts = tensors_for(METAS)
    st = Staging(buckets)
    for i, b in enumerate(buckets):
        view = st.fill(i, [ts[m.name] for m in b.tensors])
        assert torch.equal(view, pack(b, [ts[m.name] for m in b.tensors]))
    base = st.buf.untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in st.views)  # views, one allocation
    assert all(o % 64 == 0 for o in st.offsets) and st.offsets == tuple(sorted(st.offsets))
    # filled again with other values: the padding is still zero, so the checksums are packing's
    other = tensors_for(METAS, seed=1)
    for i, b in enumerate(buckets):
        view = st.fill(i, [other[m.name] for m in b.tensors])
        assert checksum(view) == checksum(pack(b, [other[m.name] for m in b.tensors]))


def test_staging_over_memory_already_written_zeroes_its_padding_once():
    buckets = plan()
    size = Staging(buckets, start=64).nbytes
    dirty = torch.full((size,), 0xAB, dtype=torch.uint8)
    st = Staging(buckets, buf=dirty, start=64)
    ts = tensors_for(METAS)
    for i, b in enumerate(buckets):
        assert torch.equal(
            st.fill(i, [ts[m.name] for m in b.tensors]), pack(b, [ts[m.name] for m in b.tensors])
        )
    assert st.offsets[0] == 64 and bool((dirty[:64] == 0xAB).all())  # nothing before ``start`` touched


def test_a_tensor_not_as_planned_is_refused_naming_it():
    buckets = plan()
    ts = tensors_for(METAS)
    st = Staging(buckets)
    wrong = [ts[m.name] for m in buckets[0].tensors]
    wrong[0] = wrong[0].float()
    with pytest.raises(ValueError, match="emb: tensor is float32"):
        st.fill(0, wrong)
    with pytest.raises(ValueError, match="flat uint8 buffer"):
        Staging(buckets, buf=torch.zeros(8, dtype=torch.uint8))


def test_the_0_5b_shape_travels_in_a_handful_of_buckets():
    """At 4 MiB, every MLP weight of the 0.5B shape (8.7 MB) travelled alone: 98 buckets a push."""
    h, kv, inter, vocab = 896, 128, 4864, 151936
    matrices = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)]
    layer = [*matrices, (h,), (kv,), (kv,), (h,), (h,)]  # with biases and norms
    metas = [TensorMeta("embed", "bfloat16", (vocab, h))]
    metas += [TensorMeta(f"l{i}.{j}", "bfloat16", s) for i in range(24) for j, s in enumerate(layer)]
    for mb, most in ((256, 6), (64, 20)):
        buckets = plan_buckets(metas, mb << 20)
        assert len(buckets) <= most, (mb, len(buckets))
        assert [t.name for t in buckets[0].tensors] == ["embed"]  # still alone: no packing copy


# -- checksums ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 1001])
def test_a_checksum_computed_where_the_bucket_is_keeps_its_meaning(n):
    gen = torch.Generator().manual_seed(n)
    for data in (
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen),
        torch.full((n,), 255, dtype=torch.uint8),
    ):
        expected = reference_checksum(bytes(data.tolist()))
        assert bk.read_checksums(device_checksum(data).reshape(1)) == [expected]
        assert checksum(data) == expected
        unaligned = torch.cat([torch.zeros(3, dtype=torch.uint8), data])[3:]
        assert checksum(unaligned) == expected


def test_sums_are_read_back_once_whatever_their_number(reads):
    bufs = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (16, 9, 0, 1024)]
    sums = Sums()
    for b in bufs:
        sums.add(b)
    sums.add_known(5)
    assert reads == {}
    assert sums.read() == [reference_checksum(bytes(b.tolist())) for b in bufs] + [5]
    assert sums.read() == sums.read() and reads == {"MainThread": 1}


def test_non_finite_answers_as_before_with_one_read_for_a_finite_bucket(monkeypatch):
    named = [
        (f"t{i}", torch.randn(50).to(dt))
        for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16] * 10)
    ]
    named.append(("ids", torch.arange(4)))
    calls = []
    real = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: calls.append(1) or real(t))
    assert non_finite(named) is None
    assert len(calls) == 1  # one value read for 30 tensors (was one per tensor)
    bad = [*named[:5], ("nan", torch.tensor([1.0, float("nan")], dtype=torch.bfloat16)), *named[5:]]
    assert non_finite(bad) == "nan"
    huge = [("big", torch.full((4,), 3e38)), ("inf", torch.tensor([float("inf")])), ("ok", torch.ones(2))]
    assert non_finite(huge) == "inf"  # a sum that overflowed is looked at elementwise, not blamed
    assert non_finite([]) is None


# -- a push: the sender's side ---------------------------------------------------------------
class _Done:
    def wait(self) -> None:
        pass


class _Group:
    """A group's process group that records what it broadcast (bytes) and finishes at once."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def broadcast(self, buf, root):
        self.sent.append(bytes(buf.tolist()))
        return _Done()


def test_a_push_reads_its_checksums_once_and_marks_each_ipc_bucket_as_it_is_staged(reads):
    buckets = plan()
    ts = tensors_for(METAS)
    items = [[ts[m.name] for m in b.tensors] for b in buckets]
    st, pg, marks = Staging(buckets), _Group(), []
    group = WeightGroup(pg, {"a": 1}, 2)

    def staged():
        for i, item in enumerate(items):
            assert marks == list(range(i))  # bucket i-1 was marked before bucket i is gathered
            yield item

    sent, sums = send_buckets(buckets, staged(), Sinks(groups=[group], ipc=st, on_ipc_ready=marks.append))
    packed = [pack(b, item) for b, item in zip(buckets, items, strict=True)]
    assert marks == list(range(len(buckets)))
    assert sums == [checksum(p) for p in packed] and sent == sum(b.nbytes for b in buckets)
    assert pg.sent == [bytes(p.tolist()) for p in packed]  # the group got the staged bytes
    assert reads == {"MainThread": 1 + len(buckets)}  # the push 1; ``checksum`` above, one each


def test_a_group_only_push_reads_its_checksums_once(reads):
    buckets = plan()
    ts = tensors_for(METAS)
    pg = _Group()
    _, sums = send_buckets(
        buckets, ([ts[m.name] for m in b.tensors] for b in buckets), Sinks(groups=[WeightGroup(pg, {}, 1)])
    )
    assert reads == {"MainThread": 1}
    assert sums == [reference_checksum(x) for x in pg.sent]


def test_shared_memory_marks_carry_each_buckets_checksum(reads):
    """The ready table of a shared-memory push carries each bucket's checksum (its reader checks
    the bytes against it): there, and only there, a checksum is read as each bucket is marked."""
    buckets = plan()
    ts = tensors_for(METAS)
    start = len(buckets) * ReadyTable.ENTRY
    size = Staging(buckets, start=start).nbytes
    seg = Segment.create(size, "t")
    try:
        st, table = Staging(buckets, buf=seg.view(), start=start), ReadyTable(seg, 0, len(buckets))
        sinks = Sinks(shm=st, on_ready=lambda i, c: table.mark(i, 4, c))
        _, sums = send_buckets(buckets, ([ts[m.name] for m in b.tensors] for b in buckets), sinks)
        assert reads == {"MainThread": len(buckets)}
        assert [table.wait(i, 4, time.monotonic() + 1) for i in range(len(buckets))] == sums
        del st, sinks
    finally:
        seg.close()


# -- a push: the receiver's side (the generator's IPC read, as its worker runs it) -----------
def _receive(buckets, views, table, push_id, progress=None, answer=None):
    def sources():
        for i, got in enumerate(ipc_sources(buckets, views, (table, push_id, time.monotonic() + 60))):
            yield got
            if progress is not None:
                progress.put(i)

    answer.append(WeightSyncExtension()._relayrl_take(buckets, sources(), False))


def test_an_ipc_reader_takes_each_bucket_as_it_is_marked_while_the_sender_stages_the_next(reads):
    """The sender gathers bucket i+1 only once the reader said it has bucket i: a reader that
    waited for the whole push would leave the sender waiting, and the test failing at its bound."""
    buckets = plan()
    ts = tensors_for(METAS)
    st = Staging(buckets)
    seg = Segment.create(aligned(len(buckets) * ReadyTable.ENTRY), "t")
    try:
        table = ReadyTable(seg, 0, len(buckets))
        for push_id in (1, 2):  # marks of push 1 never pass for push 2's
            progress, answer = queue.Queue(), []
            reader = threading.Thread(
                target=_receive, args=(buckets, st.views, table, push_id, progress, answer), name="reader"
            )
            reader.start()

            def items(progress=progress, push_id=push_id):
                for i, b in enumerate(buckets):
                    if i:
                        assert progress.get(timeout=60) == i - 1
                    yield [ts[m.name] * push_id if m.dtype != "bool" else ts[m.name] for m in b.tensors]

            _, sums = send_buckets(
                buckets, items(), Sinks(ipc=st, on_ipc_ready=lambda i, p=push_id: table.mark(i, p, 0))
            )
            reader.join(60)
            assert answer[0]["checksums"] == sums and not answer[0]["error"]
            assert reads.pop("reader") == 1 and reads.pop("MainThread") == 1
    finally:
        seg.close()


def test_an_ipc_push_given_up_stops_its_reader_at_once():
    buckets = plan()
    st = Staging(buckets)
    seg = Segment.create(aligned(len(buckets) * ReadyTable.ENTRY), "t")
    try:
        table, answer = ReadyTable(seg, 0, len(buckets)), []
        table.mark(0, 9, 0)
        table.abort(9)
        t0 = time.monotonic()
        _receive(buckets, st.views, table, 9, answer=answer)
        assert time.monotonic() - t0 < 5
        assert answer[0]["kind"] == "unavailable" and "gave up push 9 before bucket 1" in answer[0]["error"]
    finally:
        seg.close()


def test_a_read_naming_no_ready_segment_is_refused_before_any_buffer_is_opened():
    out = WeightSyncExtension().relayrl_read_ipc(plan_to_plain(plan()), [], "relayrl-t-0-gone", 3, 1.0, True)
    assert out["kind"] == "invalid" and "does not exist" in out["error"] and not out["touched"]


# -- the contract: what an IPC push's request says, checked on the generator's side ---------
def _ipc_request(n: int, push_id: int, segment: str) -> g.UpdateWeightsRequest:
    req = g.UpdateWeightsRequest(version=1)
    for _ in range(n):
        req.ipc.buffers.add(handle=b"h", storage_size_bytes=64, nbytes=64)
    req.ipc.push_id, req.ipc.ready_segment = push_id, segment
    return req


def test_an_ipc_request_names_its_ready_table_or_is_refused():
    source = wire.source_from_proto(_ipc_request(2, 7, "relayrl-ready-1-ab"), 2)
    assert (source.ipc_push_id, source.ipc_ready_segment, len(source.ipc)) == (7, "relayrl-ready-1-ab", 2)
    assert wire.source_from_proto(_ipc_request(2, 0, "ignored"), 2).ipc_ready_segment == ""  # all in place
    with pytest.raises(
        InvalidRequest, match="ipc.ready_segment '../etc/passwd' is not a relayrl segment name"
    ):
        wire.source_from_proto(_ipc_request(2, 7, "../etc/passwd"), 2)
    with pytest.raises(InvalidRequest, match="below 2"):
        wire.source_from_proto(_ipc_request(2, 1 << 63, "relayrl-ready-1-ab"), 2)


class _Peers:
    host, device, timeout_s, control_s = "127.0.0.1", "cpu", 30.0, 5.0
    addresses: dict = {}
    transports: dict = {}


async def test_the_ipc_transport_shares_one_buffer_and_marks_its_buckets_in_a_ready_table(monkeypatch):
    """What the learner's IPC transport stages, with the CUDA sharing faked (the rest runs as is):
    one buffer for the plan, a window of it per bucket, the ready table's segment named in the
    request, a push id per push; abort marks every unmarked bucket given up; renew forgets both."""
    from relayrl.learner import transports

    shared = []

    def fake_share(buf):
        shared.append(buf)
        return Shared(b"handle", buf.numel(), 4096, 0, b"rc", 1, b"", False, buf.numel())

    monkeypatch.setattr(transports, "share", fake_share)
    ipc = transports.IpcTransport("ipc", _Peers())
    buckets = plan()
    try:
        sinks = Sinks()
        req = await ipc.stage(buckets, g.UpdateWeightsRequest(version=3), sinks)
        st = sinks.ipc
        assert shared == [st.buf] and req.version == 3
        assert [(b.storage_offset_bytes, b.nbytes) for b in req.ipc.buffers] == [
            (4096 + o, b.nbytes) for o, b in zip(st.offsets, buckets, strict=True)
        ]
        assert {b.handle for b in req.ipc.buffers} == {b"handle"}
        assert req.ipc.push_id == 1 and (ROOT / req.ipc.ready_segment).exists()
        reader = Segment.attach(req.ipc.ready_segment)
        table = ReadyTable(reader, 0, len(buckets))
        sinks.on_ipc_ready(0)
        assert table.wait(0, 1, time.monotonic() + 1) == 0
        ipc.abort()
        with pytest.raises(RuntimeError, match="gave up push 1 before bucket 1"):
            table.wait(1, 1, time.monotonic() + 1)
        again = Sinks()
        req2 = await ipc.stage(buckets, g.UpdateWeightsRequest(version=4), again)
        assert again.ipc is st and len(shared) == 1 and req2.ipc.push_id == 2  # kept for the plan
        assert req2.ipc.ready_segment == req.ipc.ready_segment
        reader.close()
        ipc.renew()  # a replica was silent: fresh memory for the next push
        assert not (ROOT / req.ipc.ready_segment).exists()
        fresh = Sinks()
        req3 = await ipc.stage(buckets, g.UpdateWeightsRequest(version=5), fresh)
        assert fresh.ipc is not st and len(shared) == 2 and req3.ipc.ready_segment != req.ipc.ready_segment
    finally:
        ipc.close()


# -- the bench's CPU check ---------------------------------------------------------------------
def test_the_ipc_bench_checks_the_staging_on_the_cpu():
    out = subprocess.run(
        [sys.executable, "bench/sync_ipc.py", "--cpu-size", "tiny", "--cpu-bucket-mb", "0.25"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    figures = dict(line.split(": ", 1) for line in out.stdout.splitlines() if line.startswith("ipc_"))
    assert figures["ipc_staging_bytes_equal"] == "1"
    assert figures["ipc_checksum_reads_per_push"] == "1"
    assert figures["ipc_receiver_checksum_reads_per_push"] == "1"
    assert figures["ipc_receiver_overlaps"] == "1"
    assert int(figures["ipc_cpu_check_buckets"]) > 2
