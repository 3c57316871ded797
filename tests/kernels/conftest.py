"""The kernels, built once per session; tests need them (a build failure fails, it never skips)."""

from __future__ import annotations

import pytest

from kvboost_hf import kernels


@pytest.fixture(scope="session")
def built() -> kernels.KernelStatus:
    status = kernels.available()
    assert status.built, f"the kernels must build in CI (g++ and ninja are installed by make): {status.reason}"
    return status


@pytest.fixture
def isa_paths(built):
    """Every ISA path this CPU can run, restoring the default path afterwards."""
    paths = list(kernels.ISA_LEVELS[: kernels.ISA_LEVELS.index(built.host_isa) + 1])
    yield paths
    kernels.select_isa(None)
