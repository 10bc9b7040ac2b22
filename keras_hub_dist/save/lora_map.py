"""Which Transformers module every projection of a backbone is, for LoRA.

The Hugging Face export's mapping (`save.hf_mapping`: KerasHub's importer
traced on the checkpoint and inverted) already says, for every kernel, which
tensor it becomes and how its elements move. A projection LoRA can adapt is
a kernel that becomes exactly one `<module>.weight` tensor `(out, in)` as
`transpose(reshape(kernel, (in, out)))`: its inputs the leading kernel axes,
in C order, its outputs the rest. Then PEFT's `lora_A (r, in)` is Keras's
`A` (`in_shape + (r,)`) reshaped and transposed, and `lora_B (out, r)` is
`B (r, out)` transposed, with nothing re-derived per family.

Example:

```python
for layer, module in lora_modules(backbone):
    module.module, module.target   # "model.layers.0.self_attn.q_proj", "q_proj"
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from keras_hub_dist import _compat
from keras_hub_dist.formats import keras_h5
from keras_hub_dist.formats.pieces import Atom, Piece, canonical
from keras_hub_dist.plan.abstract import build_without_values
from keras_hub_dist.plan.lora_layers import input_axes
from keras_hub_dist.save.hf_export import twin_config
from keras_hub_dist.save.hf_mapping import hf_mapping

__all__ = ["LoraModule", "lora_modules"]


@dataclass(frozen=True)
class LoraModule:
    """A projection of the backbone as the Transformers module it exports to.

    Attributes:
        module: The module's name in Transformers' model
            (`"model.layers.0.self_attn.q_proj"`).
        target: Its last component, as PEFT's `target_modules` names it.
        kernel_shape: The Keras kernel's shape.
        inputs: The kernel axes that are inputs.
    """

    module: str
    target: str
    kernel_shape: tuple[int, ...]
    inputs: tuple[int, ...]

    @property
    def in_features(self) -> int:
        return math.prod(self.kernel_shape[i] for i in self.inputs)

    @property
    def out_features(self) -> int:
        return math.prod(d for i, d in enumerate(self.kernel_shape) if i not in self.inputs)


def _strides(sizes: list[int]) -> list[int]:
    return [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]


def _natural(piece: Piece, shape: tuple[int, ...], inputs: tuple[int, ...]) -> bool:
    """Whether `piece` (kernel -> tensor `(out, in)`) puts the kernel's
    output axes on the rows and its input axes on the columns, each
    flattened in the kernel's order."""
    outputs = tuple(i for i in range(len(shape)) if i not in inputs)
    size_in = math.prod(shape[i] for i in inputs)
    in_steps = dict(zip(inputs, _strides([shape[i] for i in inputs])))
    out_steps = dict(zip(outputs, _strides([shape[i] for i in outputs])))
    atoms = tuple(
        Atom(d, step, in_steps[i] if i in in_steps else out_steps[i] * size_in)
        for i, (d, step) in enumerate(zip(shape, _strides(list(shape))))
    )
    return canonical(piece) == canonical(Piece(piece.leaf, 0, 0, atoms))


def lora_modules(backbone: Any) -> list[tuple[Any, LoraModule]]:
    """`(layer, module)` for every projection of `backbone` that is a
    Transformers linear module, in model order.

    Raises:
        SaveError: The family does not export to the Hugging Face format
            (the message lists those that do).
    """
    twin, created = build_without_values(type(backbone), twin_config(backbone))
    try:
        mapping = hf_mapping(twin)
        names: dict[int, str] = {}
        for name, variable in keras_h5.expected_datasets(twin).items():
            names.setdefault(id(variable), name)
        twin_layers = [l for l in _compat.leaf_layers(twin) if input_axes(l) is not None]
    finally:
        _compat.forget_deferred_variables(created)
    live_layers = [l for l in _compat.leaf_layers(backbone) if input_axes(l) is not None]
    shapes = {t.name: tuple(t.shape) for t in mapping.tensors}
    out = []
    # The twin is built from the model's config: the same layers in the same
    # order (its auto-generated names may differ, so not matched by name).
    for twin_layer, layer in zip(twin_layers, live_layers, strict=True):
        kernel = twin_layer._kernel
        pairs = mapping.pieces.get(names.get(id(kernel), ""), ())
        if len(pairs) != 1 or not pairs[0][0].endswith(".weight"):
            continue
        tensor, piece = pairs[0]
        shape = tuple(int(d) for d in kernel.shape)
        module = tensor[: -len(".weight")]
        found = LoraModule(module, module.rsplit(".", 1)[-1], shape, input_axes(twin_layer))
        if shapes.get(tensor) != (found.out_features, found.in_features) or not _natural(piece, shape, found.inputs):
            continue
        out.append((layer, found))
    return out
