"""``python -m relayrl.reward [flags]``: the same as ``relayrl serve reward [flags]``."""

import sys

from relayrl.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", "reward", *sys.argv[1:]]))
