"""Subprocess entry used by test_disk.py: writes to a shared disk tier from another process."""

import sys

import torch

from kvboost_hf import ChunkStore, enable_chunk_reuse
from kvboost_hf.store.keys import namespace_key
from tests.conftest import make_tiny, random_ids

mode, path = sys.argv[1], sys.argv[2]
if mode == "generate":
    model = make_tiny("llama")
    enable_chunk_reuse(model, ChunkStore(max_bytes=50_000_000, chunk_size=8, disk_path=path))
    model.generate(random_ids(40, 1), max_new_tokens=5, do_sample=False)
elif mode == "hang-in-write":
    import os
    import time

    def stall(fd):  # the temporary file is written; the writer dies before the rename
        time.sleep(600)

    os.fsync = stall
    store = ChunkStore(max_bytes=20_000, chunk_size=4, disk_path=path)
    tokens = [1, 2, 3, 4]
    t = torch.tensor(tokens, dtype=torch.float32).view(1, -1, 1)
    store.insert(namespace_key({"model": "test"}), tokens, lambda s, e: ([t.expand(1, -1, 4).clone()], [t.expand(1, -1, 4).clone()]))
elif mode == "hammer":
    worker = int(sys.argv[3])
    store = ChunkStore(max_bytes=20_000, chunk_size=4, disk_path=path, max_disk_bytes=60_000)
    ns = namespace_key({"model": "hammer"})
    for i in range(40):
        tokens = [worker, i] + list(range(10))
        t = torch.tensor(tokens, dtype=torch.float32)
        store.insert(ns, tokens, lambda s, e: ([t[s:e].view(1, -1, 1).expand(1, -1, 8).clone()], [t[s:e].view(1, -1, 1).expand(1, -1, 8).clone()]))
        store.lookup(ns, tokens)
    print(store.stats()["corrupt_dropped"])
