"""Build any named architecture without allocating its weights, and size it.

`abstract_backbone` constructs the real KerasHub backbone with every variable
created inside a `keras.StatelessScope` and never initialized
(`plan.build.build_abstract`): variables have their path, shape and dtype,
but no value, so a 27B model is "built" in about a second on a laptop. From
the shapes alone it reports the parameter count, the bytes per dtype and, for
a mesh and layout map (the family's, `plan.layouts.get_layout_map`, unless
given), the bytes each device would hold.

Example:

```python
import keras_hub_dist

report = keras_hub_dist.abstract_backbone("gemma2_27b_en", mesh=(1, 16))
report.parameter_count        # 27227128320
report.bytes_by_dtype         # {'bfloat16': 54454256640}
report.max_device_bytes       # bytes on the most loaded of the 16 devices
```
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras

from keras_hub_dist.plan import layouts
from keras_hub_dist.plan import presets
from keras_hub_dist.plan import specs
from keras_hub_dist.plan.build import VariableSpec, build_abstract, specs_of
from keras_hub_dist.plan.mesh import axis_sizes, device_ids, device_mesh
from keras_hub_dist.plan.sizes import itemsize

# Built here before `plan/build.py` held them; callers of the old names keep
# working.
from keras_hub_dist.plan.build import build_without_values, variable_specs  # noqa: F401

__all__ = [
    "AbstractBackbone",
    "abstract_backbone",
    "per_device_bytes",
]


@dataclasses.dataclass(frozen=True)
class AbstractBackbone:
    """A backbone built from shapes only, and what it costs.

    Attributes:
        model: The KerasHub backbone. Its variables have no value: use it for
            shapes, paths and layout planning, never to compute.
        name: The named architecture, if built from one.
        backbone_class_name: e.g. `"GemmaBackbone"`.
        config: The constructor arguments it was built with.
        variables: `VariableSpec` of every weight, in `model.weights` order.
        parameter_count: Total elements of all weights (`count_params()`).
        bytes_by_dtype: dtype name -> bytes of the weights of that dtype.
        total_bytes: Bytes of all weights.
        mesh_axis_sizes: Mesh the per-device figures are for (or `None`).
        per_device_bytes: Device (id, or mesh position for an abstract mesh)
            -> bytes of the weight shards it would hold (or `None`).
        max_device_bytes: The most loaded device's bytes (or `None`).
        layout_report: The layout map's `LayoutReport`, when one was built.
    """

    model: Any = dataclasses.field(repr=False)
    name: str | None
    backbone_class_name: str
    config: Mapping[str, Any] = dataclasses.field(repr=False)
    variables: tuple[VariableSpec, ...] = dataclasses.field(repr=False)
    parameter_count: int
    bytes_by_dtype: Mapping[str, int]
    total_bytes: int
    mesh_axis_sizes: Mapping[str, int] | None = None
    per_device_bytes: Mapping[int, int] | None = dataclasses.field(
        default=None, repr=False
    )
    max_device_bytes: int | None = None
    layout_report: Any = dataclasses.field(default=None, repr=False)

    def on_mesh(
        self,
        mesh: Any,
        layout_map: keras.distribution.LayoutMap | None = None,
        **layout_kwargs: Any,
    ) -> "AbstractBackbone":
        """The same report for another mesh / layout map (no rebuild)."""
        return _with_mesh(self, mesh, layout_map, layout_kwargs)


def per_device_bytes(
    variables: Sequence[VariableSpec],
    mesh: Any,
    layout_map: keras.distribution.LayoutMap,
) -> dict[int, int]:
    """Bytes each device would hold, from shapes and the layout map only.

    A variable the map does not cover is replicated (as Keras does). Each
    device holds one block per variable; layouts are validated first, so an
    axis that does not divide raises `LayoutError` naming the variable.

    Args:
        variables: `VariableSpec`s (e.g. `AbstractBackbone.variables`).
        mesh: A Keras / JAX mesh, an abstract one, or a `{axis: size}` dict.
        layout_map: Maps variable paths to layouts (regex keys, as Keras).

    Returns:
        Device id (mesh position for an abstract mesh) -> bytes.
    """
    sizes = axis_sizes(mesh)
    per_device = 0
    for spec in variables:
        layout = layout_map[spec.path]
        axes = tuple(layout.axes) if layout is not None else ()
        specs.validate_spec(spec.path, spec.shape, axes, sizes)
        block = specs.shard_shape(spec.shape, axes, sizes)
        per_device += math.prod(block) * itemsize(spec.dtype)
    # Even sharding: every device holds one equal block of every variable.
    return {key: per_device for key in device_ids(mesh)}


def _with_mesh(
    report: AbstractBackbone,
    mesh: Any,
    layout_map: keras.distribution.LayoutMap | None,
    layout_kwargs: Mapping[str, Any],
) -> AbstractBackbone:
    mesh = device_mesh(mesh, abstract=True)
    if layout_map is None:
        layout_map = layouts.get_layout_map(report.model, mesh, **layout_kwargs)
    per_device = per_device_bytes(report.variables, mesh, layout_map)
    return dataclasses.replace(
        report,
        mesh_axis_sizes=axis_sizes(mesh),
        per_device_bytes=per_device,
        max_device_bytes=max(per_device.values()),
        layout_report=getattr(layout_map, "report", None),
    )


def abstract_backbone(
    name_or_config: Any,
    /,
    *,
    mesh: Any = None,
    layout_map: keras.distribution.LayoutMap | None = None,
    backbone_class: type | None = None,
    **overrides: Any,
) -> AbstractBackbone:
    """Builds a backbone with no weights allocated and reports its size.

    Args:
        name_or_config: A named architecture or alias (`"gemma2_27b_en"`), a
            local preset directory, a KerasHub `config.json` object, or a
            plain config dict with `backbone_class`.
        mesh: Optional mesh for per-device figures: a Keras / JAX mesh, a
            `{axis: size}` dict or a shape such as `(1, 16)` (axes
            `("batch", "model")`); any size, no devices needed.
        layout_map: The layout map for `mesh` (default: `get_layout_map` of
            the model, checked per shape).
        backbone_class: The KerasHub backbone class for a plain config dict.
        **overrides: Constructor arguments replacing the config's, e.g.
            `num_layers=2`, `dtype="float32"`.

    Returns:
        An `AbstractBackbone` with the model, variable specs, parameter count,
        bytes per dtype and, given a mesh, per-device bytes.

    Example:

    >>> report = abstract_backbone("gemma_7b_en", mesh=(1, 8))
    >>> report.parameter_count
    8537680896
    """
    cls, config, entry = presets.backbone_config(
        name_or_config, backbone_class=backbone_class, **overrides
    )
    model = build_abstract(cls, config)
    variables = specs_of(model)
    bytes_by_dtype: dict[str, int] = {}
    for spec in variables:
        bytes_by_dtype[spec.dtype] = bytes_by_dtype.get(spec.dtype, 0) + spec.nbytes
    report = AbstractBackbone(
        model=model,
        name=entry.name if entry is not None else None,
        backbone_class_name=cls.__name__,
        config=config,
        variables=variables,
        parameter_count=sum(spec.size for spec in variables),
        bytes_by_dtype=bytes_by_dtype,
        total_bytes=sum(bytes_by_dtype.values()),
    )
    if mesh is not None:
        report = _with_mesh(report, mesh, layout_map, {})
    return report
