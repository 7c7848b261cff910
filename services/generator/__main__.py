"""``python -m relayrl.generator`` / ``relayrl serve generator``: thin entrypoint."""

from relayrl.common.serve_cli import main

if __name__ == "__main__":
    raise SystemExit(main(["generator"]))
