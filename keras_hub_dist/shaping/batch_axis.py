"""The batch on the batch axis between decoder blocks, in attention and in
Gemma 4's expert bank, the feed-forward's input whole in `generate`, and
each block's weights gathered when it runs.

Under `keras.distribution.ModelParallel`, Keras splits a batch over the
mesh's data axis, and the package's maps (like KerasHub's) also split every
large weight over that axis (storage sharding). Between the two, XLA's
sharding propagation is free to gather the batch instead of the weights,
and on a mesh whose data axis is over 1 it does: a fit step then computes
each block on every batch row, on every device. `keep_batch_split` wraps
each decoder block's call so that its hidden states leave the block with
their batch dimension on the data axis (every other dimension left to XLA):
XLA then gathers each block's weights for the step (as FSDP does) and keeps
the activations split over the batch.

Measured with XLA's compiled memory analysis (XLA:CPU, 8 simulated devices,
bf16, Adam, full fine-tune, per device; `python benchmarks/bench_plan.py
--batch-axis`, BENCHMARKS.md), temporaries of 1 layer / each added layer
(2 layers - 1 layer), left to XLA -> kept split:

| fit on (2, 4) | 8 x 512 | 8 x 2048 |
|---|---|---|
| Llama-3-8B width | 2,732 / 889 -> 2,508 / 430 MiB | 11,707 / 6,092 -> 5,773 / 2,057 MiB |
| Gemma-7B width | 3,906 / 664 -> 3,510 / 595 MiB | 11,815 / 2,249 -> 8,256 / 1,972 MiB |

(On (1, 8): Llama 1,624 / 402 and 5,417 / 2,065 MiB, Gemma 2,705 / 508 and
8,033 / 2,022 MiB.) What a block held on (2, 4) beyond (1, 8)'s at 8 x 512
was FSDP's: its weights gathered, kept from the forward pass to the
backward pass, and its gradients summed over the local half of the batch
at the size of their model-axis shards until one all-reduce at the end of
the step (`shaping/block_gathers.py` now gathers them again in the backward
pass and reduces them per block).

On a mesh that is all data axis, (8, 1), every weight is gathered whole, and
keeping the batch split pays only when the activations outweigh it. Measured
(same command, temporaries 1 layer / each added layer, left to XLA -> kept
split): Llama 8 x 512 7,503 / 1,202 -> 5,949 / 1,654 MiB (worse from the
fifth layer on), 8 x 2048 21,798 / 3,357 -> 8,459 / 2,585 MiB; Gemma
8 x 512 12,760 / 1,348 -> 9,018 / 1,639 MiB, 8 x 2048 38,102 / 2,608 ->
14,081 / 2,620 MiB (better at full depth). There a block's output is kept
split only when it holds at least 1/8 of the block's parameter count: the
losing cases are 0.077 (Llama 8 x 512), 0.045 (Gemma 8 x 512) and 0.062
(`tests/plan/test_layouts.py`'s wide Gemma at 8 x 128), the winning ones
0.31, 0.18 and 0.25 (that Gemma at 8 x 512): a rule read off six measured
points, not a cost model.

Only traced calls whose output is one array are constrained (a call with a
cache returns a tuple: `generate` lays its own out, `shard_generate`), only
under a distribution whose data axis is over 1 and divides the batch.

`generate` where a mesh axis divides the KV heads
(`shaping/stationary_weights.py`, set by `shaping/generate.py`): the block
computes with its weights where they are stored, the heads over the axes
that divide them and the batch whole outside the attention; the rules
below that keep the batch on the data axis in `generate`, and the gathers
of `shaping/block_gathers.py`, are for the other models (one KV head: Gemma
2B; another cache: Gemma 3 / 4, Qwen 3.5).

Attention with grouped KV heads (fewer KV heads than query heads: Llama 3,
Qwen 2.5 / 3, Mistral, Mixtral, gpt-oss). The Llama-convention maps put the
q / k / v kernels' heads dimension on the data axis; in `generate` on
(2, 4), XLA then splits each prompt chunk's scores over heads there and
holds every batch row on every device. On a mesh with both axes over 1 the
query, key and value projections' outputs `[batch, tokens, heads,
head_dim]` keep the batch on the data axis and the heads on the model axis
(each where it divides). Measured (XLA temporaries per device, bf16,
KerasHub's top-k sampler, prompt chunks of 512; unconstrained -> kept):
Llama-3-8B width, 1 layer, 8 x 2048 on (2, 4): 885 -> 713 MiB ((1, 8): 741);
2 layers, 8 x 8192: 7,477 -> 2,717 MiB ((1, 8): 2,473); Qwen-3-8B 7,546 ->
2,762 MiB; Qwen 2.5-7B, 8 x 2048: 2,224 -> 1,367 MiB. A fit step's figures
did not change (Llama-3-8B 8 x 512 and 8 x 2048, Qwen-3-8B 8 x 2048). With
as many KV heads as query heads it made `generate` worse (Llama-2-7B width
1,015 -> 1,111 MiB; tiny widths 1.01x-1.10x) and is not applied; Gemma's
map splits heads on the model axis already (1,531 MiB either way).

The feed-forward in `generate`. With the batch split over the data axis,
XLA gathers each feed-forward kernel over that axis for every prompt chunk
and decode step. With grouped KV heads, on a mesh with both axes over 1,
the inputs of the gate and up projections (`feedforward_gate_dense`,
`feedforward_intermediate_dense`) hold every batch row while the block runs
with a KV cache (a chunk's `[8, 512, hidden]` is smaller than the kernels'
gathers). A fit step is left as it was (it got 1.03x worse with it).
Measured (`plan_memory`, 2 layers, total per device, (2, 4) before ->
after, (1, 8)): generate 8 x 1024 Llama-3-8B 1,532 -> 1,404 MiB (1,292),
Qwen-3-8B 1,611 -> 1,491 (1,395), Mistral-7B 968 -> 840 (728); 8 x 8192
Llama-3-8B 3,072 -> 2,928 (2,828). On MoE experts it was mixed (Mixtral
4,372 -> 4,173, gpt-oss 3,558 -> 3,518, Qwen-3-30B-A3B 2,531 -> 2,927
MiB): not applied there.

Gemma 4's expert bank computes every expert on the flattened tokens
`[tokens, hidden]` with routing weights `[tokens, experts]`; on (2, 4) XLA
gathered the tokens and held `[experts / 4, ffn, all tokens]`. Both inputs
keep the tokens on the data axis. Gemma 4 26B-A4B width, 2 layers, total
per device, before -> tokens on the data axis ((1, 8)): generate 8 x 1024
5,256 -> 4,601 MiB (3,242); Adam fit 8 x 512 11,778 -> 10,814 MiB (9,792).
Since then the maps store the bank with its experts over both axes
(`plan.family_rules`): generate 2,550, fit 9,451 MiB.

Each block's weights gathered when it runs (`shaping/block_gathers.py`): in
`generate` a block reads its weights after its input, so their gathers
stay inside the prompt and decode loops; in a fit step, where the batch
is kept split, a block's backward pass gathers its weights again and
reduces its gradients itself.

Example:

```python
import keras_hub
from keras_hub_dist.shaping.batch_axis import keep_batch_split
from keras_hub_dist.plan.build import build_without_values

backbone, _ = build_without_values(
    keras_hub.models.LlamaBackbone,
    dict(vocabulary_size=256, num_layers=2, num_query_heads=4,
         num_key_value_heads=2, hidden_dim=32, intermediate_dim=64),
)
keep_batch_split(backbone)   # shaping.apply.build_shaped does it by default
```
"""

from __future__ import annotations

import contextvars
import functools
import math
from typing import Any

import jax
import keras

from keras_hub_dist.shaping import block_gathers, stationary_weights

__all__ = ["constrain_where_divisible", "keep_batch_split"]


def keep_batch_split(model: Any) -> None:
    """Constrains each decoder block's output batch to the data axis, and
    with grouped KV heads the q / k / v projections' batch and heads, and in
    `generate` the feed-forward's input batch to every device; Gemma 4's
    expert bank's tokens to the data axis; each block's weights gathered
    when it runs (`shaping.block_gathers`); in `generate` where a mesh axis
    divides the KV heads, each projection's input (and the attention's
    output projection's output) laid out as its kernel is stored and the
    attention's heads (and batch) over the mesh axes
    (`shaping.stationary_weights`); in `generate`, the keys and values that
    Gemma 4's KV-shared layers read with their head dimension on the model
    axis where it does not divide their heads.

    Wraps the call of every block in `model`'s (or its backbone's)
    `transformer_layers`, of the `Dense` and `EinsumDense` layers and
    Gemma 4's expert bank (`moe_expert_bank`) inside them, and their
    attention layers' `_compute_attention`; calling it again changes
    nothing. A model without decoder blocks is left as it is.
    """
    backbone = getattr(model, "backbone", model)
    grouped = getattr(backbone, "num_key_value_heads", 0) < getattr(backbone, "num_query_heads", 0)
    for block in getattr(backbone, "transformer_layers", None) or []:
        if not hasattr(block.call, "batch_unconstrained"):
            block.call = _block_call(block)
        for layer in block._flatten_layers(include_self=False, recursive=True):
            attention = getattr(layer, "_compute_attention", None)
            if callable(attention) and not hasattr(attention, "batch_unconstrained"):
                layer._compute_attention = stationary_weights.attention_heads_over_the_mesh(attention, _mesh)
                if getattr(layer, "is_kv_shared_layer", False):
                    layer._compute_attention = _shared_kv_head_dim_split(layer._compute_attention)
            if hasattr(layer.call, "batch_unconstrained"):
                continue
            if layer.name in _TOKEN_SPLIT_EXPERTS:
                layer.call = _wrapped(layer.call, inputs=_tokens_on_data_axis)
            elif grouped and layer.name in _PROJECTIONS:
                layer.call = _wrapped(layer.call, inputs=_stationary_input(layer), output=_heads_on_model_axis)
            elif grouped and layer.name in _FEED_FORWARD_INPUTS:
                layer.call = _wrapped(layer.call, inputs=_stationary_input(layer, _first_gathered_with_a_cache))
            elif isinstance(layer, keras.layers.EinsumDense) and layer.name == "attention_output":
                layer.call = _wrapped(layer.call, inputs=_stationary_input(layer), output=_stationary_output(layer))
            elif isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense)):
                layer.call = _wrapped(layer.call, inputs=_stationary_input(layer))


# The attention projections whose `[batch, tokens, heads, head_dim]` outputs
# keep the batch on the data axis and the heads on the model axis.
_PROJECTIONS = ("query", "key", "value")

# The dense feed-forward layers reading a block's hidden states (Llama
# convention): in `generate` their input keeps every batch row.
_FEED_FORWARD_INPUTS = ("feedforward_gate_dense", "feedforward_intermediate_dense")

# Expert banks called on flattened tokens `[tokens, hidden]` with their
# routing weights `[tokens, experts]` (Gemma 4's): both inputs keep the
# tokens on the data axis.
_TOKEN_SPLIT_EXPERTS = ("moe_expert_bank",)

# On a mesh that is all data axis, the batch is kept split only when a
# block's output holds at least this fraction of its parameter count.
_ALL_DATA_AXIS_MIN_RATIO = 0.125

# Whether the decoder block now tracing was called with a KV cache
# (`generate`'s `call_with_cache`), set by the block's own wrapper.
_WITH_A_CACHE = contextvars.ContextVar("keras_hub_dist_block_with_a_cache", default=False)


def _wrapped(call: Any, *, inputs: Any = None, output: Any = None) -> Any:
    """`call` with `inputs` applied to its positional arguments (a tuple)
    and `output` to its result, each when given."""

    @functools.wraps(call)
    def constrained_call(*args: Any, **kwargs: Any) -> Any:
        result = call(*(args if inputs is None else inputs(args)), **kwargs)
        return result if output is None else output(result)

    constrained_call.batch_unconstrained = call
    return constrained_call


def _block_call(block: Any) -> Any:
    """`block.call` with its output's batch on the data axis, telling the
    layers inside whether it runs with a KV cache."""
    call = block.call

    @functools.wraps(call)
    def constrained_call(*args: Any, **kwargs: Any) -> Any:
        with_a_cache = any(v is not None for k, v in kwargs.items() if k.endswith("cache"))
        hidden = args[0] if args and getattr(args[0], "ndim", None) == 3 else None
        # Set by `generate` (`shaping/generate.py`) where the mesh divides the
        # KV heads: the block computes with its weights where they are.
        axes = stationary_weights.HEADS_AXES.get() if with_a_cache else None
        tokens = _WITH_A_CACHE.set(with_a_cache), stationary_weights.HEADS_AXES.set(axes)
        try:
            if with_a_cache and _traced_on_a_data_axis(hidden, (3,)):
                # Gathered or not (weight-stationary), what is computed from
                # the weights (their gathers, XLA:CPU's f32 copies) is
                # computed when the block runs, not hoisted out of the loops.
                output = block_gathers.read_after_the_input(block, call, args, kwargs)
            elif not with_a_cache and _batch_split_mesh(hidden, block):
                output = block_gathers.gathered_again_in_backward(block, call, args, kwargs)
            else:  # no data axis, or XLA gathers the batch, not the weights
                output = call(*args, **kwargs)
        finally:
            _WITH_A_CACHE.reset(tokens[0])
            stationary_weights.HEADS_AXES.reset(tokens[1])
        return _batch_on_data_axis(output, block)

    constrained_call.batch_unconstrained = call
    return constrained_call


def _stationary_input(layer: Any, otherwise: Any = None) -> Any:
    """An `inputs` for `_wrapped`: while a block computes with its weights
    where they are stored (`stationary_weights.HEADS_AXES`), the first
    argument laid out as `layer`'s kernel is; else `otherwise(args)`."""

    def inputs(args: tuple) -> tuple:
        if args and isinstance(args[0], jax.core.Tracer) and stationary_weights.HEADS_AXES.get() is not None:
            return (stationary_weights.input_where_the_kernel_is(layer, args[0], _mesh()), *args[1:])
        return args if otherwise is None else otherwise(args)

    return inputs


def _stationary_output(layer: Any) -> Any:
    """An `output` for `_wrapped`: while a block computes with its weights
    where they are stored, `layer`'s output laid out as its kernel is."""

    def output(y: Any) -> Any:
        if isinstance(y, jax.core.Tracer) and stationary_weights.HEADS_AXES.get() is not None:
            return stationary_weights.output_where_the_kernel_is(layer, y, _mesh())
        return y

    return output


def _mesh() -> Any:
    return keras.distribution.distribution().device_mesh.backend_mesh


def _first_gathered_with_a_cache(args: tuple) -> tuple:
    """`args` with the first, `[batch, tokens, hidden]`, holding every batch
    row, when its block runs with a KV cache on a (data, model) mesh with
    both axes over 1."""
    found = _traced_on_a_2d_mesh(args[0], (3,)) if args and _WITH_A_CACHE.get() else None
    if found is None:
        return args
    return (stationary_weights.batch_whole(args[0], found[0]), *args[1:])


def _tokens_on_data_axis(args: tuple) -> tuple:
    """`args` with each rank-2 array, `[tokens, ...]`, keeping its tokens on
    the data axis, on a (data, model) mesh with both axes over 1."""

    def constrained(x: Any) -> Any:
        found = _traced_on_a_2d_mesh(x, (2,))
        if found is None or stationary_weights.HEADS_AXES.get() is not None:
            return x
        return constrain_where_divisible(x, found[0], {0: found[1]})

    return tuple(map(constrained, args))


def _traced_on_a_2d_mesh(x: Any, ndim: tuple[int, ...]) -> tuple[Any, str, str] | None:
    """`(mesh, data axis, model axis)` when `x` is traced, of a rank in
    `ndim`, on a (data, model) mesh with both axes over 1; else None."""
    found = _traced_on_a_mesh(x, ndim)
    if found is None:
        return None
    mesh, data = found
    others = [axis for axis in mesh.axis_names if axis != data]
    if mesh.shape.get(data, 1) == 1 or len(others) != 1 or mesh.shape[others[0]] == 1:
        return None
    return mesh, data, others[0]


def _traced_on_a_mesh(output: Any, ndim: tuple[int, ...]) -> tuple[Any, str] | None:
    """`(mesh, data axis)` when `output` is traced, of a rank in `ndim`,
    under a distribution with a data axis; else None (left as it is)."""
    if not isinstance(output, jax.core.Tracer) or output.ndim not in ndim:
        return None
    distribution = keras.distribution.distribution()
    data = getattr(distribution, "batch_dim_name", None)
    return None if data is None else (distribution.device_mesh.backend_mesh, data)


def constrain_where_divisible(x: Any, mesh: Any, dims: dict[int, str | None]) -> Any:
    """`x` with each of `dims` (dimension -> mesh axis) constrained to its
    axis where the mesh has that axis and it divides the dimension; every
    other dimension left to XLA (`x` as it is when none is constrained).

    Example: `constrain_where_divisible(q, mesh, {0: "batch", 2: "model"})`
    inside a jitted function keeps `q`'s batch and heads split.
    """
    unconstrained = jax.sharding.PartitionSpec.UNCONSTRAINED
    spec = [unconstrained] * x.ndim
    for dim, axis in dims.items():
        if axis in mesh.shape and x.shape[dim] % mesh.shape[axis] == 0:
            spec[dim] = axis
    if all(s is unconstrained for s in spec):
        return x
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
    return jax.lax.with_sharding_constraint(x, sharding)


def _shared_kv_head_dim_split(compute_attention: Any) -> Any:
    """`compute_attention` of a layer that reads another layer's keys and
    values (Gemma 4's KV-shared layers, every layer of its drafters) with,
    in `generate` on a (data, model) mesh with both axes over 1 whose model
    axis does not divide the KV heads, the key's and value's batch on the
    data axis and head dimension on the model axis: the stacked cache's
    layout (`shaping/generate.py`).

    Gemma 4 slices a layer's keys and values out of a cache as wide as its
    widest head (`[..., :head_dim]`); that slice spans some of the model
    axis's shards only, and XLA gathered its head dimension whole.
    Measured (`benchmarks/sweep_plans.py --mesh 2x4 --jobs generate`, 8 x
    1024, 2 layers, total per device): the 4B drafter (2 KV heads) bf16
    134 -> 126 MiB ((1, 8): 124), f32 73 -> 66; the 2B drafter f32 57 ->
    52. Applied to every layer's query, key and value instead, it made
    Gemma 3 270M 295 -> 405 MiB and Gemma 2B 941 -> 988.
    """

    @functools.wraps(compute_attention)
    def constrained(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        found = None
        if _WITH_A_CACHE.get() and stationary_weights.HEADS_AXES.get() is None:
            found = _traced_on_a_2d_mesh(key, (4,))
        if found is not None and key.shape[2] % found[0].shape[found[2]]:
            mesh, data, model = found
            key, value = (constrain_where_divisible(t, mesh, {0: data, 3: model}) for t in (key, value))
        return compute_attention(query, key, value, *args, **kwargs)

    constrained.batch_unconstrained = compute_attention.batch_unconstrained
    return constrained


def _heads_on_model_axis(output: Any) -> Any:
    split = stationary_weights.HEADS_AXES.get()
    if split is not None and isinstance(output, jax.core.Tracer) and output.ndim == 4:
        return stationary_weights.heads_over_the_mesh(output, _mesh(), split)
    found = _traced_on_a_2d_mesh(output, (4,))
    if found is None:
        return output  # only on a (data, model) mesh with both axes over 1
    mesh, data, model = found
    # Few KV heads that the model axis does not divide: XLA's choice.
    return constrain_where_divisible(output, mesh, {0: data, 2: model})


def _batch_on_data_axis(output: Any, block: Any) -> Any:
    found = _batch_split_mesh(output, block)
    return output if found is None else constrain_where_divisible(output, found[0], {0: found[1]})


def _batch_split_mesh(x: Any, block: Any) -> tuple[Any, str] | None:
    """`(mesh, data axis)` when `block`'s hidden states `x` (its input or
    its output) keep their batch on the data axis; else None."""
    found = _traced_on_a_data_axis(x, range(2, 8))
    if found is None or x.shape[0] % found[0].shape[found[1]]:
        return None
    mesh, data = found
    # (8, 1), short sequences: gathering whole weights costs more.
    if mesh.shape[data] == mesh.size and x.size < _ALL_DATA_AXIS_MIN_RATIO * _parameter_count(block):
        return None
    return found


def _traced_on_a_data_axis(x: Any, ndim: Any) -> tuple[Any, str] | None:
    """`(mesh, data axis)` when `x` is traced, of a rank in `ndim`, under a
    distribution whose data axis is over 1; else None."""
    found = _traced_on_a_mesh(x, ndim)
    return found if found is not None and found[0].shape.get(found[1], 1) > 1 else None


def _parameter_count(block: Any) -> int:
    return sum(math.prod(weight.shape) for weight in block.weights)
