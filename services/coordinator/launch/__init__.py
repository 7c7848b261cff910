"""Placing services: who starts a run's services and where, each a ``ServiceSet``
(``service_set.py``: the addresses the run's clients dial, ``start`` and ``stop``).

``replicas.py`` (the services a run starts, listed once for every launcher), ``processes.py``
(one ``relayrl serve`` process, started and stopped by handle), ``local.py`` (local processes:
the embedded default of ``relayrl run``, with a supervisor), ``ray/`` (Ray actors in placement
groups: ``relayrl launch ray``) and ``slurm/`` (steps of a Slurm job: ``relayrl launch slurm``).
They import nothing of the coordinator but its config: the experiment's run (``run.py``) uses
them, never the other way round."""
