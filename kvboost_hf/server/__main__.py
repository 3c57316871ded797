"""``python -m kvboost_hf.server [flags]`` is ``kvboost-hf serve [flags]``."""

import sys

from kvboost_hf.cli import main
from kvboost_hf.server.heap_pages import restart_with_huge_page_heap

if __name__ == "__main__":
    if sys.argv[1:2] not in (["-h"], ["--help"]):
        restart_with_huge_page_heap()
    sys.exit(main(["serve", *sys.argv[1:]]))
