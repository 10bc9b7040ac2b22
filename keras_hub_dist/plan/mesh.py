"""Meshes: the one parser of everything a user may pass as a mesh.

Every public function that takes a mesh (`load_sharded_preset`,
`get_layout_map`, `plan_layout`, `abstract_backbone`) accepts the same
things, parsed here:

- a `keras.distribution.DeviceMesh` or a `jax.sharding.Mesh`;
- a `(data, model)` shape such as `(1, 8)`;
- a `{axis_name: size}` dict such as `{"batch": 2, "model": 4}`;
- `None`: every device on the model axis, `(1, n)`.

A shape or dict takes the first devices of `jax.devices()` (a mesh smaller
than the machine is allowed), or, with `abstract=True`, stands for a mesh of
that size without devices (planning a 256-chip pod on a laptop).

Example:

```python
device_mesh({"batch": 2, "model": 4}).shape        # (2, 4), real devices
device_mesh((1, 256), abstract=True).devices[:3]   # [0, 1, 2]: positions only
```
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import keras
import numpy as np

from keras_hub_dist.errors import LayoutError

__all__ = [
    "abstract_device_mesh",
    "axis_sizes",
    "device_ids",
    "device_mesh",
    "jax_mesh",
    "keras_device_mesh",
]


def jax_mesh(mesh: Any) -> jax.sharding.Mesh:
    """Returns the `jax.sharding.Mesh` behind a Keras `DeviceMesh` or itself."""
    if isinstance(mesh, keras.distribution.DeviceMesh):
        return mesh.backend_mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh
    raise TypeError(
        "Expected a keras.distribution.DeviceMesh or a jax.sharding.Mesh. "
        f"Received: mesh={mesh!r} of type {type(mesh).__name__}."
    )


def keras_device_mesh(mesh: Any) -> keras.distribution.DeviceMesh | None:
    """The Keras `DeviceMesh` for a Keras or JAX mesh; `None` for other inputs."""
    if isinstance(mesh, keras.distribution.DeviceMesh):
        return mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return keras.distribution.DeviceMesh(
            shape=tuple(mesh.devices.shape),
            axis_names=tuple(mesh.axis_names),
            devices=list(mesh.devices.flat),
        )
    return None


def axis_sizes(mesh: Any) -> dict[str, int]:
    """Mesh axis name -> size, for a Keras, JAX or abstract mesh or a dict."""
    if isinstance(mesh, Mapping):
        return {str(k): int(v) for k, v in mesh.items()}
    if isinstance(mesh, keras.distribution.DeviceMesh):
        return dict(zip(mesh.axis_names, mesh.shape))
    return dict(zip(mesh.axis_names, mesh.axis_sizes))


def device_ids(mesh: Any) -> list[int]:
    """Device ids of a mesh in mesh order (positions for an abstract mesh)."""
    if isinstance(mesh, (keras.distribution.DeviceMesh, jax.sharding.Mesh)):
        devices = np.asarray(mesh.devices).reshape(-1)
        return [
            int(device.id) if hasattr(device, "id") else position
            for position, device in enumerate(devices)
        ]
    return list(range(math.prod(axis_sizes(mesh).values())))


def abstract_device_mesh(
    shape: Sequence[int] | Mapping[str, int],
    axis_names: Sequence[str] = ("batch", "model"),
) -> keras.distribution.DeviceMesh:
    """A `DeviceMesh` of any size, for planning only: its devices are indices.

    Layout maps, validation and per-device byte counts only need axis names and
    sizes, so a 16-device plan can be checked on a laptop. The mesh cannot run
    anything (its `backend_mesh` has no real devices).

    Args:
        shape: Axis sizes, e.g. `(1, 16)`, or a `{axis_name: size}` dict.
        axis_names: Axis names when `shape` is a sequence.

    Example:

    >>> mesh = abstract_device_mesh({"batch": 1, "model": 16})
    >>> mesh.shape
    (1, 16)
    """
    if isinstance(shape, Mapping):
        axis_names = tuple(shape)
        shape = tuple(shape.values())
    shape = tuple(shape)
    if len(shape) != len(tuple(axis_names)) or not all(
        isinstance(size, (int, np.integer)) and size >= 1 for size in shape
    ):
        raise LayoutError(
            "Expected one positive size per mesh axis name. Received: "
            f"shape={shape}, axis_names={tuple(axis_names)}."
        )
    shape = tuple(int(size) for size in shape)
    return keras.distribution.DeviceMesh(
        shape=shape,
        axis_names=list(axis_names),
        devices=np.arange(math.prod(shape)),
    )


def device_mesh(
    mesh: Any,
    *,
    data_axis: str = "batch",
    model_axis: str = "model",
    abstract: bool = False,
) -> keras.distribution.DeviceMesh:
    """Parses anything a user may pass as a mesh into a Keras `DeviceMesh`.

    Args:
        mesh: A `keras.distribution.DeviceMesh`, a `jax.sharding.Mesh`, a
            `(data, model)` shape such as `(1, 8)`, a `{axis_name: size}`
            dict, or `None` for `(1, n)` over all devices.
        data_axis: Name of the first axis of a shape (the batch).
        model_axis: Name of the second axis of a shape (weights are sharded
            on it).
        abstract: For a shape or dict, return a planning-only mesh whose
            devices are positions (any size; nothing can run on it) instead
            of the first devices of `jax.devices()`.

    Returns:
        The `DeviceMesh`.

    Raises:
        TypeError: `mesh` is of none of these types.
        LayoutError: A shape that is not two positive integers, or more
            devices than this process sees.
    """
    converted = keras_device_mesh(mesh)
    if converted is not None:
        return converted
    devices = jax.devices()
    if mesh is None:
        names: tuple[str, ...] = (data_axis, model_axis)
        shape: tuple[Any, ...] = (1, len(devices))
    elif isinstance(mesh, Mapping):
        names, shape = tuple(str(k) for k in mesh), tuple(mesh.values())
    elif isinstance(mesh, Sequence) and not isinstance(mesh, str):
        shape = tuple(mesh)
        if len(shape) != 2:
            raise LayoutError(
                "A mesh given as a shape must have two entries, (batch, "
                f"model). Expected e.g. (1, {len(devices)}). Received: "
                f"mesh={mesh!r}. Pass a dict such as {{'{model_axis}': "
                f"{len(devices)}}} for other axis names."
            )
        names = (data_axis, model_axis)
    else:
        raise TypeError(
            "Expected mesh to be None, a keras.distribution.DeviceMesh, a "
            "jax.sharding.Mesh, a shape such as (1, 8) or a dict such as "
            f"{{'batch': 1, 'model': 8}}. Received: {mesh!r} of type "
            f"{type(mesh).__name__}."
        )
    if not all(isinstance(s, (int, np.integer)) and s >= 1 for s in shape):
        raise LayoutError(
            f"Expected positive integer mesh axis sizes. Received: mesh={mesh!r}."
        )
    if abstract:
        return abstract_device_mesh(tuple(int(s) for s in shape), names)
    size = math.prod(int(s) for s in shape)
    if size > len(devices):
        raise LayoutError(
            f"The mesh {dict(zip(names, shape))} needs {size} devices. Expected "
            f"at most {len(devices)} (jax.devices()). Received: mesh={mesh!r}."
        )
    return keras.distribution.DeviceMesh(
        tuple(int(s) for s in shape), names, devices[:size]
    )
