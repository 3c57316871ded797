"""Reuse inside the HF entry points users already have: streamers, pipeline, Seq2SeqTrainer.

Every test runs on each tiny family (with a word-level tokenizer) and on the real Gemma-3-270M.
"""

from __future__ import annotations

import threading

import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TextIteratorStreamer, pipeline

from kvboost_hf import ChunkStore, disable_chunk_reuse, enable_chunk_reuse, last_request_stats

GEN = dict(max_new_tokens=8, do_sample=False)


def store() -> ChunkStore:
    return ChunkStore(max_bytes=500_000_000, chunk_size=16)


def stream_text(model, tokenizer, text):
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, timeout=120)  # a failed generate: no hang
    inputs = tokenizer(text, return_tensors="pt")
    thread = threading.Thread(target=model.generate, kwargs=dict(**inputs, streamer=streamer, **GEN))
    thread.start()
    pieces = list(streamer)
    thread.join()
    return "".join(pieces)


def test_text_iterator_streamer(lm):
    model, tokenizer, texts = lm
    refs = [stream_text(model, tokenizer, t) for t in texts]
    enable_chunk_reuse(model, store())
    got = [stream_text(model, tokenizer, t) for t in texts]
    assert got == refs
    assert last_request_stats(model).reused_tokens > 0


def test_pipeline_reuses_call_after_call(lm):
    model, tokenizer, texts = lm
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    calls = texts + texts[:1]
    refs = [pipe(t, **GEN)[0]["generated_text"] for t in calls]
    enable_chunk_reuse(model, store())
    got, reused = [], []
    for t in calls:
        got.append(pipe(t, **GEN)[0]["generated_text"])
        reused.append(last_request_stats(model).reused_tokens)
    assert got == refs
    assert reused[0] == 0 and min(reused[1:]) > 0
    assert reused[-1] == len(tokenizer(texts[0])["input_ids"]) - 1  # a repeated prompt reuses all but one token


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def test_seq2seq_trainer_predict_with_generate(lm, tmp_path):
    model, tokenizer, texts = lm
    rows = []
    for t in texts:
        ids = tokenizer(t)["input_ids"]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": ids})
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        per_device_eval_batch_size=1,
        predict_with_generate=True,
        report_to=[],
        use_cpu=True,
    )
    trainer = Seq2SeqTrainer(model=model, args=args, processing_class=tokenizer)
    ref = trainer.predict(_Rows(rows), **GEN).predictions
    s = store()
    enable_chunk_reuse(model, s)
    got = trainer.predict(_Rows(rows), **GEN).predictions
    disable_chunk_reuse(model)
    assert (got == ref).all()
    assert s.stats()["hits"] >= len(rows) - 1  # every prompt after the first shares the prefix
