"""``kvboost-hf awq-pack`` of a checkpoint without tokenizer files (weights and config only)."""

from __future__ import annotations

import torch

from kvboost_hf.cli import main
from tests.conftest import make_tiny, make_tiny_tokenizer
from tests.streaming.conftest import load_awq


def _weights_only(path):
    make_tiny("llama", seed=2, num_layers=3).save_pretrained(path)
    assert not any(p.name.startswith("tokenizer") for p in path.iterdir())
    return path


def _calibration(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{i % 90 + 3}" for i in range(64)))
    return text


def test_round_to_nearest_packs_without_a_tokenizer(tmp_path, capsys):
    src, out = _weights_only(tmp_path / "float"), tmp_path / "awq"
    assert main(["awq-pack", str(src), str(out), "--group-size", "32"]) == 0
    line = capsys.readouterr().out.strip()
    assert "round-to-nearest" in line and "no tokenizer" in line
    assert (out / "model.safetensors").exists() and not (out / "tokenizer.json").exists()
    model = load_awq(out, residency_mode="full_resident")
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 13]])).logits
    assert logits.shape == (1, 4, model.config.vocab_size) and torch.isfinite(logits).all()


def test_activation_aware_packing_without_a_tokenizer_says_what_to_pass(tmp_path, capsys):
    src, out = _weights_only(tmp_path / "float"), tmp_path / "awq"
    capsys.readouterr()
    code = main(["awq-pack", str(src), str(out), "--group-size", "32", "--calibration-file",
                 str(_calibration(tmp_path))])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("kvboost-hf awq-pack: error:") and "\n" not in err
    assert "tokenizer" in err and "--tokenizer" in err and str(src) in err
    assert not out.exists()  # refused before anything was loaded or written


def test_activation_aware_packing_takes_the_tokenizer_option(tmp_path, capsys):
    src, out, tok = _weights_only(tmp_path / "float"), tmp_path / "awq", tmp_path / "tok"
    make_tiny_tokenizer().save_pretrained(tok)
    assert main(["awq-pack", str(src), str(out), "--group-size", "32", "--calibration-file",
                 str(_calibration(tmp_path)), "--tokenizer", str(tok)]) == 0
    assert "activation-aware" in capsys.readouterr().out
    assert (out / "tokenizer.json").exists()  # written with the checkpoint


def test_a_tokenizer_option_that_does_not_load_is_one_line(tmp_path, capsys):
    src, out, empty = _weights_only(tmp_path / "float"), tmp_path / "awq", tmp_path / "empty"
    empty.mkdir()
    for tokenizer in (tmp_path / "missing", empty):
        capsys.readouterr()
        assert main(["awq-pack", str(src), str(out), "--tokenizer", str(tokenizer)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("kvboost-hf awq-pack: error:") and "\n" not in err and str(tokenizer) in err
    assert not out.exists()
