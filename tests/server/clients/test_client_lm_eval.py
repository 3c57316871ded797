"""lm-eval's ``local-completions`` against a real server on loopback.

The tasks are small local sets written here (a JSONL file and a task YAML; no hub download).
lm-eval sends token-id prompts (with ``echo`` and ``logprobs`` for loglikelihood), two prompts per
request (``--batch_size 2``). Its per-choice loglikelihoods, accuracy and generations must equal the
same tasks scored and generated here directly with the model.

- A tiny model whose tokenizer adds no ``<bos>``: lm-eval tokenizes through the server
  (``/tokenizer_info`` + ``/tokenize``, its "remote" backend).
- The embedded Gemma-3-270M, whose tokenizer puts ``<bos>`` before every text: the remote backend
  never asks for it, so its scores are not the model's (the server says so in a log warning and a
  header); the command docs/server.md documents (the model's own tokenizer, ``add_bos_token=True``)
  gives the model's real scores and answers.
"""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

pytest.importorskip("lm_eval", reason="the [clients] extra: pip install -e '.[clients]'")

from kvboost_hf import disable_chunk_reuse  # noqa: E402
from kvboost_hf.models import default_model_path  # noqa: E402
from kvboost_hf.server.decoding.bos import BOS_WARNING_HEADER  # noqa: E402
from kvboost_hf.store import ChunkStore  # noqa: E402
from tests.server.conftest import MODEL_NAME, serve  # noqa: E402

TASK = "kvboost_local_mc"
ROOT = Path(__file__).resolve().parents[3]


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


def run_lm_eval(tmp_path: Path, model_args: str, tasks: str, out: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets"), "OPENAI_API_KEY": "unused"}
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
         "--tasks", tasks, "--include_path", str(tmp_path), "--batch_size", "2", "--log_samples",
         "--output_path", str(tmp_path / out)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def samples_of(directory: Path, task: str) -> list[dict]:
    return [json.loads(line) for line in next(directory.rglob(f"samples_{task}_*.jsonl")).open()]


def test_lm_eval_multiple_choice_equals_direct_scoring(tiny_server, tmp_path):
    docs = make_docs(10, seed=7)
    write_task(tmp_path, docs)
    model_args = (f"model={MODEL_NAME},base_url={tiny_server.base_url}/v1/completions,num_concurrent=1,"
                  "max_retries=1,tokenized_requests=True,tokenizer_backend=remote,max_length=512")
    run_lm_eval(tmp_path, model_args, TASK, "out")
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    samples = samples_of(tmp_path / "out", TASK)
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


# ---------------------------------------------------------------- Gemma: a model that needs <bos>
GEN_TASK = "kvboost_local_gen"
MAX_GEN_TOKS = 8
GEMMA_MC = [
    {"context": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "label": 0},
    {"context": "Water freezes at zero degrees", "choices": ["Kelvin", "Celsius", "Rankine"], "label": 1},
    {"context": "The largest planet in our solar system is", "choices": ["Mercury", "Mars", "Jupiter"], "label": 2},
    {"context": "A week has seven", "choices": ["days", "hours", "years"], "label": 0},
    {"context": "The opposite of hot is", "choices": ["tall", "cold", "green"], "label": 1},
    {"context": "Cats are often kept as", "choices": ["bricks", "clouds", "pets"], "label": 2},
]
GEMMA_GEN = [
    {"question": "Question: What is the capital of Italy?\nAnswer:", "answer": " Rome"},
    {"question": "Question: How many legs does a spider have?\nAnswer:", "answer": " Eight"},
    {"question": "Question: What colour is the sky on a clear day?\nAnswer:", "answer": " Blue"},
]


def documented_model_args(base_url: str) -> str:
    """docs/server.md's lm-eval command for a model that needs <bos> (plus the test's retry settings)."""
    return (f"model=gemma,base_url={base_url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={default_model_path()},add_bos_token=True,tokenized_requests=True,"
            "num_concurrent=1,max_retries=1")


def write_gen_task(directory: Path, docs: list[dict]) -> None:
    data = directory / "gen.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (directory / f"{GEN_TASK}.yaml").write_text(
        f"task: {GEN_TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        "doc_to_text: \"{{question}}\"\n"
        "doc_to_target: \"{{answer}}\"\n"
        f"generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: {MAX_GEN_TOKS}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


def gemma_reference(model, tokenizer) -> tuple[list[list[float]], list[str]]:
    """The model's own answers, computed here with transformers: per-choice loglikelihoods of
    ``<bos> context choice`` (what the tokenizer makes of the text) and greedy generations cut at the
    first newline."""
    scores = [[direct_loglikelihood_with_bos(model, tokenizer, d["context"], " " + c) for c in d["choices"]]
              for d in GEMMA_MC]
    answers = []
    for doc in GEMMA_GEN:
        ids = tokenizer(doc["question"], return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_GEN_TOKS,
                                 do_sample=False)
        answers.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0])
    return scores, answers


def direct_loglikelihood_with_bos(model, tokenizer, context: str, continuation: str) -> float:
    ctx = tokenizer(context)["input_ids"]
    whole = tokenizer(context + continuation)["input_ids"]
    assert whole[0] == tokenizer.bos_token_id
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([whole]), use_cache=False).logits[0].float(), dim=-1)
    return sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


@pytest.fixture(scope="module")
def gemma_truth(gemma):
    model, tokenizer = gemma
    disable_chunk_reuse(model)  # the model's own answers, no store involved
    return gemma_reference(model, tokenizer)


def bos_warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvboost_hf.server.decoding.bos" and "does not start with" in r.getMessage()]


def test_documented_lm_eval_command_gives_gemma_its_real_scores(gemma, gemma_truth, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kvboost_hf.server.decoding.bos")
    write_task(tmp_path, GEMMA_MC)
    write_gen_task(tmp_path, GEMMA_GEN)
    scores, answers = gemma_truth
    with serve(gemma[0], gemma[1], ChunkStore(max_bytes=200_000_000, chunk_size=16), model_name="gemma") as server:
        run_lm_eval(tmp_path, documented_model_args(server.base_url), f"{TASK},{GEN_TASK}", "out")
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    mc = sorted(samples_of(tmp_path / "out", TASK), key=lambda s: s["doc_id"])
    assert [s["doc"]["context"] for s in mc] == [d["context"] for d in GEMMA_MC]
    for sample, direct in zip(mc, scores):
        assert [float(resp[0][0]) for resp in sample["resps"]] == pytest.approx(direct, abs=2e-3)
    accuracy = sum(max(range(3), key=d.__getitem__) == doc["label"] for d, doc in zip(scores, GEMMA_MC)) / len(scores)
    assert results[TASK]["acc,none"] == pytest.approx(accuracy)
    gen = sorted(samples_of(tmp_path / "out", GEN_TASK), key=lambda s: s["doc_id"])
    assert [s["resps"][0][0] for s in gen] == answers
    assert any(a.strip() for a in answers)  # the model answers something: an empty reply would pass above too
    assert not bos_warnings(caplog)


def test_remote_tokenizer_command_misses_bos_and_the_server_says_so(gemma, gemma_truth, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="kvboost_hf.server.decoding.bos")
    write_task(tmp_path, GEMMA_MC)
    scores, _ = gemma_truth
    with serve(gemma[0], gemma[1], ChunkStore(max_bytes=200_000_000, chunk_size=16), model_name="gemma") as server:
        model_args = (f"model=gemma,base_url={server.base_url}/v1/completions,tokenizer_backend=remote,"
                      "tokenized_requests=True,num_concurrent=1,max_retries=1")
        run_lm_eval(tmp_path, model_args, TASK, "out")
        # what lm-eval sent: a context's ids without <bos>; the server answers with the header
        ids = gemma[1](GEMMA_MC[0]["context"], add_special_tokens=False)["input_ids"]
        reply = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                           json={"model": "gemma", "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 1})
    assert reply.status_code == 200
    assert "does not start with <bos>" in reply.headers[BOS_WARNING_HEADER]
    assert len(bos_warnings(caplog)) == 1  # logged once, however many prompts lacked it
    mc = sorted(samples_of(tmp_path / "out", TASK), key=lambda s: s["doc_id"])
    served = [[float(resp[0][0]) for resp in s["resps"]] for s in mc]
    assert any(abs(a - b) > 0.05 for row, direct in zip(served, scores) for a, b in zip(row, direct))
