"""Host syncs in a compiled XLA step, reported as the capture guard reports them.

A step compiled by `torch.compile(backend="openxla", fullgraph=True)` cannot run the capture
guard (dynamo refuses a TorchDispatchMode it did not set up); dynamo refuses host syncs itself: a
`.item()`, a branch on a tensor value or an op whose output shape depends on data is a graph
break, and fullgraph makes a graph break a `torch._dynamo.exc.Unsupported`. `from_dynamo`
recognises those breaks by their type (the first line of dynamo's message, torch 2.9) and builds
the `HostSyncError` the guard would raise, naming the op and the user code that calls it; the
executor raises it chained to dynamo's error. Any other break is not a host sync (None).
"""

from __future__ import annotations

import re

from polyrunner.plugin_api import HostSyncError

READ = "it reads a device tensor on the host"
SHAPE = "its output shape depends on tensor values"

# dynamo's graph-break type (torch 2.9) -> (the op, or None: the op dynamo names; why it syncs)
BREAKS: dict[str, tuple[str | None, str]] = {
    "Unsupported Tensor.item() call with capture_scalar_outputs=False":
        ("Tensor.item() (or int(t), float(t))", READ),
    "Tensor.tolist() with non-integer tensor": ("Tensor.tolist()", READ),
    "Tensor.numpy() with trace_numpy=False": ("Tensor.numpy()", READ),
    "Data dependent operator": (None, READ),
    "Data-dependent branching": ("a branch on a tensor's value (if t:, bool(t))", READ),
    "Data-dependent branching with non-constant __bool__": ("a branch on a tensor's value (bool(t))", READ),
    "Dynamic shape operator": (None, SHAPE),
    "Dynamic shape operator (no meta kernel)": (None, SHAPE),
}
_CONTEXT = re.compile(r"Developer debug context:\s*(\S+)")
_USER_CODE = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')


def from_dynamo(exc: BaseException) -> HostSyncError | None:
    """The `HostSyncError` for dynamo's refusal `exc` of a host sync; None for anything else."""
    from torch._dynamo.exc import Unsupported
    text = str(exc)
    kind = text.splitlines()[0].strip() if text else ""
    if not isinstance(exc, Unsupported) or kind not in BREAKS:
        return None
    op, why = BREAKS[kind]
    if op is None:
        named = _CONTEXT.search(text)
        op = named.group(1) if named else kind
    calls = _USER_CODE.findall(text)
    where = ""
    if calls:
        path, line, func, code = calls[-1]
        where = f" (at {path}:{line} in {func}: {code.strip()})"
    return HostSyncError(
        f"{op} inside the compiled XLA step{where}: {why}. torch.compile(fullgraph=True) refused it "
        f"(dynamo: {kind!r}); a graph replays device work only, so the op must stay on the device "
        "with a fixed shape (keep host values in numpy before the step)")
