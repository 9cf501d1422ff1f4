"""Environment variables of the CUDA backend.

Declared through `polyrunner.envs`, which imports no torch; listed in the README.
"""

from __future__ import annotations

from polyrunner.envs import declare

TRITON = declare("POLYRUNNER_CUDA_TRITON", bool, True,
                 "0: SDPA paged attention instead of the Triton kernels", section="cuda")
