"""Automatic tensor-parallel layout planning for any Keras model.

`plan_layout` proposes a `keras.distribution.LayoutMap` for a model that has
no hand-written one, in the spirit of Megatron-style column / row parallelism
(HF "tp plans", MaxText logical axis rules), but derived from the model itself:
the forward pass is traced on shapes only and the planner reads off which
weights consume which other weights' outputs, and along which dimensions.

- An embedding table is sharded on its vocabulary axis (the dimension the
  lookup indexes), else on its hidden axis.
- A matmul weight that reads a replicated activation is *column-parallel*: it
  is sharded on an output dimension. A matmul weight whose input dimensions
  all come from column-parallel weights is *row-parallel*: it is sharded on
  the contracted dimension that carries the same data as its partners'
  sharded dimension (the FFN "down" after "gate"/"up", the attention output
  projection after q/k/v). In attention that common dimension is the heads
  axis, because it is the one dimension of q, k and v that survives to the
  output projection.
- Norm scales, biases and other vectors are replicated.
- Only shardings that divide evenly are used; otherwise another dimension is
  tried, then replication, and the plan records the fallback (see
  `LayoutPlan.fallbacks`, `LayoutPlan.summary()`).
- A second mesh axis (the data axis) additionally shards each weight's largest
  remaining dimension, as KerasHub's own layout maps do (FSDP-style).

The model may be abstract: built inside `keras.StatelessScope` so that its
variables have shapes but no values. Planning a 27B model then takes seconds
and no weight memory.

This module holds the entry point, `LayoutPlan`, and mesh / model preparation;
the trace is read by `weight_graph`, each variable's layout is decided in
`auto_layout_decisions`, and the plan's text reports are in
`auto_layout_report`.

Example:

```python
import keras
import keras_hub_dist

mesh = keras.distribution.DeviceMesh(
    (1, 8), ("batch", "model"), keras.distribution.list_devices()
)
plan = keras_hub_dist.plan_layout(model, mesh)
print(plan.summary())
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=plan, batch_dim_name="batch")
)
```
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_hub_dist import _compat
from keras_hub_dist.errors import LayoutError
from keras_hub_dist.plan.auto_layout_decisions import (
    AxisEntry,
    VariableDecision,
    decide_layouts,
    resolve_duplicate_paths,
)
from keras_hub_dist.plan.auto_layout_report import render_summary, warn_fallbacks
from keras_hub_dist.plan import quantization
from keras_hub_dist.plan.mesh import axis_sizes, device_mesh
from keras_hub_dist.plan.quantized_layouts import axes_from_values
from keras_hub_dist.plan.sizes import format_bytes, itemsize
from keras_hub_dist.plan.specs import shard_shape, validate_spec
from keras_hub_dist.plan.weight_graph import WeightGraph, trace_weight_graph

__all__ = ["LayoutPlan", "VariableDecision", "plan_layout"]

# Unknown (None) input dimensions are traced with these sizes. They only need
# to be valid; the planner never compares activation sizes with weight sizes.
_TRACE_BATCH = 2
_TRACE_LENGTH = 8


class LayoutPlan(keras.distribution.LayoutMap):
    """A `LayoutMap` proposed by `plan_layout`, with the reasons behind it.

    It is a `keras.distribution.LayoutMap` (usable directly in
    `keras.distribution.ModelParallel(layout_map=plan, ...)`) whose keys are
    the regex-escaped paths of the model's variables, one key per variable,
    so each key matches exactly that variable. `plan.layout_map` returns a
    plain `LayoutMap` copy.

    Attributes:
        decisions: One `VariableDecision` per variable, in model order.
        axis_sizes: Mesh axis name -> size.
        model_axis: Mesh axis used for tensor parallelism.
        data_axis: Mesh axis also used to shard weights (or `None`).
        traced: Whether the model's forward pass could be traced (if not, the
            plan shards each weight's largest divisible dimension).
        notes: Remarks on the plan as a whole (e.g. why tracing failed).

    Example:

    ```python
    plan = plan_layout(model, mesh)
    plan.spec("decoder_block_0/ffw_linear/kernel")  # ('model', 'batch')
    print(plan.per_device_bytes / (plan.total_bytes / plan.num_devices))
    ```
    """

    def __init__(
        self,
        device_mesh: keras.distribution.DeviceMesh | None,
        decisions: Sequence[VariableDecision],
        axis_sizes: Mapping[str, int],
        model_axis: str,
        data_axis: str | None,
        traced: bool,
        notes: Sequence[str] = (),
        model_name: str = "",
    ) -> None:
        super().__init__(device_mesh)
        self.decisions: tuple[VariableDecision, ...] = tuple(decisions)
        self.axis_sizes: dict[str, int] = dict(axis_sizes)
        self.model_axis = model_axis
        self.data_axis = data_axis
        self.traced = traced
        self.notes: tuple[str, ...] = tuple(notes)
        self.model_name = model_name
        self._by_path = {d.path: d for d in self.decisions}
        # Not `key in self`: LayoutMap answers every lookup (None if missing).
        inserted: set[str] = set()
        for decision in self.decisions:
            key = re.escape(decision.path)
            if key not in inserted:
                inserted.add(key)
                self[key] = tuple(decision.axes)

    @property
    def layout_map(self) -> keras.distribution.LayoutMap:
        """A plain `keras.distribution.LayoutMap` with the same entries."""
        plain = keras.distribution.LayoutMap(self.device_mesh)
        for key in self:
            plain[key] = tuple(self[key].axes)
        return plain

    @property
    def fallbacks(self) -> tuple[VariableDecision, ...]:
        """Decisions that could not use their preferred dimension."""
        return tuple(d for d in self.decisions if d.fallback)

    @property
    def num_devices(self) -> int:
        return math.prod(self.axis_sizes.values())

    @property
    def total_bytes(self) -> int:
        return sum(d.total_bytes for d in self.decisions)

    @property
    def per_device_bytes(self) -> int:
        """Bytes of variables on each device (every device holds the same)."""
        return sum(d.device_bytes for d in self.decisions)

    @property
    def balance(self) -> float:
        """`per_device_bytes / (total_bytes / num_devices)`; 1.0 is ideal."""
        if not self.total_bytes:
            return 1.0
        return self.per_device_bytes * self.num_devices / self.total_bytes

    def decision(self, path: str) -> VariableDecision:
        """The decision for the variable at `path`."""
        try:
            return self._by_path[path]
        except KeyError:
            raise KeyError(
                f"No variable with path '{path}' in this plan. Expected one "
                f"of the model's variable paths, e.g. "
                f"{list(self._by_path)[:3]}. Received: {path!r}."
            ) from None

    def spec(self, path: str) -> tuple[AxisEntry, ...]:
        """The layout axes planned for the variable at `path`."""
        return self.decision(path).axes

    def distribution(self) -> keras.distribution.ModelParallel:
        """A `ModelParallel` distribution that uses this plan."""
        if self.device_mesh is None:
            raise LayoutError(
                "This plan was made for an abstract mesh "
                f"{self.axis_sizes}. Expected a keras.distribution.DeviceMesh "
                "to build a distribution. Received: no devices. Call "
                "plan_layout with a DeviceMesh."
            )
        return keras.distribution.ModelParallel(
            layout_map=self, batch_dim_name=self.data_axis
        )

    def summary(self, group: bool = True) -> str:
        """A readable table of the plan.

        Args:
            group: Collapse variables whose paths differ only in numbers
                (`decoder_block_0`, `decoder_block_1`, ...) and whose
                decisions are identical into one row.
        """
        return render_summary(self, group)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return (
            f"<LayoutPlan {self.model_name!r}: {len(self.decisions)} variables, "
            f"mesh {self.axis_sizes}, per device {format_bytes(self.per_device_bytes)}"
            f" = {self.balance:.3f} x total/N, {len(self.fallbacks)} fallbacks>"
        )


def plan_layout(
    model: keras.Model,
    mesh: Any,
    *,
    model_axis: str = "model",
    data_axis: str | None = "batch",
    inputs: Any = None,
) -> LayoutPlan:
    """Proposes a tensor-parallel `LayoutMap` for any Keras model.

    The model's forward pass is traced on shapes only (`jax.make_jaxpr`; no
    weight is read or allocated) and each weight gets a layout from how it is
    used: embeddings on their vocabulary axis, "up" projections column-parallel
    and their matching "down" projections row-parallel (pairs found by
    following the data from one matmul to the next), attention q/k/v/o on the
    heads axis, norms and biases replicated. Only even shardings are used;
    when a dimension does not divide, another one is used or the variable is
    replicated, with a `LayoutFallbackWarning` and a line in `summary()`.

    Args:
        model: A Keras model. It may be abstract (variables created inside
            `keras.StatelessScope(initialize_variables=False)`, no values).
            A functional model (every KerasHub backbone) is traced with its
            own symbolic inputs; other models need `inputs`, and an un-built
            model is built abstractly on a clone (it is not modified).
        mesh: A `keras.distribution.DeviceMesh`, a `jax.sharding.Mesh`, a
            `(data, model)` shape such as `(1, 8)` over the first local
            devices, `None` (every local device on `model_axis`), or a
            `{axis_name: size}` dict (an abstract mesh: the plan has no
            devices but all figures).
        model_axis: Mesh axis to shard weights on (tensor parallelism).
        data_axis: Mesh axis that also shards each weight's largest remaining
            dimension (as KerasHub's layout maps do), or `None`.
        inputs: Optional example inputs (a pytree of arrays,
            `jax.ShapeDtypeStruct` or `keras.KerasTensor`) to trace with.

    Returns:
        A `LayoutPlan`: a `keras.distribution.LayoutMap` with one exact,
        regex-escaped key per variable path, plus `summary()`, `fallbacks`,
        per-variable `decisions` and per-device byte figures.

    Raises:
        LayoutError: the mesh lacks `model_axis` / `data_axis`, is a bad
            shape or needs more devices than there are, or an un-built model
            was given without `inputs`.
        TypeError: `mesh` is of none of the types above.

    Example:

    ```python
    mesh = keras.distribution.DeviceMesh(
        (1, 8), ("batch", "model"), keras.distribution.list_devices()
    )
    plan = plan_layout(backbone, mesh)
    print(plan.summary())
    distribution = keras.distribution.ModelParallel(
        layout_map=plan, batch_dim_name="batch"
    )
    ```
    """
    device_mesh, sizes = _resolve_mesh(mesh, model_axis, data_axis)
    notes: list[str] = []
    traced_model = model
    if not model.built:
        traced_model = _abstract_clone(model, inputs)
    variables = list(traced_model.trainable_variables) + list(
        traced_model.non_trainable_variables
    )

    graph = None
    try:
        graph = _trace(traced_model, variables, inputs)
    except _UntraceableError as error:
        notes.append(str(error))
    except Exception as error:  # noqa: BLE001 - any model code may fail
        notes.append(
            f"Tracing the forward pass failed ({type(error).__name__}: "
            f"{error}); each weight was sharded on its largest divisible "
            "dimension instead."
        )
    decisions = decide_layouts(variables, graph, sizes, model_axis, data_axis)
    decisions = _quantized_decisions(traced_model, decisions, sizes)
    for d in decisions:
        validate_spec(d.path, d.shape, d.axes, sizes)
    decisions = resolve_duplicate_paths(decisions)
    plan = LayoutPlan(
        device_mesh,
        decisions,
        sizes,
        model_axis,
        data_axis,
        traced=graph is not None,
        notes=notes,
        model_name=f"{type(model).__name__} '{model.name}'",
    )
    warn_fallbacks(plan)
    return plan


def _quantized_decisions(
    model: keras.Model, decisions: Sequence[VariableDecision], sizes: dict[str, int]
) -> list[VariableDecision]:
    """A quantized model's scales, zero points and `g_idx` follow the layout
    planned for their values (`quantized_layouts.axes_from_values`), not
    their own traced use (they are only multiplied in element-wise)."""
    tensors = quantization.quantized_tensors(model)
    if not tensors:
        return list(decisions)
    by_path = {d.path: d for d in decisions}
    derived: dict[str, tuple] = {}
    for tensor in tensors:
        values = by_path.get(tensor.values.path)
        if values is not None:
            derived.update(axes_from_values(tensor, values.axes, sizes))
    out = []
    for d in decisions:
        axes = derived.get(d.path)
        if axes is None or d.path in (t.values.path for t in tensors):
            out.append(d)
            continue
        block = shard_shape(d.shape, axes, sizes)
        out.append(dataclasses.replace(
            d, axes=tuple(axes), role="quant", partners=(), fallback="",
            device_bytes=math.prod(block) * itemsize(d.dtype),
        ))
    return out


# -- mesh and model preparation -------------------------------------------


def _resolve_mesh(
    mesh: Any, model_axis: str, data_axis: str | None
) -> tuple[keras.distribution.DeviceMesh | None, dict[str, int]]:
    """The device mesh (`None` for a dict) and axis sizes to plan for.

    Args:
        mesh: Anything `plan_layout` accepts as a mesh.
        model_axis: Mesh axis for tensor parallelism.
        data_axis: Mesh axis that also shards weights, or `None`.

    Returns:
        `(device_mesh, axis_sizes)`.

    Raises:
        LayoutError: A bad shape, a shape without a data axis name, or a mesh
            that lacks `model_axis` / `data_axis`.
        TypeError: `mesh` is of no supported type (from `device_mesh`).
    """
    keras_mesh: keras.distribution.DeviceMesh | None = None
    if isinstance(mesh, Mapping):
        # An `{axis: size}` dict plans from sizes alone: no DeviceMesh, so a
        # pod-sized plan needs no devices (`LayoutPlan.distribution` refuses).
        sizes = axis_sizes(mesh)
    else:
        if isinstance(mesh, Sequence) and not isinstance(mesh, str) and (
            data_axis is None
        ):
            # `device_mesh` names a shape's axes (data, model); without a data
            # axis name there is no name for the first size.
            raise LayoutError(
                "A mesh given as a shape must be (data, model). Expected two "
                f"sizes and a data_axis name. Received: mesh={tuple(mesh)}, "
                f"data_axis={data_axis!r}. Pass a DeviceMesh for other meshes."
            )
        if mesh is None and data_axis is None:
            # `None` means (data, model) = (1, n); with no data axis name,
            # the one-axis mesh of all devices.
            mesh = {model_axis: len(jax.devices())}
        # Past the checks above, `data_axis` only names a shape's first axis,
        # so it is never needed when it is None.
        keras_mesh = device_mesh(
            mesh, data_axis=data_axis or "batch", model_axis=model_axis
        )
        sizes = axis_sizes(keras_mesh)
    for label, axis in (("model_axis", model_axis), ("data_axis", data_axis)):
        if axis is not None and axis not in sizes:
            raise LayoutError(
                f"The mesh has no axis named {axis!r}. Expected {label} to be "
                f"one of {sorted(sizes)}. Received: {label}={axis!r}. Pass "
                f"{label}=<one of those names>"
                + (" or data_axis=None." if label == "data_axis" else ".")
            )
    if data_axis is not None and data_axis == model_axis:
        raise LayoutError(
            "Expected model_axis and data_axis to differ. Received: both "
            f"{model_axis!r}. Pass data_axis=None to use one axis only."
        )
    return keras_mesh, sizes


class _UntraceableError(Exception):
    """The model has nothing to trace with; the message becomes a plan note."""


def _input_avals(model: keras.Model, inputs: Any) -> Any:
    """Shape/dtype structs to trace with: `inputs`, else the model's own.

    Unknown (`None`) dimensions get small placeholder sizes.

    Raises:
        _UntraceableError: No `inputs` and the model has no symbolic inputs.
    """
    if inputs is None:
        try:
            inputs = model.input
        except (AttributeError, ValueError) as error:
            # A Sequential model started with `keras.Input` has `inputs` only.
            symbolic = getattr(model, "inputs", None)
            if symbolic:
                inputs = symbolic[0] if len(symbolic) == 1 else list(symbolic)
            else:
                raise _UntraceableError(
                    f"Model {model.name!r} has no symbolic inputs to trace "
                    f"with ({error}); each weight was sharded on its largest "
                    "divisible dimension instead. Pass inputs=<example "
                    "inputs> to plan_layout for a structure-aware plan."
                ) from None

    def to_aval(x: Any) -> jax.ShapeDtypeStruct:
        shape = tuple(getattr(x, "shape", ()))
        dims = tuple(
            (_TRACE_BATCH if i == 0 else _TRACE_LENGTH) if d is None else int(d)
            for i, d in enumerate(shape)
        )
        dtype = jnp.dtype(keras.backend.standardize_dtype(x.dtype))
        return jax.ShapeDtypeStruct(dims, dtype)

    return jax.tree_util.tree_map(to_aval, inputs)


def _abstract_clone(model: keras.Model, inputs: Any) -> keras.Model:
    """Builds a copy of an un-built model with shape-only variables.

    The caller's model stays un-built, so it can still be built for real
    under the distribution this plan describes. Layer names are kept, so the
    clone's variable paths are the ones the real model will get.
    """
    if inputs is None:
        raise LayoutError(
            f"Model {model.name!r} is not built, so its variables have no "
            "shapes yet. Expected a built (possibly abstract) model or "
            "example inputs. Received: inputs=None. Pass inputs=<arrays, "
            "jax.ShapeDtypeStruct or keras.KerasTensor> or build the model "
            "inside keras.StatelessScope(initialize_variables=False)."
        )
    try:
        clone = keras.models.clone_model(model)
    except Exception:  # noqa: BLE001 - subclassed models cannot be cloned
        clone = type(model).from_config(model.get_config())
    avals = _input_avals(clone, inputs)
    symbolic = jax.tree_util.tree_map(
        lambda a: keras.KerasTensor(a.shape, dtype=str(a.dtype)), avals
    )
    with _compat.creating_variables_without_values():
        clone(symbolic)
    return clone


def _trace(
    model: keras.Model, variables: list[Any], inputs: Any
) -> WeightGraph:
    """Traces the forward pass on shapes only into a `WeightGraph`.

    The active distribution is unset during the trace (and restored after)
    so that the trace records the model's unsharded computation.
    """
    avals = _input_avals(model, inputs)
    n_trainable = len(model.trainable_variables)
    var_avals = [
        jax.ShapeDtypeStruct(tuple(v.shape), jnp.dtype(v.dtype)) for v in variables
    ]

    params = inspect.signature(model.call).parameters.values()
    kwargs = (
        {"training": False}
        if any(p.name == "training" or p.kind is p.VAR_KEYWORD for p in params)
        else {}
    )

    def forward(values: list[Any], x: Any) -> Any:
        # A nested scope keeps Keras from initializing pending variables when
        # `stateless_call`'s own scope exits.
        with keras.StatelessScope(initialize_variables=False):
            out, _ = model.stateless_call(
                values[:n_trainable], values[n_trainable:], x, **kwargs
            )
        return out

    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        return trace_weight_graph(forward, var_avals, avals)
    finally:
        keras.distribution.set_distribution(previous)
