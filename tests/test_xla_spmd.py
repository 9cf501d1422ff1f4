"""Tensor parallelism on XLA through SPMD (`backends/xla/spmd.py`) on the CPU PJRT device with two
virtual devices (`CPU_NUM_DEVICES=2`; SPMD must be on before the runtime starts, hence a fresh
process per engine): tp=2 generates the greedy tokens of tp=1, with the Megatron weights and the
KV cache actually sharded, no compilation after warm-up (strict), and a size the devices cannot
hold refused with the count."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch_xla", reason="torch_xla is not installed (see .ci/xla.sh)")

RUN = """
import json, sys
import torch_xla
from polyrunner import LLM, SamplingParams
tp = int(sys.argv[2])
llm = LLM(sys.argv[1], backend="xla", dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
          block_size=16, kv_cache_memory_bytes=1 << 22, request_buckets=[4], strict_no_recompile=True,
          tensor_parallel_size=tp)
prompts = [{"prompt_token_ids": list(range(3 + i, 3 + i + 5 * (i + 1)))} for i in range(4)]
outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
model, runner = llm.engine.runner.model, llm.engine.runner
spec = torch_xla._XLAC._get_xla_sharding_spec
result = {"tokens": [o.outputs[0].token_ids for o in outs], "serving_graphs": runner.executor.serving_graphs,
          "weights": {n: spec(p) for n, p in model.named_parameters() if n.startswith("layers.0.")},
          "kv": spec(runner.kv_caches[0])}
if tp > 1:
    try:
        LLM(sys.argv[1], backend="xla", tensor_parallel_size=3)
    except ValueError as e:
        result["refused"] = str(e)
print(json.dumps(result))
"""


def test_tp2_matches_tp1(tiny_model_factory):
    folder = tiny_model_factory("llama")[0]
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    env.pop("CPU_NUM_DEVICES", None)
    runs = {tp: subprocess.Popen([sys.executable, "-c", RUN, str(folder), str(tp)], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env={**env, "CPU_NUM_DEVICES": "2"} if tp == 2 else env)
            for tp in (1, 2)}
    got = {}
    for tp, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        got[tp] = json.loads(out.strip().splitlines()[-1])
    one, two = got[1], got[2]
    assert two["tokens"] == one["tokens"]
    assert one["serving_graphs"] == two["serving_graphs"] == 0
    assert all(s == "" for s in one["weights"].values()) and one["kv"] == ""
    w = two["weights"]
    for name in ("qkv_proj", "gate_up_proj"):                    # column-parallel: rows split
        assert w[f"layers.0.{'self_attn' if name == 'qkv_proj' else 'mlp'}.{name}.weight"] == "{devices=[2,1]0,1}"
    for name in ("self_attn.o_proj", "mlp.down_proj"):            # row-parallel: columns split
        assert w[f"layers.0.{name}.weight"] == "{devices=[1,2]0,1}"
    assert w["layers.0.input_layernorm.weight"] in ("", "{replicated}")
    assert two["kv"] == "{devices=[1,1,1,2,1]0,1}"               # [2, NB, bs, Hkv, D]: by KV head
    assert "tensor_parallel_size=3" in two["refused"] and "CPU_NUM_DEVICES=3" in two["refused"]
