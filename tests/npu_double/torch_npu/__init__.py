"""A test double of torch_npu (Ascend Extension for PyTorch) that enforces what the real ops
document, for CI without an NPU.

Never shipped: tests put `tests/npu_double` on sys.path (the `npu_double` fixture in
tests/npu_double_fixture.py, `PYTHONPATH=tests/npu_double` in .ci/npu.sh). Importing it does what
importing torch_npu does for the backend: `torch.npu` appears (`npu.py`) and the "hccl"
torch.distributed backend is registered.

The emulated device: tensors "on the NPU" are CPU tensors. The one seam is
`emulated_device_type = "cpu"`, which the backend reads through
`polyrunner.backends.npu.device.npu_device` (real torch_npu has no such attribute). Host-side
arguments (the ops' documented host tensors) are the ones declared with
`polyrunner.plugin_api.host_tensor`, since every tensor here is on the host.

- Ops (`_attention.py`, `_fused.py`) keep their documented signatures (a misspelt or missing
  argument fails as on the device), refuse what their documentation refuses (`_rules.py`, each
  rule citing its source: dtypes, block sizes, head sizes, layout x sparse mode, workspaces),
  compute the reference result, count their calls in `CALLS` and keep their last call in `LAST`.
- Graphs (`_graph.py`): the core's tape graphs under torch_npu's names; a replay re-executes only
  the recorded ops into the recorded buffers (`REPLAYS` counts the torch_npu ops it ran); task
  groups, task updates on an update stream and `ExternalEvent`s as the op-plugin docs describe.
- Memory statistics count live tensors (`_memory.py`).
"""

from __future__ import annotations

import torch

from torch_npu._attention import (  # noqa: F401 - torch_npu's names
    _npu_fused_infer_attention_score_get_max_workspace,
    _npu_paged_attention,
    _npu_paged_attention_get_workspace,
    _npu_reshape_and_cache,
    npu_fused_infer_attention_score,
)
from torch_npu._fused import npu_add_rms_norm, npu_rms_norm, npu_rotary_mul, npu_swiglu  # noqa: F401
from torch_npu._graph import CALLS, LAST, REPLAYS, GraphError  # noqa: F401
from torch_npu._rules import DocError  # noqa: F401

__version__ = torch.__version__.split("+")[0] + "+double"   # torch_npu X.Y.Z pairs with torch X.Y.Z
emulated_device_type = "cpu"


# ---- HCCL: torch_npu registers the "hccl" torch.distributed backend; the double's is gloo ----
def _hccl_group(store: object, rank: int, size: int, timeout: object) -> object:
    """The collective-communication group of the emulated devices (host tensors): a gloo group."""
    from torch.distributed import ProcessGroupGloo
    return ProcessGroupGloo(store, rank, size, timeout)


def _register_hccl() -> None:
    import torch.distributed as dist
    if dist.is_available() and not hasattr(dist.Backend, "HCCL"):
        dist.Backend.register_backend("hccl", _hccl_group, devices=["cpu"])


# ---- importing torch_npu registers `torch.npu` and hccl --------------------------------------
from torch_npu import npu  # noqa: E402

torch.npu = npu  # type: ignore[attr-defined]
_register_hccl()


def reset_counters() -> None:
    CALLS.clear()
    REPLAYS.clear()
    LAST.clear()
