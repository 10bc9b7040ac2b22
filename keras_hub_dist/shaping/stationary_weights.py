"""`generate` with each block's weights where they are stored: the batch
whole and the attention heads over the mesh axes that divide them.

On a mesh whose data axis is over 1, the package's maps store each large
weight split over both axes (FSDP's storage), and `shaping/batch_axis.py`
keeps the batch split over the data axis: to compute a block, XLA gathers
its weights over that axis, every prompt chunk and every decode step (and
left to itself kept the gathered copies: `shaping/block_gathers.py`). Where
the whole mesh divides the KV heads (Llama 3, Mistral, Qwen 3, Mixtral,
gpt-oss, Gemma 1 / 2 but their 2B: 8 or 16 KV heads on 8 devices),
`generate` computes as a (1, 8) mesh does instead, and no weight moves: the
batch whole on every device (a `generate` batch is small), the KV cache and
the attention split over the heads on all the mesh's axes (an eighth of the
heads per device, as on (1, 8)), and each projection's input laid out as
its kernel's contracting dimensions are stored, so that a device multiplies
its own shard of the kernel and only activations are summed or moved (the
weight-stationary layout of Pope et al., "Efficiently Scaling Transformer
Inference", 2022). The heads' order puts first the axis that splits the
key kernel's heads (`kv_heads_axis`: the data axis in the Llama
convention's maps, the model axis in Gemma's), so that a device's heads
are among those its kernel shard computes. Two outputs are pinned too:
`_compute_attention`'s (XLA otherwise took its heads from the output
projection's model-axis layout and gathered the probabilities `[batch,
heads / 4, chunk, length]` over the data axis), and the output
projection's (otherwise its kernel was gathered over the data axis).

Where the mesh does not divide the KV heads but the key kernel's heads
axis does (4 KV heads on (2, 4): Qwen 2.5 7B, Qwen 3 MoE, Gemma 2 2B), that
axis splits the cache's and the attention's heads and the other axis
their batch: each projection's partial sums are reduced onto the batch
rows there, and the attention's output gathered back over them before
the output projection (activations only). Qwen-3-30B-A3B width, 2 layers,
bf16 1,809 -> 1,706 MiB ((1, 8): 1,925); Qwen 2.5 7B 1,297 -> 1,255
(2,033); Gemma 2 2B 1,041 -> 1,031 (1,107).

Each block's weights are still read after its input
(`block_gathers.read_after_the_input`), though none is gathered: what XLA
computes from them (XLA:CPU's f32 copies of bf16 kernels) then stays in
the loops, one block at a time, instead of being hoisted out of them for
every block at once (gpt-oss-20b width, 8 layers, bf16: 7,562 -> 7,255
MiB; (1, 8): 7,021).

Measured (`plan_memory`, XLA:CPU, 8 simulated devices, `generate` 8 x 1024,
total per device, (2, 4) weights gathered -> stationary, (1, 8)):
Llama-3-8B width, 32 layers, bf16 7,253 -> 6,137 MiB (6,384), f32 6,647 ->
4,839 (4,863); Gemma-7B width, 28 layers, bf16 11,766 -> 7,579 (8,722),
f32 14,817 -> 6,924 (6,666). XLA:CPU makes f32 copies of bf16 operands,
which the f32 figures do not hold. More in BENCHMARKS.md. Not done: the
feed-forward kernels keep their hidden dimension on the data axis, so a
prompt chunk's gate and up projections hold `[batch, chunk, ffn / 4]`
partial sums where (1, 8) holds `[batch, chunk, ffn / 8]` (Gemma-7B width,
whose FFN is 8x its hidden size, 2 layers, f32: 1,156 against 920 MiB);
storing the FFN dimension over both axes instead brought that to (1, 8)'s
but made fits worse (Mistral-7B, 2 layers, Adam 8 x 512: 1,504 -> 1,753
MiB, (1, 8): 1,712; a Gemma fit at a small width 0.70x -> 1.04x stock's).

`shaping/generate.py` decides (`heads_axes`, a `Split`) and lays the cache
and the token ids out, for the causal LMs whose cache it knows (one
stacked `[batch, layers, 2, length, kv_heads, head_dim]` cache), and sets
`HEADS_AXES` while `call_with_cache` traces; the blocks' wrappers in
`shaping/batch_axis.py` read it. Elsewhere (one KV head, Gemma 2B; another
cache) `shaping/batch_axis.py`'s layout stands.

Example:

```python
mesh = jax.make_mesh((2, 4), ("batch", "model"))
heads_axes(8, mesh, "batch")                  # Split(("batch", "model"), ()): Llama-3-8B
heads_axes(16, mesh, "batch", major="model")  # Split(("model", "batch"), ()): Gemma-7B
heads_axes(4, mesh, "batch", batch_size=8)    # Split(("batch",), ("model",)): Qwen 3 MoE
heads_axes(1, mesh, "batch", batch_size=8)    # None: the batch stays on the data axis
```
"""

from __future__ import annotations

import contextvars
import functools
import math
from typing import Any, NamedTuple

import jax
import keras

from keras_hub_dist.plan.mesh import axis_sizes

__all__ = [
    "HEADS_AXES",
    "Split",
    "attention_heads_over_the_mesh",
    "backbone_split",
    "batch_whole",
    "heads_axes",
    "heads_over_the_mesh",
    "input_where_the_kernel_is",
    "kv_heads_axis",
    "output_where_the_kernel_is",
]

# How the decoder blocks now tracing split their attention (a `Split`: their
# weights where they are), or None: set by `shaping/generate.py` while
# `call_with_cache` traces, read by the blocks' wrappers
# (`shaping/batch_axis.py`).
HEADS_AXES: contextvars.ContextVar = contextvars.ContextVar("keras_hub_dist_heads_axes", default=None)


class Split(NamedTuple):
    """How the attention of the blocks now tracing is split: its heads over
    `heads`, its batch over `batch` (the mesh's other axes, where they do
    not divide the KV heads; else empty: the batch whole)."""

    heads: tuple[str, ...]
    batch: tuple[str, ...] = ()


def heads_axes(
    kv_heads: int, mesh: Any, data: str | None, major: str | None = None, batch_size: int | None = None
) -> Split | None:
    """How the attention splits on `mesh` (a Keras, JAX or abstract mesh, or
    a mapping of axis sizes) when its data axis is over 1: the heads over
    every axis, `major` first (default: the data axis), where their sizes
    divide `kv_heads`; else the heads over `major` (where its size, over 1,
    divides them) and the batch over the other axes (where `batch_size`
    is given and their sizes divide it); else None (the batch stays on the
    data axis).

    `major` is the axis a block's key kernel splits its heads over
    (`kv_heads_axis`): a device's heads are then a part of those its
    kernel shard computes, so the projection's partial sums are reduced
    onto them where they are (Gemma's kernels split heads on the model
    axis; the Llama convention's on the data axis).
    """
    sizes = axis_sizes(mesh)
    if data is None or sizes.get(data, 1) == 1:
        return None
    first = major if major in sizes else data
    order = (first, *[axis for axis in sizes if axis != first])
    if kv_heads % math.prod(sizes.values()) == 0:
        return Split(order)
    rest = order[1:]
    if sizes[first] == 1 or kv_heads % sizes[first] or batch_size is None or batch_size % math.prod(sizes[a] for a in rest):
        return None
    return Split((first,), rest)


def backbone_split(backbone: Any, mesh: Any, data: str | None, batch_size: int) -> Split | None:
    """`heads_axes` for `backbone`'s KV heads and `batch_size` rows, its key
    kernel's heads axis (`kv_heads_axis`, under the active distribution)
    first; None for a backbone without a KV-head count. What `generate`
    computes with (`shaping/generate.py`) and what the plan's KV-cache figure
    counts (`jobs/programs.py`)."""
    heads = getattr(backbone, "num_key_value_heads", None)
    if not isinstance(heads, int):
        return None
    return heads_axes(heads, mesh, data, major=kv_heads_axis(backbone), batch_size=batch_size)


def kv_heads_axis(backbone: Any) -> str | None:
    """The mesh axis the first decoder block's key projection (an
    `EinsumDense` named `key`, `[batch, tokens, heads, head_dim]` out)
    splits its heads over under the active distribution, or None."""
    distribution = keras.distribution.distribution()
    blocks = getattr(backbone, "transformer_layers", None) or []
    if distribution is None or not blocks:
        return None
    for layer in blocks[0]._flatten_layers(include_self=False, recursive=True):
        if layer.name != "key" or not isinstance(layer, keras.layers.EinsumDense):
            continue
        operands, output = layer.equation.split("->")
        kernel_labels = operands.split(",")[1]
        if len(output) != 4 or output[2] not in kernel_labels:
            return None
        entry = _kernel_axes(layer)[kernel_labels.index(output[2])]
        return entry if isinstance(entry, str) else None
    return None


def heads_over_the_mesh(x: Any, mesh: Any, split: Split, heads_dim: int = 2) -> Any:
    """`x` (`[batch, ..., heads, ...]`) with its heads over `split.heads`
    and its batch over `split.batch` (whole where that is empty), each
    where its axes divide it; every other dimension left to XLA."""
    return batch_whole(x, mesh, {heads_dim: split.heads}, batch=split.batch)


def input_where_the_kernel_is(layer: Any, x: Any, mesh: Any) -> Any:
    """`x`, the input of `layer` (a `keras.layers.Dense` or `EinsumDense`),
    with its batch whole and each contracted dimension on the mesh axes its
    kernel's is stored on; as it is when the equation is not one this reads
    (an ellipsis)."""
    kernel_axes = _kernel_axes(layer)
    if not isinstance(layer, keras.layers.EinsumDense):
        return batch_whole(x, mesh, {x.ndim - 1: kernel_axes[0]})
    operands, output = layer.equation.split("->")
    x_labels, kernel_labels = operands.split(",")
    if "." in layer.equation or len(x_labels) != x.ndim:
        return x
    return batch_whole(x, mesh, {
        i: kernel_axes[kernel_labels.index(label)]
        for i, label in enumerate(x_labels)
        if i and label in kernel_labels and label not in output
    })


def output_where_the_kernel_is(layer: Any, y: Any, mesh: Any) -> Any:
    """`y`, the output of `layer` (an `EinsumDense`), with its batch whole
    and each dimension it takes from the kernel on the mesh axes the
    kernel's is stored on; as it is when the equation is not one this
    reads.

    For the attention's output projection (module doc): left to XLA, its
    kernel was gathered over the data axis to give each device the whole
    hidden dimension.
    """
    operands, output = layer.equation.split("->")
    kernel_labels = operands.split(",")[1]
    if "." in layer.equation or len(output) != y.ndim:
        return y
    kernel_axes = _kernel_axes(layer)
    return batch_whole(y, mesh, {
        i: kernel_axes[kernel_labels.index(label)] for i, label in enumerate(output) if i and label in kernel_labels
    })


def _kernel_axes(layer: Any) -> tuple:
    kernel = layer._kernel if getattr(layer, "_kernel", None) is not None else layer.kernel
    return tuple(keras.distribution.distribution().get_variable_layout(kernel).axes)


def batch_whole(x: Any, mesh: Any, dims: dict | None = None, batch: tuple[str, ...] = ()) -> Any:
    """`x` with its batch (dimension 0) whole on every device (or over
    `batch`'s axes where they divide it) and each of `dims` (dimension -> a
    layout entry: an axis name or a tuple of them) there where the entry's
    axes divide it; every other dimension left to XLA."""
    spec = [jax.sharding.PartitionSpec.UNCONSTRAINED] * x.ndim
    spec[0] = None
    for dim, entry in {0: batch, **(dims or {})}.items():
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        if names and x.shape[dim] % math.prod(mesh.shape[a] for a in names) == 0:
            spec[dim] = entry
    return jax.lax.with_sharding_constraint(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))


def attention_heads_over_the_mesh(compute_attention: Any, mesh_of: Any) -> Any:
    """`compute_attention` (a KerasHub attention layer's `_compute_attention(
    query, key, value, ...)`, `[batch, tokens, heads, head_dim]` in and out)
    with its query, key, value and output's heads and batch split as
    `HEADS_AXES` says, while a block sets it; `mesh_of()` gives the mesh."""

    @functools.wraps(compute_attention)
    def constrained(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        split = HEADS_AXES.get()
        if split is None or not isinstance(query, jax.core.Tracer) or query.ndim != 4:
            return compute_attention(query, key, value, *args, **kwargs)
        mesh = mesh_of()
        query, key, value = (heads_over_the_mesh(t, mesh, split) for t in (query, key, value))
        output = compute_attention(query, key, value, *args, **kwargs)
        return heads_over_the_mesh(output, mesh, split) if getattr(output, "ndim", None) == 4 else output

    constrained.batch_unconstrained = compute_attention
    return constrained
