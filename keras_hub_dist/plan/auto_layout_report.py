"""Text reports of a `LayoutPlan`: the summary table and the fallback warning.

`auto_layout.LayoutPlan` calls these. They read the plan through
`PlanFigures`, the attributes they need, so this module imports nothing of
`auto_layout`: `auto_layout` is built on it, not the reverse.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from keras_hub_dist.errors import LayoutFallbackWarning
from keras_hub_dist.plan.auto_layout_decisions import AxisEntry, VariableDecision
from keras_hub_dist.plan.sizes import format_bytes

__all__ = ["PlanFigures", "render_summary", "warn_fallbacks"]


class PlanFigures(Protocol):
    """What the reports read of a plan (`auto_layout.LayoutPlan` has it)."""

    decisions: tuple[VariableDecision, ...]
    axis_sizes: Mapping[str, int]
    model_axis: str
    data_axis: str | None
    traced: bool
    notes: tuple[str, ...]
    model_name: str

    @property
    def fallbacks(self) -> tuple[VariableDecision, ...]: ...

    @property
    def num_devices(self) -> int: ...

    @property
    def total_bytes(self) -> int: ...

    @property
    def per_device_bytes(self) -> int: ...

    @property
    def balance(self) -> float: ...


def _fmt_axes(axes: Sequence[AxisEntry]) -> str:
    """`("model", None)` as `(model, -)`."""
    return "(" + ", ".join("-" if a is None else str(a) for a in axes) + ")"


def _generic_path(path: str) -> str:
    """The path with its first number (usually the block index) as `#`."""
    return re.sub(r"\d+", "#", path, count=1)


_LEGEND = (
    "  column: output dims sharded; row: contracted dims sharded (pairs with "
    "the column weights feeding it); embedding: indexed dim sharded; "
    "bias/vector: replicated; other: used only element-wise (e.g. learned "
    "positions) or not at all (e.g. an output embedding only a task head "
    "uses) by the traced forward pass, largest divisible dim sharded; "
    "quant: a quantized kernel's scale / zero point / g_idx, laid out "
    "after its values."
)


def render_summary(plan: PlanFigures, group: bool) -> str:
    """The table behind `LayoutPlan.summary()`.

    Args:
        plan: The plan to describe.
        group: Collapse variables whose paths differ only in their first
            number and whose decisions are identical into one `x<count>` row.

    Returns:
        A header (mesh, totals, roles, notes), one row per variable or group,
        the role legend, and the distinct fallback reasons.
    """
    n = plan.num_devices
    rows: list[tuple[str, VariableDecision, int]] = []
    if group:
        index: dict[tuple[Any, ...], int] = {}
        for d in plan.decisions:
            key = (_generic_path(d.path), d.shape, d.dtype, d.axes, d.role,
                   d.fallback)
            if key in index:
                path, first, count = rows[index[key]]
                rows[index[key]] = (path, first, count + 1)
            else:
                index[key] = len(rows)
                rows.append((d.path, d, 1))
        rows = [
            (_generic_path(p) if c > 1 else p, d, c) for p, d, c in rows
        ]
    else:
        rows = [(d.path, d, 1) for d in plan.decisions]

    roles: dict[str, int] = {}
    for d in plan.decisions:
        roles[d.role] = roles.get(d.role, 0) + 1
    params = sum(math.prod(d.shape) for d in plan.decisions)
    lines = [
        f"LayoutPlan for {plan.model_name} on mesh {plan.axis_sizes} "
        f"(model axis {plan.model_axis!r}, data axis {plan.data_axis!r})",
        f"  {len(plan.decisions)} variables, {params:,} parameters, "
        f"{format_bytes(plan.total_bytes)}; per device "
        f"{format_bytes(plan.per_device_bytes)} = {plan.balance:.3f} x total/{n}",
        "  roles: " + ", ".join(f"{k} {v}" for k, v in sorted(roles.items()))
        + ("" if plan.traced else " (untraced: largest-dimension heuristic)"),
    ]
    lines.extend(f"  note: {note}" for note in plan.notes)
    width = max([len(p) + (5 if c > 1 else 0) for p, _, c in rows] + [8])
    lines.append(
        f"  {'variable'.ljust(width)}  {'shape':<20} {'role':<9} "
        f"{'layout':<24} per device"
    )
    for path, d, count in rows:
        label = f"{path} x{count}" if count > 1 else path
        lines.append(
            f"  {label.ljust(width)}  {str(d.shape):<20} {d.role:<9} "
            f"{_fmt_axes(d.axes):<24} {format_bytes(d.device_bytes)}"
            + (" *" if d.fallback else "")
        )
    lines.append(_LEGEND)
    fallbacks = plan.fallbacks
    if fallbacks:
        lines.append(f"  fallbacks ({len(fallbacks)}, marked *):")
        seen: set[tuple[str, str]] = set()
        for d in fallbacks:
            key = (_generic_path(d.path) if group else d.path, d.fallback)
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"    {key[0]} {d.shape}: {d.fallback}")
    return "\n".join(lines)


def warn_fallbacks(plan: PlanFigures) -> None:
    """Warns (`LayoutFallbackWarning`) about fallbacks and an untraced plan.

    Names the first five variables that could not use their preferred
    sharding; `stacklevel` points at the caller of `plan_layout`.

    Args:
        plan: The finished plan.
    """
    fallbacks = plan.fallbacks
    if not fallbacks and plan.traced:
        return
    lines = [f"  {d.path} {d.shape}: {d.fallback}" for d in fallbacks[:5]]
    if len(fallbacks) > 5:
        lines.append(f"  ... and {len(fallbacks) - 5} more (see plan.summary())")
    head = []
    if not plan.traced:
        head.extend(plan.notes)
    if fallbacks:
        head.append(
            f"plan_layout: {len(fallbacks)} of {len(plan.decisions)} variables "
            f"of {plan.model_name} could not use their preferred sharding on "
            f"mesh {plan.axis_sizes}:"
        )
    warnings.warn(
        "\n".join(head + lines), LayoutFallbackWarning, stacklevel=3
    )
