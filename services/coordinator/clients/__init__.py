"""Talking to the services: the coordinator's clients, one module per service.

``rotation.py`` (replicas in and out of rotation, what every pool shares), ``generators.py``,
``rewards.py``, ``envs.py`` and ``gateways.py`` (a pool of each service's replicas: deadlines,
work spread and re-issued, a failed replica probed until it serves again), ``learner.py`` (one
learner role's rank 0) and ``run_clients.py`` (every client of one run, opened and closed
together). They import nothing of the coordinator but its config and errors."""
