"""The session table of an env replica: one ``Env`` object per open episode, leased.

Flow: ``open`` (Reset) makes the env and asks it for the first messages; ``step`` hands it the
model's turns; ``close`` asks for the reward and frees the env. Env code runs in a thread pool,
never on the event loop, each call bounded by a time limit (``step_timeout_seconds``, capped
by the caller's deadline).

Invariants:
* (episode_id, attempt) names at most one session: a retried Reset gets the same session.
* One step at a time per session (its lock). Steps are idempotent by index: the last index
  answered is replayed from the stored answer; any other index but the next one is
  FAILED_PRECONDITION, as is a step after the episode is done.
* Work a caller started goes on to its end if the caller goes away (``to_the_end``), so the
  retry finds it recorded.
* A failure of env code is never a reward: Reset fails INTERNAL (``EnvCrashed``); a step that
  raises or overruns ends the episode and Close answers REDO ("env_crashed", "env_timeout").
* A session no call touched for ``lease_seconds`` is expired by the reaper (its env closed);
  closed and expired sessions are remembered ``closed_keep_seconds`` (a retried Close gets the
  same answer, a late Step a NOT_FOUND that says why), then forgotten: only their answer, the env
  itself is freed at once, and at most ``max_sessions`` of them (the oldest go first).
* Tool calls carry their deadline into the sandbox (``tools.call_deadline``): what a call that
  timed out left queued or running there is dropped or killed at that deadline, so it never
  delays another session's call.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from relayrl.common.rpc import (
    FailedPrecondition,
    InvalidRequest,
    NotFound,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    to_the_end,
)
from relayrl.env import metrics
from relayrl.env.base import (
    Action,
    EnvUnavailable,
    GatewayEndpoint,
    Limits,
    Outcome,
    Reward,
    TaskError,
    ToolResult,
    ToolStatus,
)
from relayrl.env.config import EnvConfig
from relayrl.env.registry import ON_REQUEST, EnvSpec
from relayrl.env.tools import cut

logger = logging.getLogger(__name__)

MAX_FAILURE_REASON_CHARS = 960
"""Failure reasons are cut to this, plus a note of what was left out: under the contract's 1,024."""
MAX_COMPONENTS = 64


class EnvCrashed(ServiceError):
    """The env's own code failed while opening a session (not the caller's fault)."""

    code = grpc.StatusCode.INTERNAL


class _Overran(Exception):
    """Env code ran past its time limit (its thread may still be running)."""


@dataclass(frozen=True)
class Opened:
    """What Reset answers."""

    session_id: str
    messages: list[dict]
    tools_json: str
    lease_seconds: float
    max_turns: int


@dataclass(frozen=True)
class StepOut:
    """What Step answers."""

    observations: list[dict]
    done: bool
    tool_results: list[ToolResult]


@dataclass(eq=False)
class Session:
    id: str
    key: tuple[str, int]
    spec: EnvSpec
    fingerprint: str
    opened: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    touched: float = field(default_factory=time.monotonic)
    env: Any = None
    next_index: int = 0
    last: tuple[int, StepOut] | None = None
    done: bool = False
    failure: tuple[str, str] | None = None
    """(failure_kind, failure_reason) once env code failed: Close answers REDO with it."""
    result: Reward | None = None
    """Close's answer, once closed."""
    gone: str = ""
    """Why the session is no longer open (closed, expired); "" while it is."""
    ended_at: float = 0.0

    def touch(self) -> None:
        self.touched = time.monotonic()


def check_messages(messages: object, roles: tuple[str, ...], where: str) -> list[dict]:
    """Chat dicts from env code, checked (ValueError: the env broke its contract)."""
    if not isinstance(messages, list):
        raise ValueError(f"{where} must return a list of messages, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in roles or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} is not a dict with role in {roles} and a string content")
        out.append(
            {k: str(m[k]) for k in ("role", "content", "tool_call_id", "name") if m.get(k) is not None}
        )
    return out


def check_step(answer: object, action: Action) -> StepOut:
    """An env's step answer, checked against the contract (ValueError when broken)."""
    if not isinstance(answer, tuple | list) or len(answer) != 3:
        raise ValueError("step must return (observations, done, tool_results)")
    observations, done, results = answer
    observations = check_messages(observations, ("tool", "user"), "step")
    users = [i for i, m in enumerate(observations) if m["role"] == "user"]
    if len(users) > 1 or (users and users[0] != len(observations) - 1):
        raise ValueError("step: observations are tool messages, then at most one user message")
    if not isinstance(done, bool):
        raise ValueError(f"step: done must be a bool, got {type(done).__name__}")
    if not isinstance(results, list) or not all(
        isinstance(r, ToolResult) and r.status in ToolStatus for r in results
    ):
        raise ValueError("step: tool_results must be a list of ToolResult")
    if len(results) != len(action.tool_calls):
        raise ValueError(f"step: {len(results)} tool results for {len(action.tool_calls)} tool calls")
    return StepOut(observations, done, results)


def check_reward(r: object) -> Reward:
    """An env's reward answer, checked (ValueError/TypeError when broken). A bare number is an
    OK reward without components."""
    if isinstance(r, int | float) and not isinstance(r, bool):
        r = Reward(float(r))
    if not isinstance(r, tuple) or not 1 <= len(r) <= 5:
        raise TypeError(f"reward() must return a Reward, got {type(r).__name__}")
    reward, components, outcome, kind, reason = Reward(*r)
    outcome = Outcome(outcome)
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"reward() returned reward {reward!r:.60}: not a finite number")
    if not isinstance(components, dict) or len(components) > MAX_COMPONENTS:
        raise ValueError(f"reward() components must be a dict of at most {MAX_COMPONENTS} entries")
    for k, v in components.items():
        if (
            not isinstance(k, str)
            or isinstance(v, bool)
            or not isinstance(v, int | float)
            or not math.isfinite(v)
        ):
            raise ValueError(f"reward() component {k!r:.60}: not a name with a finite number")
    if outcome != Outcome.OK and not kind:
        kind = f"env_{outcome.value}"
    return Reward(
        float(reward),
        {k[:128]: float(v) for k, v in components.items()},
        outcome,
        str(kind)[:128],
        cut(str(reason), MAX_FAILURE_REASON_CHARS),
    )


def _fingerprint(env: str, task: dict, seed: int, gateway: GatewayEndpoint | None = None) -> str:
    # The gateway too: a retried Reset must talk to the same gateway session.
    where = None if gateway is None else [gateway.base_url, gateway.api_key, gateway.model]
    raw = json.dumps([env, seed, task, *([where] if where else [])], sort_keys=True, default=str).encode()
    return hashlib.sha256(raw).hexdigest()


class SessionTable:
    def __init__(self, specs: dict[str, EnvSpec], config: EnvConfig):
        self.specs = specs
        self.config = config
        self.limits = Limits(config.tool_timeout_seconds, config.max_tool_output_chars)
        self.executor = ThreadPoolExecutor(config.threads, thread_name_prefix="env")
        self.live: dict[str, Session] = {}
        self.ended: dict[str, Session] = {}
        self.by_key: dict[tuple[str, int], Session] = {}
        self._reaper: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._next = 0
        self.hung = 0  # pool threads still held by env code that ran past its limit
        self.on_ready: Callable[[bool], Any] | None = None  # readiness (health) of the replica
        self.sandbox: Any = None  # the replica's Sandbox, for envs that need one (set by the server)

    # ---- calls -------------------------------------------------------------------------------

    async def open(
        self,
        env: str,
        task: dict,
        seed: int,
        episode_id: str,
        attempt: int,
        limit: float,
        gateway: GatewayEndpoint | None = None,
    ) -> Opened:
        self._serving()
        spec = self.specs.get(env)
        if spec is None:
            how = (
                f" ({env} is served on request: env.plugins: [{ON_REQUEST[env]}])"
                if env in ON_REQUEST
                else ""
            )
            raise InvalidRequest(
                f"unknown env {cut(env, 128)!r}; this replica runs: {', '.join(self.specs)}{how}"
            )
        if spec.cls.black_box and gateway is None:
            raise InvalidRequest(
                f"env {env} runs a black-box agent: its Reset must carry a gateway (ResetRequest.gateway)"
            )
        key, fingerprint = (episode_id, attempt), _fingerprint(env, task, seed, gateway)
        s = self.by_key.get(key)
        if s is not None:
            if s.fingerprint != fingerprint:
                raise FailedPrecondition(
                    f"episode {cut(episode_id, 256)!r} attempt {attempt} is already open with another "
                    "env, task or seed; a new try of an episode takes a new attempt number"
                )
            s.touch()
            return await asyncio.shield(s.opened)  # wait: the first Reset's, bounded by its limit
        if len(self.live) >= self.config.max_sessions:
            raise ResourceExhausted(
                f"{len(self.live)} sessions open, max_sessions {self.config.max_sessions}: retry later "
                "or on another replica"
            )
        self._next += 1
        s = Session(f"{self._next:x}-{fingerprint[:16]}", key, spec, fingerprint)
        self.live[s.id] = self.by_key[key] = s
        metrics.SESSIONS_OPEN.set(len(self.live))
        return await to_the_end(self._open(s, task, seed, limit, gateway))

    async def step(self, session_id: str, index: int, action: Action, limit: float) -> StepOut:
        s = self._session(session_id)
        s.touch()
        self._serving()
        return await to_the_end(self._step(s, index, action, limit))

    async def close(self, session_id: str, limit: float) -> Reward:
        s = self._session(session_id, closed_ok=True)
        s.touch()
        if s.result is not None:
            return s.result
        self._serving()
        return await to_the_end(self._close(s, limit))

    def open_count(self) -> int:
        return len(self.live)

    # ---- inside ------------------------------------------------------------------------------

    def _session(self, session_id: str, closed_ok: bool = False) -> Session:
        s = self.live.get(session_id) or self.ended.get(session_id)
        if s is None:
            raise NotFound(f"no session {cut(session_id, 128)!r} on this replica (unknown, or forgotten)")
        if s.gone and not (closed_ok and s.result is not None):
            raise NotFound(f"session {s.id} is {s.gone}")
        return s

    async def _run(self, fn: Callable[[], Any], limit: float) -> Any:
        """``fn()`` in the pool, for at most ``limit`` seconds (else ``_Overran``). A thread
        cannot be killed: env code that overran keeps its thread until it returns. Once every
        thread is held so, nothing could run any more: the replica says it is unavailable (its
        health NOT_SERVING, its calls UNAVAILABLE, so callers take the work elsewhere) until one
        comes back."""
        fut = asyncio.get_running_loop().run_in_executor(self.executor, fn)
        done, _ = await asyncio.wait({fut}, timeout=limit)  # wait: bounded by limit
        if not done:
            self._hang(+1)
            # retrieved, not reported; its thread is back when it returns
            fut.add_done_callback(lambda f: (f.cancelled() or f.exception(), self._hang(-1)))
            raise _Overran()
        return fut.result()

    def _serving(self) -> None:
        """Unavailable while every env thread is held by env code that overran (``_run``)."""
        if self.hung >= self.config.threads:
            raise Unavailable(
                f"all {self.config.threads} env threads are held by env code that ran past its limit "
                "(a hung env or tool); restart the replica"
            )

    def _hang(self, change: int) -> None:
        was_full = self.hung >= self.config.threads
        self.hung += change
        metrics.HUNG_THREADS.set(self.hung)
        full = self.hung >= self.config.threads
        if full != was_full and self.on_ready is not None:
            self.on_ready(not full)

    def _failed(
        self, s: Session, kind: str, where: str, reason: str, exc: BaseException | None = None
    ) -> None:
        metrics.ENV_FAILURES.labels(s.spec.name, kind, where).inc()
        logger.warning("session %s (%s): %s", s.id, s.spec.name, reason, exc_info=exc)
        s.failure = (kind, cut(reason, MAX_FAILURE_REASON_CHARS))

    async def _open(
        self, s: Session, task: dict, seed: int, limit: float, gateway: GatewayEndpoint | None
    ) -> Opened:
        name = s.spec.name

        def reset() -> list[dict]:
            s.env = s.spec.cls()
            s.env.limits = self.limits
            s.env.gateway = gateway
            if s.spec.cls.needs_sandbox:
                s.env.sandbox = self.sandbox
            return check_messages(s.env.reset(task, seed), ("system", "user", "assistant"), "reset")

        try:
            try:
                messages = await self._run(reset, limit)
            except TaskError as e:
                raise InvalidRequest(f"env {name} refused the task: {e}") from None
            except _Overran:
                self._failed(s, "env_timeout", "reset", f"reset ran past its time limit ({limit:.3g}s)")
                raise EnvCrashed(f"env {name}: reset ran past its time limit ({limit:.3g}s)") from None
            except Exception as e:
                self._failed(s, "env_crashed", "reset", f"reset raised {type(e).__name__}: {e}", e)
                raise EnvCrashed(f"env {name} crashed in reset: {type(e).__name__}: {e}") from None
            if not messages:
                raise EnvCrashed(f"env {name}: reset returned no messages")
        except BaseException as e:
            self.live.pop(s.id, None)
            self.by_key.pop(s.key, None)
            metrics.SESSIONS_OPEN.set(len(self.live))
            self._free_later(s)
            s.opened.set_exception(e)
            s.opened.exception()  # retrieved: a retried Reset that shares it re-raises it
            raise
        metrics.RESETS.labels(name).inc()
        opened = Opened(s.id, messages, s.spec.tools_json, self.config.lease_seconds, s.spec.cls.max_turns)
        s.opened.set_result(opened)
        s.touch()
        return opened

    async def _step(self, s: Session, index: int, action: Action, limit: float) -> StepOut:
        async with s.lock:  # wait: the step before it, bounded by its own limit
            s.touch()
            if s.gone:
                raise NotFound(f"session {s.id} is {s.gone}")
            if s.last is not None and index == s.last[0]:
                metrics.STEP_REPLAYS.labels(s.spec.name).inc()
                return s.last[1]
            if s.done:
                raise FailedPrecondition(
                    f"session {s.id}: the episode is over (done at step_index {s.last[0] if s.last else 0}); "
                    "Close it for the reward"
                )
            if index != s.next_index:
                replay = f" or {s.last[0]} (a retry)" if s.last else ""
                raise FailedPrecondition(
                    f"session {s.id}: step_index {index}; expected {s.next_index}{replay}"
                )
            out = await self._run_step(s, index, action, limit)
            s.last, s.next_index, s.done = (index, out), index + 1, out.done
            s.touch()
            return out

    async def _run_step(self, s: Session, index: int, action: Action, limit: float) -> StepOut:
        name, t0 = s.spec.name, time.monotonic()
        # Tools answer TIMEOUT a little before the step's own limit, so that a slow tool is an
        # observation (the episode trains) rather than an env that overran (REDO).
        s.env.deadline = t0 + limit * 0.9
        try:
            out = check_step(await self._run(lambda: s.env.step(action), limit), action)
        except _Overran:
            self._failed(s, "env_timeout", "step", f"step {index} ran past its time limit ({limit:.3g}s)")
            status = ToolStatus.TIMEOUT
        except EnvUnavailable as e:  # its sandbox (or the like) is down: not a crash of its code
            self._failed(s, e.kind, "step", f"step {index}: {e}")
            status = ToolStatus.CRASHED
        except Exception as e:
            self._failed(s, "env_crashed", "step", f"step {index} raised {type(e).__name__}: {e}", e)
            status = ToolStatus.CRASHED
        if s.failure is not None:  # the episode cannot go on; Close says REDO
            out = StepOut([], True, [ToolResult(c.id, c.name[:128], status) for c in action.tool_calls])
        metrics.STEPS.labels(name).inc()
        metrics.STEP_SECONDS.labels(name).observe(time.monotonic() - t0)
        for r in out.tool_results:
            metrics.TOOL_CALLS.labels(name, r.status.value).inc()
        if out.done or index + 1 >= s.spec.cls.max_turns:
            out = StepOut([], True, out.tool_results)  # done: no observations (the contract)
        return out

    async def _close(self, s: Session, limit: float) -> Reward:
        async with s.lock:  # wait: a step in progress, bounded by its own limit
            if s.result is not None:
                return s.result
            if s.gone:
                raise NotFound(f"session {s.id} is {s.gone}")
            r = await self._score(s, limit)
            s.result = r
            self._end(s, "closed")
            metrics.CLOSES.labels(s.spec.name, r.outcome.value).inc()
        await self._free(s)
        return r

    async def _score(self, s: Session, limit: float) -> Reward:
        if s.failure is not None:
            return Reward(0.0, {}, Outcome.REDO, *s.failure)
        # One budget for both phases: Close must answer within the caller's deadline.
        end = time.monotonic() + limit
        try:
            if not await self._run(lambda: s.env.settle(limit / 2), limit / 2 + 0.1):
                reason = "a tool call was still running at Close"
                return Reward(0.0, {}, Outcome.MASK, "tool_timeout", reason)
            if s.env.tool_timed_out:  # the episode ended on a late tool: no evidence either way
                reason = "a tool call ran past tool_timeout_seconds; the model never saw its answer"
                return Reward(0.0, {}, Outcome.MASK, "tool_timeout", reason)
            return check_reward(await self._run(s.env.reward, max(0.0, end - time.monotonic())))
        except _Overran:
            self._failed(s, "env_timeout", "reward", f"reward ran past its time limit ({limit:.3g}s)")
        except Exception as e:
            self._failed(s, "env_crashed", "reward", f"reward raised {type(e).__name__}: {e}", e)
        return Reward(0.0, {}, Outcome.REDO, *s.failure)

    def _end(self, s: Session, why: str) -> None:
        s.gone, s.ended_at = why, time.monotonic()
        self.live.pop(s.id, None)
        self.ended[s.id] = s
        while len(self.ended) > self.config.max_sessions:  # the oldest ended first (insertion order)
            old = self.ended.pop(next(iter(self.ended)))
            if self.by_key.get(old.key) is old:
                del self.by_key[old.key]
        # A Reset of its (episode, attempt) now opens a new session: a retried Reset only ever
        # races a live one, and a caller that reuses ids after Close (an evaluation repeated)
        # must get a fresh episode, never the closed one.
        if self.by_key.get(s.key) is s:
            del self.by_key[s.key]
        metrics.SESSIONS_OPEN.set(len(self.live))

    async def _free(self, s: Session) -> None:
        """``env.close()``, bounded, then the env dropped (an ended session keeps only its
        answer); a failure is logged, never raised."""
        env, s.env, s.last = s.env, None, None
        if env is None:
            return
        try:
            await self._run(env.close, self.config.step_timeout_seconds)
        except _Overran:
            logger.warning("session %s (%s): close ran past its time limit", s.id, s.spec.name)
        except Exception:
            logger.warning("session %s (%s): close raised", s.id, s.spec.name, exc_info=True)

    def _free_later(self, s: Session) -> None:
        task = asyncio.ensure_future(self._free(s))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- lifetime ----------------------------------------------------------------------------

    def reap(self, now: float | None = None) -> int:
        """Expire sessions idle past their lease (not while a call holds them); forget ended
        ones past ``closed_keep_seconds``. Returns how many expired."""
        now = time.monotonic() if now is None else now
        lease, expired = self.config.lease_seconds, 0
        for s in list(self.live.values()):
            if s.opened.done() and not s.lock.locked() and now - s.touched > lease:
                self._end(s, f"expired: no call for {lease:g}s (lease_seconds)")
                metrics.EXPIRED.labels(s.spec.name).inc()
                logger.info("session %s (%s) expired", s.id, s.spec.name)
                self._free_later(s)
                expired += 1
        for s in list(self.ended.values()):
            if now - s.ended_at > self.config.closed_keep_seconds:
                del self.ended[s.id]
                if self.by_key.get(s.key) is s:
                    del self.by_key[s.key]
        return expired

    def start(self) -> None:
        """Start the reaper (from inside the event loop that serves)."""
        every = min(max(self.config.lease_seconds / 4, 0.01), 5.0)

        async def reap_forever() -> None:
            while True:
                await asyncio.sleep(every)
                try:
                    self.reap()
                except Exception:  # never let the reaper die: sessions would then leak
                    logger.exception("reaping sessions failed")

        self._reaper = asyncio.ensure_future(reap_forever())

    async def shutdown(self) -> None:
        """Stop the reaper, close every open env (bounded), stop the pool."""
        if self._reaper is not None:
            self._reaper.cancel()
        for s in list(self.live.values()):
            self._end(s, "closed: the replica shut down")
            self._free_later(s)
        if self._background:
            await asyncio.wait(set(self._background), timeout=self.config.step_timeout_seconds)
        self.executor.shutdown(wait=False, cancel_futures=True)
