"""KV cache budget from a profile run, and the TPU page (block) size, as vLLM's TPU worker does.

`profiled_kv_budget`: run the largest bucket once (the runner's `profile`, which allocates a
2-block cache and runs `max_num_batched_tokens` tokens), wait for the device, then read
torch_xla's memory info (`xm.get_memory_info`: `bytes_limit`, `bytes_used`,
`peak_bytes_used`): KV bytes = limit x utilisation - peak. (vLLM's TPU worker uses
`bytes_used * 1.02` instead of the peak, because XLA cannot reset the peak and weight loading
may have set it; using the peak here is the conservative choice.) The CPU PJRT device has no
memory info (torch_xla 2.9 raises UNIMPLEMENTED: GetAllocatorStats), so there the previous
rule stays: free host memory x utilisation - weights, capped by `POLYRUNNER_XLA_CPU_KV_BYTES`.

`tpu_page_size`: vLLM's `PallasAttentionBackend.get_page_size` — max_model_len split into
about 16 pages, the page size a power of two in [16, 256], and 16 above 8192 tokens.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

logger = logging.getLogger(__name__)


def profiled_kv_budget(memory_info: Callable[[], dict[str, Any]], profile: Callable[[], None],
                       wait: Callable[[], None], utilization: float) -> int:
    """KV bytes left at `utilization` of the device's limit after the profile run's peak."""
    profile()
    wait()
    info = memory_info()
    limit = int(info["bytes_limit"])
    peak = int(info.get("peak_bytes_used") or info["bytes_used"])
    budget = max(0, int(limit * utilization) - peak)
    logger.info("xla: KV budget %.2f GiB = limit %.2f GiB x %.2f - profiled peak %.2f GiB",
                budget / 2**30, limit / 2**30, utilization, peak / 2**30)
    return budget


def tpu_page_size(max_model_len: int) -> int:
    """vLLM's TPU page size for `max_model_len` (a power of two in [16, 256])."""
    if max_model_len > 8192:
        return 16
    page = 1 << (max_model_len - 1).bit_length() if max_model_len > 1 else 1
    return min(256, max(16, page // 16))
