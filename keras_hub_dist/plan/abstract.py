"""Build any named architecture without allocating its weights, and size it.

`abstract_backbone` constructs the real KerasHub backbone with every variable
created inside a `keras.StatelessScope` and never initialized: variables have
their path, shape and dtype, but no value, so a 27B model is "built" in about
a second on a laptop. From the shapes alone it reports the parameter count,
the bytes per dtype and, for a mesh and layout map, the bytes each device
would hold.

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
import functools
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_hub_dist import _compat
from keras_hub_dist.plan import presets
from keras_hub_dist.plan import specs
from keras_hub_dist.plan.mesh import axis_sizes, device_ids, device_mesh
from keras_hub_dist.plan.sizes import itemsize

__all__ = [
    "AbstractBackbone",
    "VariableSpec",
    "abstract_backbone",
    "build_without_values",
    "per_device_bytes",
    "variable_specs",
]


@dataclasses.dataclass(frozen=True)
class VariableSpec:
    """A variable's path, full shape and dtype: all a plan needs."""

    path: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole variable."""
        return self.size * itemsize(self.dtype)


class _NoValue:
    """Initializer of an abstract variable: shapes under tracing, else an error.

    Keras reads an uninitialized variable's value by calling its initializer.
    Under a JAX trace (`jax.eval_shape`, Keras's symbolic calls) that costs no
    memory, so shape inference still works; an eager read would allocate the
    full tensor, one copy per read, so it raises instead.
    """

    def __init__(self, path: str):
        self.path = path

    def __call__(self, shape, dtype=None):
        dtype = keras.backend.standardize_dtype(dtype)
        if isinstance(jnp.zeros((), dtype), jax.core.Tracer):
            return jnp.zeros(shape, dtype)
        raise RuntimeError(
            f"Variable '{self.path}' (shape {tuple(shape)}, dtype {dtype}) "
            "belongs to an abstract backbone: it has a shape but no value. "
            "Expected symbolic use only (shapes, layout planning, "
            "jax.eval_shape). Received: an eager read of its value. Build a "
            "real backbone with a keras_hub_dist factory (e.g. "
            "keras_hub_dist.gemma_backbone) or load weights into it."
        )


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
    # Imported here: `layouts` sizes named architectures through this module.
    from keras_hub_dist.plan import layouts

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


def build_without_values(cls: type, config: Mapping[str, Any]) -> tuple[keras.Model, list[Any]]:
    """Constructs `cls.from_config(config)` with no variable given a value.

    The one way the package builds a model before its weights exist: the
    variables have paths, shapes, dtypes and their (pending) initializers,
    and no memory. Callers then fill them from a checkpoint, draw them in
    their shards, or leave them abstract.

    Returns:
        `(model, variables created)`, the variables still pending.
    """
    with _compat.creating_variables_without_values() as created:
        model = cls.from_config(dict(config))
    return model, created


def _build_abstract(cls: type, config: dict[str, Any]) -> keras.Model:
    model, created = build_without_values(cls, config)
    for variable in created:
        _compat.set_pending_initializer(variable, _NoValue(variable.path))
    return model


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
    model = _build_abstract(cls, config)
    variables = tuple(
        VariableSpec(v.path, tuple(int(d) for d in v.shape), str(v.dtype))
        for v in model.weights
    )
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


@functools.lru_cache(maxsize=64)
def _cached_specs(key: str) -> tuple[VariableSpec, ...]:
    name_or_config = json.loads(key)
    return abstract_backbone(name_or_config).variables


def variable_specs(name_or_config: Any) -> tuple[VariableSpec, ...]:
    """The `VariableSpec`s of a named architecture or config (cached).

    Layout planning only needs paths and shapes; the abstract model is built
    once per architecture and dropped.
    """
    if isinstance(name_or_config, str) and not os.path.isdir(name_or_config):
        name_or_config = presets.resolve(name_or_config).name
    return _cached_specs(json.dumps(name_or_config, sort_keys=True))
