"""Load a KerasHub preset straight into its shards: `load_sharded_preset`.

Stock `from_preset` under `ModelParallel` random-initializes every weight,
reads each tensor whole into host memory, puts it whole on device 0 and only
then re-shards it. `load_sharded_preset` instead:

1. builds the backbone from the preset's `config.json` with every variable
   created without a value (`_compat.creating_variables_without_values`):
   no weight is generated;
2. indexes `model.weights.h5` (which dataset holds which variable, at which
   byte offset) and validates everything (missing/extra variables, shapes,
   dtypes, truncation, mesh axis names, divisibility) before any device
   memory is touched;
3. plans, per variable and device, the exact byte ranges each device holds
   (each process only its own devices; replicated variables once per
   process);
4. reads those bytes into fresh host buffers, casts them per block, places
   each block on its devices and assembles the final sharded `jax.Array`,
   which becomes the variable's first value.

Example:

```python
import keras_hub_dist

# 8 devices, all on the model axis (the default mesh).
backbone = keras_hub_dist.load_sharded_preset("./gemma_7b_en")

# A causal LM with its tokenizer, on a 2 x 4 mesh, in bfloat16.
lm = keras_hub_dist.load_sharded_preset(
    "gemma_7b_en", mesh={"batch": 2, "model": 4}, dtype="bfloat16",
    task="causal_lm",
)
lm.generate("The capital of France is", max_length=16)

# The ModelParallel distribution stays set for the returned model:
keras.distribution.distribution()  # -> the ModelParallel used to load
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import keras
import numpy as np

from keras_hub_dist import _compat, _sharding, layouts, planning, registry
from keras_hub_dist._h5_index import WeightsIndex, build_index
from keras_hub_dist._load_execute import ExecuteStats, ProgressBar, execute_plan
from keras_hub_dist._load_plan import LoadPlan, VariableRequest, plan_load
from keras_hub_dist.errors import LayoutError, PresetError

__all__ = ["LoadReport", "load_sharded_preset"]

_CONFIG_FILE = "config.json"
_METADATA_FILE = "metadata.json"
_WEIGHTS_FILE = "model.weights.h5"
_SHARDED_WEIGHTS_FILE = "model.weights.json"
_TASK_WEIGHTS_FILE = "task.weights.h5"


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """Time and memory of one `load_sharded_preset` call, measured until every
    weight was resident on its devices.

    Attributes:
        preset: What was loaded.
        axis_sizes: The mesh, `{axis name: size}`.
        wall_s: Seconds from the call to the last weight being resident.
        model_bytes: Bytes of all loaded variables (in their final dtype).
        bytes_read: Bytes this process read from the weights file(s).
        file_bytes: Bytes of the weights datasets on disk.
        read_calls: Read system calls (or h5py reads) made.
        expected_per_device: Bytes each device must hold when done (plan).
        peak_per_device / final_per_device: Measured bytes per device id
            (`keras_hub_dist.memory.MemorySampler`) added by this call: the
            sampled peak and the final bytes, minus what the device held
            when the call began.
        host_rss_start / host_rss_peak / host_rss_final: Process RSS, bytes.
    """

    preset: str
    axis_sizes: dict[str, int]
    wall_s: float
    model_bytes: int
    bytes_read: int
    file_bytes: int
    read_calls: int
    expected_per_device: dict[int, int]
    peak_per_device: dict[int, int]
    final_per_device: dict[int, int]
    host_rss_start: int
    host_rss_peak: int
    host_rss_final: int

    @property
    def peak_over_final(self) -> float:
        """The largest per-device peak / final ratio (1.0 = no spike)."""
        return max(
            (self.peak_per_device[d] / f for d, f in self.final_per_device.items() if f),
            default=1.0,
        )

    @property
    def host_growth_over_model(self) -> float:
        """Host peak RSS growth during the load / model bytes."""
        return (self.host_rss_peak - self.host_rss_start) / max(self.model_bytes, 1)

    def __str__(self) -> str:
        lines = [
            f"load_sharded_preset({self.preset!r}) on mesh {self.axis_sizes}: "
            f"{self.wall_s:.2f} s, {self.model_bytes / 1e9:.3f} GB of weights, "
            f"{self.bytes_read / 1e9:.3f} GB read in {self.read_calls} reads",
            f"  host RSS: start {self.host_rss_start / 1e9:.2f} GB, peak "
            f"{self.host_rss_peak / 1e9:.2f} GB, growth/model "
            f"{self.host_growth_over_model:.2f}",
            f"  {'device':>6} {'expected':>12} {'final':>12} {'peak':>12} {'peak/final':>10}",
        ]
        for d in sorted(self.final_per_device):
            final = self.final_per_device[d]
            peak = self.peak_per_device.get(d, 0)
            lines.append(
                f"  {d:>6} {self.expected_per_device.get(d, 0):>12,} {final:>12,} "
                f"{peak:>12,} {peak / final if final else float('nan'):>10.3f}"
            )
        return "\n".join(lines)


# --- preset resolution -----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Source:
    ref: str  # what KerasHub's preset loader gets (local dir or handle)
    label: str  # for messages
    short: str  # for the progress bar


def _resolve_preset(preset: Any) -> _Source:
    if isinstance(preset, os.PathLike):
        preset = os.fspath(preset)
    if not isinstance(preset, str) or not preset:
        raise PresetError(
            "Expected a preset: a local preset directory, a KerasHub "
            "preset name or handle, or a keras_hub_dist architecture name. "
            f"Received: preset={preset!r}."
        )
    if os.path.isdir(preset):
        return _Source(preset, preset, os.path.basename(os.path.normpath(preset)))
    if "://" not in preset:
        try:
            from keras_hub_dist import presets
        except ImportError:  # pragma: no cover - issue 3 not installed
            presets = None
        if presets is not None:
            try:
                entry = presets.resolve(preset)
            except ValueError:
                entry = None
            if entry is not None:
                return _Source(entry.handle, f"{preset} ({entry.handle})", entry.name)
    return _Source(preset, preset, preset.rstrip("/").split("/")[-1])


def _load_config(source: _Source) -> dict[str, Any]:
    try:
        path = _compat.preset_file(source.ref, _CONFIG_FILE)
    except FileNotFoundError as e:
        raise PresetError(
            f"The preset {source.label!r} has no {_CONFIG_FILE}. Expected a "
            "KerasHub preset (written by `save_to_preset`). Received: "
            f"{e}"
        ) from e
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _load_metadata(source: _Source) -> dict[str, Any]:
    if not _compat.preset_has_file(source.ref, _METADATA_FILE):
        return {}
    with open(_compat.preset_file(source.ref, _METADATA_FILE), encoding="utf-8") as f:
        return json.load(f)


def _weights_path(source: _Source) -> str:
    if _compat.preset_has_file(source.ref, _WEIGHTS_FILE):
        return _compat.preset_file(source.ref, _WEIGHTS_FILE)
    if _compat.preset_has_file(source.ref, _SHARDED_WEIGHTS_FILE):
        path = _compat.preset_file(source.ref, _SHARDED_WEIGHTS_FILE)
        with open(path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        for value in weight_map.values():  # Downloads remote shards.
            for name in value if isinstance(value, list) else [value]:
                _compat.preset_file(source.ref, name)
        return path
    raise PresetError(
        f"The preset {source.label!r} has no weights. Expected "
        f"{_WEIGHTS_FILE} (or a sharded {_SHARDED_WEIGHTS_FILE}). Received: "
        "neither file. Save the weights with `save_to_preset`."
    )


def _backbone_class(config: Mapping[str, Any], label: str) -> type:
    import keras_hub

    if "registered_name" not in config:
        kind = "a Transformers" if "model_type" in config else "an unknown"
        raise PresetError(
            f"The preset {label!r} has {kind} config.json. Expected a KerasHub "
            "(Keras-format) preset with 'registered_name', whose weights are a "
            "`model.weights.h5`. Convert it once with "
            "`keras_hub.models.Backbone.from_preset(...).save_to_preset(dir)`."
        )
    name = config["registered_name"]
    cls = keras.saving.get_registered_object(name)
    if cls is None or not (
        isinstance(cls, type) and issubclass(cls, keras_hub.models.Backbone)
    ):
        raise PresetError(
            f"Unsupported architecture in preset {label!r}. Expected the "
            "config of a registered KerasHub backbone. Received: "
            f"registered_name={name!r}, which is "
            + ("not registered with Keras" if cls is None else f"a {cls!r}")
            + ". Import the package that defines it, or load a supported "
            "family (Gemma, Llama, Qwen, Mistral, ...)."
        )
    return cls


# --- mesh and layouts --------------------------------------------------------


def _device_mesh(mesh: Any, layout_map: Any, model_axis: str, data_axis: str) -> keras.distribution.DeviceMesh:
    if mesh is None and isinstance(layout_map, keras.distribution.LayoutMap):
        return layout_map.device_mesh
    devices = jax.devices()
    if mesh is None:
        return keras.distribution.DeviceMesh(
            (1, len(devices)), (data_axis, model_axis), devices
        )
    device_mesh = _sharding.keras_device_mesh(mesh)
    if device_mesh is not None:
        return device_mesh
    if isinstance(mesh, Mapping):
        names, shape = tuple(str(k) for k in mesh), tuple(mesh.values())
    elif isinstance(mesh, Sequence) and not isinstance(mesh, str):
        shape = tuple(mesh)
        if len(shape) != 2:
            raise LayoutError(
                "A mesh given as a shape must have two entries, (batch, "
                f"model). Expected e.g. (1, {len(devices)}). Received: "
                f"mesh={mesh!r}. Pass a dict such as {{'{model_axis}': "
                f"{len(devices)}}} for other axis names."
            )
        names = (data_axis, model_axis)
    else:
        raise LayoutError(
            "Expected mesh to be None, a keras.distribution.DeviceMesh, a "
            "jax.sharding.Mesh, a shape such as (1, 8) or a dict such as "
            f"{{'batch': 1, 'model': 8}}. Received: {mesh!r} of type "
            f"{type(mesh).__name__}."
        )
    if not all(isinstance(s, (int, np.integer)) and s >= 1 for s in shape):
        raise LayoutError(
            f"Expected positive integer mesh axis sizes. Received: mesh={mesh!r}."
        )
    size = math.prod(int(s) for s in shape)
    if size > len(devices):
        raise LayoutError(
            f"The mesh {dict(zip(names, shape))} needs {size} devices. Expected "
            f"at most {len(devices)} (jax.devices()). Received: mesh={mesh!r}."
        )
    return keras.distribution.DeviceMesh(
        tuple(int(s) for s in shape), names, devices[:size]
    )


def _has_layout_source(backbone_cls: type) -> bool:
    """Whether a default layout map exists for this backbone class."""
    if callable(getattr(backbone_cls, "get_layout_map", None)):
        return True  # KerasHub's own map.
    return registry.family_of(backbone_cls) in layouts.supported_families()


def _default_layout_map(
    backbone: keras.Model,
    device_mesh: keras.distribution.DeviceMesh,
    model_axis: str,
    data_axis: str,
) -> keras.distribution.LayoutMap:
    axis_names = tuple(device_mesh.axis_names)
    missing = [a for a in (model_axis, data_axis) if a not in axis_names]
    if missing:
        raise LayoutError(
            f"The mesh axis names {axis_names} are not the ones the "
            f"{type(backbone).__name__} layout map uses. Expected axes named "
            f"{model_axis!r} (weights are sharded on it) and {data_axis!r} "
            f"(the batch). Received: mesh axis sizes "
            f"{dict(zip(axis_names, device_mesh.shape))}. Name the mesh axes "
            f"({data_axis!r}, {model_axis!r}), or pass model_axis=... and "
            "data_axis=... naming your axes."
        )
    if _has_layout_source(type(backbone)):
        return layouts.get_layout_map(
            backbone,
            device_mesh,
            model_parallel_dim_name=model_axis,
            data_parallel_dim_name=data_axis,
        )
    # No hand-written map for this family: derive one from the model's
    # structure (the backbone is built without values, so this is cheap).
    return planning.plan_layout(
        backbone, device_mesh, model_axis=model_axis, data_axis=data_axis
    ).layout_map


def _user_layout_map(layout_map: Any, device_mesh: keras.distribution.DeviceMesh) -> keras.distribution.LayoutMap:
    if isinstance(layout_map, keras.distribution.LayoutMap):
        mine = layout_map.device_mesh
        if tuple(mine.shape) != tuple(device_mesh.shape) or tuple(mine.axis_names) != tuple(
            device_mesh.axis_names
        ):
            raise LayoutError(
                "The layout_map was built for another mesh. Expected its "
                f"device_mesh to be {dict(zip(device_mesh.axis_names, device_mesh.shape))}. "
                f"Received: {dict(zip(mine.axis_names, mine.shape))}. Pass "
                "mesh=None to use the layout map's own mesh."
            )
        return layout_map
    if callable(layout_map):
        return layout_map(device_mesh)
    if isinstance(layout_map, Mapping):
        result = keras.distribution.LayoutMap(device_mesh)
        sizes = dict(zip(device_mesh.axis_names, device_mesh.shape))
        for key, axes in layout_map.items():
            entries = getattr(axes, "axes", axes)
            names = [
                n for e in entries if e is not None
                for n in ((e,) if isinstance(e, str) else tuple(e))
            ]
            unknown = [n for n in names if n not in sizes]
            if unknown:
                raise LayoutError(
                    f"Layout map entry {key!r} names mesh axis {unknown[0]!r}, "
                    f"which the mesh does not have. Expected axes among "
                    f"{sorted(sizes)}. Received: axes={tuple(entries)}, mesh "
                    f"axis sizes={sizes}. Rename the axis in the layout map or "
                    "build the mesh with that axis name."
                )
            result[key] = axes
        return result
    raise LayoutError(
        "Expected layout_map to be None, a keras.distribution.LayoutMap, a "
        "dict {path regex: axes} or a callable(device_mesh) -> LayoutMap. "
        f"Received: {type(layout_map).__name__}."
    )


def _suggest_mesh(
    shaped_specs: Sequence[tuple[tuple[int, ...], tuple[Any, ...]]],
    device_mesh: keras.distribution.DeviceMesh,
) -> str:
    names = tuple(device_mesh.axis_names)
    total = math.prod(device_mesh.shape)
    if len(names) != 2:
        return ""
    current = tuple(device_mesh.shape)
    for second in sorted((d for d in range(1, total + 1) if total % d == 0), reverse=True):
        sizes = dict(zip(names, (total // second, second)))
        if (total // second, second) == current:
            continue
        try:
            for shape, axes in shaped_specs:
                _sharding.validate_spec("", shape, axes, sizes)
        except LayoutError:
            continue
        return (
            f" A mesh that works: mesh=({total // second}, {second}), i.e. "
            f"{sizes}."
        )
    return " No 2-axis mesh of these devices divides every sharded dimension."


def _resolve_layouts(
    index: WeightsIndex,
    distribution: keras.distribution.ModelParallel,
    device_mesh: keras.distribution.DeviceMesh,
    data_axis: str,
) -> dict[str, Any]:
    """Variable path -> TensorLayout; validated, or one LayoutError for all."""
    sizes = dict(zip(device_mesh.axis_names, device_mesh.shape))
    layouts: dict[str, Any] = {}
    errors: list[str] = []
    shaped_specs = []
    used_axes: set[str] = set()
    for entry in index.entries:
        try:
            layout = distribution.get_variable_layout(entry.variable)
        except ValueError as e:  # e.g. two regexes of the map match
            raise LayoutError(f"No single layout for {entry.path!r}: {e}") from e
        axes = tuple(layout.axes)
        try:
            _sharding.validate_spec(entry.path, entry.shape, axes, sizes)
        except LayoutError as e:
            errors.append(str(e))
        for a in axes:
            used_axes.update((a,) if isinstance(a, str) else tuple(a or ()))
        shaped_specs.append((entry.shape, axes))
        layouts[entry.path] = layout
    if errors:
        shown = errors[:8]
        more = f"\n  ... and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        raise LayoutError(
            f"The layout map cannot shard {len(errors)} variable(s) on mesh "
            f"{sizes}:\n  " + "\n  ".join(shown) + more
            + "\n" + _suggest_mesh(shaped_specs, device_mesh).strip()
        )
    unused = [
        a for a, s in sizes.items() if s > 1 and a not in used_axes and a != data_axis
    ]
    if unused:
        raise LayoutError(
            f"The mesh axes {unused} are used by no layout of the layout map, "
            f"so every weight would be replicated along them. Expected the "
            f"layout map to shard over every mesh axis of size > 1 other than "
            f"the batch axis {data_axis!r}. Received: mesh axis sizes {sizes}, "
            f"axes the map uses: {sorted(used_axes)}. Rename the mesh axes, "
            "fix the layout map, or pass data_axis=... naming the batch axis."
        )
    return layouts


# --- tasks -----------------------------------------------------------------


def _snake(name: str) -> str:
    import re

    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _task_class(task: Any, backbone_cls: type, metadata: Mapping[str, Any], label: str) -> type:
    import keras_hub

    if isinstance(task, type) and issubclass(task, keras_hub.models.Task):
        cls = task
    else:
        wanted = str(task).replace("-", "_").lower()
        candidates = {
            _snake(n): getattr(keras_hub.models, n)
            for n in dir(keras_hub.models)
            if isinstance(getattr(keras_hub.models, n), type)
            and issubclass(getattr(keras_hub.models, n), keras_hub.models.Task)
        }
        cls = candidates.get(wanted) or candidates.get(wanted.replace("_", ""))
        if cls is None:
            listed = metadata.get("tasks") or []
            raise PresetError(
                f"Unknown task {task!r}. Expected the snake_case name of a "
                f"KerasHub task class, e.g. 'causal_lm'"
                + (f"; this preset lists {[_snake(t) for t in listed]}" if listed else "")
                + f". Received: task={task!r}."
            )
    custom = set(keras.saving.get_custom_objects().values())
    compatible = [
        c for c in custom | {cls}
        if isinstance(c, type) and issubclass(c, cls) and getattr(c, "backbone_cls", None) is backbone_cls
    ]
    if not compatible:
        listed = metadata.get("tasks") or []
        raise PresetError(
            f"The preset {label!r} ({backbone_cls.__name__}) has no "
            f"{cls.__name__} task. Expected one of the tasks it lists: "
            f"{[_snake(t) for t in listed] or 'none listed'}. Received: task={task!r}."
        )
    return cls


def _build_task(
    task_cls: type, source: _Source, backbone: keras.Model, task_kwargs: Mapping[str, Any]
) -> keras.Model:
    # KerasHub's own loader builds the task around our backbone (with the
    # preprocessor / tokenizer assets of the preset) and, with
    # load_weights=False, reads no backbone weight.
    model = task_cls.from_preset(source.ref, load_weights=False, backbone=backbone, **task_kwargs)
    if _compat.preset_has_file(source.ref, _TASK_WEIGHTS_FILE) and model.has_task_weights():
        # Task heads are small; Keras's own loader places them.
        model.load_task_weights(_compat.preset_file(source.ref, _TASK_WEIGHTS_FILE))
    return model


# --- the loader ------------------------------------------------------------


def _build_abstract(
    config: Mapping[str, Any], dtype: Any
) -> tuple[keras.Model, list[Any]]:
    # Exactly what `Backbone.from_preset(preset, dtype=dtype)` does: the
    # argument (None included, i.e. Keras's global dtype policy) replaces the
    # saved policy.
    config = {**config, "config": {**config["config"], "dtype": dtype}}
    with _compat.creating_variables_without_values() as created:
        backbone = keras.saving.deserialize_keras_object(config)
    return backbone, created


def load_sharded_preset(
    preset: str | os.PathLike,
    mesh: Any = None,
    *,
    layout_map: Any = None,
    dtype: Any = None,
    task: str | type | None = None,
    progress: bool | None = None,
    memory_report: bool = False,
    model_axis: str = "model",
    data_axis: str = "batch",
    task_kwargs: Mapping[str, Any] | None = None,
    num_threads: int = 2,
) -> keras.Model | tuple[keras.Model, LoadReport]:
    """Loads a KerasHub preset directly into its final sharding.

    No weight is random-initialized, no full tensor is put on one device
    (unless its layout replicates it), and each process reads from the
    weights file only the bytes its own devices hold. Everything that can be
    wrong with the preset, mesh or layout map is reported before any device
    memory is used, and a failed load leaves nothing behind.

    The returned model owns its memory: no weight aliases the file, so the
    preset can be deleted or overwritten afterwards.

    On return, the `keras.distribution.ModelParallel` used for loading is set
    as the global Keras distribution (`keras.distribution.distribution()`),
    so `model(...)`, `predict`, `generate` and `fit` run sharded. Restore your
    own with `keras.distribution.set_distribution(...)` if needed.

    Args:
        preset: A local KerasHub preset directory, a KerasHub preset name or
            handle (`"gemma_7b_en"`, `"kaggle://..."`, `"hf://..."`, resolved
            and cached by KerasHub's downloader), or a keras_hub_dist
            architecture name (`keras_hub_dist.presets.names()`, e.g.
            `"gemma2_7b"`).
        mesh: `None` (all devices on the model axis: `(1, n)`), a
            `keras.distribution.DeviceMesh`, a `jax.sharding.Mesh`, a shape
            `(batch, model)` such as `(2, 4)`, or a dict such as
            `{"batch": 1, "model": 8}`.
        layout_map: `None` for the family's map (keras_hub_dist's if
            available, else KerasHub's `get_layout_map`), a
            `keras.distribution.LayoutMap`, a dict `{path regex: axes}`, or a
            callable `device_mesh -> LayoutMap`.
        dtype: Dtype (policy) of the model, e.g. `"bfloat16"`; weights are
            cast block by block on the host. Default: as with
            `Backbone.from_preset`, Keras's global dtype policy
            (`keras.config.dtype_policy()`, float32 unless set), whatever
            dtype the preset was saved in.
        task: `None` for the backbone, or a task such as `"causal_lm"` (any
            KerasHub task class name in snake_case, or the class) to get the
            task model with the preset's preprocessor / tokenizer.
        progress: Show a progress bar on stderr; default: when stderr is a
            terminal.
        memory_report: Also return a `LoadReport` (time, bytes read, per
            device peak / final bytes, host RSS) measured until every weight
            is resident.
        model_axis: Mesh axis name the weights are sharded on.
        data_axis: Mesh axis name of the batch.
        task_kwargs: Extra arguments for the task's `from_preset`.
        num_threads: Reader threads (blocks of a variable are read
            concurrently); 1 reads in the calling thread only.

    Returns:
        The backbone (or task) model, or `(model, LoadReport)` with
        `memory_report=True`.

    Raises:
        PresetError: Missing or truncated weights file; variables missing
            from or extra in it; shape or dtype mismatch (the message names
            the path, expected and on-disk values); an unsupported
            architecture; an unknown task.
        LayoutError: Mesh axis names the layout map does not use, or a
            dimension the mesh does not divide (the message names the
            variable and suggests a mesh that works).
    """
    if memory_report:
        from keras_hub_dist import memory

        sampler = memory.MemorySampler()
    else:
        sampler = contextlib.nullcontext()
    start = time.perf_counter()
    with sampler:
        model, plan, stats, index, label = _load(
            preset, mesh, layout_map, dtype, task, progress, model_axis, data_axis,
            dict(task_kwargs or {}), num_threads,
        )
    wall = time.perf_counter() - start
    if not memory_report:
        return model
    report = LoadReport(
        preset=label,
        axis_sizes=dict(plan.axis_sizes),
        wall_s=wall,
        model_bytes=sum(_variable_bytes(v) for v in plan.variables),
        bytes_read=stats.bytes_read,
        file_bytes=index.total_bytes,
        read_calls=stats.read_calls,
        expected_per_device=plan.device_bytes(),
        peak_per_device={
            d: p - sampler.start_per_device.get(d, 0)
            for d, p in sampler.peak_per_device.items()
        },
        final_per_device={
            d: f - sampler.start_per_device.get(d, 0)
            for d, f in sampler.final_per_device.items()
        },
        host_rss_start=sampler.host_start_rss,
        host_rss_peak=sampler.host_peak_rss,
        host_rss_final=sampler.host_final_rss,
    )
    return model, report


def _variable_bytes(var: Any) -> int:
    return math.prod(var.shape) * var.target_dtype.itemsize


def _load(
    preset: Any,
    mesh: Any,
    layout_map: Any,
    dtype: Any,
    task: Any,
    progress: bool | None,
    model_axis: str,
    data_axis: str,
    task_kwargs: dict[str, Any],
    num_threads: int,
) -> tuple[keras.Model, LoadPlan, ExecuteStats, WeightsIndex, str]:
    # Phase 1: resolve and validate; no device memory is used.
    source = _resolve_preset(preset)
    config = _load_config(source)
    backbone_cls = _backbone_class(config, source.label)
    metadata = _load_metadata(source)
    task_cls = _task_class(task, backbone_cls, metadata, source.label) if task else None
    weights_path = _weights_path(source)
    device_mesh = _device_mesh(mesh, layout_map, model_axis, data_axis)

    backbone, deferred = _build_abstract(config, dtype)
    try:
        index = build_index(backbone, weights_path)
        if layout_map is None:
            resolved_map = _default_layout_map(backbone, device_mesh, model_axis, data_axis)
        else:
            resolved_map = _user_layout_map(layout_map, device_mesh)
        distribution = keras.distribution.ModelParallel(
            layout_map=resolved_map,
            batch_dim_name=data_axis if data_axis in device_mesh.axis_names else None,
        )
        layouts = _resolve_layouts(index, distribution, device_mesh, data_axis)
        jax_mesh = _sharding.jax_mesh(device_mesh)
        requests = [
            VariableRequest(e.path, e.dataset, tuple(layouts[e.path].axes), e.dtype)
            for e in index.entries
        ]
        plan = plan_load(requests, jax_mesh, process_index=jax.process_index())
        shardings = {path: layout.backend_layout for path, layout in layouts.items()}
        devices = {d.id: d for d in jax_mesh.devices.flat}
        variables = {e.path: e.variable for e in index.entries}

        # Phase 2: read and place, straight into the final shardings.
        def fill(var_plan: Any, array: jax.Array) -> None:
            _compat.materialize_deferred_variable(
                variables[var_plan.path], array, layouts[var_plan.path]
            )

        bar = ProgressBar(plan.read_bytes, f"Loading {source.short}", progress)
        stats = execute_plan(
            plan, shardings, devices, fill, progress=bar, num_threads=num_threads
        )
        with distribution.scope():
            # Variables Keras never saves (e.g. seed generator states) get
            # their normal initial value, as with stock `from_preset`.
            loaded = {id(v) for v in variables.values()}
            for v in deferred:
                if id(v) not in loaded:
                    _compat.initialize_pending([v])
            model = backbone
            if task_cls is not None:
                model = _build_task(task_cls, source, backbone, task_kwargs)
    except BaseException:
        for v in deferred:
            value = _compat.variable_array(v)
            if isinstance(value, jax.Array):
                with contextlib.suppress(Exception):
                    value.delete()
        raise
    keras.distribution.set_distribution(distribution)
    return model, plan, stats, index, source.label
