"""KerasHub presets (`model.weights.h5`, single or multi-file): the writer.

Keras writes every saved value as a contiguous, uncompressed HDF5 dataset.
Its place in the file is fixed once the dataset is created, so the file can
be laid out first and filled later, by anyone who knows the offsets:

1. `weights_layout` replays `model.save_weights`'s walk (the one Keras's
   saver makes) and records the groups and datasets it would write, with
   their shapes and dtypes, keeping no value;
2. `create_weights_files` (one process) writes exactly those groups and
   datasets through Keras's own store classes, with the dataset storage
   allocated at creation and never filled (no byte of data is written; the
   file is sparse until filled). Multi-file weights (`max_shard_size`)
   follow Keras's own rule for when a new file starts;
3. every process then writes the bytes of the blocks it owns at the
   datasets' offsets (`keras_hub_dist.save`), with plain positioned writes.

The result is an ordinary Keras weights file: stock `load_weights` and
`Backbone.from_preset` read it, and so does our loader (`formats.keras_h5`).

Example:

```python
layout = weights_layout(backbone)
path = create_weights_files(layout, "preset_dir", max_shard_size=None)
offsets = keras_h5.read_datasets(keras_h5.weights_files(path))
```
"""

from __future__ import annotations

import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import h5py
import ml_dtypes
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.formats import keras_h5
from keras_hub_dist.formats.base import numpy_dtype

__all__ = [
    "DatasetLayout",
    "GroupLayout",
    "WeightsLayout",
    "create_weights_files",
    "weights_layout",
]

_BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@dataclass(frozen=True)
class GroupLayout:
    """A saveable's group (`make(path, metadata)` of Keras's walk)."""

    path: str
    metadata: Mapping[str, Any] | None


@dataclass(frozen=True)
class DatasetLayout:
    """One saved value: dataset `name` (`<path>/vars/<key>`), shape, dtype."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class WeightsLayout:
    """What `model.save_weights` writes, in order, without the values."""

    events: tuple[GroupLayout | DatasetLayout, ...]

    @property
    def datasets(self) -> tuple[DatasetLayout, ...]:
        return tuple(e for e in self.events if isinstance(e, DatasetLayout))

    @property
    def nbytes(self) -> int:
        return sum(d.nbytes for d in self.datasets)


def _value_dtype(value: Any) -> np.dtype:
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return np.asarray(value).dtype
    return numpy_dtype(dtype)


def weights_layout(
    model: Any,
    skip: Sequence[Any] = (),
    on_value: Callable[[DatasetLayout, Any], None] | None = None,
) -> WeightsLayout:
    """The groups and datasets `model.save_weights` would write.

    Args:
        model: A built model.
        skip: Saveables left out (a task's backbone layers, as
            `save_task_weights` does).
        on_value: Called with each dataset and the value Keras would save
            (a `keras.Variable`, or a computed array such as a LoRA-merged
            kernel), which is not kept after the call.
    """
    events: list[GroupLayout | DatasetLayout] = []

    def group(path: str, metadata: Mapping[str, Any] | None) -> None:
        events.append(GroupLayout(path, dict(metadata) if metadata else None))

    def value(name: str, key: str, saved: Any) -> None:
        dataset = DatasetLayout(name, key, tuple(int(d) for d in saved.shape), _value_dtype(saved))
        events.append(dataset)
        if on_value is not None:
            on_value(dataset, saved)

    keras_h5.walk_saved_values(model, value, group, skip)
    return WeightsLayout(tuple(events))


def _storage_plist() -> h5py.h5p.PropDCID:
    plist = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    # Allocated now, so its offset is known; never filled, so creating a
    # dataset writes no data (the file stays sparse until the owners write).
    plist.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    plist.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    return plist


def _create_dataset(group: h5py.Group, key: str, dataset: DatasetLayout) -> None:
    """What `H5IOStore.__setitem__` does with a value, minus the data."""
    created = group.create_dataset(
        key, shape=dataset.shape, dtype=dataset.dtype, dcpl=_storage_plist()
    )
    if dataset.dtype == _BFLOAT16:
        created.attrs["dtype"] = "bfloat16"


def create_weights_files(
    layout: WeightsLayout,
    path: str,
    max_shard_size: float | None = None,
) -> str:
    """Writes the weights file(s) of `layout` with every dataset allocated
    and unfilled.

    Args:
        layout: From `weights_layout`.
        path: `.../model.weights.h5`, or `.../model.weights.json` for
            multi-file weights.
        max_shard_size: GB per file (Keras's `max_shard_size`); `None` for a
            single file.

    Returns:
        The path to load from: the `.h5` file, or the `.json` weight map.
    """
    store = _compat.unfilled_weights_store(pathlib.Path(path), max_shard_size, _create_dataset)
    try:
        for event in layout.events:
            if isinstance(event, GroupLayout):
                store.make(event.path, metadata=event.metadata)
            else:
                store[event.key] = event
    finally:
        store.close()
    return os.fspath(path)
