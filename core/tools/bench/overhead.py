"""Per-step host overhead of the runner, isolated with a no-op model.

The model returns zero hidden states and fixed logits, so a step's time is the
host path: scheduling, slot-state update, input preparation, sampling
bookkeeping and output processing. Reported in microseconds per step at 1, 32
and 256 running decode requests.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from polyrunner.plugins import hookimpl, register

VOCAB = 128  # small, so sampling (device work) does not hide the host path


class NoOpModel(torch.nn.Module):
    """Skips all compute: zero hidden states, fixed logits (token 7 wins)."""

    def __init__(self, arch, attn_op, max_positions):
        super().__init__()
        self.arch = arch
        self.rotary = torch.nn.Identity()
        self.dummy = torch.nn.Parameter(torch.zeros(1))
        self.logits = None  # built on first use (the model may be constructed on the meta device)

    def forward(self, input_ids, positions, meta, kv_caches):
        return torch.zeros(input_ids.shape[0], 1)

    def compute_logits(self, hidden):
        if self.logits is None:
            self.logits = torch.zeros(1, self.arch.vocab_size)
            self.logits[0, 7] = 1.0
        return self.logits.repeat(hidden.shape[0], 1)

    def load_weights(self, weights):
        for _ in weights:
            pass


class NoOpPlugin:
    PLUGIN_API_VERSION = "1.0"
    @hookimpl
    def polyrunner_models(self):
        return {"NoOpForCausalLM": NoOpModel}


_registered = False


def make_folder() -> Path:
    global _registered
    if not _registered:
        register(NoOpPlugin(), name="noop-model")
        _registered = True
    folder = Path(tempfile.mkdtemp(prefix="polyrunner-noop-"))
    cfg = dict(architectures=["NoOpForCausalLM"], model_type="llama", vocab_size=VOCAB, hidden_size=64,
               intermediate_size=64, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1,
               max_position_embeddings=4096)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({"dummy": torch.zeros(1)}, str(folder / "model.safetensors"))
    return folder


def measure(num_reqs: int, steps: int, folder: Path, repeats: int = 1) -> float:
    """Median over `repeats` of the mean microseconds per decode step with `num_reqs` running requests."""
    from polyrunner import LLM, SamplingParams
    llm = LLM(str(folder), backend="cpu", max_num_seqs=num_reqs,
              max_num_batched_tokens=max(2048, num_reqs * 16), max_model_len=4096,
              kv_cache_memory_bytes=64 << 20, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=repeats * steps + 10, ignore_eos=True)
    for i in range(num_reqs):
        engine.add_request({"prompt_token_ids": [1 + i % 100] * 16}, params)
    engine.step()  # all prefills in one step
    for _ in range(5):
        engine.step()
    results = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        results.append((time.perf_counter() - start) / steps * 1e6)
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    return statistics.median(results)


def run_overhead(batches=(1, 32, 256), steps: int = 200, repeats: int = 3) -> dict[int, float]:
    """{running decode requests: host microseconds per step}."""
    folder = make_folder()
    return {n: measure(n, steps, folder, repeats) for n in batches}
