"""relayrl learner service. Light on purpose: heavy engines are imported lazily by the entrypoint."""
