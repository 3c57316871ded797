import io

from kvboost_hf.cli import main, run_demo
from kvboost_hf.models import GEMMA_CHAT_TEMPLATE, default_model_path


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
