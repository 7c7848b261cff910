"""``python -m relayrl.reward`` / ``relayrl serve reward``: thin entrypoint."""

from relayrl.common.serve_cli import main

if __name__ == "__main__":
    raise SystemExit(main(["reward"]))
