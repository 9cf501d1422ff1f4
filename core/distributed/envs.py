"""Environment variables of the distributed executors (declared in `polyrunner.envs`'s registry)."""

from __future__ import annotations

from polyrunner.envs import declare

RAY_PLACEMENT = declare("POLYRUNNER_RAY_PLACEMENT", str, "strict_pack",
                        "`distributed_executor_backend=\"ray\"`: the placement group's strategy for the "
                        "tensor-parallel ranks (Ray's names): strict_pack (every rank on one node), pack, "
                        "spread (across nodes where possible), strict_spread (one rank per node)",
                        choices=("strict_pack", "pack", "spread", "strict_spread"))
