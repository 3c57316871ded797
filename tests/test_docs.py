"""Every python code block in README.md and docs/*.md runs as pasted, offline, on the embedded model.

The rule: a page is read top to bottom, so **a page's python blocks run in order in one
namespace** (what a reader gets who pastes them in order into one interpreter), and every page
starts from an empty namespace with an empty temporary directory as its working directory. A
block is a fence whose language is ``python`` (or ``py`` / ``python3``); ``bash``, ``text`` and
bare fences are not run, so a block that truly cannot run must say which language it is.

What the test provides, and nothing more:

- offline mode (``HF_HUB_OFFLINE``): a hub id fails at once instead of after network time-outs;
- ``kvboost_hf.models.load_default_model()`` (and ``load_model(None)``) hands out a deep copy of
  the session's Gemma-3-270M, the checkpoint a fresh load reads, and the session's tokenizer, so
  the model is loaded once per session rather than once per page;
- a page that names ``http://127.0.0.1:8000`` (where ``kvboost-hf serve`` listens by default) gets
  that server, on the embedded model with the command's default store and scheduler, on a free
  port: the address in its blocks is replaced by the server's. ``redis://127.0.0.1:6379/0`` is
  likewise replaced by a Redis server the test starts.

A few pages also state what a snippet shows (a second question reuses the first one's context,
...); ``CLAIMS`` checks those right after the block that shows it.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub.constants
import pytest
from markdown_it import MarkdownIt

import kvboost_hf.models
from kvboost_hf import ChunkStore

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGUAGES = {"python", "py", "python3"}
SERVER_URL = "http://127.0.0.1:8000"
REDIS_URL = "redis://127.0.0.1:6379/0"


@dataclass(frozen=True)
class Block:
    """One python fence: its code and the 1-based line of its first code line in the page."""

    page: Path
    line: int
    code: str


def python_blocks(page: Path) -> list[Block]:
    """The runnable fences of ``page`` in reading order (fences inside lists included)."""
    blocks = []
    for token in MarkdownIt("commonmark").parse(page.read_text(encoding="utf-8")):
        language = token.info.split()[0].lower() if token.info.strip() else ""
        if token.type == "fence" and language in RUN_LANGUAGES:
            blocks.append(Block(page, token.map[0] + 2, token.content))
    return blocks


RUNNABLE = [page for page in PAGES if python_blocks(page)]


@dataclass(frozen=True)
class Claim:
    """What a page says a block shows, checked right after the block containing ``anchor`` ran."""

    anchor: str
    says: str
    holds: Callable[[dict], bool]


CLAIMS: dict[str, list[Claim]] = {
    "README.md": [
        Claim("stats = last_request_stats(model)", "the request after warm() reuses the warmed system prompt",
              lambda ns: ns["stats"].reused_tokens > 0),
    ],
    "getting-started.md": [
        Claim("stats = last_request_stats(model)", "the second question reuses the shared context",
              lambda ns: ns["stats"].reused_tokens > 0),
    ],
    "position-independent-reuse.md": [
        Claim("s = last_request_stats(model)", "documents in another order are reused as approximate tokens",
              lambda ns: ns["s"].approximate_tokens > 0),
    ],
    "server.md": [
        Claim("client = OpenAI(", "the second question is served with cached prompt tokens",
              lambda ns: ns["reply"].usage.prompt_tokens_details.cached_tokens > 0),
    ],
    "speculative.md": [
        Claim("draft=draft", "the self-draft proposes tokens",
              lambda ns: ns["last_request_stats"](ns["model"]).speculation.drafted_tokens > 0),
    ],
}


def test_collector_sees_every_page():
    """The pages with python blocks are the ones this test runs (a fence typo would hide a block)."""
    names = {page.name for page in RUNNABLE}
    assert {"README.md", "getting-started.md", "server.md", "store.md"} <= names, names
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        fences = text.count("```python") + text.count("```py\n")
        assert len(python_blocks(page)) == fences, f"{page.name}: a ```python fence the parser did not see"


@contextlib.contextmanager
def doc_server(gemma) -> Iterator[str]:
    """``kvboost-hf serve``'s defaults (embedded model, store, batch scheduler) on a free port; yields its URL."""
    from kvboost_hf import disable_chunk_reuse
    from kvboost_hf.server import ServerSettings, create_app
    from kvboost_hf.server.command import add_serve_arguments, build_store, scheduler_of
    from kvboost_hf.server.routes.background import serve_in_background

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    defaults = parser.parse_args([])
    model, tokenizer = copy.deepcopy(gemma[0]), gemma[1]
    settings = ServerSettings(model_name=kvboost_hf.models.DEFAULT_MODEL_NAME, scheduler=scheduler_of(defaults))
    running = serve_in_background(create_app(model, tokenizer, build_store(defaults), settings))
    try:
        yield running.url
    finally:
        running.stop()
        disable_chunk_reuse(model)


@pytest.fixture
def offline_loader(gemma, monkeypatch):
    """Offline mode, and the embedded-model loaders handing out copies of the session model."""
    session_model, tokenizer = gemma
    load_model = kvboost_hf.models.load_model

    def load_copy(model_id_or_path=None, *args, **kwargs):
        if model_id_or_path is None:
            return copy.deepcopy(session_model), tokenizer  # a tokenizer copy costs seconds; pages only read it
        return load_model(model_id_or_path, *args, **kwargs)

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(kvboost_hf.models, "load_model", load_copy)
    monkeypatch.setattr(kvboost_hf.models, "load_default_model", lambda *args, **kwargs: load_copy(None))


@pytest.mark.gemma
@pytest.mark.parametrize("page", RUNNABLE, ids=lambda page: page.name)
def test_page_runs_as_pasted(page, offline_loader, gemma, request, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks(page)
    claims = CLAIMS.get(page.name, [])
    text = "".join(block.code for block in blocks)
    namespace: dict = {"__name__": "__main__"}
    with contextlib.ExitStack() as stack:
        stack.callback(_release, namespace)
        replacements = {}
        if SERVER_URL in text:
            replacements[SERVER_URL] = stack.enter_context(doc_server(gemma))
        if REDIS_URL in text:
            replacements[REDIS_URL] = request.getfixturevalue("redis_url")
        for block in blocks:
            code = block.code
            for literal, actual in replacements.items():
                code = code.replace(literal, actual)
            source = "\n" * (block.line - 1) + code  # padded: tracebacks point at the page's own lines
            try:
                exec(compile(source, str(page), "exec"), namespace)
            except Exception as err:
                raise AssertionError(
                    f"{page.relative_to(ROOT)}: the python block at line {block.line} raised "
                    f"{type(err).__name__}: {err}"
                ) from err
            for claim in claims:
                if claim.anchor in block.code:
                    assert claim.holds(namespace), f"{page.relative_to(ROOT)}, block at line {block.line}: {claim.says}"
    for claim in claims:
        assert claim.anchor in text, \
            f"{page.relative_to(ROOT)}: no python block contains {claim.anchor!r}; update CLAIMS in {__name__}"


def _release(namespace: dict) -> None:
    """Stop what a page started (a Redis tier's writer thread) and drop its objects (a model copy each)."""
    for value in namespace.values():
        if isinstance(value, ChunkStore):
            value.close()
    namespace.clear()
    gc.collect()
