"""CUDA IPC between two processes on one GPU (marked ``gpu``; ``scripts/gpu_check.sh`` runs it):
the fields ``relayrl.common.cudaipc.share`` puts on the wire rebuild the same memory in another
process, and the bytes read there are the bytes written here."""

from __future__ import annotations

import multiprocessing as mp

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _receive(fields: dict, out) -> None:
    import torch
    from relayrl.common.weightsync.buckets import checksum
    from relayrl.common.weightsync.cudaipc import Shared, open_shared

    torch.cuda.set_device(0)
    buf = open_shared(Shared(**fields), 0)
    out.put((checksum(buf), buf.numel(), torch.cuda.get_device_properties(0).uuid.hex))


def test_a_shared_buffer_reads_the_same_in_another_process_on_the_same_gpu():
    import dataclasses

    import torch
    from relayrl.common.weightsync.buckets import checksum
    from relayrl.common.weightsync.cudaipc import share

    buf = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8, device="cuda:0")
    fields = dataclasses.asdict(share(buf))
    assert all(isinstance(v, bytes | int | bool) for v in fields.values())  # plain data, no pickle
    q = mp.get_context("spawn").Queue()
    p = mp.get_context("spawn").Process(target=_receive, args=(fields, q))
    p.start()
    got, n, uuid = q.get(timeout=120)
    p.join(60)
    assert (got, n) == (checksum(buf), buf.numel())
    assert uuid == torch.cuda.get_device_properties(0).uuid.hex
