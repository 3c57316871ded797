"""Building, ISA choice and the no-compiler fallback, each in a fresh process."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from kvboost_hf import kernels

PROBE = (
    "import json, logging, io\n"
    "log = io.StringIO(); logging.basicConfig(stream=log, level=logging.WARNING)\n"
    "from kvboost_hf import kernels\n"
    "s = kernels.available(); kernels.available()\n"
    "print(json.dumps({'built': s.built, 'isa': s.isa, 'reason': s.reason, 'log': log.getvalue()}))\n"
)


def probe(**env: str) -> dict:
    return probes(env)[0]


def probes(*envs: dict, timeout: int = 600) -> list[dict]:
    """PROBE's report in a fresh process per environment, the processes side by side (each mostly imports torch)."""
    runs = [subprocess.Popen([sys.executable, "-c", PROBE], env={**os.environ, **env}, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for env in envs]
    reports = []
    for run in runs:
        out, err = run.communicate(timeout=timeout)
        assert run.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def test_without_a_compiler_it_says_why_once_and_torch_kernels_remain(tmp_path: Path):
    got = probe(CXX=str(tmp_path / "no-such-g++"), KVBOOST_HF_CACHE=str(tmp_path))
    assert got["built"] is False and "no C++ compiler" in got["reason"]
    assert got["log"].count("kernels unavailable") == 1


def test_disabled_by_the_environment(tmp_path: Path):
    got = probe(KVBOOST_HF_KERNELS="0", KVBOOST_HF_CACHE=str(tmp_path))
    assert got["built"] is False and "KVBOOST_HF_KERNELS=0" in got["reason"]


def test_a_build_killed_mid_way_does_not_hang_the_next_load(built, tmp_path: Path):
    """torch's cpp_extension leaves its ``lock`` file behind when a build is killed, and waits for it forever at
    every later load; under the package's own lock (released with its holder) it is stale: removed, and the build
    loads (here from a copy of this session's built folder, so nothing compiles)."""
    from kvboost_hf.kernels.build import build_key, source_dir
    from kvboost_hf.models import cache_dir

    key = build_key(source_dir())
    copy = tmp_path / "kernels" / key
    shutil.copytree(cache_dir() / "kernels" / key, copy)
    (copy / "lock").write_text("")  # a killed build's baton
    got = probes({"KVBOOST_HF_CACHE": str(tmp_path)}, timeout=240)[0]
    assert got["built"] is True and not (copy / "lock").exists()


def test_the_path_follows_aten_cpu_capability(built):
    levels = kernels.ISA_LEVELS
    best = levels.index(built.host_isa)
    avx2, default, scalar = probes({"ATEN_CPU_CAPABILITY": "avx2"}, {"ATEN_CPU_CAPABILITY": "default"},
                                   {"KVBOOST_HF_KERNEL_ISA": "scalar"})
    assert avx2["isa"] == levels[min(best, 1)]
    assert default["isa"] == "scalar"
    assert scalar["isa"] == "scalar"
    assert built.isa == levels[min(best, levels.index(kernels.ops.default_isa()))]


def test_a_wheel_carries_the_sources_and_an_installed_package_finds_them(tmp_path: Path):
    """``pip wheel`` packs csrc/ as kvboost_hf/kernels/csrc (a link in the checkout); unpacked without
    the checkout, the package's source_dir() is its own copy."""
    import shutil
    import zipfile

    from kvboost_hf.kernels.build import HEADERS, SOURCES

    root, src = Path(__file__).resolve().parents[2], tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.cfg", "README.md"):
        shutil.copy(root / name, src / name)
    shutil.copytree(root / "csrc", src / "csrc")
    shutil.copytree(root / "kvboost_hf", src / "kvboost_hf", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert (src / "kvboost_hf" / "kernels" / "csrc").is_symlink()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    wheel = zipfile.ZipFile(next((tmp_path / "dist").glob("kvboost_hf-*.whl")))
    packed = {n.rsplit("/", 1)[-1] for n in wheel.namelist() if n.startswith("kvboost_hf/kernels/csrc/")}
    assert packed == set(SOURCES + HEADERS)
    site = tmp_path / "site"
    wheel.extractall(site)
    env = {**{k: v for k, v in os.environ.items() if k != "KVBOOST_HF_CSRC"}, "PYTHONPATH": str(site)}
    probe_code = "from kvboost_hf.kernels.build import source_dir; print(source_dir())"
    found = subprocess.run([sys.executable, "-c", probe_code], cwd=tmp_path, env=env, capture_output=True, text=True,
                           check=True, timeout=120).stdout.strip()
    assert Path(found) == site / "kvboost_hf" / "kernels" / "csrc"


def test_a_failed_compile_names_the_compiler_error_and_keeps_the_whole_output(tmp_path: Path):
    """The reason quotes the compiler's error line (not the tail of the failed command line, which is all the
    last 500 characters held), and the whole output stays in the build folder."""
    from kvboost_hf.kernels.build import source_dir

    broken = tmp_path / "csrc"
    shutil.copytree(source_dir(), broken)
    # A missing header stops each unit at once (an #error would not: GCC goes on through torch's headers, ~60 s)
    for source in broken.glob("*.cpp"):
        source.write_text('#include "planted-by-the-test.h"\n' + source.read_text())
    got = probe(KVBOOST_HF_CSRC=str(broken), KVBOOST_HF_CACHE=str(tmp_path / "cache"))
    assert got["built"] is False and "planted-by-the-test.h" in got["reason"]
    logs = list((tmp_path / "cache" / "kernels").glob("*/build-error.log"))
    assert len(logs) == 1 and str(logs[0]) in got["reason"] and "FAILED" in logs[0].read_text()
    assert got["log"].count("kernels unavailable") == 1


def test_a_build_error_summary_prefers_compiler_errors_to_the_command_tail():
    from kvboost_hf.kernels.build import build_error_summary

    command = "c++ -MMD -MF ops.o.d -O3 -fopenmp -c /src/ops.cpp -o ops.o"
    text = (f"RuntimeError: Error building extension 'k': [1/2] {command}\nFAILED: ops.o\n{command}\n"
            "/src/ops.cpp:3:10: fatal error: Python.h: No such file or directory\ncompilation terminated.\n"
            "ninja: build stopped: subcommand failed.\n")
    assert build_error_summary(text) == "/src/ops.cpp:3:10: fatal error: Python.h: No such file or directory"
    silent = f"RuntimeError: Error building extension 'k': [1/2] {command}\nFAILED: ops.o\n{command}\nninja: build stopped"
    assert build_error_summary(silent, limit=80) == silent[-80:]


# A unit compiled under `#pragma GCC target` compiles what it includes there for that ISA: a library template's
# members (std::vector's, say) would be AVX-512 code that the linker may keep as the one copy the whole library
# calls, on any CPU, and GCC 13 refuses to inline std::allocator into such members at all. So library headers come
# before the pragma (gemm_amx.cpp), where their templates keep the generic target; immintrin.h belongs after it,
# and type_traits holds types only.
_HEADERS_AFTER_A_TARGET = {"immintrin.h", "type_traits"}


def under_target_pragmas(csrc: Path) -> dict[str, str]:
    """Each unit of ``csrc`` compiled under a target pragma, and its text from the pragma on."""
    texts = {name: (csrc / name).read_text() for name in kernels.build.SOURCES}
    return {name: text[text.find("#pragma GCC target"):] for name, text in texts.items()
            if "#pragma GCC target" in text}


def headers_under_target_pragmas(csrc: Path) -> list[str]:
    """Each library header that a unit of ``csrc`` includes after its target pragma (itself or through a body it
    includes there), as ``unit: <header>``."""
    found = []
    for name, tail in under_target_pragmas(csrc).items():
        for body in [tail] + [(csrc / inc).read_text() for inc in re.findall(r'#include "([^"]+)"', tail)]:
            found += [f"{name}: <{h}>" for h in re.findall(r"#include <([^>]+)>", body)
                      if h not in _HEADERS_AFTER_A_TARGET]
    return found


def test_isa_units_include_no_library_header_under_their_target_pragma(tmp_path: Path):
    from kvboost_hf.kernels.build import source_dir

    assert headers_under_target_pragmas(source_dir()) == []
    planted = tmp_path / "csrc"
    shutil.copytree(source_dir(), planted)
    unit = planted / "gemm_avx512.cpp"
    unit.write_text(unit.read_text().replace("#include <immintrin.h>", "#include <immintrin.h>\n#include <vector>"))
    body = planted / "gemm_body.inc"
    body.write_text("#include <algorithm>\n" + body.read_text())
    assert headers_under_target_pragmas(planted) == [
        "gemm_avx2.cpp: <algorithm>", "gemm_avx512.cpp: <vector>", "gemm_avx512.cpp: <algorithm>"]


def test_isa_units_define_no_code_the_linker_could_share(built):
    """No weak (vague-linkage) definitions in an ISA unit's object: such a copy, compiled for that ISA, is the one
    the linker may keep for every caller in the library."""
    from kvboost_hf.kernels.build import load_library

    folder = Path(load_library().library).parent
    nm = shutil.which("nm")
    assert nm is not None, "nm (binutils, installed with g++) is needed to read the kernels' objects"
    units = list(under_target_pragmas(kernels.build.source_dir()))
    assert {"gemm_avx2.cpp", "gemm_avx512.cpp", "gemm_amx.cpp"} <= set(units)
    shared = {}
    for name in units:
        listing = subprocess.run([nm, "--defined-only", "-P", str(folder / (Path(name).stem + ".o"))],
                                 capture_output=True, text=True, check=True).stdout
        symbols = [line.split() for line in listing.splitlines() if line.strip()]
        shared[name] = [s[0] for s in symbols if s[1] in "WwVvu" and not s[0].startswith("DW.ref.")]
    assert shared == {name: [] for name in units}
