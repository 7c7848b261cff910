"""``python -m relayrl.learner [flags]``: the same as ``relayrl serve learner [flags]``."""

import sys

from relayrl.cli import main

if __name__ == "__main__":
    raise SystemExit(main(["serve", "learner", *sys.argv[1:]]))
