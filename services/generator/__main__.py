"""``python -m relayrl.generator [flags]``: the same as ``relayrl serve generator [flags]``."""

import sys

from relayrl.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", "generator", *sys.argv[1:]]))
