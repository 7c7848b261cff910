"""Multi-turn episodes: the lifecycle every episode source shares (``EpisodeSource``), for the
experiments with an ``episodes`` section. Two sources play an episode their own way:
``tool_episodes`` (the model's turns sampled here, each stepped by the env) and ``agent_episodes``
(an agent of the env's own, reaching the model through a gateway).

Each sample of a group is one episode of the environment on the row's task: the env service opens
a session (Reset: the first messages and the tools), the source plays the episode on it
(``_play``), and Close gives the episode's reward and outcome.

What is checked, loudly: before the first step, the generator's chat template must show the
env's tools in the prompt and read back the tool calls it renders, and extending a dialogue turn
by turn must give what rendering it whole gives (``prepare``); an environment that expects tools
but sees none for ``zero_tool_steps`` steps raises the alarm.

Failures: an env replica that dies, or a session it lost, redoes the episode from its start on
another replica (same seed, so the same episode where sampling is reproducible); an env that says
REDO likewise; after ``max_attempts``, or when the env says MASK, the episode is masked: it keeps
an ERROR result, which ``algorithms.rewards.fresh_groups`` leaves out of training and of the
group's baseline, and which counts against ``services.max_reward_error_fraction``. Never a reward
of 0. An episode that ran but left nothing to train on (``NothingToTrain``) is masked too, unless
the env says REDO.

Seeds: turn ``k`` of episode ``i`` of prompt ``p`` is the generator prompt ``p/i/t<k>``, whose
random stream derives from the experiment's seed and that id: a seeded run repeats its episodes
exactly, whichever replica or attempt runs them. The env's own seed derives from the same
(``env_seed``)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.common.alarms import StreakAlarm
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients.envs import EnvPool, EpisodeLost
from relayrl.coordinator.clients.generators import GeneratorPool
from relayrl.coordinator.clients.rotation import Replica
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.errors import RunFailure
from relayrl.coordinator.rollout.base import Rollout
from relayrl.coordinator.rollout.episode import Episode, episode_stats, write_trace
from relayrl.env.v1 import env_pb2 as ev
from relayrl.generator.v1 import generator_pb2 as g
from relayrl.reward.v1 import reward_pb2 as rw

logger = logging.getLogger(__name__)

MAX_TASK_BYTES = 1 << 20
"""Largest data row sent to the env service as a task (ResetRequest.task_json's bound)."""
TRACED_EPISODES = 2
"""Episodes of the first training rollout written to the run folder (``write_trace``)."""


class ChatTemplateUnfit(RunFailure):
    """The model's chat template cannot run these episodes (the tools are not in its prompt, the
    calls it renders do not parse back, or turn-by-turn prompts differ from whole renders)."""


class ToolsNeverCalled(RunFailure):
    """An environment that expects tools saw no tool call for ``episodes.zero_tool_steps``
    training steps, with ``episodes.zero_tool_alarm: fail``."""


class NothingToTrain(Exception):
    """The episode ran but left nothing to train on: it is masked (as ``kind``), unless the env's
    Close says REDO."""

    kind = "nothing_to_train"


def env_seed(seed: int, episode_id: str) -> int:
    """The env's seed for an episode: stable across processes and attempts, distinct per episode."""
    return (
        int.from_bytes(hashlib.blake2b(f"{seed}/{episode_id}".encode(), digest_size=8).digest(), "little")
        >> 1
    )


@dataclass
class Attempt:
    """One attempt at episode ``index`` of prompt ``pid``, as the lifecycle hands it to a source's
    hooks."""

    pid: str
    index: int
    evaluation: bool
    tag: str
    min_version: int
    number: int
    """Attempts before this one (the env's ``ResetRequest.attempt``)."""
    gateway: ev.GatewayEndpoint | None = None
    """What the env's Reset hands the episode's agent, where it runs one (``_open`` sets it)."""
    held: Any = None
    """What the source holds for this attempt between its hooks (``agent_episodes``: the gateway
    session)."""

    @property
    def eid(self) -> str:
        return f"{self.pid}/{self.index}"


class EpisodeSource:
    """Episodes of ``cfg.episodes.env`` (described by ``info``, as the env service lists it) on the
    env service, sampled on the generators; a source says how one is played (``_play``) and, where
    it must, what an attempt holds besides the env's session (``_open``, ``_abandon``) and what
    its reward is (``_result``)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        generators: GeneratorPool,
        envs: EnvPool,
        info: ev.EnvInfo,
        trace: Path | None = None,
    ):
        """``trace``: where the first training rollout's first episodes are written, turn by
        turn (``write_trace``), for a person to read what the model saw and did."""
        assert cfg.episodes is not None
        self.trace = trace
        self.cfg = cfg
        self.ep = cfg.episodes
        self.gen = generators
        self.envs = envs
        self.info = info
        self.prepared = False
        self.stop_ids: list[int] = []
        self.zero_tools = StreakAlarm(
            "alarm_zero_tool_calls",
            self.ep.zero_tool_steps,
            self.ep.zero_tool_alarm,
            ToolsNeverCalled,
            logger,
        )  # training rollouts in a row without a tool call
        self.nonce = secrets.token_hex(4)  # this process's episodes, apart from any earlier one's

    async def prepare(self) -> None:
        """Check, before the first step, that the generators' chat template can run the env's
        episodes (``ChatTemplateUnfit`` otherwise), and learn its end-of-turn tokens."""
        tools = json.loads(self.info.tools_json or "[]")
        fmt = self.ep.tool_format
        check = await self.gen.check_chat(self.info.tools_json if tools else "", fmt)
        if check.tools_missing_from_prompt:
            raise ChatTemplateUnfit(
                f"the chat template leaves the tools {list(check.tools_missing_from_prompt)[:8]} of env "
                f"{self.ep.env!r} out of the prompt: the model could never call them (does the model's "
                "chat template have a tools branch?)"
            )
        if tools and fmt and not check.round_trip_ok:
            raise ChatTemplateUnfit(
                f"episodes.tool_format {fmt!r}: a tool call the chat template renders does not parse back "
                f"the same: {check.round_trip_detail[:500]}"
            )
        if not check.prefix_preserving and self.ep.turns == "exact":
            msg = (
                "the chat template is not prefix-preserving (rendering a dialogue whole differs from "
                f"extending it turn by turn): {check.bridge_detail[:500]}"
            )
            if not self.ep.allow_template_drift:
                raise ChatTemplateUnfit(
                    msg + "; use episodes.turns: stepwise (every call rendered whole, one learner sample "
                    "each), or set episodes.allow_template_drift to train on the turn-by-turn tokens"
                )
            logger.warning("%s; training token-exactly on the turn-by-turn tokens", msg)
        if self.info.expects_tools and not fmt:
            logger.warning(
                "env %r expects tool calls but episodes.tool_format is empty: none will be read",
                self.ep.env,
            )
        self.stop_ids = list(check.stop_token_ids)
        self.prepared = True

    def _sampling(self, evaluation: bool, max_tokens: int) -> g.SamplingParams:
        s, sched = self.cfg.sampling, self.cfg.schedule
        return g.SamplingParams(
            n=1,
            max_tokens=max_tokens,
            stop_token_ids=self.stop_ids,
            temperature=sched.eval_temperature if evaluation else s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            seed=self.cfg.seed if s.seeded else None,
            tool_format=self.ep.tool_format,
            fit_to_context=True,
        )

    async def rollout(
        self, batch: list[tuple[str, dict]], evaluation: bool, tag: str, min_version: int
    ) -> Rollout:
        if not self.prepared:
            await self.prepare()
        n = self.cfg.schedule.eval_samples if evaluation else self.cfg.sampling.n
        slots = asyncio.Semaphore(self.ep.concurrency)

        async def one(pid: str, i: int, row: dict) -> Episode:
            async with slots:  # wait: bounded by the episodes before it, each under deadlines
                return await self.episode(pid, i, row, evaluation, tag, min_version)

        t0 = time.monotonic()
        # A TaskGroup: when one episode fails the run (a prefix violation, a bad request), the
        # others are cancelled, not left generating.
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [[tg.create_task(one(pid, i, row)) for i in range(n)] for pid, row in batch]
        except BaseExceptionGroup as failed:  # the run fails on the first, as with one task
            raise failed.exceptions[0] from None
        episodes = [[t.result() for t in ts] for ts in tasks]
        t1 = time.monotonic()
        groups = [
            (row, [e.sample for e in eps], [e.result for e in eps])
            for (_, row), eps in zip(batch, episodes, strict=True)
        ]
        flat = [e for eps in episodes for e in eps]
        masks = {(e.sample.prompt_id, e.sample.sample_index): e.mask for e in flat if not all(e.mask)}
        segments = {(e.sample.prompt_id, e.sample.sample_index): e.segments for e in flat if e.segments}
        stats = episode_stats(flat)
        if not evaluation:
            stats.update(self._alarm(flat))
            if self.trace is not None:
                await asyncio.to_thread(write_trace, self.trace, flat[:TRACED_EPISODES])
                self.trace = None
        tokens = sum(int(sum(e.mask)) for e in flat)
        seconds = {"generate": t1 - t0, "score": 0.0}
        return Rollout(groups, seconds, tokens, [pid for pid, _ in batch], masks, stats, segments)

    def _alarm(self, episodes: list[Episode]) -> dict[str, float]:
        """The zero-tool alarm, over training steps in a row (``episodes.zero_tool_alarm``)."""
        if not self.info.expects_tools:
            return {}
        return self.zero_tools.observe(
            not any(e.tool_calls for e in episodes),
            lambda n: (
                f"env {self.ep.env!r} expects tool calls but saw none in {n} training steps in a row "
                f"(episodes.tool_format {self.ep.tool_format!r}): are the tools in the prompt, and are the "
                "model's calls parsed?"
            ),
        )

    async def episode(
        self, pid: str, i: int, row: dict, evaluation: bool, tag: str, min_version: int
    ) -> Episode:
        """Episode ``i`` of prompt ``pid``: redone while its environment fails, masked after
        ``episodes.max_attempts`` failures."""
        eid = f"{pid}/{i}"
        why = ""
        for attempt in range(self.ep.max_attempts):
            try:
                got = await self._attempt(row, Attempt(pid, i, evaluation, tag, min_version, attempt))
            except EpisodeLost as lost:
                why = str(lost)[:500]
                logger.warning("episode %s attempt %d lost, redone: %s", eid, attempt, why)
                continue
            got.redone = attempt
            return got
        why = f"lost on each of {self.ep.max_attempts} attempts: {why}"
        return self._masked(pid, i, "episode_lost", why, self.ep.max_attempts, min_version)

    def _masked(
        self,
        pid: str,
        i: int,
        kind: str,
        why: str,
        redone: int,
        version: int = 0,
        like: Episode | None = None,
    ) -> Episode:
        """A masked episode: ``like`` (one that ran, kept for its counts) or an empty sample at
        ``version`` (never trained; the version only keeps its group's staleness true). Logged
        once, with its reason (``kind``, counted as ``env_masked_<kind>``)."""
        logger.warning("episode %s/%d masked (%s): %s", pid, i, kind, why[:500])
        error = rw.RewardResult(
            sample_id=f"{pid}/{i}", status=rw.SCORE_STATUS_ERROR, error=f"env: {kind}: {why}"[:1024]
        )
        if like is not None:
            like.result, like.masked, like.mask_reason = error, True, kind
            return like
        sample = common_pb2.Sample(prompt_id=pid, sample_index=i, policy_version=version)
        return Episode(sample, [], error, redone=redone, masked=True, mask_reason=kind)

    async def _attempt(self, row: dict, a: Attempt) -> Episode:
        """One attempt: the env's session opened (Reset), the episode played on it, the session
        closed (Close: the reward and the outcome). A failure on the way frees what the attempt
        holds, at once, and is raised (``EpisodeLost``: the attempt is redone)."""
        task = json.dumps(row, default=str)
        if len(task.encode()) > MAX_TASK_BYTES:
            raise RunFailure(
                f"data row {a.pid}: {len(task.encode())} bytes as JSON; the env service takes at most {MAX_TASK_BYTES}"
            )
        await self._open(a)
        try:
            rep, reset = await self.envs.reset(
                ev.ResetRequest(
                    request_id=a.tag,
                    env=self.ep.env,
                    task_json=task,
                    seed=env_seed(self.cfg.seed, a.eid),
                    # Unique to this rollout of this coordinator process: a retried Reset finds its
                    # session, while an evaluation run again or a resumed run never reaches an old one.
                    episode_id=f"{self.nonce}/{a.tag}/{a.eid}",
                    attempt=a.number,
                    gateway=a.gateway,
                )
            )
        except BaseException:
            self._abandon(a)
            raise
        empty: NothingToTrain | None = None
        try:
            try:
                ep = await self._play(a, rep, reset)
            except NothingToTrain as e:  # nothing to train; the env's verdict still decides below
                empty, ep = e, None
            close = await self.envs.close_session(
                rep, ev.CloseRequest(request_id=a.tag, session_id=reset.session_id)
            )
        except BaseException:
            self._abandon(a)
            # The episode is lost, the run failing or cancelled: free its session now rather than
            # at its lease's end.
            self._close_soon(rep, a.tag, reset.session_id)
            raise
        if close.outcome == ev.OUTCOME_REDO:
            raise EpisodeLost(f"env said REDO: {close.failure_kind}: {close.failure_reason[:300]}")
        if ep is None:
            return self._masked(a.pid, a.index, empty.kind, str(empty), a.number, a.min_version)
        if close.outcome == ev.OUTCOME_MASK:
            return self._masked(
                a.pid, a.index, close.failure_kind or "masked", close.failure_reason, a.number, like=ep
            )
        if close.outcome != ev.OUTCOME_OK:
            raise RunFailure(
                f"env {rep.name}: Close of episode {a.eid} answered no outcome (a contract violation)"
            )
        ep.result = self._result(a, close)
        return ep

    def _close_soon(self, rep: Replica, tag: str, session_id: str) -> None:
        """Close an env session without waiting, unless its replica is gone (nothing to free)."""
        if rep.healthy:
            closing = asyncio.ensure_future(
                self.envs.close_session(rep, ev.CloseRequest(request_id=tag, session_id=session_id))
            )
            closing.add_done_callback(lambda f: f.cancelled() or f.exception())

    # -- what a source says ----------------------------------------------------------------------
    async def _open(self, a: Attempt) -> None:
        """Before the env's Reset: what the attempt needs besides the env's session (sets
        ``a.gateway`` and ``a.held``). Nothing by default."""

    async def _play(self, a: Attempt, rep: Replica, reset: ev.ResetResponse) -> Episode:
        """The episode on its env session (``reset``, on replica ``rep``): its Episode without a
        reward result yet. Raises ``EpisodeLost`` to redo it, ``NothingToTrain`` to mask it."""
        raise NotImplementedError

    def _abandon(self, a: Attempt) -> None:
        """The attempt failed or was cancelled midway: free what ``_open`` took, without waiting.
        Nothing by default."""

    def _result(self, a: Attempt, close: ev.CloseResponse) -> rw.RewardResult:
        """The episode's reward result: the env's, from its Close."""
        return rw.RewardResult(
            sample_id=a.eid, status=rw.SCORE_STATUS_OK, reward=close.reward, components=dict(close.components)
        )
