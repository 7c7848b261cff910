"""``python -m relayrl.env [flags]``: the same as ``relayrl serve env [flags]``."""

import sys

from relayrl.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", "env", *sys.argv[1:]]))
