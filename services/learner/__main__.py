"""``python -m relayrl.learner`` / ``relayrl serve learner``: thin entrypoint."""

from relayrl.common.serve_cli import main

if __name__ == "__main__":
    raise SystemExit(main(["learner"]))
