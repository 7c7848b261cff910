"""``relayrl launch ray`` deciding that a learner rank is dead, without a Ray cluster: only a rank
whose process exited or whose actor Ray reports dead, or one that left several health checks in a
row unanswered, stops the learner; one slow answer does not (it once stopped every rank)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from relayrl.coordinator.config import ExperimentConfig
from relayrl.coordinator.launch.ray import services as ray_launch
from relayrl.coordinator.launch.ray.services import TIMED_OUT, RankLiveness, RayServices, poll_outcome


def _cfg(**ray) -> ExperimentConfig:
    return ExperimentConfig.model_validate({"model": {"path": "m"}, "data": {"train": "t"}, "ray": ray})


def test_a_slow_answer_is_not_a_death_but_several_in_a_row_are():
    live = RankLiveness(dead_after=3)
    assert live.dead({"learner": None, "learner-rank1": TIMED_OUT}) == {}
    assert live.dead({"learner": None, "learner-rank1": TIMED_OUT}) == {}
    assert live.dead({"learner": None, "learner-rank1": None}) == {}  # it answered: the count restarts
    assert live.dead({"learner": TIMED_OUT, "learner-rank1": TIMED_OUT}) == {}
    assert live.dead({"learner": None, "learner-rank1": TIMED_OUT}) == {}
    assert live.dead({"learner": None, "learner-rank1": TIMED_OUT}) == {
        "learner-rank1": "no answer to 3 health checks in a row"
    }


def test_an_exit_or_a_dead_actor_is_a_death_at_once():
    live = RankLiveness(dead_after=3)
    assert live.dead({"learner": None, "learner-rank1": 1}) == {"learner-rank1": 1}
    assert live.dead({"learner": -9, "learner-rank1": None}) == {"learner": -9}


def test_what_rays_errors_say_about_an_actor():
    exceptions = pytest.importorskip("ray.exceptions")
    assert poll_outcome(exceptions.ActorDiedError()) == -9
    assert poll_outcome(exceptions.RayActorError()) == -9
    # A RayActorError too, but a temporary one: Ray may reach the actor again.
    assert poll_outcome(exceptions.ActorUnavailableError("node busy", None)) == TIMED_OUT
    assert poll_outcome(exceptions.GetTimeoutError()) == TIMED_OUT
    with pytest.raises(ValueError):
        poll_outcome(ValueError("not Ray's"))


def test_the_watch_stops_the_learner_after_consecutive_unanswered_checks_only(tmp_path, monkeypatch):
    services = RayServices(_cfg(dead_after_timeouts=3), tmp_path)
    services.ranks = ["learner", "learner-rank1"]
    slow, fine = {"learner": None, "learner-rank1": TIMED_OUT}, {"learner": None, "learner-rank1": None}
    polls = iter([slow, slow, fine, slow, slow, slow])  # more would raise StopIteration: a failure
    seen, stopped = [], []

    def poll(names=None):
        seen.append(names)
        return next(polls)

    monkeypatch.setattr(ray_launch, "WATCH_EVERY", 0.0)
    monkeypatch.setattr(services, "_poll", poll)
    monkeypatch.setattr(services, "_stop_hosts", lambda names: stopped.append((list(names), len(seen))))
    services._watch()
    assert stopped == [(["learner", "learner-rank1"], 6)]  # at the third unanswered check in a row


def test_a_health_check_waits_for_all_actors_at_most_the_configured_deadline(tmp_path, monkeypatch):
    """``_poll`` gives every actor one deadline together; an actor not done by then is TIMED_OUT,
    one Ray reports dead is -9 (a fake ``ray`` module stands in for the cluster)."""
    exceptions = pytest.importorskip("ray.exceptions")
    waited = []

    class Ref:
        def __init__(self, outcome):
            self.outcome = outcome

    def wait(refs, num_returns, timeout):
        waited.append(timeout)
        return [r for r in refs if r.outcome != "hung"], [r for r in refs if r.outcome == "hung"]

    def get(ref, timeout):
        assert timeout == 0  # only refs that are done are read
        if isinstance(ref.outcome, BaseException):
            raise ref.outcome
        return ref.outcome

    monkeypatch.setitem(
        __import__("sys").modules, "ray", SimpleNamespace(wait=wait, get=get, exceptions=exceptions)
    )
    services = RayServices(_cfg(call_timeout_seconds=7), tmp_path)
    actor = lambda outcome: SimpleNamespace(poll=SimpleNamespace(remote=lambda: Ref(outcome)))  # noqa: E731
    services.hosts = {
        "a": actor(None),
        "b": actor(3),
        "c": actor("hung"),
        "d": actor(exceptions.ActorDiedError()),
    }
    assert services._poll() == {"a": None, "b": 3, "c": TIMED_OUT, "d": -9}
    assert waited == [7]
