"""Save a sharded model as a KerasHub preset, from every process, with no
gather: `save_sharded_preset`.

Stock `save_to_preset` fetches every weight whole to the host of one process
(`Variable.numpy()`): it cannot save a model spread over several processes
(JAX refuses to fetch non-addressable arrays), and in one process it grows
host memory by more than the model. `save_sharded_preset` instead:

1. checks everything on every process and agrees on it (the same target, a
   built model, a writable parent, no existing preset unless `overwrite`);
2. replays Keras's `save_weights` walk to lay out the weights file(s) and
   has process 0 create them in a temporary directory beside the target,
   with every dataset's storage allocated and unfilled
   (`formats.keras_h5_writer`), plus config.json, task.json, the
   preprocessor's files and metadata.json as `save_to_preset` writes them;
3. plans which process writes each distinct block (`save.write_plan`:
   each block once, replicated ones spread over the processes) and has each
   process write its own devices' blocks at their byte offsets
   (`save.write_execute`);
4. hashes the files (each process a share of the 64 MiB chunks) and records
   the checksums in metadata.json (`formats.checksums`);
5. publishes the directory with a rename once every process has finished.

What a save killed outright leaves beside the target (its staging directory,
with an owner record) the next save to that target removes, once it has
proven that save dead (`save.staging`).

Why one preallocated Keras file rather than HDF5 virtual datasets or whole
variables per process: Keras stores each value as one contiguous dataset,
so once process 0 has created the (sparse) file every process can fill its
blocks with positioned writes, concurrently, at offsets the file itself
records. The result is byte-for-byte the layout `save_to_preset` writes (an
ordinary `model.weights.h5`, or Keras's multi-file weights for models over
`max_shard_size`): stock KerasHub, h5py and our loader read it with no
virtual-dataset support and no file per process to carry along. Whole
variables per process would make the process owning a variable gather its
other processes' blocks: a full tensor on one host.

Example:

```python
lm = keras_hub_dist.load_sharded_preset("gemma_7b_en", mesh=(1, 8), task="causal_lm")
lm.backbone.enable_lora(rank=4)
lm.fit(data, epochs=1)
keras_hub_dist.save_sharded_preset(lm, "./gemma_7b_tuned")
keras_hub.models.CausalLM.from_preset("./gemma_7b_tuned")  # stock loads it
```
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import keras
import numpy as np

from keras_hub_dist import _compat, _processes
from keras_hub_dist._progress import byte_progress
from keras_hub_dist.errors import PresetError, SaveError, StaleStagingWarning
from keras_hub_dist.formats import checksums, keras_h5
from keras_hub_dist.storage import host_io
from keras_hub_dist.formats.base import Index
from keras_hub_dist.formats.keras_h5_writer import (
    DatasetLayout,
    WeightsLayout,
    create_weights_files,
    weights_layout,
)
from keras_hub_dist.save import staging
from keras_hub_dist.save.write_execute import WriteStats, write_value
from keras_hub_dist.save.write_plan import SavePlan, SaveRequest, plan_save

__all__ = ["save_sharded_preset"]


@dataclass
class WeightSet:
    """One weights file (or multi-file set) and the model part it saves."""

    model: Any
    skip: Sequence[Any]
    file_name: str
    max_shard_size: float | None
    layout: WeightsLayout
    shardings: dict[str, Any]
    paths: dict[str, str]


def save_sharded_preset(
    model: keras.Model,
    preset_dir: str | os.PathLike,
    *,
    overwrite: bool = False,
    progress: bool | None = None,
    max_shard_size: float | None = 10,
    num_threads: int = 2,
    durable: bool = False,
) -> None:
    """`save_sharded_preset(model, preset_dir, format="keras")`: the preset
    `model.save_to_preset(preset_dir)` writes, from every process, with no
    gather. The arguments, crash safety, `durable` and errors are
    `keras_hub_dist.save_sharded_preset`'s (`save.api`).
    """
    target = _agreed_target(preset_dir)
    backbone, task = _backbone_and_task(model)
    _processes.check_all(_model_error(model), SaveError, "Cannot save the model")
    claim_target(target, overwrite)
    parent, base = os.path.split(target)

    names = _compat.preset_file_names()
    backbone_bytes = _compat.variables_size_in_bytes(backbone.variables)
    multi_file = max_shard_size is not None and backbone_bytes / 2**30 > max_shard_size
    sets = [
        weight_set_of(
            backbone, (), names["sharded_weights" if multi_file else "weights"],
            max_shard_size if multi_file else None,
        )
    ]
    if task is not None and task.has_task_weights():
        sets.append(
            weight_set_of(task, list(backbone._flatten_layers()), names["task_weights"], None)
        )

    token = _processes.broadcast_string(secrets.token_hex(6))
    folder = staging.staging_path(parent, base, token)
    try:
        error = None
        if jax.process_index() == 0:
            error = _guard(lambda: prepare_preset(target, token, durable, backbone, task, sets, names))
        _processes.check_all(error, SaveError, f"Preparing {folder!r} failed")

        plans: list[SavePlan] = []
        error = _guard(lambda: plans.extend(plan_writes(folder, s) for s in sets))
        _processes.check_all(error, SaveError, "Planning the writes failed")

        error = write_blocks(sets, plans, progress, base, durable)
        _processes.check_all(error, SaveError, "Writing the weights failed")

        files = weights_files_of(folder, sets)
        table: list[np.ndarray] = []
        error = _guard(lambda: table.append(_local_digests(files, num_threads)))
        _processes.check_all(error, SaveError, "Hashing the weights files failed")
        digests = _processes.sum_over_processes(table[0])

        if jax.process_index() == 0:
            error = _guard(
                lambda: finish_preset(folder, target, backbone, files, digests, token, names, durable)
            )
        _processes.check_all(error, SaveError, f"Publishing {target!r} failed")
    finally:  # the owner record, and the staging directory unless published
        if jax.process_index() == 0:
            staging.discard(target, token)


def _agreed_target(preset_dir: str | os.PathLike) -> str:
    """The absolute target, once every process has passed the same one."""
    target = os.path.abspath(os.fspath(preset_dir))
    targets = _processes.gather_strings(target)
    if len(set(targets)) > 1:
        raise SaveError(
            "Expected every process to pass the same preset_dir. Received: "
            + ", ".join(f"process {i}: {t!r}" for i, t in enumerate(targets))
            + ". Pass one path on a filesystem all processes share."
        )
    return target


def claim_target(target: str, overwrite: bool) -> None:
    """Removes what dead saves to `target` left (process 0; warns with what
    it removed or left), then checks on every process that `target` may be
    written."""
    parent, base = os.path.split(target)
    error, report = None, []
    if jax.process_index() == 0:  # before the target check: it may restore the target
        error = _guard(lambda: report.append(staging.sweep_stale(parent, base)))
    if report and report[0]:
        # The user's call, through `api.save_sharded_preset` and this module.
        warnings.warn(report[0], StaleStagingWarning, stacklevel=4)
    _processes.check_all(error, SaveError, "Removing what earlier saves left failed")
    _processes.check_all(_target_error(target, overwrite), SaveError, f"Cannot save to {target!r}")


def _create_staging(target: str, token: str, durable: bool) -> str:
    """Creates the owner record and the staging directory of save `token`
    (`staging.create`); returns the directory."""
    try:
        return staging.create(target, token, jax.process_count(), durable=durable)
    except OSError as e:
        raise SaveError(
            f"Expected to create a directory beside preset_dir. Received: "
            f"{type(e).__name__}: {e}. Choose a preset_dir on a writable "
            "filesystem, or fix its permissions."
        ) from e


def _guard(step: Any) -> str | None:
    """Runs `step`; returns its error as a message (for `check_all`)."""
    try:
        step()
    except Exception as e:  # noqa: BLE001 - reported on every process
        return f"{type(e).__name__}: {e}"
    return None


def _backbone_and_task(model: Any) -> tuple[Any, Any]:
    import keras_hub

    if isinstance(model, keras_hub.models.Backbone):
        return model, None
    if isinstance(model, keras_hub.models.Task) and isinstance(
        getattr(model, "backbone", None), keras_hub.models.Backbone
    ):
        return model.backbone, model
    raise SaveError(
        "Expected a keras_hub.models.Backbone or Task (e.g. a CausalLM). "
        f"Received: {type(model).__name__}. Save other Keras models with "
        "`model.save_weights`."
    )


def _model_error(model: Any) -> str | None:
    if not model.built:
        return (
            f"Expected a built model. Received: {type(model).__name__} that "
            "is not built. Call it on data (or `build()` it) first."
        )
    empty, deleted = [], []
    for variable in model.weights:
        array = _compat.variable_array(variable)
        if array is None:
            empty.append(variable.path)
        elif isinstance(array, jax.Array) and array.is_deleted():
            deleted.append(variable.path)
    if empty:
        return (
            f"Expected every variable to hold a value. Received: {len(empty)} "
            f"without one (created inside a StatelessScope, or a load that "
            f"failed), e.g. {empty[:3]}. Load or initialize the model first."
        )
    if deleted:
        return (
            f"Expected every variable to hold a live array. Received: "
            f"{len(deleted)} deleted, e.g. {deleted[:3]}."
        )
    return None


def _target_error(target: str, overwrite: bool) -> str | None:
    if os.path.lexists(target):
        if not os.path.isdir(target):
            return "Expected a directory (or nothing) there. Received: a file."
        if os.listdir(target) and not overwrite:
            return (
                "Expected a new or empty directory. Received: a non-empty "
                "directory. Pass overwrite=True to replace it (only once the "
                "new preset is complete)."
            )
    ancestor = os.path.dirname(target)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        return (
            f"Expected a path under a directory. Received: {ancestor!r} is a "
            "file, so nothing can be created under it. Choose another preset_dir."
        )
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return (
            f"Expected a writable directory. Received: {ancestor!r}, which "
            "this process cannot write to. Choose another preset_dir or fix "
            "its permissions."
        )
    return None


def _device_indices(sharding: Any, shape: tuple[int, ...]) -> dict[Any, Index]:
    return {
        device: tuple(
            (s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(index, shape)
        )
        for device, index in sharding.devices_indices_map(shape).items()
    }


def _saved_array(value: Any) -> Any:
    if isinstance(value, keras.Variable):
        return _compat.variable_array(value)
    return value


def weight_set_of(model: Any, skip: Sequence[Any], file_name: str, max_shard_size: float | None) -> WeightSet:
    """The weights file(s) `file_name` that `model.save_weights` would write
    (layers in `skip` left out): their layout and each value's sharding."""
    shardings: dict[str, Any] = {}
    paths: dict[str, str] = {}

    def remember(dataset: DatasetLayout, value: Any) -> None:
        array = _saved_array(value)
        shardings[dataset.name] = array.sharding if isinstance(array, jax.Array) else None
        paths[dataset.name] = getattr(value, "path", dataset.name)

    layout = weights_layout(model, skip, remember)
    return WeightSet(model, skip, file_name, max_shard_size, layout, shardings, paths)


def prepare_preset(
    target: str, token: str, durable: bool, backbone: Any, task: Any, sets: list[WeightSet],
    names: dict[str, str],
) -> None:
    """Creates save `token`'s staging directory beside `target` (with its
    owner record) holding config.json, task.json, the preprocessor's files
    and every weights file of `sets` laid out, datasets allocated and
    unfilled; run by one process (`save_sharded_preset`) or by `convert`."""
    write_preset_files(_create_staging(target, token, durable), backbone, task, sets, names)


def write_preset_files(
    folder: str, backbone: Any, task: Any, sets: list[WeightSet], names: dict[str, str]
) -> None:
    """Writes into `folder` what `save_to_preset` writes but metadata.json,
    with every weights file of `sets` laid out, datasets allocated and
    unfilled (sparse: only the HDF5 metadata is written)."""
    if task is not None:
        _compat.save_preset_config(task, folder, names["task"])
    _compat.save_preset_config(backbone, folder, names["config"])
    if task is not None and task.preprocessor is not None:
        task.preprocessor.save_to_preset(folder)
    for weight_set in sets:
        create_weights_files(
            weight_set.layout, os.path.join(folder, weight_set.file_name), weight_set.max_shard_size
        )


def plan_writes(folder: str, weight_set: WeightSet) -> SavePlan:
    """This process's writes of `weight_set`, laid out in `folder`."""
    return plan_save(
        save_requests(folder, weight_set), process_index=jax.process_index(), process_count=jax.process_count()
    )


def save_requests(folder: str, weight_set: WeightSet) -> list[SaveRequest]:
    """Every value of `weight_set` with its place in the files laid out in
    `folder` and the devices holding each of its blocks (`plan_save`'s input)."""
    path = os.path.join(folder, weight_set.file_name)
    try:
        on_disk = keras_h5.read_datasets(keras_h5.weights_files(path))
    except PresetError as e:
        raise SaveError(
            f"Process {jax.process_index()} cannot read {path!r}, which process "
            f"0 created. Expected every process to share the filesystem of "
            f"preset_dir. Received: {e}"
        ) from e
    requests = []
    for dataset in weight_set.layout.datasets:
        info = on_disk[dataset.name]
        sharding = weight_set.shardings[dataset.name]
        requests.append(
            SaveRequest(
                dataset.name,
                weight_set.paths[dataset.name],
                dataset.shape,
                dataset.dtype,
                info.file,
                info.offset or 0,
                None if sharding is None else _device_indices(sharding, dataset.shape),
            )
        )
    return requests


def write_blocks(
    sets: list[WeightSet], plans: list[SavePlan], progress: bool | None, base: str, durable: bool,
    files: Any = None, value_writer: Any = None,
) -> str | None:
    """Writes this process's blocks (and with `durable` flushes them to the
    disk); returns its first error as a message.

    `files` is what the blocks are written through (default: the files in
    place, `host_io.FileDescriptors`). `value_writer(entry, value, errors)`,
    if given, writes each value instead of `write_value`: it is called on
    every process for every value, in the walk's order, errors or not (it
    may take collective steps), and appends its own errors to `errors`.

    After a failed write the walks still run to their end: a LoRA-merged
    kernel is computed by all processes together, so every process must
    reach every value.
    """
    # No O_CREAT / O_TRUNC: the files and their datasets exist already.
    files = host_io.FileDescriptors(os.O_WRONLY) if files is None else files
    stats = WriteStats()
    on_cpu = all(d.platform == "cpu" for d in jax.local_devices())
    bar = byte_progress(sum(p.nbytes for p in plans), f"Saving {base}", progress)
    error: list[str] = []

    def walk() -> None:
        for weight_set, plan in zip(sets, plans):
            by_name = {v.name: v for v in plan.values}

            def write(name: str, key: str, value: Any) -> None:
                entry = by_name[name]
                if value_writer is not None:
                    value_writer(entry, _saved_array(value), error)
                    bar.update(entry.nbytes)
                    return
                if error:
                    return
                _processes.reached("part")
                try:
                    write_value(entry, _saved_array(value), files, stats, on_cpu=on_cpu)
                except Exception as e:  # noqa: BLE001 - reported on every process
                    error.append(
                        f"writing {entry.path!r} (dataset {name!r} of "
                        f"{entry.file!r}, shape {entry.shape}, {entry.dtype}) "
                        f"failed: {type(e).__name__}: {e}"
                    )
                bar.update(entry.nbytes)

            keras_h5.walk_saved_values(weight_set.model, write, skip=weight_set.skip)

    return _walk_writes(walk, files, bar, durable, error)


def _walk_writes(walk: Any, files: host_io.FileDescriptors, bar: Any, durable: bool, error: list[str]) -> str | None:
    """Runs `walk` (which writes through `files` and records its errors in
    `error`), flushes what it wrote with `durable`, closes `files` and the
    bar; returns the first error as a message."""
    try:
        walk()
        if durable and not error:
            files.sync()  # what this process wrote, before the processes agree to publish
    except Exception as e:  # noqa: BLE001 - the walk itself failed
        error.append(f"{type(e).__name__}: {e}")
    finally:
        with contextlib.suppress(OSError):
            files.close()
        bar.close()
    return error[0] if error else None


def weights_files_of(folder: str, sets: list[WeightSet]) -> list[str]:
    """The paths of every weights file of `sets` in `folder`, as hashed."""
    files = []
    for weight_set in sets:
        path = os.path.join(folder, weight_set.file_name)
        files += [path] if path.endswith(".h5") else [path, *keras_h5.weights_files(path)]
    return files


def _local_digests(files: list[str], num_threads: int) -> np.ndarray:
    keys = checksums.all_chunks([os.path.getsize(f) for f in files])
    mine = checksums.share(keys, jax.process_index(), jax.process_count())
    digests = checksums.chunk_digests(files, mine, num_threads=num_threads)
    table = np.zeros((len(keys), 32), np.uint8)
    for row, key in enumerate(keys):
        if key in digests:
            table[row] = np.frombuffer(digests[key], np.uint8)
    return table


def finish_preset(
    folder: str,
    target: str,
    backbone: Any,
    files: list[str],
    digests: np.ndarray,
    token: str,
    names: dict[str, str],
    durable: bool,
) -> None:
    """Writes metadata.json with the files' checksums (`digests`) and
    publishes `folder` as `target` (`staging.publish`), once every block is
    written."""
    write_metadata(folder, backbone, files, digests, names)
    _processes.reached("publish")
    staging.publish(folder, target, token, durable=durable)


def write_metadata(folder: str, backbone: Any, files: list[str], digests: np.ndarray, names: dict[str, str]) -> None:
    """Writes `save_to_preset`'s metadata.json into `folder`, with the
    checksums of `files` (`digests`: one row per chunk, `checksums.all_chunks`)."""
    recorded = checksums.entries(files, digests)
    _compat.save_preset_metadata(backbone, folder)
    metadata_path = os.path.join(folder, names["metadata"])
    with open(metadata_path, encoding="utf-8") as f:
        metadata = json.load(f)
    metadata[checksums.METADATA_KEY] = {"checksums": recorded}
    with open(metadata_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(metadata, indent=4))
