"""Loading quantized: `quantize=` and quantized presets, for `load_sharded_preset`.

With `quantize="int8" | "int4"` the float model is built without values and
its checkpoint indexed and validated as for a float load; then:

1. `quantize_checkpoint`: the model gets Keras's quantized structure
   (`plan.quantization.quantize_without_values`, no float kernel ever
   allocated) and the index its variables, each quantized one with a
   `quantize.quantizer` source computing its blocks from the float tensor's;
2. `quantized_layout_map`: the layout map gets an exact entry per quantized
   variable, derived from its float kernel's layout;
3. `combine_statistics`: after planning, the tensors whose reduced extent
   the layout splits get their statistics from one small collective;
4. the executor reads and places the quantized blocks like any other, and
   `QuantizedLoad.filled` drops a tensor's statistics once its variables are
   placed.

A quantized KerasHub preset (written by `save_to_preset` after `quantize`)
needs none of this but the layout entries: its `config.json` carries the
layers' quantized dtype policies (`DTypePolicyMap`), which `preset_config`
keeps (stock `Backbone.from_preset` replaces it with `dtype=None` and fails).

Example:

```python
loaded = quantize_checkpoint(backbone, index, "int8")
index, deferred = loaded.index, loaded.pending(deferred)
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import keras

from keras_hub_dist.errors import QuantizationError
from keras_hub_dist.formats.base import CheckpointIndex, IndexedVariable, numpy_dtype
from keras_hub_dist.quantize.quantizer import TensorQuantizer, group_index_source, slab_buffers
from keras_hub_dist.quantize.combine import combine_statistics, sharding_blocks
from keras_hub_dist.quantize import prequantized
from keras_hub_dist.load.block_plan import LoadPlan
from keras_hub_dist.plan import quantization
from keras_hub_dist.plan.layouts import ReportingLayoutMap
from keras_hub_dist.plan.quantized_layouts import add_quantized_entries

__all__ = [
    "QuantizedLoad",
    "prequantized_checkpoint",
    "preset_config",
    "quantize_checkpoint",
    "quantized_layout_map",
    "run_combine",
]

_POLICY_MAP = "DTypePolicyMap"


def _saved_modes(saved_dtype: Any) -> set[str]:
    if not (isinstance(saved_dtype, Mapping) and _POLICY_MAP in str(saved_dtype.get("class_name"))):
        return set()
    policies = saved_dtype.get("config", {}).get("policy_map", {})
    return {p.get("config", {}).get("mode") for p in policies.values() if isinstance(p, Mapping)} - {None}


def preset_config(config: Mapping[str, Any], dtype: Any, quantize: str | None, label: str) -> dict[str, Any]:
    """The backbone config to build: `dtype` replaces the saved dtype, except
    a quantized preset's `DTypePolicyMap`, which is kept with `dtype` as its
    float policy (KerasHub's `set_dtype_in_config`, which `from_preset` of a
    backbone skips).

    Raises:
        QuantizationError: `quantize=` asks another mode than the preset's.
    """
    saved = config.get("dtype")
    modes = _saved_modes(saved)
    if not modes:
        return {**config, "dtype": dtype}
    if quantize is not None and modes != {quantize}:
        raise QuantizationError(
            f"The preset {label!r} is already quantized ({', '.join(sorted(modes))}). "
            f"Expected quantize=None (or {sorted(modes)[0]!r}) for it. Received: "
            f"quantize={quantize!r}. Load the float preset to quantize it "
            "another way."
        )
    if dtype is None:
        return dict(config)
    name = dtype if isinstance(dtype, str) else keras.dtype_policies.get(dtype).name
    saved = {**saved, "config": dict(saved["config"])}
    saved["config"]["default_policy"] = name
    saved["config"]["policy_map"] = {
        key: {**policy, "config": {**policy["config"], "source_name": name}}
        for key, policy in saved["config"]["policy_map"].items()
    }
    return {**config, "dtype": saved}


@dataclasses.dataclass
class QuantizedLoad:
    """A model quantized without values, and where its variables come from.

    Attributes:
        index: The checkpoint index of the quantized model (float variables
            as indexed, quantized ones computed from their float tensors).
        result: What `quantize_without_values` did.
        quantizers: `id(values source)` -> its `TensorQuantizer`.
    """

    index: CheckpointIndex
    result: quantization.QuantizedModel
    quantizers: dict[int, TensorQuantizer]
    _owner: dict[int, TensorQuantizer] = dataclasses.field(default_factory=dict)
    _left: dict[int, int] = dataclasses.field(default_factory=dict)

    def pending(self, deferred: Sequence[Any]) -> list[Any]:
        """The variables still to fill: `deferred` less the float variables
        the model dropped, plus the quantized ones."""
        removed = {id(v) for v in self.result.removed}
        return [v for v in deferred if id(v) not in removed] + list(self.result.created)

    def filled(self, variable: Any) -> None:
        """Called once per placed variable: a tensor's kept statistics go
        once its last variable is placed."""
        quantizer = self._owner.get(id(variable))
        if quantizer is None:
            return
        self._left[id(quantizer)] -= 1
        if not self._left[id(quantizer)]:
            quantizer.release()


def quantize_checkpoint(backbone: keras.Model, index: CheckpointIndex, mode: str) -> QuantizedLoad:
    """Quantizes `backbone`'s structure and derives the quantized index.

    Args:
        backbone: The float model, built without values, that `index` fills.
        index: Its validated checkpoint index.
        mode: `"int8"` or `"int4"`.
    """
    result = quantization.quantize_without_values(backbone, mode)
    by_variable = {id(e.variable): e for e in index.entries}
    derived: dict[int, Any] = {}
    quantizers: dict[int, TensorQuantizer] = {}
    loaded = QuantizedLoad(index, result, quantizers)
    buffers = slab_buffers()
    for tensor in result.tensors:
        entry = by_variable[id(tensor.float_variable)]
        quantizer = TensorQuantizer(tensor, entry.source, tensor.float_variable.dtype, buffers)
        values = quantizer.values_source()
        quantizers[id(values)] = quantizer
        derived[id(tensor.values)] = values
        derived[id(tensor.scale)] = quantizer.scale_source(numpy_dtype(tensor.scale.dtype))
        if tensor.zero is not None:
            derived[id(tensor.zero)] = quantizer.zero_source(numpy_dtype(tensor.zero.dtype))
        if tensor.group_index is not None:
            derived[id(tensor.group_index)] = group_index_source(tensor)
        for variable in tensor.variables:
            loaded._owner[id(variable)] = quantizer
        loaded._left[id(quantizer)] = len(tensor.variables)
    entries = []
    for variable in backbone.weights:
        if id(variable) in derived:
            source = derived[id(variable)]
            entries.append(
                IndexedVariable(
                    variable.path, tuple(int(d) for d in variable.shape),
                    numpy_dtype(variable.dtype), source, variable,
                )
            )
        elif id(variable) in by_variable:
            entries.append(by_variable[id(variable)])
    loaded.index = dataclasses.replace(index, entries=tuple(entries))
    return loaded


def prequantized_checkpoint(backbone: keras.Model, index: CheckpointIndex) -> QuantizedLoad | None:
    """A pre-quantized int4 checkpoint (GPTQ, AWQ, compressed-tensors) into
    Keras's int4 layers: each `Dense` / `EinsumDense` whose kernel is a
    checkpoint's int4 weight gets Keras's int4 structure in the checkpoint's
    groups, and its variables the checkpoint's codes, scales, zero points and
    group index as they are (`quantize.prequantized`); `None` when no kernel
    is one. Kernels the converter maps otherwise load dequantized."""
    found = prequantized.int4_kernels(backbone, index)
    if not found:
        return None
    result = quantization.quantize_without_values(
        backbone, "int4", {path: block for path, (_, block) in found.items()}
    )
    by_variable = {id(e.variable): e for e in index.entries}
    derived: dict[int, Any] = {}
    for tensor in result.tensors:
        scale_dtype = numpy_dtype(tensor.scale.dtype)
        derived.update(prequantized.int4_variable_sources(tensor, found[tensor.layer_path][0], scale_dtype))
    entries = []
    for variable in backbone.weights:
        if id(variable) in derived:
            entries.append(IndexedVariable(
                variable.path, tuple(int(d) for d in variable.shape),
                numpy_dtype(variable.dtype), derived[id(variable)], variable,
            ))
        elif id(variable) in by_variable:
            entries.append(by_variable[id(variable)])
    return QuantizedLoad(dataclasses.replace(index, entries=tuple(entries)), result, {})


def quantized_layout_map(
    backbone: keras.Model, layout_map: keras.distribution.LayoutMap, float_map: keras.distribution.LayoutMap | None = None
) -> keras.distribution.LayoutMap:
    """A copy of `layout_map` with an exact entry per quantized variable of
    `backbone`, from the float kernels' layouts in `float_map` (default:
    `layout_map` itself)."""
    tensors = quantization.quantized_tensors(backbone)
    if not tensors:
        return layout_map
    float_map = layout_map if float_map is None else float_map
    out = ReportingLayoutMap(layout_map.device_mesh, getattr(layout_map, "report", None))
    for key in layout_map:
        out[key] = layout_map[key]
    float_axes = {}
    for tensor in tensors:
        layout = float_map[tensor.float_path]
        float_axes[tensor.float_path] = tuple(layout.axes) if layout is not None else ()
    return add_quantized_entries(out, tensors, float_axes)


def run_combine(plan: LoadPlan, shardings: Mapping[str, Any], quantizers: Mapping[int, TensorQuantizer]) -> None:
    """Completes, before any block is placed, the statistics of every
    tensor whose layout splits its reduced extent over devices (a global
    property, so all processes take part in the same collective)."""
    work = []
    for var in plan.variables:
        quantizer = quantizers.get(id(var.source))
        if quantizer is None or not quantizer.splits(sharding_blocks(shardings[var.path], var.shape)):
            continue
        if (
            jax.process_count() == 1
            and var.union is not None
            and quantizer.complete(quantizer.x_index(var.union))
        ):
            continue  # one process reads its whole extent at once anyway
        work.append((quantizer, [b.index for b in var.blocks]))
    combine_statistics(work)
