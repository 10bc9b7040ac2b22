"""How a model uses its weights, read off an abstract trace of its forward pass.

The planner needs structure, not names: which weights multiply activations
that came out of which other weights, and along which dimensions. We trace the
model's stateless forward pass with `jax.make_jaxpr` on shapes only (no weight
is allocated, so a 27B model traces in seconds) and walk the jaxpr once.

Every activation dimension carries a set of *tags* `(use, var_dim)`: "this
dimension is dimension `var_dim` of the weight consumed by weight-use `use`".
A matmul's output dimensions that come from its kernel get fresh tags; the
tags then follow the data through element-wise ops, broadcasts, transposes,
reshapes (onto the major dimension of a split or merge, which is where a
sharding ends up too) and activation-activation matmuls such as `q @ k`.
When a later matmul contracts its kernel against a tagged dimension, we learn
exactly which dimension of which earlier kernel it reduces over: that is the
column-parallel / row-parallel pairing, found from data flow alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

__all__ = ["Tag", "WeightGraph", "WeightUse", "trace_weight_graph"]

Tag = tuple[int, int]  # (weight-use id, dimension of that use's variable)
Tags = frozenset  # frozenset[Tag]
_NO_TAGS: frozenset = frozenset()

# Primitives that keep a weight a weight (a cast for mixed precision, a
# transpose for a tied output embedding, ...), with the dimension bookkeeping
# done by the shape rules below.
_REDUCTIONS = {
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "reduce_and",
    "reduce_or",
    "reduce_xor",
    "argmax",
    "argmin",
}


@dataclasses.dataclass(frozen=True)
class WeightUse:
    """One place where the forward pass consumes a variable as a weight.

    Attributes:
        index: Position of this use in trace order.
        var: Index of the variable (in the order given to the tracer).
        kind: `"matmul"` (dot_general / einsum), `"gather"` (embedding lookup)
            or `"conv"`.
        free_dims: Variable dimensions that survive into the output.
        contracted: `(var_dim, tags)` for each variable dimension reduced
            against an activation dimension; `tags` say where that activation
            dimension came from.
        gathered_dims: For `"gather"`, the variable dimensions that are indexed
            (the vocabulary axis of an embedding table).
    """

    index: int
    var: int
    kind: str
    free_dims: tuple[int, ...]
    contracted: tuple[tuple[int, frozenset], ...] = ()
    gathered_dims: tuple[int, ...] = ()


@dataclasses.dataclass
class WeightGraph:
    """The weight uses of one traced forward pass.

    Attributes:
        uses: Every `WeightUse`, in trace order.
        added_to: Variable index -> ids of the weight uses whose outputs the
            variable is combined with element-wise (a bias, a norm scale).
        elementwise_vars: Variables used element-wise with activations.
        num_eqns: Number of primitive equations walked (after inlining).
    """

    uses: list[WeightUse]
    added_to: dict[int, set[int]]
    elementwise_vars: set[int]
    num_eqns: int = 0


@dataclasses.dataclass(frozen=True)
class _Weight:
    """A value computed from one variable only; `dims[i]` = variable dim."""

    var: int
    dims: tuple[int | None, ...]


@dataclasses.dataclass(frozen=True)
class _Act:
    """An activation; `tags[i]` = where dimension `i` came from."""

    tags: tuple[frozenset, ...]


_CONST = object()  # literals, constants and values computed only from them


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _reshape_groups(
    src: Sequence[int], dst: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """Groups of source / destination dims of a reshape with equal products."""
    groups = []
    i = j = 0
    while i < len(src) and j < len(dst):
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                if i >= len(src):
                    return groups
                gi.append(i)
                pi *= src[i]
                i += 1
            else:
                if j >= len(dst):
                    return groups
                gj.append(j)
                pj *= dst[j]
                j += 1
        groups.append((gi, gj))
    return groups


def _major(dims: list[int], shape: Sequence[int]) -> int | None:
    for d in dims:
        if shape[d] > 1:
            return d
    return None


def _reshape_map(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """dst dim -> src dim for the major dims of each reshape group.

    A sharding on the major source dimension of a split or merge stays on the
    major destination dimension, so that is where identity is kept.
    """
    mapping = {}
    for gi, gj in _reshape_groups(src, dst):
        a, b = _major(gi, src), _major(gj, dst)
        if a is not None and b is not None:
            mapping[b] = a
    return mapping


def _inlinable(eqn: Any) -> Any | None:
    """The body jaxpr of a call-like equation (jit, custom_jvp, remat, ...).

    Control flow (scan, while, cond) is not inlined: its body sees slices or
    several branches, so shapes would not line up. A closed body's constants
    are constants to the walker, so only the open jaxpr is returned.
    """
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, jcore.ClosedJaxpr):
                found.append(item.jaxpr)
            elif isinstance(item, jcore.Jaxpr):
                found.append(item)
    if len(found) != 1:
        return None
    body = found[0]
    if len(body.invars) != len(eqn.invars) or len(body.outvars) != len(
        eqn.outvars
    ):
        return None
    for inner, outer in zip(body.invars, eqn.invars, strict=True):
        if _shape(inner) != _shape(outer):
            return None
    return body


class _Walker:
    def __init__(self) -> None:
        self.uses: list[WeightUse] = []
        self.added_to: dict[int, set[int]] = {}
        self.elementwise_vars: set[int] = set()
        self.num_eqns = 0

    # -- environment -----------------------------------------------------

    def walk(self, jaxpr: Any, args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        for var in jaxpr.constvars:
            env[var] = _CONST
        for var, info in zip(jaxpr.invars, args, strict=True):
            env[var] = info

        def read(atom):
            if isinstance(atom, jcore.Literal):
                return _CONST
            return env.get(atom, _CONST)

        for eqn in jaxpr.eqns:
            self.num_eqns += 1
            ins = [read(v) for v in eqn.invars]
            body = _inlinable(eqn)
            if body is not None:
                outs = self.walk(body, ins)
            else:
                outs = self.apply(eqn, ins)
            for var, info in zip(eqn.outvars, outs, strict=True):
                env[var] = info
        return [read(v) for v in jaxpr.outvars]

    # -- rules -----------------------------------------------------------

    def apply(self, eqn: Any, ins: list[Any]) -> list[Any]:
        name = eqn.primitive.name
        in_shapes = [_shape(v) for v in eqn.invars]
        out_shapes = [_shape(v) for v in eqn.outvars]
        weights = [i for i, x in enumerate(ins) if isinstance(x, _Weight)]
        acts = [i for i, x in enumerate(ins) if isinstance(x, _Act)]

        if name == "dot_general":
            return [self._dot_general(eqn, ins, in_shapes, out_shapes)]
        if name == "gather" and ins and isinstance(ins[0], _Weight):
            return [self._gather_weight(eqn, ins[0], in_shapes, out_shapes[0])]
        if name == "conv_general_dilated" and isinstance(ins[1], _Weight):
            return [self._conv(eqn, ins, in_shapes, out_shapes[0])]

        if not acts and not weights:
            return [_CONST] * len(eqn.outvars)

        if weights and not acts:
            vars_ = {ins[i].var for i in weights}
            if len(vars_) == 1:
                return [
                    _Weight(ins[weights[0]].var, dims)
                    for dims in self._map_dims(
                        eqn,
                        [ins[i].dims if i in weights else None for i in
                         range(len(ins))],
                        in_shapes,
                        out_shapes,
                        weights,
                    )
                ]
            return [_Act((_NO_TAGS,) * len(s)) for s in out_shapes]

        if weights:
            self._record_elementwise(eqn, ins, weights, acts, in_shapes)
        mapped = self._map_dims(
            eqn,
            [ins[i].tags if i in acts else None for i in range(len(ins))],
            in_shapes,
            out_shapes,
            acts,
            union=True,
        )
        return [
            _Act(tuple(t if isinstance(t, frozenset) else _NO_TAGS for t in m))
            for m in mapped
        ]

    def _map_dims(
        self,
        eqn: Any,
        per_input: list[Any],
        in_shapes: list[tuple[int, ...]],
        out_shapes: list[tuple[int, ...]],
        sources: list[int],
        union: bool = False,
    ) -> list[tuple[Any, ...]]:
        """Carries per-dimension labels from inputs to outputs.

        Labels are tag sets (activations, `union=True`) or variable dims
        (weights). Unknown primitives keep the labels of every same-rank input
        on the dimensions whose size did not change (element-wise ops, slices,
        pads, cumulative ops, scatters): a conservative guess that never
        invents a correspondence between dimensions of different sizes.
        """
        name = eqn.primitive.name
        params = eqn.params
        empty = _NO_TAGS if union else None

        def combine(values):
            values = [v for v in values if v is not None]
            if union:
                out = _NO_TAGS
                for v in values:
                    out = out | v
                return out
            return values[0] if values else None

        first = sources[0]
        src_labels = per_input[first]
        src_shape = in_shapes[first]

        if name == "transpose":
            perm = params["permutation"]
            return [tuple(src_labels[p] for p in perm)]
        if name == "broadcast_in_dim":
            out_shape = out_shapes[0]
            labels = [empty] * len(out_shape)
            for i, d in enumerate(params["broadcast_dimensions"]):
                if src_shape[i] == out_shape[d]:
                    labels[d] = src_labels[i]
            return [tuple(labels)]
        if name == "reshape":
            out_shape = out_shapes[0]
            labels = [empty] * len(out_shape)
            for b, a in _reshape_map(src_shape, out_shape).items():
                labels[b] = src_labels[a]
            return [tuple(labels)]
        if name == "squeeze":
            dropped = {d % len(src_shape) for d in params["dimensions"]}
            return [
                tuple(x for d, x in enumerate(src_labels) if d not in dropped)
            ]
        if name in _REDUCTIONS and "axes" in params:
            axes = {a % len(src_shape) for a in params["axes"]}
            return [
                tuple(x for d, x in enumerate(src_labels) if d not in axes)
            ]
        if name == "stack":
            axis = params["axis"]
            outs = []
            for out_shape in out_shapes:
                labels = [empty] * len(out_shape)
                src_dims = [d for d in range(len(out_shape)) if d != axis]
                for d_in, d_out in enumerate(src_dims):
                    labels[d_out] = combine(
                        [per_input[i][d_in] for i in sources]
                    )
                outs.append(tuple(labels))
            return outs
        if name == "dot_general":  # two activations (weights handled before)
            (lc, rc), (lb, rb) = params["dimension_numbers"]
            lhs = per_input[0] or (empty,) * len(in_shapes[0])
            rhs = per_input[1] or (empty,) * len(in_shapes[1])
            labels = [combine([lhs[a], rhs[b]]) for a, b in zip(lb, rb, strict=True)]
            labels += [
                lhs[d] for d in range(len(lhs)) if d not in lc and d not in lb
            ]
            labels += [
                rhs[d] for d in range(len(rhs)) if d not in rc and d not in rb
            ]
            return [tuple(labels)]
        if name == "gather":
            if per_input[0] is None:  # a constant table indexed by activations
                return [(empty,) * len(out_shapes[0])]
            return [
                self._gather_act(
                    eqn, per_input[0], in_shapes[0], out_shapes[0], empty
                )
            ]

        outs = []
        for out_shape in out_shapes:
            labels = []
            for d, size in enumerate(out_shape):
                candidates = [
                    per_input[i][d]
                    for i in sources
                    if len(in_shapes[i]) == len(out_shape)
                    and in_shapes[i][d] == size
                ]
                labels.append(combine(candidates) if candidates else empty)
            outs.append(tuple(labels))
        return outs

    @staticmethod
    def _gather_act(eqn, src_labels, src_shape, out_shape, empty):
        dn = eqn.params["dimension_numbers"]
        slice_sizes = eqn.params["slice_sizes"]
        skipped = set(dn.collapsed_slice_dims) | set(
            getattr(dn, "operand_batching_dims", ())
        )
        kept = [d for d in range(len(src_shape)) if d not in skipped]
        labels = [empty] * len(out_shape)
        for out_dim, src_dim in zip(dn.offset_dims, kept, strict=True):
            if slice_sizes[src_dim] == src_shape[src_dim]:
                labels[out_dim] = src_labels[src_dim]
        return tuple(labels)

    def _record_elementwise(self, eqn, ins, weights, acts, in_shapes):
        """Remembers which weight-use outputs a variable is combined with."""
        for wi in weights:
            var = ins[wi].var
            self.elementwise_vars.add(var)
            w_shape = in_shapes[wi]
            for ai in acts:
                a_tags = ins[ai].tags
                if len(in_shapes[ai]) != len(w_shape):
                    continue
                for d, size in enumerate(w_shape):
                    if size > 1 and ins[wi].dims[d] is not None:
                        for use, _ in a_tags[d]:
                            self.added_to.setdefault(var, set()).add(use)

    def _new_use(self, **kwargs) -> int:
        use = WeightUse(index=len(self.uses), **kwargs)
        self.uses.append(use)
        return use.index

    def _dot_general(self, eqn, ins, in_shapes, out_shapes):
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = ins
        w_side = None
        if isinstance(rhs, _Weight) and not isinstance(lhs, _Weight):
            w_side = 1
        elif isinstance(lhs, _Weight) and not isinstance(rhs, _Weight):
            w_side = 0
        if w_side is None:
            if isinstance(lhs, _Weight) or isinstance(rhs, _Weight):
                return _Act((_NO_TAGS,) * len(out_shapes[0]))
            if lhs is _CONST and rhs is _CONST:
                return _CONST
            per_input = [
                lhs.tags if isinstance(lhs, _Act) else None,
                rhs.tags if isinstance(rhs, _Act) else None,
            ]
            return _Act(
                self._map_dims(eqn, per_input, in_shapes, out_shapes,
                               [i for i in (0, 1) if per_input[i] is not None]
                               or [0], union=True)[0]
            )
        weight = ins[w_side]
        act = ins[1 - w_side]
        act_tags = (
            act.tags
            if isinstance(act, _Act)
            else (_NO_TAGS,) * len(in_shapes[1 - w_side])
        )
        w_contract, a_contract = (rc, lc) if w_side == 1 else (lc, rc)
        w_batch, a_batch = (rb, lb) if w_side == 1 else (lb, rb)
        w_rank = len(in_shapes[w_side])
        w_free = [d for d in range(w_rank) if d not in w_contract and d not in w_batch]
        contracted = []
        for wd, ad in zip(w_contract, a_contract, strict=True):
            vd = weight.dims[wd]
            if vd is not None:
                contracted.append((vd, act_tags[ad]))
        free_var_dims = tuple(
            weight.dims[d] for d in w_free if weight.dims[d] is not None
        )
        use = self._new_use(
            var=weight.var,
            kind="matmul",
            free_dims=free_var_dims,
            contracted=tuple(contracted),
        )
        a_rank = len(act_tags)
        a_free = [d for d in range(a_rank) if d not in a_contract and d not in a_batch]
        batch = [act_tags[d] for d in a_batch]
        a_labels = [act_tags[d] for d in a_free]
        w_labels = [
            frozenset({(use, weight.dims[d])})
            if weight.dims[d] is not None
            else _NO_TAGS
            for d in w_free
        ]
        if w_side == 1:
            return _Act(tuple(batch + a_labels + w_labels))
        return _Act(tuple(batch + w_labels + a_labels))

    def _gather_weight(self, eqn, weight, in_shapes, out_shape):
        dn = eqn.params["dimension_numbers"]
        src_shape = in_shapes[0]
        gathered = tuple(
            weight.dims[d]
            for d in dn.start_index_map
            if weight.dims[d] is not None
        )
        use_id = len(self.uses)
        labels = self._gather_act(
            eqn,
            tuple(
                frozenset({(use_id, v)}) if v is not None else _NO_TAGS
                for v in weight.dims
            ),
            src_shape,
            out_shape,
            _NO_TAGS,
        )
        free = tuple(
            next(iter(t))[1] for t in labels if t
        )
        self._new_use(
            var=weight.var, kind="gather", free_dims=free, gathered_dims=gathered
        )
        return _Act(labels)

    def _conv(self, eqn, ins, in_shapes, out_shape):
        dn = eqn.params["dimension_numbers"]
        lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
        weight = ins[1]
        act = ins[0]
        act_tags = (
            act.tags if isinstance(act, _Act) else (_NO_TAGS,) * len(in_shapes[0])
        )
        out_feature = weight.dims[rhs_spec[0]]
        in_feature = weight.dims[rhs_spec[1]]
        contracted = ()
        if in_feature is not None:
            contracted = ((in_feature, act_tags[lhs_spec[1]]),)
        use = self._new_use(
            var=weight.var,
            kind="conv",
            free_dims=(out_feature,) if out_feature is not None else (),
            contracted=contracted,
        )
        labels = [_NO_TAGS] * len(out_shape)
        labels[out_spec[0]] = act_tags[lhs_spec[0]]
        if out_feature is not None:
            labels[out_spec[1]] = frozenset({(use, out_feature)})
        return _Act(tuple(labels))


def trace_weight_graph(
    fn: Callable[..., Any],
    variable_avals: Sequence[jax.ShapeDtypeStruct],
    input_avals: Any,
) -> WeightGraph:
    """Traces `fn(variables, inputs)` on shapes only and records weight uses.

    Args:
        fn: A function of `(list_of_variable_values, inputs)`.
        variable_avals: One `jax.ShapeDtypeStruct` per variable.
        input_avals: A pytree of `jax.ShapeDtypeStruct` for the inputs.

    Returns:
        The `WeightGraph`; variable indices follow `variable_avals`.
    """
    closed = jax.make_jaxpr(fn)(list(variable_avals), input_avals)
    walker = _Walker()
    n_vars = len(variable_avals)
    n_flat_inputs = len(jax.tree_util.tree_leaves(input_avals))
    args: list[Any] = []
    for i, var in enumerate(closed.jaxpr.invars):
        if i < n_vars:
            args.append(_Weight(i, tuple(range(len(_shape(var))))))
        else:
            args.append(_Act((_NO_TAGS,) * len(_shape(var))))
    assert len(args) == n_vars + n_flat_inputs
    walker.walk(closed.jaxpr, args)
    return WeightGraph(
        uses=walker.uses,
        added_to=walker.added_to,
        elementwise_vars=walker.elementwise_vars,
        num_eqns=walker.num_eqns,
    )
