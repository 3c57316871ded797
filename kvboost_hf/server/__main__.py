"""``python -m kvboost_hf.server [flags]`` is ``kvboost-hf serve [flags]``."""

import sys

from kvboost_hf.cli import main

if __name__ == "__main__":
    sys.exit(main(["serve", *sys.argv[1:]]))
