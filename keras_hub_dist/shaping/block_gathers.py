"""Each decoder block's weights gathered when the block runs, FSDP-style.

The package's maps store every large weight split over the mesh's data
axis too (FSDP's storage), and `shaping/batch_axis.py` keeps the batch split
over that axis, so XLA gathers a block's weights over it to compute the
block. Where that gather lands is XLA's choice, and left to it the
gathered weights outlive the block:

- `generate` runs every block in two loops, the prompt chunks and the
  decode steps, on the same weights (where the mesh divides the KV heads
  it gathers none, `shaping/stationary_weights.py`, and the barrier below
  keeps in the loops what XLA computes from them: XLA:CPU's f32 copies);
  XLA hoisted each gather, a loop
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

A block's call reads its variables from a scope of their own
(`calling`): its weights and its seed generators' state, which it hands
back advanced (dropout draws new masks each step), and the losses it
adds (an MoE block's load-balancing loss), which it hands to the step's
scope. The fit step's block is traced once, in its Keras call context,
and its `jax.custom_vjp` evaluates that program (`traced_once`): rules
traced later, outside the context, ran the block with `training` unset,
dropout off.

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

__all__ = [
    "add_losses", "assign_state", "calling", "gathered_again_in_backward", "keeping_losses", "plus_zero",
    "read_after_the_input", "traced_once", "traced_variables", "zero_after",
]


def read_after_the_input(block: Any, call: Any, args: tuple, kwargs: dict) -> Any:
    """`call(*args, **kwargs)` (a block's call in `generate`, on a mesh
    whose data axis is over 1) with the block's weights read through an
    optimization barrier together with its input `args[0]`; as it is when
    the weights' values are not traced.

    Example: `read_after_the_input(block, block.call, (x,), dict(cache=c))`.
    """
    found = traced_variables(block)
    if found is None:
        return call(*args, **kwargs)
    variables, values = found
    values, inputs = jax.lax.optimization_barrier((values, args[0]))
    return calling(variables, values, call, inputs, *args[1:], **kwargs)


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
    found = traced_variables(block)
    if found is None:
        return call(*args, **kwargs)
    variables, values = found
    distribution = keras.distribution.distribution()
    # Frozen: non-trainable weights (LoRA's base kernels) and other state
    # (dropout's seeds, handed back updated as the call's second output).
    trainable = [i for i, variable in enumerate(variables) if variable.trainable]
    frozen = [i for i, variable in enumerate(variables) if not variable.trainable]
    layouts = [distribution.get_variable_layout(variables[i]).backend_layout for i in trainable]

    def block_of(trained: list, kept: list, inputs: Any) -> tuple[Any, dict]:
        mapped = [None] * len(variables)
        for i, value in [*zip(trainable, trained), *zip(frozen, kept)]:
            mapped[i] = value
        return calling(variables, mapped, call, inputs, *args[1:], returning_state=True, **kwargs)

    trained, kept = [values[i] for i in trainable], [values[i] for i in frozen]
    # The other arguments' arrays (masks, positions) are among `consts`;
    # what the call adds with `add_loss` is an output, differentiated too.
    added = []
    evaluate, consts = traced_once(keeping_losses(block_of, added), trained, kept, args[0])

    @jax.custom_vjp
    def run(consts, trained, kept, inputs):
        return evaluate(consts, trained, kept, inputs)

    def forward(consts, trained, kept, inputs):
        output, pullback, state = jax.vjp(evaluate, consts, trained, kept, inputs, has_aux=True)
        weight_ids = {id(value) for value in [*trained, *kept]}
        is_weight = tuple(id(leaf) in weight_ids for leaf in jax.tree_util.tree_leaves(pullback))
        return (output, state), (pullback, is_weight)

    def backward(saved, cotangents):
        pullback, is_weight = saved
        cotangent = cotangents[0]  # the state's (integer seeds) is float0
        residuals, residual_tree = jax.tree_util.tree_flatten(pullback)
        after = zero_after(jax.tree_util.tree_leaves(cotangent)[0])
        residuals = [plus_zero(r, after) if weight else r for r, weight in zip(residuals, is_weight)]
        pulled = jax.tree_util.tree_unflatten(residual_tree, residuals)(cotangent)
        const_grads, grads, kept_grads, input_grad = pulled
        grads = [jax.lax.with_sharding_constraint(g, layout) for g, layout in zip(grads, layouts)]
        if grads:
            input_grad = plus_zero(input_grad, sum(zero_after(g) for g in grads))
        return const_grads, grads, kept_grads, input_grad

    run.defvjp(forward, backward)
    (output, losses), state = run(consts, trained, kept, args[0])
    assign_state(variables, state)
    add_losses(block, losses, added)
    return output


def keeping_losses(function: Any, added: list) -> Any:
    """`function` (returning `calling`'s `((output, losses), state)`) that
    also keeps, in `added`, the losses it returned as traced: what
    `add_losses` makes the layers inside forget."""

    def keeping(*args: Any) -> Any:
        (output, losses), state = function(*args)
        added.extend(losses)
        return (output, losses), state

    return keeping


def traced_once(function: Any, *args: Any) -> tuple[Any, list]:
    """`function(*args)` traced now, as `(evaluate, consts)`:
    `evaluate(consts, *args)` computes what it computed (same pytrees), the
    program read back, not the Python function called again.

    A `jax.custom_vjp`'s rules are traced when the step is differentiated,
    possibly outside the Keras call context in which Keras tells the layers
    inside `training` (a block inside a rematerialized one: dropout was off
    in its backward pass); and they may not close over traced values, so
    what the program reads besides `args` (`consts`) becomes an input. (Not
    `jax.closure_convert`: its cache keeps every call's constants.)

    Example: `evaluate, consts = traced_once(layer.call, x); y =
    evaluate(consts, x)`.
    """
    program, shapes = jax.make_jaxpr(function, return_shape=True)(*args)
    outputs = jax.tree_util.tree_structure(shapes)

    def evaluate(consts: list, *args: Any) -> Any:
        flat = jax.core.eval_jaxpr(program.jaxpr, consts, *jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(outputs, flat)

    return evaluate, list(program.consts)


def traced_variables(layer: Any) -> tuple[list, list] | None:
    """`(variables, their values)` when every value is traced (a step being
    traced reads them), else None: `layer`'s weights, then its other state
    (its seed generators', which `layer.weights` leaves out)."""
    weights = list(layer.weights)
    known = {id(weight) for weight in weights}
    variables = weights + [variable for variable in layer.variables if id(variable) not in known]
    values = [variable.value for variable in variables]
    if not values or not all(isinstance(value, jax.core.Tracer) for value in values):
        return None
    return variables, values


def calling(
    variables: list, values: list, call: Any, *args: Any, returning_state: bool = False, owner: Any = None,
    **kwargs: Any,
) -> Any:
    """`call(*args, **kwargs)` with `variables` reading `values`: every
    variable the call reads must be among them, for one the scope leaves
    out reads its initializer, not the step's value. What it assigns
    (dropout's seeds) is assigned in the caller's scope, and what it adds
    with `add_loss` (an MoE block's load-balancing loss in a train step) is
    added there by `owner` (a layer); or with `returning_state=True` both
    are returned, `((output, losses), {index in variables: value})`, for
    `assign_state` and `add_losses` outside a `jax.custom_vjp`. (A scope of
    its own that did not collect the losses dropped them: a Qwen 3 MoE
    train step on (2, 4) left out its load-balancing loss.)

    Example: `calling(*traced_variables(layer), layer.call, x, owner=layer)`.
    """
    with keras.StatelessScope(
        state_mapping=list(zip(variables, values)), initialize_variables=False, collect_losses=True
    ) as scope:
        read = [scope.get_current_value(variable) for variable in variables]
        output = call(*args, **kwargs)
    state = {}
    for i, (variable, value) in enumerate(zip(variables, read)):
        current = scope.get_current_value(variable)
        if current is not value:
            state[i] = current
    losses = list(scope.losses)
    if returning_state:
        return (output, losses), state
    assign_state(variables, state)
    add_losses(owner, losses, losses)
    return output


def add_losses(layer: Any, losses: list, added: list) -> None:
    """Adds `losses` (the values, in the caller's scope, of what a call of
    `layer` added in a scope of its own: `added`) to the caller's scope as
    `layer`'s. The layers inside forget `added`: Keras attributes a loss to
    a layer by its id, and a freed tracer's id may be a later loss's."""
    if not added:
        return
    forgotten = {id(loss) for loss in added}
    for sublayer in layer._flatten_layers(include_self=True, recursive=True):
        sublayer._loss_ids.difference_update(forgotten)
    for loss in losses:
        layer.add_loss(loss)


def assign_state(variables: list, state: dict) -> None:
    """Assigns `state` (from `calling(..., returning_state=True)`) to the
    variables it belongs to, in the scope of the step being traced."""
    for i, value in state.items():
        variables[i].assign(value)


def zero_after(x: Any) -> Any:
    """A float32 zero computed from `x`'s first element (0 where that is not
    finite too): XLA neither folds it nor lets it exist before `x`."""
    first = jnp.ravel(x)[0].astype(jnp.float32)
    return jnp.where(jnp.isfinite(first), first, 0.0) * 0.0


def plus_zero(x: Any, zero: Any) -> Any:
    """`x + zero` (a `zero_after`) for a float `x`; any other `x` as it is."""
    return x + zero.astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
