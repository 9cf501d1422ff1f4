"""Host time per decode step of the XLA backend on the CPU PJRT device.

Times `XLAGraphExecutor.run` (the backbone: trace or replay, graph lookup and
dispatch; the device work runs asynchronously) over the decode steps of a
batch of greedy requests on a small random Llama (4 layers, head size 64),
after warm-up. Run in the xla venv:

    PJRT_DEVICE=CPU ~/.cache/polyrunner/venvs/xla-2.9.0/bin/python benchmarks/xla_host_time.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")


def make_model(folder: Path, layers: int) -> None:
    import torch
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    from polyrunner import LLM, SamplingParams
    with tempfile.TemporaryDirectory() as tmp:
        make_model(Path(tmp), args.layers)
        llm = LLM(tmp, backend="xla", dtype="float32", max_num_seqs=args.batch, max_num_batched_tokens=64,
                  max_model_len=256, block_size=16, kv_cache_memory_bytes=1 << 24, request_buckets=[args.batch])
        ex = llm.engine.runner.executor
        run, times = ex.run, []

        def timed(inputs):
            start = time.perf_counter()
            out = run(inputs)
            if int(inputs.input_ids.shape[0]) <= args.batch * 2:   # decode-sized buckets only
                times.append(time.perf_counter() - start)
            return out

        ex.run = timed
        prompts = [{"prompt_token_ids": list(range(3 + i, 11 + i))} for i in range(args.batch)]
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)   # first pass: caches warm
        times.clear()
        llm.generate(prompts, params, use_tqdm=False)
    mode = ex.mode
    print(f"xla host time per decode step ({mode}, {args.layers} layers, batch {args.batch}): "
          f"median {statistics.median(times) * 1e3:.2f} ms over {len(times)} steps; "
          f"graphs compiled while serving: {ex.serving_graphs}", file=sys.stdout)


if __name__ == "__main__":
    main()
