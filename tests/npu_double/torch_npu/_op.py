"""How the double's torch_npu ops are called: bound to their documented signature (a misspelt or
missing argument fails as on the device), checked against the documented rules (`check`, also at
a task update, where the op itself does not run), then run eagerly, recorded into the graph being
captured, or re-bound by a task update (`_graph.run_op`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch_npu import _graph

Check = Callable[[dict[str, Any]], int]   # validates a call; returns the workspace bytes it needs


def no_check(call: dict[str, Any]) -> int:
    return 0


def op(*, check: Check = no_check, host: tuple[str, ...] = (), functional: bool = True,
       name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make `fn` a torch_npu op. `host`: the arguments the op reads on the host (frozen into a captured
    task); `functional`: it returns its results (else it writes an `out=` argument or caches in place);
    `name`: the op's torch_npu name (default: the function's)."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        op_name = name or fn.__name__

        @functools.wraps(fn)
        def call_op(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            call = dict(bound.arguments)
            with _graph.emulating():   # the rules read host values, never as a captured host sync
                needed = check(call)
            return _graph.run_op(op_name, fn, call, host, needed, functional)
        call_op.__name__ = op_name
        return call_op
    return wrap
