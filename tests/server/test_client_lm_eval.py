"""lm-eval's ``local-completions`` (loglikelihood multiple choice) against a real server on loopback.

The task is a small local multiple-choice set written here (a JSONL file and a task YAML; no hub
download). lm-eval tokenizes through the server (``/tokenizer_info`` + ``/tokenize``), sends
token-id prompts with ``echo`` and ``logprobs``, two prompts per request (``--batch_size 2``).
Its per-choice loglikelihoods and accuracy must equal the same task scored here directly with
the model's log-softmax.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval", reason="the [clients] extra: pip install -e '.[clients]'")

from tests.server.conftest import MODEL_NAME  # noqa: E402

TASK = "kvboost_local_mc"
ROOT = Path(__file__).resolve().parents[2]


def write_task(directory: Path, docs: list[dict]) -> None:
    data = directory / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (directory / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: \"{{context}}\"\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )


def make_docs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        context = " ".join(f"w{rng.randrange(3, 96)}" for _ in range(rng.randrange(3, 9)))
        choices = [" ".join(f"w{rng.randrange(3, 96)}" for _ in range(rng.randrange(1, 3))) for _ in range(3)]
        docs.append({"context": context, "choices": choices, "label": rng.randrange(3)})
    return docs


def direct_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """What lm-eval's loglikelihood means, computed with one forward: sum of the continuation's logprobs."""
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([whole]), use_cache=False).logits[0].float(), dim=-1)
    return sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


def test_lm_eval_multiple_choice_equals_direct_scoring(tiny_server, tmp_path):
    docs = make_docs(10, seed=7)
    write_task(tmp_path, docs)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "OPENAI_API_KEY": "unused"}
    model_args = (f"model={MODEL_NAME},base_url={tiny_server.base_url}/v1/completions,num_concurrent=1,"
                  "max_retries=1,tokenized_requests=True,tokenizer_backend=remote,max_length=512")
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
         "--tasks", TASK, "--include_path", str(tmp_path), "--batch_size", "2", "--log_samples",
         "--output_path", str(tmp_path / "out")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob(f"samples_{TASK}_*.jsonl")).open()]
    model, tokenizer = tiny_server.model, tiny_server.tokenizer
    correct = 0
    for sample in samples:
        doc = sample["doc"]
        direct = [direct_loglikelihood(model, tokenizer, doc["context"], " " + c) for c in doc["choices"]]
        served = [float(resp[0][0]) for resp in sample["resps"]]  # logged as strings
        assert served == pytest.approx(direct, abs=1e-4)
        correct += int(max(range(3), key=direct.__getitem__) == doc["label"])
    assert len(samples) == len(docs)
    assert results["results"][TASK]["acc,none"] == pytest.approx(correct / len(docs))
