"""The Hub's pre-quantized checkpoints: what `quantization_config` says, and
the tensors of each quantized Linear weight.

`scheme(config, label)` reads `quantization_config` and refuses, before
anything is built, what this package does not read (the message names the
method and lists what is supported). `dequantized_tensor(scheme, name,
tensors)` answers the Hugging Face tracer when KerasHub's converter asks for
a Linear `*.weight` that the checkpoint holds quantized: a
`formats.dequantize` source of the float weight, computed block by block,
and the stored tensors it reads. Modules the checkpoint left unquantized
(`ignore`, `modules_to_not_convert`, `lm_head`) hold a plain `*.weight` and
load as they always did.

| `quant_method` | weights | tensors per Linear |
|---|---|---|
| `fp8` (Transformers' `FineGrainedFP8Config`, DeepSeek-V3, Qwen3-FP8) | e4m3, `weight_block_size` blocks | `weight`, `weight_scale_inv` |
| `compressed-tensors`, `float-quantized` (FP8_DYNAMIC, FP8_BLOCK) | e4m3, per tensor / channel / block | `weight`, `weight_scale` |
| `compressed-tensors`, `pack-quantized` (W4A16, W4A16_ASYM) | int4, groups | `weight_packed`, `weight_scale`, `weight_zero_point`, `weight_g_idx` |
| `gptq` (`bits: 4`, `checkpoint_format` `gptq` / `gptq_v2`) | int4, groups, `desc_act` | `qweight`, `qzeros`, `scales`, `g_idx` |
| `awq` (`version: gemm`) | int4, groups | `qweight`, `qzeros`, `scales` |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from keras_hub_dist.errors import PresetError
from keras_hub_dist.formats.base import StoredTensor, TensorSource, is_float
from keras_hub_dist.formats.dequantize import (
    AwqSource,
    CompressedInt4Source,
    Fp8Source,
    GptqSource,
)

__all__ = ["SUPPORTED_METHODS", "Scheme", "dequantized_tensor", "scheme", "with_packed_weights"]

SUPPORTED_METHODS = ("fp8", "compressed-tensors", "gptq", "awq", "mxfp4 (gpt-oss)")
_SUPPORTED = (
    "quant_method 'fp8' (e4m3 weights, weight_block_size or per-tensor "
    "weight_scale_inv); 'compressed-tensors' in the formats 'float-quantized' "
    "(8-bit float weights, tensor / channel / block scales) and 'pack-quantized' "
    "(4-bit int weights in groups or channels, symmetric or not: W4A16, "
    "W4A16_ASYM); 'gptq' with bits 4 (checkpoint_format 'gptq' or 'gptq_v2', "
    "desc_act true or false); 'awq' with bits 4, version 'gemm'; 'mxfp4' "
    "(gpt-oss)"
)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """What a checkpoint's quantized Linear weights are.

    Attributes:
        method: `quant_method`.
        kind: `"fp8"` or `"int4"`.
        group_size: int4 input rows per group (`None`: one group per row of
            the weight, i.e. per output channel).
        block: FP8 `(rows, cols)` of a scale block, `None` otherwise.
        symmetric: int4 without zero points.
        zero_offset: What GPTQ stores less than the zero point (1 for
            `gptq`, 0 for `gptq_v2`).
        label: The checkpoint, for messages.
    """

    method: str
    kind: str
    group_size: int | None = None
    block: tuple[int, int] | None = None
    symmetric: bool = True
    zero_offset: int = 1
    label: str = ""


def _refuse(label: str, method: Any, what: str) -> PresetError:
    return PresetError(
        f"The checkpoint {label!r} is quantized with quant_method={method!r}: {what}. "
        f"keras_hub_dist reads {_SUPPORTED}. Fix: use a checkpoint in one of these "
        "formats, or the unquantized checkpoint (and quantize= or "
        "model.quantize(...) after loading)."
    )


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _compressed_tensors(q: Mapping[str, Any], label: str) -> Scheme:
    method = "compressed-tensors"
    if q.get("sparsity_config"):
        raise _refuse(label, method, "its sparsity_config (sparse weights) is not read")
    if q.get("transform_config"):
        raise _refuse(label, method, "its transform_config (rotated weights) is not read")
    groups = q.get("config_groups") or {}
    if not isinstance(groups, Mapping) or not groups:
        raise _refuse(label, method, "its config_groups are missing")
    schemes = set()
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        fmt = (group or {}).get("format") or q.get("format")
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        where = f"config group {name!r} (weights {dict(weights)!r}, format {fmt!r})"
        activations = (group or {}).get("input_activations")
        if activations and not activations.get("dynamic", False) and kind == "int":
            raise _refuse(label, method, f"{where} quantizes activations statically (W8A8 / W4A8)")
        if fmt == "float-quantized" and kind == "float" and bits == 8:
            if strategy == "block":
                block = weights.get("block_structure")
                if not (isinstance(block, list) and len(block) == 2 and all(_positive(b) for b in block)):
                    raise _refuse(label, method, f"{where}: a block strategy needs block_structure [rows, cols]")
                schemes.add(Scheme(method, "fp8", block=(block[0], block[1]), label=label))
            elif strategy in ("tensor", "channel"):
                schemes.add(Scheme(method, "fp8", label=label))
            else:
                raise _refuse(label, method, f"{where}: 8-bit float weights with strategy {strategy!r}")
        elif fmt == "pack-quantized" and kind == "int" and bits == 4:
            if strategy == "group":
                size = weights.get("group_size")
                if not _positive(size):
                    raise _refuse(label, method, f"{where}: a group strategy needs a positive group_size")
            elif strategy == "channel":
                size = None
            else:
                raise _refuse(label, method, f"{where}: 4-bit int weights with strategy {strategy!r}")
            schemes.add(Scheme(method, "int4", group_size=size, symmetric=bool(weights.get("symmetric", True)), label=label))
        else:
            raise _refuse(
                label, method,
                f"{where}: {bits}-bit {kind} weights in the {fmt!r} format are not supported",
            )
    if len(schemes) != 1:
        raise _refuse(label, method, f"its config groups mix several weight schemes ({len(schemes)})")
    return schemes.pop()


def scheme(config: Mapping[str, Any], label: str) -> Scheme | None:
    """The checkpoint's `Scheme` (`None`: unquantized, or gpt-oss MXFP4).

    Raises:
        PresetError: A `quant_method` or variant this package does not read;
            the message names it and lists what is supported.
    """
    q = config.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, Mapping) else None
    if method == "mxfp4" and config.get("model_type") == "gpt_oss":
        return None
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is not None and not (isinstance(block, list) and len(block) == 2 and all(_positive(b) for b in block)):
            raise _refuse(label, method, f"weight_block_size={block!r} is not [rows, cols]")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise _refuse(label, method, f"activation_scheme={q.get('activation_scheme')!r} (static activation scales)")
        return Scheme("fp8", "fp8", block=None if block is None else (block[0], block[1]), label=label)
    if method == "compressed-tensors":
        return _compressed_tensors(q, label)
    if method in ("gptq", "awq"):
        bits = q.get("bits", q.get("w_bit"))
        if bits != 4:
            raise _refuse(label, method, f"bits={bits!r} (only 4-bit weights are read)")
        size = q.get("group_size", q.get("q_group_size"))
        if size in (None, -1):
            size = None
        elif not _positive(size):
            raise _refuse(label, method, f"group_size={size!r} is not a positive integer or -1")
        if method == "gptq":
            fmt = q.get("checkpoint_format", q.get("format", "gptq"))
            if fmt not in ("gptq", "gptq_v2"):
                raise _refuse(label, method, f"checkpoint_format={fmt!r} (only 'gptq' and 'gptq_v2' are read)")
            return Scheme("gptq", "int4", group_size=size, symmetric=False,
                          zero_offset=1 if fmt == "gptq" else 0, label=label)
        version = str(q.get("version", "gemm")).lower()
        if version != "gemm":
            raise _refuse(label, method, f"version={q.get('version')!r} (only 'gemm' is read)")
        if q.get("zero_point") is False:
            raise _refuse(label, method, "zero_point=false (only AWQ with zero points is read)")
        return Scheme("awq", "int4", group_size=size, symmetric=False, zero_offset=0, label=label)
    raise _refuse(label, method, "this method is not read")


def with_packed_weights(names: Mapping[str, Any]) -> dict[str, Any]:
    """`names` (a weight map or a file's tensors) and, for each int4 weight
    stored packed (`*.weight_packed`, `*.qweight`), the `*.weight` it stands
    for, with the packed entry's value: a converter's key search (KerasHub's
    prefix guess, `model.` before `layers.0...`) then finds the weights the
    checkpoint holds only packed."""
    out = dict(names)
    for name, value in names.items():
        for suffix in ("weight_packed", "qweight"):
            if name.endswith(suffix):
                out.setdefault(name[: -len(suffix)] + "weight", value)
    return out


def _problem(name: str, s: Scheme, what: str) -> str:
    return f"tensor {name!r} ({s.method}): {what}"


def dequantized_tensor(
    s: Scheme, name: str, tensors: Mapping[str, StoredTensor]
) -> tuple[list[str], TensorSource] | str | None:
    """The float weight `name` (a Linear's `*.weight`) of a quantized
    checkpoint: `(stored names read, source)`; a problem (a message naming
    the tensor, what was expected and what the file holds); or `None`
    where `name` is not quantized (stored as it is, or not a weight)."""
    if not name.endswith("weight"):
        return None
    prefix = name[: -len("weight")]
    stored = tensors.get(name)
    if s.kind == "fp8":
        if stored is None or is_float(stored.dtype) and stored.dtype.itemsize > 1:
            return None
        if stored.dtype.itemsize != 1 or not is_float(stored.dtype):
            return _problem(name, s, f"expected an 8-bit float weight, received {stored.dtype}")
        scale_name = prefix + ("weight_scale_inv" if s.method == "fp8" else "weight_scale")
        scale = tensors.get(scale_name)
        if scale is None:
            return _problem(name, s, f"its scale {scale_name!r} is missing")
        if len(stored.shape) != 2:
            return _problem(name, s, f"expected a 2-D weight, received shape {list(stored.shape)}")
        out, inner = stored.shape
        size = int(np.prod(scale.shape))
        block = s.block
        if size == 1:
            block = None
        elif block is not None:
            expected = (-(-out // block[0]), -(-inner // block[1]))
            if tuple(scale.shape) != expected:
                return _problem(name, s, f"{scale_name!r} has shape {list(scale.shape)}, expected "
                                f"{list(expected)} for {block[0]} x {block[1]} blocks of {list(stored.shape)}")
        elif tuple(scale.shape) not in ((out, 1), (out,)):
            return _problem(name, s, f"{scale_name!r} has shape {list(scale.shape)}, expected one scale "
                            f"per tensor or per output channel ({out}, 1)")
        return [name, scale_name], Fp8Source(stored, scale, block, name)
    if stored is not None:
        return None  # an unquantized module
    if s.method == "compressed-tensors":
        return _compressed_int4(s, name, prefix, tensors)
    return _gptq_awq(s, name, prefix, tensors)


def _int4_group(s: Scheme, name: str, inner: int) -> int | str:
    size = s.group_size or inner
    if inner % size:
        return _problem(name, s, f"the input axis ({inner}) is not a multiple of group_size {size}; "
                        "supported: group sizes that divide every quantized Linear's input width")
    return size


def _check_shape(s: Scheme, name: str, tensor: str, stored: StoredTensor | None, shape: tuple[int, ...], ints: bool = True) -> str | None:
    if stored is None:
        return _problem(name, s, f"{tensor!r} is missing")
    if tuple(stored.shape) != shape:
        return _problem(name, s, f"{tensor!r} has shape {list(stored.shape)}, expected {list(shape)}")
    if ints and stored.dtype != np.dtype(np.int32):
        return _problem(name, s, f"{tensor!r} has dtype {stored.dtype}, expected int32 (eight 4-bit values each)")
    return None


def _compressed_int4(s: Scheme, name: str, prefix: str, tensors: Mapping[str, StoredTensor]) -> Any:
    packed = tensors.get(prefix + "weight_packed")
    if packed is None:
        return None
    out, cols = packed.shape
    inner = cols * 8
    size = _int4_group(s, name, inner)
    if isinstance(size, str):
        return size
    groups = inner // size
    names = [prefix + "weight_packed", prefix + "weight_scale"]
    problem = _check_shape(s, name, names[0], packed, (out, cols)) or _check_shape(
        s, name, names[1], tensors.get(names[1]), (out, groups), ints=False
    )
    zero = None
    if not s.symmetric:
        names.append(prefix + "weight_zero_point")
        zero = tensors.get(names[-1])
        if zero is None or tuple(zero.shape) != (out, groups):  # else unpacked, as older writers
            problem = problem or _check_shape(s, name, names[-1], zero, (-(-out // 8), groups))
    g_idx = tensors.get(prefix + "weight_g_idx")
    if g_idx is not None:
        names.append(prefix + "weight_g_idx")
        problem = problem or _check_shape(s, name, names[-1], g_idx, (inner,))
    if problem:
        return problem
    return names, CompressedInt4Source(packed, tensors[names[1]], zero, g_idx, inner, size, name)


def _gptq_awq(s: Scheme, name: str, prefix: str, tensors: Mapping[str, StoredTensor]) -> Any:
    qweight = tensors.get(prefix + "qweight")
    if qweight is None:
        return None
    names = [prefix + n for n in ("qweight", "qzeros", "scales")]
    if s.method == "gptq":
        inner, out = qweight.shape[0] * 8, qweight.shape[1]
    else:
        inner, out = qweight.shape[0], qweight.shape[1] * 8
    size = _int4_group(s, name, inner)
    if isinstance(size, str):
        return size
    groups = inner // size
    problem = (
        _check_shape(s, name, names[1], tensors.get(names[1]), (groups, out // 8))
        or _check_shape(s, name, names[2], tensors.get(names[2]), (groups, out), ints=False)
    )
    g_idx = tensors.get(prefix + "g_idx") if s.method == "gptq" else None
    if g_idx is not None:
        names.append(prefix + "g_idx")
        problem = problem or _check_shape(s, name, names[-1], g_idx, (inner,))
    if problem:
        return problem
    if s.method == "gptq":
        return names, GptqSource(qweight, tensors[names[1]], tensors[names[2]], g_idx, size, name, s.zero_offset)
    return names, AwqSource(qweight, tensors[names[1]], tensors[names[2]], size, name)
