"""``kvboost-hf serve`` restarts itself once with malloc's heap on huge pages (``kvboost_hf.server.heap_pages``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvboost_hf.server import heap_pages
from kvboost_hf.server.heap_pages import RESTARTED, TUNABLE, huge_page_tunables

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def capable_host(monkeypatch, tmp_path):
    """A Linux host with glibc 2.36 and transparent huge pages on madvise, whatever this one is."""
    enabled = tmp_path / "enabled"
    enabled.write_text("always [madvise] never\n")
    monkeypatch.setattr(heap_pages, "THP_ENABLED", enabled)
    monkeypatch.setattr(heap_pages, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(sys, "platform", "linux")
    return enabled


def test_the_tunable_is_added_where_the_host_takes_it(capable_host, monkeypatch):
    assert huge_page_tunables({}) == TUNABLE
    assert huge_page_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == f"glibc.malloc.arena_max=2:{TUNABLE}"
    assert huge_page_tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # the user's own choice
    assert huge_page_tunables({"KVBOOST_HF_HUGE_PAGES": "0"}) is None
    assert huge_page_tunables({RESTARTED: TUNABLE}) is None  # restarted already: never a second time
    capable_host.write_text("always madvise [never]\n")
    assert huge_page_tunables({}) is None
    capable_host.unlink()
    assert huge_page_tunables({}) is None  # no transparent huge pages at all
    capable_host.write_text("[always] madvise never\n")
    monkeypatch.setattr(heap_pages, "glibc_version", lambda: (2, 34))  # before the tunable existed
    assert huge_page_tunables({}) is None
    monkeypatch.setattr(heap_pages, "glibc_version", lambda: None)  # another C library
    assert huge_page_tunables({}) is None
    monkeypatch.setattr(heap_pages, "glibc_version", lambda: (2, 36))
    monkeypatch.setattr(sys, "platform", "darwin")
    assert huge_page_tunables({}) is None


def test_glibc_version_reads_the_c_library(monkeypatch):
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36")
    assert heap_pages.glibc_version() == (2, 36)
    monkeypatch.setattr(os, "confstr", lambda name: "musl 1.2")
    assert heap_pages.glibc_version() is None

    def unknown(name):
        raise ValueError(name)

    monkeypatch.setattr(os, "confstr", unknown)
    assert heap_pages.glibc_version() is None


def test_a_failed_restart_is_logged_and_serving_goes_on(capable_host, monkeypatch, caplog):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(RESTARTED, raising=False)
    monkeypatch.delenv("KVBOOST_HF_HUGE_PAGES", raising=False)
    calls = []

    def refused(path, argv, environ):
        calls.append((path, argv, environ))
        raise PermissionError("exec refused")

    monkeypatch.setattr(os, "execve", refused)
    monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "kvboost_hf.server", "--port", "9"])
    heap_pages.restart_with_huge_page_heap()
    (path, argv, environ), = calls
    assert path == sys.executable and argv == [sys.executable, "-m", "kvboost_hf.server", "--port", "9"]
    assert environ["GLIBC_TUNABLES"] == TUNABLE and environ[RESTARTED] == TUNABLE
    assert "could not restart" in caplog.text and "exec refused" in caplog.text


def run_server_module(env: dict) -> subprocess.CompletedProcess:
    """``python -m kvboost_hf.server`` stopped by a bad ``OMP_NUM_THREADS`` (checked after the restart's log line)."""
    env = {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "lots"}
    return subprocess.run([sys.executable, "-m", "kvboost_hf.server", "--log-level", "info"], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_server_process_restarts_once_with_the_tunable():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", RESTARTED, "KVBOOST_HF_HUGE_PAGES")}
    expected = huge_page_tunables(env)
    done = run_server_module(env)
    assert done.returncode == 2 and "kvboost-hf serve: error: OMP_NUM_THREADS=lots" in done.stderr
    restarted = f"malloc's heap on transparent huge pages (GLIBC_TUNABLES={TUNABLE};"
    if expected is None:  # a host without glibc 2.35+ or transparent huge pages: no restart
        assert "malloc's heap" not in done.stderr
    else:
        assert done.stderr.count(restarted) == 1
    off = run_server_module({**env, "KVBOOST_HF_HUGE_PAGES": "0"})
    assert off.returncode == 2 and "malloc's heap" not in off.stderr
