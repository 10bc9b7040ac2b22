"""Per-variable layout decisions of `plan_layout`.

From the traced weight graph (`weight_graph`), each variable gets a role
(embedding, column- or row-parallel matmul weight, bias, vector, other), a
preferred dimension to shard on the model axis, and, when that dimension does
not divide evenly, the next best one or replication with the reason recorded.
A second (data) mesh axis then shards the largest remaining dimension.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import keras

from keras_hub_dist.plan.sizes import itemsize
from keras_hub_dist.plan.specs import shard_shape
from keras_hub_dist.plan.weight_graph import WeightGraph, WeightUse

__all__ = [
    "AxisEntry",
    "ROLE_BIAS",
    "ROLE_COLUMN",
    "ROLE_EMBEDDING",
    "ROLE_OTHER",
    "ROLE_ROW",
    "ROLE_VECTOR",
    "VariableDecision",
    "decide_layouts",
    "resolve_duplicate_paths",
]

AxisEntry = str | None

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


def _roles(uses: Sequence[WeightUse]) -> list[str]:
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
    uses: Sequence[WeightUse],
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
    use: WeightUse | None,
) -> list[int]:
    """Dimensions to try, in order.

    The preferred one first; then, for a matmul weight, its contracted (input)
    dims before its other output dims: splitting the input keeps the output
    whole, whereas another output dim (head_dim under indivisible heads) is
    split again by rotary embeddings, which XLA can only do by regathering.
    Then every dim, largest first.
    """

    def by_size(dims: Iterable[int]) -> list[int]:
        return sorted(dims, key=lambda d: (-shape[d], d))

    order: list[int] = [] if preferred is None else [preferred]
    if use is not None:
        order += by_size(d for d, _ in use.contracted)
        order += by_size(use.free_dims)
    order += by_size(range(len(shape)))
    return list(dict.fromkeys(order))


def _describe_dim(
    dim: int, shape: tuple[int, ...], use: WeightUse | None
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
    use: WeightUse | None,
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


def decide_layouts(
    variables: Sequence[Any],
    graph: WeightGraph | None,
    sizes: Mapping[str, int],
    model_axis: str,
    data_axis: str | None,
) -> list[VariableDecision]:
    """One layout per variable, from how the traced forward pass uses it.

    Args:
        variables: The model's variables (trainable first), in the order the
            weight graph indexes them.
        graph: The traced weight graph, or `None` when tracing failed (every
            weight then gets the largest-divisible-dimension heuristic).
        sizes: Mesh axis name -> size.
        model_axis: Mesh axis for tensor parallelism.
        data_axis: Mesh axis that also shards each weight's largest remaining
            dimension, or `None`.

    Returns:
        One `VariableDecision` per variable, in `variables` order.
    """
    shapes = [tuple(int(s) for s in v.shape) for v in variables]
    paths = [v.path for v in variables]
    uses = graph.uses if graph is not None else []
    roles = _roles(uses)
    preferred, use_partners = _preferred_dims(uses, roles, shapes)
    first_use: dict[int, WeightUse] = {}
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
        total = math.prod(shape) * itemsize(var.dtype)
        block = shard_shape(shape, axes, sizes)
        per_device = math.prod(block) * itemsize(var.dtype)
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


def resolve_duplicate_paths(
    decisions: Sequence[VariableDecision],
) -> list[VariableDecision]:
    """Replicates variables that share a path but were given different layouts.

    Keras assigns layouts by path, so such variables cannot keep layouts of
    their own; each one is replicated and records why.

    Args:
        decisions: One decision per variable.

    Returns:
        The decisions, with each conflicting group replaced by replicated ones.
    """
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
