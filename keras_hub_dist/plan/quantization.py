"""What `model.quantize(mode)` makes of a model, from shapes alone.

Keras 3.15's `Model.quantize("int8" | "int4")` visits every leaf layer and
quantizes those of exactly the classes `Dense`, `EinsumDense`, `Embedding`
and `ReversibleEmbedding` (subclasses and other layers raise
`NotImplementedError`, which it turns into a warning: KerasHub's expert banks
and custom layers stay in full precision). Per float tensor `X` it computes,
with NumPy on the host (`to_numpy=True`), in `X`'s own dtype:

- **int8** (`AbsMaxQuantizer`): `scale = 127 / (max(|X|, over the reduced
  axes, keepdims) + 1e-7)`, `values = int8(clip(round(X * scale), -127,
  127))` (round half to even). Reduced axes: a `Dense` kernel's input axis
  0, an `EinsumDense` kernel's contracted axes (the kernel labels absent from
  the output), an embedding table's axis 1 (one scale per token), an untied
  output table's axis 0. The scale variable is the keepdims scale squeezed
  (`Dense`, embeddings) or, for `EinsumDense`, transposed / expanded /
  squeezed into the output's label order (`_adjust_scale_for_quant`).
- **int4** (`Int4QuantizationConfig()`, groups of `block_size=128`, policy
  `int4/128`): on a 2-D matrix `M` (a `Dense` kernel, an `EinsumDense`
  kernel reshaped in C order to `(prod(reduced dims), prod(other dims))`, an
  embedding table, an untied output table), groups of 128 along one axis
  (the input axis; an embedding table's axis 1), the last group zero-padded:
  `scale = (max - min + 1e-7) / 15`, `zero = clip(round(-min / scale) - 8,
  -8, 7)`, `values = int8(clip(round(M / scale) + zero, -8, 7))`, then two
  values per byte (`pack_int4`, low nibble first) along the packed axis:
  `M`'s axis 1 (`Dense`, `EinsumDense`, the embedding table) or 0 (the
  output table). Scale and zero (`int8`; the output table's zero in its
  float dtype) have `M`'s shape with the group axis replaced by the number of
  groups; `g_idx` (float32) is each row's group.

This module describes that (`QuantizedTensor`, with an `Int8Rule` or
`Int4Rule`), validates the arguments, and builds the quantized structure of
a model whose variables have no value yet (`quantize_without_values`):
Keras's own `quantized_build` runs, so the variables, their order, dtypes
and the layers' dtype policies are stock's; no float kernel is allocated.

Example:

```python
backbone, created = build_without_values(cls, config)
result = quantize_without_values(backbone, "int8")
result.tensors[0].values.path   # 'token_embedding/embeddings' (int8)
```
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import keras

from keras_hub_dist import _compat
from keras_hub_dist.errors import QuantizationError

__all__ = [
    "Int4Rule",
    "Int8Rule",
    "QuantizedModel",
    "QuantizedTensor",
    "SUPPORTED_MODES",
    "check_quantize_arguments",
    "group_index_shape",
    "prospective_tensors",
    "quantize_without_values",
    "quantized_tensors",
    "scale_shape",
    "values_shape",
]

# What `load_sharded_preset(..., quantize=)` computes; Keras's other modes need
# training (float8) or calibration data (gptq, awq).
SUPPORTED_MODES = ("int8", "int4")
_KINDS = {
    keras.layers.Dense: "dense",
    keras.layers.EinsumDense: "einsum",
    keras.layers.Embedding: "embedding",
    keras.layers.ReversibleEmbedding: "reversible",
}


@dataclasses.dataclass(frozen=True)
class Int8Rule:
    """Per-channel abs-max int8 of a float tensor `X` (values: `X`'s shape).

    Attributes:
        reduced: Axes of `X` the maximum runs over.
        scale_axes: Per axis of the scale variable, the axis of `X` it spans,
            or `None` for a size-1 axis.
    """

    reduced: tuple[int, ...]
    scale_axes: tuple[int | None, ...]


@dataclasses.dataclass(frozen=True)
class Int4Rule:
    """Grouped (or, `block_size=None`, per-channel) int4 of a matrix `M`.

    Attributes:
        matrix: `M`'s shape: the float tensor itself or (`EinsumDense`) its
            C-order reshape.
        group_axis: The axis of `M` the groups (or the per-channel range) run
            along.
        pack_axis: The axis of `M` two values are packed per byte along.
        block_size: Rows per group; `None` for per-channel int4.
    """

    matrix: tuple[int, int]
    group_axis: int
    pack_axis: int
    block_size: int | None

    @property
    def num_groups(self) -> int:
        return math.ceil(self.matrix[self.group_axis] / self.block_size) if self.block_size else 1


Rule = Int8Rule | Int4Rule


@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
    """One float tensor of a quantized layer and the variables it became.

    Attributes:
        layer_path: The layer's path.
        mode: `"int8"` or `"int4"`.
        float_path: The float variable's path (the quantized values keep it).
        float_shape: The float variable's shape.
        rule: How values, scale and zero derive from the float tensor.
        values: The quantized (int8, or int4 packed into int8) variable.
        scale: The scale variable.
        zero: The int4 zero point variable (`None` for int8 / per-channel).
        group_index: The int4 `g_idx` variable (`None` where Keras has none).
        float_variable: The removed float variable (only when quantized here,
            by `quantize_without_values`).
    """

    layer_path: str
    mode: str
    float_path: str
    float_shape: tuple[int, ...]
    rule: Rule
    values: Any = dataclasses.field(repr=False)
    scale: Any = dataclasses.field(repr=False)
    zero: Any = dataclasses.field(default=None, repr=False)
    group_index: Any = dataclasses.field(default=None, repr=False)
    float_variable: Any = dataclasses.field(default=None, repr=False)

    @property
    def variables(self) -> tuple[Any, ...]:
        """Values, scale, zero and g_idx (those that exist)."""
        return tuple(v for v in (self.values, self.scale, self.zero, self.group_index) if v is not None)


@dataclasses.dataclass(frozen=True)
class QuantizedModel:
    """The outcome of `quantize_without_values`.

    Attributes:
        tensors: One per quantized float tensor, in layer order.
        removed: The float variables the model no longer holds (never to be
            given a value).
        created: The new variables, all without a value.
        skipped: Paths of leaf layers `Model.quantize` would warn about and
            leave in full precision (e.g. expert banks).
    """

    tensors: tuple[QuantizedTensor, ...]
    removed: tuple[Any, ...]
    created: tuple[Any, ...]
    skipped: tuple[str, ...]


def _policy_name(dtype: Any) -> tuple[str | None, str | None]:
    """`(compute dtype, quantization mode)` of a dtype argument (None: global)."""
    if dtype is None:
        policy = keras.config.dtype_policy()
    else:
        try:
            policy = keras.dtype_policies.get(dtype)
        except (ValueError, TypeError):
            return None, None
    return policy.compute_dtype, policy.quantization_mode


def check_quantize_arguments(quantize: Any, dtype: Any) -> str | None:
    """Validates `quantize=` and `dtype=` together, before anything is built.

    Returns:
        The mode, or `None` without quantization.

    Raises:
        QuantizationError: An unknown mode (the message lists the modes), a
            mode this Keras does not know, a dtype naming integer weights
            (which `quantize=` gives), or a dtype the mode cannot take (int8
            with a float16 compute dtype, refused by Keras's `quantize`).
    """
    compute, mode_of_dtype = _policy_name(dtype)
    is_float = compute is not None and "float" in compute and mode_of_dtype is None
    if dtype is not None and not is_float:
        raise QuantizationError(
            "Weights are loaded in a float dtype. Expected dtype to be a float "
            "dtype or dtype policy, e.g. 'bfloat16', 'float16', 'float32' or "
            f"'mixed_bfloat16'. Received: dtype={dtype!r}. For int8 weights, "
            'load in a float dtype and quantize: quantize="int8" (quantize= '
            f"takes one of {', '.join(repr(m) for m in SUPPORTED_MODES)}), e.g. "
            'load_sharded_preset(preset, dtype="bfloat16", quantize="int8"): '
            "dtype= is then the float dtype of the scales and activations."
        )
    if quantize is None:
        return None
    if quantize not in SUPPORTED_MODES:
        raise QuantizationError(
            f"Unknown quantization mode. Expected quantize= to be one of "
            f"{', '.join(repr(m) for m in SUPPORTED_MODES)} (or None). "
            f"Received: quantize={quantize!r}. Keras's other modes (float8, "
            "gptq, awq) need training or calibration data: load the model, "
            "then call model.quantize(...) yourself."
        )
    known = _compat.quantization_modes()
    if quantize not in known:
        raise QuantizationError(
            f"This Keras ({keras.__version__}) does not support "
            f"quantize={quantize!r}. Expected a mode of Keras's "
            f"`model.quantize`: {', '.join(repr(m) for m in known)}. "
            "Upgrade Keras (int4 in groups of 128 needs Keras >= 3.15) or "
            "choose another mode."
        )
    if quantize == "int8" and compute == "float16":
        raise QuantizationError(
            f"quantize='int8' cannot take dtype={dtype!r}: Keras refuses "
            "int8 quantization with a float16 compute dtype (its scales "
            "overflow). Expected a bfloat16 or float32 compute dtype, e.g. "
            "dtype='bfloat16' or 'mixed_bfloat16'. Received: compute dtype "
            "float16."
        )
    return quantize


def _einsum_scale_axes(info: dict[str, Any], rank: int) -> tuple[int | None, ...]:
    """`EinsumDense._adjust_scale_for_quant` on axis labels: which kernel
    axis each axis of the kernel scale spans (`None`: size 1)."""
    labels: list[int | None] = list(range(rank))
    if info["transpose"]:
        labels = [labels[i] for i in info["transpose"]]
    for axis in sorted(info["expand"]):
        labels.insert(axis, None)
    for axis in sorted(info["squeeze"], reverse=True):
        del labels[axis]
    return tuple(None if a in info["reduced"] else a for a in labels)


def _rule(kind: str, which: str, mode: str, shape: tuple[int, ...], info: dict[str, Any]) -> Rule:
    """The rule of one float tensor (`which`: "kernel", "embeddings" or
    "reverse_embeddings") of a layer of `kind`."""
    if mode == "int8":
        if kind == "einsum":
            return Int8Rule(tuple(info["reduced"]), _einsum_scale_axes(info, len(shape)))
        reduced = 1 if which == "embeddings" else 0
        return Int8Rule((reduced,), (1 - reduced,))
    block = info.get("block_size")
    if kind == "einsum":
        rows = math.prod(d for i, d in enumerate(shape) if i in info["reduced"])
        return Int4Rule((rows, math.prod(shape) // rows), 0, 1, block)
    if which == "embeddings":
        return Int4Rule(tuple(shape), 1, 1, block)
    return Int4Rule(tuple(shape), 0, 1 if kind == "dense" else 0, block)


def _layer_kind(layer: Any) -> str | None:
    return _KINDS.get(type(layer))


def _layer_info(layer: Any, kind: str) -> dict[str, Any]:
    """An einsum's reduction analysis; a quantized layer's int4 block size
    (its policy's) and float kernel shape (`original_kernel_shape`)."""
    info: dict[str, Any] = dict(_compat.einsum_reduction(layer)) if kind == "einsum" else {}
    policy = layer.dtype_policy
    if isinstance(policy, keras.dtype_policies.DTypePolicyMap):
        policy = policy[layer.path]
    block = getattr(policy, "block_size", None)
    info["block_size"] = None if block in (None, -1) else block
    if getattr(layer, "original_kernel_shape", None) is not None:
        info["float_shape"] = tuple(int(d) for d in layer.original_kernel_shape)
    return info


def _own_variable(layer: Any, name: str) -> Any:
    """The layer's variable `name` (found by path: no property that would
    compute, e.g. unpack an int4 kernel, is read)."""
    path = f"{layer.path}/{name}"
    return next((v for v in layer.weights if v.path == path), None)


def _float_tensors(layer: Any, kind: str, info: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """`(which, float shape)` per float tensor of a layer, quantized or not."""
    if kind in ("dense", "einsum"):
        kernel = tuple(int(d) for d in _own_variable(layer, "kernel").shape)
        if kind == "dense":
            return [("kernel", (kernel[0], int(layer.units)))]
        return [("kernel", tuple(int(d) for d in info.get("float_shape") or kernel))]
    out = [("embeddings", (int(layer.input_dim), int(layer.output_dim)))]
    if kind == "reversible" and not layer.tie_weights:
        out.append(("reverse_embeddings", (int(layer.output_dim), int(layer.input_dim))))
    return out


def _describe(layer: Any, kind: str, mode: str, removed: Sequence[Any] = ()) -> list[QuantizedTensor]:
    """The `QuantizedTensor`s of a quantized layer."""
    info = _layer_info(layer, kind)
    out = []
    for k, (which, shape) in enumerate(_float_tensors(layer, kind, info)):
        rule = _rule(kind, which, mode, shape, info)
        prefix = "reverse_embeddings" if which == "reverse_embeddings" else (
            "embeddings" if kind in ("embedding", "reversible") else "kernel"
        )
        group_index = None
        if which != "reverse_embeddings":
            group_index = _own_variable(layer, "g_idx")
        out.append(
            QuantizedTensor(
                layer_path=layer.path,
                mode=mode,
                float_path=f"{layer.path}/{which}",
                float_shape=shape,
                rule=rule,
                values=_own_variable(layer, which),
                scale=_own_variable(layer, f"{prefix}_scale"),
                zero=_own_variable(layer, f"{prefix}_zero"),
                group_index=group_index,
                float_variable=removed[k] if removed else None,
            )
        )
    return out


def quantized_tensors(model: keras.Model) -> list[QuantizedTensor]:
    """The quantized float tensors of a model already quantized (by
    `model.quantize`, or built from a quantized preset's config), int8 and
    int4 only; an empty list for a float model."""
    out = []
    for layer in _compat.leaf_layers(model):
        kind = _layer_kind(layer)
        mode = getattr(layer, "quantization_mode", None) if kind else None
        if mode in SUPPORTED_MODES:
            out.extend(_describe(layer, kind, mode))
    return out


def _check_shapes(tensor: QuantizedTensor) -> None:
    """Keras built what the rule says, or this Keras differs from 3.15's."""
    expected = {"values": values_shape(tensor), "scale": scale_shape(tensor)}
    for name, shape in expected.items():
        actual = tuple(int(d) for d in getattr(tensor, name).shape)
        if actual != shape:
            raise QuantizationError(
                f"{tensor.values.path}: Keras built a {name} of shape {actual} "
                f"where {shape} was expected for {tensor.mode} (Keras 3.15's "
                f"layout). Received: Keras {keras.__version__}, which "
                "keras_hub_dist does not support for quantize= yet."
            )


def values_shape(tensor: QuantizedTensor) -> tuple[int, ...]:
    """Shape of the quantized values variable."""
    rule = tensor.rule
    if isinstance(rule, Int8Rule):
        return tensor.float_shape
    shape = list(rule.matrix)
    shape[rule.pack_axis] = (shape[rule.pack_axis] + 1) // 2
    return tuple(shape)


def scale_shape(tensor: QuantizedTensor) -> tuple[int, ...]:
    """Shape of the scale (and zero) variables."""
    rule = tensor.rule
    if isinstance(rule, Int8Rule):
        return tuple(1 if a is None else tensor.float_shape[a] for a in rule.scale_axes)
    if not rule.block_size:
        return (rule.matrix[1 - rule.group_axis],)
    shape = list(rule.matrix)
    shape[rule.group_axis] = rule.num_groups
    return tuple(shape)


def quantize_without_values(
    model: keras.Model, mode: str, layers: dict[str, int] | None = None
) -> QuantizedModel:
    """`model.quantize(mode)` on a model whose variables have no value yet.

    Each layer `Model.quantize` would quantize gets Keras's own quantized
    variables (created without values, so nothing is allocated) and dtype
    policy; its float variables are dropped before any value exists.
    `layers` (`{layer path: int4 block size}`): only those layers, each in
    its own groups (a pre-quantized checkpoint's).

    Raises:
        QuantizationError: A layer this Keras would quantize that is none of
            the four known classes, or shapes that differ from Keras 3.15's.
    """
    tensors: list[QuantizedTensor] = []
    removed: list[Any] = []
    created: list[Any] = []
    skipped: list[str] = []
    for layer in _compat.leaf_layers(model):
        kind = _layer_kind(layer)
        if layers is not None and (kind is None or layer.path not in layers):
            continue
        if kind is None:
            if _quantizes_itself(layer):
                raise QuantizationError(
                    f"Layer {layer.path!r} ({type(layer).__name__}) has its "
                    "own `quantize`, which quantize= cannot replay without "
                    "values. Expected only Keras's Dense, EinsumDense, "
                    "Embedding and ReversibleEmbedding to quantize. Load in "
                    "float, then call model.quantize(...)."
                )
            if isinstance(layer, tuple(_KINDS)) or _has_weights(layer):
                skipped.append(layer.path)
            continue
        floats = _float_tensors(layer, kind, _layer_info(layer, kind))
        float_variables = [_own_variable(layer, which) for which, _ in floats]
        with _compat.creating_variables_without_values() as new:
            _compat.quantize_layer_structure(
                layer, mode, floats[0][1], None if layers is None else layers[layer.path]
            )
        described = _describe(layer, kind, mode, float_variables)
        for tensor in described:
            _check_shapes(tensor)
        tensors.extend(described)
        removed.extend(float_variables)
        created.extend(new)
    return QuantizedModel(tuple(tensors), tuple(removed), tuple(created), tuple(skipped))


def _quantizes_itself(layer: Any) -> bool:
    """Whether a layer's class overrides `quantize` (other than Keras's four,
    whose subclasses Keras refuses)."""
    own = type(layer).quantize
    known = {cls.quantize for cls in _KINDS} | {keras.layers.Layer.quantize}
    return own not in known


def _has_weights(layer: Any) -> bool:
    return bool(layer.weights)


@dataclasses.dataclass(frozen=True)
class _Named:
    """A variable that does not exist yet: its path."""

    path: str


def group_index_shape(tensor: QuantizedTensor) -> tuple[int, ...]:
    """Shape of the int4 `g_idx` variable."""
    return (tensor.rule.matrix[tensor.rule.group_axis],)


def prospective_tensors(
    model: keras.Model, mode: str
) -> list[tuple[QuantizedTensor, dict[str, tuple[tuple[int, ...], str]]]]:
    """What `model.quantize(mode)` would create, without creating anything:
    per float tensor of a layer it would quantize, the `QuantizedTensor`
    (its variables stand-ins with a `path`) and `{path: (shape, dtype)}` of
    the variables Keras would build."""
    block = keras.quantizers.Int4QuantizationConfig().block_size if mode == "int4" else None
    out = []
    for layer in _compat.leaf_layers(model):
        kind = _layer_kind(layer)
        if kind is None or getattr(layer, "quantization_mode", None) is not None:
            continue
        try:
            info = {**_layer_info(layer, kind), "block_size": block}
        except ValueError:  # an einsum Keras cannot quantize: neither do we
            continue
        for which, shape in _float_tensors(layer, kind, info):
            rule = _rule(kind, which, mode, shape, info)
            prefix = "kernel" if kind in ("dense", "einsum") else which
            grouped = isinstance(rule, Int4Rule) and bool(rule.block_size)
            names = {"values": which, "scale": f"{prefix}_scale"}
            if grouped:
                names["zero"] = f"{prefix}_zero"
                if which != "reverse_embeddings":
                    names["group_index"] = "g_idx"
            tensor = QuantizedTensor(
                layer_path=layer.path, mode=mode, float_path=f"{layer.path}/{which}",
                float_shape=shape, rule=rule,
                **{key: _Named(f"{layer.path}/{name}") for key, name in names.items()},
            )
            float_dtype = keras.backend.standardize_dtype(layer.variable_dtype)
            dtypes = {
                "values": "int8", "scale": float_dtype, "group_index": "float32",
                "zero": float_dtype if which == "reverse_embeddings" else "int8",
            }
            shapes = {
                "values": values_shape(tensor), "scale": scale_shape(tensor),
                "zero": scale_shape(tensor),
                "group_index": group_index_shape(tensor) if grouped else (),
            }
            out.append((tensor, {
                f"{layer.path}/{name}": (shapes[key], dtypes[key]) for key, name in names.items()
            }))
    return out
