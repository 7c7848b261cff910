"""``python -m relayrl.coordinator [flags]``: the same as ``relayrl serve coordinator [flags]``."""

import sys

from relayrl.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", "coordinator", *sys.argv[1:]]))
