"""``relayrl launch slurm``: an experiment's services as job steps of the Slurm allocation it runs in.
``plan.py`` (where each service goes, pure), ``services.py`` (the ``ServiceSet`` that starts and
stops them, and the job a run is in) and ``job_secrets.py`` (the per-job TLS set and token)."""
