"""Environment variables of the CUDA backend.

Declared through `polyrunner.envs`, which imports no torch; listed in the README.
"""

from __future__ import annotations

from polyrunner.envs import declare

TRITON = declare("POLYRUNNER_CUDA_TRITON", bool, True,
                 "0: SDPA paged attention instead of the Triton kernels", section="cuda")
FUSED = declare("POLYRUNNER_CUDA_FUSED", bool, True,
                "0: the core's RMSNorm, rotary and MLP modules instead of the fused Triton kernels", section="cuda")
