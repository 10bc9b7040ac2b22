"""Partition specs: validation and arithmetic, shared by init, plan and load.

Pure functions over shapes, partition specs and mesh axis sizes: nothing here
touches a device, so a plan can be checked before any byte moves.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import keras
from jax.sharding import PartitionSpec

from keras_hub_dist import _compat
from keras_hub_dist.errors import LayoutError
from keras_hub_dist.plan.mesh import axis_sizes

__all__ = [
    "MergedAxesLayout",
    "as_partition_spec",
    "entry_axes",
    "lookup_layout",
    "shard_shape",
    "tensor_layout",
    "validate_spec",
]

AxisEntry = str | tuple[str, ...] | None


def as_partition_spec(axes: Sequence[AxisEntry] | PartitionSpec) -> PartitionSpec:
    """Turns Keras `TensorLayout.axes` (or a spec) into a `PartitionSpec`."""
    if isinstance(axes, PartitionSpec):
        return axes
    return PartitionSpec(*axes)


def entry_axes(entry: AxisEntry) -> tuple[str, ...]:
    """The mesh axis names of one spec entry (`None`, a name or a tuple)."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


class MergedAxesLayout(keras.distribution.TensorLayout):
    """A `keras.distribution.TensorLayout` whose entries may name several
    mesh axes for one dimension, as a `PartitionSpec`'s do.

    Keras's `TensorLayout` takes one mesh axis name (or `None`) per
    dimension; its JAX backend turns the axes into a `PartitionSpec` as they
    are, which takes a tuple of names too. The package's maps use that for
    the vocabulary tables (`family_rules.vocabulary_rules`): split along the
    vocabulary over both axes of a `(batch, model)` mesh, as `(1, 8)` splits
    them over its model axis. Keras 3.15 checks a layout's axes in
    `TensorLayout._validate_axes`, which this overrides (its one reliance on
    Keras's internals; every load and build with the package's maps goes
    through it).

    Example:

    >>> mesh = keras.distribution.DeviceMesh((2, 4), ("batch", "model"))
    >>> layout = MergedAxesLayout((("batch", "model"), None), mesh)
    >>> layout.backend_layout.spec
    PartitionSpec(('batch', 'model'), None)
    """

    def _validate_axes(self) -> None:
        mesh = self.device_mesh
        if mesh is None:
            return
        names = [name for entry in self.axes for name in entry_axes(entry)]
        unknown = sorted(set(names) - set(mesh.axis_names))
        if unknown or len(set(names)) != len(names):
            raise ValueError(
                "Invalid axis names for Layout. Expected each of the mesh's "
                f"axis names {tuple(mesh.axis_names)} at most once (an entry "
                f"may be a tuple of them). Received: axes={self.axes}."
            )


def tensor_layout(axes: Sequence[AxisEntry], device_mesh: Any = None) -> keras.distribution.TensorLayout:
    """A Keras `TensorLayout` for `axes`: a `MergedAxesLayout` where an entry
    names several mesh axes, Keras's own otherwise."""
    axes = tuple(axes)
    if any(len(entry_axes(entry)) > 1 for entry in axes):
        return MergedAxesLayout(axes, device_mesh)
    axes = tuple(entry if entry is None or isinstance(entry, str) else entry_axes(entry)[0] for entry in axes)
    return keras.distribution.TensorLayout(axes, device_mesh)


def _divisors_up_to(n: int, limit: int) -> list[int]:
    return [d for d in range(1, limit + 1) if n % d == 0]


def validate_spec(
    path: str,
    shape: Sequence[int],
    spec: Sequence[AxisEntry] | PartitionSpec,
    mesh: Any,
) -> None:
    """Raises `LayoutError` unless `spec` shards `shape` evenly on `mesh`.

    Args:
        path: The variable path, named in the error.
        shape: The full (global) shape of the variable.
        spec: One entry per dimension: `None`, a mesh axis name or a tuple of
            names (a `PartitionSpec` or Keras `TensorLayout.axes`).
        mesh: A Keras/JAX mesh or a `{axis_name: size}` dict.

    Example:

    >>> validate_spec("emb", (1000, 64), ("model", None), {"model": 6})
    Traceback (most recent call last):
    ...
    keras_hub_dist.errors.LayoutError: Cannot shard 'emb' of shape (1000, 64) ...
    """
    sizes = axis_sizes(mesh)
    shape = tuple(int(d) for d in shape)
    spec = tuple(spec)
    where = f"'{path}' of shape {shape}"
    if len(spec) > len(shape):
        raise LayoutError(
            f"Cannot shard {where}: the layout has {len(spec)} entries for a "
            f"rank-{len(shape)} variable. Expected at most {len(shape)} "
            f"entries. Received: layout axes={spec}. Fix the layout map entry "
            "that matches this path."
        )
    seen: set[str] = set()
    for dim, entry in enumerate(spec):
        names = entry_axes(entry)
        for name in names:
            if name not in sizes:
                raise LayoutError(
                    f"Cannot shard {where}: dimension {dim} names mesh axis "
                    f"'{name}', which the mesh does not have. Expected one of "
                    f"{sorted(sizes)}. Received: layout axes={spec}, mesh axis "
                    f"sizes={sizes}. Rename the axis in the layout map or build "
                    "the mesh with that axis name."
                )
            if name in seen:
                raise LayoutError(
                    f"Cannot shard {where}: mesh axis '{name}' is used twice. "
                    f"Expected each mesh axis at most once. Received: layout "
                    f"axes={spec}."
                )
            seen.add(name)
        parts = math.prod(sizes[name] for name in names)
        if parts > 1 and shape[dim] % parts:
            works = _divisors_up_to(shape[dim], max(parts * 2, 16))
            raise LayoutError(
                f"Cannot shard {where}: dimension {dim} ({shape[dim]}) is split "
                f"over mesh axes {names} of total size {parts}, which does not "
                f"divide it. Expected a multiple of {parts}. Received: layout "
                f"axes={spec}, mesh axis sizes={sizes}. Fix: use a mesh whose "
                f"axes {names} multiply to a divisor of {shape[dim]} (e.g. "
                f"{works}), or shard another dimension / replicate this "
                "variable in the layout map."
            )


def shard_shape(
    shape: Sequence[int],
    spec: Sequence[AxisEntry] | PartitionSpec,
    mesh: Any,
) -> tuple[int, ...]:
    """The per-device block shape of an evenly sharded variable."""
    sizes = axis_sizes(mesh)
    spec = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    return tuple(
        int(d) // math.prod(sizes[name] for name in entry_axes(entry))
        for d, entry in zip(shape, spec)
    )


def lookup_layout(
    path: str, distribution: Any | None = None
) -> tuple[Any | None, tuple[str, ...]]:
    """Finds the layout the active distribution's LayoutMap gives `path`.

    Uses the LayoutMap's own matching rules (exact key, then regex), so the
    answer is the one Keras gives the variable with that path.

    Returns:
        `(layout_or_None, searched_keys)`: the matching `TensorLayout` and the
        LayoutMap keys that were searched (for error messages).
    """
    if distribution is None:
        distribution = keras.distribution.distribution()
    layout_map = _compat.distribution_layout_map(distribution)
    if layout_map is None:
        return None, ()
    keys = tuple(layout_map.keys())
    return layout_map[path], keys
