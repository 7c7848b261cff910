"""``python -m relayrl.gateway [flags]``: the same as ``relayrl serve gateway [flags]``."""

import sys

from relayrl.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", "gateway", *sys.argv[1:]]))
