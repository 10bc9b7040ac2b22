"""Build a model whose variables have shapes but no values.

`build_without_values` is the one way the package builds a model before its
weights exist: the loader fills the variables from a checkpoint, the
factories draw them in their shards, and `build_abstract` leaves them
abstract (an eager read raises) for shapes and planning. How the model then
runs on the mesh (the batch kept on the batch axis, remat) is applied by
the builders' callers, `shaping.apply.build_shaped`: this room holds where
the weights live, not how `fit` and `generate` run. `variable_specs`
gives a named architecture's variable paths, shapes and dtypes from such a
build, cached.

This sits below both `layouts` (which checks a family's map against a named
architecture's shapes) and `abstract` (which sizes an architecture on a
mesh with that map), so neither imports the other's caller.

Example:

```python
import keras_hub
from keras_hub_dist.plan.build import build_without_values, variable_specs

model, pending = build_without_values(
    keras_hub.models.GemmaBackbone,
    dict(vocabulary_size=256, num_layers=1, num_query_heads=2,
         num_key_value_heads=1, hidden_dim=16, intermediate_dim=32, head_dim=8),
)
specs = variable_specs("gemma_2b_en")   # (VariableSpec(path, shape, dtype), ...)
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_hub_dist import _compat
from keras_hub_dist.plan import presets
from keras_hub_dist.plan.sizes import itemsize

__all__ = [
    "VariableSpec",
    "build_abstract",
    "build_without_values",
    "specs_of",
    "variable_specs",
]

@dataclasses.dataclass(frozen=True)
class VariableSpec:
    """A variable's path, full shape and dtype: all a plan needs."""

    path: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole variable."""
        return self.size * itemsize(self.dtype)


class _NoValue:
    """Initializer of an abstract variable: shapes under tracing, else an error.

    Keras reads an uninitialized variable's value by calling its initializer.
    Under a JAX trace (`jax.eval_shape`, Keras's symbolic calls) that costs no
    memory, so shape inference still works; an eager read would allocate the
    full tensor, one copy per read, so it raises instead.
    """

    def __init__(self, path: str):
        self.path = path

    def __call__(self, shape, dtype=None):
        dtype = keras.backend.standardize_dtype(dtype)
        if isinstance(jnp.zeros((), dtype), jax.core.Tracer):
            return jnp.zeros(shape, dtype)
        raise RuntimeError(
            f"Variable '{self.path}' (shape {tuple(shape)}, dtype {dtype}) "
            "belongs to an abstract backbone: it has a shape but no value. "
            "Expected symbolic use only (shapes, layout planning, "
            "jax.eval_shape). Received: an eager read of its value. Build a "
            "real backbone with a keras_hub_dist factory (e.g. "
            "keras_hub_dist.gemma_backbone) or load weights into it."
        )


def build_without_values(cls: type, config: Mapping[str, Any]) -> tuple[keras.Model, list[Any]]:
    """Constructs `cls.from_config(config)` with no variable given a value.

    The one way the package builds a model before its weights exist: the
    variables have paths, shapes, dtypes and their (pending) initializers,
    and no memory. Callers then fill them from a checkpoint, draw them in
    their shards, or leave them abstract. The model is as stock KerasHub
    builds it: `shaping.apply.build_shaped` also keeps its batch on the
    mesh's data axis and rematerializes its decoder blocks.

    Args:
        cls: The backbone class.
        config: Its config.

    Returns:
        `(model, variables created)`, the variables still pending.
    """
    with _compat.creating_variables_without_values() as created, _each_layer_kind_traced_once():
        model = cls.from_config(dict(config))
    return model, created


def _spec_key(value: Any) -> tuple:
    if isinstance(value, keras.KerasTensor):
        return ("tensor", tuple(value.shape), value.dtype, value.sparse, value.ragged)
    if value is None or isinstance(value, (bool, int, float, str)):
        return ("value", value)
    raise TypeError(type(value))


def _fresh_tensor(value: Any) -> Any:
    if isinstance(value, keras.KerasTensor):
        return keras.KerasTensor(value.shape, value.dtype, sparse=value.sparse, ragged=value.ragged)
    return value


@contextlib.contextmanager
def _each_layer_kind_traced_once() -> Iterator[None]:
    """Infers the output spec of each kind of layer call once per build.

    A functional backbone infers what each decoder block returns by tracing
    its `call` (Keras's `Operation.compute_output_spec`, a `jax.eval_shape`),
    block after block, though all blocks of one config given the same input
    specs return the same specs. Here a call whose layer class, config (but
    its name), input specs and static arguments were seen already in this
    build gets fresh tensors of the recorded specs instead. Abstract builds,
    medians of 3 on the 2-core VM (`benchmarks/bench_abstract_build.py`,
    BENCHMARKS.md): gpt-oss-120b 5.18 -> 0.51 s, gpt-oss-20b 2.51 -> 0.39 s
    (most KerasHub blocks give their output shape without a trace); every named architecture's weights, layers and output specs are
    the same either way (tests/plan/test_abstract.py checks gpt-oss). A
    layer whose config or arguments do not serialize is traced as Keras
    does, and so is a layer whose dtype is a `DTypePolicyMap` (a quantized
    preset's): Keras's `get_config` of such a map sets its quantized
    policies' names to None (Keras 3.15).
    """
    traced: dict[tuple, Any] = {}
    keras_spec = keras.Operation.compute_output_spec

    def compute_output_spec(operation, *args, **kwargs):
        if isinstance(getattr(operation, "dtype_policy", None), keras.dtype_policies.DTypePolicyMap):
            return keras_spec(operation, *args, **kwargs)
        try:
            config = {k: v for k, v in operation.get_config().items() if k != "name"}
            key = (
                type(operation),
                json.dumps(config, sort_keys=True),
                str(keras.tree.map_structure(_spec_key, (args, kwargs))),
            )
        except Exception:  # noqa: BLE001 - then Keras's own inference
            return keras_spec(operation, *args, **kwargs)
        if key not in traced:
            traced[key] = keras_spec(operation, *args, **kwargs)
            return traced[key]
        return keras.tree.map_structure(_fresh_tensor, traced[key])

    keras.Operation.compute_output_spec = compute_output_spec
    try:
        yield
    finally:
        keras.Operation.compute_output_spec = keras_spec


def build_abstract(cls: type, config: Mapping[str, Any]) -> keras.Model:
    """`cls.from_config(config)` whose variables raise on an eager read
    (built as `build_without_values` builds it)."""
    model, created = build_without_values(cls, config)
    for variable in created:
        _compat.set_pending_initializer(variable, _NoValue(variable.path))
    return model


def specs_of(model: keras.Model) -> tuple[VariableSpec, ...]:
    """The `VariableSpec` of every weight of `model`, in `model.weights` order."""
    return tuple(
        VariableSpec(v.path, tuple(int(d) for d in v.shape), str(v.dtype))
        for v in model.weights
    )


@functools.lru_cache(maxsize=64)
def _cached_specs(key: str) -> tuple[VariableSpec, ...]:
    cls, config, _ = presets.backbone_config(json.loads(key))
    return specs_of(build_abstract(cls, config))


def variable_specs(name_or_config: Any) -> tuple[VariableSpec, ...]:
    """The `VariableSpec`s of a named architecture or config (cached).

    Layout planning only needs paths and shapes; the abstract model is built
    once per architecture and dropped.
    """
    if isinstance(name_or_config, str) and not os.path.isdir(name_or_config):
        name_or_config = presets.resolve(name_or_config).name
    return _cached_specs(json.dumps(name_or_config, sort_keys=True))
