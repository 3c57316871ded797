"""Our import-linter contract types (tests/import_contracts.py) catch what they promise to catch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
[importlinter]
root_package = toy
contract_types =
    private_names: tests.import_contracts.PrivateNamesContract
    acyclic: tests.import_contracts.AcyclicContract

[importlinter:contract:private]
name = private names
type = private_names
root = toy

[importlinter:contract:acyclic]
name = acyclic
type = acyclic
root = toy
"""


def lint(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    for name, text in {"toy/__init__.py": "", "toy/low/__init__.py": "", "toy/high/__init__.py": "", **files}.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    (tmp_path / ".importlinter").write_text(CONFIG)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    lint_imports = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint_imports), "--no-cache"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


CLEAN = {
    "toy/low/core.py": "def shared():\n    return 1\n\ndef _helper():\n    return 2\n",
    "toy/low/other.py": "from toy.low.core import _helper\n",  # inside its own package: allowed
    "toy/high/use.py": "from toy.low.core import shared\n",
}


def test_a_clean_package_keeps_both_contracts(tmp_path):
    done = lint(tmp_path, CLEAN)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("KEPT") == 2


@pytest.mark.parametrize("line", [
    "from toy.low.core import shared, _helper\n",
    "from toy.low.core import (\n    shared,\n    _helper,\n)\n",
    "from toy.low import _private_module\n",
])
def test_a_private_name_imported_across_packages_breaks_the_contract(tmp_path, line):
    files = {**CLEAN, "toy/low/_private_module.py": "", "toy/high/use.py": line}
    done = lint(tmp_path, files)
    assert done.returncode == 1
    assert "private names BROKEN" in done.stdout and "toy.high.use" in done.stdout


def test_an_import_cycle_breaks_the_contract_even_through_a_function(tmp_path):
    files = {**CLEAN, "toy/low/core.py": "def late():\n    from toy.low import other\n"}
    done = lint(tmp_path, {**files, "toy/low/other.py": "from toy.low.core import late\n"})
    assert done.returncode == 1
    assert "acyclic BROKEN" in done.stdout and "toy.low.core <-> toy.low.other" in done.stdout
