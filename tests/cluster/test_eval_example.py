"""examples/eval_with_reuse.py under ``accelerate launch`` with 2 CPU processes (gloo): both processes
share one disk tier, both reuse, and every answer equals the pipeline's without reuse."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.server.conftest import save_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def test_two_processes_share_one_tier_and_answer_as_without_reuse(tmp_path):
    save_tiny_model(tmp_path / "model", seed=4)
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
               "--mixed_precision", "no", "--dynamo_backend", "no", str(ROOT / "examples" / "eval_with_reuse.py"),
               "--model_name_or_path", str(tmp_path / "model"), "--shared_dir", str(tmp_path / "kv"),
               "--max_new_tokens", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = re.findall(r"process (\d): (\d+) prompts, (\d+)/(\d+) prompt tokens reused", done.stdout)
    assert sorted(p for p, *_ in lines) == ["0", "1"], done.stdout
    assert all(int(reused) > 0 for _, _, reused, _ in lines)
    assert '"identical_to_no_reuse": true' in done.stdout
    assert any((tmp_path / "kv").rglob("*")), "the shared disk tier holds the chunks"
