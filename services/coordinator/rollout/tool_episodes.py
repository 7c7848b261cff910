"""Tool episodes: the model's turns sampled by the coordinator, each answered by the env (Step: tool
results or feedback), for an env whose tools the model calls itself. The lifecycle (attempts,
redo, masking, the env's session) is ``episodes.EpisodeSource``'s.

How a turn follows the one before (``episodes.turns``) is one small class each:
``ExactTurns``: the next turn's prompt is the exact tokens so far extended with the env's answer
(``common.v1.Continuation``: the generator renders only the new messages); every turn's prompt
must start with the previous turn's exact tokens (``PrefixViolation`` stops the run), and
``trajectories.assemble`` makes the episode one learner sample whose loss mask leaves out the
env's tokens. ``StepwiseTurns``: every call renders the dialogue whole; the episode trains as one
learner sample per call, each with the episode's advantage.

Turns of one episode go to one generator replica (``affinity``), where the earlier turns' tokens
are in the prefix cache."""

from __future__ import annotations

import grpc
from relayrl.common.trajectories import assemble, check_prefix, segments_sample, turn_room
from relayrl.common.v1 import common_pb2
from relayrl.coordinator.clients.envs import EpisodeLost
from relayrl.coordinator.clients.rotation import Replica
from relayrl.coordinator.rollout.episode import Episode
from relayrl.coordinator.rollout.episodes import Attempt, EpisodeSource
from relayrl.env.v1 import env_pb2 as ev
from relayrl.reward.v1 import reward_pb2 as rw

MAX_ACTION_TEXT = 256 << 10
"""Most characters of a turn's text sent to the env (StepRequest's bound)."""
MAX_ARGUMENTS = 64 << 10
"""Largest tool call arguments sent to the env (StepRequest's bound)."""


class ExactTurns:
    """``episodes.turns: exact``: turn by turn on the exact tokens (see the module doc)."""

    def __init__(self, reset: ev.ResetResponse, tool_format: str):
        self.tools_json = reset.tools_json

    def check(self, prefix: list[int], s: common_pb2.Sample, where: str) -> None:
        check_prefix(prefix, s, where)

    def goes_on(self, s: common_pb2.Sample, stop_ids: list[int]) -> bool:
        """Whether turn ``s`` can be extended: a turn cut at its budget, or stopped on an end token
        that is not the template's end of turn (vLLM stops on every end token the model's config
        lists), cannot be extended token-exactly."""
        ended = bool(s.completion_token_ids) and s.completion_token_ids[-1] in stop_ids
        return s.finish_reason == common_pb2.FINISH_REASON_STOP and ended

    def next_input(self, s: common_pb2.Sample, prefix: list[int], answer) -> dict:
        cont = common_pb2.Continuation(prefix_token_ids=prefix, append=answer, tools_json=self.tools_json)
        return {"continuation": cont}

    def learner_sample(self, ep: Episode, turns: list[common_pb2.Sample], pid: str, i: int) -> None:
        ep.sample, ep.mask = assemble(turns, pid, i)


class StepwiseTurns:
    """``episodes.turns: stepwise``: every call renders the dialogue so far whole (see the module
    doc)."""

    def __init__(self, reset: ev.ResetResponse, tool_format: str):
        self.tools_json = reset.tools_json
        self.tool_format = tool_format
        self.history = list(reset.messages)

    def check(self, prefix: list[int], s: common_pb2.Sample, where: str) -> None:
        pass  # every call is rendered anew: no prefix to keep

    def goes_on(self, s: common_pb2.Sample, stop_ids: list[int]) -> bool:
        return s.finish_reason == common_pb2.FINISH_REASON_STOP

    def next_input(self, s: common_pb2.Sample, prefix: list[int], answer) -> dict:
        self.history += [self._assistant(s), *answer]
        return {"messages": common_pb2.ChatMessages(messages=self.history, tools_json=self.tools_json)}

    def _assistant(self, s: common_pb2.Sample) -> common_pb2.ChatMessage:
        """The model's turn as a message to render again: its text outside the tool calls and the
        calls that parsed (one that did not cannot be rendered as a call)."""
        ok = [c for c in s.tool_calls if c.parse == common_pb2.TOOL_CALL_PARSE_OK]
        return common_pb2.ChatMessage(
            role="assistant", content=s.content if self.tool_format else s.text, tool_calls=ok
        )

    def learner_sample(self, ep: Episode, turns: list[common_pb2.Sample], pid: str, i: int) -> None:
        ep.sample, ep.segments = segments_sample(turns, pid, i), [(t, None) for t in turns]
        ep.mask = [1.0] * sum(len(t.completion_token_ids) for t in turns)


TURNS = {"exact": ExactTurns, "stepwise": StepwiseTurns}
"""How a turn follows the one before, by ``episodes.turns``."""


class ToolEpisodes(EpisodeSource):
    """Episodes whose turns the coordinator samples and steps (see the module doc)."""

    async def _play(self, a: Attempt, rep: Replica, reset: ev.ResetResponse) -> Episode:
        """Sample and step the episode's turns; its Episode without a result yet."""
        eid, pid, i = a.eid, a.pid, a.index
        limit = min(x for x in (reset.max_turns, self.info.max_turns, self.ep.max_turns or 0, 256) if x)
        prompt = common_pb2.Prompt(
            prompt_id=f"{eid}/t0",
            messages=common_pb2.ChatMessages(messages=reset.messages, tools_json=reset.tools_json),
        )
        turns: list[common_pb2.Sample] = []
        prefix: list[int] = []
        room = min(self.cfg.sampling.max_tokens, self.ep.max_episode_tokens)
        shape = TURNS[self.ep.turns](reset, self.ep.tool_format)
        counts = Episode(common_pb2.Sample(), [], rw.RewardResult())
        for k in range(limit):
            s = await self._turn(a, prompt, room, k)
            if s is None:  # the context is full: the episode ends here
                counts.truncated = True
                break
            if k:
                shape.check(prefix, s, f"episode {eid} turn {k}")
            turns.append(s)
            calls = list(s.tool_calls)
            counts.tool_calls += sum(c.parse == common_pb2.TOOL_CALL_PARSE_OK for c in calls)
            counts.parse_failures += sum(c.parse != common_pb2.TOOL_CALL_PARSE_OK for c in calls)
            counts.calls.append(s)
            step = await self.envs.step(
                rep,
                ev.StepRequest(
                    request_id=a.tag,
                    session_id=reset.session_id,
                    step_index=k,
                    action=action(s, calls),
                ),
            )
            counts.tool_statuses.update(ev.ToolStatus.Name(r.status) for r in step.tool_results)
            counts.answers.append(list(step.observations))
            if step.done or not shape.goes_on(s, self.stop_ids) or k + 1 == limit:
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
            prompt = common_pb2.Prompt(
                prompt_id=f"{eid}/t{k + 1}", **shape.next_input(s, prefix, step.observations)
            )
        shape.learner_sample(counts, turns, pid, i)
        counts.turns = len(turns)
        versions = [v for t in turns for v in (t.policy_version, *(sp.version for sp in t.version_spans))]
        counts.version_spread = max(versions) - min(versions)
        return counts

    async def _turn(
        self, a: Attempt, prompt: common_pb2.Prompt, room: int, k: int
    ) -> common_pb2.Sample | None:
        """The model's turn ``k`` on ``prompt``, at most ``room`` tokens, on the episode's replica;
        None when a later turn no longer fits the model's context (the generator answers
        OUT_OF_RANGE with ``fit_to_context``)."""
        try:
            got = await self.gen.generate(
                [prompt],
                self._sampling(a.evaluation, room),
                f"{a.tag}-{a.eid}-t{k}",
                a.min_version,
                affinity=a.eid,
            )
        except grpc.aio.AioRpcError as e:
            if k and e.code() == grpc.StatusCode.OUT_OF_RANGE:
                return None
            raise
        s = got[prompt.prompt_id][0]
        if s.finish_reason == common_pb2.FINISH_REASON_ABORT:  # the generator gave it up
            raise EpisodeLost(f"generator {s.replica_id}: turn {k} of {a.eid} was aborted")
        return s


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
