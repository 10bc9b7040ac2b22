"""The compiled loops of `kernels` (see there: what each computes
and why it is Keras's to the bit).

Numba compiles them on first use and caches the machine code next to this
module (or in the user's cache when that is read-only): each is defined at
module level with its constants as module globals, which is what lets
Numba's cache find them again in a new process. Importing this module
imports Numba (0.5 s), so `kernels` imports it only when a load
quantizes.
"""

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

_jit = numba.njit(nogil=True, cache=True, error_model="numpy")

_I31, _M31, _I15, _I4 = np.int32(31), np.int32(0x7FFFFFFF), np.int32(15), np.int32(4)
_U16, _HALF, _KEEP, _ONE = np.uint32(16), np.uint32(0x7FFF), np.uint32(0xFFFF0000), np.uint32(1)
_MAGIC = np.float32(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds to an integer
_INT32_MIN, _INT32_MAX = np.int32(-(2**31)), np.int32(2**31 - 1)


@_jit
def row_floats(bits, round_bf16, out_bits):
    """A row of float32 bits, rounded to bfloat16 if asked, into `out_bits`."""
    if round_bf16:
        for j in range(bits.shape[0]):
            u = bits[j]
            out_bits[j] = np.uint32(np.uint32(u + _HALF + np.uint32((u >> _U16) & _ONE)) & _KEEP)
    else:
        for j in range(bits.shape[0]):
            out_bits[j] = bits[j]


@intrinsic
def _bits_of(typingctx, x):
    """A float32's bits as uint32 (an LLVM bitcast: free, and it keeps the
    loop it is in vectorized, where a pass through a uint32 view of
    memory is a loop of its own)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@intrinsic
def _float_of(typingctx, u):
    """The float32 of uint32 bits (`_bits_of`'s inverse)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@_jit
def to_bf16(y):
    """A float32 rounded to bfloat16 (ties to even, on the bits; finite or
    infinite `y`), as a float32."""
    u = _bits_of(y)
    return _float_of(np.uint32(np.uint32(u + _HALF + np.uint32((u >> _U16) & _ONE)) & _KEEP))


@_jit
def group_keys_along_rows(keys, first, block, low, high):
    """Per (row, group of `block` columns) min / max keys; column 0 is
    global column `first`."""
    rows, cols = keys.shape
    g0 = first // block
    for i in range(rows):
        c = 0
        while c < cols:
            g = (first + c) // block
            end = min(cols, (g + 1) * block - first)
            lo, hi = _INT32_MAX, _INT32_MIN
            seg = keys[i, c:end]
            for j in range(seg.shape[0]):
                k = seg[j]
                k = k ^ ((k >> _I31) & _M31)
                lo, hi = min(lo, k), max(hi, k)
            low[i, g - g0], high[i, g - g0] = lo, hi
            c = end


@_jit
def keys_down_columns(keys, first, block, low, high):
    """Per (group of `block` rows, column) min / max keys (`low` /
    `high` start at the extremes); row 0 is global row `first`. With
    `block` past the rows: one group, each column's over all rows."""
    rows, cols = keys.shape
    g0 = first // block
    for i in range(rows):
        g = (first + i) // block - g0
        row, lo, hi = keys[i], low[g], high[g]
        for j in range(cols):
            k = row[j]
            k = k ^ ((k >> _I31) & _M31)
            lo[j], hi[j] = min(lo[j], k), max(hi[j], k)


@_jit
def int4_from_quotient(q, z, vmin, vmax):
    """`q = x / scale`, rounded, plus the zero point, clipped to `vmin..vmax`.
    `q` is first clamped to +-(vmax - vmin + 1): integers past any value
    that can land inside the range once a zero point in it is added."""
    bound = vmax - vmin + np.float32(1.0)
    q = -bound if q < -bound else q
    q = bound if q > bound else q
    v = ((q + _MAGIC) - _MAGIC) + z
    v = vmin if v < vmin else v
    v = vmax if v > vmax else v
    return np.int32(v)


@_jit
def int4_row(x, round_step, g_scale, g_zero, per_column, first, block, vmin, vmax, out):
    """One row's int4 values (int32): scales per column (`per_column`:
    the row's group's) or per group of `block` columns of the row; with
    `round_step` each quotient rounded to bfloat16 first (a loop of its
    own, so that neither tests it per element)."""
    cols = x.shape[0]
    if per_column:
        if round_step:
            for j in range(cols):
                out[j] = int4_from_quotient(to_bf16(x[j] / g_scale[j]), g_zero[j], vmin, vmax)
        else:
            for j in range(cols):
                out[j] = int4_from_quotient(x[j] / g_scale[j], g_zero[j], vmin, vmax)
        return
    c = 0
    while c < cols:
        g = (first + c) // block
        end = min(cols, (g + 1) * block - first)
        s, z = g_scale[g - first // block], g_zero[g - first // block]
        xs, outs = x[c:end], out[c:end]  # from 0: LLVM vectorizes this loop
        if round_step:
            for j in range(xs.shape[0]):
                outs[j] = int4_from_quotient(to_bf16(xs[j] / s), z, vmin, vmax)
        else:
            for j in range(xs.shape[0]):
                outs[j] = int4_from_quotient(xs[j] / s, z, vmin, vmax)
        c = end


@_jit
def int4_values(bits, round_bf16, round_step, group_axis, first, block, scale, zero, vmin, vmax, pack_axis, out):
    """The int4 values of a block (bits of float32, rounded to bfloat16 if
    asked; quotients rounded to bfloat16 if `round_step`), packed two per
    byte along `pack_axis` into `out`."""
    rows, cols = bits.shape
    buf = np.empty(cols, np.uint32)
    x = buf.view(np.float32)
    cur = np.empty(cols, np.int32)
    prev = np.zeros(cols, np.int32)
    g0 = first // block
    for i in range(rows):
        row_floats(bits[i], round_bf16, buf)
        if group_axis == 0:
            g = (first + i) // block - g0
            int4_row(x, round_step, scale[g], zero[g], True, 0, block, vmin, vmax, cur)
        else:
            int4_row(x, round_step, scale[i], zero[i], False, first, block, vmin, vmax, cur)
        if pack_axis == 1:
            dst = out[i]
            for j in range(cols // 2):
                dst[j] = np.int8((cur[2 * j] & _I15) | ((cur[2 * j + 1] & _I15) << _I4))
            if cols % 2:
                dst[cols // 2] = np.int8(cur[cols - 1] & _I15)
        elif i % 2 == 0:
            prev, cur = cur, prev
        else:
            dst = out[i // 2]
            for j in range(cols):
                dst[j] = np.int8((prev[j] & _I15) | ((cur[j] & _I15) << _I4))
    if pack_axis == 0 and rows % 2:
        dst = out[rows // 2]
        for j in range(cols):
            dst[j] = np.int8(prev[j] & _I15)


@_jit
def int8_from_product(y, lo, hi):
    """`rint(y)` clipped to `lo..hi`, as int8."""
    y = lo if y < lo else y
    y = hi if y > hi else y
    return np.int8((y + _MAGIC) - _MAGIC)


@_jit
def int8_values(bits, round_bf16, round_step, scale, per_column, lo, hi, out):
    """`rint(x * scale)` clipped to `lo..hi` (`per_column`: scale per
    column, else per row); clipping first is the same (integer ends). With
    `round_step` each product is rounded to bfloat16 first."""
    rows, cols = bits.shape
    buf = np.empty(cols, np.uint32)
    x = buf.view(np.float32)
    for i in range(rows):
        row_floats(bits[i], round_bf16, buf)
        dst = out[i]
        if per_column:
            if round_step:
                for j in range(cols):
                    dst[j] = int8_from_product(to_bf16(x[j] * scale[j]), lo, hi)
            else:
                for j in range(cols):
                    dst[j] = int8_from_product(x[j] * scale[j], lo, hi)
        else:
            s = scale[i]
            if round_step:
                for j in range(cols):
                    dst[j] = int8_from_product(to_bf16(x[j] * s), lo, hi)
            else:
                for j in range(cols):
                    dst[j] = int8_from_product(x[j] * s, lo, hi)
