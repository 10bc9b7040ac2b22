"""KerasHub presets (`model.weights.h5`, single or multi-file): the index.

Which bytes on disk belong to which variable.

`model.weights.h5` does not name datasets after variable paths. Keras's saver
walks the model's attributes and writes each saveable's variables as
`<attribute path>/vars/<i>` (e.g. `layers/reversible_embedding/vars/0` holds
`token_embedding/embeddings`). This module replays that very walk on the
(abstract, unallocated) model with a recording store, so the mapping is the
one Keras itself would use to save and load, then reads the file's metadata
(shape, dtype, byte offset of each contiguous dataset) and checks everything a
load needs, before a single weight byte is read:

- the file exists, opens as HDF5 and is not truncated (every dataset's bytes
  lie inside the file);
- no model variable is missing from the file and no dataset is extra;
- shapes are equal and dtypes compatible (float to float casts; any other
  kind must match exactly).

Example:

```python
with keras.StatelessScope(initialize_variables=False):
    backbone = keras_hub.models.GemmaBackbone(**config)
index = build_index(backbone, "preset/model.weights.h5")
index.entries[0].path, index.entries[0].source.stored.offset
```
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import h5py
import keras
import ml_dtypes
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.errors import PresetError, ProcessLostError
from keras_hub_dist.storage import host_io
from keras_hub_dist.storage.names import check_name, local_path
from keras_hub_dist.formats.base import (
    CheckpointIndex,
    Index,
    IndexedVariable,
    StoredTensor,
    StoredTensorSource,
    TensorSource,
    compatible_dtypes,
    listing,
    numpy_dtype,
)

__all__ = [
    "DatasetInfo", "ContiguousDatasetSource", "H5DatasetSource", "backbone_config", "dataset_source",
    "index_checkpoint", "recognizes", "build_index", "expected_datasets", "read_datasets", "open_weights",
    "walk_saved_values", "weights_files",
]


@dataclass(frozen=True)
class DatasetInfo:
    """Where one dataset's bytes are.

    Attributes:
        file: Path of the `.h5` file holding the dataset.
        name: Dataset path inside the file (`layers/.../vars/0`).
        shape: Shape on disk.
        dtype: Logical dtype on disk (bfloat16, stored by Keras as opaque
            2-byte values with a `dtype` attribute, is resolved here).
        offset: Byte offset of the data in the file when it is stored
            contiguously and uncompressed (what Keras writes); `None`
            otherwise (chunked/compressed datasets are read through h5py).
        nbytes: Bytes of the (uncompressed) data.
        opened: The file it was read from when that is not a local path
            (a remote object; see `storage.locations`).
    """

    file: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int | None
    nbytes: int
    opened: Any = field(default=None, compare=False, repr=False)

    @property
    def contiguous(self) -> bool:
        return self.offset is not None


class H5DatasetSource(TensorSource):
    """A chunked or compressed dataset, read block by block through h5py."""

    def __init__(self, dataset: DatasetInfo) -> None:
        self.dataset = dataset
        self.shape = dataset.shape
        self.dtype = dataset.dtype
        self.description = f"dataset {dataset.name!r} of {dataset.file!r}"

    def read(self, index: Index) -> np.ndarray:
        with _open_h5(self.dataset.opened or self.dataset.file) as h5:
            h5_dataset = h5[self.dataset.name]
            raw = np.asarray(
                h5_dataset[tuple(slice(a, b) for a, b in index)] if index else h5_dataset[()]
            )
        if raw.dtype != self.dtype:  # Keras's bfloat16 is stored opaque.
            raw = raw.view(self.dtype)
        out = host_io.aligned_empty(raw.shape, self.dtype)
        out[...] = raw
        return out


class ContiguousDatasetSource(StoredTensorSource):
    """A contiguous dataset (what Keras writes): read as byte runs."""

    def __init__(self, dataset: DatasetInfo) -> None:
        super().__init__(
            StoredTensor(dataset.file, dataset.offset, dataset.shape, dataset.dtype, dataset.opened),
            f"dataset {dataset.name!r} of {dataset.file!r}",
        )
        self.dataset = dataset


def dataset_source(dataset: DatasetInfo) -> TensorSource:
    """The `TensorSource` of one dataset."""
    if dataset.contiguous:
        return ContiguousDatasetSource(dataset)
    return H5DatasetSource(dataset)


def _shard_names(data: bytes, entry: str) -> list[str]:
    """The `.h5` file names a sharded `model.weights.json` maps weights to."""
    try:
        weight_map = json.loads(data)["weight_map"]
        names = {n for v in weight_map.values() for n in (v if isinstance(v, list) else [v])}
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"shard names {sorted(map(repr, names))}, not all strings")
        return sorted(names)
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise PresetError(
            f"Cannot read the sharded weights config {entry!r}. "
            f"Expected JSON with a 'weight_map'. Received: {e!r}."
        ) from e


def weights_files(weights_path: str) -> tuple[str, ...]:
    """The `.h5` files behind a `model.weights.h5` or sharded `model.weights.json`.

    Raises:
        PresetError: The file (or a shard it lists) does not exist, or the
            sharding config cannot be read.
    """
    weights_path = os.fspath(weights_path)
    if not os.path.isfile(weights_path):
        raise PresetError(
            f"The weights file does not exist. Expected a file at "
            f"{weights_path!r}. Received: no such file. Save the preset with "
            "`save_to_preset` (it writes `model.weights.h5`) or fix the path."
        )
    if not weights_path.endswith(".json"):
        return (weights_path,)
    with open(weights_path, "rb") as f:
        names = _shard_names(f.read(), weights_path)
    folder = os.path.dirname(weights_path)
    files = []
    for name in names:
        path = local_path(folder, name, source=f"the sharded weights config {weights_path!r}")
        if not os.path.isfile(path):
            raise PresetError(
                f"A weights shard listed in {weights_path!r} is missing. "
                f"Expected a file at {path!r}. Received: no such file."
            )
        files.append(path)
    return tuple(files)


_MAX_CHUNK_RATIO = 2048  # deflate's best is ~1032:1; a chunk never written reads as fill


def _bound(path: str, name: str, shape: tuple, dtype: Any, wanted: int, limit: int, stored: str) -> None:
    if wanted > limit:  # a size bomb: refused before a byte of it is read
        raise PresetError(
            f"The weights file {path!r} is truncated or forged: dataset {name!r} declares shape {shape} "
            f"of {dtype}. Expected its bytes stored in the file, as Keras writes. Received: "
            f"{math.prod(shape) * dtype.itemsize} declared bytes, but {stored}. Download or save the preset again."
        )


def _dataset_info(path: str, name: str, ds: h5py.Dataset, file_size: int, opened: Any) -> DatasetInfo:
    if ds.external:
        raise PresetError(
            f"Dataset {name!r} in {path!r} is stored in an external file. "
            "Expected data inside the weights file (Keras never writes "
            "external datasets). Received: an external dataset."
        )
    if ds.is_virtual:
        raise PresetError(
            f"Dataset {name!r} in {path!r} is a virtual dataset. Expected "
            "plain data (Keras never writes virtual datasets)."
        )
    dtype = ds.dtype
    if ds.attrs.get("dtype") == "bfloat16":
        if dtype.itemsize != 2:
            raise PresetError(
                f"Dataset {name!r} in {path!r} is tagged bfloat16 but stores "
                f"{dtype.itemsize}-byte values. Expected 2-byte values."
            )
        dtype = np.dtype(ml_dtypes.bfloat16)
    elif dtype.kind not in "biufc":
        raise PresetError(
            f"Dataset {name!r} in {path!r} has a dtype the loader cannot "
            f"read. Expected a numeric dtype (or Keras's tagged bfloat16). "
            f"Received: {dtype!r}."
        )
    shape = tuple(int(d) for d in ds.shape)
    nbytes = math.prod(shape) * dtype.itemsize
    offset, end, stored = None, 0, 0
    if ds.chunks is None and ds.compression is None and nbytes:
        _bound(path, name, shape, dtype, nbytes, file_size, f"the whole file is {file_size} bytes")
        offset = ds.id.get_offset()
        if offset is None:
            raise PresetError(
                f"Dataset {name!r} in {path!r} declares shape {shape} but no "
                "data was ever written. Expected a fully written dataset. "
                "Received: unallocated storage (an interrupted save?)."
            )
        end = offset + nbytes
    elif nbytes:
        for i in range(count := ds.id.get_num_chunks()):
            chunk = ds.id.get_chunk_info(i)
            end = max(end, chunk.byte_offset + chunk.size)
            stored += chunk.size
        needed = math.prod(-(-d // c) for d, c in zip(shape, ds.chunks))
        _bound(path, name, shape, dtype, needed, count, f"only {count} of its {needed} chunks are stored")
        _bound(path, name, shape, dtype, nbytes, stored * _MAX_CHUNK_RATIO, f"its chunks store {stored} bytes (over {_MAX_CHUNK_RATIO}:1)")
    if end > file_size:
        raise PresetError(
            f"The weights file {path!r} is truncated: dataset {name!r} "
            f"(shape {shape}, {dtype}) ends at byte {end}. Expected a file of "
            f"at least {end} bytes. Received: {file_size} bytes. Download or "
            "save the preset again."
        )
    return DatasetInfo(path, name, shape, dtype, None if offset is None else int(offset), nbytes, opened)


def _index_file(path: str, h5: h5py.File, found: dict[str, DatasetInfo], file_size: int, opened: Any) -> None:
    problems: list[PresetError] = []

    def visit(name: str, link: Any) -> None:
        # An exception must not cross h5py's C callback: collect, raise after.
        if not isinstance(link, h5py.HardLink):
            problems.append(
                PresetError(
                    f"The weights file {path!r} contains a {type(link).__name__} "
                    f"at {name!r}. Expected plain groups and datasets (Keras "
                    "refuses links too)."
                )
            )
            return
        obj = h5[name]
        if not isinstance(obj, h5py.Dataset):
            return
        if name in found:
            problems.append(
                PresetError(
                    f"Dataset {name!r} is in two weights shards: "
                    f"{found[name].file!r} and {path!r}. Expected each dataset "
                    "in exactly one shard."
                )
            )
            return
        try:
            found[name] = _dataset_info(path, name, obj, file_size, opened)
        except PresetError as e:
            problems.append(e)

    h5.visititems_links(visit)
    if problems:
        raise problems[0]


@contextlib.contextmanager
def _open_h5(file: Any) -> Iterator[h5py.File]:
    """h5py on a local path, or on an opened (remote) file through a reader
    that fetches 64 KiB blocks: HDF5's metadata is a few small reads per
    dataset, so a file's index costs a few range requests per dataset.

    A read that fails inside h5py (its file-object callback cannot carry
    our error out) is raised as the reader's own error, naming the URL and
    the byte range."""
    reader = None
    try:
        if isinstance(file, (str, host_io.LocalFile)):
            h5 = h5py.File(file if isinstance(file, str) else file.name, "r")
        else:
            reader = host_io.BufferedReader(file)
            h5 = h5py.File(reader, "r")
        with h5:
            yield h5
    except Exception:
        if reader is not None and reader.error is not None:
            raise reader.error from None
        raise


def read_datasets(files: Sequence[Any]) -> dict[str, DatasetInfo]:
    """Metadata of every dataset in the weights files, keyed by dataset path.

    Only HDF5 metadata is read (no weight bytes). Soft/external links and
    external or virtual datasets are rejected, as Keras's own loader does.

    Args:
        files: Local paths, or opened files (`host_io.LocalFile`, a remote
            `ranged_http.RemoteFile`).

    Raises:
        PresetError: A file is not HDF5, is truncated, or two shards hold the
            same dataset.
    """
    found: dict[str, DatasetInfo] = {}
    for file in files:
        path = file if isinstance(file, str) else file.name
        size = os.path.getsize(path) if isinstance(file, str) else file.size
        opened = None if isinstance(file, (str, host_io.LocalFile)) else file
        try:
            with _open_h5(file) as h5:
                _index_file(path, h5, found, size, opened)
        except (PresetError, ProcessLostError):
            raise
        except (OSError, RuntimeError, SystemError, KeyError, ValueError) as e:  # h5py on corrupt metadata
            reason = "truncated" if "truncated" in str(e) else "not a readable HDF5 file"
            raise PresetError(
                f"The weights file {path!r} is {reason}. Expected the complete `.weights.h5` written by Keras. "
                f"Received: a file of {size} bytes that h5py cannot read ({type(e).__name__}: {e}). Download or save the preset again."
            ) from e
    return found


class _WalkStore(_compat.H5IOStore):
    """Stands in for Keras's H5 store and reports what would be written.

    Keras's walk calls `make(inner_path, metadata)` per saveable and then
    `store[str(i)] = value` per saved value; `on_group(path, metadata)` and
    `on_value(dataset name, key, value)` hear of each, in file order. No
    value is kept, so a computed one (a LoRA-merged kernel) lives only as
    long as the callback holds it.
    """

    def __init__(  # noqa: D107 - no file is opened on purpose
        self,
        on_value: Callable[[str, str, Any], None],
        on_group: Callable[[str, Mapping[str, Any] | None], None] | None = None,
    ) -> None:
        self._on_value = on_value
        self._on_group = on_group
        self._inner_path = ""

    def __bool__(self) -> bool:
        return True

    def make(self, path: str, metadata: Mapping[str, Any] | None = None) -> _WalkStore:
        self._inner_path = path
        if self._on_group is not None:
            self._on_group(path, metadata)
        return self

    def __setitem__(self, key: str, value: Any) -> None:
        prefix = f"{self._inner_path}/vars" if self._inner_path else "vars"
        self._on_value(f"{prefix}/{key}", key, value)

    def close(self) -> None:
        pass


def walk_saved_values(
    model: keras.Model,
    on_value: Callable[[str, str, Any], None],
    on_group: Callable[[str, Mapping[str, Any] | None], None] | None = None,
    skip: Sequence[Any] = (),
) -> None:
    """Replays `model.save_weights`'s walk: `on_value(dataset name, key,
    value)` per saved value and `on_group(inner path, metadata)` per saveable,
    in the order Keras writes them; `skip` saveables are left out."""
    _compat.walk_saved_variables(model, _WalkStore(on_value, on_group), skip)


def expected_datasets(model: keras.Model) -> dict[str, Any]:
    """Dataset path -> Keras variable, exactly as `model.save_weights` names them.

    Works on a model whose variables are deferred (created in a
    `StatelessScope`): the walk only hands variable objects to the store.

    Raises:
        PresetError: A layer saves a computed value rather than a variable
            (e.g. a LoRA-merged kernel), which cannot be loaded in place.
    """
    records: dict[str, Any] = {}
    walk_saved_values(model, lambda name, key, value: records.__setitem__(name, value))
    for name, value in records.items():
        if not isinstance(value, keras.Variable):
            raise PresetError(
                f"Dataset {name!r} is saved from a computed value of type "
                f"{type(value).__name__}, not from a variable. Expected every "
                "saved value to be a variable (layers with LoRA enabled or "
                "merged quantization scales save computed values). Disable "
                "LoRA / load the preset with stock `from_preset`."
            )
    return records


def build_index(model: keras.Model, weights_path: str, files: Sequence[Any] | None = None) -> CheckpointIndex:
    """Matches every variable of `model` with its dataset in `weights_path`.

    Args:
        model: The (abstract) model whose variables are to be filled.
        weights_path: `model.weights.h5`, or a sharded `model.weights.json`.
        files: The weights files, opened (remote ones); default: the local
            files `weights_path` names.

    Returns:
        A `CheckpointIndex` in the order of `model.weights`, with one
        `ContiguousDatasetSource` (or `H5DatasetSource`) per variable.

    Raises:
        PresetError: The file is missing or truncated; a variable is missing
            from the file or the file has an extra dataset; a shape differs or
            a dtype cannot be cast. All problems are listed in one message,
            each naming the variable path, expected and on-disk values.
    """
    if files is None:
        files = weights_files(weights_path)
    on_disk = read_datasets(files)
    names = tuple(f if isinstance(f, str) else f.name for f in files)
    expected = expected_datasets(model)

    by_variable: dict[int, str] = {}
    for name, variable in expected.items():
        by_variable.setdefault(id(variable), name)

    problems: list[str] = []
    missing = [
        f"{v.path} (shape {tuple(v.shape)}, {v.dtype}): expected dataset {n!r}"
        for n, v in expected.items()
        if n not in on_disk
    ]
    if missing:
        problems.append(
            f"{len(missing)} variable(s) missing from the file:" + listing(missing)
        )
    extra = [
        f"{n} (shape {d.shape}, {d.dtype})" for n, d in on_disk.items() if n not in expected
    ]
    if extra:
        problems.append(
            f"{len(extra)} dataset(s) in the file match no variable of "
            f"{type(model).__name__}:" + listing(extra)
        )
    paths: dict[str, int] = {}
    for v in model.weights:
        paths[v.path] = paths.get(v.path, 0) + 1
    duplicated = [p for p, n in paths.items() if n > 1]
    if duplicated:
        problems.append(
            f"{len(duplicated)} variable path(s) are used by more than one "
            "variable, so no layout map can address them:" + listing(duplicated)
        )
    unsaved = [v.path for v in model.weights if id(v) not in by_variable]
    if unsaved:
        problems.append(
            f"{len(unsaved)} variable(s) that Keras's saver never writes, so "
            "no file can fill them:" + listing(unsaved)
        )

    entries = []
    mismatched = []
    seen: set[int] = set()
    for variable in model.weights:
        if id(variable) in seen or id(variable) not in by_variable:
            continue
        seen.add(id(variable))
        name = by_variable[id(variable)]
        info = on_disk.get(name)
        if info is None:
            continue
        shape = tuple(int(d) for d in variable.shape)
        dtype = numpy_dtype(variable.dtype)
        if info.shape != shape:
            mismatched.append(
                f"{variable.path}: shape mismatch. Expected {shape}. "
                f"Received on disk: {info.shape} (dataset {name!r})"
            )
        elif not compatible_dtypes(info.dtype, dtype):
            mismatched.append(
                f"{variable.path}: dtype mismatch. Expected {dtype} (or any "
                f"float dtype for a float variable). Received on disk: "
                f"{info.dtype} (dataset {name!r})"
            )
        entries.append(
            IndexedVariable(variable.path, shape, dtype, dataset_source(info), variable)
        )
    if mismatched:
        problems.append(
            f"{len(mismatched)} variable(s) do not match the file:" + listing(mismatched)
        )
    if problems:
        raise PresetError(
            f"The weights file {weights_path!r} does not fit the "
            f"{type(model).__name__} built from the preset config. "
            + " ".join(problems)
            + "\nFix: load the preset whose config.json matches these weights, "
            "or re-save it with `save_to_preset`."
        )
    return CheckpointIndex(
        files=names,
        opened=tuple(f for f in files if not isinstance(f, str)),
        entries=tuple(entries),
        total_bytes=sum(e.source.dataset.nbytes for e in entries),
        format="keras_h5",
    )


FORMAT = "keras_h5"
_WEIGHTS_FILE = "model.weights.h5"
_SHARDED_WEIGHTS_FILE = "model.weights.json"


def recognizes(config: Mapping[str, Any]) -> bool:
    """Whether a preset's config.json is a KerasHub (Keras-format) one."""
    return "registered_name" in config


def open_weights(location: Any, label: str) -> tuple[str, list[Any]]:
    """The name of the preset's weights entry (`model.weights.h5` or the
    sharded `model.weights.json`) and its `.h5` files, opened from
    `location` (a `storage.locations.Location`)."""
    if location.has(_WEIGHTS_FILE):
        return location.path_of(_WEIGHTS_FILE), [location.open(_WEIGHTS_FILE)]
    if not location.has(_SHARDED_WEIGHTS_FILE):
        raise PresetError(
            f"The preset {label!r} has no weights. Expected "
            f"{_WEIGHTS_FILE} (or a sharded {_SHARDED_WEIGHTS_FILE}). Received: "
            "neither file. Save the weights with `save_to_preset`."
        )
    entry = location.path_of(_SHARDED_WEIGHTS_FILE)
    files = []
    shards = _shard_names(location.read_bytes(_SHARDED_WEIGHTS_FILE), entry)
    for name in shards:  # every one, before any is opened
        check_name(name, source=f"the sharded weights config {entry!r}")
    for name in shards:
        try:
            files.append(location.open(name))
        except FileNotFoundError as e:
            raise PresetError(
                f"A weights shard listed in {entry!r} is missing. "
                f"Expected a file at {location.path_of(name)!r}. Received: {e}"
            ) from None
    return entry, files


def backbone_config(config: Mapping[str, Any], label: str) -> tuple[type, dict[str, Any]]:
    """`(backbone class, constructor config)` of a preset's config.json."""
    import keras_hub

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
    return cls, dict(config["config"])


def index_checkpoint(
    model: keras.Model, location: Any, label: str, config: Mapping[str, Any]
) -> CheckpointIndex:
    """Indexes and validates the preset's weights for `model` (no weight
    read), from a `storage.locations.Location`."""
    entry, files = open_weights(location, label)
    return build_index(model, entry, files)
