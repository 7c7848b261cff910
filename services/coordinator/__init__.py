"""relayrl coordinator service: it runs experiments. Light on purpose: heavy engines are imported
lazily by the entrypoint.

At the top, the experiment: its config (``config.py``, ``derive.py``, ``schema.py``), its inputs
(``assets.py``), its loop (``loop.py``), the wiring of one run (``drive.py``), the commands that
run it (``run.py``, ``cli.py``), why a run ends (``errors.py``) and the Prometheus metrics
(``metrics.py``). The rest is in rooms by job, each importing only the rooms below it:
``clients/`` (talk to services), ``rollout/`` (make rollouts), ``algorithms/`` (rollouts into
train batches), ``launch/`` (place services), ``service/`` (the standing gRPC service) and
``records/`` (what a run leaves behind)."""
