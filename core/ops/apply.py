"""Applying a backend's op overrides to a model: the one place the core swaps a model's modules."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from torch import nn

from polyrunner.ops.roles import MODULE_ROLES

# A role's factory: the core's module in that role -> the module to use (possibly the same one).
OpFactory = Callable[[nn.Module], nn.Module]


def check_roles(overrides: Mapping[str, OpFactory]) -> None:
    """ValueError naming every role of `overrides` that `Backend.op_overrides` may not name."""
    unknown = [role for role in overrides if role not in MODULE_ROLES]
    if unknown:
        raise ValueError(f"op overrides for unknown role(s) {', '.join(map(repr, unknown))}; known roles: "
                         f"{', '.join(MODULE_ROLES)} (attention is overridden by defining Backend.attention)")


def apply_overrides(model: nn.Module, overrides: Mapping[str, OpFactory]) -> dict[str, int]:
    """Replace the model's modules in each role of `overrides` (`Backend.op_overrides`) by what the
    role's factory returns for them; returns how many modules each overridden role replaced (a
    factory returning its argument replaces nothing). ValueError for a role not in `MODULE_ROLES`.

    The modules come from the model's `replaceable_modules()` hook (a model without it is left as
    it is). Roles go in `MODULE_ROLES` order, innermost first, each from a fresh walk, so the
    gated_mlp factory sees the replaced linears inside it. A module in several places (the shared
    rotary) is passed to the factory once and its replacement set in every place. A factory with
    a `prepare(modules)` method is first given all of the role's modules (each once, in the
    model's order), e.g. to time kernels on every layer of a weight shape before choosing one."""
    check_roles(overrides)
    hook = getattr(model, "replaceable_modules", None)
    replaced: dict[str, int] = {}
    for role in MODULE_ROLES:
        factory = overrides.get(role)
        if factory is None or hook is None:
            continue
        places = [(parent, attr, module) for r, parent, attr, module in hook() if r == role]
        modules = list({id(module): module for _, _, module in places}.values())
        prepare = getattr(factory, "prepare", None)
        if prepare is not None:
            prepare(modules)
        new = {id(module): factory(module) for module in modules}
        for parent, attr, module in places:
            if new[id(module)] is not module:
                setattr(parent, attr, new[id(module)])
        replaced[role] = sum(new[id(module)] is not module for module in modules)
    return replaced
