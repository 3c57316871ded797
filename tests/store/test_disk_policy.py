"""Disk tier rules that protect output and capacity: precision, chain-aware eviction, temp files, read-only."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.store import disk as disk_module
from tests.conftest import make_tiny, random_ids
from tests.store.test_disk import ROOT, files
from tests.store.test_store import NS, put


def reused(store, tokens):
    return sum(h.num_tokens for h in store.lookup(NS, tokens))


def file_of(store, key):
    return store._disk.file_for(key)


def chain_keys(store, tokens):
    return [h.chunk.key for h in store.lookup(NS, tokens)]


# ---------------------------------------------------------------------- precision
def test_lossless_store_never_takes_lossy_entries_and_replaces_them(tmp_path):
    tokens = list(range(10, 22))
    put(ChunkStore(chunk_size=4, kv_bits=4, disk_path=tmp_path), tokens)
    lossless = ChunkStore(chunk_size=4, disk_path=tmp_path)
    assert reused(lossless, tokens) == 0
    assert len(files(tmp_path)) == 3  # other stores' entries are left alone
    assert put(lossless, tokens) == 3  # stored anew, lossless, over the int4 files
    hits = ChunkStore(chunk_size=4, disk_path=tmp_path).lookup(NS, tokens)
    assert sum(h.num_tokens for h in hits) == 12 and all(h.chunk.bits is None for h in hits)


def test_quantized_store_reuses_more_precise_entries_only(tmp_path):
    tokens = list(range(10, 22))
    put(ChunkStore(chunk_size=4, kv_bits=4, disk_path=tmp_path / "int4"), tokens)
    assert reused(ChunkStore(chunk_size=4, kv_bits=8, disk_path=tmp_path / "int4"), tokens) == 0
    put(ChunkStore(chunk_size=4, disk_path=tmp_path / "lossless"), tokens)
    for bits in (8, 4):
        hits = ChunkStore(chunk_size=4, kv_bits=bits, disk_path=tmp_path / "lossless").lookup(NS, tokens)
        assert sum(h.num_tokens for h in hits) == 12 and all(h.chunk.bits is None for h in hits)


def test_file_replaced_by_a_lossy_one_after_indexing_is_not_served(tmp_path):
    tokens = list(range(10, 22))
    put(ChunkStore(chunk_size=4, disk_path=tmp_path / "a"), tokens)
    put(ChunkStore(chunk_size=4, kv_bits=4, disk_path=tmp_path / "b"), tokens)
    lossless = ChunkStore(chunk_size=4, disk_path=tmp_path / "a")  # indexes the lossless files
    for f in files(tmp_path / "b"):  # another writer swaps in int4 files under the same names
        os.replace(f, tmp_path / "a" / f.name)
    assert reused(lossless, tokens) == 0


def test_lossless_model_store_on_a_directory_an_int4_store_wrote(tmp_path):
    model = make_tiny("llama")
    prompt = torch.cat([random_ids(40, 1), random_ids(6, 2)], dim=1)
    ref = model.generate(prompt, max_new_tokens=6, do_sample=False)
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=8, kv_bits=4, disk_path=tmp_path))
    model.generate(prompt, max_new_tokens=6, do_sample=False)
    enable_chunk_reuse(model, ChunkStore(max_bytes=10**8, chunk_size=8, disk_path=tmp_path))
    out = model.generate(prompt, max_new_tokens=6, do_sample=False)
    stats = last_request_stats(model)
    disable_chunk_reuse(model)
    assert torch.equal(out, ref)
    assert stats.approximate_tokens == 0 and stats.reused_tokens == 0


# ---------------------------------------------------------------------- chain-aware eviction
def files_budget(tmp_path, n):
    """Bytes for ``n`` one-chunk files (tokens of 2-3 digits make files a few bytes apart)."""
    put(ChunkStore(chunk_size=4, disk_path=tmp_path / "probe"), [100, 101, 102, 103])
    one = files(tmp_path / "probe")[0].stat().st_size
    return one * n + one // 2


def test_disk_budget_keeps_chain_roots_and_a_restart_reuses_them(tmp_path):
    budget = files_budget(tmp_path, 4)
    tokens = list(range(10, 42))  # 8 chunks, room for 4
    put(ChunkStore(chunk_size=4, disk_path=tmp_path / "tier", max_disk_bytes=budget), tokens)
    assert len(files(tmp_path / "tier")) == 4
    restarted = ChunkStore(chunk_size=4, disk_path=tmp_path / "tier", max_disk_bytes=budget)
    assert reused(restarted, tokens) == 16  # the first four chunks: every file left is reachable


def test_leaves_go_first_and_a_new_chain_never_strands_an_old_one(tmp_path):
    budget = files_budget(tmp_path, 4)
    store = ChunkStore(chunk_size=4, disk_path=tmp_path / "tier", max_disk_bytes=budget)
    first, second = list(range(10, 22)), list(range(50, 62))
    put(store, first)
    put(store, second)  # needs 2 more files: the leaves of `first` go, its root stays
    restarted = ChunkStore(chunk_size=4, disk_path=tmp_path / "tier", max_disk_bytes=budget)
    assert reused(restarted, first) == 4 and reused(restarted, second) == 4 * (len(files(tmp_path / "tier")) - 1)


def test_ram_hits_refresh_disk_recency(tmp_path):
    budget = files_budget(tmp_path, 2)
    store = ChunkStore(chunk_size=4, disk_path=tmp_path / "tier", max_disk_bytes=budget)
    hot, cold = [1, 2, 3, 4], [5, 6, 7, 8]
    put(store, hot)
    put(store, cold)
    old = time.time() - 7200
    for f in files(tmp_path / "tier"):
        os.utime(f, (old, old))
    assert reused(store, hot) == 4  # a RAM hit: the file must count as used too
    put(store, [9, 10, 11, 12])
    other = ChunkStore(chunk_size=4, disk_path=tmp_path / "tier")
    assert reused(other, hot) == 4 and reused(other, cold) == 0


def test_pinned_files_are_evicted_last_even_when_pinned_later(tmp_path):
    budget = files_budget(tmp_path, 2)
    store = ChunkStore(chunk_size=4, disk_path=tmp_path / "tier", max_disk_bytes=budget)
    system = [1, 2, 3, 4]
    put(store, system)
    store.insert(NS, system, lambda s, e: pytest.fail("already stored"), pin=True)  # pinned afterwards
    for i in range(4):
        put(store, [20 + i, 5, 6, 7])
    assert reused(ChunkStore(chunk_size=4, disk_path=tmp_path / "tier"), system) == 4


def test_unreachable_files_are_evicted_first(tmp_path):
    budget = files_budget(tmp_path, 3)
    tier = tmp_path / "tier"
    store = ChunkStore(chunk_size=4, disk_path=tier, max_disk_bytes=budget)
    tokens = list(range(10, 22))
    put(store, tokens)
    keys = chain_keys(store, tokens)
    file_of(store, keys[1]).unlink()  # the third chunk is now unreachable
    fresh = ChunkStore(chunk_size=4, disk_path=tier, max_disk_bytes=budget)
    put(fresh, [90, 91, 92, 93])
    put(fresh, [94, 95, 96, 97])  # one file too many: the orphan goes, not a reachable root
    assert not file_of(fresh, keys[2]).exists() and file_of(fresh, keys[0]).exists()


# ---------------------------------------------------------------------- temp files and kill -9
def test_stale_temp_files_are_counted_then_reclaimed_at_open(tmp_path):
    store = ChunkStore(chunk_size=4, disk_path=tmp_path)
    put(store, [1, 2, 3, 4])
    entries = store.stats()["bytes_by_tier"]["disk"]
    (tmp_path / f"{disk_module.TMP_PREFIX}4242-dead").write_bytes(b"x" * 5000)
    assert store.stats()["bytes_by_tier"]["disk"] == entries + 5000  # counted until reclaimed
    reopened = ChunkStore(chunk_size=4, disk_path=tmp_path)
    assert not list(tmp_path.glob(f"{disk_module.TMP_PREFIX}*"))
    assert reopened.stats()["temp_files_reclaimed"] == 1
    assert reopened.stats()["bytes_by_tier"]["disk"] == entries


def test_writer_killed_mid_write_leaves_nothing_behind(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.store.disk_worker", "hang-in-write", str(tmp_path)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 120
        while not list(tmp_path.glob(f"{disk_module.TMP_PREFIX}*")):
            assert proc.poll() is None, proc.stderr.read()
            assert time.time() < deadline, "the worker never started writing"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    store = ChunkStore(chunk_size=4, disk_path=tmp_path)  # takes the lock the dead writer held
    assert not list(tmp_path.glob(f"{disk_module.TMP_PREFIX}*"))
    assert put(store, [1, 2, 3, 4]) == 1 and reused(ChunkStore(chunk_size=4, disk_path=tmp_path), [1, 2, 3, 4]) == 4


# ---------------------------------------------------------------------- what the files say
def test_file_swapped_for_another_entrys_file_is_dropped(tmp_path):
    tokens = list(range(10, 22))
    store = ChunkStore(chunk_size=4, disk_path=tmp_path)
    put(store, tokens)
    keys = chain_keys(store, tokens)
    os.replace(file_of(store, keys[2]), file_of(store, keys[1]))  # chunk 3's file under chunk 2's name
    fresh = ChunkStore(chunk_size=4, disk_path=tmp_path)
    assert reused(fresh, tokens) == 4
    assert fresh.stats()["corrupt_dropped"] == 1 and not file_of(fresh, keys[1]).exists()


def test_disk_entries_counts_files_not_ram_entries(tmp_path):
    store = ChunkStore(chunk_size=4, disk_path=tmp_path / "tier", max_disk_bytes=files_budget(tmp_path, 2))
    put(store, list(range(10, 26)))  # 4 chunks in RAM, room for 2 files
    stats = store.stats()
    assert stats["entries"] == 4 and stats["disk_entries"] == len(files(tmp_path / "tier")) == 2


def _snapshot(path):
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in Path(path).iterdir()}


def test_read_only_store_writes_nothing_and_serves_a_read_only_directory(tmp_path, monkeypatch):
    tokens = list(range(10, 22))
    writer = ChunkStore(chunk_size=4, disk_path=tmp_path / "ro")
    put(writer, tokens)
    keys = chain_keys(writer, tokens)
    (tmp_path / "ro" / ".lock").unlink()
    data = bytearray(file_of(writer, keys[2]).read_bytes())
    data[-3] ^= 0xFF
    file_of(writer, keys[2]).write_bytes(bytes(data))
    before = _snapshot(tmp_path / "ro")

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    # As root, permissions do not stop writes: refuse every way the tier could write instead.
    for target, name in [(Path, "mkdir"), (Path, "write_bytes"), (Path, "unlink"), (Path, "touch"),
                         (os, "replace"), (os, "utime"), (disk_module.FileLock, "acquire")]:
        monkeypatch.setattr(target, name, refuse)
    store = ChunkStore(chunk_size=4, disk_path=tmp_path / "ro", read_only=True)
    assert reused(store, tokens) == 8  # the corrupt third chunk is skipped, not deleted
    assert reused(store, tokens) == 8
    assert put(store, list(range(50, 58))) == 0
    assert store.stats()["corrupt_dropped"] == 1
    monkeypatch.undo()
    assert _snapshot(tmp_path / "ro") == before


def test_read_only_store_needs_an_existing_directory(tmp_path):
    with pytest.raises(ValueError, match="not a directory"):
        ChunkStore(disk_path=tmp_path / "missing", read_only=True)
