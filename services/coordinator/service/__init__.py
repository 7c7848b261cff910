"""The standing gRPC service: ``CoordinatorService`` over a registry of experiments.
``registry.py`` (experiments' lifecycle, metrics, and the task driving each one), ``admission.py``
(what a ``StartExperiment`` checks before it answers OK), ``servicer.py`` (the RPCs) and
``server.py`` (the server: ``relayrl serve coordinator``, and inside ``relayrl run``)."""
