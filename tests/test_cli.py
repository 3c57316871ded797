import io
import re
from importlib import metadata

import pytest

from kvboost_hf.cli import main, run_demo
from kvboost_hf.models import GEMMA_CHAT_TEMPLATE, default_model_path
from tests.conftest import make_tiny, make_tiny_tokenizer


def test_default_model_is_float32_gemma3_with_chat_template(gemma):
    model, tokenizer = gemma
    assert model.config.model_type == "gemma3_text"
    assert next(model.parameters()).dtype.is_floating_point and str(next(model.parameters()).dtype) == "torch.float32"
    assert tokenizer.chat_template is not None
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}],
        tokenize=False,
    )
    assert text == "<bos><start_of_turn>user\nS\n\nQ<end_of_turn>\n<start_of_turn>model\nA<end_of_turn>\n"
    assert (default_model_path() / "config.json").exists()
    assert "start_of_turn" in GEMMA_CHAT_TEMPLATE


def test_demo_reports_identical_outputs_and_reuse(gemma):
    model, tokenizer = gemma
    out = io.StringIO()
    rows = run_demo(model, tokenizer, turns=["Hi.", "Which woods?", "Delivery time?"], max_new_tokens=4, out=out)
    assert all(r["identical"] for r in rows)
    assert rows[0]["reused_tokens"] == 0
    # Later turns reuse at least the whole previous prompt.
    for prev, row in zip(rows, rows[1:]):
        assert row["reused_tokens"] >= prev["prompt_tokens"]
    assert "TTFT plain" in out.getvalue()


def test_model_command_prints_checkpoint_path(capsys):
    assert main(["model"]) == 0
    assert capsys.readouterr().out.strip() == str(default_model_path())


# ---------------------------------------------------------------------- CLI honesty: sizes, errors, help, version
def run(argv: list[str]) -> int:
    """``main(argv)``'s exit status, whether it returns it or raises SystemExit (argparse)."""
    try:
        return main(argv)
    except SystemExit as done:
        return done.code


def test_sizes_take_units_and_a_bare_number_only_when_its_unit_is_named():
    from kvboost_hf.units import SizeError, format_size, parse_size

    assert parse_size("24GB") == 24 * 10**9 and parse_size("24GiB") == 24 * 2**30
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("512 mb") == 512 * 10**6
    assert parse_size("2.5g") == int(2.5 * 2**30) and parse_size("3Gi") == 3 * 2**30 and parse_size("100B") == 100
    assert parse_size("24", bare_unit="B") == 24 and parse_size("2", bare_unit="GiB") == 2 * 2**30
    with pytest.raises(SizeError, match="give a unit, e.g. 24GiB or 24GB"):
        parse_size("24")
    for bad, why in (("lots", "number and a unit"), ("5XB", "unknown unit"), ("-1GiB", "number and a unit")):
        with pytest.raises(SizeError, match=why) as err:
            parse_size(bad)
        assert isinstance(err.value, ValueError) and "\n" not in str(err.value)
    assert format_size(412 * 2**20) == "412.0 MiB" and format_size(3 * 2**29) == "1.50 GiB" and format_size(5) == "5 B"


@pytest.fixture
def nothing_slow(monkeypatch):
    """Model loads and the server's start fail the test if any bad flag gets as far as them."""
    import transformers

    import kvboost_hf.models
    import kvboost_hf.server.launch

    def reached(*args, **kwargs):
        raise AssertionError("a bad flag got as far as loading a model")

    monkeypatch.setattr(kvboost_hf.models, "load_model", reached)
    monkeypatch.setattr(kvboost_hf.server.launch, "load_served_model", reached)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", reached)


def tiny_checkpoint(path):
    make_tiny("llama", seed=2).save_pretrained(path)  # hidden 64, intermediate 128
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("argv, says", [
    (["plan", "--memory", "24"], "--memory 24: give a unit, e.g. 24GiB"),
    (["plan", "--memory", "lots"], "--memory lots: write a number and a unit"),
    (["plan", "--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
    (["plan", "--margin", "1.5"], "--margin 1.5"),
    (["serve", "--model", "/nonexistent"], "--model /nonexistent: no such directory"),
    (["serve", "--awq-streaming", "full_stream"], "--awq-streaming needs --model"),
    (["serve", "--memory-limit", "20"], "--memory-limit 20: give a unit"),
    (["serve", "--memory-limit", "1MiB"], "this process holds"),
    (["serve", "--max-body-size", "huge"], "--max-body-size huge"),
    (["serve", "--max-cache-bytes", "2XB"], "--max-cache-bytes 2XB: unknown unit"),
    (["serve", "--grammar-cache", "0MiB"], "--grammar-cache 0MiB: must be more than 0"),
    (["serve", "--port", "70000"], "--port 70000"),
    (["serve", "--warm-file", "/nonexistent/system.txt"], "--warm-file /nonexistent/system.txt: no such file"),
    (["serve", "--no-memory-planning", "--memory-limit", "8GiB"], "drop --no-memory-planning"),
    (["serve", "--draft-layers", "2"], "add --draft int4"),
    (["serve", "--torch-threads", "0"], "--torch-threads 0: must be 1 or more"),
    (["serve", "--max-batch-size", "0"], "--max-batch-size must be a positive int"),
    (["serve", "--kv-bits", "2"], "invalid choice"),
    (["demo", "--model", "./no-such-model"], "--model ./no-such-model: no such directory"),
    (["awq-pack", "/nonexistent/float", "/tmp/never-written"], "/nonexistent/float: no such directory"),
])
def test_bad_flags_are_one_line_exit_2_before_anything_slow(argv, says, nothing_slow, capsys):
    assert run(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err, err  # no usage block, no traceback
    assert err.startswith(f"kvboost-hf {argv[0]}: error:") and says in err, err
    assert captured.out == ""


def test_memory_limit_below_the_process_says_the_figure(nothing_slow, capsys):
    assert run(["serve", "--memory-limit", "1MiB"]) == 2
    err = capsys.readouterr().err
    held = re.search(r"the ([0-9.]+ [KMGT]iB) this process holds", err)
    assert held and "1.00 MiB" in err and "pass more, e.g. --memory-limit" in err


def test_awq_pack_group_size_is_checked_against_the_config_before_loading(tmp_path, nothing_slow, capsys):
    src = tiny_checkpoint(tmp_path / "float")
    capsys.readouterr()  # save_pretrained's own progress bar
    assert run(["awq-pack", str(src), str(tmp_path / "awq"), "--group-size", "48"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--group-size 48 does not divide hidden_size (64)" in err
    assert not (tmp_path / "awq").exists()


def test_awq_pack_calibration_shows_progress(tmp_path, capsys):
    src = tiny_checkpoint(tmp_path / "float")
    capsys.readouterr()
    calibration = tmp_path / "calib.txt"
    calibration.write_text(" ".join(f"w{i % 90 + 3}" for i in range(64)))
    assert run(["awq-pack", str(src), str(tmp_path / "awq"), "--group-size", "32",
                "--calibration-file", str(calibration)]) == 0
    err = capsys.readouterr().err
    assert "AWQ scale search" in err and "2/2" in err  # one step per decoder layer
    assert "int4 packing" in err and "14/14" in err  # 7 linears per layer


def test_help_shows_defaults_and_plain_text(capsys):
    helps = {}
    for command in ([], ["serve"], ["plan"], ["awq-pack"], ["demo"]):
        assert run([*command, "--help"]) == 0
        helps[" ".join(command)] = " ".join(capsys.readouterr().out.split())
    for name, text in helps.items():
        assert "`" not in text, f"RST markup in kvboost-hf {name} --help"
    serve = helps["serve"]
    assert "--port PORT TCP port, 1-65535 (default: 8000)" in serve
    assert "(default: 2GB)" in serve and "(default: 4MiB)" in serve and "(default: exact)" in serve
    assert "OMP_NUM_THREADS" in serve  # --torch-threads says where its default comes from
    assert "--group-size GROUP_SIZE" in helps["awq-pack"] and "(default: 128)" in helps["awq-pack"]
    assert "--context CONTEXT tokens per sequence (default: 8192)" in helps["plan"]
    assert "(default: 24)" in helps["demo"]
    assert "(default: None)" not in " ".join(helps.values())


def test_version_is_the_installed_package_version(capsys):
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"kvboost-hf {metadata.version('kvboost_hf')}"


def test_plan_with_too_little_memory_does_not_say_the_weights_fit(tmp_path, capsys):
    src = tiny_checkpoint(tmp_path / "tiny")
    capsys.readouterr()
    assert run(["plan", "--model", str(src), "--memory", "100KiB", "--bandwidth", "10", "--margin", "0"]) == 0
    out = capsys.readouterr().out
    assert "cannot serve: the weights" in out and "do not fit in 0.1 MiB" in out and "the weights fit" not in out
