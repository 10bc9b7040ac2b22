"""Safetensors files: headers, shards and the index, validated.

A safetensors file is an 8-byte little-endian header length `n`, `n` bytes of
JSON (`{name: {"dtype", "shape", "data_offsets": [begin, end]}}`, offsets
relative to the end of the header), then the raw C-order tensors. Reading
the header alone gives every tensor's exact byte range, so the loader can
read any block of any tensor without touching the rest of the file, and
can check that every tensor lies inside the file before a byte of weights is
read.

A Hugging Face checkpoint is either one `model.safetensors` or a
`model.safetensors.index.json` whose `weight_map` names the shard file of
each tensor.

Example:

```python
files = checkpoint_files(open_location("./my-llama"))   # or "hf://owner/name"
files.tensor("model.norm.weight").offset     # a StoredTensor
```
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from keras_hub_dist.errors import PresetError
from keras_hub_dist.storage import host_io
from keras_hub_dist.formats import safetensors_header
from keras_hub_dist.formats.base import StoredTensor
from keras_hub_dist.storage.locations import LocalDirectory
from keras_hub_dist.storage.names import check_name
from keras_hub_dist.plan.presets import INDEX_FILE_LIMIT, parse_json

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "SafetensorsCheckpoint",
    "SafetensorsHeader",
    "checkpoint_files",
    "read_header",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# A header is read with one read of this many bytes (most headers fit).
_FIRST_READ_BYTES = 64 * 1024

# The dtypes the loader reads (`safetensors_header.DTYPE_BITS` lists every
# dtype of the format; the sub-byte and the rarer ones have no reader here).
_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}


@dataclass(frozen=True)
class SafetensorsHeader:
    """One safetensors file's tensors (name -> `StoredTensor`), validated."""

    file: str
    tensors: Mapping[str, StoredTensor]
    opened: Any = None

    def keys(self):
        return self.tensors.keys()


def read_header(file: Any) -> SafetensorsHeader:
    """Parses and validates the header of one safetensors file.

    Args:
        file: A local path, or an opened file (`host_io.LocalFile`, a remote
            `ranged_http.RemoteFile`): the header is read with one range
            read of its first 64 KiB and, for a longer header, one more.

    Raises:
        PresetError: The header breaks a rule of
            `safetensors_header.validate_header` (the safetensors crate's,
            and a few stricter), or a tensor has a dtype the loader cannot
            read. The message names the file and the tensor.
    """
    if isinstance(file, str):
        file = host_io.LocalFile(file)
    return _parse_header(file)


def _parse_header(file: Any) -> SafetensorsHeader:
    path, size = file.name, file.size
    # Locally, exactly the length and the header; remotely one speculative
    # request usually gets both (a round trip saved per file).
    first_bytes = 8 if isinstance(file, host_io.LocalFile) else _FIRST_READ_BYTES
    first = file.read(0, min(size, first_bytes))
    header_bytes = safetensors_header.header_length(first, size, path)
    if len(first) < 8 + header_bytes:
        first += file.read(len(first), 8 + header_bytes - len(first))
    header = safetensors_header.validate_header(first, size, path)
    tensors: dict[str, StoredTensor] = {}
    for name, entry in header.tensors.items():
        if entry.dtype not in _DTYPES:
            raise PresetError(
                f"Tensor {name!r} in {path!r} has dtype {entry.dtype!r}, a safetensors "
                f"dtype the loader cannot read. Expected one of {sorted(_DTYPES)}. "
                f"Received: {entry.dtype!r}. Convert the tensor to one of those dtypes "
                "and save the checkpoint again."
            )
        tensors[name] = StoredTensor(
            path, header.data_start + entry.begin, entry.shape, _DTYPES[entry.dtype], opened=file
        )
    return SafetensorsHeader(path, tensors, file)


@dataclass(frozen=True)
class SafetensorsCheckpoint:
    """Every safetensors file of a checkpoint, with its header.

    Attributes:
        headers: File name (relative, as the index names it) -> header.
        weight_map: Tensor name -> file name, from the index; `None` for a
            single `model.safetensors`.
    """

    headers: Mapping[str, SafetensorsHeader]
    weight_map: Mapping[str, str] | None

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(h.file for h in self.headers.values())

    @property
    def opened(self) -> tuple[Any, ...]:
        return tuple(h.opened for h in self.headers.values())

    def file_of(self, name: str) -> str | None:
        """The file name holding tensor `name` (`None`: the index lacks it)."""
        if self.weight_map is None:
            return SINGLE_FILE
        return self.weight_map.get(name)


def checkpoint_files(location: Any, label: str | None = None) -> SafetensorsCheckpoint:
    """Finds, opens and validates a checkpoint's files.

    Args:
        location: A `storage.locations.Location` (or a local directory).

    Raises:
        PresetError: No `model.safetensors` nor index; an invalid index; a
            shard the index names is missing; a tensor the index assigns to a
            shard is not in it; a truncated or corrupt file.
    """
    if isinstance(location, str):
        location = LocalDirectory(location)
    label = label or location.label
    if location.has(INDEX_FILE):
        index_path = location.path_of(INDEX_FILE)
        index = parse_json(location.read_bytes(INDEX_FILE), index_path, INDEX_FILE_LIMIT)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise PresetError(
                f"{index_path!r} is not a safetensors index. Expected a JSON object "
                "with a 'weight_map' of tensor name -> shard file name. Received: "
                f"{str(index)[:200]}."
            )
        headers = {}
        shards = sorted(set(weight_map.values()))
        for name in shards:  # every one, before any is opened
            check_name(name, source=f"the index {index_path!r}")
        for name in shards:
            try:
                opened = location.open(name)
            except FileNotFoundError as e:
                raise PresetError(
                    f"The index {index_path!r} names the shard file {name!r}, which "
                    f"does not exist in {label!r} ({e}). Expected every shard the "
                    "index names. Download or upload the checkpoint again."
                ) from None
            headers[name] = read_header(opened)
        for tensor, name in weight_map.items():
            if tensor not in headers[name].tensors:
                raise PresetError(
                    f"The index {index_path!r} puts tensor {tensor!r} in {name!r}, but "
                    f"that file has no such tensor. Expected the index and the shards "
                    "of the same checkpoint."
                )
        return SafetensorsCheckpoint(headers, dict(weight_map))
    if location.has(SINGLE_FILE):
        return SafetensorsCheckpoint({SINGLE_FILE: read_header(location.open(SINGLE_FILE))}, None)
    raise PresetError(
        f"The Hugging Face checkpoint {label!r} has no weights. Expected "
        f"{SINGLE_FILE!r} or {INDEX_FILE!r} beside config.json. Received: neither."
    )
