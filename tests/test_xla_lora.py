"""Multi-LoRA on the XLA backend (CPU PJRT device): a batch mixing two adapters (one with
token-embedding weights) and the base model gives the CPU backend's greedy tokens (which
tests/test_lora_engine.py checks against peft's merged models), through the compiled
static-shape steps, with no recompilation while serving."""

import os

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla", reason="torch_xla is not installed (see .ci/xla.sh)")
os.environ.setdefault("PJRT_DEVICE", "CPU")

from polyrunner import LLM, SamplingParams  # noqa: E402
from polyrunner.lora.peft import LoRAWeights, save_adapter  # noqa: E402
from polyrunner.lora.request import LoRARequest  # noqa: E402

OPTIONS = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, block_size=16,
               kv_cache_memory_bytes=1 << 22, enable_lora=True, max_loras=2, max_lora_rank=8)
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 128, 256, 2, 1, 64, 2
SHAPES = {"q_proj": (HEADS * HEAD_DIM, HIDDEN), "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
          "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN), "o_proj": (HIDDEN, HEADS * HEAD_DIM),
          "gate_proj": (INTER, HIDDEN), "up_proj": (INTER, HIDDEN), "down_proj": (HIDDEN, INTER)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    path = tmp_path_factory.mktemp("xla-lora-base")
    model.save_pretrained(path)
    return path


def _adapter(path, rank: int, names, seed: int, embed: bool = False) -> str:
    gen = torch.Generator().manual_seed(seed)
    modules = {(layer, n): LoRAWeights(torch.randn(rank, SHAPES[n][1], generator=gen) * 0.1,
                                       torch.randn(SHAPES[n][0], rank, generator=gen) * 0.1)
               for layer in range(LAYERS) for n in names}
    emb = LoRAWeights(torch.randn(rank, 512, generator=gen), torch.randn(HIDDEN, rank, generator=gen) * 0.05)
    save_adapter(path, modules, rank, 2 * rank, emb if embed else None)
    return str(path)


def test_mixed_adapters_match_the_cpu_backend(folder, tmp_path):
    loras = [LoRARequest("attn", 1, _adapter(tmp_path / "a", 4, ("q_proj", "v_proj", "o_proj"), 1)),
             LoRARequest("all", 2, _adapter(tmp_path / "b", 8, tuple(SHAPES), 2, embed=True))]
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, 512, size=n).tolist()} for n in (5, 17, 40, 9)]
    assign = [loras[0], None, loras[1], loras[0]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(llm, loras=assign):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False, lora_request=loras)]

    xla = LLM(str(folder), backend="xla", strict_no_recompile=True, request_buckets=[4], **OPTIONS)
    got = run(xla)
    assert xla.engine.runner.executor.serving_graphs == 0
    cpu = LLM(str(folder), backend="cpu", **OPTIONS)
    assert got == run(cpu)
    base = run(cpu, None)
    assert got[0] != base[0] and got[2] != base[2] and got[1] == base[1]   # the adapters change the tokens
