"""``python -m kvboost_hf.kernels``: build the kernels now (the Makefile does, once) and say what runs."""

from __future__ import annotations

import logging
import sys

from kvboost_hf.kernels import available


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    status = available()
    if status.built:
        sys.stdout.write(f"kvboost_hf kernels: built, path {status.isa} (CPU best: {status.host_isa})\n")
        return 0
    sys.stdout.write(f"kvboost_hf kernels: not built ({status.reason}); torch's kernels will be used\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
