"""An OpenEnv environment written as OpenEnv's guide writes one (``models.py``: an Action and an
Observation; ``server/..._environment.py``: the Environment; ``server/app.py``: ``create_app``),
and ``serve``, which runs its server on loopback in a thread, as ``uvicorn server.app:app`` would.

The game: guess the secret (the row's ``secret``, else drawn from the seed), told higher or lower;
reward 1 on the step that finds it. Rows with ``silent`` get observations without a reward; a
guess of 7 in a row with ``boom`` raises in the env (the server answers EXECUTION_ERROR)."""

from __future__ import annotations

import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    """Guess the secret number."""

    number: int = Field(..., ge=1, le=9, description="Your guess, 1 to 9.")


class GuessObservation(Observation):
    feedback: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    resets = 0  # episodes begun on this server (the tests count them)

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid.uuid4()), step_count=0)

    def reset(self, seed=None, episode_id=None, secret=None, silent=False, boom=False, **kwargs):
        self._state = State(episode_id=episode_id or str(uuid.uuid4()), step_count=0)
        GuessEnvironment.resets += 1
        self.secret = int(secret) if secret is not None else random.Random(seed).randint(1, 9)
        self.silent, self.boom = bool(silent), bool(boom)
        return GuessObservation(feedback="Guess my number (1-9).", reward=None if silent else 0.0)

    def step(self, action: GuessAction, timeout_s=None, **kwargs) -> GuessObservation:
        self._state.step_count += 1
        if self.boom and action.number == 7:
            raise RuntimeError("the env broke on 7")
        found = action.number == self.secret
        feedback = "Correct!" if found else ("Higher." if action.number < self.secret else "Lower.")
        reward = None if self.silent else float(found)
        return GuessObservation(feedback=feedback, reward=reward, done=found)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess", max_concurrent_envs=256)


@contextmanager
def serve() -> Iterator[str]:
    """The server on 127.0.0.1 (a free port) in a thread; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the OpenEnv server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
