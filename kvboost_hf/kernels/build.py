"""Building and loading the C++ kernels of ``csrc/`` (a torch extension registering ``torch.ops.kvboost``).

The extension is compiled once per source/torch/compiler combination into
``<cache>/kernels/<key>/`` (the model cache: ``$KVBOOST_HF_CACHE`` or ``~/.cache/kvboost_hf``),
under a file lock so that concurrent processes build it once, then loaded with
``torch.ops.load_library``. A failed build (no compiler, no sources in an installed wheel) is
logged once as a warning and everything runs on torch's own kernels.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from filelock import FileLock

from kvboost_hf.models.loading import cache_dir

logger = logging.getLogger(__name__)

SOURCES = ("ops.cpp", "row_ops.cpp", "layer.cpp", "decoder.cpp", "draft.cpp", "group_sums.cpp", "gemm_scalar.cpp",
           "gemm_avx2.cpp", "gemm_avx512.cpp", "gemm_avx512bf16.cpp", "head_avx512bf16.cpp",
           "gemm_amx.cpp", "bf16_avx512.cpp")
HEADERS = ("kvboost_kernels.h", "ops.h", "threads.h", "gemm_body.inc", "attention_body.inc", "norm_body.inc",
           "int4_codes.inc", "bf16_round.inc", "with_rows.inc")
# No auto-vectorization: the kernels vectorize by hand, and GCC 12's vectorizer (-O3, AVX-512 target)
# was caught miscompiling an in-order float sum over even and odd elements (the even ones counted twice).
CFLAGS = ("-O3", "-fno-tree-vectorize", "-fopenmp", "-ffp-contract=off", "-fno-math-errno")
DISABLE_ENV = "KVBOOST_HF_KERNELS"  # "0": never build or use the kernels


@dataclass(frozen=True)
class BuildResult:
    """Whether the library is loaded (``library`` is its path), or why not (``reason``)."""

    library: str | None
    reason: str = ""


def source_dir() -> Path | None:
    """``$KVBOOST_HF_CSRC``, else the package's own ``kernels/csrc`` (the sources a wheel carries; in a
    checkout, a link to the top-level ``csrc/``), else ``csrc/`` beside the package."""
    candidates = [Path(os.environ["KVBOOST_HF_CSRC"])] if os.environ.get("KVBOOST_HF_CSRC") else []
    here = Path(__file__).resolve().parent
    candidates += [here / "csrc", here.parents[1] / "csrc"]
    return next((c for c in candidates if all((c / name).is_file() for name in SOURCES + HEADERS)), None)


def compiler() -> str:
    return os.environ.get("CXX", "c++")


def build_key(sources: Path) -> str:
    """Changes with the sources, torch, the compiler name and the Python ABI: a stale build is never loaded; and with
    where the sources are (the build files name them: two checkouts sharing one folder rebuilt it in turn, each
    under the library the other had loaded)."""
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (sources / name).read_bytes())
    digest.update(f"{torch.__version__}|{compiler()}|{platform.python_version()}|{CFLAGS}|".encode())
    digest.update(str(sources.resolve()).encode())
    return digest.hexdigest()[:16]


_lock = threading.Lock()
_result: BuildResult | None = None


def load_library() -> BuildResult:
    """Build (at most once per machine) and load the kernels; never raises."""
    global _result
    with _lock:
        if _result is None:
            _result = _build_and_load()
            if _result.library is None:
                logger.warning("kvboost_hf kernels unavailable (%s): int4/int8 models use torch's kernels",
                               _result.reason)
        return _result


def _build_and_load() -> BuildResult:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return BuildResult(None, f"disabled by {DISABLE_ENV}=0")
    sources = source_dir()
    if sources is None:
        return BuildResult(None, "no csrc/ sources beside the package (set KVBOOST_HF_CSRC to a checkout's csrc/)")
    if shutil.which(compiler()) is None:
        return BuildResult(None, f"no C++ compiler ({compiler()!r} not found; install g++ or set CXX)")
    from torch.utils import cpp_extension

    key = build_key(sources)
    folder = cache_dir() / "kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    name = f"kvboost_kernels_{key}"
    try:
        with FileLock(str(folder / ".build.lock")):
            _clear_stale_baton(folder)
            path = cpp_extension.load(name=name, sources=[str(sources / s) for s in SOURCES],
                                      extra_cflags=list(CFLAGS), extra_ldflags=["-fopenmp"],
                                      extra_include_paths=[str(sources)], build_directory=str(folder),
                                      is_python_module=False, verbose=False)
    except Exception as error:  # a compiler error, a missing ninja, a loader error: all mean "not built"
        text = f"{type(error).__name__}: {error}"
        log = folder / "build-error.log"
        try:
            log.write_text(text + "\n")
        except OSError:
            log = None
        where = f"build failed in {folder}" + (f" (whole output: {log})" if log else "")
        return BuildResult(None, f"{where}: {build_error_summary(text)}")
    logger.info("kvboost_hf kernels loaded from %s", path)
    return BuildResult(str(path))


def build_error_summary(text: str, limit: int = 600) -> str:
    """The lines of a failed build's output that say why: the compiler's ``error`` lines (the first four, once
    each). Where it printed none (killed, say), the tail, which names the failed command."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and not line.startswith(("FAILED:", "ninja:"))
              and " -c " not in line]
    if not errors:
        return text[-limit:]
    summary = " | ".join(dict.fromkeys(errors[:4]))
    return summary if len(summary) <= limit else summary[: limit - 3] + "..."


def _clear_stale_baton(folder: Path) -> None:
    """torch's ``cpp_extension.load`` marks a build in progress with a ``lock`` file in its folder, which a build
    killed mid-way leaves behind; every later load then waits for it forever. Under our own lock (which the OS
    releases when its holder dies) no build of ours is in progress in ``folder``: such a file is stale."""
    stale = folder / "lock"
    if stale.exists():
        logger.warning("removing %s, left by a kernels build that did not finish", stale)
        stale.unlink(missing_ok=True)
