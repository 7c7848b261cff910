"""The reward service as the coordinator calls it: a rotation of reward replicas, Score spread over
them by chunks of items.

Score is stateless: a chunk whose replica failed (it died, its deadline passed, or it answered
results that do not match its items one for one, which would give samples each other's rewards)
is sent again to the replicas in rotation. A failed replica is probed and comes back into
rotation when it serves again (``rotation.py``); with none left, calls wait for one. A chunk that
fails ``max_attempts`` times ends the run with ``AttemptsExhausted``, naming the replicas and
their errors.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
from relayrl.common import logcontext
from relayrl.common.serving import ClientSecurity
from relayrl.coordinator.clients.rotation import DOWN_CODES, Attempts, Replica, Rotation
from relayrl.coordinator.errors import ServiceRpcError
from relayrl.reward.v1 import reward_pb2 as rw
from relayrl.reward.v1 import reward_pb2_grpc as rwg


class RewardPool(Rotation):
    def __init__(
        self,
        replicas: dict[str, str],
        deadline_s: float,
        chunk: int = 256,
        security: ClientSecurity | None = None,
        wait_s: float = 600.0,
        probe_s: float = 5.0,
        max_attempts: int = 4,
        coming_back: Callable[[str], bool] | None = None,
    ):
        super().__init__(
            "reward",
            replicas,
            "relayrl.reward.v1.RewardService",
            security,
            probe_s=probe_s,
            wait_s=wait_s,
            call_deadline_s=deadline_s,
            coming_back=coming_back,
        )
        self.deadline_s = deadline_s
        self.chunk = chunk
        self.max_attempts = max_attempts

    async def score(self, items: list[rw.RewardInput], request_id: str) -> list[rw.RewardResult]:
        """Results in the order of ``items``."""
        chunks = [items[i : i + self.chunk] for i in range(0, len(items), self.chunk)]
        out: list[list[rw.RewardResult] | None] = [None] * len(chunks)
        pending = list(range(len(chunks)))
        tries = Attempts("reward: score chunk", self.max_attempts)
        while pending:
            reps = await self.available()
            sent = [(c, reps[k % len(reps)]) for k, c in enumerate(pending)]
            answers = await asyncio.gather(
                *(self._call(rep, chunks[c], f"{request_id}-{c}") for c, rep in sent)
            )
            still = []
            for (c, rep), a in zip(sent, answers, strict=True):
                if isinstance(a, str):
                    still.append(c)  # its replica failed: re-issued to the others
                    tries.failed(f"{request_id}-{c}", f"{rep.name}: {a}")
                else:
                    out[c] = a
            pending = still
        return [r for chunk in out for r in chunk]  # type: ignore[union-attr]

    async def _call(self, rep: Replica, chunk: list, rid: str) -> list[rw.RewardResult] | str:
        """The chunk's results in its order, or why the replica failed it."""
        try:
            resp = await rwg.RewardServiceStub(rep.channel).Score(
                rw.ScoreRequest(request_id=rid, items=chunk),
                timeout=self.deadline_s,
                metadata=logcontext.current(),
            )
        except grpc.aio.AioRpcError as e:
            if e.code() not in DOWN_CODES:
                raise ServiceRpcError(e, f"reward {rep.name} ({rep.address})", "Score") from None
            why = f"{e.code().name} {e.details()}"
        else:
            if [r.sample_id for r in resp.results] == [x.sample_id for x in chunk]:
                return list(resp.results)
            # Results out of step with the items would give samples each other's rewards.
            why = f"answered {len(resp.results)} results for {len(chunk)} items, not one per item in order"
        self.mark_down(rep, why)
        return why
