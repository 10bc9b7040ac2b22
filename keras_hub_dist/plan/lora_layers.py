"""LoRA on a Keras projection in the factorization PEFT uses.

PEFT's LoRA of a linear layer `W (out, in)` is `W + s * B @ A` with
`A (r, in)`, `B (out, r)`: a rank-`r` update of the whole matrix. Keras's
`EinsumDense.enable_lora(r)` splits the kernel at its *last* axis instead:
`A = kernel.shape[:-1] + (r,)`, `B = (r, kernel.shape[-1])`. Where the
kernel's input axes are all but the last (an output projection
`(heads, head_dim, hidden)`, every 2-D kernel) the two agree. Where the
output has several axes (a query kernel `(hidden, heads, head_dim)`), Keras's
`A` carries the head axis, so its update is one rank-`r` update per head
sharing `B`: rank up to `heads * r` as a matrix, which no rank-`r` PEFT
adapter can hold, and a PEFT adapter's update of `q_proj` is not of Keras's
form either.

`enable_lora(layer, rank, lora_alpha)` gives every projection PEFT's form:
Keras's own `enable_lora` where the forms agree, and elsewhere the same
method run with the kernel's input axes kept apart (`A = in_shape + (r,)`,
`B = (r, prod(out_shape))`, the update `reshape(A @ B, kernel.shape)`): the
layer's class becomes a subclass whose `kernel` property computes that.
`lora_form(layer)` tells a LoRA-enabled layer's form (either one) for the
adapter writer.

Example:

```python
layer = backbone.get_layer("transformer_layer_0").attention.query_dense
enable_lora(layer, rank=4, lora_alpha=8)
layer.lora_kernel_a.shape, layer.lora_kernel_b.shape  # (hidden, 4), (4, heads * head_dim)
```
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import keras
from keras import ops

__all__ = ["LoraForm", "enable_lora", "input_axes", "lora_form"]


def input_axes(layer: Any) -> tuple[int, ...] | None:
    """The kernel axes that are the layer's inputs (contracted with the
    input), in order; `None` for a layer LoRA cannot go on (no kernel, an
    ellipsis equation, a kernel axis neither input nor output)."""
    if isinstance(layer, keras.layers.Dense):
        return (0,)
    if not isinstance(layer, keras.layers.EinsumDense) or "." in layer.equation:
        return None
    try:
        operands, output = layer.equation.replace(" ", "").split("->")
        inputs, kernel = operands.split(",")
    except ValueError:
        return None
    axes = tuple(i for i, a in enumerate(kernel) if a in inputs and a not in output)
    outputs = [a for a in kernel if a in output and a not in inputs]
    if not axes or len(axes) + len(outputs) != len(kernel):
        return None
    return axes


def _order(shape: tuple[int, ...], inputs: tuple[int, ...]) -> tuple[list[int], tuple[int, ...]]:
    """`(input axes then output axes, the permutation back to the kernel's order)`."""
    order = list(inputs) + [i for i in range(len(shape)) if i not in inputs]
    return order, tuple(order.index(i) for i in range(len(shape)))


class _SplitLora:
    """The `kernel` of an `EinsumDense` whose LoRA factors split the kernel
    between its input and output axes (PEFT's form; see the module)."""

    @property
    def kernel(self) -> Any:
        shape_for_lora = getattr(self, "_khd_lora_shape", None)
        if shape_for_lora is not None:  # inside `enable_lora`, which reads `kernel.shape`
            return SimpleNamespace(shape=shape_for_lora)
        kernel = self._kernel
        if self.lora_enabled:
            shape = tuple(kernel.shape)
            order, back = _order(shape, self._khd_lora_inputs)
            update = ops.reshape(ops.matmul(self.lora_kernel_a, self.lora_kernel_b), [shape[i] for i in order])
            if back != tuple(range(len(shape))):
                update = ops.transpose(update, back)
            kernel = ops.cast(ops.add(kernel, (self.lora_alpha / self.lora_rank) * update), self.compute_dtype)
        return kernel


@functools.cache
def _split_class(cls: type) -> type:
    return type(cls.__name__, (_SplitLora, cls), {"__module__": __name__, "__qualname__": cls.__qualname__})


def enable_lora(
    layer: Any, rank: int, lora_alpha: float | None = None, a_initializer: Any = "he_uniform"
) -> None:
    """Enables LoRA on `layer` in PEFT's factorization (see the module).

    Args:
        layer: A built `Dense` or `EinsumDense` without LoRA, each of whose
            kernel axes is an input or an output axis.
        rank: The rank `r`.
        lora_alpha: The scale numerator: updates are scaled by
            `lora_alpha / rank`, as in Keras and PEFT; default `rank`.
        a_initializer: The initializer of `lora_kernel_a` (Keras's default).

    Raises:
        ValueError: A layer of another kind, a quantized layer (Keras's own
            checks too: LoRA already enabled, a kernel constraint).
    """
    inputs = input_axes(layer)
    if inputs is None:
        raise ValueError(
            f"Expected a Dense or EinsumDense layer each of whose kernel axes is an input or an "
            f"output axis. Received: {layer.path!r} ({type(layer).__name__}"
            f"{', ' + repr(layer.equation) if hasattr(layer, 'equation') else ''})."
        )
    if getattr(layer, "quantization_mode", None):
        raise ValueError(f"Expected an unquantized layer for LoRA. Received: {layer.path!r} ({layer.quantization_mode}).")
    shape = tuple(int(d) for d in layer.kernel.shape)
    if inputs == tuple(range(len(shape) - 1)):
        layer.enable_lora(rank, lora_alpha=lora_alpha, a_initializer=a_initializer)
        return
    outputs = [d for i, d in enumerate(shape) if i not in inputs]
    layer.__class__ = _split_class(type(layer))
    # Set past Keras's attribute tracking, which would wrap the tuples.
    object.__setattr__(layer, "_khd_lora_inputs", inputs)
    object.__setattr__(layer, "_khd_lora_shape", tuple(shape[i] for i in inputs) + (math.prod(outputs),))
    try:
        layer.enable_lora(rank, lora_alpha=lora_alpha, a_initializer=a_initializer)
    finally:
        object.__setattr__(layer, "_khd_lora_shape", None)


@dataclass(frozen=True)
class LoraForm:
    """How a LoRA-enabled layer's factors relate to its kernel.

    Attributes:
        kernel_shape: The kernel's shape.
        inputs: The kernel axes that are inputs.
        rank: Keras's rank `r`.
        scale: `lora_alpha / rank`.
        heads: Output axes that Keras's own form keeps in `A` (every kernel
            axis but the last that is not an input); `()` in PEFT's form.
            Such a layer's update is, as a matrix, of rank `prod(heads
            sizes) * r` (block diagonal in `B`).
    """

    kernel_shape: tuple[int, ...]
    inputs: tuple[int, ...]
    rank: int
    scale: float
    heads: tuple[int, ...]

    @property
    def peft_rank(self) -> int:
        """The rank of the update as a matrix: PEFT's `r` that holds it."""
        return math.prod(self.kernel_shape[i] for i in self.heads) * self.rank


def lora_form(layer: Any) -> LoraForm | None:
    """The form of a LoRA-enabled layer's factors (`None`: no LoRA, or
    factors of neither form)."""
    if not getattr(layer, "lora_enabled", False):
        return None
    inputs = input_axes(layer)
    if inputs is None:
        return None
    shape = tuple(int(d) for d in layer._kernel.shape)
    a, b = tuple(layer.lora_kernel_a.shape), tuple(layer.lora_kernel_b.shape)
    rank = int(layer.lora_rank)
    scale = layer.lora_alpha / layer.lora_rank
    outputs = math.prod(d for i, d in enumerate(shape) if i not in inputs)
    if a == tuple(shape[i] for i in inputs) + (rank,) and b == (rank, outputs):
        return LoraForm(shape, inputs, rank, scale, ())
    if a == shape[:-1] + (rank,) and b == (rank, shape[-1]) and len(shape) - 1 not in inputs:
        return LoraForm(shape, inputs, rank, scale, tuple(i for i in range(len(shape) - 1) if i not in inputs))
    return None
