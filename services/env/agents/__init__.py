"""Programs a harness env (``relayrl.env.harness``) runs in the sandbox, standard library only,
each copied into the job's /tmp as a file: ``bootstrap.py`` (the job's main program: the
gateway's forwarder, then the agent), ``relay.py`` (the byte pump both forwarders use) and the
built-in agent ``calc_agent.py``."""
