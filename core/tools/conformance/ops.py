"""Op overrides: every module a backend's `op_overrides` makes for a role gives the role's
reference result (`polyrunner.ops.ROLES`) on random cases (`polyrunner.ops.cases`: row counts
from 1 to a few dozen, the tiny model's sizes and odd ones, weights that show a dropped term),
for each dtype the backend declares, on its device, within the dtype's tolerance. A backend
without overrides passes with a note.

Attention is a role too, but its override is `Backend.attention` itself, which
`execution::attention_matches_reference` compares with the reference. On the models: the
engines of the `execution` and `end_to_end` groups load the model as the core does, with the
overrides applied (`load_runner` in `polyrunner.engine.model_setup`), so their checks run every
replacement in its model; the greedy parity checks depend on this group.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn

from polyrunner.ops import MODULE_ROLES, ROLES, OpFactory, apply_overrides, check_roles
from polyrunner.ops.cases import CaseSizes, compare
from polyrunner.tools.conformance.framework import check, fail


class _Holder(nn.Module):
    """A one-module model: its `replaceable_modules()` names `op` in `role`, so a factory is
    applied to it exactly as the core applies it to a model (`apply_overrides`)."""

    def __init__(self, role: str, module: nn.Module) -> None:
        super().__init__()
        self.role, self.op = role, module

    def replaceable_modules(self) -> Iterator[tuple[str, nn.Module, str, nn.Module]]:
        yield self.role, self, "op", self.op


def case_sizes(arch) -> CaseSizes:
    """The tiny model's sizes, with odd ones (not multiples of 16 or 32) after them."""
    return CaseSizes(hidden=(arch.hidden_size, 72, 100), intermediate=(arch.intermediate_size, 100, 36),
                     head_dims=(arch.head_dim, 64), heads=(arch.num_heads, arch.num_kv_heads))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _kind(got: torch.Tensor, ref: torch.Tensor) -> str:
    """'' when shape and dtype agree, else what differs."""
    if got.shape == ref.shape and got.dtype == ref.dtype:
        return ""
    return (f": got {tuple(got.shape)} {_dtype_name(got.dtype)}, expected {tuple(ref.shape)} "
            f"{_dtype_name(ref.dtype)}")


def _check_role(backend, role: str, factory: OpFactory, dtype: torch.dtype, sizes: CaseSizes, seed: int
                ) -> tuple[int, int, float]:
    """(cases, cases whose module the factory replaced, worst error / tolerance) of one role in one dtype."""
    cases = replaced = 0
    worst = 0.0
    maker = ROLES[role].cases
    assert maker is not None
    for case in maker(dtype, backend.device, sizes, torch.Generator().manual_seed(seed)):
        original = copy.deepcopy(case.module)   # the factory may keep or change what it is given
        holder = _Holder(role, original)
        apply_overrides(holder, {role: factory})
        cases += 1
        replaced += holder.op is not original
        for call in case.calls:
            with backend.no_grad():
                ref, got = call.run(case.module), call.run(holder.op)
            backend.synchronize()
            where = f"({call.method}, {_dtype_name(dtype)}, {call.shape}"
            if len(got) != len(ref):
                fail(f"op override for role {role!r} {where}) returned {len(got)} outputs; the reference "
                     f"returns {len(ref)} ({', '.join(call.outputs)})")
            for name, g, r in zip(call.outputs, got, ref):
                ok, err, bound = compare(g, r, dtype)
                label = f"{where}{f', {name}' if len(ref) > 1 else ''})"
                if not ok:
                    fail(f"op override for role {role!r} {label} differs from the reference{_kind(g, r)}: "
                         f"max abs error {err:.3g} (tolerance {bound:.3g})")
                worst = max(worst, err / bound if bound else 0.0)
    return cases, replaced, worst


@check("ops")
def check_overrides_match_reference(ctx) -> str:
    """Every op override's module gives the role's reference result on random cases, per declared dtype
    (the backend made with LoRA enabled, so that it offers its "lora" op too)."""
    from polyrunner.config import LoRAConfig
    backend = ctx.new_backend(lora=LoRAConfig())
    sizes = case_sizes(ctx.arch)
    notes, none = [], []
    for dtype in backend.capabilities.dtypes:
        overrides = backend.op_overrides(dtype)
        try:
            check_roles(overrides)
        except ValueError as exc:
            fail(f"op_overrides({_dtype_name(dtype)}): {exc}")
        if not overrides:
            none.append(_dtype_name(dtype))
            continue
        parts, worst = [], 0.0
        for role in MODULE_ROLES:
            if role in overrides:
                cases, replaced, err = _check_role(backend, role, overrides[role], dtype, sizes, ctx.settings.seed)
                parts.append(f"{role} {replaced}/{cases}")
                worst = max(worst, err)
        notes.append(f"{_dtype_name(dtype)}: {', '.join(parts)} cases replaced, worst error {worst:.2f}x "
                     "the tolerance")
    if none:
        notes.append(f"no op overrides for {', '.join(none)}")
    return "; ".join(notes)
