"""Export a sharded model as a Hugging Face (Transformers) checkpoint, from
every process, with no gather: `save_sharded_preset(..., format="huggingface")`.

Stock `export_to_transformers` turns every weight into one host NumPy array
(device transposes included) and writes one `model.safetensors`: host memory
grows by more than the model, and a model spread over several processes
cannot be exported at all. Here the steps of the Keras-format save
(`save.saver`) are kept, and only the file layout differs:

1. every process checks and agrees on the target and the model, then maps
   the model to its checkpoint (`save.hf_mapping`: KerasHub's exporter and
   importer replayed on a copy of the model built without values);
2. process 0 creates the safetensors files in a temporary directory beside
   the target, headers written and data a hole (`formats.safetensors_writer`,
   Transformers' sharding), plus config.json, generation_config.json and a
   task's tokenizer files (`save.hf_files`);
3. each distinct block of each variable is written by one process holding
   it (`save.write_plan.block_owners`), through the pieces of the tensors it
   lands in (`formats.pieces.block_writes`), with positioned writes: a block
   whose bytes are in the file's order goes from the device buffer as it is,
   one that needs a transpose or a cast through a 16 MiB host buffer
   (`save.piece_write`);
4. the files are hashed (each process a share of the 64 MiB chunks) and the
   checksums recorded in `model.safetensors.index.json`'s metadata;
5. process 0 publishes the directory with a rename once all have finished.

The staging directory, its owner record, the sweep of what dead saves left
and `durable=True` are the Keras-format save's (`save.staging`).

Example:

```python
keras_hub_dist.save_sharded_preset(lm, "./gemma_hf", format="huggingface")
transformers.AutoModelForCausalLM.from_pretrained("./gemma_hf")
```
"""

from __future__ import annotations

import inspect
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from keras_hub_dist import _compat, _processes
from keras_hub_dist._progress import byte_progress
from keras_hub_dist.errors import SaveError
from keras_hub_dist.formats import checksums, keras_h5
from keras_hub_dist.storage import host_io
from keras_hub_dist.formats.base import Index, is_float, numpy_dtype
from keras_hub_dist.formats.pieces import BlockWrite, block_writes
from keras_hub_dist.formats.safetensors_files import INDEX_FILE
from keras_hub_dist.formats.safetensors_writer import (
    SafetensorsLayout,
    create_files,
    dtype_name,
    index_json,
    plan_files,
)
from keras_hub_dist.plan.abstract import build_without_values
from keras_hub_dist.save.hf_files import write_hf_files
from keras_hub_dist.save.hf_mapping import HfMapping, hf_mapping
from keras_hub_dist.save import staging
from keras_hub_dist.save.piece_write import PieceWriter
from keras_hub_dist.save.saver import (
    _agreed_target,
    _backbone_and_task,
    _create_staging,
    _device_indices,
    _guard,
    _local_digests,
    _model_error,
    _saved_array,
    _walk_writes,
    claim_target,
    weight_set_of,
)
from keras_hub_dist.save.write_plan import block_owners

__all__ = [
    "BlockPlan", "check_dtype", "checked_mapping", "checksummed_index", "device_indices_of", "plan_blocks",
    "quantization_error", "save_huggingface", "shard_size", "twin_config",
]


@dataclass(frozen=True)
class BlockPlan:
    """One block this process writes: where it comes from and its writes
    `(file path, BlockWrite, file dtype)`."""

    device_id: int | None
    index: Index
    writes: tuple[tuple[str, BlockWrite, np.dtype], ...]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for _, w, _ in self.writes)


def shard_size(max_shard_size: float | int | str | None) -> int | str:
    """`max_shard_size` as Transformers takes it: `None` for its default
    (`"50GB"`), a number of GB (as for the Keras format), or a string such as
    `"5GB"`."""
    if max_shard_size is None:
        return "50GB"
    if isinstance(max_shard_size, str):
        return max_shard_size
    return max(1, int(max_shard_size * 1e9))


def plan_blocks(
    mapping: HfMapping,
    layout: SafetensorsLayout,
    directory: str,
    device_indices: Mapping[str, Mapping[Any, Index] | None],
    *,
    process_index: int,
    process_count: int,
) -> tuple[dict[str, list[BlockPlan]], list[int]]:
    """Which blocks of which dataset this process writes, and how.

    Args:
        mapping: The model's checkpoint.
        layout: Its files.
        directory: Where the files are.
        device_indices: Dataset -> device -> the block it holds (`None`: a
            host value, written by process 0).
        process_index: This process.
        process_count: Processes of the job.

    Returns:
        `(dataset -> its blocks here, bytes each process writes)`.
    """
    load = [0] * process_count
    specs = {t.name: t for t in layout.tensors}
    plans: dict[str, list[BlockPlan]] = {}
    for dataset, pairs in mapping.pieces.items():
        shape = mapping.shapes[dataset]
        itemsize = max(np.dtype(specs[t].dtype).itemsize for t, _ in pairs)
        indices = device_indices[dataset]
        if indices is None:
            full = tuple((0, d) for d in shape)
            load[0] += int(np.prod(shape)) * itemsize
            owners = [(full, None)] if process_index == 0 else []
        else:
            owners = [(i, d) for i, d in block_owners(indices, itemsize, load) if d.process_index == process_index]
        mine = []
        for index, device in owners:
            writes = []
            for tensor, piece in pairs:
                file, offset = layout.place(tensor)
                dtype = np.dtype(specs[tensor].dtype)
                for write in block_writes(piece, shape, index, offset, dtype.itemsize):
                    writes.append((os.path.join(directory, file), write, dtype))
            mine.append(BlockPlan(None if device is None else device.id, index, tuple(writes)))
        plans[dataset] = mine
    return plans, load


def checksummed_index(layout: SafetensorsLayout, paths: list[str], digests: np.ndarray) -> str:
    """`model.safetensors.index.json` with the checksum of every file (from
    `digests`, one row per 64 MiB chunk of `paths`, in order; the files'
    sizes are the layout's, so `paths` need not exist here)."""
    sizes = [f.size for f in layout.files]
    return index_json(layout, {checksums.METADATA_KEY: {"checksums": checksums.entries(paths, digests, sizes)}})


def check_dtype(dtype: Any, to: str) -> np.dtype | None:
    """`dtype` as a NumPy dtype, if the `to` format can hold it as weights.

    Raises:
        SaveError: Not a floating-point dtype, or one safetensors lacks.
    """
    if dtype is None:
        return None
    try:
        resolved = np.dtype(numpy_dtype(dtype))
    except (TypeError, ValueError) as e:
        raise SaveError(f"Expected a floating-point dtype such as 'bfloat16'. Received: dtype={dtype!r} ({e}).") from e
    if not is_float(resolved) or (to == "huggingface" and dtype_name(resolved) is None):
        raise SaveError(
            f"Expected a floating-point dtype the {to} format can hold (float32, bfloat16, "
            f"float16{', float64, float8_e4m3fn, float8_e5m2' if to == 'huggingface' else ''}). "
            f"Received: dtype={dtype!r}."
        )
    return resolved


def quantization_error(model: Any) -> str | None:
    quantized = sorted({
        layer.path
        for layer in model._flatten_layers()
        if getattr(getattr(layer, "dtype_policy", None), "quantization_mode", None)
    })
    if not quantized:
        return None
    return (
        f"Expected an unquantized model. Received: {len(quantized)} quantized layer(s), e.g. "
        f"{quantized[:3]}; the Hugging Face export writes floating-point weights only. "
        "Export the model before `quantize(...)`, or save it with format='keras'."
    )


def _write(
    backbone: Any, plans: dict[str, list[BlockPlan]], progress: bool | None, base: str, durable: bool
) -> str | None:
    """Writes this process's blocks (and with `durable` flushes them to the
    disk); returns its first error as a message. The walk runs to its end
    after an error (LoRA merges are collective)."""
    files = host_io.FileDescriptors(os.O_WRONLY)
    writer = PieceWriter(files)
    bar = byte_progress(sum(b.nbytes for p in plans.values() for b in p), f"Exporting {base}", progress)
    error: list[str] = []
    seen: set[str] = set()

    def write(name: str, key: str, value: Any) -> None:
        seen.add(name)
        blocks = plans.get(name)
        if error or not blocks:
            return
        _processes.reached("part")
        array = _saved_array(value)
        try:
            shards = {s.device.id: s for s in array.addressable_shards} if isinstance(array, jax.Array) else {}
            for block in blocks:
                if block.device_id is None:
                    host = np.asarray(array)
                else:
                    host = _compat.host_array(shards[block.device_id].data)
                expected = tuple(b - a for a, b in block.index)
                if tuple(host.shape) != expected:
                    raise ValueError(f"block {block.index} has shape {host.shape}, expected {expected}")
                writer.write(host, block.writes)
                bar.update(block.nbytes)
                del host
        except Exception as e:  # noqa: BLE001 - reported on every process
            error.append(f"writing dataset {name!r} failed: {type(e).__name__}: {e}")

    def walk() -> None:
        keras_h5.walk_saved_values(backbone, write)
        missing = sorted(set(plans) - seen)
        if missing and not error:
            error.append(f"the model no longer saves {missing[:3]} (changed since it was mapped)")

    return _walk_writes(walk, files, bar, durable, error)


def twin_config(backbone: Any) -> dict[str, Any]:
    """`backbone.get_config()`, plus constructor arguments it forgets but
    keeps as attributes (KerasHub 0.32's `LlamaBackbone` leaves out
    `tie_word_embeddings`: its copy would grow an untied head)."""
    config = backbone.get_config()
    for name in inspect.signature(type(backbone).__init__).parameters:
        if name not in config and name not in ("self", "kwargs") and hasattr(backbone, name):
            config[name] = getattr(backbone, name)
    return config


def _mapping_of(backbone: Any, task: Any, dtype: Any) -> HfMapping:
    """The checkpoint of `backbone`, mapped on a copy built without values."""
    twin, created = build_without_values(type(backbone), twin_config(backbone))
    try:
        tokenizer = getattr(getattr(task, "preprocessor", None), "tokenizer", None)
        return hf_mapping(twin, tokenizer=tokenizer, dtype=dtype)
    finally:
        _compat.forget_deferred_variables(created)


def checked_mapping(backbone: Any, task: Any, dtype: Any, max_shard_size: Any) -> tuple[HfMapping, SafetensorsLayout, Any]:
    """The model's checkpoint (mapped on a copy built without values), its
    files, and the model's `WeightSet`; run by every process.

    Raises:
        SaveError: On every process, when mapping failed on one or the model
            saves other shapes than the copy.
    """
    found: list[HfMapping] = []
    error = _guard(lambda: found.append(_mapping_of(backbone, task, dtype)))
    _processes.check_all(error, SaveError, "Mapping the model to the Hugging Face format failed")
    mapping = found[0]
    layout = plan_files(mapping.tensors, shard_size(max_shard_size))
    weight_set = weight_set_of(backbone, (), "", None)
    live = {d.name: d.shape for d in weight_set.layout.datasets}
    differ = sorted(d for d, shape in mapping.shapes.items() if live.get(d) != shape)
    _processes.check_all(
        differ and (
            f"Expected the model to save what a copy built from its config saves. Received: "
            f"{len(differ)} dataset(s) differ, e.g. {differ[:3]} "
            f"(model: {[live.get(d) for d in differ[:3]]}, copy: {[mapping.shapes[d] for d in differ[:3]]})."
        ) or None,
        SaveError, "Cannot export the model",
    )
    return mapping, layout, weight_set


def device_indices_of(mapping: HfMapping, weight_set: Any) -> dict[str, Any]:
    """Dataset -> device -> the block it holds, of every mapped dataset
    (`None`: a host value)."""
    return {
        d: None if weight_set.shardings.get(d) is None
        else _device_indices(weight_set.shardings[d], mapping.shapes[d])
        for d in mapping.pieces
    }


def save_huggingface(
    model: Any,
    preset_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool | None = None,
    max_shard_size: float | int | str | None = None,
    num_threads: int = 2,
    dtype: Any = None,
    durable: bool = False,
) -> None:
    """`save_sharded_preset(model, preset_dir, format="huggingface")`; see
    `keras_hub_dist.save_sharded_preset`."""
    dtype = check_dtype(dtype, "huggingface")
    target = _agreed_target(preset_dir)
    backbone, task = _backbone_and_task(model)
    _processes.check_all(_model_error(model) or quantization_error(model), SaveError, "Cannot export the model")
    claim_target(target, overwrite)
    mapping, layout, weight_set = checked_mapping(backbone, task, dtype, max_shard_size)

    parent, base = os.path.split(target)
    token = _processes.broadcast_string(secrets.token_hex(6))
    folder = staging.staging_path(parent, base, token)
    paths = [os.path.join(folder, f.name) for f in layout.files]
    try:
        error = None
        if jax.process_index() == 0:
            error = _guard(lambda: prepare_export(target, token, durable, layout, backbone, task, mapping))
        _processes.check_all(error, SaveError, f"Preparing {folder!r} failed")

        plans: dict[str, list[BlockPlan]] = {}

        def plan() -> None:
            indices = device_indices_of(mapping, weight_set)
            plans.update(plan_blocks(
                mapping, layout, folder, indices,
                process_index=jax.process_index(), process_count=jax.process_count(),
            )[0])
            missing = [p for p in paths if not os.path.exists(p)]
            if missing:
                raise SaveError(
                    f"Process {jax.process_index()} cannot see {missing[0]!r}, which process 0 "
                    "created. Expected every process to share the filesystem of preset_dir."
                )

        error = _guard(plan)
        _processes.check_all(error, SaveError, "Planning the writes failed")

        error = _write(backbone, plans, progress, base, durable)
        _processes.check_all(error, SaveError, "Writing the weights failed")

        table: list[np.ndarray] = []
        error = _guard(lambda: table.append(_local_digests(paths, num_threads)))
        _processes.check_all(error, SaveError, "Hashing the weights files failed")
        digests = _processes.sum_over_processes(table[0])

        if jax.process_index() == 0:
            error = _guard(lambda: finish_export(folder, target, layout, paths, digests, token, durable))
        _processes.check_all(error, SaveError, f"Publishing {target!r} failed")
    finally:  # the owner record, and the staging directory unless published
        if jax.process_index() == 0:
            staging.discard(target, token)


def prepare_export(
    target: str, token: str, durable: bool, layout: SafetensorsLayout, backbone: Any, task: Any,
    mapping: HfMapping,
) -> None:
    """Creates save `token`'s staging directory beside `target` (with its
    owner record) holding the export's small files and its safetensors
    files laid out (`layout`), headers written and tensors unfilled; run
    by one process (`save_huggingface`) or by `convert`."""
    folder = _create_staging(target, token, durable)
    write_hf_files(folder, backbone, task, mapping.config)
    create_files(layout, folder)


def finish_export(
    folder: str, target: str, layout: SafetensorsLayout, paths: list[str], digests: np.ndarray,
    token: str, durable: bool,
) -> None:
    """Records the files' checksums (`digests`) in the index and publishes
    `folder` as `target` (`staging.publish`), once every tensor is written."""
    with open(os.path.join(folder, INDEX_FILE), "w", encoding="utf-8") as f:
        f.write(checksummed_index(layout, paths, digests))
    _processes.reached("publish")
    staging.publish(folder, target, token, durable=durable)

