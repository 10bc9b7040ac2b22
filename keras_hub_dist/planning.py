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
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import keras

from keras_hub_dist import _compat, _plan_graph, _sharding
from keras_hub_dist.errors import LayoutError, LayoutFallbackWarning

__all__ = ["LayoutPlan", "VariableDecision", "plan_layout"]

AxisEntry = str | None

# Unknown (None) input dimensions are traced with these sizes. They only need
# to be valid; the planner never compares activation sizes with weight sizes.
_TRACE_BATCH = 2
_TRACE_LENGTH = 8

ROLE_EMBEDDING = "embedding"
ROLE_COLUMN = "column"
ROLE_ROW = "row"
ROLE_BIAS = "bias"
ROLE_VECTOR = "vector"
ROLE_OTHER = "other"


@dataclasses.dataclass(frozen=True)
class VariableDecision:
    """The layout chosen for one variable, and why.

    Attributes:
        path: The variable path (`variable.path`).
        shape: The full shape.
        dtype: The variable dtype name.
        axes: One mesh axis name or `None` per dimension (`TensorLayout.axes`).
        role: `"embedding"`, `"column"` (output dims sharded), `"row"`
            (contracted dims sharded), `"bias"` / `"vector"` (replicated),
            or `"other"` (used only element-wise, or not at all, by the
            traced forward pass; sharded on its largest divisible dim).
        partners: Paths of the column-parallel weights a row-parallel weight
            pairs with (through data flow), or of the row-parallel weight a
            column-parallel weight feeds.
        fallback: Why the preferred dimension was not used (`""` if it was).
        total_bytes: Bytes of the whole variable.
        device_bytes: Bytes each device holds.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[AxisEntry, ...]
    role: str
    partners: tuple[str, ...] = ()
    fallback: str = ""
    total_bytes: int = 0
    device_bytes: int = 0

    @property
    def sharded(self) -> bool:
        """Whether any dimension is split over a mesh axis of size > 1."""
        return self.device_bytes < self.total_bytes


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
        return _render_summary(self, group)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        return (
            f"<LayoutPlan {self.model_name!r}: {len(self.decisions)} variables, "
            f"mesh {self.axis_sizes}, per device {_fmt_bytes(self.per_device_bytes)}"
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
            `(data, model)` shape such as `(1, 8)` over the local devices, or
            a `{axis_name: size}` dict (an abstract mesh: the plan has no
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
        LayoutError: the mesh lacks `model_axis` / `data_axis`, or an un-built
            model was given without `inputs`.

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
    decisions = _decide(variables, graph, sizes, model_axis, data_axis)
    for d in decisions:
        _sharding.validate_spec(d.path, d.shape, d.axes, sizes)
    decisions = _resolve_duplicate_paths(decisions)
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
    _warn_fallbacks(plan)
    return plan


# -- mesh and model preparation -------------------------------------------


def _resolve_mesh(
    mesh: Any, model_axis: str, data_axis: str | None
) -> tuple[keras.distribution.DeviceMesh | None, dict[str, int]]:
    # A `{axis: size}` dict plans from sizes alone (no DeviceMesh).
    device_mesh = _sharding.keras_device_mesh(mesh)
    if device_mesh is not None or isinstance(mesh, Mapping):
        pass
    elif isinstance(mesh, Sequence) and all(isinstance(s, int) for s in mesh):
        if len(mesh) != 2 or data_axis is None:
            raise LayoutError(
                "A mesh given as a shape must be (data, model). Expected two "
                f"sizes and a data_axis name. Received: mesh={tuple(mesh)}, "
                f"data_axis={data_axis!r}. Pass a DeviceMesh for other meshes."
            )
        devices = jax.devices()
        if math.prod(mesh) != len(devices):
            raise LayoutError(
                f"Mesh shape {tuple(mesh)} needs {math.prod(mesh)} devices. "
                f"Expected a shape whose product is the {len(devices)} local "
                f"devices. Received: mesh={tuple(mesh)}."
            )
        device_mesh = keras.distribution.DeviceMesh(
            shape=tuple(mesh), axis_names=(data_axis, model_axis), devices=devices
        )
    else:
        raise LayoutError(
            "Expected mesh to be a keras.distribution.DeviceMesh, a "
            "jax.sharding.Mesh, a (data, model) shape or an {axis: size} "
            f"dict. Received: mesh={mesh!r} of type {type(mesh).__name__}."
        )
    sizes = _sharding.axis_sizes(device_mesh if device_mesh is not None else mesh)
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
    return device_mesh, sizes


class _UntraceableError(Exception):
    pass


def _input_avals(model: keras.Model, inputs: Any) -> Any:
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
) -> _plan_graph.WeightGraph:
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
        return _plan_graph.trace_weight_graph(forward, var_avals, avals)
    finally:
        keras.distribution.set_distribution(previous)


# -- decisions ---------------------------------------------------------------


def _roles(uses: Sequence[_plan_graph.WeightUse]) -> list[str]:
    """Column vs row parallel, from which weights feed each matmul.

    A matmul is row-parallel when every weight its contracted dimensions come
    from is column-parallel (so its input is sharded exactly where it reduces);
    otherwise it reads a replicated activation and is column-parallel.
    """
    roles: list[str] = []
    for use in uses:
        if use.kind == "gather":
            roles.append(ROLE_EMBEDDING)
            continue
        sources = {tag[0] for _, tags in use.contracted for tag in tags}
        if sources and all(roles[s] == ROLE_COLUMN for s in sources):
            roles.append(ROLE_ROW)
        else:
            roles.append(ROLE_COLUMN)
    return roles


def _preferred_dims(
    uses: Sequence[_plan_graph.WeightUse],
    roles: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
) -> tuple[dict[int, int], dict[int, set[int]]]:
    """The dimension each use would ideally shard, ignoring divisibility.

    A row-parallel use picks the contracted dimension whose data comes from
    the most column-parallel weights (heads rather than head_dim in attention,
    because q and k's head_dim is reduced away in `q @ k`; outermost on ties),
    and claims those weights' matching output dimensions.
    """
    preferred: dict[int, int] = {}
    partners: dict[int, set[int]] = {}
    claims: dict[int, int] = {}
    for use in uses:
        if roles[use.index] != ROLE_ROW:
            continue
        best = None
        for var_dim, tags in use.contracted:
            cols = sorted(
                {(a, j) for a, j in tags if roles[a] == ROLE_COLUMN}
            )
            key = (len({a for a, _ in cols}), -var_dim)
            if best is None or key > best[0]:
                best = (key, var_dim, cols)
        _, var_dim, cols = best
        preferred[use.index] = var_dim
        for a, j in cols:
            claims.setdefault(a, j)
            partners.setdefault(use.index, set()).add(a)
            partners.setdefault(a, set()).add(use.index)
    for use in uses:
        if use.index in preferred:
            continue
        shape = shapes[use.var]
        if roles[use.index] == ROLE_EMBEDDING and use.gathered_dims:
            preferred[use.index] = use.gathered_dims[0]
        elif use.index in claims:
            preferred[use.index] = claims[use.index]
        elif use.free_dims:
            preferred[use.index] = max(
                use.free_dims, key=lambda d: (shape[d], -d)
            )
        elif use.contracted:
            preferred[use.index] = max(
                (d for d, _ in use.contracted), key=lambda d: (shape[d], -d)
            )
    return preferred, partners


def _candidates(
    preferred: int | None,
    shape: tuple[int, ...],
    use: _plan_graph.WeightUse | None,
) -> list[int]:
    """Dimensions to try, in order.

    The preferred one first; then, for a matmul weight, its contracted (input)
    dims before its other output dims: splitting the input keeps the output
    whole, whereas another output dim (head_dim under indivisible heads) is
    split again by rotary embeddings, which XLA can only do by regathering.
    Then every dim, largest first.
    """

    def by_size(dims):
        return sorted(dims, key=lambda d: (-shape[d], d))

    order: list[int] = [] if preferred is None else [preferred]
    if use is not None:
        order += by_size(d for d, _ in use.contracted)
        order += by_size(use.free_dims)
    order += by_size(range(len(shape)))
    return list(dict.fromkeys(order))


def _describe_dim(
    dim: int, shape: tuple[int, ...], use: _plan_graph.WeightUse | None
) -> str:
    kind = "dim"
    if use is not None and dim in use.gathered_dims:
        kind = "indexed (vocabulary) dim"
    elif use is not None and dim in use.free_dims:
        kind = "output dim"
    elif use is not None and dim in {d for d, _ in use.contracted}:
        kind = "contracted dim"
    return f"{kind} {dim} ({shape[dim]})"


_SHARDED_ROLES = (ROLE_EMBEDDING, ROLE_COLUMN, ROLE_ROW, ROLE_OTHER)


def _choose_dim(
    want: int | None,
    shape: tuple[int, ...],
    use: _plan_graph.WeightUse | None,
    m: int,
    model_axis: str,
) -> tuple[int | None, str]:
    """The dim to split over the model axis, and the fallback note if any."""
    model_dim = next(
        (
            d
            for d in _candidates(want, shape, use)
            if shape[d] % m == 0 and shape[d] >= m
        ),
        None,
    )
    if want is not None and model_dim != want:
        reason = (
            f"{_describe_dim(want, shape, use)} is not divisible by the {m} "
            f"devices of mesh axis '{model_axis}'"
        )
        if model_dim is None:
            return None, f"{reason}, nor is any other dim: replicated"
        return model_dim, (
            f"{reason}: sharded {_describe_dim(model_dim, shape, use)} instead"
        )
    if model_dim is None:
        return None, (
            f"no dimension of {shape} is divisible by the {m} devices of mesh "
            f"axis '{model_axis}': replicated"
        )
    return model_dim, ""


def _itemsize(dtype: Any) -> int:
    return jnp.dtype(keras.backend.standardize_dtype(dtype)).itemsize


def _decide(
    variables: Sequence[Any],
    graph: _plan_graph.WeightGraph | None,
    sizes: Mapping[str, int],
    model_axis: str,
    data_axis: str | None,
) -> list[VariableDecision]:
    shapes = [tuple(int(s) for s in v.shape) for v in variables]
    paths = [v.path for v in variables]
    uses = graph.uses if graph is not None else []
    roles = _roles(uses)
    preferred, use_partners = _preferred_dims(uses, roles, shapes)
    first_use: dict[int, _plan_graph.WeightUse] = {}
    for use in uses:
        first_use.setdefault(use.var, use)
    m = sizes[model_axis]
    n_data = sizes[data_axis] if data_axis is not None else 1

    decisions = []
    for i, var in enumerate(variables):
        shape = shapes[i]
        rank = len(shape)
        use = first_use.get(i)
        partners: tuple[str, ...] = ()
        fallback = ""
        if use is not None:
            role = roles[use.index]
            want = preferred.get(use.index)
            partners = tuple(
                sorted({paths[uses[p].var] for p in use_partners.get(use.index, ())})
            )
        elif rank <= 1:
            role, want = ROLE_VECTOR, None
        elif graph is not None and any(
            uses[u].kind != "gather" for u in graph.added_to.get(i, ())
        ):
            # Added to a matmul's output. (A table added to an embedding
            # lookup, like learned positions, is sharded as "other".)
            role, want = ROLE_BIAS, None
            partners = tuple(
                sorted({paths[uses[u].var] for u in graph.added_to[i]})
            )
        else:
            role, want = ROLE_OTHER, None

        axes: list[AxisEntry] = [None] * rank
        if role in _SHARDED_ROLES and rank >= 2:
            model_dim, fallback = _choose_dim(want, shape, use, m, model_axis)
            if model_dim is not None:
                axes[model_dim] = model_axis
            if data_axis is not None:
                # FSDP-style, as KerasHub's maps: the largest other dim.
                rest = [
                    d
                    for d in sorted(range(rank), key=lambda d: (-shape[d], d))
                    if d != model_dim and shape[d] % n_data == 0
                    and shape[d] >= n_data
                ]
                if rest:
                    axes[rest[0]] = data_axis
        total = math.prod(shape) * _itemsize(var.dtype)
        block = _sharding.shard_shape(shape, axes, sizes)
        per_device = math.prod(block) * _itemsize(var.dtype)
        decisions.append(
            VariableDecision(
                path=paths[i],
                shape=shape,
                dtype=keras.backend.standardize_dtype(var.dtype),
                axes=tuple(axes),
                role=role,
                partners=partners,
                fallback=fallback,
                total_bytes=total,
                device_bytes=per_device,
            )
        )
    return decisions


def _resolve_duplicate_paths(
    decisions: list[VariableDecision],
) -> list[VariableDecision]:
    """Variables sharing a path get one layout (Keras matches by path)."""
    by_path: dict[str, list[int]] = {}
    for i, d in enumerate(decisions):
        by_path.setdefault(d.path, []).append(i)
    out = list(decisions)
    for path, indices in by_path.items():
        group = [decisions[i] for i in indices]
        if len(group) < 2 or len({(d.shape, d.axes) for d in group}) == 1:
            continue
        for i in indices:
            d = decisions[i]
            out[i] = dataclasses.replace(
                d,
                axes=(None,) * len(d.shape),
                device_bytes=d.total_bytes,
                fallback=(
                    f"{len(group)} variables share the path '{path}' with "
                    "different shapes or layouts, and Keras assigns layouts "
                    "by path: replicated"
                ),
            )
    return out


def _warn_fallbacks(plan: LayoutPlan) -> None:
    fallbacks = plan.fallbacks
    if not fallbacks and plan.traced:
        return
    lines = [f"  {d.path} {d.shape}: {d.fallback}" for d in fallbacks[:5]]
    if len(fallbacks) > 5:
        lines.append(f"  ... and {len(fallbacks) - 5} more (see plan.summary())")
    head = []
    if not plan.traced:
        head.extend(plan.notes)
    if fallbacks:
        head.append(
            f"plan_layout: {len(fallbacks)} of {len(plan.decisions)} variables "
            f"of {plan.model_name} could not use their preferred sharding on "
            f"mesh {plan.axis_sizes}:"
        )
    warnings.warn(
        "\n".join(head + lines), LayoutFallbackWarning, stacklevel=3
    )


# -- summary -----------------------------------------------------------------


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def _fmt_axes(axes: Sequence[AxisEntry]) -> str:
    return "(" + ", ".join("-" if a is None else str(a) for a in axes) + ")"


def _generic_path(path: str) -> str:
    """The path with its first number (usually the block index) as `#`."""
    return re.sub(r"\d+", "#", path, count=1)


_LEGEND = (
    "  column: output dims sharded; row: contracted dims sharded (pairs with "
    "the column weights feeding it); embedding: indexed dim sharded; "
    "bias/vector: replicated; other: used only element-wise (e.g. learned "
    "positions) or not at all (e.g. an output embedding only a task head "
    "uses) by the traced forward pass, largest divisible dim sharded."
)


def _render_summary(plan: LayoutPlan, group: bool) -> str:
    n = plan.num_devices
    rows: list[tuple[str, VariableDecision, int]] = []
    if group:
        index: dict[tuple, int] = {}
        for d in plan.decisions:
            key = (_generic_path(d.path), d.shape, d.dtype, d.axes, d.role,
                   d.fallback)
            if key in index:
                path, first, count = rows[index[key]]
                rows[index[key]] = (path, first, count + 1)
            else:
                index[key] = len(rows)
                rows.append((d.path, d, 1))
        rows = [
            (_generic_path(p) if c > 1 else p, d, c) for p, d, c in rows
        ]
    else:
        rows = [(d.path, d, 1) for d in plan.decisions]

    roles = {}
    for d in plan.decisions:
        roles[d.role] = roles.get(d.role, 0) + 1
    params = sum(math.prod(d.shape) for d in plan.decisions)
    lines = [
        f"LayoutPlan for {plan.model_name} on mesh {plan.axis_sizes} "
        f"(model axis {plan.model_axis!r}, data axis {plan.data_axis!r})",
        f"  {len(plan.decisions)} variables, {params:,} parameters, "
        f"{_fmt_bytes(plan.total_bytes)}; per device "
        f"{_fmt_bytes(plan.per_device_bytes)} = {plan.balance:.3f} x total/{n}",
        "  roles: " + ", ".join(f"{k} {v}" for k, v in sorted(roles.items()))
        + ("" if plan.traced else " (untraced: largest-dimension heuristic)"),
    ]
    lines.extend(f"  note: {note}" for note in plan.notes)
    width = max([len(p) + (5 if c > 1 else 0) for p, _, c in rows] + [8])
    lines.append(
        f"  {'variable'.ljust(width)}  {'shape':<20} {'role':<9} "
        f"{'layout':<24} per device"
    )
    for path, d, count in rows:
        label = f"{path} x{count}" if count > 1 else path
        lines.append(
            f"  {label.ljust(width)}  {str(d.shape):<20} {d.role:<9} "
            f"{_fmt_axes(d.axes):<24} {_fmt_bytes(d.device_bytes)}"
            + (" *" if d.fallback else "")
        )
    lines.append(_LEGEND)
    fallbacks = plan.fallbacks
    if fallbacks:
        lines.append(f"  fallbacks ({len(fallbacks)}, marked *):")
        seen = set()
        for d in fallbacks:
            key = (_generic_path(d.path) if group else d.path, d.fallback)
            if key in seen:
                continue
            seen.add(key)
            lines.append(f"    {key[0]} {d.shape}: {d.fallback}")
    return "\n".join(lines)
