"""Random init straight into a quantized model: the factories' `quantize=`.

`gemma_backbone(..., quantize="int8" | "int4")` (every factory) returns what
the stock backbone built with the same seed gives after
`backbone.quantize(mode)`, bitwise, without the float model ever whole on
the devices. The backbone is built without values and quantized
structurally (`plan.quantization.quantize_without_values`); every variable
Keras leaves in float is drawn as the factory draws it. Then, one float
tensor at a time: its twin initializer draws it in its float layout (each
device its own shard), a `quantize.quantizer.TensorQuantizer` reads those
shards on the host and computes each device's quantized blocks (statistics
split across devices combined as for a load), the quantized blocks are
placed in their layouts (`plan.quantized_layouts`), and the float shards
are deleted before the next tensor is drawn. So a device holds the
quantized model plus, for a moment, one float kernel's shard.

Example:

```python
with keras.distribution.ModelParallel(layout_map=layout_map).scope():
    backbone = keras_hub_dist.llama_backbone("llama3_8b_en", num_layers=2, quantize="int8")
```
"""

from __future__ import annotations

from typing import Any

import jax
import keras
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.errors import QuantizationError
from keras_hub_dist.storage import host_io
from keras_hub_dist.quantize import kernels as quantize_kernels
from keras_hub_dist.formats.base import Index, TensorSource, numpy_dtype
from keras_hub_dist.quantize.quantizer import TensorQuantizer, group_index_source, slab_buffers
from keras_hub_dist.quantize.combine import combine_statistics, sharding_blocks
from keras_hub_dist.init import initializers
from keras_hub_dist.plan import quantization, specs
from keras_hub_dist.plan.quantized_layouts import quantized_axes

__all__ = ["initialize_quantized"]


class _DeviceShards(TensorSource):
    """A sharded `jax.Array`'s values, block by block, from this process's
    shards (each block copied to the host, never gathered on a device)."""

    def __init__(self, array: jax.Array, description: str) -> None:
        self.array = array
        self.shape, self.dtype = tuple(array.shape), numpy_dtype(array.dtype)
        self.description = description
        self._shards = [(self._index(s.index), s.data) for s in array.addressable_shards]

    def _index(self, slices: tuple[slice, ...]) -> Index:
        return tuple((s.start or 0, d if s.stop is None else s.stop) for s, d in zip(slices, self.shape))

    def read(self, index: Index) -> np.ndarray:
        def inside(box: Index) -> bool:
            return all(c <= a and b <= d for (a, b), (c, d) in zip(index, box))

        for box, data in self._shards:  # one shard holds it: the usual case
            if inside(box):
                host = _compat.host_array(data)
                return _fresh(host[tuple(slice(a - c, b - c) for (a, b), (c, _) in zip(index, box))])
        out = host_io.aligned_empty(tuple(b - a for a, b in index), self.dtype)
        covered = np.zeros(out.shape, dtype=bool)
        for box, data in self._shards:
            cut = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(index, box))
            if any(lo >= hi for lo, hi in cut):
                continue
            target = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(cut, index))
            out[target] = _compat.host_array(data)[tuple(slice(lo - c, hi - c) for (lo, hi), (c, _) in zip(cut, box))]
            covered[target] = True
        if not covered.all():
            raise QuantizationError(
                f"Block {index} of {self.description} is not held by this "
                "process's devices. Expected the quantized layout to keep each "
                "process's elements (true for every map of this package on one "
                "process). Received: a layout whose int4 matrix moves elements "
                "across processes; load from a checkpoint instead."
            )
        return out


def _fresh(values: np.ndarray) -> np.ndarray:
    out = host_io.aligned_empty(values.shape, values.dtype)
    out[...] = values
    return out


def _place(variable: Any, source: TensorSource, axes: tuple, mesh: Any) -> None:
    """Fills a deferred variable from `source`, each local block on its devices."""
    layout = specs.tensor_layout(axes, mesh)
    sharding = layout.backend_layout
    shape = tuple(int(d) for d in variable.shape)
    dtype = numpy_dtype(variable.dtype)
    blocks: dict[Index, np.ndarray] = {}
    per_device = []
    for device, index in zip(
        sharding.addressable_devices_indices_map(shape), sharding_blocks(sharding, shape, local=True, distinct=False)
    ):
        if index not in blocks:
            host = source.read(index)
            blocks[index] = host if host.dtype == dtype else host.astype(dtype)
        per_device.append(jax.device_put(blocks[index], device))
    array = jax.make_array_from_single_device_arrays(shape, sharding, per_device)
    _compat.materialize_deferred_variable(variable, array, layout)
    _compat.forget_deferred_variables([variable])


def initialize_quantized(backbone: keras.Model, created: list[Any], mode: str) -> None:
    """Quantizes `backbone` (built without values; `created` its pending
    variables) structurally and gives every variable its value (see the
    module doc). Runs under the active distribution, or none (then: drawn
    in float and quantized by Keras itself)."""
    distribution = keras.distribution.distribution()
    if distribution is None:
        initializers.initialize_variables(created, distribute_all=True)
        backbone.quantize(mode)
        return
    quantize_kernels.prepare()
    result = quantization.quantize_without_values(backbone, mode)
    removed = {id(v) for v in result.removed} | {id(v) for v in result.created}
    initializers.initialize_variables([v for v in created if id(v) not in removed], distribute_all=True)
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    buffers = slab_buffers()
    for tensor in result.tensors:
        float_variable = tensor.float_variable
        layout = distribution.get_variable_layout(float_variable)
        float_axes = tuple(layout.axes)
        axes = quantized_axes(tensor, float_axes, sizes)
        initializers.initialize_variables([float_variable], distribute_all=True)
        drawn = _compat.variable_array(float_variable)
        quantizer = TensorQuantizer(tensor, _DeviceShards(drawn, float_variable.path), float_variable.dtype, buffers)
        values = quantizer.values_source()
        sharding = specs.tensor_layout(axes[tensor.values.path], mesh).backend_layout
        if quantizer.splits(sharding_blocks(sharding, values.shape)):
            combine_statistics([(quantizer, sharding_blocks(sharding, values.shape, local=True))])
        sources = {tensor.values.path: values, tensor.scale.path: quantizer.scale_source(numpy_dtype(tensor.scale.dtype))}
        if tensor.zero is not None:
            sources[tensor.zero.path] = quantizer.zero_source(numpy_dtype(tensor.zero.dtype))
        if tensor.group_index is not None:
            sources[tensor.group_index.path] = group_index_source(tensor)
        for variable in tensor.variables:
            _place(variable, sources[variable.path], axes[variable.path], mesh)
        quantizer.release()
        drawn.delete()
