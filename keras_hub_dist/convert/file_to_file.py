"""Convert a checkpoint between KerasHub's and Hugging Face's formats, file
to file, without building the model's values: `convert_checkpoint` (and
`keras-hub-dist convert SRC DST --to keras|huggingface`).

Stock conversion (`from_preset` then `save_to_preset` / `export_to_transformers`)
holds the whole model in memory, twice. Here the model is only built without
values, to plan: the source is indexed as for a load (`formats.keras_h5` /
`formats.huggingface`), the target laid out as for a save
(`formats.keras_h5_writer` / `save.hf_mapping` + `formats.safetensors_writer`),
and the two are joined by affine pieces (`formats.pieces`): each tile of a
source tensor is read (`preadv` of its byte runs), goes through the
transform (`save.piece_write`: transposes as XLA programs on a CPU device,
8 MiB slab by slab, into a reused buffer; casts through one 16 MiB buffer)
and is written at its offsets in the target file. A tile is at most
`TILE_BYTES`; `num_threads` workers each convert one tile at a time into
their own reused buffers (one reads while another transposes), so host
memory is bounded by `num_threads x (2 x 256 + 24) MiB` (tile, transposed
tile, cast buffer and one XLA slab) plus the plan, whatever the model's size
(`BENCHMARKS.md`). A value that is not a pure rearrangement of stored
tensors (gpt-oss's MXFP4 experts) is converted tile by tile in the
variable's own layout instead.

Same crash safety as `save_sharded_preset` (`save.staging`): written into
`.<name>.partial-<token>` beside the target, with its owner record,
checksummed, renamed into place when complete; a failure (or a kill) leaves
the target untouched, and the next save or conversion to that target removes
what a killed one left. Sources are what `load_sharded_preset` reads
(`load.source`, `storage.locations`): a directory, a KerasHub handle, or a
remote location read by byte ranges. It reads like the loader and writes
like the saver, so it sits in its own room above both; the command line
that runs it is `keras-hub-dist convert` (`cli.main`).

Example:

```python
convert_checkpoint("./Qwen3-8B", "./qwen3_8b_keras", to="keras")
convert_checkpoint("./gemma_7b_en", "./gemma_7b_hf", to="huggingface", dtype="bfloat16")
```
"""

from __future__ import annotations

import math
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from keras_hub_dist import _compat, _processes
from keras_hub_dist._progress import byte_progress
from keras_hub_dist.errors import SaveError
from keras_hub_dist.formats import checksums, keras_h5
from keras_hub_dist.storage import host_io
from keras_hub_dist.formats.base import Index, StoredTensor, StoredTensorSource, TensorSource
from keras_hub_dist.formats.detect import checkpoint_format
from keras_hub_dist.formats.pieces import NotAffine, Piece, block_writes, identity, pieces_of
from keras_hub_dist.storage.locations import Location, is_remote, is_url, open_location
from keras_hub_dist.storage.ranged_http import RangeClient
from keras_hub_dist.storage.uploads import WRITE_SCHEMES, is_writable_url, open_writer
from keras_hub_dist.formats.safetensors_files import INDEX_FILE
from keras_hub_dist.formats.safetensors_writer import plan_files
from keras_hub_dist.load.source import read_config, read_metadata, resolve_source
from keras_hub_dist.shaping.tasks import task_class
from keras_hub_dist.plan.abstract import build_without_values
from keras_hub_dist.save import hf_export, remote_save, saver, staging
from keras_hub_dist.save.hf_files import write_hf_files
from keras_hub_dist.save.hf_mapping import hf_mapping
from keras_hub_dist.save.piece_write import PieceWriter
from keras_hub_dist.convert import into_bucket

__all__ = ["TILE_BYTES", "ConvertStats", "convert_checkpoint", "tiles"]

# The most bytes of a source tensor read at once. Larger tiles mean longer
# byte runs on the transposed side (fewer positioned writes or reads):
# converting the full-size Gemma-7B to a KerasHub preset took 40.9-46.2 CPU-s
# with 128 MiB tiles, 35.3 with 256 MiB (BENCHMARKS.md), where every kernel
# fits one tile.
TILE_BYTES = 256 << 20
TARGETS = ("keras", "huggingface")


@dataclass
class ConvertStats:
    """What a conversion did."""

    bytes_read: int = 0
    bytes_written: int = 0
    bytes_copied: int = 0
    tiles: int = 0


@dataclass(frozen=True)
class _Job:
    """One source tensor and where its elements go: `(file path, piece,
    byte offset of the target tensor, target dtype)`. `stored` tensors are
    read into a worker's reused buffer; others through `read`."""

    shape: tuple[int, ...]
    dtype: np.dtype
    read: Callable[[Index], np.ndarray]
    targets: tuple[tuple[str, Piece, int, np.dtype], ...]
    keeps_order: bool
    stored: StoredTensor | None = None


def tiles(shape: Sequence[int], itemsize: int, budget: int | None = None, *, rows_only: bool = False) -> Iterator[Index]:
    """Boxes covering `shape`, each at most `budget` bytes (default
    `TILE_BYTES`; or one row):
    `rows_only` splits the leading dimensions only (runs stay whole);
    otherwise the largest dimension is halved until a box fits (square-ish
    tiles keep the runs long on both sides of a transpose)."""
    budget = TILE_BYTES if budget is None else budget
    shape = [int(d) for d in shape]
    counts = [1] * len(shape)

    def size() -> int:
        return math.prod(-(-d // c) for d, c in zip(shape, counts)) * itemsize

    while shape and size() > budget:
        candidates = [i for i in range(len(shape)) if counts[i] < shape[i]]
        if rows_only:
            candidates = [next(i for i in range(len(shape)) if counts[i] < shape[i])]
        if not candidates:
            break
        i = max(candidates, key=lambda j: -(-shape[j] // counts[j])) if not rows_only else candidates[0]
        counts[i] = min(shape[i], counts[i] * 2)
    steps = [-(-d // c) for d, c in zip(shape, counts)]
    for corner in np.ndindex(*counts):
        box = tuple((k * s, min(d, (k + 1) * s)) for k, s, d in zip(corner, steps, shape))
        if all(a < b for a, b in box):
            yield box


def _keeps_order(pieces: Sequence[Piece]) -> bool:
    """Whether every piece writes the leaf's elements in their own order."""
    for piece in pieces:
        ordered = sorted(piece.atoms, key=lambda a: -a.out_step)
        if [a.leaf_step for a in ordered] != sorted((a.leaf_step for a in ordered), reverse=True):
            return False
    return True


class _Worker:
    """One converting thread: its files, its read buffer, its write buffer."""

    def __init__(self, on_written: Callable[[str, Any], None] | None, files: Any = None) -> None:
        self.reads = host_io.Readers()
        self.writer = PieceWriter(
            files if files is not None else host_io.FileDescriptors(os.O_WRONLY), on_written=on_written,
            transpose_device=jax.local_devices(backend="cpu")[0],
        )
        self.buffer = host_io.aligned_empty((TILE_BYTES,), np.uint8)
        self.bytes_read = 0
        self.tiles = 0

    def read(self, job: _Job, box: Index) -> np.ndarray:
        shape = tuple(b - a for a, b in box)
        nbytes = math.prod(shape) * job.dtype.itemsize
        if job.stored is None or nbytes > len(self.buffer):
            return job.read(box)
        out = self.buffer[:nbytes].view(job.dtype).reshape(shape)
        file = self.reads(job.stored.file, job.stored.opened)
        file.read_stretches(host_io.run_stretches(job.stored.block_runs(box), out))
        return out

    def convert(self, job: _Job, box: Index) -> int:
        """Reads one tile and writes it through its pieces; returns the
        bytes written."""
        values = self.read(job, box)
        writes = []
        for path, piece, offset, dtype in job.targets:
            writes += [(path, w, dtype) for w in block_writes(piece, job.shape, box, offset, dtype.itemsize)]
        before = self.writer.stats.bytes_written
        self.writer.write(values, writes)
        self.bytes_read += values.nbytes
        self.tiles += 1
        return self.writer.stats.bytes_written - before

    def close(self) -> None:
        self.reads.close()
        self.writer.files.close()


def _items(jobs: Sequence[_Job]) -> list[tuple[_Job, Index]]:
    """Every tile of every job."""
    return [(job, box) for job in jobs for box in tiles(job.shape, job.dtype.itemsize, rows_only=job.keeps_order)]


def _run(
    items: Iterator[tuple[_Job, Index]], num_threads: int, stats: ConvertStats, bar: Any,
    on_written: Callable[[str, Any], None] | None, files: Any = None,
) -> None:
    """Converts every tile on `num_threads` threads (reads, copies and
    positioned writes release the GIL: one thread reads while another
    transposes), into local files or the shared `files` (a bucket's parts)."""
    lock = threading.Lock()
    workers = [_Worker(on_written, files) for _ in range(max(1, num_threads))]

    def work(worker: _Worker) -> None:
        while True:
            with lock:
                item = next(items, None)
            if item is None:
                return
            written = worker.convert(*item)
            with lock:
                bar.update(written)

    try:
        with ThreadPoolExecutor(len(workers), "keras_hub_dist-convert") as pool:
            for future in [pool.submit(work, w) for w in workers]:
                future.result()
    finally:
        for worker in workers:
            worker.close()
            stats.bytes_read += worker.bytes_read
            stats.tiles += worker.tiles
            stats.bytes_written += worker.writer.stats.bytes_written
            stats.bytes_copied += worker.writer.stats.bytes_copied


def _source_dtype(config: dict[str, Any], checkpoint: Any, backbone_config: dict[str, Any]) -> Any:
    """The model dtype that keeps the source's own: the preset's saved
    policy, or the Hugging Face config's `torch_dtype` / `dtype`."""
    if checkpoint is keras_h5:
        return backbone_config.get("dtype")
    for key in ("torch_dtype", "dtype"):
        value = config.get(key) or (config.get("text_config") or {}).get(key)
        if isinstance(value, str) and value in ("float32", "bfloat16", "float16"):
            return value
    return "float32"


def _task(location: Location, label: str, backbone: Any, wanted: str | None) -> Any:
    """The CausalLM around `backbone` with the source's preprocessor, or None."""
    if wanted is None:
        return None
    try:
        cls = task_class("causal_lm" if wanted == "auto" else wanted, type(backbone), read_metadata(location), label)
        return cls.from_preset(location.keras_hub_dir(), load_weights=False, backbone=backbone)
    except Exception:  # noqa: BLE001 - no tokenizer to carry over
        if wanted == "auto":
            return None
        raise


@_processes.raises_process_lost(SaveError, "the conversion", _processes.SAVE_LEFT)
def convert_checkpoint(
    source: str | os.PathLike,
    target: str | os.PathLike,
    *,
    to: str,
    dtype: Any = None,
    task: str | None = "auto",
    overwrite: bool = False,
    progress: bool | None = None,
    max_shard_size: float | int | str | None = None,
    num_threads: int = 2,
) -> ConvertStats:
    """Converts a KerasHub preset to a Hugging Face checkpoint or back, file
    to file, never holding the model's values.

    The result equals `save_sharded_preset(load_sharded_preset(source,
    dtype=...), target, format=to)` byte for byte in its weights.

    Args:
        source: A KerasHub preset or Hugging Face checkpoint: a directory,
            a KerasHub handle (`"kaggle://..."`), or a remote location read
            by byte ranges (`"s3://..."`, `"gs://..."`, `"hf://..."`,
            `"https://..."`), as `load_sharded_preset` takes.
        target: The directory to create, or a bucket's prefix
            (`"s3://bucket/prefix"`, `"gs://bucket/prefix"`: uploaded in
            parts as converted, with no local copy; `convert.into_bucket`).
        to: `"keras"` or `"huggingface"`.
        dtype: Dtype of the floating-point weights (cast tile by tile);
            default: the source's own (unlike `from_preset`, which uses
            Keras's global policy).
        task: `"auto"` carries over the source's tokenizer / preprocessor as
            a causal LM if it has one; `None` converts the backbone only;
            a task name requires it.
        overwrite: Replace an existing non-empty `target` once complete.
        progress: Show a progress bar; default: when stderr is a terminal.
        max_shard_size: As `save_sharded_preset`.
        num_threads: Threads that convert tiles (one more hashes each
            64 MiB chunk of the target as soon as it is complete).

    Returns:
        `ConvertStats`.

    Raises:
        PresetError: The source is missing, corrupt or of no known format.
        SaveError: The target format is the source's, the dtype cannot be
            held, the target exists (without `overwrite`), or the family
            does not export to the Hugging Face format.
    """
    if to not in TARGETS:
        raise SaveError(f"Expected to= one of {TARGETS}. Received: to={to!r}.")
    wanted_dtype = hf_export.check_dtype(dtype, to)
    remote = isinstance(target, str) and is_url(target)  # never a local path
    if remote and not is_writable_url(target):
        raise SaveError(
            f"Expected target to be a local directory or an object store URL "
            f"({', '.join(s + '://' for s in WRITE_SCHEMES)}). Received: {target!r}. "
            + ("Pushing to the Hugging Face Hub is not supported: convert to a local directory, "
               "then upload it with `huggingface-cli upload`." if target.lower().startswith("hf://")
               else "Convert to a local directory or a bucket.")
        )
    resolved = resolve_source(source)
    client = RangeClient() if is_remote(resolved.ref) or remote else None
    try:
        with open_location(resolved.ref, resolved.label, client=client) as location, host_io.collector_paused():
            destination = target if remote else os.path.abspath(os.fspath(target))
            writer = open_writer(target, client) if remote else None
            return _convert(
                location, resolved.label, destination, to, dtype, wanted_dtype,
                task, overwrite, progress, max_shard_size, num_threads, writer,
            )
    finally:
        if client is not None:
            client.close()


def _convert(
    location: Location, label: str, destination: str, to: str, dtype: Any, wanted_dtype: np.dtype | None,
    task: str | None, overwrite: bool, progress: bool | None, max_shard_size: Any, num_threads: int,
    writer: Any = None,
) -> ConvertStats:
    config = read_config(location)
    checkpoint = checkpoint_format(config, label)
    if checkpoint.FORMAT == to or (checkpoint is keras_h5 and to == "keras"):
        raise SaveError(
            f"The source {label!r} is already in the {to} format. Expected a "
            f"{'Hugging Face checkpoint' if to == 'keras' else 'KerasHub preset'} to convert "
            "to it; copy the directory instead."
        )
    if writer is None:  # a bucket is claimed by `RemoteTarget`, once the plan is made
        saver.claim_target(destination, overwrite)
    backbone_cls, backbone_config = checkpoint.backbone_config(config, label)
    model_dtype = dtype if dtype is not None else _source_dtype(config, checkpoint, backbone_config)
    backbone, created = build_without_values(backbone_cls, {**backbone_config, "dtype": model_dtype})
    try:
        index = checkpoint.index_checkpoint(backbone, location, label, config)
        task_model = _task(location, label, backbone, task)
        sources = {id(e.variable): e.source for e in index.entries}
        datasets = keras_h5.expected_datasets(backbone)
        convert = _to_huggingface if to == "huggingface" else _to_keras
        return convert(
            backbone, task_model, sources, datasets, destination, wanted_dtype, progress,
            max_shard_size, num_threads, writer, overwrite,
        )
    finally:
        _compat.forget_deferred_variables(created)


def _to_huggingface(
    backbone: Any, task: Any, sources: dict[int, TensorSource], datasets: dict[str, Any],
    destination: str, dtype: np.dtype | None, progress: bool | None, max_shard_size: Any,
    num_threads: int, writer: Any = None, overwrite: bool = False,
) -> ConvertStats:
    tokenizer = getattr(getattr(task, "preprocessor", None), "tokenizer", None)
    mapping = hf_mapping(backbone, tokenizer=tokenizer, dtype=dtype)
    layout = plan_files(mapping.tensors, hf_export.shard_size(max_shard_size))
    specs = {t.name: t for t in layout.tensors}
    stats = ConvertStats()

    def jobs_in(folder: str) -> list[_Job]:
        jobs = []
        for name, pairs in mapping.pieces.items():
            source = sources[id(datasets[name])]
            targets = []
            for tensor, piece in pairs:
                file, offset = layout.place(tensor)
                targets.append((os.path.join(folder, file), piece, offset, np.dtype(specs[tensor].dtype)))
            jobs.append(_Job(
                mapping.shapes[name], np.dtype(source.dtype), source.read, tuple(targets),
                _keeps_order([p for _, p in pairs]), source.stored,
            ))
        return jobs

    if writer is not None:
        with into_bucket.RemoteTarget(writer, overwrite) as target:
            write_hf_files(target.folder, backbone, task, mapping.config)
            names = [f.name for f in layout.files]
            headers = {f.name: f.header for f in layout.files}

            def prefill(name: str, start: int, stop: int, buffer: np.ndarray) -> int:
                header = headers[name][start:stop]  # a safetensors file's only non-value bytes
                buffer[: len(header)] = np.frombuffer(header, np.uint8)
                return len(header)

            digests = _upload_all(target, jobs_in(""), [(f.name, f.size) for f in layout.files], names, prefill,
                                  layout.total_size, progress, stats, num_threads)
            paths = [os.path.join(target.folder, n) for n in names]
            with open(os.path.join(target.folder, INDEX_FILE), "w", encoding="utf-8") as f:
                f.write(hf_export.checksummed_index(layout, paths, digests))
            target.publish(names, {"config": "config.json"})
        return stats
    token = secrets.token_hex(6)
    folder = staging.staging_path(*os.path.split(destination), token)
    paths = [os.path.join(folder, f.name) for f in layout.files]
    try:
        hf_export.prepare_export(destination, token, False, layout, backbone, task, mapping)
        pending = {os.path.join(folder, f.name): [(len(f.header), f.size)] for f in layout.files}
        digests = _write_all(jobs_in(folder), layout.total_size, destination, progress, stats, num_threads,
                             pending, paths)
        hf_export.finish_export(folder, destination, layout, paths, digests, token, False)
    finally:  # the owner record, and the staging directory unless published
        staging.discard(destination, token)
    return stats


def _upload_all(
    target: Any, jobs: Sequence[_Job], files: list[tuple[str, int]], order: list[str], prefill: Any,
    total: int, progress: bool | None, stats: ConvertStats, num_threads: int,
) -> np.ndarray:
    """Converts every job into `target`'s uploads, tiles in the target
    files' byte order (`convert.into_bucket`); returns the digests."""
    items = into_bucket.ordered_items(jobs, _items(jobs), order)
    bar = byte_progress(total, f"Converting to {target.writer.location}", progress)
    try:
        return target.upload(files, prefill, items, lambda it, sink: _run(it, num_threads, stats, bar, None, sink),
                             num_threads)
    finally:
        bar.close()


def _write_all(
    jobs: Sequence[_Job],
    total: int,
    destination: str,
    progress: bool | None,
    stats: ConvertStats,
    num_threads: int,
    pending: dict[str, list[tuple[int, int]]],
    files: list[str],
) -> np.ndarray:
    """Converts every job; returns the files' chunk digests, hashed as each
    chunk is completed (`pending`: the byte ranges the jobs write)."""
    hasher = checksums.HashingAsWritten(files, pending)
    bar = byte_progress(total, f"Converting to {os.path.basename(destination)}", progress)
    try:
        _run(iter(_items(jobs)), num_threads, stats, bar, hasher.written)
    finally:
        bar.close()
    return hasher.table()


def _stored_leaves(source: TensorSource) -> Iterator[StoredTensor]:
    """The stored tensors a transform tree reads (`formats.transforms`: a
    node has a `child` or `children`), as indexed: no header is read again."""
    if isinstance(source, StoredTensorSource):
        yield source.stored
    children = getattr(source, "children", None) or ([source.child] if hasattr(source, "child") else [])
    for child in children:
        yield from _stored_leaves(child)


def _to_keras(
    backbone: Any, task: Any, sources: dict[int, TensorSource], datasets: dict[str, Any],
    destination: str, dtype: np.dtype | None, progress: bool | None, max_shard_size: Any,
    num_threads: int, writer: Any = None, overwrite: bool = False,
) -> ConvertStats:
    names = _compat.preset_file_names()
    limit = 10 if max_shard_size is None else max_shard_size
    multi_file = backbone_bytes(backbone) / 2**30 > limit
    weight_set = saver.weight_set_of(
        backbone, (), names["sharded_weights" if multi_file else "weights"], limit if multi_file else None
    )
    if task is not None and task.has_task_weights():
        raise SaveError("Expected a task without task weights (a causal LM). Received one with task weights.")
    stats = ConvertStats()
    if writer is not None:
        with into_bucket.RemoteTarget(writer, overwrite) as target:
            saver.write_preset_files(target.folder, backbone, task, [weight_set], names)
            files = saver.weights_files_of(target.folder, [weight_set])
            jobs, total = _keras_jobs(backbone, sources, datasets, weight_set, files)
            order = list(files)
            digests = _upload_all(target, jobs, [(f, os.path.getsize(f)) for f in files], order,
                                  remote_save.Skeleton(files), total, progress, stats, num_threads)
            saver.write_metadata(target.folder, backbone, files, digests, names)
            target.publish(files, names)
        return stats
    token = secrets.token_hex(6)
    folder = staging.staging_path(*os.path.split(destination), token)
    try:
        saver.prepare_preset(destination, token, False, backbone, task, [weight_set], names)
        files = saver.weights_files_of(folder, [weight_set])
        jobs, total = _keras_jobs(backbone, sources, datasets, weight_set, files)
        pending: dict[str, list[tuple[int, int]]] = {}
        for info in keras_h5.read_datasets(keras_h5.weights_files(os.path.join(folder, weight_set.file_name))).values():
            pending.setdefault(info.file, []).append((info.offset, info.offset + info.nbytes))
        digests = _write_all(jobs, total, destination, progress, stats, num_threads, pending, files)
        saver.finish_preset(folder, destination, backbone, files, digests, token, names, False)
    finally:  # the owner record, and the staging directory unless published
        staging.discard(destination, token)
    return stats


def _keras_jobs(
    backbone: Any, sources: dict[int, TensorSource], datasets: dict[str, Any], weight_set: Any, files: list[str],
) -> tuple[list[_Job], int]:
    """The jobs that fill the laid-out weights files `files`, and their bytes."""
    on_disk = keras_h5.read_datasets([f for f in files if f.endswith(".h5")])
    leaves = {(t.file, t.offset): t for s in sources.values() for t in _stored_leaves(s)}
    by_leaf: dict[tuple[str, int], list[tuple[str, Piece, int, np.dtype]]] = {}
    jobs: list[_Job] = []
    for name, variable in datasets.items():
        info = on_disk[name]
        target_dtype = np.dtype(info.dtype)
        source = sources.get(id(variable))
        if source is None:
            # A buffer the checkpoint does not hold (SmolLM3's rotary
            # inv_freq): its initial value, as a load gives it.
            value = _initial_value(variable)
            jobs.append(_Job(info.shape, value.dtype, lambda box, v=value: v[_slices(box)].copy(),
                             ((info.file, identity(("<value>", 0), info.shape), info.offset, target_dtype),), True))
            continue
        try:
            pieces = pieces_of(source)
        except NotAffine:  # e.g. MXFP4: converted in the variable's layout
            whole = identity(("<value>", 0), info.shape)
            jobs.append(_Job(info.shape, np.dtype(source.dtype), source.read,
                             ((info.file, whole, info.offset, target_dtype),), True))
            continue
        for piece in pieces:
            by_leaf.setdefault(piece.leaf, []).append((info.file, piece, info.offset, target_dtype))
    for key, targets in by_leaf.items():
        leaf = leaves[key]
        jobs.append(_Job(leaf.shape, leaf.dtype, leaf.read, tuple(targets),
                         _keeps_order([p for _, p, _, _ in targets]), leaf))
    return jobs, sum(d.nbytes for d in weight_set.layout.datasets)


def _slices(box: Index) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


def _initial_value(variable: Any) -> np.ndarray:
    """A small variable's initial value on the host (computed once)."""
    _compat.initialize_pending([variable])
    return np.ascontiguousarray(np.asarray(_compat.variable_array(variable)))


def backbone_bytes(backbone: Any) -> int:
    """KerasHub's measure of a backbone's size (multi-file weights over 10 GB)."""
    return _compat.variables_size_in_bytes(backbone.variables)

