"""Keras's int8 / int4 weight quantization, block by block, bitwise.

Keras 3.15 quantizes weights with NumPy on the host (`to_numpy=True` in
`abs_max_quantize` and `abs_max_quantize_grouped_with_zero_point`, and
`pack_int4`). Every function here repeats those NumPy calls in the same
order, on arrays of the same dtypes, with the same Python scalars (the
dtypes NumPy picks matter: a bfloat16 array plus a Python float is float32
under ml_dtypes, so the scale of a bfloat16 kernel is computed in float32
and rounded to bfloat16 last, as Keras does). So the results are Keras's to
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
`formats.quantize`: every block-sized step of Keras on a bfloat16 kernel is
a float32 one by NumPy's promotion, and its reductions are exact) compute
the same values faster.

Example:

```python
top = abs_max(block, axes=(0,))                    # per block
scale = int8_scale(np.maximum(top, other_top))     # combined, then as Keras
values = int8_values(block, scale)
```
"""

from __future__ import annotations

import inspect
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


def int8_values(block: np.ndarray, scale: np.ndarray, value_range: tuple[int, int] = INT8_RANGE) -> np.ndarray:
    """`abs_max_quantize`'s values of `block` for its (broadcast) scale.

    Keras's `clip` to the range is left out: it never changes a value. With
    `scale = r / (m + eps)` and `|x| <= m` (the very maximum the scale came
    from), `|x * scale| <= r * (1 + 2 ulp)`, which rounds to at most `r`
    (and NaN stays NaN either way); the test suite checks ties and extremes
    against Keras."""
    outputs = np.multiply(block, scale)  # then in place: the same values
    np.round(outputs, out=outputs)
    return outputs.astype("int8")


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
    fn: Callable[[np.ndarray, slice], np.ndarray],
) -> list[np.ndarray]:
    """`fn(rows of one group, the group's slot)` per group the block's rows
    touch (`axis` is the group axis; `start` the block's first row). Whole
    groups in the middle go through `fn` at once, reshaped to (groups,
    block_size, other) with the group axis first."""
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
            out.append(fn(whole, slice(group - first_group, group - first_group + j - i)))
            i = j
        else:
            rows = moved[lo - start : hi - start]
            out.append(fn(rows[None], slice(group - first_group, group - first_group + 1)))
            i += 1
    return out


def group_stats(block: np.ndarray, axis: int, start: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-group `(min, max)` over the rows the block holds (group axis
    `axis`, first row `start`), shaped like the block with that axis
    replaced by the groups it touches. Exact: combine with `np.minimum` /
    `np.maximum`, then `finish_group_stats`."""
    lows = _per_group(block, axis, start, block_size, lambda rows, _: np.min(rows, axis=1))
    highs = _per_group(block, axis, start, block_size, lambda rows, _: np.max(rows, axis=1))
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
) -> np.ndarray:
    """The int4 values (in int8) of a block whose groups' parameters are
    `scale` / `zero_point` (group axis `axis`, first group the block's)."""
    qmin, qmax = value_range
    scale_g = np.moveaxis(scale, axis, 0)
    zero_g = np.moveaxis(zero_point, axis, 0)

    def quantize(rows: np.ndarray, groups: slice) -> np.ndarray:
        outputs = np.divide(rows, scale_g[groups][:, None])  # then in place
        np.round(outputs, out=outputs)
        np.add(outputs, zero_g[groups][:, None], out=outputs)
        np.clip(outputs, qmin, qmax, out=outputs)
        outputs = outputs.astype("int8")
        return outputs.reshape((-1,) + outputs.shape[2:])

    parts = _per_group(block, axis, start, block_size, quantize)
    return np.moveaxis(np.concatenate(parts, axis=0), 0, axis)


def pack_int4(values: np.ndarray, axis: int) -> np.ndarray:
    """`keras.quantizers.pack_int4(values, axis)`'s NumPy steps (int8)."""
    arr = np.moveaxis(values, axis, 0)
    if arr.shape[0] % 2 == 1:
        arr = np.concatenate([arr, np.zeros((1,) + arr.shape[1:], dtype=arr.dtype)], axis=0)
    low = arr[::2]
    high = arr[1::2]
    dtype = np.dtype("int8")
    mask = np.array(0x0F, dtype=dtype)
    low_u = np.bitwise_and(low.astype(dtype), mask)
    high_u = np.bitwise_and(high.astype(dtype), mask)
    packed = np.bitwise_or(low_u, np.left_shift(high_u, np.array(4, dtype=dtype)))
    return np.moveaxis(packed.astype(dtype), 0, axis)
