"""Tensor-parallel layout maps for the KerasHub LLM families, valid per shape.

`get_layout_map` returns KerasHub's own `get_layout_map` for the families that
have one (Gemma / Gemma 2, Llama 2 / 3, Qwen 2.5, Qwen MoE, Qwen 3 MoE) and a
map with the same conventions for those that lack one (`family_rules`: Gemma
3 and Gemma 4 follow Gemma's rules; Qwen 3, Mistral, Qwen 3.5, Qwen 3.5 MoE,
Mixtral and gpt-oss follow Llama's). Untied output embeddings
(`token_embedding/reverse_embeddings`), which KerasHub's maps leave
replicated, are sharded like the input table, and Qwen 3 MoE's expert banks,
which KerasHub's map leaves replicated, are added. Gemma's hidden-width norm
scales (every Gemma family), which KerasHub's map leaves replicated, go on
the model axis: that keeps the residual stream split over it, and with it
the activations a fit step keeps for its backward pass (Gemma-7B width, fit
8 x 512 on (1, 8): 0.59x KerasHub's temporaries per decoder block;
`family_rules`, docs/layouts.md).

Mixture-of-Experts banks (Mixtral, Qwen 3 / 3.5 MoE, gpt-oss, Gemma 4
26B-A4B) are split along the expert axis, which keeps each expert's matmuls
local with one all-reduce, as KerasHub runs every expert on every token;
where the model axis does not divide the expert count they move to the
expert-FFN dimension (a reported fallback), and where it divides neither,
`get_layout_map` raises a `LayoutError` naming the variable, its shape and
the axis size rather than replicate the bank (details in `family_rules`).

A hand-written map shards an axis without knowing its size, so KerasHub's
Gemma map asks to split the KV-heads axis of `gemma_2b_en` (1 KV head) or
`gemma2_2b_en` (4 KV heads) over 8 devices, which JAX rejects. When the
variables' shapes are known (a model, an abstract model or a named
architecture), every variable's layout is checked against the mesh from
shapes alone; where an axis does not divide, the mesh axes move to another
dimension of that variable that they divide (the largest free one, else
merged into an already sharded one), or the variable is replicated on them.
Each such variable gets an exact-path entry (or, where every variable of a
rule falls back alike, the rule is rewritten, so another build whose
auto-generated layer names differ still matches), is listed in the map's
`report` (`LayoutReport`) and announced by one `LayoutFallbackWarning`.

Example:

```python
import keras
import keras_hub_dist

mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"))
layout_map = keras_hub_dist.get_layout_map("gemma_2b_en", mesh)
layout_map.report.fallbacks[0].path   # 'decoder_block_0/attention/key/kernel'
distribution = keras.distribution.ModelParallel(
    layout_map=layout_map, batch_dim_name="batch"
)
```
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import keras

from keras_hub_dist.errors import LayoutError
from keras_hub_dist.errors import LayoutFallbackWarning
from keras_hub_dist.plan import family_rules
from keras_hub_dist.plan import presets
from keras_hub_dist.plan import quantization
from keras_hub_dist.plan import specs
from keras_hub_dist.plan.build import variable_specs
from keras_hub_dist.plan.family_rules import ExpertBank, VocabularyTable
from keras_hub_dist.plan.families import keras_hub_family
from keras_hub_dist.plan.mesh import axis_sizes
from keras_hub_dist.plan.mesh import device_mesh as parse_mesh
from keras_hub_dist.plan.quantized_layouts import add_quantized_entries

__all__ = [
    "LayoutFallback",
    "LayoutReport",
    "ReportingLayoutMap",
    "get_layout_map",
    "supported_families",
]

Axes = tuple[Any, ...]


def supported_families() -> list[str]:
    """Registry families `get_layout_map` has a map for (without a model)."""
    return sorted(
        {"gemma", "llama", "llama3", "qwen", "qwen_moe", "qwen3_moe"}
        | set(family_rules.hand_written_families())
    )


@dataclasses.dataclass(frozen=True)
class LayoutFallback:
    """One variable whose requested layout did not divide its shape.

    Attributes:
        path: The variable path.
        shape: Its full shape.
        rule: The LayoutMap key whose layout was requested.
        requested: The requested axes (one entry per dimension).
        used: The axes used instead (entries moved, or dropped = replicated).
        reason: Why the requested axes could not be used.
    """

    path: str
    shape: tuple[int, ...]
    rule: str
    requested: Axes
    used: Axes
    reason: str

    @property
    def replicated_axes(self) -> tuple[str, ...]:
        """Mesh axes the requested layout used that the fallback does not."""
        return tuple(
            sorted(set(_names_of(self.requested)) - set(_names_of(self.used)))
        )


@dataclasses.dataclass(frozen=True)
class LayoutReport:
    """What `get_layout_map` checked and where it fell back.

    Attributes:
        family: The registry family of the model (e.g. `"gemma"`).
        source: `"keras_hub"` when KerasHub's own `get_layout_map` gave the
            rules, `"keras_hub_dist"` for this package's.
        mesh_axis_sizes: Mesh axis name -> size.
        checked: Whether variable shapes were known and every layout checked.
            `False` for a backbone class alone: pass a model, an abstract
            model or a named architecture to get a map checked per shape.
        num_variables: Variables checked.
        fallbacks: One entry per variable whose layout fell back.
    """

    family: str | None
    source: str
    mesh_axis_sizes: Mapping[str, int]
    checked: bool
    num_variables: int
    fallbacks: tuple[LayoutFallback, ...]

    def summary(self) -> str:
        """A few lines: what was checked and each distinct fallback."""
        sizes = dict(self.mesh_axis_sizes)
        if not self.checked:
            return (
                f"{self.family} layout map ({self.source}) for mesh {sizes}: "
                "not checked against variable shapes (no model given)."
            )
        lines = [
            f"{self.family} layout map ({self.source}) for mesh {sizes}: "
            f"{self.num_variables} variables checked, "
            f"{len(self.fallbacks)} fell back."
        ]
        for (rule, shape, requested, used), paths in _grouped(self.fallbacks):
            dropped = {
                name: sizes[name]
                for name in sorted(set(_names_of(requested)) - set(_names_of(used)))
            }
            replicated = f", REPLICATED over mesh axes {dropped}" if dropped else ""
            lines.append(
                f"  {len(paths)} x {paths[0]!r}{' ...' if len(paths) > 1 else ''}"
                f" shape {shape}: {requested} -> {used}{replicated} "
                f"(rule {rule!r})"
            )
        return "\n".join(lines)


class ReportingLayoutMap(keras.distribution.LayoutMap):
    """A `keras.distribution.LayoutMap` that carries its `LayoutReport`.

    Lookups are remembered per path until the map changes: Keras's
    `__getitem__` full-matches every key as a regular expression for each
    path, and a model's build asks once per variable per distribution step
    (1.4M lookups, ~20% of tests/plan/test_layouts_new_models.py's profile).
    The answer is Keras's own, the same object; an ambiguous path still
    raises each time.
    """

    def __init__(self, device_mesh: Any, report: LayoutReport | None = None):
        super().__init__(device_mesh)
        self.report = report
        self._found: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        try:
            return self._found[key]
        except KeyError:
            layout = self._found[key] = super().__getitem__(key)
            return layout

    def __setitem__(self, key: str, layout: Any) -> None:
        self._found.clear()
        if isinstance(layout, tuple):  # an entry may name both mesh axes
            layout = specs.tensor_layout(layout)
        super().__setitem__(key, layout)

    def __delitem__(self, key: str) -> Any:
        self._found.clear()
        return super().__delitem__(key)


def _names_of(axes: Sequence[Any]) -> list[str]:
    return [name for entry in axes for name in specs.entry_axes(entry)]


def _grouped(fallbacks: Sequence[LayoutFallback]):
    groups: dict[tuple, list[str]] = {}
    for fallback in fallbacks:
        key = (fallback.rule, fallback.shape, fallback.requested, fallback.used)
        groups.setdefault(key, []).append(fallback.path)
    return list(groups.items())


def _target(model_or_class_or_name: Any) -> tuple[type, list[tuple[str, tuple]] | None]:
    """`(backbone class, [(path, shape)] or None)` for what the user passed."""
    target = model_or_class_or_name
    if isinstance(target, presets.PresetEntry):
        target = target.name
    if isinstance(target, str):
        cls, _, _ = presets.backbone_config(target)  # a name or preset dir
        return cls, [(spec.path, spec.shape) for spec in variable_specs(target)]
    model = getattr(target, "model", None)  # an `AbstractBackbone`
    if isinstance(model, keras.Model):
        target = model
    if isinstance(target, type):
        return target, None
    if isinstance(target, keras.Model):
        backbone = getattr(target, "backbone", None)
        family_source = backbone if isinstance(backbone, keras.Model) else target
        return type(family_source), _float_variables(target)
    raise TypeError(
        "Expected a KerasHub backbone or task (built or abstract), a backbone "
        "class, or a named architecture such as 'gemma_7b_en'. Received: "
        f"{model_or_class_or_name!r}."
    )


def _float_variables(model: keras.Model) -> list[tuple[str, tuple]]:
    """`(path, shape)` of a model's variables, each quantized tensor as its
    float tensor (the layout map's rules name float kernels; the quantized
    variables' layouts derive from theirs, `quantized_layouts`)."""
    tensors = quantization.quantized_tensors(model)
    quantized = {id(v) for t in tensors for v in t.variables}
    out = [(t.float_path, t.float_shape) for t in tensors]
    out += [(v.path, tuple(v.shape)) for v in model.weights if id(v) not in quantized]
    return out


def _quantized_entries(model_or_class_or_name: Any, layout_map: ReportingLayoutMap) -> None:
    """Exact entries for the quantized variables of a quantized model."""
    target = model_or_class_or_name
    model = getattr(target, "model", None)  # an `AbstractBackbone`
    if isinstance(model, keras.Model):
        target = model
    if not isinstance(target, keras.Model):
        return
    tensors = quantization.quantized_tensors(target)
    float_axes = {}
    for tensor in tensors:
        layout = layout_map[tensor.float_path]
        float_axes[tensor.float_path] = tuple(layout.axes) if layout is not None else ()
    add_quantized_entries(layout_map, tensors, float_axes)


def _base_rules(
    cls: type, family: str | None, mesh: keras.distribution.DeviceMesh,
    model_dim: str, data_dim: str,
) -> tuple[dict[str, Axes], dict[str, ExpertBank | VocabularyTable], str]:
    """`(rules: key -> axes, key -> the `ExpertBank` or `VocabularyTable`
    rule of the keys that have one, source)`."""
    keras_hub_map = getattr(cls, "get_layout_map", None)
    written = None
    if not callable(keras_hub_map):
        written = family_rules.family_rules(family, model_dim, data_dim)
    if callable(keras_hub_map):
        layout_map = keras_hub_map(
            mesh,
            model_parallel_dim_name=model_dim,
            data_parallel_dim_name=data_dim,
        )
        rules: dict[str, Any] = {key: tuple(layout_map[key].axes) for key in layout_map}
        source = "keras_hub"
    elif written is not None:
        rules, source = written, "keras_hub_dist"
    else:
        raise LayoutError(
            f"No layout map is known for {cls.__name__} (registry family "
            f"{family!r}). Expected a backbone of one of the families "
            f"{supported_families()}. Received: {cls.__module__}."
            f"{cls.__name__}. Write a keras.distribution.LayoutMap for it, or "
            "use automatic planning (keras_hub_dist.plan_layout) when available."
        )
    for key, axes in family_rules.extra_rules(family, model_dim, data_dim).items():
        rules.setdefault(key, axes)
    rules.update(family_rules.vocabulary_rules(model_dim, data_dim))
    special = {key: rule for key, rule in rules.items() if isinstance(rule, (ExpertBank, VocabularyTable))}
    axes_of = {key: rule.axes if key in special else tuple(rule) for key, rule in rules.items()}
    return axes_of, special, source


def _fallback_axes(
    shape: tuple[int, ...], axes: Axes, sizes: Mapping[str, int]
) -> Axes:
    """Moves mesh axes off dimensions they do not divide (see module doc)."""

    def parts(entry: Any) -> int:
        return math.prod(sizes[name] for name in specs.entry_axes(entry))

    used: list[Any] = list(axes) + [None] * (len(shape) - len(axes))
    homeless: list[tuple[str, ...]] = []
    for dim, entry in enumerate(used):
        if entry is not None and shape[dim] % parts(entry):
            homeless.append(specs.entry_axes(entry))
            used[dim] = None
    for names in homeless:
        need = math.prod(sizes[name] for name in names)
        free = [
            dim for dim, entry in enumerate(used)
            if entry is None and shape[dim] % need == 0
        ]
        if free:
            # The largest free dimension keeps shards as large as possible
            # (fewer, bigger blocks per device for the same bytes).
            dim = max(free, key=lambda d: (shape[d], -d))
            used[dim] = names[0] if len(names) == 1 else names
            continue
        merged = [
            dim for dim, entry in enumerate(used)
            if entry is not None and shape[dim] % (parts(entry) * need) == 0
        ]
        if merged:
            dim = max(merged, key=lambda d: (shape[d], -d))
            used[dim] = specs.entry_axes(used[dim]) + names
        # Otherwise the variable stays replicated along `names`.
    return tuple(used)


def _keras_axes(axes: Axes, sizes: Mapping[str, int]) -> Axes:
    """`axes` with at most one mesh axis per dimension, as Keras layouts take.

    A merged entry (`_fallback_axes`) keeps its axes of size > 1 only, and of
    those the largest; the others are replicated (the fallback reports it).
    """
    result: list[Any] = []
    for entry in axes:
        names = specs.entry_axes(entry)
        if len(names) <= 1:
            result.append(names[0] if names else None)
            continue
        big = [name for name in names if sizes[name] > 1]
        result.append(max(big, key=lambda n: sizes[n]) if big else names[0])
    return tuple(result)


def _fallback_entries(
    fallbacks: Sequence[LayoutFallback],
    matched: Mapping[str, int],
    rules: Mapping[str, Axes],
) -> dict[str, Axes]:
    """LayoutMap entries for the fallbacks: an exact-path entry each, except
    where every variable a rule matches fell back to the same axes: then the
    rule itself is rewritten, which also holds for another build of the model
    whose auto-generated layer names differ (e.g. `mixtral_sparse_moe_block_1`
    in a process that built Mixtral before)."""
    by_rule: dict[str, list[LayoutFallback]] = {}
    for fallback in fallbacks:
        by_rule.setdefault(fallback.rule, []).append(fallback)
    entries: dict[str, Axes] = {}
    for rule, group in by_rule.items():
        if (
            rule in rules
            and len(group) == matched.get(rule, 0)
            and len({fallback.used for fallback in group}) == 1
        ):
            entries[rule] = group[0].used
        else:
            entries.update((fallback.path, fallback.used) for fallback in group)
    return entries


def _check_axis_names(
    mesh: keras.distribution.DeviceMesh, model_dim: str, data_dim: str
) -> None:
    for role, name in (
        ("model_parallel_dim_name", model_dim),
        ("data_parallel_dim_name", data_dim),
    ):
        if name not in mesh.axis_names:
            raise LayoutError(
                f"The device mesh has no axis named {name!r} ({role}). "
                f"Expected one of {list(mesh.axis_names)}. Received: "
                f"{role}={name!r}, mesh shape {tuple(mesh.shape)}. Pass the "
                "mesh's axis name, or build the mesh with that name."
            )


def get_layout_map(
    model_or_class_or_name: Any,
    device_mesh: Any,
    model_parallel_dim_name: str = "model",
    data_parallel_dim_name: str = "batch",
) -> ReportingLayoutMap:
    """A `LayoutMap` for a KerasHub LLM, checked against its variable shapes.

    Uses KerasHub's own `get_layout_map` where the backbone class has one,
    and the same conventions otherwise (Gemma 3 / 4: Gemma's; Qwen 3,
    Mistral, Qwen 3.5 (+ MoE), Mixtral, gpt-oss: Llama's; see
    `family_rules`), plus `family_rules.extra_rules` (untied output
    embeddings, Gemma's norm scales on the model axis, Qwen 3 MoE's
    expert banks). Given shapes (a model or named architecture), every
    variable's layout is validated from shapes alone (no weight is
    allocated); where a mesh axis does not divide a dimension it is moved to
    another dimension of that variable or dropped (replicated), with an
    exact-path entry, a `LayoutFallback` in `layout_map.report` and a
    `LayoutFallbackWarning`. An expert bank whose expert count the model axis
    does not divide moves to its expert-FFN dimension (also a fallback).
    For a quantized model (`model.quantize("int8" | "int4")`, or built from
    a quantized preset) every quantized variable gets an exact-path entry
    derived from its float kernel's layout (`quantized_layouts`): int4
    kernels keep their float kernels' paths with another shape.

    Args:
        model_or_class_or_name: A KerasHub backbone or task (built, or
            abstract from `abstract_backbone`), a backbone class (rules only,
            unchecked), a named architecture / alias such as
            `"gemma_7b_en"` or a local preset directory (built abstractly to
            get its shapes).
        device_mesh: A `keras.distribution.DeviceMesh`, a `jax.sharding.Mesh`,
            or a `{axis_name: size}` dict (an abstract mesh, for planning).
        model_parallel_dim_name: The mesh axis weights are split over.
        data_parallel_dim_name: The mesh axis the batch is split over (also
            used for a second weight axis, as in KerasHub's maps).

    Returns:
        A `ReportingLayoutMap` (a `keras.distribution.LayoutMap`) whose
        `report` is a `LayoutReport`.

    Raises:
        LayoutError: an axis name is not in the mesh, the family has no map,
            or the model axis divides neither the expert count nor the expert
            FFN width of an expert bank (the message names the variable, its
            shape and the axis size; a bank is never replicated silently).

    Example:

    >>> mesh = keras_hub_dist.plan.mesh.abstract_device_mesh((1, 8))
    >>> layout_map = get_layout_map("gemma2_2b_en", mesh)
    >>> len(layout_map.report.fallbacks) > 0   # 4 KV heads on 8 devices
    True
    """
    mesh = parse_mesh(device_mesh, abstract=True)
    _check_axis_names(mesh, model_parallel_dim_name, data_parallel_dim_name)
    cls, variables = _target(model_or_class_or_name)
    family = keras_hub_family(cls)
    rules, special, source = _base_rules(
        cls, family, mesh, model_parallel_dim_name, data_parallel_dim_name
    )
    sizes = axis_sizes(mesh)
    layout_map = ReportingLayoutMap(mesh)
    for key, axes in rules.items():
        layout_map[key] = axes
    fallbacks: list[LayoutFallback] = []
    matched: dict[str, int] = {}
    for path, shape in variables or ():
        layout = layout_map[path]
        if layout is None:
            continue
        requested = tuple(layout.axes)
        rule = next((key for key in rules if layout_map[key] is layout), path)
        matched[rule] = matched.get(rule, 0) + 1
        wanted, reasons = requested, []
        if isinstance(special.get(rule), VocabularyTable):
            # Over both axes where they divide the vocabulary, else KerasHub's.
            try:
                specs.validate_spec(path, shape, requested, sizes)
            except LayoutError:
                wanted = special[rule].otherwise
                reasons.append(
                    f"mesh axes {dict(sizes)} do not divide the vocabulary: the "
                    "table keeps KerasHub's split (the vocabulary on the model "
                    "axis, the hidden dimension on the data axis)."
                )
        elif rule in special:
            # Experts first, else the expert FFN, else a LayoutError.
            bank = special[rule]
            wanted = family_rules.expert_axes(
                path, tuple(shape), bank, sizes, model_parallel_dim_name
            )
            if wanted != requested:
                on_experts = model_parallel_dim_name in specs.entry_axes(wanted[bank.expert_dim])
                reasons.append(
                    f"mesh axes {dict(sizes)} do not divide the expert count "
                    f"{shape[bank.expert_dim]}: "
                    + ("the bank keeps its experts on the model axis only." if on_experts else
                       f"the bank is split along its expert FFN dimension ({shape[bank.ffn_dim]}).")
                )
        try:
            specs.validate_spec(path, shape, wanted, sizes)
            used = wanted
        except LayoutError as error:
            reasons.append(str(error))
            used = _keras_axes(_fallback_axes(shape, wanted, sizes), sizes)
        if used == requested:
            continue
        reason = " ".join(reasons)
        specs.validate_spec(path, shape, used, sizes)
        fallbacks.append(
            LayoutFallback(path, tuple(shape), rule, requested, used, reason)
        )
    for key, axes in _fallback_entries(fallbacks, matched, rules).items():
        if key in rules:  # a rule rewritten, or an exact-path rule
            del layout_map[key]
        layout_map[key] = axes
    _quantized_entries(model_or_class_or_name, layout_map)
    layout_map.report = LayoutReport(
        family=family,
        source=source,
        mesh_axis_sizes=dict(sizes),
        checked=variables is not None,
        num_variables=len(variables or ()),
        fallbacks=tuple(fallbacks),
    )
    if fallbacks:
        warnings.warn(
            f"{len(fallbacks)} variable(s) could not use their requested "
            f"layout on mesh {dict(sizes)}: a mesh axis does not divide their "
            "shape, so it was moved to another dimension or dropped "
            "(replicated).\n" + layout_map.report.summary() + "\nInspect "
            "`layout_map.report`; choose a mesh whose model axis divides the "
            "head (and expert) counts to avoid this.",
            LayoutFallbackWarning,
            stacklevel=2,
        )
    return layout_map
