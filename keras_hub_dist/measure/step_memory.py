"""XLA memory of a Keras train step or a KerasHub generate call, compile only.

A layout or a rematerialization choice shows in the temporaries XLA assigns
to one device's program (activations kept for the backward pass, attention
scores, resharded copies), which `compiled.memory_analysis()` reports before
anything runs. These functions lower the model's own step on
`jax.ShapeDtypeStruct`s carrying each variable's sharding, so the model may
be abstract (`plan.build.build_abstract`: no weight allocated) and a 8B-wide
layer is measured in the time of one compilation.

- `train_step_memory(model, x, y)`: Keras's JAX `train_step` (value and
  gradient of the compiled loss, then the optimizer's update), jitted with
  the state donated, as `model.fit` jits it.
- `generate_memory(causal_lm, inputs)`: KerasHub's `generate_step` (the
  prefill that builds the KV cache, then the sampling loop), as
  `CausalLM.make_generate_function` jits it.

Example:

```python
import jax, keras, keras_hub
from keras_hub_dist.measure.step_memory import train_step_memory

backbone = ...  # built under a keras.distribution.ModelParallel
x = {"token_ids": jax.ShapeDtypeStruct((8, 512), "int32"),
     "padding_mask": jax.ShapeDtypeStruct((8, 512), "int32")}
y = jax.ShapeDtypeStruct((8, 512, backbone.hidden_dim), "bfloat16")
train_step_memory(backbone, x, y)["temp_bytes"]
```
"""

from __future__ import annotations

import itertools
from typing import Any

import jax
import keras

from keras_hub_dist import _compat
from keras_hub_dist.measure.memory import compiled_memory

__all__ = ["generate_memory", "train_step_memory", "variable_struct"]


def variable_struct(variable: Any) -> jax.ShapeDtypeStruct:
    """A variable's shape, dtype and sharding (its layout under the active
    distribution), without reading its value."""
    layout = _compat.pending_layout(variable)
    sharding = getattr(layout, "backend_layout", layout)
    return jax.ShapeDtypeStruct(
        tuple(int(d) for d in variable.shape), variable.dtype, sharding=sharding
    )


def _structs(variables: Any) -> list[jax.ShapeDtypeStruct]:
    return [variable_struct(v) for v in variables]


def _slot_structs(slots: Any, variables: Any, structs: list) -> list:
    """The optimizer's variables, each slot sharded as its model variable.

    Keras gives a slot its model variable's layout when that variable has
    one; a variable created without a value has none yet, so the slot would
    be replicated. A slot is named `<optimizer>/<variable path with "/" ->
    "_">_<slot name>` and has its variable's shape: that finds it.
    """
    by_name = {
        v.path.replace("/", "_"): struct for v, struct in zip(variables, structs)
    }
    out = []
    for slot in slots:
        struct = variable_struct(slot)
        name = slot.path.split("/", 1)[-1]
        owners = [
            key for key in by_name
            if name.startswith(key + "_") and by_name[key].shape == struct.shape
        ]
        if owners:
            owner = by_name[max(owners, key=len)]
            struct = jax.ShapeDtypeStruct(struct.shape, struct.dtype, sharding=owner.sharding)
        out.append(struct)
    return out


def train_step_memory(
    model: keras.Model, x: Any, y: Any, *, optimizer: Any = "adam", loss: Any = "mse"
) -> dict[str, int]:
    """Per-device XLA memory of one `fit` step of `model`, compiled only.

    Compiles `model` with `optimizer` and `loss` (unless already compiled),
    creates the optimizer's slots without values (no memory) and lowers
    Keras's `train_step` on the state's shapes and shardings.

    Args:
        model: A Keras model built under the distribution it is measured
            with (abstract or real).
        x: Inputs: arrays or `jax.ShapeDtypeStruct`s (with a sharding to
            split the batch).
        y: Targets, likewise.
        optimizer: The optimizer for `model.compile`.
        loss: The loss for `model.compile`.

    Returns:
        `compiled_memory` of the step: `temp_bytes`, `argument_bytes`, ...
    """
    if not getattr(model, "compiled", False):
        # The iteration counter and the loss tracker hold values, so they
        # are created for real (a few scalars); the slots are not.
        model.compile(optimizer=optimizer, loss=loss)
    if not model.optimizer.built:
        with _compat.creating_variables_without_values():
            model.optimizer.build(model.trainable_variables)
    trainable = _structs(model.trainable_variables)
    state = (
        trainable,
        _structs(model.non_trainable_variables),
        _slot_structs(model.optimizer.variables, model.trainable_variables, trainable),
        _structs(model.metrics_variables),
    )
    step = jax.jit(model.train_step, donate_argnums=0)
    return compiled_memory(step.lower(state, (x, y)).compile())


def generate_memory(causal_lm: keras.Model, inputs: Any) -> dict[str, int]:
    """Per-device XLA memory of one `generate` call of a KerasHub CausalLM.

    Args:
        causal_lm: A KerasHub `CausalLM` (abstract or real), compiled with
            the sampler to measure (KerasHub's default otherwise).
        inputs: `{"token_ids": ..., "padding_mask": ...}` of shape
            `(batch, max_length)`: arrays or `jax.ShapeDtypeStruct`s.

    Returns:
        `compiled_memory` of the generate program.
    """
    sampler = causal_lm.sampler

    def generate(inputs, state):
        # As `CausalLM.make_generate_function` does under JAX.
        mapping = itertools.chain(
            zip(sampler.variables, state[0]),
            zip(causal_lm.trainable_variables, state[1]),
            zip(causal_lm.non_trainable_variables, state[2]),
        )
        with keras.StatelessScope(state_mapping=mapping):
            return causal_lm.generate_step(inputs, None)

    state = (
        _structs(sampler.variables),
        _structs(causal_lm.trainable_variables),
        _structs(causal_lm.non_trainable_variables),
    )
    return compiled_memory(jax.jit(generate).lower(inputs, state).compile())
