"""Keras's int8 / int4 quantization of float32 blocks, compiled with Numba.

`keras_math` repeats Keras's NumPy calls; each is one pass over every
element, and NumPy reduces 128-element groups one by one. Numba compiles
the same arithmetic into loops over each row that LLVM vectorizes: per
element of an 8 MiB float32 block of Gemma-7B width rounded to bfloat16,
one thread, int4 along rows (an embedding) 0.61 ns against NumPy's 4.87,
int4 along columns (a kernel) 0.70 against 4.24, int8 0.48 against 4.03; a
plain copy of the block is 0.10 (`benchmarks/bench_quantize_kernels.py`,
2-core Xeon, 2026-12-06; whole loads: BENCHMARKS.md). Numba is the well-kept way to write such loops
in Python (no C extension to build per platform); it is imported, and the
kernels loaded from its on-disk cache (compiled once: 5.4 s), only when a
load quantizes (`prepare`).

The results are `keras_math`'s (so Keras's) to the bit, by these steps:

- statistics are taken on int32 keys that order as the floats do
  (`bits ^ ((bits >> 31) & 0x7FFFFFFF)`): integer `min` / `max` are exact
  and vectorize without fast-math. A NaN's key lies beyond both infinities,
  so a block holding one is found from its statistics alone (`None`: the
  caller takes `keras_math`'s path, which propagates NaN as Keras does);
- a float32 value is rounded to bfloat16 as `ml_dtypes` does for every
  non-NaN (round to nearest, ties to even, on the bits);
- division, multiplication and comparisons are IEEE float32 operations,
  in Keras's order, with no fast-math flags (no reassociation or fused
  multiply-add); where Keras's steps are bfloat16 (`round_step`: ml_dtypes
  0.7 computes each element in float32 and rounds it to bfloat16,
  `keras_math.step_dtype`) each product or quotient is rounded so, in the
  same loop (an LLVM bitcast, `_jit.to_bf16`: int8 0.48 against 0.41 ns
  per element without it, int4 along rows 0.61 against 0.50); rounding
  to an integer is `(q + 1.5 * 2**23) - 1.5 * 2**23`,
  exact (ties to even) for `|q| <= 2**22`, after `q` is clamped to a range
  whose ends are integers outside the value range (clamping and rounding
  commute there, and Keras's final clip gives the same value);
- the values are taken only where every statistic is finite (so every
  element is: the caller checks), and written as Keras's `pack_int4` packs
  them (low nibble first, a lone last value packed with zero).

The kernels work on 2-D C-contiguous float32 blocks; the caller views its
blocks so, and keeps `keras_math` for any other dtype.
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Any

import numpy as np

from keras_hub_dist.quantize import keras_math as qm

__all__ = [
    "int4_stats", "int4_values", "int8_abs_max", "int8_abs_max_run", "int8_values", "int8_values_run",
    "prepare", "supported",
]

# Keys of the float32 infinities (see the module doc): a statistic beyond them is a NaN.
_KEY_NEG_INF = int(np.array([0xFF800000], np.uint32).view(np.int32)[0] ^ 0x7FFFFFFF)
_KEY_POS_INF = 0x7F800000
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def supported(block: np.ndarray, ndim: int = 2) -> bool:
    """Whether the kernels take `block` as it is (C-contiguous float32 of
    `ndim` axes)."""
    return block.dtype == np.float32 and block.ndim == ndim and block.flags.c_contiguous


def _floats(keys: np.ndarray) -> np.ndarray:
    """The float32 values of int32 keys (the key map is its own inverse)."""
    return (keys ^ ((keys >> 31) & 0x7FFFFFFF)).view(np.float32)


def _has_nan(low: np.ndarray, high: np.ndarray) -> bool:
    return bool(low.size) and (int(low.min()) < _KEY_NEG_INF or int(high.max()) > _KEY_POS_INF)


@functools.cache
def _kernels() -> Any:
    # Imported on first use: `_jit` imports Numba (0.5 s), which
    # only a quantized load needs.
    return importlib.import_module("keras_hub_dist.quantize._jit")


def prepare() -> None:
    """Readies the kernels in the background: Numba's import, its first
    dispatch and the cached machine code of every signature the loader
    calls (0.7 s in all, under Numba's compiler lock, which would otherwise
    hold up the first blocks); a quantized load's planning, which mostly
    waits on XLA compiles with the GIL released, runs meanwhile."""
    threading.Thread(target=_warm, name="keras_hub_dist-quantize-prepare", daemon=True).start()


def _warm() -> None:
    try:
        _kernels()
    except Exception:  # noqa: BLE001 - the load's own first call raises it, in its thread
        return
    x = np.zeros((4, 4), np.float32)
    for axis in (0, 1):
        low, _ = int4_stats(x, axis, 0, 2)
        for pack_axis in (0, 1):
            shape = (2, 4) if pack_axis == 0 else (4, 2)
            for out in (np.empty(shape, np.int8), np.empty((4, 4), np.int8)[: shape[0], : shape[1]]):
                int4_values(x, True, axis, 0, 2, np.ones_like(low), np.zeros_like(low), pack_axis, out)
        top = int8_abs_max(x, axis)
        for out in (np.empty((4, 4), np.int8), np.empty((4, 8), np.int8)[:, :4]):
            int8_values(x, True, top + 1, axis, out)


def _keys_down_columns(x: np.ndarray, first: int, block: int, groups: int) -> tuple[np.ndarray, np.ndarray]:
    low = np.full((groups, x.shape[1]), _INT32_MAX, np.int32)
    high = np.full((groups, x.shape[1]), _INT32_MIN, np.int32)
    _kernels().keys_down_columns(x.view(np.int32), first, block, low, high)
    return low, high


def int4_stats(x: np.ndarray, axis: int, first: int, block: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-group `(min, max)` of `x` (float32, 2-D, C-contiguous), as
    `keras_math.group_stats(x, axis, first, block)` gives them (float32);
    `None` if `x` holds a NaN."""
    touched = (first + x.shape[axis] - 1) // block - first // block + 1
    if axis == 1:
        low = np.empty((x.shape[0], touched), np.int32)
        high = np.empty_like(low)
        _kernels().group_keys_along_rows(x.view(np.int32), first, block, low, high)
    else:
        low, high = _keys_down_columns(x, first, block, touched)
    if _has_nan(low, high):
        return None
    return _floats(low), _floats(high)


def int8_abs_max(x: np.ndarray, axis: int) -> np.ndarray | None:
    """`keras_math.abs_max(x, (axis,))` of `x` (float32, 2-D,
    C-contiguous); `None` if `x` holds a NaN."""
    if axis == 0:
        low, high = _keys_down_columns(x, 0, max(1, x.shape[0]), 1)
    else:
        low = np.empty((x.shape[0], 1), np.int32)
        high = np.empty_like(low)
        _kernels().group_keys_along_rows(x.view(np.int32), 0, max(1, x.shape[1]), low, high)
    if _has_nan(low, high):
        return None
    return np.maximum(_floats(high), np.negative(_floats(low)))


def int4_values(
    x: np.ndarray, round_bf16: bool, axis: int, first: int, block: int,
    scale: np.ndarray, zero: np.ndarray, pack_axis: int, out: np.ndarray, round_step: bool = False,
) -> None:
    """`pack_int4(group_values(...), pack_axis)` of `x` (float32, 2-D,
    C-contiguous; rounded to bfloat16 first if `round_bf16`), into `out`
    (int8, packed shape, any strides). `scale` / `zero` (float32 or
    bfloat16, finite) are the groups' the block touches, shaped as
    `int4_stats` gives them; a block packed along axis 0 starts at an even
    row. `round_step`: each quotient rounded to bfloat16 (`group_values`'
    `step`)."""
    scale, zero = (np.ascontiguousarray(a, np.float32) for a in (scale, zero))  # as warmed; exact
    vmin, vmax = (np.float32(v) for v in qm.INT4_RANGE)
    _kernels().int4_values(
        x.view(np.uint32), round_bf16, round_step, axis, first, block, scale, zero, vmin, vmax, pack_axis, out
    )


def int8_values(
    x: np.ndarray, round_bf16: bool, scale: np.ndarray, axis: int, out: np.ndarray, round_step: bool = False
) -> None:
    """`keras_math.int8_values(x, scale)` of `x` (float32, 2-D,
    C-contiguous; rounded to bfloat16 first if `round_bf16`) whose float32
    or bfloat16 `scale` (finite) reduces `axis` (one per column for 0, per
    row for 1), into `out` (int8, any strides). `round_step`: each product
    rounded to bfloat16 (`int8_values`' `step`)."""
    scale = np.ascontiguousarray(scale, np.float32).reshape(-1)  # as warmed; exact
    lo, hi = (np.float32(v) for v in qm.INT8_RANGE)
    _kernels().int8_values(x.view(np.uint32), round_bf16, round_step, scale, axis == 0, lo, hi, out)


def int8_abs_max_run(x: np.ndarray) -> np.ndarray | None:
    """`keras_math.abs_max(x, (1,))` of `x` (float32, 3-D: the axes
    before the reduced run, the run, the axes after it; C-contiguous),
    keepdims; `None` if `x` holds a NaN."""
    a, b, c = x.shape
    if c == 1:  # reduced axes trail (an embedding table: per row)
        top = int8_abs_max(x.reshape(a, b), 1)
        return None if top is None else top.reshape(a, 1, 1)
    tops = []
    for matrix in x:  # e.g. an attention kernel (heads, hidden, head_dim)
        top = int8_abs_max(matrix, 0)
        if top is None:
            return None
        tops.append(top)
    return np.stack(tops)


def int8_values_run(
    x: np.ndarray, round_bf16: bool, scale: np.ndarray, out: np.ndarray, round_step: bool = False
) -> None:
    """`int8_values` of `x` as `int8_abs_max_run` takes it, for its keepdims
    `scale`, into `out` (int8, `x`'s shape, any strides)."""
    a, b, c = x.shape
    if c == 1:
        int8_values(x.reshape(a, b), round_bf16, scale.reshape(a), 1, out[:, :, 0], round_step)
        return
    for i in range(a):
        int8_values(x[i], round_bf16, scale[i], 0, out[i], round_step)
