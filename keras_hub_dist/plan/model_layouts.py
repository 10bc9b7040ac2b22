"""The layouts of one model's variables on one mesh, checked before a load.

Chooses the layout map (the user's, the family's hand-written map, or an
automatic plan for a family without one), then resolves and validates every
variable's layout against the mesh, reporting all problems at once with a
mesh that would work.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import keras

from keras_hub_dist.errors import LayoutError
from keras_hub_dist.plan import auto_layout, layouts, specs
from keras_hub_dist.plan.families import keras_hub_family

__all__ = ["default_layout_map", "user_layout_map", "variable_layouts"]


def _has_layout_source(backbone_cls: type) -> bool:
    """Whether a default layout map exists for this backbone class."""
    if callable(getattr(backbone_cls, "get_layout_map", None)):
        return True  # KerasHub's own map.
    return keras_hub_family(backbone_cls) in layouts.supported_families()


def default_layout_map(
    backbone: keras.Model,
    device_mesh: keras.distribution.DeviceMesh,
    model_axis: str,
    data_axis: str,
) -> keras.distribution.LayoutMap:
    axis_names = tuple(device_mesh.axis_names)
    missing = [a for a in (model_axis, data_axis) if a not in axis_names]
    if missing:
        raise LayoutError(
            f"The mesh axis names {axis_names} are not the ones the "
            f"{type(backbone).__name__} layout map uses. Expected axes named "
            f"{model_axis!r} (weights are sharded on it) and {data_axis!r} "
            f"(the batch). Received: mesh axis sizes "
            f"{dict(zip(axis_names, device_mesh.shape))}. Name the mesh axes "
            f"({data_axis!r}, {model_axis!r}), or pass model_axis=... and "
            "data_axis=... naming your axes."
        )
    if _has_layout_source(type(backbone)):
        return layouts.get_layout_map(
            backbone,
            device_mesh,
            model_parallel_dim_name=model_axis,
            data_parallel_dim_name=data_axis,
        )
    # No hand-written map for this family: derive one from the model's
    # structure (the backbone is built without values, so this is cheap).
    return auto_layout.plan_layout(
        backbone, device_mesh, model_axis=model_axis, data_axis=data_axis
    ).layout_map


def user_layout_map(layout_map: Any, device_mesh: keras.distribution.DeviceMesh) -> keras.distribution.LayoutMap:
    """The user's `layout_map` argument as a `LayoutMap` on `device_mesh`.

    Raises:
        LayoutError: Built for another mesh, naming an axis the mesh does not
            have, a key that is not a regular expression, or not a layout map.
    """
    resolved = _user_layout_map(layout_map, device_mesh)
    for key in resolved if isinstance(resolved, Mapping) else ():
        try:
            re.compile(key)
        except re.error as e:
            raise LayoutError(
                f"Layout map key {key!r} is not a valid regular expression "
                f"({e}). Expected each layout-map key to be a regular "
                "expression, searched for in variable paths as "
                "keras.distribution.LayoutMap does. Received: "
                f"{key!r}. To match the text literally, escape it "
                f"(re.escape): {re.escape(key)!r}."
            ) from None
    return resolved


def _user_layout_map(layout_map: Any, device_mesh: keras.distribution.DeviceMesh) -> keras.distribution.LayoutMap:
    if isinstance(layout_map, keras.distribution.LayoutMap):
        mine = layout_map.device_mesh
        if tuple(mine.shape) != tuple(device_mesh.shape) or tuple(mine.axis_names) != tuple(
            device_mesh.axis_names
        ):
            raise LayoutError(
                "The layout_map was built for another mesh. Expected its "
                f"device_mesh to be {dict(zip(device_mesh.axis_names, device_mesh.shape))}. "
                f"Received: {dict(zip(mine.axis_names, mine.shape))}. Pass "
                "mesh=None to use the layout map's own mesh."
            )
        return layout_map
    if callable(layout_map):
        return layout_map(device_mesh)
    if isinstance(layout_map, Mapping):
        result = keras.distribution.LayoutMap(device_mesh)
        sizes = dict(zip(device_mesh.axis_names, device_mesh.shape))
        for key, axes in layout_map.items():
            entries = getattr(axes, "axes", axes)
            names = [
                n for e in entries if e is not None
                for n in ((e,) if isinstance(e, str) else tuple(e))
            ]
            unknown = [n for n in names if n not in sizes]
            if unknown:
                raise LayoutError(
                    f"Layout map entry {key!r} names mesh axis {unknown[0]!r}, "
                    f"which the mesh does not have. Expected axes among "
                    f"{sorted(sizes)}. Received: axes={tuple(entries)}, mesh "
                    f"axis sizes={sizes}. Rename the axis in the layout map or "
                    "build the mesh with that axis name."
                )
            result[key] = axes
        return result
    raise LayoutError(
        "Expected layout_map to be None, a keras.distribution.LayoutMap, a "
        "dict {path regex: axes} or a callable(device_mesh) -> LayoutMap. "
        f"Received: {type(layout_map).__name__}."
    )


def _suggest_mesh(
    shaped_specs: Sequence[tuple[tuple[int, ...], tuple[Any, ...]]],
    device_mesh: keras.distribution.DeviceMesh,
) -> str:
    names = tuple(device_mesh.axis_names)
    total = math.prod(device_mesh.shape)
    if len(names) != 2:
        return ""
    current = tuple(device_mesh.shape)
    for second in sorted((d for d in range(1, total + 1) if total % d == 0), reverse=True):
        sizes = dict(zip(names, (total // second, second)))
        if (total // second, second) == current:
            continue
        try:
            for shape, axes in shaped_specs:
                specs.validate_spec("", shape, axes, sizes)
        except LayoutError:
            continue
        return (
            f" A mesh that works: mesh=({total // second}, {second}), i.e. "
            f"{sizes}."
        )
    return " No 2-axis mesh of these devices divides every sharded dimension."


def variable_layouts(
    entries: Sequence[Any],
    distribution: keras.distribution.ModelParallel,
    device_mesh: keras.distribution.DeviceMesh,
    data_axis: str,
) -> dict[str, Any]:
    """Variable path -> TensorLayout; validated, or one LayoutError for all.

    `entries` have `path`, `shape` and `variable` (a checkpoint index's).
    """
    sizes = dict(zip(device_mesh.axis_names, device_mesh.shape))
    layouts: dict[str, Any] = {}
    errors: list[str] = []
    shaped_specs = []
    used_axes: set[str] = set()
    for entry in entries:
        try:
            layout = distribution.get_variable_layout(entry.variable)
        except ValueError as e:  # e.g. two regexes of the map match
            raise LayoutError(f"No single layout for {entry.path!r}: {e}") from e
        axes = tuple(layout.axes)
        try:
            specs.validate_spec(entry.path, entry.shape, axes, sizes)
        except LayoutError as e:
            errors.append(str(e))
        for a in axes:
            used_axes.update((a,) if isinstance(a, str) else tuple(a or ()))
        shaped_specs.append((entry.shape, axes))
        layouts[entry.path] = layout
    if errors:
        shown = errors[:8]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        raise LayoutError(
            f"The layout map cannot shard {len(errors)} variable(s) on mesh "
            f"{sizes}:\n  " + "\n  ".join(shown) + more
            + "\n" + _suggest_mesh(shaped_specs, device_mesh).strip()
        )
    unused = [
        a for a, s in sizes.items() if s > 1 and a not in used_axes and a != data_axis
    ]
    if unused:
        raise LayoutError(
            f"The mesh axes {unused} are used by no layout of the layout map, "
            f"so every weight would be replicated along them. Expected the "
            f"layout map to shard over every mesh axis of size > 1 other than "
            f"the batch axis {data_axis!r}. Received: mesh axis sizes {sizes}, "
            f"axes the map uses: {sorted(used_axes)}. Rename the mesh axes, "
            "fix the layout map, or pass data_axis=... naming the batch axis."
        )
    return layouts
