"""Load a KerasHub preset or a Hugging Face checkpoint straight into its
shards: `load_sharded_preset`.

Stock `from_preset` under `ModelParallel` random-initializes every weight,
reads each tensor whole into host memory, puts it whole on device 0 and only
then re-shards it. `load_sharded_preset` instead:

1. builds the backbone from the preset's `config.json` with every variable
   created without a value (`shaping.apply.build_shaped`):
   no weight is generated;
2. indexes the checkpoint through its format module (`keras_hub_dist.formats`:
   which tensor holds which variable, at which byte offset) and validates
   everything (missing/extra variables, shapes, dtypes, truncation, mesh axis
   names, divisibility) before any device memory is touched;
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
import math
import os
import time
from collections.abc import Mapping
from typing import Any

import jax
import keras

from keras_hub_dist import _compat, _processes
from keras_hub_dist._progress import byte_progress
from keras_hub_dist.formats import checksums
from keras_hub_dist.storage import host_io
from keras_hub_dist.quantize import kernels as quantize_kernels
from keras_hub_dist.formats.base import CheckpointIndex
from keras_hub_dist.formats.detect import checkpoint_format
from keras_hub_dist.storage.locations import Location, is_remote, open_location
from keras_hub_dist.storage.ranged_http import DEFAULT_CONCURRENCY, RangeClient
from keras_hub_dist.formats.transforms import fallbacks
from keras_hub_dist.load import quantized
from keras_hub_dist.load.block_plan import LoadPlan, VariableRequest, plan_load
from keras_hub_dist.load.execute import ExecuteStats, execute_plan
from keras_hub_dist.load.report import LoadReport
from keras_hub_dist.errors import PresetError
from keras_hub_dist.load.source import PresetSource, read_config, read_metadata, resolve_source
from keras_hub_dist.shaping.generate import DEFAULT_PROMPT_CHUNK, check_prompt_chunk, shard_generate
from keras_hub_dist.shaping.tasks import build_task, check_classes, task_class
from keras_hub_dist.measure.memory import MemorySampler
from keras_hub_dist.shaping.apply import build_shaped
from keras_hub_dist.shaping.remat import remat_scope
from keras_hub_dist.plan.mesh import device_mesh as parse_mesh
from keras_hub_dist.plan.mesh import jax_mesh
from keras_hub_dist.plan import quantization
from keras_hub_dist.plan.quantization import check_quantize_arguments
from keras_hub_dist.plan.quantized_layouts import QuantizationAwareModelParallel
from keras_hub_dist.plan.model_layouts import (
    default_layout_map,
    user_layout_map,
    variable_layouts,
)

__all__ = ["LoadReport", "load_sharded_preset"]


@_processes.raises_process_lost(PresetError, "the load", _processes.LOAD_LEFT)
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
    verify: bool = False,
    concurrency: int = DEFAULT_CONCURRENCY,
    cache_dir: str | os.PathLike | None = None,
    quantize: str | None = None,
    lora_adapter: str | os.PathLike | None = None,
    merge: bool = False,
    prompt_chunk: int | None = DEFAULT_PROMPT_CHUNK,
    remat: Any = None,
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
        preset: A local KerasHub preset directory; a remote one, read by
            byte ranges with each process fetching only its own devices'
            bytes (`"s3://bucket/path"`, `"gs://bucket/path"`,
            `"hf://owner/name[@revision]"`, `"https://host/path"`; see
            docs/remote.md); a KerasHub preset name or handle
            (`"gemma_7b_en"`, `"kaggle://..."`, downloaded whole by
            KerasHub's downloader); or a keras_hub_dist architecture name
            (`keras_hub_dist.presets.names()`, e.g. `"gemma2_7b"`). Hugging
            Face checkpoints (a Transformers `config.json` and
            `model.safetensors` or `model.safetensors.index.json` + shards,
            local or remote) load the same way, converted block by block
            exactly as KerasHub's converter would
            (`keras_hub_dist.formats.huggingface`).
        mesh: `None` (all devices on the model axis: `(1, n)`), a
            `keras.distribution.DeviceMesh`, a `jax.sharding.Mesh`, a shape
            `(batch, model)` such as `(2, 4)`, or a dict such as
            `{"batch": 1, "model": 8}`.
        layout_map: `None` for the family's map (keras_hub_dist's if
            available, else KerasHub's `get_layout_map`), a
            `keras.distribution.LayoutMap`, a dict `{path regex: axes}`, or a
            callable `device_mesh -> LayoutMap`.
        dtype: Float dtype (policy) of the model, e.g. `"bfloat16"`; weights
            are cast block by block on the host. Default: as with
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
        verify: Check every weights file against the checksums that
            `save_sharded_preset` recorded (in metadata.json, or in a
            Hugging Face checkpoint's `model.safetensors.index.json`) before any
            device memory is used (a full read of the files, split over the
            processes). A preset without checksums is an error then, and
            so is an adapter (`lora_adapter`) without those that
            `save_lora_adapter` records.
        concurrency: Range requests in flight at once for a remote preset
            (each at most 16 MiB).
        cache_dir: For a remote preset, where the small files KerasHub's
            task loaders read from disk (config, tokenizer) are kept;
            default: a temporary directory removed after the load. Weight
            files are never written to disk.
        quantize: `"int8"` or `"int4"` to get the model `model.quantize(mode)`
            gives, bitwise, without the float model ever on a device: each
            quantized block is computed on the host from the float block as
            it is read (Keras's own NumPy steps), and only quantized blocks
            are placed. `dtype` stays the float dtype (scales, activations).
            A quantized preset (saved after `quantize`) loads as it is,
            without this argument.
        lora_adapter: A PEFT LoRA adapter to load on top of the base (a
            directory holding `adapter_config.json` and
            `adapter_model.safetensors`, `"hf://owner/adapter"`, or a remote
            location as for `preset`; see docs/lora.md): LoRA is enabled on
            exactly the projections it adapts, with its rank and scaling,
            and its factors are read straight into their shards with the
            base weights. The factors stay trainable (the rest of the
            backbone frozen, as `Backbone.enable_lora` leaves it).
        merge: With `lora_adapter`, fold the update into the kernels
            instead (`W + scaling * B @ A`, computed per block on the host as
            it is read): a plain model with no LoRA variables, for serving.
        prompt_chunk: For a causal LM task, `generate`'s prompt pass runs
            this many positions at a time and its batch is split over
            `data_axis` (`keras_hub_dist.shard_generate`, see
            docs/load.md); `None` leaves KerasHub's `generate` as it is.
            Ignored for a backbone or another task.
        remat: Rematerialization in training (`model.fit`): `None` (off,
            Keras's default), a `keras.RematScope` mode (`"full"`,
            `"activations"`, `"larger_than"`, `"list_of_layers"`) or a
            `keras.RematScope`, applied to the decoder blocks only
            (`shaping.remat`: `"full"` recomputes each block in the backward
            pass from its input, a fit step's per-layer temporaries 0.03x,
            for one more forward pass; docs/plan.md#rematerialization).

    Returns:
        The backbone (or task) model, or `(model, LoadReport)` with
        `memory_report=True`.

    Raises:
        PresetError: A dtype that is not a float dtype (quantized weights
            come from quantizing after the load); missing or truncated weights file; with `verify=True`,
            bytes that differ from the recorded checksums; variables missing
            from or extra in it; shape or dtype mismatch (the message names
            the path, expected and on-disk values); an unsupported
            architecture; an unknown task.
        LayoutError: Mesh axis names the layout map does not use, or a
            dimension the mesh does not divide (the message names the
            variable and suggests a mesh that works; for int4, the packed
            axis).
        QuantizationError: An unknown `quantize` mode, one this Keras lacks,
            or a `dtype` it cannot take (e.g. `dtype="int8"`).
        ValueError: An unknown `remat` mode (before anything is read).
    """
    remat_scope(remat)  # an unknown mode fails before anything is read
    if memory_report:
        sampler = MemorySampler()
    else:
        sampler = contextlib.nullcontext()
    start = time.perf_counter()
    options = _Options(
        mesh, layout_map, dtype, task, progress, model_axis, data_axis,
        dict(task_kwargs or {}), num_threads, verify, concurrency,
        None if cache_dir is None else os.fspath(cache_dir), quantize,
        None if lora_adapter is None else os.fspath(lora_adapter), merge, prompt_chunk,
        remat,
    )
    with sampler, host_io.collector_paused():
        model, plan, stats, index, label = _load(preset, options)
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
        format=index.format,
        fallbacks=tuple(r for e in index.entries for r in fallbacks(e.source)),
        host_bytes_reused=stats.host_bytes_reused,
    )
    return model, report


def _is_causal_lm(model: Any) -> bool:
    import keras_hub

    return isinstance(model, keras_hub.models.CausalLM)


def _variable_bytes(var: Any) -> int:
    return math.prod(var.shape) * var.target_dtype.itemsize


@dataclasses.dataclass(frozen=True)
class _Options:
    """`load_sharded_preset`'s arguments, as the phases of a load use them."""

    mesh: Any
    layout_map: Any
    dtype: Any
    task: Any
    progress: bool | None
    model_axis: str
    data_axis: str
    task_kwargs: dict[str, Any]
    num_threads: int
    verify: bool
    concurrency: int
    cache_dir: str | None
    quantize: str | None
    lora_adapter: str | None = None
    merge: bool = False
    prompt_chunk: int | None = DEFAULT_PROMPT_CHUNK
    remat: Any = None


# The reader of `lora_adapter=`: `(backbone, index, location, label, merge,
# verify, num_threads) -> (index with the adapter's variables, variables it
# created)`. It lives
# above this room (it maps projections with the Hugging Face export's
# mapping, in `save/`) and registers itself when the package is imported.
_ADAPTER_READERS: list[Any] = []


def register_adapter_reader(reader: Any) -> None:
    """Sets the function that reads `lora_adapter=` (see `_ADAPTER_READERS`)."""
    _ADAPTER_READERS[:] = [reader]


def _load(
    preset: Any, options: _Options
) -> tuple[keras.Model, LoadPlan, ExecuteStats, CheckpointIndex, str]:
    # Phase 1: resolve and validate; no device memory is used.
    mode = check_quantize_arguments(options.quantize, options.dtype)
    check_prompt_chunk(options.prompt_chunk)
    source = resolve_source(preset)
    adapter = None if options.lora_adapter is None else resolve_source(options.lora_adapter)
    if adapter is not None and mode is not None:
        raise PresetError(
            "Expected either quantize= or lora_adapter=. Received: both. Load the adapter with "
            "merge=True and quantize the model afterwards."
        )
    client = None
    if any(s is not None and is_remote(s.ref) for s in (source, adapter)):
        client = RangeClient(options.concurrency, process_index=jax.process_index())
    try:
        with contextlib.ExitStack() as stack:
            location = stack.enter_context(open_location(
                source.ref, source.label, client=client, cache_dir=options.cache_dir
            ))
            if adapter is not None:
                adapter = (adapter, stack.enter_context(open_location(adapter.ref, adapter.label, client=client)))
            return _load_from(source, location, client, options, mode, adapter)
    finally:
        if client is not None:
            client.close()


def _load_from(
    source: PresetSource,
    location: Location,
    client: RangeClient | None,
    options: _Options,
    mode: str | None,
    adapter: tuple[PresetSource, Location] | None = None,
) -> tuple[keras.Model, LoadPlan, ExecuteStats, CheckpointIndex, str]:
    mesh, layout_map, model_axis, data_axis = (
        options.mesh, options.layout_map, options.model_axis, options.data_axis
    )
    if mode is not None:
        quantize_kernels.prepare()
    # A remote load's reads wait on the network: more of them run ahead.
    read_ahead = options.num_threads if client is None else max(options.num_threads, options.concurrency)
    config = read_config(location)
    checkpoint = checkpoint_format(config, source.label)
    backbone_cls, backbone_config = checkpoint.backbone_config(config, source.label)
    metadata = read_metadata(location)
    task_cls = task_class(options.task, backbone_cls, metadata, source.label) if options.task else None
    if task_cls is not None:
        # Staged (and every listed name, tokenizer path and class checked)
        # before any device memory is used; `build_task` reuses it.
        location.keras_hub_dir()
        check_classes(location)
    if mesh is None and isinstance(layout_map, keras.distribution.LayoutMap):
        device_mesh = layout_map.device_mesh
    else:
        device_mesh = parse_mesh(mesh, data_axis=data_axis, model_axis=model_axis)

    # Exactly what `Backbone.from_preset(preset, dtype=dtype)` does: the
    # argument (None included, i.e. Keras's global dtype policy) replaces the
    # saved policy, except a quantized preset's policy map, which is kept.
    backbone_config = quantized.preset_config(backbone_config, options.dtype, mode, source.label)
    backbone, deferred = build_shaped(backbone_cls, backbone_config, options.remat)
    _compat.own_dtype_policies(backbone)  # a quantized preset's layers
    quantizing = None
    try:
        index = checkpoint.index_checkpoint(backbone, location, source.label, config)
        if options.verify:
            # A Hugging Face checkpoint records them in its index's metadata.
            recorded = getattr(checkpoint, "checksum_metadata", lambda location: metadata)(location)
            checksums.verify_files(
                index.opened or index.files, recorded, source.label, num_threads=read_ahead
            )
        if adapter is not None:  # verified against its own checksums
            index, created = _ADAPTER_READERS[0](
                backbone, index, adapter[1], adapter[0].label, options.merge, options.verify, read_ahead
            )
            deferred = list(deferred) + list(created)
        if layout_map is None:
            resolved_map = default_layout_map(backbone, device_mesh, model_axis, data_axis)
        else:
            resolved_map = user_layout_map(layout_map, device_mesh)
        float_map = resolved_map
        if mode in (None, "int4") and not quantization.quantized_tensors(backbone):
            # A pre-quantized int4 checkpoint: its codes, 4 bits on the device.
            quantizing = quantized.prequantized_checkpoint(backbone, index)
        if quantizing is None and mode is not None and not quantization.quantized_tensors(backbone):
            quantizing = quantized.quantize_checkpoint(backbone, index, mode)
        if quantizing is not None:
            index, deferred = quantizing.index, quantizing.pending(deferred)
        resolved_map = quantized.quantized_layout_map(backbone, resolved_map, float_map)
        distribution = QuantizationAwareModelParallel(
            layout_map=resolved_map,
            batch_dim_name=data_axis if data_axis in device_mesh.axis_names else None,
        )
        layouts = variable_layouts(index.entries, distribution, device_mesh, data_axis)
        mesh_of_devices = jax_mesh(device_mesh)
        requests = [
            VariableRequest(e.path, e.source, tuple(layouts[e.path].axes), e.dtype)
            for e in index.entries
        ]
        plan = plan_load(requests, mesh_of_devices, process_index=jax.process_index())
        shardings = {path: layout.backend_layout for path, layout in layouts.items()}
        devices = {d.id: d for d in mesh_of_devices.devices.flat}
        # By plan entry, not by path: some models (SmolLM3) reuse a path
        # in every layer; the layout, chosen by path, is the same for all.
        variables = {id(p): e.variable for p, e in zip(plan.variables, index.entries)}

        if quantizing is not None:
            quantized.run_combine(plan, shardings, quantizing.quantizers)

        # Phase 2: read and place, straight into the final shardings.
        def fill(var_plan: Any, array: jax.Array) -> None:
            _compat.materialize_deferred_variable(
                variables[id(var_plan)], array, layouts[var_plan.path]
            )
            if quantizing is not None:
                quantizing.filled(variables[id(var_plan)])

        bar = byte_progress(plan.read_bytes, f"Loading {source.short}", options.progress)
        stats = execute_plan(
            plan, shardings, devices, fill, progress=bar, num_threads=options.num_threads,
            prefetch_threads=read_ahead, on_failure=None if client is None else client.cancel,
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
                model = build_task(task_cls, location, backbone, options.task_kwargs)
                if options.prompt_chunk is not None and _is_causal_lm(model):
                    shard_generate(
                        model, options.prompt_chunk, data_axis=data_axis, model_axis=model_axis
                    )
            # A later `model.quantize(...)` finds its variables' layouts.
            distribution.cover(backbone)
    except BaseException:
        for v in deferred:
            value = _compat.variable_array(v)
            if isinstance(value, jax.Array):
                with contextlib.suppress(Exception):
                    value.delete()
        raise
    keras.distribution.set_distribution(distribution)
    return model, plan, stats, index, source.label
