"""The pure helpers of `compare.py --model`: the real shapes' parameter counts, the bytes of weights
a decode step reads, the interleaved rounds (order, medians, a failing engine dropped with its reason),
the workers' derived figures, the table's bandwidth used and ratios, each engine's worker command."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bandwidth  # noqa: E402
import realistic_models as rm  # noqa: E402
import rounds  # noqa: E402


@pytest.mark.parametrize("name, params", [("smollm2-1.7b", 1_711_376_384), ("llama-3.2-3b", 3_212_749_824),
                                          ("llama-3.1-8b", 8_030_261_248)])
def test_the_shapes_have_the_published_parameter_counts(name: str, params: int) -> None:
    assert rm.SHAPES[name].num_params() == params


def test_shards_hold_every_tensor_once_and_stay_under_the_shard_size() -> None:
    shape = rm.SHAPES["llama-3.1-8b"]
    shards = rm._plan_shards(shape)
    names = [n for shard in shards for n, _ in shard]
    assert names == [n for n, _ in shape.tensors()]
    assert "lm_head.weight" in names and "lm_head.weight" not in [n for n, _ in rm.SHAPES["llama-3.2-3b"].tensors()]
    for shard in shards:
        size = sum(2 * rm.numel(s) for _, s in shard)
        assert size <= rm.SHARD_BYTES or len(shard) == 1


def test_read_per_token_drops_the_embedding_unless_it_is_the_head() -> None:
    untied = {"token_embd.weight": 100, "output.weight": 100, "blk.0.attn_q.weight": 10, "blk.0.attn_norm.weight": 1}
    assert bandwidth.weight_bytes_per_token(untied, "token_embd.weight", "output.weight") == 111
    tied = {k: v for k, v in untied.items() if k != "output.weight"}
    assert bandwidth.weight_bytes_per_token(tied, "token_embd.weight", "output.weight") == 111


def test_safetensors_sizes_come_from_the_headers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    save_file({"model.embed_tokens.weight": torch.zeros(64, 8, dtype=torch.bfloat16),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(8, dtype=torch.float32)}, str(tmp_path / "model.safetensors"))
    sizes = bandwidth.safetensors_tensor_bytes(tmp_path)
    assert sizes == {"model.embed_tokens.weight": 1024, "model.layers.0.mlp.up_proj.weight": 256,
                     "model.norm.weight": 32}
    info = bandwidth.file_weight_bytes(tmp_path)
    assert info["read_per_token"] == 256 + 32 + 1024      # no lm_head: tied, the embedding is the head
    assert info["tensor_bytes"] == 1312
    assert bandwidth.bandwidth_used(10**9, 5.0, 20e9) == pytest.approx(0.25)


def _job(name: str, script: str) -> rounds.Job:
    return rounds.Job(name, "f", [sys.executable, "-c", script], ["w3"])


def test_rounds_interleave_report_medians_and_drop_a_failing_engine(tmp_path: Path) -> None:
    log = tmp_path / "order"
    script = ("import json, sys; open(%r, 'a').write('{n}\\n'); n = len(open(%r).read().split());"
              "print('LOAD ' + json.dumps({{'start_s': n}}));"
              "print('RESULT ' + json.dumps({{'workload': 'w3', 'output_tok_s': 10.0 * n, 'tpot_ms': 100.0 / n}}))"
              % (str(log), str(log)))
    a, b = _job("a", script.format(n="a")), _job("b", script.format(n="b"))
    bad = _job("bad", "import os, signal; os.kill(os.getpid(), signal.SIGILL)")
    a.engine = "llama.cpp"     # a label with a dot: the log files keep it whole
    rounds.run_rounds([a, bad, b], 3, log=lambda _: None, log_dir=tmp_path / "logs")
    assert (tmp_path / "logs" / "llama.cpp_f-r3.out").read_text().startswith("LOAD")
    assert (tmp_path / "logs" / "bad_f-r1.err").is_file()
    assert log.read_text().split() == ["a", "b", "b", "a", "a", "b"]     # forward, reverse, forward
    assert bad.error is not None and "SIGILL" in bad.error and not bad.runs
    s = rounds.summary(a)      # a ran as the 1st, 4th and 5th process
    assert s["rounds"] == 3 and s["w3"]["output_tok_s"] == 40.0 and s["start_first_s"] == 1
    assert s["start_later_s"] == 4.5
    assert rounds.summary(bad)["error"] == bad.error


def test_the_kv_cache_budget_holds_w2_for_every_shape() -> None:
    from model_compare import kv_cache_gib
    for name in rm.REAL_SHAPES:
        shape = rm.SHAPES[name]
        c = shape.config
        need = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * shape.head_dim * 4 * 8 * (32 + 512)
        assert kv_cache_gib(shape) * (1 << 30) >= need


def test_resolve_takes_a_name_or_a_written_folder(tmp_path: Path) -> None:
    assert rm.resolve("llama-3.2-3b")[0].name == "llama-3.2-3b"
    (tmp_path / "bench_model.json").write_text(json.dumps({"shape": "smoke-tiny"}))
    (tmp_path / "hf-bf16").mkdir()
    shape, folder = rm.resolve(str(tmp_path / "hf-bf16"))
    assert shape.name == "smoke-tiny" and folder == tmp_path
    with pytest.raises(SystemExit):
        rm.resolve(str(tmp_path.parent / "nothing-here"))


def test_a_shape_that_does_not_fit_the_disk_is_skipped_with_the_reason(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(rm, "ROOT", tmp_path)
    monkeypatch.setattr(rm, "free_bytes", lambda path: 10 << 30)
    ms = rm.ensure(rm.SHAPES["llama-3.1-8b"], ["Q4_K_M", "bf16"])
    assert not ms.files and set(ms.skipped) == {"Q4_K_M", "bf16"}
    assert "needs ~" in ms.skipped["bf16"] and "GB free" in ms.skipped["bf16"]
    assert "SKIP llama-3.1-8b" in capsys.readouterr().out
    assert not any(tmp_path.iterdir())          # nothing written


def test_a_worker_that_times_out_is_killed_with_its_children(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    job = _job("slow", script)
    rounds.run_rounds([job], 1, timeout_s=3, log=lambda _: None)
    assert job.error is not None and job.error.startswith("timed out")
    child = int(pid_file.read_text())
    stat = Path(f"/proc/{child}/stat")

    def gone() -> bool:    # gone, or a zombie (SIGKILL lands when the child is next scheduled: on a busy host later)
        try:
            return stat.read_text().split(") ")[1].startswith("Z")
        except (OSError, IndexError):
            return True
    deadline = time.monotonic() + 20
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone()        # (it sleeps 60 s: only the kill of the worker's process group ends it this soon)


def test_worker_results_derive_w2_and_w3_figures_from_the_median_run() -> None:
    import dataclasses

    from shared_workloads import capped, result

    @dataclasses.dataclass(frozen=True)
    class W:
        name: str
        max_tokens: int
        prompt_tokens: int = 32

    w3 = capped(W("w3", 256), 11)
    assert w3.max_tokens == 11 and capped(w3, None) is w3 and capped(w3, 500).max_tokens == 11
    res = result("x", w3, walls=[3.0, 1.1, 2.0], ttfts=[0.1, 0.2, 0.9], output_tokens=11, extra=1)
    assert res["wall_s"] == 2.0 and res["output_tok_s"] == 5.5 and res["total_tok_s"] == 21.5
    assert res["ttft_ms"] == pytest.approx(200.0) and res["tpot_ms"] == pytest.approx(180.0) and res["extra"] == 1
    w2 = result("x", W("w2", 512, 256), walls=[4.0], ttfts=[], output_tokens=8 * 512)
    assert w2["tpot_ms"] == pytest.approx(4000 / 512) and "ttft_ms" not in w2


def test_the_table_gives_bandwidth_used_and_the_ratios_per_file() -> None:
    import model_compare

    def row(engine: str, file: str, tok_s: float, tpot: float, ttft: float) -> dict:
        return {"engine": engine, "file": file, "rounds": 3, "error": None, "file_bytes": 2e9, "read_per_token": 1e9,
                "w2": {"output_tok_s": tok_s, "tpot_ms": 1e3 * 8 / tok_s},
                "w3": {"tpot_ms": tpot, "ttft_ms": ttft}, "start_first_s": 3.0, "start_later_s": 1.5,
                "rss_after_load": 1e9, "peak_load": 2e9, "rss_end": 3e9}
    rows = [row("polyrunner-quant", "Q4_K_M", 80.0, 50.0, 100.0), row("llama.cpp", "Q4_K_M", 40.0, 100.0, 150.0),
            row("polyrunner", "bf16", 30.0, 200.0, 300.0), row("vllm-compiled", "bf16", 10.0, 400.0, 600.0)]
    rows.append({"engine": "vllm-eager", "file": "bf16", "rounds": 0, "error": "exit status 1: boom",
                 "file_bytes": 2e9, "read_per_token": 1e9})
    text = model_compare.model_table(rows, bw=40e9, flags="avx2 fma", header=["== head"])
    quant = next(line for line in text.splitlines() if line.startswith("polyrunner-quant"))
    assert " 20.0 " in quant and " 50% " in quant and " 1.50x " in quant    # 1 GB x 20 tok/s / 40 GB/s; RSS/file
    assert rows[0]["bandwidth_used"] == pytest.approx(0.5)
    assert "polyrunner-quant x llama.cpp (Q4_K_M): W2 out tok/s 2.00x, W3 time/token 2.00x, W3 TTFT 1.50x" in text
    assert "polyrunner x vllm-compiled (bf16): W2 out tok/s 3.00x, W3 time/token 2.00x, W3 TTFT 2.00x" in text
    assert "vllm-eager bf16: not measured: exit status 1: boom" in text
    assert "x vllm-eager" not in text and text.splitlines()[-1] == "CPU flags: avx2 fma"


def test_engine_jobs_carry_each_engines_flags_and_environment() -> None:
    import engines

    poly = engines.polyrunner_job("polyrunner", "bf16", "/m/hf", ["w2", "w3"], 8, dtype="bfloat16",
                                  kv_cache_bytes=2 << 30)
    assert poly.cmd[poly.cmd.index("--model") + 1] == "/m/hf" and "--dtype" in poly.cmd
    assert poly.cmd[-7:] == ["--workload", "w2", "w3", "--repeats", "1", "--max-tokens", "8"]
    assert "--max-tokens" not in engines.polyrunner_job("p", "f", None, ["w3"], None).cmd
    vllm = engines.vllm_job(Path("/v/python"), "compiled", "bf16", "/m/hf", "bfloat16", ["w3"], None,
                            kv_cache_gib=2, max_num_batched_tokens=256)
    assert vllm.engine == "vllm-compiled" and "--eager" not in vllm.cmd
    assert vllm.cmd[vllm.cmd.index("--max-num-batched-tokens") + 1] == "256"
    assert vllm.env["VLLM_CPU_KVCACHE_SPACE"] == "2" and vllm.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert "--eager" in engines.vllm_job(Path("/v/python"), "eager", "bf16", "/m", "bfloat16", ["w3"], None).cmd
    with pytest.raises(ValueError):
        engines.vllm_job(Path("/v/python"), "graph", "bf16", "/m", "bfloat16", ["w3"], None)


def test_the_tables_say_how_many_rounds_and_when_a_run_is_a_smoke_run() -> None:
    assert rounds.describe(3).startswith("3 interleaved rounds (every engine once per round")
    assert rounds.describe(1).startswith("1 interleaved round (")
    assert "SMOKE" not in rounds.describe(3) and "SMOKE: output capped at 8 tokens" in rounds.describe(2, 8)
