"""Hugging Face checkpoints (safetensors shards + index): the writer.

A safetensors file is an 8-byte little-endian header length, a JSON header
giving each tensor's dtype, shape and byte range, then the raw C-order
tensors. Once the header is written every tensor's place in the file is
fixed, so the files can be laid out first and filled later by anyone who
knows the offsets:

1. `plan_files` splits the tensors into shard files exactly as Transformers'
   `save_pretrained` does (`huggingface_hub.split_state_dict_into_shards_factory`,
   the tensors in the order given, Transformers' default `"50GB"` per
   file) and orders each file's tensors exactly as the `safetensors`
   library does (by dtype, widest first, then by name), so that a file
   holds the same bytes `safetensors.numpy.save_file` would write;
2. `create_files` (one process) writes each file's header and sets its
   length (`ftruncate`: the data is a hole until filled, no byte of it is
   written);
3. every process then writes the bytes of the blocks it owns at the
   tensors' offsets (`keras_hub_dist.save`), with plain positioned writes.

The shards are always named `model-0000i-of-0000n.safetensors` and listed
in `model.safetensors.index.json` (even one shard), whose `metadata` also
carries our checksums; Transformers, KerasHub and our loader read both.

Example:

```python
layout = plan_files([TensorSpec("model.norm.weight", (64,), np.float32)])
create_files(layout, "out_dir")
layout.place("model.norm.weight")   # ("model-00001-of-00001.safetensors", byte offset)
```
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "FileLayout",
    "SafetensorsLayout",
    "TensorSpec",
    "create_files",
    "dtype_name",
    "index_json",
    "plan_files",
]

# Transformers 5's `save_pretrained` default.
DEFAULT_MAX_SHARD_SIZE = "50GB"
_FILE_PATTERN = "model{suffix}.safetensors"

# The dtypes safetensors stores, in the order of its `Dtype` enum: a file
# holds its tensors widest-first by this order, then by name.
_ORDER = (
    "BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
    "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "F64", "I64", "U64",
)
_NAMES: dict[np.dtype, str] = {
    np.dtype(np.bool_): "BOOL",
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(ml_dtypes.float8_e5m2): "F8_E5M2",
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint16): "U16",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint32): "U32",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.uint64): "U64",
}


def dtype_name(dtype: Any) -> str | None:
    """The safetensors name of a NumPy dtype, or `None` if it has none."""
    return _NAMES.get(np.dtype(dtype))


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to write: name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class FileLayout:
    """One safetensors file: its name, header (length prefix included),
    total size, and each tensor's absolute byte offset."""

    name: str
    header: bytes
    size: int
    offsets: Mapping[str, int]


@dataclass(frozen=True)
class SafetensorsLayout:
    """Every file of a checkpoint and where each tensor goes."""

    files: tuple[FileLayout, ...]
    tensors: tuple[TensorSpec, ...]

    def place(self, name: str) -> tuple[str, int]:
        """`(file name, byte offset)` of tensor `name`."""
        for file in self.files:
            if name in file.offsets:
                return file.name, file.offsets[name]
        raise KeyError(name)

    @property
    def weight_map(self) -> dict[str, str]:
        return {n: f.name for f in self.files for n in f.offsets}

    @property
    def total_size(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def _file_layout(name: str, tensors: Sequence[TensorSpec], metadata: Mapping[str, str]) -> FileLayout:
    ordered = sorted(tensors, key=lambda t: (-_ORDER.index(dtype_name(t.dtype)), t.name))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    position = 0
    relative = {}
    for t in ordered:
        header[t.name] = {
            "dtype": dtype_name(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [position, position + t.nbytes],
        }
        relative[t.name] = position
        position += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    prefix = struct.pack("<Q", len(text)) + text
    return FileLayout(
        name, prefix, len(prefix) + position, {n: len(prefix) + r for n, r in relative.items()}
    )


def plan_files(
    tensors: Sequence[TensorSpec],
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    metadata: Mapping[str, str] | None = None,
) -> SafetensorsLayout:
    """Lays out a checkpoint: which file holds each tensor, and where.

    Args:
        tensors: In Transformers' state-dict order (it decides the split).
        max_shard_size: Bytes per file (`int`) or a size such as `"5GB"`; a
            tensor larger than that gets a file of its own.
        metadata: The header's `__metadata__` (default `{"format": "pt"}`,
            as Transformers writes).

    Raises:
        ValueError: A dtype safetensors cannot hold, or a repeated name.
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    names = [t.name for t in tensors]
    if len(set(names)) != len(names):
        raise ValueError(f"Expected unique tensor names. Received duplicates: {sorted({n for n in names if names.count(n) > 1})}")
    for t in tensors:
        if dtype_name(t.dtype) is None:
            raise ValueError(
                f"Tensor {t.name!r} has dtype {np.dtype(t.dtype)}, which safetensors "
                f"cannot hold. Expected one of {sorted(_NAMES.values())}."
            )
    split = split_state_dict_into_shards_factory(
        {t.name: t for t in tensors},
        get_storage_size=lambda t: t.nbytes,
        filename_pattern=_FILE_PATTERN,
        max_shard_size=max_shard_size,
    )
    by_name = {t.name: t for t in tensors}
    groups = list(split.filename_to_tensors.values())
    count = len(groups)
    header_metadata = {"format": "pt"} if metadata is None else metadata
    files = tuple(
        _file_layout(
            f"model-{i + 1:05d}-of-{count:05d}.safetensors",
            [by_name[n] for n in group],
            header_metadata,
        )
        for i, group in enumerate(groups)
    )
    return SafetensorsLayout(files, tuple(tensors))


def create_files(layout: SafetensorsLayout, directory: str) -> list[str]:
    """Creates each file of `layout` in `directory`: header written, data a
    hole of the right length. Returns their paths."""
    paths = []
    for file in layout.files:
        path = os.path.join(directory, file.name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.pwrite(fd, file.header, 0)
            os.ftruncate(fd, file.size)
        finally:
            os.close(fd)
        paths.append(path)
    return paths


def index_json(layout: SafetensorsLayout, extra_metadata: Mapping[str, Any] | None = None) -> str:
    """`model.safetensors.index.json`, as Transformers writes it (sorted
    keys, two-space indent), with `extra_metadata` in its `metadata`."""
    metadata = {
        "total_parameters": sum(math.prod(t.shape) for t in layout.tensors),
        "total_size": layout.total_size,
        **(extra_metadata or {}),
    }
    return json.dumps({"metadata": metadata, "weight_map": layout.weight_map}, indent=2, sort_keys=True) + "\n"

