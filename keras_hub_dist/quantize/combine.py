"""Quantization statistics split across processes, completed by one collective.

Where a layout splits a quantized tensor's reduced extent across devices
(row-parallel projections), no values block holds its channels' whole
statistics. `combine_statistics` has each process reduce its own blocks on
the host (`TensorQuantizer.partial_statistics`) and takes the element-wise
maximum over processes of those vectors (minima negated): a few floats per
channel or group cross the network, never the kernel. `sharding_blocks`
gives the blocks a sharding cuts a variable into, to ask
`TensorQuantizer.splits` whether this is needed.

Example:

```python
blocks = sharding_blocks(sharding, values_shape)
if quantizer.splits(blocks):
    combine_statistics([(quantizer, sharding_blocks(sharding, values_shape, local=True))])
```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from keras_hub_dist import _processes
from keras_hub_dist.errors import PresetError
from keras_hub_dist.formats.base import Index, full_index, index_slices
from keras_hub_dist.quantize.quantizer import TensorQuantizer
from keras_hub_dist.plan.quantization import Int8Rule

__all__ = ["combine_statistics", "sharding_blocks"]


def sharding_blocks(sharding: Any, shape: Sequence[int], local: bool = False, distinct: bool = True) -> list[Index]:
    """The blocks a `jax.sharding.Sharding` cuts `shape` into, per device
    (this process's devices only with `local=True`), in device order; each
    block once with `distinct=True`."""
    shape = tuple(int(d) for d in shape)
    by_device = sharding.addressable_devices_indices_map(shape) if local else sharding.devices_indices_map(shape)
    blocks = [
        tuple((s.start or 0, d if s.stop is None else s.stop) for s, d in zip(slices, shape))
        for slices in by_device.values()
    ]
    return list(dict.fromkeys(blocks)) if distinct else blocks


def combine_statistics(work: Sequence[tuple[TensorQuantizer, Sequence[Index]]]) -> None:
    """Completes the statistics of tensors whose reduced extent the layout
    splits: each process reduces its own values blocks (`Index`es of the
    values variable) on the host, then one collective takes the element-wise
    maximum over processes of every partial statistic (minima negated), a
    few floats per channel. Every process must pass the same tensors in the
    same order (a global property of the layout); each reads only its
    blocks."""
    partials: list[tuple[np.ndarray, ...]] = []
    error = None
    try:
        for quantizer, indices in work:
            shape = quantizer.stats_shape
            signs = (1,) if isinstance(quantizer.rule, Int8Rule) else (-1, 1)
            wide = np.promote_types(quantizer.float_dtype, np.float32)  # exact
            acc = [np.full(shape, -np.inf, dtype=wide) for _ in signs]
            for index in indices:
                box, stats = quantizer.partial_statistics(quantizer.x_index(index))
                where = index_slices(box, full_index(shape))
                for a, s, sign in zip(acc, stats, signs):
                    np.maximum(a[where], sign * s.astype(wide), out=a[where])
            partials.append(tuple(acc))
    except Exception as e:  # noqa: BLE001 - every process must hear of it
        if jax.process_count() == 1:
            raise
        error = f"{type(e).__name__}: {e}"
    if jax.process_count() > 1:
        # A process that failed would leave the others in the collective.
        _processes.check_all(error, PresetError, "Reading the quantization statistics failed")
    if not partials:
        return
    flat = np.concatenate([a.reshape(-1) for arrays in partials for a in arrays])
    flat = _processes.max_over_processes(flat)
    offset = 0
    for (quantizer, _), arrays in zip(work, partials):
        signs = (1,) if isinstance(quantizer.rule, Int8Rule) else (-1, 1)
        out = []
        for a, sign in zip(arrays, signs):
            size = math.prod(a.shape)
            out.append((sign * flat[offset : offset + size].reshape(a.shape)).astype(quantizer.float_dtype))
            offset += size
        quantizer.set_statistics(tuple(out))
