"""``relayrl launch slurm``: an experiment's services as job steps of the Slurm allocation it runs in."""
