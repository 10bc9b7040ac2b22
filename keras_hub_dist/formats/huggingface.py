"""Hugging Face checkpoints (config.json + safetensors), through KerasHub's
own converters.

KerasHub converts a Transformers checkpoint with one module per
`model_type` (`keras_hub/src/utils/transformers/convert_*.py`): a config
conversion, and `convert_weights(backbone, loader, config)`, which reads each
file tensor whole, transforms it with NumPy and assigns it to a variable.
This module runs that very function once, on the model built without
values, with a loader whose tensors are `LazyArray`s and with
`Variable.assign` recording instead of assigning. What it records per
variable is a `TensorSource` that computes any block of the converted value
from the bytes of that block alone. So the mapping cannot drift from
KerasHub's: it is KerasHub's, replayed block-wise.

Pre-quantized checkpoints (`quantization_config`: FP8, compressed-tensors,
GPTQ, AWQ; `formats.prequantized`): a Linear weight the checkpoint holds
quantized is served to the converter as a `formats.dequantize` source of its
float value, block-wise; `load.quantized` then places int4 ones in Keras's
int4 layers as they are. A method this package does not read is refused by
`backbone_config`, naming it.

Values the tracer cannot split into blocks:
- gpt-oss MXFP4 experts (the converter's dequantization uses masked
  assignment): recognized by their `*_blocks` / `*_scales` tensors and read
  by `formats.mxfp4`, block-wise; a checkpoint holding them unquantized
  (Transformers' `experts.gate_up_proj` layout, which KerasHub's converter
  cannot read) loads them as they are, KerasHub's variable layout;
- a `port_weight` hook doing something else: the hook runs on the whole
  tensor on the host, once per block read, and `LoadReport.fallbacks` names
  the variable;
- anything else: a `PresetError` naming the variable.

Validation, before any device memory is used: the files (headers, lengths,
the index and its shards), every tensor the converter asks for, and every
value's shape against the variable built from config.json.

Example:

```python
backbone = keras_hub_dist.load_sharded_preset("./Qwen3-8B", mesh=(1, 8))
backbone = keras_hub_dist.load_sharded_preset("hf://Qwen/Qwen3-8B")
```
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import keras
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.errors import PresetError, UnconvertedWeightsWarning
from keras_hub_dist.plan.presets import INDEX_FILE_LIMIT, parse_json
from keras_hub_dist.formats import hf_config_compat, keras_h5, prequantized
from keras_hub_dist.formats.base import (
    CheckpointIndex,
    IndexedVariable,
    StoredTensor,
    StoredTensorSource,
    TensorSource,
    compatible_dtypes,
    listing,
    numpy_dtype,
)
from keras_hub_dist.formats.lazy_numpy import LazyArray, Opaque, leaves_of
from keras_hub_dist.formats.mxfp4 import Mxfp4Source
from keras_hub_dist.formats.safetensors_files import (
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsCheckpoint,
    checkpoint_files,
)
from keras_hub_dist.formats.transforms import Constant, FullTensorFallback, view

__all__ = [
    "FORMAT",
    "TESTED_MODEL_TYPES",
    "backbone_config",
    "checksum_metadata",
    "index_checkpoint",
    "recognizes",
    "trace_sources",
]

FORMAT = "huggingface"

# The causal-LM model types whose conversion the test suite compares with
# stock KerasHub, bitwise. Other types KerasHub converts load the same way.
TESTED_MODEL_TYPES = (
    "gemma", "gemma2", "gemma3", "gemma3_text", "gemma4", "gemma4_text", "gpt_oss",
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
    "qwen3_5", "qwen3_5_moe", "smollm3",
)



def recognizes(config: Mapping[str, Any]) -> bool:
    """Whether config.json is a Transformers one (`model_type`, no Keras class)."""
    return "model_type" in config and "registered_name" not in config


def checksum_metadata(location: Any, index_file: str = INDEX_FILE) -> dict[str, Any]:
    """The `metadata` of the checkpoint's `model.safetensors.index.json`
    (where `save_sharded_preset(..., format="huggingface")` records the
    files' checksums; `save_lora_adapter` writes the same into
    `index_file` `adapter_model.safetensors.index.json`), or `{}` without
    it. `location`: a `storage.locations.Location`."""
    if not location.has(index_file):
        return {}
    index = parse_json(location.read_bytes(index_file), location.path_of(index_file), INDEX_FILE_LIMIT)
    metadata = index.get("metadata") if isinstance(index, dict) else None
    return metadata if isinstance(metadata, dict) else {}


def _check_quantization(config: Mapping[str, Any], label: str) -> None:
    # Refuses, naming it, a quant_method (or variant) that is not read.
    prequantized.scheme(config, label)


def _converter(config: Mapping[str, Any], label: str) -> Any:
    try:
        return _compat.transformers_converter(dict(config))
    except ValueError:
        raise PresetError(
            f"KerasHub cannot convert the checkpoint {label!r}: its config.json has "
            f"model_type={config.get('model_type')!r}. Expected a model_type with a "
            "KerasHub converter; the causal LMs keras_hub_dist is tested with: "
            f"{', '.join(TESTED_MODEL_TYPES)}."
        ) from None


def backbone_config(config: Mapping[str, Any], label: str) -> tuple[type, dict[str, Any]]:
    """`(backbone class, constructor config)`, by KerasHub's config conversion.

    `config` may be written by `transformers` 4 or 5: keys `transformers` 5
    renamed are read under their new names (`hf_config_compat`).
    """
    _check_quantization(config, label)
    config = hf_config_compat.compatible_config(config, label)
    converter = _converter(config, label)
    cls = converter.backbone_cls
    convert = converter.convert_backbone_config
    try:
        # Some conversions construct sub-models (Gemma 3/4 vision towers):
        # built here without values, then passed on as configs, so the
        # loader's own build creates them with everything else.
        with _compat.creating_variables_without_values():
            if len(inspect.signature(convert).parameters) != 1:
                kwargs = dict(convert(dict(config), cls))
            else:
                kwargs = dict(convert(dict(config)))
        return cls, {
            k: keras.layers.serialize(v) if isinstance(v, keras.layers.Layer) else v
            for k, v in kwargs.items()
        }
    except KeyError as e:
        raise PresetError(_missing_key_message(config, label, e.args[0] if e.args else e)) from e
    except (TypeError, ValueError) as e:
        raise PresetError(
            f"KerasHub's converter for model_type={config.get('model_type')!r} cannot "
            f"read the config.json of {label!r}: {type(e).__name__}: {e}. Expected a "
            "complete Transformers config of that model type."
        ) from e


def _missing_key_message(config: Mapping[str, Any], label: str, key: Any) -> str:
    model_type = str(config.get("model_type"))
    known = hf_config_compat.renames_of(model_type)
    return (
        f"KerasHub's converter for model_type={model_type!r} cannot read the "
        f"config.json of {label!r}: it has no key {key!r}. Expected a complete "
        f"Transformers config of that model type, as transformers "
        f"{hf_config_compat.READ_TRANSFORMERS_VERSIONS} writes it (keys "
        "transformers 5 renamed for this model type, read under their new names: "
        + (", ".join(known) if known else "none")
        + f"). Received keys: {sorted(config)}. Fix: use the config.json that came "
        f"with the weights; if a newer transformers wrote {key!r} under another "
        "name, add that name to the checkpoint's config.json as well."
    )


class _MissingTensor(KeyError):
    """A tensor the converter asked for is not in the checkpoint."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _Trace:
    """What the converter did: value per variable id, and the problems."""

    def __init__(self, variables: list[Any]) -> None:
        self.variables = {id(v): v for v in variables}
        self.values: dict[int, Any] = {}
        self.problems: list[str] = []
        self.read: set[str] = set()
        # gpt-oss MXFP4 names the checkpoint holds unquantized: name -> tensor.
        self.unquantized: dict[str, str] = {}
        # Weights read from a pre-quantized checkpoint's quantized tensors.
        self.quantized = 0


def _tracing_loader(
    label: str, files: SafetensorsCheckpoint, trace: _Trace, model_type: str,
    scheme: prequantized.Scheme | None = None,
) -> Any:
    """KerasHub's `SafetensorLoader`, serving `LazyArray`s (no tensor read).

    A subclass, so key resolution (`get_prefixed_key`, prefixes, the index)
    is KerasHub's own; a tensor it does not find is looked up under the name
    `transformers` 5 gives it (`hf_config_compat.stored_tensor_name`). Its
    state is set from the files already indexed (KerasHub's constructor would
    fetch the index through its own file getter, which downloads whole files
    for remote presets).
    """
    base = _compat.safetensor_loader_class()

    class TracingLoader(base):
        def __init__(self) -> None:  # noqa: D107 - see above
            contextlib.ExitStack.__init__(self)
            self.preset = label
            # The names KerasHub's key (and prefix) search sees: with the
            # `*.weight` of each weight a pre-quantized checkpoint holds packed.
            names = prequantized.with_packed_weights if scheme is not None else dict
            self.safetensor_config = (
                None if files.weight_map is None else {"weight_map": names(files.weight_map)}
            )
            self.header_names = {f: names(h.tensors) for f, h in files.headers.items()}
            self.safetensor_files = {}
            self.prefix = None
            self.fname = None
            self.all_tensors = {n: t for h in files.headers.values() for n, t in h.tensors.items()}

        def stored_key(self, hf_weight_key: str, names: Mapping[str, Any]) -> str:
            key = self.get_prefixed_key(hf_weight_key, names)
            renamed = hf_config_compat.stored_tensor_name(model_type, key, names.__contains__)
            return key if renamed is None else renamed

        def get_tensor(self, hf_weight_key: str) -> LazyArray:
            if self.safetensor_config is None:
                fname = self.fname if self.fname is not None else SINGLE_FILE
            else:
                weight_map = self.safetensor_config["weight_map"]
                key = self.stored_key(hf_weight_key, weight_map)
                fname = weight_map.get(key)
                if fname is None and key.endswith(("_blocks", "_scales")):  # unquantized gpt-oss
                    fname = weight_map.get(key.rsplit("_", 1)[0])
                if fname is None:
                    in_files = [f for f, h in files.headers.items() if hf_weight_key in h.tensors]
                    raise _MissingTensor(
                        f"tensor {hf_weight_key!r} is missing from the index "
                        "model.safetensors.index.json"
                        + (f" (it is in {in_files[0]!r}; the index is stale)" if in_files else "")
                    )
            header = files.headers.get(fname)
            name = self.stored_key(hf_weight_key, self.header_names[fname]) if header else hf_weight_key
            if scheme is not None:
                found = prequantized.dequantized_tensor(scheme, name, self.all_tensors)
                if isinstance(found, str):
                    raise _MissingTensor(found)
                if found is not None:
                    trace.read.update(found[0])
                    trace.quantized += 1
                    return LazyArray(found[1], frozenset({name}))
            if header is not None and name not in header.tensors:
                standin = _unquantized_standin(name, header.tensors)
                if standin is not None:
                    trace.read.add(standin[0])
                    trace.unquantized[name] = standin[0]
                    return LazyArray(standin[1], frozenset({name}))
            if header is None or name not in header.tensors:
                raise _MissingTensor(
                    f"tensor {hf_weight_key!r} is missing from {fname!r}"
                )
            stored = header.tensors[name]
            trace.read.add(name)
            return LazyArray(
                view(stored, stored.shape, f"tensor {name!r} of {stored.file!r}"),
                frozenset({name}),
            )

        def port_weight(self, keras_variable: Any, hf_weight_key: str, hook_fn: Any = None) -> None:
            try:
                tensor = self.get_tensor(hf_weight_key)
            except _MissingTensor as e:
                trace.problems.append(f"{keras_variable.path}: {e.message}")
                return
            value: Any = tensor
            if hook_fn:
                shape = list(keras_variable.shape)
                try:
                    value = hook_fn(tensor, shape)
                except Exception as e:  # noqa: BLE001 - reported with the tensor
                    trace.problems.append(
                        f"{keras_variable.path}: tensor {hf_weight_key!r} (shape "
                        f"{list(tensor.shape)}, {tensor.dtype}) does not convert to "
                        f"shape {shape}: {e}"
                    )
                    return
                if isinstance(value, Opaque):
                    value = FullTensorFallback(
                        [tensor.source],
                        lambda whole, hook=hook_fn, shape=shape: hook(whole, shape),
                        shape,
                        numpy_dtype(keras_variable.dtype),
                        f"{keras_variable.path}: KerasHub's conversion hook for "
                        f"{hf_weight_key!r} has no block-wise form; the whole tensor is "
                        "converted on the host",
                    )
            keras_variable.assign(value)

    return TracingLoader()


@contextlib.contextmanager
def _recording_assignments(trace: _Trace) -> Iterator[None]:
    """`Variable.assign` records the traced value for the model's variables.

    The patch lives only while the converter runs, on the variable classes
    of this model; other variables assign as usual.
    """
    classes = {type(v) for v in trace.variables.values()}
    originals = {cls: cls.__dict__.get("assign") for cls in classes}

    def make(cls: type) -> Any:
        original = super(cls, cls).assign if originals[cls] is None else originals[cls]

        def assign(self: Any, value: Any) -> Any:
            if id(self) not in trace.variables:
                return original(self, value)
            trace.values[id(self)] = value
            return value

        return assign

    for cls in classes:
        cls.assign = make(cls)
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is None:
                del cls.assign
            else:
                cls.assign = original


_MXFP4_GROUP = 32


def _unquantized_standin(name: str, tensors: Mapping[str, StoredTensor]) -> tuple[str, TensorSource] | None:
    """gpt-oss experts stored unquantized (`experts.gate_up_proj` (experts,
    in, out), as Transformers and `save_sharded_preset` write them) where
    KerasHub's converter asks for MXFP4 `*_blocks` / `*_scales`: the
    tensor's name, and a stand-in of the MXFP4 shape the converter computes
    with (never read: `_source_of` maps it back to the tensor)."""
    if not name.endswith(("_blocks", "_scales")):
        return None
    base = name.rsplit("_", 1)[0]
    stored = tensors.get(base)
    if stored is None or len(stored.shape) != 3:
        return None
    experts, inputs, outputs = stored.shape
    groups = -(-inputs // _MXFP4_GROUP)
    shape = (experts, outputs, groups, _MXFP4_GROUP // 2) if name.endswith("_blocks") else (experts, outputs, groups)
    standin = StoredTensor(stored.file, stored.offset, shape, np.dtype(np.uint8))
    return base, StoredTensorSource(standin, f"tensor {base!r} of {stored.file!r}")


def _source_of(
    value: Any,
    variable: Any,
    model_type: str,
    tensors: Mapping[str, StoredTensor],
    unquantized: Mapping[str, str] | None = None,
) -> TensorSource | str:
    """The variable's `TensorSource`, or a problem."""
    if isinstance(value, LazyArray):
        return value.source
    if isinstance(value, TensorSource):
        return value
    if isinstance(value, Opaque):
        blocks = [k for k in value.leaves if k.endswith("_blocks")]
        scales = [k for k in value.leaves if k.endswith("_scales")]
        if model_type == "gpt_oss" and len(blocks) == len(scales) == 1 and len(value.leaves) == 2:
            if unquantized and blocks[0] in unquantized:
                # Transformers' unquantized layout is KerasHub's variable.
                base = unquantized[blocks[0]]
                return StoredTensorSource(tensors[base], f"tensor {base!r} of {tensors[base].file!r}")
            try:
                return Mxfp4Source(tensors[blocks[0]], tensors[scales[0]])
            except ValueError as e:
                return f"{variable.path}: {e}"
        return (
            f"{variable.path}: KerasHub's converter computes it from "
            f"{sorted(value.leaves)} with operations that keras_hub_dist cannot "
            "split into blocks"
        )
    try:
        return Constant(np.asarray(value), f"a value computed by KerasHub's converter for {variable.path}")
    except Exception:  # noqa: BLE001
        return f"{variable.path}: the converter assigned a {type(value).__name__}"


def _trace(
    model: keras.Model, files: SafetensorsCheckpoint, config: Mapping[str, Any], label: str
) -> tuple[_Trace, dict[int, Any]]:
    """Runs KerasHub's converter on `model` with lazy tensors from `files`
    (`config` in the spelling the converter reads); returns the trace and
    the saved variables by id."""
    model_type = str(config.get("model_type"))
    converter = _converter(config, label)
    saved = {id(v): v for v in keras_h5.expected_datasets(model).values()}
    trace = _Trace(list(saved.values()))
    # Some converters print audits of what they ported (Qwen 3.5); of a
    # trace, that would be noise, and the library prints nothing.
    with (
        _recording_assignments(trace),
        _tracing_loader(label, files, trace, model_type, prequantized.scheme(config, label)) as loader,
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            converter.convert_weights(model, loader, dict(config))
        except _MissingTensor as e:
            trace.problems.append(e.message)
        except Exception as e:  # noqa: BLE001 - any converter failure is the checkpoint's
            trace.problems.append(
                f"KerasHub's converter stopped: {type(e).__name__}: {e}"
            )
    return trace, saved


def trace_sources(
    model: keras.Model, files: SafetensorsCheckpoint, config: Mapping[str, Any]
) -> tuple[dict[int, TensorSource], list[str]]:
    """What KerasHub's converter makes of `files` (headers only: the files
    need not exist): each variable's `TensorSource` by `id(variable)`, and
    the problems (a tensor missing, a value that is not block-wise).

    The exporter (`keras_hub_dist.save`) traces the files it is about to
    write, to invert the converter.
    """
    # `config` is the exporter's, in the spelling the converter reads (and
    # may hold objects a deep copy cannot take): used as it is.
    label = "the planned checkpoint"
    trace, saved = _trace(model, files, config, label)
    tensors = {n: t for h in files.headers.values() for n, t in h.tensors.items()}
    problems = list(trace.problems)
    sources: dict[int, TensorSource] = {}
    model_type = str(config.get("model_type"))
    for key, value in trace.values.items():
        source = _source_of(value, saved[key], model_type, tensors, trace.unquantized)
        if isinstance(source, str):
            problems.append(source)
        elif tuple(source.shape) != tuple(saved[key].shape):
            problems.append(
                f"{saved[key].path}: KerasHub's conversion of {sorted(leaves_of(value)) or source.description} "
                f"has shape {tuple(source.shape)}, expected {tuple(saved[key].shape)}"
            )
        else:
            sources[key] = source
    return sources, problems


def index_checkpoint(
    model: keras.Model, location: Any, label: str, config: Mapping[str, Any]
) -> CheckpointIndex:
    """Traces KerasHub's converter on `model` and validates every value.

    Raises:
        PresetError: A corrupt or incomplete checkpoint, a tensor missing
            or of the wrong shape for config.json (the message names the
            tensor, the variable, expected and received), a value that cannot
            be loaded block-wise.
    """
    files = checkpoint_files(location, label)
    config = hf_config_compat.compatible_config(config, label)
    model_type = str(config.get("model_type"))
    tensors = {n: t for h in files.headers.values() for n, t in h.tensors.items()}
    trace, saved = _trace(model, files, config, label)

    entries, unassigned, problems = [], [], list(trace.problems)
    scheme = prequantized.scheme(config, label)
    if scheme is not None and not trace.quantized and not problems:
        problems.append(
            f"config.json says the weights are quantized ({scheme.method}, {scheme.kind}), "
            "but the checkpoint holds no quantized Linear weight (expected e.g. "
            + ("8-bit float '*.weight' tensors" if scheme.kind == "fp8" else
               "'*.weight_packed' or '*.qweight' tensors")
            + "); every weight is stored in float"
        )
    seen: set[int] = set()
    for variable in model.weights:
        if id(variable) in seen or id(variable) not in saved:
            continue
        seen.add(id(variable))
        if id(variable) not in trace.values:
            # Buffers computed at build time (rotary inv_freq) are not
            # weights; only trainable ones left random are worth a warning.
            if variable.trainable:
                unassigned.append(variable.path)
            continue
        source = _source_of(trace.values[id(variable)], variable, model_type, tensors, trace.unquantized)
        if isinstance(source, str):
            problems.append(source)
            continue
        shape = tuple(int(d) for d in variable.shape)
        dtype = numpy_dtype(variable.dtype)
        if tuple(source.shape) != shape:
            on_disk = ", ".join(
                f"{n!r} of shape {list(tensors[n].shape)} in {os.path.basename(tensors[n].file)!r}"
                for n in sorted(leaves_of(trace.values[id(variable)]))
            )
            problems.append(
                f"{variable.path}: shape mismatch. Expected {shape} (from config.json). "
                f"Received {tuple(source.shape)} after KerasHub's conversion of "
                f"tensor {on_disk or source.description}"
            )
        elif not compatible_dtypes(source.dtype, dtype):
            problems.append(
                f"{variable.path}: dtype mismatch. Expected {dtype}. Received "
                f"{source.dtype} from {source.description}"
            )
        else:
            entries.append(IndexedVariable(variable.path, shape, dtype, source, variable))
    if problems:
        raise PresetError(
            f"The Hugging Face checkpoint {label!r} does not fit the "
            f"{type(model).__name__} that KerasHub's converter builds from its "
            f"config.json (model_type={model_type!r}). {len(problems)} problem(s):"
            + listing(problems)
            + "\nFix: use the config.json that came with these weights, or "
            "download the checkpoint again."
        )
    if unassigned:
        warnings.warn(
            f"KerasHub's converter for model_type={model_type!r} assigns no value to "
            f"{len(unassigned)} weight(s) of {type(model).__name__}; they keep their "
            "initial values, as with stock `from_preset`:" + listing(unassigned),
            UnconvertedWeightsWarning,
            stacklevel=3,
        )
    return CheckpointIndex(
        files=files.files,
        entries=tuple(entries),
        total_bytes=sum(tensors[n].nbytes for n in trace.read),
        format=FORMAT,
        opened=files.opened,
    )
