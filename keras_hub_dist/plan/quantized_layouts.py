"""Layouts of quantized variables, derived from their float kernel's layout.

A layout map names float kernels (`.*query.*kernel`); quantizing keeps the
kernel's path for its int8 / int4 values and adds scales, zero points and
`g_idx`. Here each quantized variable gets the layout its float tensor's
layout implies:

- **int8**: the values keep the kernel's layout (same shape); the scale
  follows the kernel's output (kept) axes, each with the kernel's entry,
  size-1 axes unsharded.
- **int4**: values, scale and zero live on the matrix `M` Keras quantizes
  (`plan.quantization.Int4Rule`). For `Dense` and the embedding tables `M`
  is the kernel, whose entries carry over. An `EinsumDense` kernel is
  reshaped in C order: where that reshape merges whole dimensions (`(hidden,
  heads, head_dim) -> (hidden, heads * head_dim)`) a merged axis takes the
  entry of its leading dimension, and where only the kernel's first
  dimension is sharded, its contiguous slices are row slices of `M` (Gemma's
  `(heads, hidden, head_dim) -> (hidden, heads * head_dim)`): either way each
  device holds exactly the elements it held in float. Otherwise (two sharded
  axes that do not stay contiguous) the mesh axes go to `M`'s rows, then its
  columns, where they divide: the same bytes per device, other elements.
  The packed axis (two values per byte) must stay divisible by its mesh
  axes; where it is not (a router of 8 experts packs into 4 bytes) they
  move to the matrix's other axis if that is unsharded and divisible (a
  `LayoutFallbackWarning`), else `LayoutError` names the variable, the
  packed length and the axis sizes that would divide it. Scale and zero follow
  `M`'s kept axis; along the grouped axis they follow `M`'s entry where each
  device's rows are whole groups (else that axis is replicated: they are
  1/128 of the values). `g_idx` follows the grouped axis.

`QuantizationAwareModelParallel` is the `ModelParallel` a load leaves set:
a later `model.quantize("int4")` creates 2-D packed kernels under the paths
of 3-D float ones, which a path-keyed `LayoutMap` cannot tell apart
(`device_put ... incompatible with its sharding annotation`); this
distribution answers for those variables by their shape and dtype.

Example:

```python
axes = quantized_axes(tensor, ("model", None), {"batch": 1, "model": 8})
axes[tensor.scale.path]     # ('model',) for a Dense int8 kernel (None, 'model')
```
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import keras

from keras_hub_dist.errors import LayoutError, LayoutFallbackWarning
from keras_hub_dist.plan import quantization, specs
from keras_hub_dist.plan.quantization import Int8Rule, QuantizedTensor

__all__ = [
    "QuantizationAwareModelParallel",
    "add_quantized_entries",
    "axes_from_values",
    "matrix_axes",
    "quantized_axes",
]

Axes = tuple[Any, ...]


def _parts(entry: Any, sizes: Mapping[str, int]) -> int:
    return math.prod(sizes[name] for name in specs.entry_axes(entry))


def _sharded(entry: Any, sizes: Mapping[str, int]) -> bool:
    return _parts(entry, sizes) > 1


def _merged_entry(shape: Sequence[int], axes: Sequence[Any], sizes: Mapping[str, int]) -> tuple[bool, Any]:
    """`(exact, entry)` of dimensions merged in C order: exact when at most
    one is sharded and every dimension before it has size 1."""
    sharded = [i for i, e in enumerate(axes) if _sharded(e, sizes)]
    if not sharded:
        return True, None
    if len(sharded) == 1 and all(shape[i] == 1 for i in range(sharded[0])):
        return True, axes[sharded[0]]
    return False, None


def matrix_axes(
    float_shape: Sequence[int], float_axes: Sequence[Any], matrix: Sequence[int], sizes: Mapping[str, int]
) -> tuple[Axes, bool]:
    """`(entries of M, exact)`: the layout of the float tensor carried to
    its C-order reshape `M = (rows, cols)` (see the module doc)."""
    shape = tuple(int(d) for d in float_shape)
    axes = tuple(float_axes) + (None,) * (len(shape) - len(tuple(float_axes)))
    if tuple(matrix) == shape:
        return axes, True
    rows = matrix[0]
    for k in range(len(shape) + 1):
        if math.prod(shape[:k]) == rows:
            exact_r, r = _merged_entry(shape[:k], axes[:k], sizes)
            exact_c, c = _merged_entry(shape[k:], axes[k:], sizes)
            if exact_r and exact_c:
                return (r, c), True
    sharded = [i for i, e in enumerate(axes) if _sharded(e, sizes)]
    if not sharded:
        return (None, None), True
    first = next(i for i, d in enumerate(shape) if d > 1)
    if sharded == [first] and rows % _parts(axes[first], sizes) == 0:
        return (axes[first], None), True
    # Not carried exactly: the same bytes per device, other elements.
    out: list[Any] = [None, None]
    for i in sorted(sharded, key=lambda i: -_parts(axes[i], sizes)):
        need = _parts(axes[i], sizes)
        for dim, length in ((0, rows), (1, (matrix[1] + 1) // 2)):
            if out[dim] is None and length % need == 0:
                out[dim] = axes[i]
                break
    return tuple(out), False


def _packed_error(path: str, axis: int, length: int, values: int, entry: Any, sizes: Mapping[str, int]) -> LayoutError:
    names = specs.entry_axes(entry)
    parts = _parts(entry, sizes)
    works = [d for d in range(1, max(2 * parts, 16) + 1) if length % d == 0]
    return LayoutError(
        f"Cannot shard the int4 values {path!r}: they are packed two per byte "
        f"along axis {axis}, which holds {length} bytes ({values} int4 values), "
        f"split over mesh axes {names} of total size {parts}, which does not "
        f"divide {length}. Expected a multiple of {parts}. Received: mesh axis "
        f"sizes {dict(sizes)}. Fix: a mesh whose axes {names} multiply to a "
        f"divisor of {length} (e.g. {works}), a layout that does not shard "
        "this axis of the float kernel, or quantize='int8'."
    )


def quantized_axes(
    tensor: QuantizedTensor,
    float_axes: Sequence[Any],
    sizes: Mapping[str, int],
    fallbacks: list[str] | None = None,
) -> dict[str, Axes]:
    """Variable path -> axes for the variables of one quantized tensor.

    Args:
        tensor: The quantized tensor (`plan.quantization`).
        float_axes: The layout axes of its float tensor (already checked
            against the float shape).
        sizes: Mesh axis sizes.
        fallbacks: Receives a line per int4 kernel whose packed axis could
            not keep its mesh axes, which moved to the other (unsharded,
            divisible) axis of the matrix, e.g. an 8-expert router's 4 bytes
            on 8 devices.

    Raises:
        LayoutError: The mesh axes on the int4 packed axis divide neither it
            nor the other axis (which must be unsharded to take them).
    """
    rule = tensor.rule
    float_axes = tuple(float_axes) + (None,) * (len(tensor.float_shape) - len(tuple(float_axes)))
    if isinstance(rule, Int8Rule):
        return axes_from_values(tensor, float_axes, sizes)
    m_axes, _ = matrix_axes(tensor.float_shape, float_axes, rule.matrix, sizes)
    packed = (rule.matrix[rule.pack_axis] + 1) // 2
    entry = m_axes[rule.pack_axis]
    if _sharded(entry, sizes) and packed % _parts(entry, sizes):
        other = 1 - rule.pack_axis
        if _sharded(m_axes[other], sizes) or rule.matrix[other] % _parts(entry, sizes):
            raise _packed_error(
                tensor.values.path, rule.pack_axis, packed, rule.matrix[rule.pack_axis], entry, sizes
            )
        # The other axis takes the mesh axes (e.g. a router's few experts).
        moved = [None, None]
        moved[other] = entry
        m_axes = tuple(moved)
        if fallbacks is not None:
            fallbacks.append(
                f"{tensor.values.path}: int4 packed axis {rule.pack_axis} ({packed} "
                f"bytes) not divisible by {specs.entry_axes(entry)}; sharded "
                f"along axis {other} ({rule.matrix[other]}) instead"
            )
    return axes_from_values(tensor, m_axes, sizes)


def axes_from_values(tensor: QuantizedTensor, values_axes: Sequence[Any], sizes: Mapping[str, int]) -> dict[str, Axes]:
    """Variable path -> axes for a quantized tensor's variables, given the
    layout of its values (for int4, of the matrix `M`, packed or not: the
    same entries): the scale and zero follow the kept axes, `g_idx` the
    grouped one (see the module doc)."""
    rule = tensor.rule
    rank = len(quantization.values_shape(tensor))
    values_axes = tuple(values_axes) + (None,) * (rank - len(tuple(values_axes)))
    out: dict[str, Axes] = {tensor.values.path: values_axes}
    if isinstance(rule, Int8Rule):
        out[tensor.scale.path] = tuple(None if a is None else values_axes[a] for a in rule.scale_axes)
        return out
    kept = 1 - rule.group_axis
    if not rule.block_size:
        scale_axes: Axes = (values_axes[kept],)
    else:
        rows = rule.matrix[rule.group_axis]
        group_entry = values_axes[rule.group_axis]
        parts = _parts(group_entry, sizes)
        whole_groups = rows % parts == 0 and (rows // parts) % rule.block_size == 0
        scale_list: list[Any] = [None, None]
        scale_list[kept] = values_axes[kept]
        scale_list[rule.group_axis] = group_entry if whole_groups else None
        scale_axes = tuple(scale_list)
    out[tensor.scale.path] = scale_axes
    if tensor.zero is not None:
        out[tensor.zero.path] = scale_axes
    if tensor.group_index is not None:
        out[tensor.group_index.path] = (values_axes[rule.group_axis],)
    return out


def add_quantized_entries(
    layout_map: keras.distribution.LayoutMap,
    tensors: Iterable[QuantizedTensor],
    float_axes: Mapping[str, Axes],
) -> keras.distribution.LayoutMap:
    """Adds an exact-path entry per quantized variable to `layout_map` (in
    place; exact keys win over the map's regexes, as Keras looks them up).

    Args:
        layout_map: The map (its float kernel entries are no longer used for
            the quantized values, which keep the kernels' paths).
        tensors: The model's quantized tensors.
        float_axes: Float path -> the axes of the float tensor.
    """
    sizes = dict(zip(layout_map.device_mesh.axis_names, layout_map.device_mesh.shape))
    keys = set(layout_map.keys())  # `in` would match regexes (None: found)
    fallbacks: list[str] = []
    for tensor in tensors:
        for path, axes in quantized_axes(tensor, float_axes[tensor.float_path], sizes, fallbacks).items():
            if path in keys:
                del layout_map[path]
            layout_map[path] = specs.tensor_layout(axes)
            keys.add(path)
    if fallbacks:
        warnings.warn(
            f"{len(fallbacks)} int4 kernel(s) could not keep their float "
            f"kernel's layout on mesh {sizes}:\n  " + "\n  ".join(fallbacks[:12]),
            LayoutFallbackWarning,
            stacklevel=3,
        )
    return layout_map


class QuantizationAwareModelParallel(keras.distribution.ModelParallel):
    """A `ModelParallel` whose layouts also fit what `model.quantize` creates.

    `cover(model)` records, for every layer of `model` that
    `model.quantize("int8" | "int4")` would quantize, the layout each of its
    quantized variables would need (keyed by path, shape and dtype, since
    an int4 kernel keeps its float kernel's path); other variables get the
    layout map's layout, as with `ModelParallel`.

    Example:

    >>> distribution = QuantizationAwareModelParallel(layout_map=layout_map)
    >>> distribution.cover(backbone)
    >>> keras.distribution.set_distribution(distribution)
    >>> backbone.quantize("int4")   # packed kernels placed in their layout
    """

    def __init__(self, *, layout_map: keras.distribution.LayoutMap, **kwargs: Any) -> None:
        super().__init__(layout_map=layout_map, **kwargs)
        self._quantized: dict[tuple[str, tuple[int, ...], str], Axes] = {}

    def cover(self, model: keras.Model) -> None:
        """Records the quantized layouts of `model`'s float layers."""
        sizes = dict(zip(self.device_mesh.axis_names, self.device_mesh.shape))
        layout_map = self._layout_map
        for mode in quantization.SUPPORTED_MODES:
            for tensor, shapes in quantization.prospective_tensors(model, mode):
                layout = layout_map[tensor.float_path]
                float_axes = tuple(layout.axes) if layout is not None else ()
                try:
                    axes = quantized_axes(tensor, float_axes, sizes)
                except LayoutError:
                    continue  # Keras then raises the device_put error itself.
                for path, (shape, dtype) in shapes.items():
                    self._quantized[(path, shape, dtype)] = axes[path]

    def get_variable_layout(self, variable: Any) -> Any:
        if getattr(variable, "_layout", None) is None:
            key = (
                variable.path,
                tuple(int(d) for d in variable.shape),
                keras.backend.standardize_dtype(variable.dtype),
            )
            axes = self._quantized.get(key)
            if axes is not None:
                return specs.tensor_layout(axes, self.device_mesh)
        return super().get_variable_layout(variable)
