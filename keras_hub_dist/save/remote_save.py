"""Save a KerasHub preset straight into object storage (`s3://`, `gs://`),
with nothing written to local disk but a few small files in memory.

An object store has no positioned writes and no rename, so the local save's
two moves (fill preallocated files in place, then rename the directory)
become:

1. **lay out** — the preset's small files and its weights files' skeletons
   (HDF5 metadata, datasets allocated and never filled: sparse) are written
   into a temporary directory in memory (`/dev/shm` where there is one), as
   the local save writes its staging directory; the bytes that are not
   dataset values (a few KiB of HDF5 metadata) are read back from there as
   each part opens (`Skeleton`);
2. **upload** — each weights file is one multipart upload cut into 64 MiB
   parts (`storage.part_uploads`: part `k` is the file's bytes
   `[(k-1) * 64 MiB, k * 64 MiB)`, exactly one checksum chunk). The saver
   writes each value in file order, slab by slab of leading rows
   (`save.write_execute.file_order_slabs`), into the parts' host buffers;
   a part is hashed and uploaded as soon as its last byte is written,
   while the walk goes on, so about `buffer_fraction` of the weights is
   in host buffers at most. Nothing is gathered: each value's blocks are
   read from the devices that hold them, a slab at a time;
3. **publish** — once every part is uploaded the uploads are completed (each
   object appears whole, at once), then the small files, metadata.json
   (with the checksums) and last config.json: a reader finds no preset
   until config.json exists, and then every object it names is complete.
   `overwrite=True` deletes the old config.json first, so the old preset
   is unreadable (not mixed) while it is replaced; objects of the old
   preset the new one does not have are deleted before config.json is
   written.

A failure aborts every upload of the save (no part is left billed) and
leaves an existing preset untouched. A save killed outright leaves its
uploads: its owner record (`.khd-save-<token>.json` beside the preset,
renewed every `LEASE_SECONDS / 4` by a thread while the save runs) lets
the next save to the same target abort them once the record's lease has
lapsed by the store's own clock; uploads of a live save are never touched.
Each abort is named in a `StaleStagingWarning`. The claim, the owner
record, the combining of mixed parts and the publishing are shared with
the Hugging Face export into a bucket (`save.remote_publish`).

Several processes (a pod, no shared filesystem): every process lays out
the same skeleton in its own memory (checked equal across processes),
process 0 creates the uploads and publishes, and each part is uploaded by
the only process with bytes in it, or else the least loaded one
(`save.part_plan`). A part whose
bytes several processes hold (a value split across processes along an axis
other than its first: its blocks are strided in the file) is combined on
its owner first: each process fills a zeroed buffer with its own bytes of
the part and the buffers are summed over the processes in 2 MiB slices
(`_processes.sum_disjoint_bytes`; the bytes are disjoint, so the sum is the
part), right after the last value with bytes in it is written. That costs
the interconnect an all-reduce of the mixed bytes and each device
`2 x 2 MiB / (its process's devices)` for a moment (a slice spread over
them); a layout whose processes hold contiguous ranges combines nothing.

Example:

```python
keras_hub_dist.save_sharded_preset(lm, "s3://my-bucket/gemma_7b_tuned")
keras_hub_dist.load_sharded_preset("s3://my-bucket/gemma_7b_tuned", verify=True)
```
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import tempfile
from typing import Any

import jax
import numpy as np

from keras_hub_dist import _compat, _processes
from keras_hub_dist.errors import SaveError
from keras_hub_dist.formats import checksums, keras_h5
from keras_hub_dist.save.part_plan import plan_parts
from keras_hub_dist.save.remote_publish import (
    SCHEMES,
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
from keras_hub_dist.save.saver import (
    _backbone_and_task,
    _guard,
    _model_error,
    save_requests,
    weight_set_of,
    weights_files_of,
    write_blocks,
    write_metadata,
    write_preset_files,
)
from keras_hub_dist.save.write_execute import file_order_slabs, slab_ends
from keras_hub_dist.save.write_plan import SavePlan, plan_save
from keras_hub_dist.storage.part_uploads import FileUpload, PartUploads, part_count
from keras_hub_dist.storage.ranged_http import RangeClient
from keras_hub_dist.storage.uploads import open_writer

__all__ = ["SCHEMES", "Skeleton", "save_keras_remote"]


def save_keras_remote(
    model: Any,
    url: str,
    *,
    overwrite: bool = False,
    progress: bool | None = None,
    max_shard_size: float | None = 10,
    buffer_fraction: float = 0.12,
) -> None:
    """`save_sharded_preset(model, "s3://..." | "gs://...")` in the Keras
    format, run by every process (see the module doc and
    `keras_hub_dist.save_sharded_preset`)."""
    agreed_url(url)
    backbone, task = _backbone_and_task(model)
    _processes.check_all(_model_error(model), SaveError, "Cannot save the model")
    # Every request says which process sent it (`X-Khd-Process`).
    with RangeClient(process_index=jax.process_index()) as client:
        _save(url, open_writer(url, client), backbone, task, overwrite, progress,
              max_shard_size, buffer_fraction)


def _save(
    url: str, writer: Any, backbone: Any, task: Any, overwrite: bool,
    progress: bool | None, max_shard_size: float | None, buffer_fraction: float,
) -> None:
    first = jax.process_index() == 0
    found: list[dict[str, Any]] = []
    error = _guard(lambda: found.append(claim_remote(writer, overwrite))) if first else None
    _processes.check_all(error, SaveError, f"Cannot save to {url!r}")

    names = _compat.preset_file_names()
    backbone_bytes = _compat.variables_size_in_bytes(backbone.variables)
    multi_file = max_shard_size is not None and backbone_bytes / 2**30 > max_shard_size
    sets = [weight_set_of(
        backbone, (), names["sharded_weights" if multi_file else "weights"],
        max_shard_size if multi_file else None,
    )]
    if task is not None and task.has_task_weights():
        sets.append(weight_set_of(task, list(backbone._flatten_layers()), names["task_weights"], None))

    folder = tempfile.mkdtemp(prefix="khd-save-", dir=memory_dir())
    owner = OwnerRecord(writer, _processes.broadcast_string(secrets.token_hex(6)))
    uploads: dict[str, str] = {}
    try:
        laid_out: list[Any] = []
        error = _guard(lambda: laid_out.append(_lay_out(folder, backbone, task, sets, names)))
        _processes.check_all(error, SaveError, "Laying out the preset failed")
        files, sizes, requests = laid_out[0]
        _processes.check_all(_skeleton_differs(files, sizes), SaveError, "Laying out the preset failed")

        if first:
            names_of = [os.path.relpath(f, folder).replace(os.sep, "/") for f in files]
            error = _guard(lambda: start_uploads(writer, owner, names_of, uploads))
        _processes.check_all(error, SaveError, f"Starting the uploads into {url!r} failed")
        uploads.update(json.loads(_processes.broadcast_string(json.dumps(uploads))))

        digests, parts, error = _upload_weights(
            writer, folder, files, sizes, uploads, sets, requests, progress, url, buffer_fraction,
        )
        _processes.check_all(error, SaveError, f"Uploading the weights into {url!r} failed")

        def finish(digests: np.ndarray, merged: dict[str, list]) -> None:
            write_metadata(folder, backbone, files, digests, names)
            publish(writer, folder, files, uploads, merged, found[0], names)

        publish_job(url, uploads, digests, parts, first, finish)
    finally:
        release_job(writer, owner, uploads, folder, first)


def _lay_out(folder: str, backbone: Any, task: Any, sets: list[Any], names: dict[str, str]) -> tuple:
    """The skeleton in `folder`: weights file paths, sizes, and per set the
    `SaveRequest`s of its values."""
    write_preset_files(folder, backbone, task, sets, names)
    files = weights_files_of(folder, sets)
    return files, {f: os.path.getsize(f) for f in files}, [save_requests(folder, s) for s in sets]


def _skeleton_differs(files: list[str], sizes: dict[str, int]) -> str | None:
    """A message when this process's skeleton differs from process 0's."""
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{os.path.basename(path)}:{sizes[path]}:".encode())
        with open(path, "rb") as f:
            for start, stop in _skeleton_gaps(path):
                digest.update(os.pread(f.fileno(), stop - start, start))
    digests = _processes.gather_strings(digest.hexdigest())
    if digests[jax.process_index()] != digests[0]:
        return (
            f"Expected every process to lay out the same weights files. Received: process "
            f"{jax.process_index()}'s differ from process 0's. Run the same versions of "
            "Keras, KerasHub and h5py on every host."
        )
    return None


def _upload_weights(
    writer: Any, folder: str, files: list[str], sizes: dict[str, int], uploads: dict[str, str],
    sets: list[Any], requests: list[list[Any]], progress: bool | None, url: str, buffer_fraction: float,
) -> tuple[np.ndarray, dict[str, list[tuple[int, str]]], str | None]:
    """Uploads this process's parts of every weights file (skeleton bytes,
    then the values; mixed parts combined on their owners). Returns this
    process's rows of the chunk digests (`checksums.all_chunks` order),
    its parts per file, and its first error as a message."""
    me, count = jax.process_index(), jax.process_count()
    part_bytes = checksums.CHUNK_BYTES  # a part is a checksum chunk: hashed as uploaded
    keys = checksums.all_chunks([sizes[f] for f in files])
    table = np.zeros((len(keys), 32), np.uint8)
    for path in files:
        if part_count(sizes[path], part_bytes) > writer.MAX_PARTS:
            return table, {}, (
                f"Expected at most {writer.MAX_PARTS} parts of {part_bytes >> 20} MiB per file. "
                f"Received: {os.path.basename(path)!r} of {sizes[path]} bytes. Pass a smaller max_shard_size."
            )
    by_set = [[plan_save(r, process_index=p, process_count=count) for p in range(count)] for r in requests]
    plans = [s[me] for s in by_set]
    # Every process's values of every set, in walk order, per process.
    every = [SavePlan(sum((s[p].values for s in by_set), ()), p, ()) for p in range(count)]
    layout = plan_parts(sizes, every, part_bytes)
    row_of = {key: row for row, key in enumerate(keys)}
    number_of = {os.path.relpath(f, folder).replace(os.sep, "/"): i for i, f in enumerate(files)}

    def on_part(name: str, number: int, data: memoryview) -> None:
        table[row_of[(number_of[name], number - 1)]] = np.frombuffer(hashlib.sha256(data).digest(), np.uint8)

    uploads_of = {}
    for f in files:
        name = os.path.relpath(f, folder).replace(os.sep, "/")
        uploads_of[f] = FileUpload(name, sizes[f], uploads[name], layout[f].owned_by(me), layout[f].mixed)
    # Host memory: part buffers of about `buffer_fraction` of the weights (4
    # to 16 of them), all but one uploading while one fills.
    buffers = max(4, min(16, int(buffer_fraction * sum(sizes.values()) / part_bytes)))
    sink = PartUploads(writer, uploads_of, part_bytes=part_bytes, max_buffers=buffers,
                       num_threads=buffers - 1, prefill=Skeleton(files), on_part=on_part)
    combiner = Combiner(sink, layout)
    on_cpu = all(d.platform == "cpu" for d in jax.local_devices())
    walked = [0]

    def value_writer(entry: Any, value: Any, errors: list[str]) -> None:
        # Slab by slab, then every mixed part that slab completed is
        # combined: the same steps on every process, whatever failed here.
        index, walked[0] = walked[0], walked[0] + 1
        slabs = file_order_slabs(entry, value, on_cpu, sink.slab_bytes) if not errors else None
        handle = sink(entry.file)
        ends = slab_ends(entry, sink.slab_bytes)
        for end in ends:
            if slabs is not None:
                try:
                    for offset, iovecs in next(slabs)[1]:
                        sink.pwritev(handle, iovecs, offset)
                except Exception as e:  # noqa: BLE001 - reported on every process
                    errors.append(f"writing {entry.path!r} ({entry.shape}, {entry.dtype}): {type(e).__name__}: {e}")
                    slabs = None
            combiner.advance(entry.file, index, end, ends[-1], errors)

    # Every process walks every value (the combining steps are collective).
    error = write_blocks(
        sets, plans, progress, os.path.basename(url.rstrip("/")), False, files=sink, value_writer=value_writer,
    )
    errors = [error] if error else []
    for path in files:  # parts no value has bytes in (the file's own), and any left
        combiner.advance(path, walked[0], sizes[path], sizes[path], errors)
    parts, error = finish_parts(sink, errors)
    return table, parts, error


def _skeleton_gaps(path: str) -> list[tuple[int, int]]:
    """The byte ranges of weights file `path` that are not dataset values."""
    datasets = sorted(
        (info.offset or 0, (info.offset or 0) + info.nbytes)
        for info in keras_h5.read_datasets([path]).values() if info.file == path
    )
    gaps, position = [], 0
    for start, stop in datasets:
        if start > position:
            gaps.append((position, start))
        position = max(position, stop)
    size = os.path.getsize(path)
    if position < size:
        gaps.append((position, size))
    return gaps


class Skeleton:
    """The bytes of the weights files that are not dataset values (HDF5
    metadata around them), read from the local sparse skeleton as each part
    is opened (`PartUploads`' `prefill`)."""

    def __init__(self, files: list[str]) -> None:
        self._gaps = {path: _skeleton_gaps(path) for path in files}

    def __call__(self, path: str, start: int, stop: int, buffer: np.ndarray) -> int:
        filled = 0
        with open(path, "rb") as f:
            for a, b in self._gaps[path]:
                a, b = max(a, start), min(b, stop)
                if a < b:
                    buffer[a - start : b - start] = np.frombuffer(os.pread(f.fileno(), b - a, a), np.uint8)
                    filled += b - a
        return filled


