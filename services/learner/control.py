"""Rank 0 -> other ranks command channel: a JSON header plus raw bytes, over a gloo group.

Every collective operation starts with rank 0 sending a command; the other ranks wait in
``recv`` and then run the same method. Bytes, not pickle, cross it (the payload of a train step
is the TrainStepRequest protobuf rank 0 received). The group is gloo even when training runs on
NCCL, with a long timeout: followers legitimately wait as long as rank 0 has no work.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch
import torch.distributed as dist


class Control:
    def __init__(self) -> None:
        self.group = dist.new_group(backend="gloo", timeout=timedelta(days=30))

    def send(self, cmd: dict, payload: bytes = b"") -> None:
        header = json.dumps(cmd).encode()
        sizes = torch.tensor([len(header), len(payload)], dtype=torch.int64)
        dist.broadcast(sizes, src=0, group=self.group)
        buf = (
            torch.frombuffer(bytearray(header + payload), dtype=torch.uint8)
            if header or payload
            else torch.empty(0, dtype=torch.uint8)
        )
        dist.broadcast(buf, src=0, group=self.group)

    def gather_text(self, text: str, limit: int = 512) -> list[str]:
        """Every rank's ``text`` (cut to ``limit`` UTF-8 bytes), in rank order, on every rank."""
        data = text.encode()[:limit]
        buf = torch.zeros(limit + 2, dtype=torch.uint8)
        buf[:2] = torch.tensor([len(data) >> 8, len(data) & 0xFF], dtype=torch.uint8)
        if data:
            buf[2 : 2 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(buf) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(out, buf, group=self.group)
        texts = []
        for b in out:
            n = (int(b[0]) << 8) | int(b[1])
            texts.append(b[2 : 2 + n].numpy().tobytes().decode(errors="replace"))
        return texts

    def recv(self) -> tuple[dict, bytes]:
        sizes = torch.empty(2, dtype=torch.int64)
        dist.broadcast(sizes, src=0, group=self.group)
        n_header, n_payload = int(sizes[0]), int(sizes[1])
        buf = torch.empty(n_header + n_payload, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        data = buf.numpy().tobytes()
        return json.loads(data[:n_header]), data[n_header:]
