"""`remat=`: rematerialization of a causal LM's decoder blocks in training.

Rematerialization (gradient checkpointing) keeps fewer of the forward pass's
activations for the backward pass and recomputes the rest there. `remat=`
applies it to the backbone's decoder blocks (`backbone.transformer_layers`),
never to the token embedding, the final norm or the task's head:

- `None`: off (Keras's default);
- `"full"`: each decoder block's call is rematerialized as a whole
  (MaxText's per-layer remat): the backward pass keeps each block's input
  and recomputes the block from it;
- `"larger_than"`, `"list_of_layers"`: Keras's rule (`keras.RematScope`) on
  the decoder blocks and the layers inside them (the outermost layer whose
  output holds more than the threshold's elements, the layers named);
- `"activations"`: Keras's rule on the layers inside the decoder blocks
  (each layer's `activation` function);
- a `keras.RematScope`: its mode (and threshold, layer names) as above.

Keras's `RematScope` entered around a whole build also rematerializes the
embedding, and `jax.checkpoint` then turns `ReversibleEmbedding`'s
`reverse=True` into a tracer: a causal LM's `fit` raises
`TracerBoolConversionError` (Keras 3.15). A block checkpointed here keeps its
non-array arguments (Python flags, indices, `None`) static, and is
recomputed in the backward pass only once the cotangent of its output exists
(`_recomputed_after_cotangent`): XLA:CPU merges `jax.checkpoint`'s
recomputation into the forward pass. Measured: docs/plan.md#rematerialization.

Example:

```python
import keras_hub
from keras_hub_dist.shaping.apply import build_shaped

backbone, _ = build_shaped(
    keras_hub.models.GemmaBackbone,
    dict(vocabulary_size=256, num_layers=2, num_query_heads=2,
         num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8),
    remat="full",
)
```
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import keras
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.shaping import block_gathers

__all__ = ["REMAT_MODES", "apply_remat", "decoder_blocks", "remat_scope"]

# `keras.RematScope`'s modes (Keras 3.15); `None` is "off".
REMAT_MODES = ("full", "activations", "larger_than", "list_of_layers")


def remat_scope(remat: Any) -> keras.RematScope | None:
    """The `keras.RematScope` that `remat=` asks for, checked; `None`: off.

    Args:
        remat: `None` (no rematerialization), one of `REMAT_MODES` (a scope
            with Keras's defaults for that mode), or a `keras.RematScope`
            (e.g. `keras.RematScope("larger_than", output_size_threshold=
            2**20)`), used as it is.

    Raises:
        ValueError: Anything else (before any model is built).
    """
    if remat is None or isinstance(remat, keras.RematScope):
        return remat
    if isinstance(remat, str) and remat in REMAT_MODES:
        return keras.RematScope(mode=remat)
    raise ValueError(
        f"Expected remat= to be one of {[None, *REMAT_MODES]} or a "
        f"keras.RematScope. Received: remat={remat!r}."
    )


def decoder_blocks(model: Any) -> list[Any]:
    """The decoder blocks of `model` (a backbone, or a task's backbone)."""
    backbone = getattr(model, "backbone", model)
    blocks = getattr(backbone, "transformer_layers", None)
    if not blocks:
        raise ValueError(
            "Expected a backbone with decoder blocks (`transformer_layers`) "
            f"for remat=. Received: {type(backbone).__name__}."
        )
    return list(blocks)


def checkpointed(layer: Any, call: Any, larger_than: int | None = None) -> Any:
    """`layer`'s `call` rematerialized (`_recomputed_after_cotangent`), its
    array arguments and `layer`'s variables its inputs and every other
    argument (flags, indices, `None`) passed as it is; with `larger_than`,
    only when its outputs hold more elements than that."""

    @functools.wraps(call)
    def remat_call(*args, **kwargs):
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        traced = [i for i, leaf in enumerate(leaves) if isinstance(leaf, (jax.Array, np.ndarray))]

        def layer_call(*values):
            filled = list(leaves)
            for i, value in zip(traced, values):
                filled[i] = value
            inner_args, inner_kwargs = jax.tree_util.tree_unflatten(treedef, filled)
            return call(*inner_args, **inner_kwargs)

        values = [leaves[i] for i in traced]
        if _INSIDE:  # already inside a rematerialized call
            return layer_call(*values)
        if larger_than is not None:
            outputs = jax.eval_shape(layer_call, *values)
            if sum(np.prod(o.shape) for o in jax.tree_util.tree_leaves(outputs)) <= larger_than:
                return layer_call(*values)

        def inside(*values):
            _INSIDE.append(call)
            try:
                return layer_call(*values)
            finally:
                _INSIDE.pop()

        return _recomputed_after_cotangent(layer, inside, values)

    remat_call.unrematerialized = call
    return remat_call


def _recomputed_after_cotangent(layer: Any, function: Any, values: list) -> Any:
    """`function(*values)` (a call of `layer`) whose backward pass recomputes
    it from its inputs, what `jax.checkpoint` does, from inputs that depend
    on the output's cotangent: XLA:CPU drops `jax.checkpoint`'s optimization
    barriers and merges the recomputation with the forward pass (CSE), or
    runs it before the loss, so each block's activations stayed alive (0.66x
    of the temporaries per layer without remat against 0.03x here,
    docs/plan.md).

    The call is traced once, here, in the layer's call context, and the
    recomputation evaluates that program again (`block_gathers.traced_once`);
    the layer's variables are read through `block_gathers.calling`, and
    what the call assigns (dropout's seeds) is a second output: the
    recomputation draws the forward pass's dropout masks. What it adds with
    `add_loss` (an MoE block's load-balancing loss) is an output too.
    """
    found = block_gathers.traced_variables(layer)
    variables, variable_values = found if found is not None else ([], [])

    def read(values: list, variable_values: list) -> tuple[Any, dict]:
        if not variables:  # untraced variables are constants
            return (function(*values), []), {}
        return block_gathers.calling(variables, variable_values, function, *values, returning_state=True)

    # What the call adds with `add_loss` is an output, differentiated too.
    added = []
    evaluate, consts = block_gathers.traced_once(block_gathers.keeping_losses(read, added), values, variable_values)

    @jax.custom_vjp
    def run(inputs):
        return evaluate(*inputs)

    def forward(inputs):
        return evaluate(*inputs), inputs

    def backward(inputs, cotangents):
        # A zero computed from the output's cotangent (the state's cotangents,
        # integer seeds', are float0): every float input of the recomputation
        # depends on it, and an inf or NaN there reaches no more than it would
        # without remat.
        zero = block_gathers.zero_after(jax.tree_util.tree_leaves(cotangents[0])[0])
        inputs = jax.tree.map(lambda v: block_gathers.plus_zero(v, zero), inputs)
        return jax.vjp(lambda inputs: evaluate(*inputs)[0], inputs)[1](cotangents[0])

    run.defvjp(forward, backward)
    (output, losses), state = run((consts, list(values), list(variable_values)))
    block_gathers.assign_state(variables, state)
    block_gathers.add_losses(layer, losses, added)
    return output


# The rematerialized calls being traced (a layer inside one is not nested).
_INSIDE: list[Any] = []


def apply_remat(model: Any, remat: Any) -> None:
    """Rematerializes `model`'s decoder blocks as `remat=` asks (module
    docstring), replacing any earlier `remat=`; `None` turns it off."""
    scope = remat_scope(remat)
    backbone = getattr(model, "backbone", model)
    layers = list(backbone._flatten_layers(include_self=False, recursive=True))
    for layer in layers:
        if hasattr(layer.call, "unrematerialized"):
            layer.call = layer.call.unrematerialized
    _compat.set_remat_mode(layers, None)
    if scope is None or scope.mode is None:
        return
    blocks = decoder_blocks(backbone)
    inside = [l for b in blocks for l in b._flatten_layers(include_self=True, recursive=True)]
    if scope.mode == "activations":
        _compat.set_remat_mode(inside, scope)
    for layer in blocks if scope.mode == "full" else inside:
        if scope.mode == "full" or (scope.mode == "list_of_layers" and layer.name in scope.layer_names):
            layer.call = checkpointed(layer, layer.call)
        elif scope.mode == "larger_than":
            layer.call = checkpointed(layer, layer.call, scope.output_size_threshold)
