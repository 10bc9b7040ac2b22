"""Keras's int8 / int4 weight quantization, block by block, bitwise.

Keras 3.15 quantizes weights with NumPy on the host (`to_numpy=True` in
`abs_max_quantize` and `abs_max_quantize_grouped_with_zero_point`, and
`pack_int4`). Every function here repeats those NumPy calls in the same
order, on arrays of the same dtypes, with the same Python scalars (the
dtypes NumPy picks matter, and for a bfloat16 kernel they are ml_dtypes'
choice: with ml_dtypes 0.7 a bfloat16 array plus a Python float is
bfloat16, so Keras's scale, products and quotients are bfloat16; with 0.5
it was float32; `step_dtype` asks NumPy). So the results are Keras's to
the bit, on any block:

- the reductions (`max |x|`, per-group `min` / `max`) are exact, so they can
  run over any split of the reduced axis and be combined with `np.maximum` /
  `np.minimum` (also across processes) to the very values Keras's single
  reduction gives; the zero rows Keras pads the last int4 group with are a
  `0` folded into that group's `min` / `max` (`finish_group_stats`);
- everything after the reduction is element-wise (IEEE divide, multiply,
  round half to even, clip, cast), so a block of the result is the same
  function of the same elements.

Only the reduction inputs move: a stored zero's sign never matters (`max -
min` and `round(-min / scale)` give the same values for `+0` and `-0`).
In-place steps (`out=`) and a bfloat16 block widened to float32 first (by
`quantize.quantizer`: exact; its reductions give the same values, and each
product or quotient is rounded back to `step_dtype` where Keras's is
bfloat16, which is the value ml_dtypes' bfloat16 ufunc gives: it too
computes in float32 and rounds once) compute the same values faster; so do a rounding and its int8 cast in one ufunc
call, `reduceat` for groups along the last axis and int4 pairs packed as
uint16 (each says why where it is used; the tests compare every one with
Keras's own functions).

Example:

```python
top = abs_max(block, axes=(0,))                    # per block
scale = int8_scale(np.maximum(top, other_top))     # combined, then as Keras
values = int8_values(block, scale)
```
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence

import keras
import numpy as np

__all__ = [
    "GROUP_EPSILON",
    "INT4_RANGE",
    "INT8_EPSILON",
    "INT8_RANGE",
    "abs_max",
    "finish_group_stats",
    "group_params",
    "group_segments",
    "group_stats",
    "group_values",
    "int8_scale",
    "int8_values",
    "pack_int4",
    "step_dtype",
]

# The defaults Keras's layers quantize with (read from Keras, not copied):
# `AbsMaxQuantizer()` for int8, `abs_max_quantize_grouped_with_zero_point`'s
# signature for int4 (range (-8, 7), which the layers also pass explicitly).
_ABS_MAX = keras.quantizers.AbsMaxQuantizer()
INT8_RANGE: tuple[int, int] = tuple(_ABS_MAX.value_range)
INT8_EPSILON: float = _ABS_MAX.epsilon
_GROUPED = inspect.signature(keras.quantizers.abs_max_quantize_grouped_with_zero_point).parameters
INT4_RANGE: tuple[int, int] = tuple(_GROUPED["value_range"].default)
GROUP_EPSILON: float = _GROUPED["epsilon"].default


def abs_max(block: np.ndarray, axes: Sequence[int]) -> np.ndarray:
    """`max(|block|)` over `axes`, keepdims (exact: combine with `np.maximum`).

    Taken as `max(max(x), -min(x))`: the same value as Keras's
    `max(abs(x))` without a block-sized `abs` temporary (NaN propagates
    either way; an all-zero column may give `-0.0`, which `+ epsilon`
    turns into the same scale)."""
    axes = tuple(axes)
    return np.maximum(np.max(block, axis=axes, keepdims=True), np.negative(np.min(block, axis=axes, keepdims=True)))


def int8_scale(top: np.ndarray, value_range: tuple[int, int] = INT8_RANGE, epsilon: float = INT8_EPSILON) -> np.ndarray:
    """`abs_max_quantize`'s scale from the (combined) `max |x|`."""
    return np.divide(value_range[1], np.add(top, epsilon))


def int8_values(
    block: np.ndarray, scale: np.ndarray, value_range: tuple[int, int] = INT8_RANGE,
    overwrite: bool = False, out: np.ndarray | None = None, step: np.dtype | None = None,
) -> np.ndarray:
    """`abs_max_quantize`'s values of `block` for its (broadcast) scale.

    Keras's `clip` to the range is left out where the products are float32
    or wider: it never changes a value there. With `scale = r / (m + eps)`
    and `|x| <= m` (the very maximum the scale came from), `|x * scale| <=
    r * (1 + 2 ulp)`, which rounds to at most `r` (and NaN stays NaN either
    way). A bfloat16 scale and product (8 significant bits) can pass the
    end: `127 * (1 + 2**-8)` rounds to 127.5, then to 128, which the clip
    (done before the rounding here: the same values, the ends being
    integers) brings back to 127. The test suite checks ties and extremes
    against Keras.

    With `overwrite=True` the products are computed in `block`'s memory
    where they have its dtype; with `out` (int8, the block's shape, any
    strides) the values are written there. `step`: the dtype Keras's
    product has (`step_dtype`) where `block` was widened from it.
    """
    products = _product_target(block, scale, overwrite)
    np.multiply(block, scale, out=products)
    _round_to(products, step)
    if np.dtype(step or products.dtype).itemsize < 4:
        np.clip(products, value_range[0], value_range[1], out=products)
    if out is None:
        out = np.empty(products.shape, np.int8)
    # Keras's `np.round` (which is `rint` for 0 decimals) then
    # `astype("int8")`, in one pass: the ufunc rounds into a small buffer
    # and casts that with the same cast `astype` uses.
    np.rint(products, out=out, casting="unsafe")
    return out


def step_dtype(float_dtype: np.dtype, scale: np.ndarray) -> np.dtype:
    """The dtype of Keras's `x * scale` (int8) or `x / scale` (int4) for a
    kernel of `float_dtype`: NumPy's promotion of the two, as Keras runs it.

    Keras computes the scale from the kernel's own dtype and Python scalars,
    so for a bfloat16 kernel the scale's dtype is `ml_dtypes`' choice: with
    ml_dtypes 0.7 (NEP 50: a Python scalar takes the array's dtype) the
    scale, the products and the quotients are bfloat16, each element
    computed in float32 and rounded to bfloat16 (`x * scale` exactly, then
    rounded once: both factors have 8 significant bits); with ml_dtypes 0.5
    (`bf16 + 1e-7` is float32) they are float32. `quantize.quantizer`
    widens a bfloat16 block to float32 (exact) and, where this says
    bfloat16, rounds each product or quotient to it (`_round_to`, the same
    cast as ml_dtypes' own ufuncs end with)."""
    return np.result_type(np.dtype(float_dtype), scale.dtype)


def _round_to(values: np.ndarray, step: np.dtype | None) -> None:
    """Rounds `values` in place to the narrower float dtype `step` (then
    back): the value Keras's step holds there."""
    if step is not None and np.dtype(step) != values.dtype and np.dtype(step).itemsize < values.dtype.itemsize:
        np.copyto(values, values.astype(step))


def _product_target(block: np.ndarray, other: np.ndarray, overwrite: bool) -> np.ndarray:
    """Where `block (op) other` goes: `block` itself when allowed and of the
    result's dtype (the same values: element-wise, in place), else fresh."""
    dtype = np.result_type(block, other)
    if overwrite and dtype == block.dtype and block.flags.writeable:
        return block
    return np.empty(np.broadcast_shapes(block.shape, other.shape), dtype)


def group_segments(start: int, stop: int, block_size: int) -> list[tuple[int, int, int]]:
    """`(group, first row, stop row)` of each group rows `[start, stop)` touch
    (rows in global numbering), in order."""
    out = []
    row = start
    while row < stop:
        group = row // block_size
        end = min(stop, (group + 1) * block_size)
        out.append((group, row, end))
        row = end
    return out


def _per_group(
    block: np.ndarray, axis: int, start: int, block_size: int,
    fn: Callable[[np.ndarray, slice, int], np.ndarray],
) -> list[np.ndarray]:
    """`fn(rows of one group, the group's slot, their first row in the
    block)` per group the block's rows touch (`axis` is the group axis;
    `start` the block's first row). Whole groups in the middle go through
    `fn` at once, reshaped to (groups, block_size, other) with the group
    axis first."""
    moved = np.moveaxis(block, axis, 0)
    segments = group_segments(start, start + moved.shape[0], block_size)
    first_group = segments[0][0] if segments else 0
    out: list[np.ndarray] = []
    i = 0
    while i < len(segments):
        group, lo, hi = segments[i]
        if hi - lo == block_size:
            j = i
            while j < len(segments) and segments[j][2] - segments[j][1] == block_size:
                j += 1
            rows = moved[lo - start : segments[j - 1][2] - start]
            whole = rows.reshape((j - i, block_size) + rows.shape[1:])
            out.append(fn(whole, slice(group - first_group, group - first_group + j - i), lo - start))
            i = j
        else:
            rows = moved[lo - start : hi - start]
            out.append(fn(rows[None], slice(group - first_group, group - first_group + 1), lo - start))
            i += 1
    return out


def group_stats(block: np.ndarray, axis: int, start: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-group `(min, max)` over the rows the block holds (group axis
    `axis`, first row `start`), shaped like the block with that axis
    replaced by the groups it touches. Exact: combine with `np.minimum` /
    `np.maximum`, then `finish_group_stats`.

    Groups along the last axis (an embedding table's) are reduced by one
    `reduceat` at their first elements: NumPy reduces the 128-element rows
    of a (rows, groups, 128) view one by one, 1.4x slower; along any other
    axis that view is the fast one (8x faster than `reduceat`)."""
    if axis == block.ndim - 1:
        starts = [lo - start for _, lo, _ in group_segments(start, start + block.shape[axis], block_size)]
        return np.minimum.reduceat(block, starts, axis=axis), np.maximum.reduceat(block, starts, axis=axis)
    lows = _per_group(block, axis, start, block_size, lambda rows, *_: np.min(rows, axis=1))
    highs = _per_group(block, axis, start, block_size, lambda rows, *_: np.max(rows, axis=1))
    return (
        np.moveaxis(np.concatenate(lows, axis=0), 0, axis),
        np.moveaxis(np.concatenate(highs, axis=0), 0, axis),
    )


def finish_group_stats(
    low: np.ndarray, high: np.ndarray, axis: int, first_group: int, rows: int, block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Folds in the zero rows Keras pads the last group with (when `rows`
    is not a multiple of `block_size` and the stats hold that group)."""
    last = (rows - 1) // block_size
    if rows % block_size == 0 or not first_group <= last < first_group + low.shape[axis]:
        return low, high
    index = [slice(None)] * low.ndim
    index[axis] = slice(last - first_group, last - first_group + 1)
    index = tuple(index)
    low, high = low.copy(), high.copy()
    zero = np.zeros((), low.dtype)
    low[index] = np.minimum(low[index], zero)
    high[index] = np.maximum(high[index], zero)
    return low, high


def group_params(
    low: np.ndarray, high: np.ndarray, value_range: tuple[int, int] = INT4_RANGE, epsilon: float = GROUP_EPSILON
) -> tuple[np.ndarray, np.ndarray]:
    """`(scale, zero point)` of each group, before Keras's final casts."""
    qmin, qmax = value_range
    scale = np.divide(np.subtract(high, low) + epsilon, qmax - qmin)
    zero_point = np.round(np.divide(-low, scale)) + qmin
    zero_point = np.clip(zero_point, qmin, qmax)
    return scale, zero_point


def group_values(
    block: np.ndarray, axis: int, start: int, block_size: int,
    scale: np.ndarray, zero_point: np.ndarray, value_range: tuple[int, int] = INT4_RANGE,
    overwrite: bool = False, out: np.ndarray | None = None, step: np.dtype | None = None,
) -> np.ndarray:
    """The int4 values (in int8) of a block whose groups' parameters are
    `scale` / `zero_point` (group axis `axis`, first group the block's).
    `overwrite`, `out` and `step` (of the quotients) as for `int8_values`.

    Keras adds the zero point in the quotients' dtype: a bfloat16 sum may
    round where it is past 256, but such a sum clips to the same end of the
    range (rounding is monotonic and the ends are bfloat16 values), so the
    float32 sum here gives Keras's values."""
    qmin, qmax = value_range
    scale_g = np.moveaxis(scale, axis, 0)
    zero_g = np.moveaxis(zero_point, axis, 0)
    values = np.empty(block.shape, np.int8) if out is None else out
    values_g = np.moveaxis(values, axis, 0)

    def quantize(rows: np.ndarray, groups: slice, first: int) -> None:
        group_scale = scale_g[groups][:, None]
        outputs = _product_target(rows, group_scale, overwrite)
        np.divide(rows, group_scale, out=outputs)  # then in place
        _round_to(outputs, step)
        np.round(outputs, out=outputs)
        np.add(outputs, zero_g[groups][:, None], out=outputs)
        target = values_g[first : first + outputs.shape[0] * outputs.shape[1]]
        # `clip` then `astype("int8")`, in one pass (as in `int8_values`)
        np.clip(outputs.reshape(target.shape), qmin, qmax, out=target, casting="unsafe")

    _per_group(block, axis, start, block_size, quantize)
    return values


def pack_int4(values: np.ndarray, axis: int, out: np.ndarray | None = None) -> np.ndarray:
    """`keras.quantizers.pack_int4(values, axis)` (int8), written to `out`
    (any strides) if given.

    Keras computes `(low & 0x0F) | ((high & 0x0F) << 4)` in int8 over every
    other element; the same bits come from uint8 views with one step fewer
    (a byte shifted left by 4 drops the high nibble `& 0x0F` would clear),
    or, for pairs along a contiguous last axis, from each pair read as one
    little-endian uint16 (`_pack_pairs`): every other element along the last
    axis is a 2-byte stride NumPy cannot vectorize, 1.75x slower."""
    if out is None:
        shape = list(values.shape)
        shape[axis] = -(-shape[axis] // 2)
        out = np.empty(shape, np.int8)
    last = axis == values.ndim - 1 or axis == -1
    if last and values.shape[-1] % 2 == 0 and values.flags.c_contiguous and _LITTLE_ENDIAN:
        _pack_pairs(values.astype(np.int8, copy=False).view(np.uint16), out.view(np.uint8))
        return out
    arr = np.moveaxis(values, axis, 0)
    if arr.shape[0] % 2 == 1:
        arr = np.concatenate([arr, np.zeros((1,) + arr.shape[1:], dtype=arr.dtype)], axis=0)
    low = arr[::2].astype(np.int8, copy=False).view(np.uint8)
    high = arr[1::2].astype(np.int8, copy=False).view(np.uint8)
    packed = np.moveaxis(out, axis, 0).view(np.uint8)
    np.left_shift(high, np.uint8(4), out=packed)
    np.bitwise_or(packed, np.bitwise_and(low, np.uint8(0x0F)), out=packed)
    return out


_LITTLE_ENDIAN = sys.byteorder == "little"


def _pack_pairs(pairs: np.ndarray, out: np.ndarray) -> None:
    """Each uint16 `high << 8 | low` (an int8 pair) to the byte
    `(high << 4) & 0xF0 | low & 0x0F`, into uint8 `out`."""
    low = np.bitwise_and(pairs, np.uint16(0x0F))
    high = np.right_shift(pairs, np.uint16(4))
    np.bitwise_and(high, np.uint16(0xF0), out=high)
    np.bitwise_or(low, high, out=low)
    np.copyto(out, low, casting="unsafe")  # the low byte
