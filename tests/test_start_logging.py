"""Engine start-up talks at INFO, stage by stage with timings, once logging is configured, and
stays quiet (Python's default WARNING) when the embedding application configured nothing."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

from polyrunner import LLM


def test_engine_start_logs_each_stage(tiny_model_factory, caplog):
    folder, _ = tiny_model_factory("llama")
    with caplog.at_level(logging.INFO, logger="polyrunner"):
        LLM(str(folder), backend="cpu", dtype="bfloat16", max_model_len=64, max_num_seqs=4,
            kv_cache_memory_bytes=1 << 20)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    expected = [rf"model {re.escape(str(folder))} on backend cpu: starting",
                rf"model {re.escape(str(folder))}: LlamaForCausalLM, dtype bfloat16, quantization None, "
                r"max_model_len 64",
                r"loading \d+ tensors \(0 run quantized, \d+ dense in bfloat16\) from ",
                r"loaded \d+ tensors in \d+\.\d s",
                r"KV cache: \d+ blocks of 16 tokens \(\d+ tokens, \d+\.\d\d GiB\)",
                r"engine ready in \d+\.\d s: backend=cpu"]
    found = [next((i for i, line in enumerate(lines) if re.match(pattern, line)), None) for pattern in expected]
    assert None not in found, f"missing {[p for p, i in zip(expected, found) if i is None]} in {lines}"
    assert found == sorted(found), lines


def test_library_use_is_quiet_without_logging_configured(tiny_model_factory):
    folder, _ = tiny_model_factory("llama")
    code = ("from polyrunner import LLM, SamplingParams\n"
            f"llm = LLM({str(folder)!r}, backend='cpu', dtype='float32', max_model_len=64, max_num_seqs=4)\n"
            "llm.generate([{'prompt_token_ids': [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr == "" and out.stdout == ""
