"""The Ray wing: ``relayrl launch ray`` places an experiment's services on a Ray cluster.
``config.py`` (the experiment's ``ray`` section), ``plan.py`` (placement groups and rank
assignment, pure), ``actor.py`` (the actor that hosts one service process on its node) and
``services.py`` (the ``ServiceSet`` that starts, watches and stops them, and the cluster a run
joins). Importing this package imports no Ray: only ``services`` and ``actor`` do, when called."""
