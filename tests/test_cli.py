"""The command line: `generate` on the embedded model, and the `backends` table."""

import subprocess
import sys

import pytest

from polyrunner.tools.cli import main


def run_cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "polyrunner.tools.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_default_model_names_paris():
    pytest.importorskip("gguf")
    proc = run_cli("generate", "--prompt", "The capital of France is", "--max-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_backends_table(capsys):
    assert main(["backends"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["cpu"].split()[1] == "yes"
    for name in ("cuda", "xla", "npu"):
        assert rows[name].split()[1] == "no", rows[name]
        assert len(rows[name].split()) > 4  # a reason is given


def test_generate_reports_bad_model_cleanly(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_chat_one_shot_message():
    pytest.importorskip("gguf")
    proc = run_cli("chat", "--message", "What is the capital of France? Answer in one word.",
                   "--max-tokens", "8")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_applies_the_model_template():
    from polyrunner import LLM, SamplingParams
    llm = LLM(max_model_len=512, max_num_seqs=2)
    messages = [{"role": "user", "content": "Hi"}]
    text = llm.tokenizer.apply_chat_template(messages)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt == text
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
