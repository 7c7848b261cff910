"""Multi-turn episodes: the rollout source of experiments with an ``episodes`` section.

Each sample of a group is one episode of the environment on the row's task: the env service opens
a session (Reset: the first messages and the tools), the generator samples the model's turn, the
env answers it (Step: tool results or feedback), and the next turn's prompt is the exact tokens so
far extended with that answer (``common.v1.Continuation``: the generator renders only the new
messages). Close gives the episode's reward and outcome. ``trajectories.assemble`` makes the
episode one learner sample whose loss mask leaves out the environment's tokens.

What is checked, loudly: before the first step, the generator's chat template must show the
env's tools in the prompt and read back the tool calls it renders, and extending a dialogue turn
by turn must give what rendering it whole gives (``prepare``); every turn's prompt must start with
the previous turn's exact tokens (``PrefixViolation`` stops the run); an environment that expects
tools but sees none for ``zero_tool_steps`` steps raises the alarm.

Failures: an env replica that dies, or a session it lost, redoes the episode from its start on
another replica (same seed, so the same episode where sampling is reproducible); an env that says
REDO likewise; after ``max_attempts``, or when the env says MASK, the episode is masked: it keeps
an ERROR result, which ``batch.fresh_groups`` leaves out of training and of the group's
baseline, and which counts against ``services.max_reward_error_fraction``. Never a reward of 0.

Seeds: turn ``k`` of episode ``i`` of prompt ``p`` is the generator prompt ``p/i/t<k>``, whose
random stream derives from the experiment's seed and that id: a seeded run repeats its episodes
exactly, whichever replica or attempt runs them. Turns of one episode go to one generator replica
(``affinity``), where the earlier turns' tokens are in the prefix cache."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import secrets
import time
from pathlib import Path

import grpc
from relayrl.common.trajectories import assemble, check_prefix, segments_sample, turn_room
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.agent_episodes import (
    AgentSilent,
    close_soon,
    episode_of,
    harness_result,
    open_session,
)
from relayrl.coordinator.batch import Rollout
from relayrl.coordinator.clients import GeneratorPool
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.envs import EnvPool, EpisodeLost
from relayrl.coordinator.episode_records import Episode, episode_stats, write_trace
from relayrl.coordinator.errors import RunFailure
from relayrl.coordinator.gateways import GatewayPool
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


def env_seed(seed: int, episode_id: str) -> int:
    """The env's seed for an episode: stable across processes and attempts, distinct per episode."""
    return (
        int.from_bytes(hashlib.blake2b(f"{seed}/{episode_id}".encode(), digest_size=8).digest(), "little")
        >> 1
    )


class MultiTurn:
    """Episodes of ``cfg.episodes.env`` on the env service, sampled on the generators."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        generators: GeneratorPool,
        envs: EnvPool,
        trace: Path | None = None,
        gateways: GatewayPool | None = None,
    ):
        """``trace``: where the first training rollout's first episodes are written, turn by
        turn (``write_trace``), for a person to read what the model saw and did. ``gateways``:
        for an env that runs its own agent (``agent_episodes``)."""
        self.gateways = gateways
        assert cfg.episodes is not None
        self.trace = trace
        self.cfg = cfg
        self.ep = cfg.episodes
        self.gen = generators
        self.envs = envs
        self.info: ev.EnvInfo | None = None
        self.stop_ids: list[int] = []
        self.quiet_steps = 0  # training rollouts in a row without a tool call
        self.nonce = secrets.token_hex(4)  # this process's episodes, apart from any earlier one's

    async def prepare(self) -> None:
        """Check, before the first step, that the generators' chat template can run the env's
        episodes (``ChatTemplateUnfit`` otherwise), and learn its end-of-turn tokens."""
        try:
            self.info = await self.envs.env_info(self.ep.env)
        except ValueError as e:
            raise ChatTemplateUnfit(str(e)) from None
        if self.info.black_box and self.gateways is None:
            raise ChatTemplateUnfit(
                f"env {self.ep.env!r} runs an agent of its own, which reaches the model through a gateway: "
                "start one (services.gateway_replicas: 1) or name one (services.gateways)"
            )
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

    def _assistant(self, s: common_pb2.Sample) -> common_pb2.ChatMessage:
        """The model's turn as a message to render again (stepwise): its text outside the tool
        calls and the calls that parsed (one that did not cannot be rendered as a call)."""
        ok = [c for c in s.tool_calls if c.parse == common_pb2.TOOL_CALL_PARSE_OK]
        return common_pb2.ChatMessage(
            role="assistant", content=s.content if self.ep.tool_format else s.text, tool_calls=ok
        )

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
        if self.info is None:
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
        if self.info is None or not self.info.expects_tools:
            return {}
        self.quiet_steps = 0 if any(e.tool_calls for e in episodes) else self.quiet_steps + 1
        if self.quiet_steps < self.ep.zero_tool_steps:
            return {"alarm_zero_tool_calls": 0}
        msg = (
            f"env {self.ep.env!r} expects tool calls but saw none in {self.quiet_steps} training steps in a "
            f"row (episodes.tool_format {self.ep.tool_format!r}): are the tools in the prompt, and are the "
            "model's calls parsed?"
        )
        if self.ep.zero_tool_alarm == "fail":
            raise ToolsNeverCalled(msg)
        logger.warning("ALARM: %s", msg)
        return {"alarm_zero_tool_calls": 1}

    async def episode(
        self, pid: str, i: int, row: dict, evaluation: bool, tag: str, min_version: int
    ) -> Episode:
        """Episode ``i`` of prompt ``pid``: redone while its environment fails, masked after
        ``episodes.max_attempts`` failures."""
        eid = f"{pid}/{i}"
        why = ""
        for attempt in range(self.ep.max_attempts):
            try:
                got = await self._attempt(pid, i, row, evaluation, tag, min_version, attempt)
            except EpisodeLost as lost:
                why = str(lost)[:500]
                logger.warning("episode %s attempt %d lost, redone: %s", eid, attempt, why)
                continue
            got.redone = attempt
            return got
        logger.warning("episode %s masked after %d attempts: %s", eid, self.ep.max_attempts, why)
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
        ``version`` (never trained; the version only keeps its group's staleness true)."""
        error = rw.RewardResult(
            sample_id=f"{pid}/{i}", status=rw.SCORE_STATUS_ERROR, error=f"env: {kind}: {why}"[:1024]
        )
        if like is not None:
            like.result, like.masked = error, True
            return like
        sample = common_pb2.Sample(prompt_id=pid, sample_index=i, policy_version=version)
        return Episode(sample, [], error, redone=redone, masked=True)

    async def _attempt(
        self, pid: str, i: int, row: dict, evaluation: bool, tag: str, min_version: int, attempt: int
    ) -> Episode:
        eid = f"{pid}/{i}"
        task = json.dumps(row, default=str)
        if len(task.encode()) > MAX_TASK_BYTES:
            raise RunFailure(
                f"data row {pid}: {len(task.encode())} bytes as JSON; the env service takes at most {MAX_TASK_BYTES}"
            )
        opened = None
        if self.info.black_box:  # the env's agent samples through a gateway session of its own
            room = min(self.cfg.sampling.max_tokens, self.ep.max_episode_tokens)
            opened = await open_session(
                self.gateways,
                eid,
                self._sampling(evaluation, room),
                self.ep.max_episode_tokens,
                min_version,
                tag,
                agent_reward=self.ep.agent_reward,
            )
        try:
            rep, reset = await self.envs.reset(
                ev.ResetRequest(
                    request_id=tag,
                    env=self.ep.env,
                    task_json=task,
                    seed=env_seed(self.cfg.seed, eid),
                    # Unique to this rollout of this coordinator process: a retried Reset finds its
                    # session, while an evaluation run again or a resumed run never reaches an old one.
                    episode_id=f"{self.nonce}/{tag}/{eid}",
                    attempt=attempt,
                    gateway=opened.endpoint if opened else None,
                )
            )
        except BaseException:
            if opened is not None:
                close_soon(self.gateways, opened, tag)
            raise
        silent = ""
        try:
            if opened is None:
                ep = await self._turns(rep, reset, pid, i, evaluation, tag, min_version)
            else:  # one Step: the agent runs to its end; then its tokens, as the gateway recorded them
                await self.envs.step(rep, ev.StepRequest(request_id=tag, session_id=reset.session_id))
                closed = await self.gateways.close_session(opened.replica, opened.key, tag)
                opened = None
                try:
                    ep = episode_of(closed, pid, i)
                except AgentSilent as e:  # nothing to train; the env's verdict still decides below
                    silent, ep = str(e), None
            close = await self.envs.close_session(
                rep, ev.CloseRequest(request_id=tag, session_id=reset.session_id)
            )
        except BaseException:
            if opened is not None:
                close_soon(self.gateways, opened, tag)
            # The episode is lost, the run failing or cancelled: free its session now rather than
            # at its lease's end, unless its replica is gone (nothing to free there).
            if rep.healthy:
                closing = asyncio.ensure_future(
                    self.envs.close_session(rep, ev.CloseRequest(request_id=tag, session_id=reset.session_id))
                )
                closing.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise
        if close.outcome == ev.OUTCOME_REDO:
            raise EpisodeLost(f"env said REDO: {close.failure_kind}: {close.failure_reason[:300]}")
        if ep is None:
            return self._masked(pid, i, "agent_silent", silent, attempt, min_version)
        if close.outcome == ev.OUTCOME_MASK:
            return self._masked(
                pid, i, close.failure_kind or "masked", close.failure_reason, attempt, like=ep
            )
        if close.outcome != ev.OUTCOME_OK:
            raise RunFailure(
                f"env {rep.name}: Close of episode {eid} answered no outcome (a contract violation)"
            )
        ep.result = (
            harness_result(eid, closed, close)
            if self.info.black_box
            else rw.RewardResult(
                sample_id=eid,
                status=rw.SCORE_STATUS_OK,
                reward=close.reward,
                components=dict(close.components),
            )
        )
        return ep

    async def _turns(
        self, rep, reset: ev.ResetResponse, pid: str, i: int, evaluation: bool, tag: str, min_version: int
    ) -> Episode:
        """Sample and step the episode's turns; its Episode without a result yet."""
        eid = f"{pid}/{i}"
        limit = min(x for x in (reset.max_turns, self.info.max_turns, self.ep.max_turns or 0, 256) if x)
        prompt = common_pb2.Prompt(
            prompt_id=f"{eid}/t0",
            messages=common_pb2.ChatMessages(messages=reset.messages, tools_json=reset.tools_json),
        )
        turns: list[common_pb2.Sample] = []
        prefix: list[int] = []
        room = min(self.cfg.sampling.max_tokens, self.ep.max_episode_tokens)
        stepwise = self.ep.turns == "stepwise"
        history = list(reset.messages)  # stepwise: the dialogue, rendered whole for every call
        counts = Episode(common_pb2.Sample(), [], rw.RewardResult())
        for k in range(limit):
            try:
                got = await self.gen.generate(
                    [prompt], self._sampling(evaluation, room), f"{tag}-{eid}-t{k}", min_version, affinity=eid
                )
            except grpc.aio.AioRpcError as e:
                if k and e.code() == grpc.StatusCode.OUT_OF_RANGE:  # the context is full: ends here
                    counts.truncated = True
                    break
                raise
            s = got[prompt.prompt_id][0]
            if s.finish_reason == common_pb2.FINISH_REASON_ABORT:  # the generator gave it up
                raise EpisodeLost(f"generator {s.replica_id}: turn {k} of {eid} was aborted")
            if k and not stepwise:
                check_prefix(prefix, s, f"episode {eid} turn {k}")
            turns.append(s)
            calls = list(s.tool_calls)
            counts.tool_calls += sum(c.parse == common_pb2.TOOL_CALL_PARSE_OK for c in calls)
            counts.parse_failures += sum(c.parse != common_pb2.TOOL_CALL_PARSE_OK for c in calls)
            counts.calls.append(s)
            step = await self.envs.step(
                rep,
                ev.StepRequest(
                    request_id=tag,
                    session_id=reset.session_id,
                    step_index=k,
                    action=action(s, calls),
                ),
            )
            counts.tool_statuses.update(ev.ToolStatus.Name(r.status) for r in step.tool_results)
            counts.answers.append(list(step.observations))
            # A turn cut at its budget, or stopped on an end token that is not the template's end
            # of turn (vLLM stops on every end token the model's config lists), cannot be
            # extended token-exactly: the episode ends there.
            ended = bool(s.completion_token_ids) and s.completion_token_ids[-1] in self.stop_ids
            cut = s.finish_reason != common_pb2.FINISH_REASON_STOP or not (ended or stepwise)
            if step.done or cut or k + 1 == limit:
                counts.truncated = not step.done
                break
            if not step.observations:
                raise EpisodeLost(f"env {rep.name}: step {k} of {eid} is not done and has nothing to answer")
            prefix = [*s.prompt_token_ids, *s.completion_token_ids]
            used = len(prefix) - len(turns[0].prompt_token_ids)
            # The model's context bounds the turn exactly (the generator fits max_tokens to it);
            # the episode's budget is checked here, with an upper estimate of the env's tokens.
            room = turn_room(
                self.cfg.sampling.max_tokens, self.ep.max_episode_tokens, used, step.observations
            )
            if room < 1:
                counts.truncated = True
                break
            if stepwise:
                history += [self._assistant(s), *step.observations]
                nxt = {"messages": common_pb2.ChatMessages(messages=history, tools_json=reset.tools_json)}
            else:
                cont = common_pb2.Continuation(
                    prefix_token_ids=prefix, append=step.observations, tools_json=reset.tools_json
                )
                nxt = {"continuation": cont}
            prompt = common_pb2.Prompt(prompt_id=f"{eid}/t{k + 1}", **nxt)
        if stepwise:
            counts.sample, counts.segments = segments_sample(turns, pid, i), [(t, None) for t in turns]
            counts.mask = [1.0] * sum(len(t.completion_token_ids) for t in turns)
        else:
            counts.sample, counts.mask = assemble(turns, pid, i)
        counts.turns = len(turns)
        versions = [v for t in turns for v in (t.policy_version, *(sp.version for sp in t.version_spans))]
        counts.version_spread = max(versions) - min(versions)
        return counts


MAX_ACTION_TEXT = 256 << 10
"""Most characters of a turn's text sent to the env (StepRequest's bound)."""
MAX_ARGUMENTS = 64 << 10
"""Largest tool call arguments sent to the env (StepRequest's bound)."""


def action(s: common_pb2.Sample, calls: list[common_pb2.ToolCall]) -> ev.Action:
    """The model's turn for the env, within the env service's bounds: a longer text is cut (the
    env reads its end: the final answer), a call with larger arguments goes as a call that did
    not parse, which the env answers with an error the model sees (the model wrote it).

    >>> big = common_pb2.ToolCall(id="c", name="calc", arguments_json="{" + "1" * MAX_ARGUMENTS + "}", parse=1)
    >>> a = action(common_pb2.Sample(text="x" * (MAX_ACTION_TEXT + 5)), [big])
    >>> len(a.text), a.tool_calls[0].parse == common_pb2.TOOL_CALL_PARSE_INVALID_ARGUMENTS
    (262144, True)
    """
    out = []
    for c in calls:
        if len(c.arguments_json) > MAX_ARGUMENTS:
            c = common_pb2.ToolCall(
                id=c.id,
                name=c.name,
                arguments_json=c.arguments_json[:1024],
                parse=common_pb2.TOOL_CALL_PARSE_INVALID_ARGUMENTS,
            )
        out.append(c)
    return ev.Action(text=s.text[-MAX_ACTION_TEXT:], tool_calls=out, finish_reason=s.finish_reason)
