"""``import kvboost_hf`` loads only the reuse core: the server, speculative decoding, AWQ streaming and
optional dependencies load when first used, and the lazily loaded public names still resolve."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOT_AT_IMPORT = ("xgrammar", "fastapi", "uvicorn", "starlette", "redis", "matplotlib", "jsonschema", "openai",
                 "kvboost_hf.server", "kvboost_hf.speculative", "kvboost_hf.streaming")


def loaded_after(code: str) -> list[str]:
    """The modules of ``NOT_AT_IMPORT`` (or under them) loaded after running ``code`` in a fresh interpreter."""
    probe = (f"{code}\nimport json, sys\nnames = {NOT_AT_IMPORT!r}\n"
             "print(json.dumps(sorted(m for m in sys.modules if any(m == n or m.startswith(n + '.') for n in names))))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_loads_no_server_speculation_or_optional_dependency():
    assert loaded_after("import kvboost_hf") == []


def test_lazy_public_names_resolve_and_load_their_module():
    loaded = loaded_after("from kvboost_hf import make_draft, ControllerSettings, SpeculationStats\n"
                          "assert callable(make_draft) and isinstance(ControllerSettings(), ControllerSettings)")
    assert "kvboost_hf.speculative" in loaded and "kvboost_hf.server" not in loaded


def test_every_public_name_exists_and_unknown_names_raise():
    import kvboost_hf

    for name in kvboost_hf.__all__:
        assert getattr(kvboost_hf, name) is not None, name
        assert name in dir(kvboost_hf)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kvboost_hf.nope  # noqa: B018
