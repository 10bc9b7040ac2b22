"""A checkpoint's own int4 codes placed in Keras's int4 layers, 4 bits a weight.

Keras 3.15's int4 `Dense` / `EinsumDense` with groups (`int4/<block>`
policies) hold exactly what GPTQ, AWQ and compressed-tensors `pack-quantized`
checkpoints store: on the kernel's 2-D matrix `M` `(in, out)` (an
`EinsumDense` kernel reshaped in C order), int4 codes `q` packed two per byte
along `out` (low nibble first), `kernel_scale` and `kernel_zero` `(groups,
out)`, and `g_idx` `(in,)`, each input row's group (any order: GPTQ's
act-order `g_idx` as it is), dequantized as `(q - zero) * scale`. A Linear
weight `W` `(out, in)` fills `M = W.T` when KerasHub's converter maps it so
(Llama, Qwen, Mistral: every projection); `int4_kernels` finds those by
asking the traced source of each kernel, reshaped to `M`, whether it is
`transpose(W)` of a `formats.dequantize.Int4Source`, float casts aside (the
load's dtype, and Mistral's converter's float16: the layer holds the
checkpoint's values, dequantized in the compute dtype). Other kernels (a
converter that scrambles the groups, e.g. Gemma's query kernels) load
dequantized, in the float dtype.

The codes are never dequantized on the way: each block of each variable is
read from the codes, scales and zero points of that block alone (no group
spans two shards' reads: a scale block is read whole wherever the kernel's
rows are cut).

Example:

```python
found = int4_kernels(backbone, index)      # {layer path: (source, block)}
sources = int4_variable_sources(tensor, found[tensor.layer_path][0])
```
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.formats import transforms
from keras_hub_dist.formats.base import CheckpointIndex, Index, TensorSource, is_float
from keras_hub_dist.formats.dequantize import Int4Source
from keras_hub_dist.plan.quantization import QuantizedTensor, scale_shape
from keras_hub_dist.storage import host_io

__all__ = ["int4_kernels", "int4_variable_sources", "uses_prequantized"]


def _matrix(layer: Any, kind: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    if kind == "dense":
        return (shape[0], shape[1])
    try:
        reduced = _compat.einsum_reduction(layer)["reduced"]
    except ValueError:
        return None
    rows = int(np.prod([d for i, d in enumerate(shape) if i in reduced]))
    return (rows, int(np.prod(shape)) // rows)


def uses_prequantized(source: TensorSource) -> bool:
    """Whether a traced source reads a checkpoint's int4 codes."""
    if isinstance(source, Int4Source):
        return True
    for attr in ("child", "children", "operands", "inputs"):
        value = getattr(source, attr, None)
        for child in value if isinstance(value, tuple) else [value]:
            if isinstance(child, TensorSource) and uses_prequantized(child):
                return True
    return False


def int4_kernels(backbone: Any, index: CheckpointIndex) -> dict[str, tuple[Int4Source, int]]:
    """`{layer path: (int4 source, block size)}` of each `Dense` /
    `EinsumDense` whose float kernel is exactly `transpose` of a
    checkpoint's int4 weight on Keras's int4 matrix."""
    by_variable = {id(e.variable): e for e in index.entries}
    kinds = {"Dense": "dense", "EinsumDense": "einsum"}
    found: dict[str, tuple[Int4Source, int]] = {}
    for layer in _compat.leaf_layers(backbone):
        kind = kinds.get(type(layer).__name__)
        if kind is None or type(layer).__module__.split(".")[0] != "keras":
            continue
        kernel = next((v for v in layer.weights if v.path == f"{layer.path}/kernel"), None)
        entry = by_variable.get(id(kernel)) if kernel is not None else None
        if entry is None or not uses_prequantized(entry.source):
            continue
        matrix = _matrix(layer, kind, tuple(int(d) for d in kernel.shape))
        if matrix is None:
            continue
        try:
            m = transforms.reshape(entry.source, matrix)
        except ValueError:
            continue
        m = _uncast(m)
        weight = _uncast(m.child) if isinstance(m, transforms.Transpose) and m.perm == (1, 0) else None
        if isinstance(weight, Int4Source) and tuple(weight.shape) == weight.base:
            found[layer.path] = (weight, weight.group_size)
    return found


def _uncast(source: TensorSource) -> TensorSource:
    """`source` less its float casts (the load's dtype; a converter's own
    `astype`, as Mistral's float16): the int4 layer holds the checkpoint's
    values, dequantized in the compute dtype."""
    while isinstance(source, transforms.Cast) and is_float(source.dtype) and source.dtype.itemsize >= 2:
        source = source.child
    return source


class _PackedRows(TensorSource):
    """The codes packed two per byte along the output, as rows:
    `(ceil(out / 2), in)` int8; Keras's values variable is its transpose
    (done on the devices, `load.block_plan`, for large blocks)."""

    def __init__(self, source: Int4Source) -> None:
        self.source = source
        self.shape = ((source.base[0] + 1) // 2, source.base[1])
        self.dtype = np.dtype(np.int8)
        self.description = f"the int4 codes of {source.description}"

    def read(self, index: Index) -> np.ndarray:
        (p0, p1), (i0, i1) = index
        o0, o1 = 2 * p0, min(2 * p1, self.source.base[0])
        codes = self.source.codes(o0, o1, i0, i1).view(np.uint8)  # (out, in)
        out = host_io.aligned_empty((p1 - p0, i1 - i0), self.dtype)
        packed = out.view(np.uint8)
        np.bitwise_and(codes[0::2], np.uint8(0x0F), out=packed)
        if codes.shape[0] > 1:
            high = codes[1::2] << np.uint8(4)
            packed[: high.shape[0]] |= high
        return out

    def read_nbytes(self, index: Index) -> int:
        (p0, p1), (i0, i1) = index
        return (p1 - p0) * (i1 - i0)

    def union_read_helps(self, indices: Any) -> bool:
        return False


class _Groups(TensorSource):
    """`group_scales` / `group_zeros` transposed: `(groups, out)`."""

    def __init__(self, source: Int4Source, shape: tuple[int, ...], dtype: Any, zeros: bool) -> None:
        self.source, self.shape, self.zeros = source, shape, zeros
        self.dtype = np.dtype(dtype)
        self.description = f"the group {'zero points' if zeros else 'scales'} of {source.description}"

    def read(self, index: Index) -> np.ndarray:
        (g0, g1), (o0, o1) = index
        read = self.source.group_zeros if self.zeros else self.source.group_scales
        out = host_io.aligned_empty((g1 - g0, o1 - o0), self.dtype)
        out[...] = read(o0, o1, g0, g1).T
        return out

    def read_nbytes(self, index: Index) -> int:
        (g0, g1), (o0, o1) = index
        return (g1 - g0) * (o1 - o0) * (1 if self.zeros else self.source.scales.dtype.itemsize)

    def union_read_helps(self, indices: Any) -> bool:
        return False


class _GroupIndex(TensorSource):
    """Keras's `g_idx`: each input row's group, float32."""

    def __init__(self, source: Int4Source) -> None:
        self.source = source
        self.shape = (source.base[1],)
        self.dtype = np.dtype(np.float32)
        self.description = f"the group index of {source.description}"

    def read(self, index: Index) -> np.ndarray:
        ((i0, i1),) = index
        out = host_io.aligned_empty((i1 - i0,), self.dtype)
        out[...] = self.source.group_index(i0, i1)
        return out

    def read_nbytes(self, index: Index) -> int:
        return 0 if self.source.g_idx is None else (index[0][1] - index[0][0]) * self.source.g_idx.dtype.itemsize


def int4_variable_sources(tensor: QuantizedTensor, source: Int4Source, scale_dtype: Any) -> Mapping[int, TensorSource]:
    """`{id(variable): source}` of the values, scale, zero and g_idx of a
    Keras int4 kernel whose matrix is `source`'s weight transposed.

    Raises:
        ValueError: Keras's variables do not have the shapes the checkpoint
            gives (another group size, another Keras).
    """
    rows, cols = tensor.rule.matrix
    if (cols, rows) != source.base or tensor.rule.block_size != source.group_size:
        raise ValueError(
            f"{tensor.layer_path}: Keras's int4 matrix {tensor.rule.matrix} in groups of "
            f"{tensor.rule.block_size} does not hold {source.description} "
            f"({source.base} in groups of {source.group_size})"
        )
    groups = scale_shape(tensor)
    out = {
        id(tensor.values): transforms.Transpose(_PackedRows(source), (1, 0)),
        id(tensor.scale): _Groups(source, groups, scale_dtype, zeros=False),
        id(tensor.zero): _Groups(source, groups, np.int8, zeros=True),
        id(tensor.group_index): _GroupIndex(source),
    }
    return out
