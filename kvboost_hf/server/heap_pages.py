"""``kvboost-hf serve`` with malloc's heap on transparent huge pages: the process restarts itself once with
``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc 2.35+), which glibc reads only at process start.

The weights are put on huge pages in process (:mod:`kvboost_hf.models.huge_pages`); the rest of the memory a request
touches (activations, the KV cache, the store's tensors, the interpreter's objects) comes from malloc. On a VM, where
each TLB miss walks two page tables and the host reclaims idle guest memory in 4 KiB units, that memory on 4 KiB pages
measured (Gemma-3-270M, 2 vCPUs of a Xeon VM, 2026-11-30): a warm request from a 2,048-token reused prompt 134-165 ms
back to back and 283-511 ms after the process slept 1 s, against 97-107 and 136-167 ms with the tunable; an int4 model's
``generate`` 29.2-29.5 against 25.3-28.2 ms a token (docs/kernels.md, "Weights on huge pages").

Only the command line restarts (never a caller of :func:`kvboost_hf.cli.main` with its own arguments), only on
Linux with glibc 2.35 or later and transparent huge pages not ``never``, only where ``GLIBC_TUNABLES`` does not set
malloc's huge pages already; ``KVBOOST_HF_HUGE_PAGES=0`` turns it off with the weights' huge pages. ``execve`` keeps
the process id, its open files and its environment (plus the tunable and a marker that stops a second restart).
"""

from __future__ import annotations

import logging
import os
import re
import sys
from pathlib import Path

from kvboost_hf.models.huge_pages import huge_pages_allowed

logger = logging.getLogger(__name__)

TUNABLE = "glibc.malloc.hugetlb=1"
RESTARTED = "KVBOOST_HF_HEAP_HUGE_PAGES"  # set in the restarted process's environment: the tunable it added
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def glibc_version() -> tuple[int, int] | None:
    """The C library's version where it is glibc (``os.confstr``), else None."""
    try:
        name = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        return None
    found = re.fullmatch(r"glibc (\d+)\.(\d+).*", name)
    return (int(found.group(1)), int(found.group(2))) if found else None


def huge_page_tunables(environ: dict | None = None) -> str | None:
    """``GLIBC_TUNABLES`` with malloc's huge pages added, or None where the process should not restart for them
    (turned off, already restarted or set, not Linux with glibc 2.35+, transparent huge pages ``never``)."""
    environ = os.environ if environ is None else environ
    current = environ.get("GLIBC_TUNABLES", "")
    if (not huge_pages_allowed(environ) or RESTARTED in environ or "glibc.malloc.hugetlb" in current
            or not sys.platform.startswith("linux") or (glibc_version() or (0, 0)) < (2, 35)):
        return None
    try:
        if "[never]" in THP_ENABLED.read_text():
            return None
    except OSError:
        return None
    return f"{current}:{TUNABLE}" if current else TUNABLE


def restart_with_huge_page_heap() -> None:
    """Replace this process with itself, started again with malloc's heap on huge pages, where
    :func:`huge_page_tunables` says to; returns only where it does not restart (or the restart failed: logged)."""
    tunables = huge_page_tunables()
    argv = getattr(sys, "orig_argv", None)
    if tunables is None or not argv or not sys.executable:
        return
    environ = {**os.environ, "GLIBC_TUNABLES": tunables, RESTARTED: TUNABLE}
    try:
        os.execve(sys.executable, [sys.executable, *argv[1:]], environ)
    except OSError as err:  # (execve returns only on failure)
        logger.warning("could not restart with %s (malloc's heap stays on 4 KiB pages): %s", TUNABLE, err)


def log_restart() -> None:
    """One line saying this process runs with the tunable the restart added (nothing where it did not restart)."""
    if RESTARTED in os.environ:
        logger.info("malloc's heap on transparent huge pages (GLIBC_TUNABLES=%s; KVBOOST_HF_HUGE_PAGES=0 turns it "
                    "off)", os.environ.get("GLIBC_TUNABLES", ""))
