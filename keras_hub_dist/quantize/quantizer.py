"""Quantized variables as tensor sources, computed block by block on the host.

`load_sharded_preset(..., quantize="int8" | "int4")` fills each quantized
variable from a `TensorSource` like any other: the loader plans, reads and
places its blocks, and nothing but quantized blocks ever reaches a device.
For one float tensor (`plan.quantization.QuantizedTensor`) a
`TensorQuantizer` reads blocks of the float source (cast on the host to the
float variable's dtype, as stock assigns it), and computes with
`kernels` (compiled loops, bitwise) where they apply,
else with `keras_math` (Keras's own NumPy steps, bitwise):

- `values_source()`: the int8 values (int4 values packed two per byte), of
  any block;
- `scale_source()`, `zero_source()`: scale and zero point of any block, in
  the variable's dtype.

The values of a block need the statistics of its channels over the whole
reduced extent (int8: `max |x|` over the reduced axes; int4: per-group `min`
/ `max`). A block that spans that extent (or holds whole groups) computes
them itself and keeps them for the scale and zero (small: one per channel or
group); the scale and zero read them from there, or compute them from the
float tensor if no values block did. Where the layout splits the reduced
extent across devices (row-parallel projections), `combine` runs
first: each process reads its own blocks once, reduces them on the host to
partial statistics, and one small collective (`np.maximum` over processes of
a vector, never the kernel) completes them on every process.

Example:

```python
quantizer = TensorQuantizer(tensor, float_source, "bfloat16")
quantizer.values_source().read(((0, 64), (0, 32)))   # int8 block
quantizer.scale_source().read(((0, 32),))            # its scale block
```
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Sequence
from typing import Any

import numpy as np

from keras_hub_dist.formats import transforms
from keras_hub_dist.storage import host_io
from keras_hub_dist.quantize import kernels as qk
from keras_hub_dist.quantize import keras_math as qm
from keras_hub_dist.formats.base import Index, TensorSource, full_index, index_slices, numpy_dtype
from keras_hub_dist.quantize.flat_reshape import blockwise_reshape
from keras_hub_dist.plan.quantization import (
    Int4Rule,
    Int8Rule,
    QuantizedTensor,
    scale_shape,
    values_shape,
)

__all__ = [
    "READ_BYTES",
    "SLAB_BYTES",
    "TensorQuantizer",
    "group_index_source",
    "slab_buffers",
]

# A block is read in units of about this many bytes, each unit quantized
# whole by the kernels or, where they do not apply, in slabs of rows of about
# `SLAB_BYTES` (both counted in the dtype it is computed in), so the host
# holds one unit and a few slabs per reader thread, not the block. Units are cut along a kept axis, most often columns: a narrow
# strip of a row-major tensor is one file read (and its Python) per row,
# and 4 MiB units made an int8 load 4x slower than 64 MiB ones (Gemma-7B
# width, `benchmarks/bench_quantize.py`).
READ_BYTES = 64 << 20
SLAB_BYTES = 8 << 20
# Units of one block computed at once (the loader's reader threads each run
# a block; a union of blocks, read in one call, still uses the cores).
SLAB_THREADS = min(8, os.cpu_count() or 1)
_BFLOAT16 = numpy_dtype("bfloat16")


def _intersection(a: Index, b: Index) -> Index | None:
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _map(fn: Any, units: Sequence[Index]) -> list[Any]:
    """`[fn(unit) for unit in units]`, `SLAB_THREADS` at a time."""
    if len(units) < 2 or SLAB_THREADS < 2:
        return [fn(unit) for unit in units]
    with ThreadPoolExecutor(min(SLAB_THREADS, len(units)), "keras_hub_dist-quantize") as pool:
        return list(pool.map(fn, units))


def slab_buffers() -> host_io.ScratchBuffers:
    """Scratch memory for one load's quantizers (`TensorQuantizer`'s
    `buffers`): buffers of at least `SLAB_BYTES`, a few per slab thread
    kept between uses."""
    return host_io.ScratchBuffers(min_bytes=SLAB_BYTES, keep=4 * SLAB_THREADS)


def _fresh(array: np.ndarray, dtype: Any) -> np.ndarray:
    out = host_io.aligned_empty(array.shape, dtype)
    out[...] = array
    return out


class _Derived(TensorSource):
    """One variable of a quantized tensor (values, scale or zero)."""

    def __init__(self, quantizer: TensorQuantizer, part: str, shape: tuple[int, ...], dtype: Any) -> None:
        self.quantizer, self.part = quantizer, part
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.description = f"{part} of {quantizer.tensor.mode} {quantizer.source.description}"
        self.read_group = quantizer  # the scale reuses the values' statistics

    def read(self, index: Index) -> np.ndarray:
        block = getattr(self.quantizer, self.part)(tuple(index))
        if self.part == "values":  # fresh, int8, computed for this read
            return block
        return _fresh(block, self.dtype)

    def read_nbytes(self, index: Index) -> int:
        return self.quantizer.read_nbytes(self.part, tuple(index))

    def union_read_helps(self, indices: Sequence[Index]) -> bool:
        """Values blocks that each hold their channels' whole reduced extent
        are computed as fast one by one (in parallel); a union helps blocks
        that split it (the statistics then come from one read, no
        `combine_statistics`)."""
        return self.part != "values" or self.quantizer.splits(indices)


class TensorQuantizer:
    """Computes the quantized variables of one float tensor, block by block.

    Args:
        tensor: The quantized tensor (its rule and variables).
        source: The float tensor's values (the checkpoint's, any dtype).
        float_dtype: The float variable's dtype (what stock's `quantize`
            computes in: the model's variable dtype).
        buffers: Scratch memory shared with the load's other quantizers
            (`slab_buffers()`; a new one if not given).
    """

    def __init__(
        self, tensor: QuantizedTensor, source: TensorSource, float_dtype: Any,
        buffers: host_io.ScratchBuffers | None = None,
    ) -> None:
        self.tensor, self.source = tensor, source
        self.rule = tensor.rule
        self.float_dtype = numpy_dtype(float_dtype)
        # bfloat16 is computed in float32 (`_widen`)
        self.compute_dtype = np.dtype(np.float32) if self.float_dtype == _BFLOAT16 else self.float_dtype
        self.buffers = buffers if buffers is not None else slab_buffers()
        raw = source
        if isinstance(self.rule, Int4Rule) and tuple(raw.shape) != tuple(self.rule.matrix):
            raw = blockwise_reshape(raw, self.rule.matrix)
        # Where `x` (the float tensor or int4 matrix) is a stored tensor's
        # bytes as they are, blocks are read straight into scratch memory.
        self.stored = raw.stored if raw.stored is not None and tuple(raw.stored.shape) == tuple(raw.shape) else None
        self.x = raw if np.dtype(raw.dtype) == self.float_dtype else transforms.Cast(raw, self.float_dtype)
        self._lock = threading.Lock()
        self._global: tuple[np.ndarray, ...] | None = None
        self._cache: list[tuple[Index, tuple[np.ndarray, ...]]] = []

    # --- geometry -----------------------------------------------------------

    @property
    def stats_shape(self) -> tuple[int, ...]:
        """int8: the float shape with reduced axes 1; int4: the matrix with
        its group axis replaced by the number of groups."""
        if isinstance(self.rule, Int8Rule):
            return tuple(1 if a in self.rule.reduced else d for a, d in enumerate(self.x.shape))
        shape = list(self.rule.matrix)
        shape[self.rule.group_axis] = self.rule.num_groups
        return tuple(shape)

    def x_index(self, values_index: Index) -> Index:
        """The block of `x` (float tensor / matrix) a values block comes from."""
        if isinstance(self.rule, Int8Rule):
            return values_index
        axis, n = self.rule.pack_axis, self.rule.matrix[self.rule.pack_axis]
        out = list(values_index)
        start, stop = values_index[axis]
        out[axis] = (2 * start, min(2 * stop, n))
        return tuple(out)

    def _stats_box(self, x_index: Index) -> Index:
        """The statistics a block of `x` needs (the channels / groups it holds)."""
        if isinstance(self.rule, Int8Rule):
            return tuple((0, 1) if a in self.rule.reduced else r for a, r in enumerate(x_index))
        g, bs = self.rule.group_axis, self.rule.block_size
        start, stop = x_index[g]
        out = list(x_index)
        out[g] = (start // bs, -(-stop // bs))
        return tuple(out)

    def _x_region(self, stats_box: Index) -> Index:
        """The block of `x` holding everything statistics `stats_box` reduce."""
        if isinstance(self.rule, Int8Rule):
            return tuple((0, d) if a in self.rule.reduced else r for a, (r, d) in enumerate(zip(stats_box, self.x.shape)))
        g, bs = self.rule.group_axis, self.rule.block_size
        out = list(stats_box)
        out[g] = (stats_box[g][0] * bs, min(stats_box[g][1] * bs, self.rule.matrix[g]))
        return tuple(out)

    def complete(self, x_index: Index) -> bool:
        """Whether a block of `x` holds its channels' whole reduced extent."""
        return self._x_region(self._stats_box(x_index)) == tuple(x_index)

    def splits(self, values_indices: Sequence[Index]) -> bool:
        """Whether any of these values blocks (every device's, for a global
        answer) lacks part of its channels' reduced extent: then
        `combine_statistics` must run first."""
        return not all(self.complete(self.x_index(index)) for index in values_indices)

    def _cut_axis(self, x_index: Index) -> int | None:
        """The kept axis (never reduced or grouped) a block is cut along:
        its longest; `None` if it has none."""
        rule = self.rule
        kept = [a for a in range(len(x_index)) if a not in rule.reduced] if isinstance(rule, Int8Rule) else [1 - rule.group_axis]
        return max(kept, key=lambda a: x_index[a][1] - x_index[a][0]) if kept else None

    def _units(self, x_index: Index) -> list[Index]:
        """`x_index` cut along its cut axis (in pairs along the packed axis)
        into units of about `READ_BYTES`: each unit's statistics and values
        depend on the unit only, so a block is computed with unit-sized
        temporaries, whatever its size."""
        axis = self._cut_axis(x_index)
        if axis is None:
            return [x_index]
        start, stop = x_index[axis]
        per_unit = math.prod(b - a for i, (a, b) in enumerate(x_index) if i != axis)
        step = max(1, READ_BYTES // max(1, per_unit * self.compute_dtype.itemsize))
        if isinstance(self.rule, Int4Rule) and axis == self.rule.pack_axis:
            step = max(2, step - step % 2)
        out = []
        for lo in range(start, stop, step):
            slab = list(x_index)
            slab[axis] = (lo, min(stop, lo + step))
            out.append(tuple(slab))
        return out

    def _each_unit(self, x_index: Index, fn: Any) -> list[Any]:
        """`[fn(unit, src, rounded) ...]` over block `x_index` of `x` read in
        units of about `READ_BYTES` (`SLAB_THREADS` at a time), in order.
        `src` holds the unit in scratch memory `fn` may overwrite, in a
        dtype NumPy reduces fast (float32 or wider); `rounded` says whether
        it already holds the float dtype's values (else the kernels or
        `_rounded_rows` round them; reductions may use it as it is: rounding to a narrower
        float is monotonic, so the maximum of the rounded values is the
        rounded maximum, and so for the minimum)."""

        def unit(piece: Index) -> Any:
            with self.buffers.lease() as scratch:
                raw = self._read_raw(piece, scratch)
                if raw.dtype.kind == "f" and raw.dtype.itemsize >= 4:  # NumPy's own float32 / float64
                    return fn(piece, raw, raw.dtype == self.float_dtype)
                return fn(piece, self._widen(raw, scratch), True)

        return _map(unit, self._units(x_index))

    def _rounded_rows(self, unit: Index, src: np.ndarray, rounded: bool) -> Any:
        """Yields `(rows, block, scratch)`: `unit` cut along axis 0 into
        contiguous slabs of about `SLAB_BYTES` (whole groups and pairs where
        axis 0 is grouped or packed), each slab's values in the compute
        dtype, in memory the caller may overwrite (`src`'s own rows where it
        can), and a lease for more scratch memory while the slab lasts."""
        align = 1
        if isinstance(self.rule, Int4Rule):
            align = math.lcm(self.rule.block_size if self.rule.group_axis == 0 else 1, 2 if self.rule.pack_axis == 0 else 1)
        start, stop = unit[0]
        per_row = math.prod(b - a for a, b in unit[1:]) * self.compute_dtype.itemsize
        step = max(align, SLAB_BYTES // max(1, per_row))
        lo = start
        while lo < stop:
            hi = min(stop, max(lo + 1, (lo + step) // align * align))
            rows = ((lo, hi),) + tuple(unit[1:])
            block = src[lo - start : hi - start]
            with self.buffers.lease() as scratch:
                if not rounded:
                    block = self._widen(block, scratch, into=block)
                yield rows, block, scratch
            lo = hi

    def _joined(self, x_index: Index, parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, ...]:
        """Per-unit statistics of block `x_index`, joined along its cut axis."""
        if len(parts) == 1:
            return parts[0]
        return tuple(np.concatenate(p, axis=self._cut_axis(x_index)) for p in zip(*parts))

    def _scale_box(self, scale_index: Index) -> Index:
        """The statistics of a block of the scale (or zero) variable."""
        if isinstance(self.rule, Int4Rule):
            return tuple(scale_index)
        box = [(0, 1)] * len(self.x.shape)
        for axis, (start, stop) in zip(self.rule.scale_axes, scale_index):
            if axis is not None:
                box[axis] = (start, stop)
        return tuple(box)

    # --- statistics ---------------------------------------------------------

    def _read_raw(self, x_index: Index, scratch: Any) -> np.ndarray:
        """A block of `x` as read: a stored tensor's, straight into scratch
        memory, in its dtype; else in the float dtype, fresh."""
        if self.stored is not None:
            return self.stored.read(x_index, out=scratch(tuple(b - a for a, b in x_index), self.stored.dtype))
        return self.x.read(x_index)

    def _widen(self, raw: np.ndarray, scratch: Any, into: np.ndarray | None = None) -> np.ndarray:
        """Values to compute on, contiguous in scratch memory: the float
        dtype's values (the checkpoint's cast as stock assigns them), a
        bfloat16 block widened to float32 (exact): float32 reductions give
        the same (bfloat16) values, ~30x faster, and each product or
        quotient is rounded back to bfloat16 where Keras's is
        (`keras_math.step_dtype`: ml_dtypes 0.7's promotion). The widened values go to `into` (the caller's
        own memory, of `raw`'s shape) when it has the compute dtype."""
        rounded = raw
        if raw.dtype != self.float_dtype:
            rounded = scratch(raw.shape, self.float_dtype)
            np.copyto(rounded, raw, casting="unsafe")  # as `astype`
            if rounded.dtype == self.compute_dtype:
                return rounded
        wide = into if into is not None and into.dtype == self.compute_dtype else scratch(raw.shape, self.compute_dtype)
        np.copyto(wide, rounded)
        return wide

    def _reduce(self, x_index: Index, block: np.ndarray) -> tuple[np.ndarray, ...]:
        """Statistics of a block, in the float dtype (what Keras reduces in;
        the block may hold the values before their rounding to it)."""
        stats = self._kernel_reduce(x_index, block)
        if stats is None:
            if isinstance(self.rule, Int8Rule):
                stats = (qm.abs_max(block, self.rule.reduced),)
            else:
                g = self.rule.group_axis
                stats = qm.group_stats(block, g, x_index[g][0], self.rule.block_size)
        return tuple(s.astype(self.float_dtype, copy=False) for s in stats)

    def _kernel_view(self, block: np.ndarray) -> np.ndarray | None:
        """`block` as the kernels (`kernels`) take it, or `None`:
        int4's matrix; an int8 block whose reduced axes are one run, viewed
        as (the axes before, the run, the axes after)."""
        if isinstance(self.rule, Int4Rule):
            return block if self.rule.block_size and qk.supported(block) else None
        reduced = sorted(self.rule.reduced)
        if not reduced or reduced[-1] - reduced[0] + 1 != len(reduced) or not block.flags.c_contiguous:
            return None
        shape, start, stop = block.shape, reduced[0], reduced[-1] + 1
        run = block.reshape(math.prod(shape[:start]), math.prod(shape[start:stop]), math.prod(shape[stop:]))
        return run if qk.supported(run, ndim=3) else None

    def _kernel_reduce(self, x_index: Index, block: np.ndarray) -> tuple[np.ndarray, ...] | None:
        """`_reduce`'s statistics (before their rounding) by the kernels,
        or `None` where they do not apply (or the block holds a NaN)."""
        view = self._kernel_view(block)
        if view is None:
            return None
        if isinstance(self.rule, Int4Rule):
            g = self.rule.group_axis
            return qk.int4_stats(view, g, x_index[g][0], self.rule.block_size)
        top = qk.int8_abs_max_run(view)
        if top is None:
            return None
        return (top.reshape([1 if a in self.rule.reduced else d for a, d in enumerate(block.shape)]),)

    def partial_statistics(self, x_index: Index) -> tuple[Index, tuple[np.ndarray, ...]]:
        """`(stats box, arrays)` of block `x_index` of `x`, reduced over the
        rows it holds only (read unit by unit)."""
        parts = self._each_unit(x_index, lambda unit, src, _: self._reduce(unit, src))
        return self._stats_box(x_index), self._joined(x_index, parts)

    def _finish(self, box: Index, stats: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        if isinstance(self.rule, Int8Rule):
            return stats
        g = self.rule.group_axis
        return qm.finish_group_stats(*stats, g, box[g][0], self.rule.matrix[g], self.rule.block_size)

    def set_statistics(self, stats: tuple[np.ndarray, ...]) -> None:
        """Complete statistics of the whole tensor (`combine_statistics`)."""
        with self._lock:
            self._global = self._finish(full_index(self.stats_shape), stats)

    def _statistics(self, box: Index) -> tuple[np.ndarray, ...]:
        """Complete statistics for `box`: global, cached, else computed."""
        with self._lock:
            if self._global is not None:
                return tuple(s[index_slices(box, full_index(self.stats_shape))] for s in self._global)
            kept = self._from_cache(box)
        if kept is not None:
            return kept
        stats = self._finish(box, self.partial_statistics(self._x_region(box))[1])
        self._remember(box, stats)
        return stats

    def _from_cache(self, box: Index) -> tuple[np.ndarray, ...] | None:
        """Statistics `box` assembled from the kept ones (one values block's,
        or several that together cover it: a row-sharded embedding's scale
        spans every block), or `None` when they do not cover it."""
        parts = [(part, cached_box, arrays) for cached_box, arrays in self._cache if (part := _intersection(cached_box, box))]
        if not parts:
            return None
        shape = tuple(b - a for a, b in box)
        covered = np.zeros(shape, dtype=bool)
        out = tuple(np.empty(shape, a.dtype) for a in parts[0][2])
        for part, cached_box, arrays in parts:
            for o, a in zip(out, arrays):
                o[index_slices(part, box)] = a[index_slices(part, cached_box)]
            covered[index_slices(part, box)] = True
        return out if covered.all() else None

    def _remember(self, box: Index, stats: tuple[np.ndarray, ...]) -> None:
        with self._lock:
            if self._global is None:
                self._cache.append((box, stats))

    def release(self) -> None:
        """Drops the kept statistics (once the tensor's variables are filled)."""
        with self._lock:
            self._global, self._cache = None, []

    # --- the variables ------------------------------------------------------

    def values(self, index: Index) -> np.ndarray:
        """Block `index` of the int8 (or packed int4) values: statistics
        and values per unit (`_each_unit`), by the kernels
        (`_kernel_values`) or else per slab of rows (`_rounded_rows`); both
        release the GIL, so units run in parallel."""
        x_index = self.x_index(index)
        box = self._stats_box(x_index)
        local = self.complete(x_index) and self._global is None
        stats = None if local else self._statistics(box)
        out = host_io.aligned_empty(tuple(b - a for a, b in index), np.int8)

        def one(unit: Index, src: np.ndarray, rounded: bool) -> tuple[np.ndarray, ...]:
            unit_box = self._stats_box(unit)
            if local:
                part = self._finish(unit_box, self._reduce(unit, src))
            else:
                part = tuple(s[index_slices(unit_box, box)] for s in stats)
            if self._kernel_values(unit, src, rounded, part, out[index_slices(self._values_index(unit), index)]):
                return part
            for rows, block, scratch in self._rounded_rows(unit, src, rounded):
                rows_part = tuple(p[index_slices(self._stats_box(rows), unit_box)] for p in part)
                self._quantize(rows, block, rows_part, out[index_slices(self._values_index(rows), index)], scratch)
            return part

        kept = self._each_unit(x_index, one)
        if local:
            self._remember(box, self._joined(x_index, kept))
        return out

    def _values_index(self, x_index: Index) -> Index:
        """The values block of a block of `x` (int4: packed, in pairs)."""
        if isinstance(self.rule, Int8Rule):
            return x_index
        axis = self.rule.pack_axis
        out = list(x_index)
        out[axis] = (x_index[axis][0] // 2, -(-x_index[axis][1] // 2))
        return tuple(out)

    def _kernel_values(
        self, unit: Index, src: np.ndarray, rounded: bool, stats: tuple[np.ndarray, ...], out: np.ndarray
    ) -> bool:
        """Writes the values of unit `unit` (`src`, rounded to the float
        dtype by the kernel where not `rounded`) to `out` with the kernels,
        if they apply: a float32 block they take (`_kernel_view`), finite
        statistics (so finite values), float32 parameters. Returns whether
        it did."""
        view = self._kernel_view(src)
        round_bf16 = not rounded
        if view is None or (round_bf16 and self.float_dtype != _BFLOAT16):
            return False
        if not all(np.isfinite(s).all() for s in stats):
            return False
        if isinstance(self.rule, Int4Rule):
            scale, zero = qm.group_params(*stats)
            step = self._kernel_step(scale, zero)
            if step is None:
                return False
            g = self.rule.group_axis
            qk.int4_values(
                view, round_bf16, g, unit[g][0], self.rule.block_size, scale, zero, self.rule.pack_axis, out,
                round_step=step,
            )
            return True
        scale = qm.int8_scale(stats[0])
        target = out.view()
        try:
            target.shape = view.shape  # no copy: a view of the values block
        except AttributeError:
            return False
        step = self._kernel_step(scale)
        if step is None:
            return False
        qk.int8_values_run(view, round_bf16, scale.reshape(view.shape[0], 1, view.shape[2]), target, round_step=step)
        return True

    def _kernel_step(self, *params: np.ndarray) -> bool | None:
        """Whether the kernels round each product / quotient to bfloat16
        (`keras_math.step_dtype`), or `None` where they do not apply: the
        kernels take parameters and steps of float32 or bfloat16 (exact
        in float32) only."""
        if any(p.dtype not in (np.float32, _BFLOAT16) for p in params):
            return None
        step = qm.step_dtype(self.float_dtype, params[0])
        return step == _BFLOAT16 if step in (np.float32, _BFLOAT16) else None

    def _quantize(
        self, x_index: Index, block: np.ndarray, stats: tuple[np.ndarray, ...], out: np.ndarray, scratch: Any
    ) -> None:
        """Writes the values of `block` (scratch, overwritten) to `out`."""
        if isinstance(self.rule, Int8Rule):
            scale = qm.int8_scale(stats[0])
            qm.int8_values(block, scale, overwrite=True, out=out, step=qm.step_dtype(self.float_dtype, scale))
            return
        g = self.rule.group_axis
        scale, zero = qm.group_params(*stats)
        values = scratch(block.shape, np.int8)
        qm.group_values(
            block, g, x_index[g][0], self.rule.block_size, scale, zero, overwrite=True, out=values,
            step=qm.step_dtype(self.float_dtype, scale),
        )
        qm.pack_int4(values, self.rule.pack_axis, out=out)

    def scale(self, index: Index) -> np.ndarray:
        """Block `index` of the scale, in the float dtype (as stock stores it)."""
        stats = self._statistics(self._scale_box(index))
        if isinstance(self.rule, Int4Rule):
            return qm.group_params(*stats)[0].astype(self.float_dtype)
        return self._scale_layout(qm.int8_scale(stats[0]), index).astype(self.float_dtype)

    def zero(self, index: Index) -> np.ndarray:
        """Block `index` of the int4 zero point (int8, as Keras casts it)."""
        return qm.group_params(*self._statistics(self._scale_box(index)))[1].astype("int8")

    def _scale_layout(self, keepdims: np.ndarray, index: Index) -> np.ndarray:
        """A keepdims int8 scale block in the scale variable's axis order."""
        kept = [a for a in self.rule.scale_axes if a is not None]
        squeezed = keepdims.reshape([d for a, d in enumerate(keepdims.shape) if a not in self.rule.reduced] or [1])
        order = sorted(range(len(kept)), key=lambda i: kept[i])
        moved = np.transpose(squeezed, np.argsort(order)) if kept else squeezed
        return moved.reshape(tuple(b - a for a, b in index))

    def read_nbytes(self, part: str, index: Index) -> int:
        if part == "values":
            return self.x.read_nbytes(self.x_index(index))
        return 0  # from statistics kept by the values (normally)

    def values_source(self) -> TensorSource:
        """The values variable's source (int8)."""
        return _Derived(self, "values", values_shape(self.tensor), np.int8)

    def scale_source(self, dtype: Any) -> TensorSource:
        """The scale variable's source, cast to `dtype` (the variable's)."""
        return _Derived(self, "scale", scale_shape(self.tensor), dtype)

    def zero_source(self, dtype: Any) -> TensorSource:
        """The zero point variable's source, cast to `dtype` (the variable's)."""
        return _Derived(self, "zero", scale_shape(self.tensor), dtype)


def group_index_source(tensor: QuantizedTensor) -> TensorSource:
    """Keras's `g_idx`: each row's group, float32 (`floor_divide(arange, block)`)."""
    rule = tensor.rule
    rows = rule.matrix[rule.group_axis]
    value = np.floor_divide(np.arange(rows, dtype=np.float32), rule.block_size)
    return transforms.Constant(value, f"g_idx of {tensor.layer_path}")
