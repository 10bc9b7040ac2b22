"""Export a Hugging Face checkpoint straight into object storage (`s3://`,
`gs://`): `save_sharded_preset(model, url, format="huggingface")`, run by
every process, with nothing written to local disk but the small files in
memory.

The bytes are those of the local export (`save.hf_export`): the same
mapping (`save.hf_mapping`), the same files (`formats.safetensors_writer`),
each block written through the same pieces by `save.piece_write`'s
`PieceWriter` (transposes and casts as the local export makes them), the
same checksums in `model.safetensors.index.json`. What differs is where the
bytes go and in which order:

1. **claim** — process 0 checks the target and sweeps what killed saves
   left (`save.remote_publish`), before any byte is uploaded;
2. **lay out** — the small files (config.json, generation_config.json, a
   task's tokenizer files) in a temporary directory in memory; the
   safetensors files need no skeleton: a file is its header (known from the
   layout) then its tensors back to back (bytes no tensor piece writes, an
   adapter's padding, are zeros its part's owner writes: `unwritten`);
3. **upload** — each safetensors file is one multipart upload of 64 MiB
   parts (one checksum chunk each, hashed from the buffer it is uploaded
   from). The writes go in the **files' byte order**, not the model's
   (`save.hf_part_plan`): each block write is cut into steps of at most a
   quarter part of the file, and every process takes every process's steps
   in file order, writing its own. A part is uploaded when its last byte is
   written; a part several processes write is combined on its owner after
   its last step (`save.remote_publish.Combiner`). Values are taken one at a
   time from the model: a variable's value as it is, a value Keras computes
   while saving (a LoRA-merged kernel) computed from its layer when its first
   step comes (`_Values`: one layer's at a time, on every process, in the
   same order: the merge is a collective program);
4. **publish** — process 0 completes the uploads, then writes the small
   files, the index with the checksums, and config.json last.

`upload_safetensors` does these steps for any safetensors files described
by a `RemoteFiles`: the checkpoint here, a PEFT adapter
(`save.lora_adapter`) too.

Example:

```python
keras_hub_dist.save_sharded_preset(lm, "gs://my-bucket/gemma_hf", format="huggingface")
keras_hub_dist.load_sharded_preset("gs://my-bucket/gemma_hf", verify=True)
```
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from keras_hub_dist import _compat, _processes
from keras_hub_dist._progress import byte_progress
from keras_hub_dist.errors import SaveError
from keras_hub_dist.formats import checksums
from keras_hub_dist.formats.safetensors_files import INDEX_FILE
from keras_hub_dist.save.hf_export import (
    check_dtype,
    checked_mapping,
    checksummed_index,
    device_indices_of,
    plan_blocks,
    quantization_error,
)
from keras_hub_dist.save.hf_files import write_hf_files
from keras_hub_dist.save.hf_part_plan import peak_open_parts, plan_steps, row_window, sub_write, unwritten
from keras_hub_dist.save.part_plan import plan_step_parts
from keras_hub_dist.save.piece_write import PieceWriter
from keras_hub_dist.save.remote_publish import (
    Combiner,
    OwnerRecord,
    agreed_url,
    claim_remote,
    finish_parts,
    memory_dir,
    publish,
    publish_job,
    release_job,
    start_uploads,
)
from keras_hub_dist.save.saver import _backbone_and_task, _guard, _model_error, _saved_array
from keras_hub_dist.storage.part_uploads import FileUpload, PartUploads, part_count
from keras_hub_dist.storage.ranged_http import RangeClient
from keras_hub_dist.storage.uploads import open_writer

__all__ = ["RemoteFiles", "save_huggingface_remote", "upload_safetensors"]


def save_huggingface_remote(
    model: Any,
    url: str,
    *,
    overwrite: bool = False,
    progress: bool | None = None,
    max_shard_size: float | int | str | None = None,
    dtype: Any = None,
    buffer_fraction: float = 0.12,
) -> None:
    """`save_sharded_preset(model, "s3://..." | "gs://...", format=
    "huggingface")`, run by every process (see the module doc and
    `keras_hub_dist.save_sharded_preset`).

    Args:
        buffer_fraction: Part buffers to hold, as a fraction of the weights
            (4 to 16 parts; more where the plan needs more open at once).
    """
    dtype = check_dtype(dtype, "huggingface")
    agreed_url(url)
    backbone, task = _backbone_and_task(model)
    _processes.check_all(_model_error(model) or quantization_error(model), SaveError, "Cannot export the model")

    def describe() -> RemoteFiles:
        mapping, layout, weight_set = checked_mapping(backbone, task, dtype, max_shard_size)
        return RemoteFiles(
            mapping, layout,
            indices=lambda: device_indices_of(mapping, weight_set),
            values=lambda: _Values(backbone),
            write_files=lambda folder: write_hf_files(folder, backbone, task, mapping.config),
            index_file=INDEX_FILE, config="config.json", label="Exporting",
        )

    with RangeClient(process_index=jax.process_index()) as client:
        upload_safetensors(url, open_writer(url, client), overwrite, progress, describe, buffer_fraction)


@dataclass(frozen=True)
class RemoteFiles:
    """What `upload_safetensors` uploads: safetensors files and small files.

    Attributes:
        mapping: The values' pieces in the tensors (`save.hf_mapping`; its
            datasets are the names `values` knows).
        layout: The safetensors files.
        indices: Called by every process: dataset -> device -> the block it
            holds (`None`: a host value).
        values: Called by every process before the first step: a callable
            dataset -> its array, with `release()` (`_Values`).
        write_files: Called by the first process: writes the small files
            into the directory it is given.
        index_file: The small file that gets the checksums.
        config: The small file written last: the target is readable once
            it is there.
        label: The progress bar's verb.
    """

    mapping: Any
    layout: Any
    indices: Callable[[], dict[str, Any]]
    values: Callable[[], Any]
    write_files: Callable[[str], None]
    index_file: str
    config: str
    label: str


def upload_safetensors(
    url: str, writer: Any, overwrite: bool, progress: bool | None, describe: Callable[[], RemoteFiles],
    buffer_fraction: float = 0.12, what: str = "preset",
) -> None:
    """Steps 1 to 4 of the module doc into `writer`, run by every process:
    the target claimed, then `describe()` (every process) says what to
    upload. Also the PEFT adapter's save (`save.lora_adapter`); `what` the
    target must not hold already (errors say it).

    Raises:
        SaveError: On every process: the target cannot be written or holds
            files (without `overwrite`), before any byte is uploaded; an
            upload or the publish failed (every upload is aborted then).
    """
    first = jax.process_index() == 0
    found: list[dict[str, Any]] = []
    error = _guard(lambda: found.append(claim_remote(writer, overwrite, what))) if first else None
    _processes.check_all(error, SaveError, f"Cannot save to {url!r}")
    files = describe()
    mapping, layout = files.mapping, files.layout
    names = [f.name for f in layout.files]
    folder = tempfile.mkdtemp(prefix="khd-export-", dir=memory_dir())
    owner = OwnerRecord(writer, _processes.broadcast_string(secrets.token_hex(6)))
    uploads: dict[str, str] = {}
    try:
        if first:
            def start() -> None:
                files.write_files(folder)
                start_uploads(writer, owner, names, uploads)

            error = _guard(start)
        _processes.check_all(error, SaveError, f"Starting the uploads into {url!r} failed")
        uploads.update(json.loads(_processes.broadcast_string(json.dumps(uploads))))

        planned: list[Any] = []

        def plan() -> None:
            indices = files.indices()
            count = jax.process_count()
            plans = [plan_blocks(mapping, layout, "", indices, process_index=p, process_count=count)[0]
                     for p in range(count)]
            planned.extend([plans, plan_steps(plans, names, _slab_bytes(checksums.CHUNK_BYTES))])

        error = _guard(plan)
        _processes.check_all(error, SaveError, "Planning the writes failed")
        plans, steps = planned

        digests, parts, error = _upload(writer, files, uploads, plans, steps, progress, url, buffer_fraction)
        _processes.check_all(error, SaveError, f"Uploading the weights into {url!r} failed")

        def finish(digests: np.ndarray, merged: dict[str, list]) -> None:
            paths = [os.path.join(folder, n) for n in names]
            with open(os.path.join(folder, files.index_file), "w", encoding="utf-8") as f:
                f.write(checksummed_index(layout, paths, digests))
            publish(writer, folder, paths, uploads, merged, found[0], {"config": files.config})

        publish_job(url, uploads, digests, parts, first, finish)
    finally:
        release_job(writer, owner, uploads, folder, first)


def _slab_bytes(part_bytes: int) -> int:
    """File bytes one step spans at most: a quarter part (as
    `PartUploads.slab_bytes`), so a step opens at most two parts."""
    return max(1, min(16 << 20, part_bytes // 4))


class _Values:
    """The values the model saves, by dataset name, one at a time: a
    variable's as it is; a computed one (LoRA-merged) computed again from its
    layer, whose values are kept until another layer's are asked for."""

    def __init__(self, backbone: Any) -> None:
        self._owners: dict[str, tuple[Any, Any, str]] = {}
        store = _OwnerStore(self._owners)
        _compat.walk_saved_variables(backbone, store)
        self._layer: Any = None
        self._computed: dict[str, Any] = {}

    def __call__(self, dataset: str) -> Any:
        if dataset not in self._owners:
            raise ValueError(f"the model no longer saves {dataset!r} (changed since it was mapped)")
        variable, layer, key = self._owners[dataset]
        if variable is not None:
            return _saved_array(variable)
        if layer is not self._layer:
            self._computed, self._layer = {}, None  # the previous layer's go first
            self._computed = _saved_by(layer)
            self._layer = layer
        return self._computed[key]

    def release(self) -> None:
        self._computed, self._layer = {}, None


class _OwnerStore(_compat.H5IOStore):
    """Stands in for Keras's weights store: records, per dataset, the
    variable saved (or `None` for a computed value) and its layer."""

    def __init__(self, owners: dict[str, tuple[Any, Any, str]]) -> None:  # noqa: D107 - no file
        self._owners = owners
        self._path = ""
        self._layer: Any = None

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: Any = None) -> _OwnerStore:
        self._path, self._layer = path, _compat.saveable_being_saved()
        return self

    def __setitem__(self, key: str, value: Any) -> None:
        import keras

        name = f"{self._path}/vars/{key}" if self._path else f"vars/{key}"
        self._owners[name] = (value if isinstance(value, keras.Variable) else None, self._layer, key)

    def close(self) -> None:
        pass


class _KeyStore(_compat.H5IOStore):
    """Collects what one layer's `save_own_variables` saves, by key."""

    def __init__(self) -> None:  # noqa: D107 - no file
        self.values: dict[str, Any] = {}

    def __bool__(self) -> bool:
        return True

    def __setitem__(self, key: str, value: Any) -> None:
        self.values[key] = value

    def close(self) -> None:
        pass


def _saved_by(layer: Any) -> dict[str, Any]:
    store = _KeyStore()
    layer.save_own_variables(store)
    return {k: _saved_array(v) for k, v in store.values.items()}


def _upload(
    writer: Any, files: RemoteFiles, uploads: dict[str, str], plans: list[dict[str, list[Any]]],
    steps: list[Any], progress: bool | None, url: str, buffer_fraction: float,
) -> tuple[np.ndarray, dict[str, list[tuple[int, str]]], str | None]:
    """Takes every step in order, writing this process's into the parts;
    returns this process's rows of the chunk digests, its parts per file,
    and its first error as a message."""
    me, count, layout = jax.process_index(), jax.process_count(), files.layout
    part_bytes = checksums.CHUNK_BYTES  # a part is a checksum chunk: hashed as uploaded
    sizes = {f.name: f.size for f in layout.files}
    keys = checksums.all_chunks(list(sizes.values()))
    table = np.zeros((len(keys), 32), np.uint8)
    for name, size in sizes.items():
        if part_count(size, part_bytes) > writer.MAX_PARTS:
            return table, {}, (
                f"Expected at most {writer.MAX_PARTS} parts of {part_bytes >> 20} MiB per file. "
                f"Received: {name!r} of {size} bytes. Pass a smaller max_shard_size."
            )
    parts_plan = plan_step_parts(sizes, ((s.process, s.file, i, s.runs) for i, s in enumerate(steps)), count, part_bytes)
    row_of = {key: row for row, key in enumerate(keys)}
    number_of = {name: i for i, name in enumerate(sizes)}
    headers = {f.name: f.header for f in layout.files}

    def on_part(name: str, number: int, data: memoryview) -> None:
        table[row_of[(number_of[name], number - 1)]] = np.frombuffer(hashlib.sha256(data).digest(), np.uint8)

    holes = unwritten(steps, sizes, {n: len(h) for n, h in headers.items()})

    def prefill(name: str, start: int, stop: int, buffer: np.ndarray) -> int:
        # A safetensors file's bytes that are not values: its header, and
        # the zeros no tensor piece writes (an adapter's padding).
        header = headers[name][start:stop]
        buffer[: len(header)] = np.frombuffer(header, np.uint8)
        filled = len(header)
        for low, high in holes.get(name, ()):
            low, high = max(low, start), min(high, stop)
            if low < high:
                buffer[low - start : high - start] = 0
                filled += high - low
        return filled

    targets = {
        n: FileUpload(n, sizes[n], uploads[n], parts_plan[n].owned_by(me), parts_plan[n].mixed) for n in sizes
    }
    # Host memory: part buffers of about `buffer_fraction` of the weights (4
    # to 16), or what the plan keeps open at once if more (plus two: one
    # uploading, one opening).
    buffers = max(4, min(16, int(buffer_fraction * sum(sizes.values()) / part_bytes)),
                  peak_open_parts(steps, me, part_bytes) + 2)
    sink = PartUploads(writer, targets, part_bytes=part_bytes, max_buffers=buffers, num_threads=buffers - 1,
                       prefill=prefill, on_part=on_part)
    combiner = Combiner(sink, parts_plan)
    errors: list[str] = []
    _run_steps(files, plans[me], steps, sink, combiner, sizes, errors, progress, url)
    for name, size in sizes.items():  # parts no step writes (the header's alone), and any left
        combiner.advance(name, len(steps), size, size, errors)
    parts, error = finish_parts(sink, errors)
    return table, parts, error


def _run_steps(
    files: RemoteFiles, mine: dict[str, list[Any]], steps: list[Any], sink: PartUploads, combiner: Combiner,
    sizes: dict[str, int], errors: list[str], progress: bool | None, url: str,
) -> None:
    """Every step, in order, on every process: the value fetched (computed
    values are collective), this process's steps written, then the mixed
    parts that step completed combined. After an error, only the collective
    work goes on."""
    me = jax.process_index()
    on_cpu = all(d.platform == "cpu" for d in jax.local_devices())
    writer = PieceWriter(sink)
    total = sum(s.runs.nbytes for s in steps if s.process == me)
    bar = byte_progress(total, f"{files.label} {os.path.basename(url.rstrip('/'))}", progress)
    values = files.values()
    current: tuple[str | None, Any, Any] = (None, None, None)  # dataset, its shards, its host copy
    try:
        for index, step in enumerate(steps):
            try:
                array = values(step.dataset)
                if step.process == me and not errors:
                    if current[0] != step.dataset:
                        current = (step.dataset, _shards(array), None)
                    block = mine[step.dataset][step.block]
                    file, write, dtype = block.writes[step.write]
                    if block.device_id is None:  # a host value: its whole array is the block
                        if current[2] is None:
                            current = (current[0], current[1], np.ascontiguousarray(np.asarray(array)))
                        data = current[2]
                    else:
                        data = current[1][block.device_id]
                    expected = tuple(b - a for a, b in block.index)
                    if tuple(data.shape) != expected:
                        raise ValueError(f"block {block.index} has shape {tuple(data.shape)}, expected {expected}")
                    writer.write(_rows(data, write, step, on_cpu), [(file, sub_write(write, step.first, step.stop), dtype)])
                    bar.update(step.runs.nbytes)
            except Exception as e:  # noqa: BLE001 - reported on every process
                errors.append(f"writing {step.dataset!r} into {step.file!r}: {type(e).__name__}: {e}")
            combiner.advance(step.file, index, sizes[step.file], sizes[step.file], errors)
    finally:
        values.release()
        bar.close()


def _shards(array: Any) -> dict[int, Any]:
    return {s.device.id: s.data for s in array.addressable_shards} if isinstance(array, jax.Array) else {}


def _rows(data: Any, write: Any, step: Any, on_cpu: bool) -> np.ndarray:
    """The slice of a block that rows `step.first:step.stop` of `write`
    read, on the host (on CPU a view of the device buffer; elsewhere only
    that slice crosses to the host)."""
    window = row_window(write, step.first, step.stop)
    index = [slice(None)] * len(data.shape)
    if window is not None:
        dim, low, high = window
        index[dim] = slice(low, high)
    if isinstance(data, np.ndarray):
        return data[tuple(index)]
    if on_cpu:
        return _compat.host_array(data)[tuple(index)]
    return _compat.host_array(data[tuple(index)])

