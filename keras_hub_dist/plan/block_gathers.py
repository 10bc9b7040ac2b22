"""Each decoder block's weights gathered when the block runs, FSDP-style.

The package's maps store every large weight split over the mesh's data
axis too (FSDP's storage), and `plan/batch_axis.py` keeps the batch split
over that axis, so XLA gathers a block's weights over it to compute the
block. Where that gather lands is XLA's choice, and left to it the
gathered weights outlive the block:

- `generate` runs every block in two loops, the prompt chunks and the
  decode steps, on the same weights; XLA hoisted each gather, a loop
  constant, out of both loops, so every block's gathered weights lived for
  the whole call. `read_after_the_input` passes a block's weights through
  an optimization barrier together with its input: each gather depends on
  the step and happens when the block runs.
- A train step's backward pass reads the same weights as the forward
  pass; XLA merged the two gathers (one gathered copy of every block kept
  from the forward pass to the backward pass), and summed every block's
  weight gradients in one all-reduce at the end of the step (each
  gradient kept whole over the data axis until then).
  `gathered_again_in_backward` runs a block with its backward pass reading
  its weights anew (after the output's cotangent exists: FSDP's reshard
  after the forward pass), reducing its weight gradients to their stored
  layout there, and handing the input's cotangent back only once they are
  reduced.

The dependencies in the backward pass are arithmetic (a weight plus 0 x a
cotangent element): XLA's CPU compiler drops optimization barriers before
it schedules, and would merge the gathers again. They cost an elementwise
pass over each block's weights per step, and the reduction of a block's
gradients is no longer overlapped with the previous block's backward pass.

Measured (XLA:CPU, 8 simulated devices, bf16, `plan_memory`, total per
device; (2, 4) before -> after, (1, 8)): Llama-3-8B width `generate`
8 x 1024, 2 layers 1,404 -> 1,236 MiB (1,292), 32 layers 8,081 -> 7,125
(6,384); Adam fit 8 x 512, 2 layers 4,002 -> 3,416 (3,090), 8 layers
7,728 -> 6,028 (6,439); Gemma 2 9B width 8 layers 9,160 -> 8,304 (8,420),
but 2 layers 5,191 -> 5,630 (4,580): the added gathers and reductions
cost a step more than one block's share, and less than each added block
saved. More in BENCHMARKS.md.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import keras

__all__ = ["gathered_again_in_backward", "read_after_the_input", "reading", "traced_weights"]


def read_after_the_input(block: Any, call: Any, args: tuple, kwargs: dict) -> Any:
    """`call(*args, **kwargs)` (a block's call in `generate`, on a mesh
    whose data axis is over 1) with the block's weights read through an
    optimization barrier together with its input `args[0]`; as it is when
    the weights' values are not traced.

    Example: `read_after_the_input(block, block.call, (x,), dict(cache=c))`.
    """
    found = traced_weights(block)
    if found is None:
        return call(*args, **kwargs)
    weights, values = found
    values, inputs = jax.lax.optimization_barrier((values, args[0]))
    with reading(weights, values):
        return call(inputs, *args[1:], **kwargs)


def gathered_again_in_backward(block: Any, call: Any, args: tuple, kwargs: dict) -> Any:
    """`call(*args, **kwargs)` (a block's call in a train step, its batch
    `args[0]` kept split over a data axis over 1) whose backward pass reads
    the block's weights after its output's cotangent exists, reduces the
    trainable weights' gradients to their stored layouts and returns the
    input's cotangent after them; as it is when the weights' values are not
    traced. Values and gradients are those of the call itself (the added
    terms are zeros).

    Example: `gathered_again_in_backward(block, block.call, (x,), {})`.
    """
    found = traced_weights(block)
    if found is None:
        return call(*args, **kwargs)
    weights, values = found
    distribution = keras.distribution.distribution()
    trainable = [i for i, weight in enumerate(weights) if weight.trainable]
    frozen = [i for i, weight in enumerate(weights) if not weight.trainable]
    layouts = [distribution.get_variable_layout(weights[i]).backend_layout for i in trainable]

    # The other arguments' arrays (masks, positions) become inputs: a
    # `jax.custom_vjp` function may not close over traced values. (Not
    # `jax.closure_convert`: its cache keeps every call's constants.)
    leaves, treedef = jax.tree_util.tree_flatten((args[1:], kwargs))
    arrays = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

    def block_of(trained: list, kept: list, inputs: Any, rest: list) -> Any:
        mapped, filled = [None] * len(weights), list(leaves)
        for i, value in [*zip(trainable, trained), *zip(frozen, kept)]:
            mapped[i] = value
        for i, value in zip(arrays, rest):
            filled[i] = value
        rest_args, rest_kwargs = jax.tree_util.tree_unflatten(treedef, filled)
        with reading(weights, mapped):
            return call(inputs, *rest_args, **rest_kwargs)

    trained, kept = [values[i] for i in trainable], [values[i] for i in frozen]

    @jax.custom_vjp
    def run(trained, kept, inputs, rest):
        return block_of(trained, kept, inputs, rest)

    def forward(trained, kept, inputs, rest):
        output, pullback = jax.vjp(block_of, trained, kept, inputs, rest)
        weight_ids = {id(value) for value in [*trained, *kept]}
        return output, (pullback, tuple(id(leaf) in weight_ids for leaf in jax.tree_util.tree_leaves(pullback)))

    def backward(saved, cotangent):
        pullback, is_weight = saved
        residuals, residual_tree = jax.tree_util.tree_flatten(pullback)
        after = _zero_after(jax.tree_util.tree_leaves(cotangent)[0])
        residuals = [_plus(r, after) if weight else r for r, weight in zip(residuals, is_weight)]
        grads, kept_grads, input_grad, rest_grads = jax.tree_util.tree_unflatten(residual_tree, residuals)(cotangent)
        grads = [jax.lax.with_sharding_constraint(g, layout) for g, layout in zip(grads, layouts)]
        if grads:
            input_grad = _plus(input_grad, sum(_zero_after(g) for g in grads))
        return grads, kept_grads, input_grad, rest_grads

    run.defvjp(forward, backward)
    return run(trained, kept, args[0], [leaves[i] for i in arrays])


def traced_weights(layer: Any) -> tuple[list, list] | None:
    """`(layer.weights, their values)` when every value is traced (a step
    being traced reads them); else None."""
    weights = list(layer.weights)
    values = [weight.value for weight in weights]
    if not values or not all(isinstance(value, jax.core.Tracer) for value in values):
        return None
    return weights, values


def reading(weights: list, values: list) -> keras.StatelessScope:
    """A scope in which `weights` read `values`: every weight a call reads
    must be among them, for a variable the scope leaves out reads its
    initializer, not the step's value."""
    return keras.StatelessScope(state_mapping=list(zip(weights, values)), initialize_variables=False)


def _zero_after(x: Any) -> Any:
    """A float32 zero computed from `x`'s first element (0 where that is not
    finite too): XLA neither folds it nor lets it exist before `x`."""
    first = jnp.ravel(x)[0].astype(jnp.float32)
    return jnp.where(jnp.isfinite(first), first, 0.0) * 0.0


def _plus(x: Any, zero: Any) -> Any:
    return x + zero.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
