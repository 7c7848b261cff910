"""Run id, step and policy version in every log line of every service, so that one ``grep`` follows
a step through the coordinator, the generators, the reward replicas and the learner.

Callers send the three as request metadata (``metadata(...)``); ``ContextInterceptor`` on every
server binds them to context variables for the duration of the call; ``ContextFilter`` puts the
current values on every log record, and ``FORMAT`` prints them. Code that knows better (a
learner rank running a step, the coordinator's loop) binds them itself with ``bound(...)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
from collections.abc import Iterator

import grpc

RUN_ID = contextvars.ContextVar("relayrl_run_id", default="-")
STEP = contextvars.ContextVar("relayrl_step", default="-")
VERSION = contextvars.ContextVar("relayrl_policy_version", default="-")
KEYS = {"x-relayrl-run-id": RUN_ID, "x-relayrl-step": STEP, "x-relayrl-policy-version": VERSION}
FORMAT = "%(asctime)s %(levelname)s %(name)s [run %(run_id)s step %(step)s v%(policy_version)s]: %(message)s"
MAX_VALUE_CHARS = 128


def metadata(
    run_id: str = "", step: int | None = None, version: int | None = None
) -> tuple[tuple[str, str], ...]:
    """Request metadata carrying what is known (empty values are left out)."""
    pairs = [("x-relayrl-run-id", run_id), ("x-relayrl-step", step), ("x-relayrl-policy-version", version)]
    return tuple((k, str(v)) for k, v in pairs if v not in (None, ""))


def current() -> tuple[tuple[str, str], ...]:
    """Metadata carrying the values bound here, for a call made on their behalf."""
    return tuple((k, var.get()) for k, var in KEYS.items() if var.get() != "-")


def bound(run_id: str | None = None, step: int | None = None, version: int | None = None):
    """Bind the given values for a ``with`` block (None leaves a value as it is)."""
    pairs = ((RUN_ID, run_id), (STEP, step), (VERSION, version))
    return _bind({var: str(value) for var, value in pairs if value is not None})


class ContextFilter(logging.Filter):
    """Puts the bound run id, step and policy version on each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.run_id, record.step, record.policy_version = RUN_ID.get(), STEP.get(), VERSION.get()
        return True


def configure(level: str | int = "WARNING") -> None:
    """Root logging with ``FORMAT`` and the context on every record (a process's entrypoint)."""
    logging.basicConfig(level=level, format=FORMAT)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ContextFilter) for f in handler.filters):
            handler.addFilter(ContextFilter())


def _values(details: grpc.HandlerCallDetails) -> dict[contextvars.ContextVar, str]:
    return {KEYS[k]: v for k, v in (details.invocation_metadata or ()) if k in KEYS and isinstance(v, str)}


class ContextInterceptor(grpc.aio.ServerInterceptor):
    """Binds the caller's run id, step and policy version while its call is handled."""

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        values = _values(details)
        if handler is None or not values:
            return handler

        def wrap(fn):
            if fn is None:
                return None
            if inspect.isasyncgenfunction(fn):

                async def stream(request, context):
                    with _bind(values):
                        async for item in fn(request, context):
                            yield item

                return stream

            async def unary(request, context):
                with _bind(values):
                    return await fn(request, context)

            return unary

        return handler._replace(
            unary_unary=wrap(handler.unary_unary),
            unary_stream=wrap(handler.unary_stream),
            stream_unary=wrap(handler.stream_unary),
            stream_stream=wrap(handler.stream_stream),
        )


@contextlib.contextmanager
def _bind(values: dict[contextvars.ContextVar, str]) -> Iterator[None]:
    tokens = [(var, var.set(v[:MAX_VALUE_CHARS])) for var, v in values.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)
