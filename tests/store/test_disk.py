import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats
from kvboost_hf.store.keys import namespace_key
from tests.conftest import make_tiny, random_ids
from tests.store.test_store import NS, put

ROOT = Path(__file__).resolve().parents[2]


def files(path):
    return sorted(Path(path).glob("*.safetensors"))


def test_new_store_on_same_directory_serves_entries_from_disk(tmp_path):
    tokens = list(range(10, 30))
    put(ChunkStore(chunk_size=4, disk_path=tmp_path), tokens)
    assert len(files(tmp_path)) == 5
    reopened = ChunkStore(chunk_size=4, disk_path=tmp_path)
    hits = reopened.lookup(NS, tokens)
    assert sum(h.num_tokens for h in hits) == 20
    assert hits[2].chunk.keys[0][0, :, 0].tolist() == [18, 19, 20, 21]
    stats = reopened.stats()
    assert stats["disk_reads"] == 5 and stats["entries"] == 5 and stats["corrupt_dropped"] == 0
    assert stats["bytes_by_tier"]["disk"] == sum(f.stat().st_size for f in files(tmp_path))


def test_quantized_entries_round_trip_through_disk(tmp_path):
    tokens = list(range(10, 22))
    first = ChunkStore(chunk_size=4, kv_bits=4, group_size=4, sink_tokens=2, disk_path=tmp_path)
    put(first, tokens)
    ram = [h.chunk.layer_states(1, 4) for h in first.lookup(NS, tokens)]
    # Read by another int4 store (a lossless one never takes them: see test_disk_policy.py).
    second = ChunkStore(chunk_size=4, kv_bits=4, group_size=4, sink_tokens=2, disk_path=tmp_path)
    disk = [h.chunk.layer_states(1, 4) for h in second.lookup(NS, tokens)]
    assert len(disk) == 3
    for (k1, v1), (k2, v2) in zip(ram, disk):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _corrupt_and_reopen(tmp_path, damage):
    tokens = list(range(10, 22))
    put(ChunkStore(chunk_size=4, disk_path=tmp_path), tokens)
    second = sorted(files(tmp_path), key=lambda p: p.stat().st_mtime_ns)[1]
    damage(second)
    store = ChunkStore(chunk_size=4, disk_path=tmp_path)
    reused = sum(h.num_tokens for h in store.lookup(NS, tokens))
    return store, reused, second


def test_flipped_tensor_byte_is_detected_and_dropped(tmp_path):
    def flip(path):
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))

    store, reused, damaged = _corrupt_and_reopen(tmp_path, flip)
    assert reused == 4  # the chain stops before the damaged chunk; nothing wrong is loaded
    assert store.stats()["corrupt_dropped"] == 1 and not damaged.exists()


def test_truncated_file_is_detected_and_dropped(tmp_path):
    store, reused, damaged = _corrupt_and_reopen(tmp_path, lambda p: p.write_bytes(p.read_bytes()[:50]))
    assert reused == 4
    assert store.stats()["corrupt_dropped"] >= 1 and not damaged.exists()


def test_edited_tokens_are_detected(tmp_path):
    def retoken(path):
        data = path.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        tokens = json.loads(header["__metadata__"]["tokens"])
        header["__metadata__"]["tokens"] = json.dumps([t + 1 for t in tokens])
        raw = json.dumps(header).encode()
        raw += b" " * (n - len(raw)) if len(raw) <= n else b""
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n :])

    store, reused, _ = _corrupt_and_reopen(tmp_path, retoken)
    assert reused == 4 and store.stats()["corrupt_dropped"] == 1


def test_other_namespace_is_never_returned_from_disk(tmp_path):
    tokens = list(range(10, 22))
    put(ChunkStore(chunk_size=4, disk_path=tmp_path), tokens)
    other = ChunkStore(chunk_size=4, disk_path=tmp_path)
    assert other.lookup(namespace_key({"model": "other"}), tokens) == []
    assert other.stats()["disk_reads"] == 0


def test_disk_budget_is_respected(tmp_path):
    put(ChunkStore(chunk_size=4, disk_path=tmp_path / "probe"), [1, 2, 3, 4])
    one_file = files(tmp_path / "probe")[0].stat().st_size
    store = ChunkStore(chunk_size=4, disk_path=tmp_path / "tier", max_disk_bytes=one_file * 3 + 10)
    for i in range(8):
        put(store, [100 + i, 1, 2, 3])
    total = sum(f.stat().st_size for f in files(tmp_path / "tier"))
    assert total <= one_file * 3 + 10 and len(files(tmp_path / "tier")) == 3


def _run_worker(*args):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, "-m", "tests.store.disk_worker", *map(str, args)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_second_process_reuses_entries_of_the_first(tmp_path):
    proc = _run_worker("generate", tmp_path)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert files(tmp_path)
    model = make_tiny("llama")  # same seed and config as the worker: same namespace
    prompt = torch.cat([random_ids(40, 1), random_ids(6, 2)], dim=1)
    ref = model.generate(prompt, max_new_tokens=5, do_sample=False)
    store = ChunkStore(max_bytes=50_000_000, chunk_size=8, disk_path=tmp_path)
    enable_chunk_reuse(model, store)
    out = model.generate(prompt, max_new_tokens=5, do_sample=False)
    reused = last_request_stats(model).reused_tokens
    disable_chunk_reuse(model)
    assert torch.equal(out, ref)
    assert reused == 40  # the worker's whole prompt, read from its files
    assert store.stats()["disk_reads"] >= 5


def test_concurrent_processes_do_not_corrupt_the_directory(tmp_path):
    procs = [_run_worker("hammer", tmp_path, w) for w in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert out.strip() == "0"
    store = ChunkStore(chunk_size=4, disk_path=tmp_path)
    ns = namespace_key({"model": "hammer"})
    assert files(tmp_path), "workers wrote nothing"
    assert sum(f.stat().st_size for f in files(tmp_path)) <= 60_000
    assert not list(Path(tmp_path).glob(".tmp-*"))
    for f in files(tmp_path):  # every file left verifies
        assert store._disk.read(bytes.fromhex(f.name[: -len(".safetensors")]), ns) is not None
    assert store.stats()["corrupt_dropped"] == 0
