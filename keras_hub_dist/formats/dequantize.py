"""Pre-quantized Linear weights (FP8, packed int4), dequantized block by block.

A quantized Linear weight `W` `(out, in)` of a Hugging Face checkpoint is
stored as codes and per-block parameters: every value of `W` depends only on
its own code and its group's scale (and zero point). So any box `[o0:o1,
i0:i1]` of `W` is computed from the codes of that box and the few scales
covering it, never the whole tensor:

- `Fp8Source`: e4m3 codes times a float32 scale per tensor, per output
  channel or per `(block_out, block_in)` block (native `quant_method: "fp8"`'s
  `weight_scale_inv`, compressed-tensors' `weight_scale`): `w = float32(code)
  * scale`, the product the writers' readers compute in float32;
- `Int4Source`: 4-bit codes `q`, group scales `s` and zero points `z` along
  the input axis: `w = (q - z) * s`, in the convention of Keras's int4 layers
  (`q`, `z` signed, `q` in [-8, 7]). Its subclasses read compressed-tensors
  `pack-quantized` (`weight_packed` int32 `(out, in / 8)`, eight values per
  int32 along the input, stored `q + 8`; `weight_zero_point` packed along the
  output), GPTQ (`qweight` `(in / 8, out)` packed along the input, `qzeros`
  storing `z - 1`, `g_idx`) and AWQ GEMM (`qweight` `(in, out / 8)`, nibble
  order 0, 2, 4, 6, 1, 3, 5, 7, `qzeros` storing `z`).

KerasHub's converters reshape and transpose `W` (heads split out of `out`):
`reshaped(shape)` gives the same source seen with another C-order shape
(`transforms.reshape` asks it), read by mapping each block back to the rows
and columns of `W` it covers. The int4 sources also give their codes, scales,
zero points and group index as they are (`codes`, `group_scales`, ...), which
`quantize.prequantized` places in Keras's int4 variables, 4 bits a weight.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Sequence

import numpy as np

from keras_hub_dist.formats.base import Index, StoredTensor, TensorSource
from keras_hub_dist.storage import host_io

__all__ = [
    "AwqSource",
    "CompressedInt4Source",
    "DequantizedSource",
    "Fp8Source",
    "GptqSource",
    "Int4Source",
    "unpack_int32",
]

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: np.ndarray, axis: int, order: Sequence[int] = range(8)) -> np.ndarray:
    """The eight 4-bit fields of each int32 (lowest first, or in `order`:
    field `k` holds value `order[k]` of the eight), unsigned, as int8,
    along `axis` (which grows eight times).

    Byte-wise: the int32s are little-endian, so byte `b` of one holds fields
    `2b` (low nibble) and `2b + 1` (high); two passes over bytes, no shifts
    of 32-bit words."""
    words = np.ascontiguousarray(np.moveaxis(np.asarray(packed), axis, -1)).astype("<i4", copy=False)
    octets = words.view(np.uint8)
    fields = np.empty(words.shape[:-1] + (words.shape[-1] * 8,), np.uint8)
    np.bitwise_and(octets, np.uint8(0x0F), out=fields[..., 0::2])
    np.right_shift(octets, np.uint8(4), out=fields[..., 1::2])
    if tuple(order) != tuple(range(8)):
        grouped = fields.reshape(words.shape + (8,))
        reordered = np.empty_like(grouped)
        reordered[..., list(order)] = grouped
        fields = reordered.reshape(fields.shape)
    return np.moveaxis(fields.view(np.int8), -1, axis)


def _groups(shape: Sequence[int], base: Sequence[int]) -> tuple[list[int], list[int]] | None:
    """The axes of `shape` a C-order reshape splits the base's out and in
    axes into (size-1 axes in neither); `None` where it merges them."""
    out, inner = [], []
    size, target = 1, base[0]
    for axis, d in enumerate(shape):
        if d == 1:
            continue
        if size < target:
            out.append(axis)
            size *= d
        else:
            inner.append(axis)
    if size != base[0] or math.prod(shape[a] for a in inner) != base[1]:
        return None
    return out, inner


def _positions(index: Index, shape: Sequence[int], axes: Sequence[int]) -> np.ndarray:
    """The flat positions (C order over `axes`) of the block's elements
    along those axes."""
    pos = np.zeros((1,), np.int64)
    for axis in axes:
        a, b = index[axis]
        pos = (pos[:, None] * shape[axis] + np.arange(a, b)[None, :]).reshape(-1)
    return pos


class DequantizedSource(TensorSource):
    """A dequantized `(out, in)` weight, seen with any C-order shape of the
    same size that keeps out and in apart; subclasses compute boxes of it.

    Attributes:
        base: `(out, in)`.
        name: The stored weight's name, for messages.
    """

    base: tuple[int, int]
    name: str

    def box(self, o0: int, o1: int, i0: int, i1: int) -> np.ndarray:
        """`W[o0:o1, i0:i1]`, float32, in fresh aligned memory."""
        raise NotImplementedError

    def box_nbytes(self, o0: int, o1: int, i0: int, i1: int) -> int:
        raise NotImplementedError

    def reshaped(self, shape: Sequence[int]) -> DequantizedSource | None:
        """The same values with a C-order `shape` (`None`: one that merges
        out and in, which no converter does)."""
        shape = tuple(int(d) for d in shape)
        if _groups(shape, self.base) is None:
            return None
        view = copy.copy(self)
        view.shape = shape
        return view

    def _spans(self, index: Index) -> tuple[np.ndarray, np.ndarray]:
        if len(self.shape) == 2 and tuple(self.shape) == self.base:
            (o0, o1), (i0, i1) = index
            return np.arange(o0, o1), np.arange(i0, i1)
        out_axes, in_axes = _groups(self.shape, self.base)
        return _positions(index, self.shape, out_axes), _positions(index, self.shape, in_axes)

    def read(self, index: Index) -> np.ndarray:
        rows, cols = self._spans(index)
        block_shape = tuple(b - a for a, b in index)
        if rows.size == 0 or cols.size == 0:
            return host_io.aligned_empty(block_shape, np.dtype(np.float32))
        o0, o1, i0, i1 = int(rows.min()), int(rows.max()) + 1, int(cols.min()), int(cols.max()) + 1
        if rows.size == o1 - o0 and cols.size == i1 - i0:
            return self.box(o0, o1, i0, i1).reshape(block_shape)  # fresh, aligned
        # Rows in runs (a block cut across heads): each run's box alone, so
        # the host never holds much more than the block.
        out = host_io.aligned_empty(block_shape, np.dtype(np.float32))
        flat = out.reshape(rows.size, cols.size)
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1
        for start, stop in zip(np.r_[0, breaks], np.r_[breaks, rows.size]):
            r0 = int(rows[start])
            run = self.box(r0, r0 + int(stop - start), i0, i1)
            flat[start:stop] = run if cols.size == i1 - i0 else run[:, cols - i0]
        return out

    def read_nbytes(self, index: Index) -> int:
        rows, cols = self._spans(index)
        if rows.size == 0 or cols.size == 0:
            return 0
        return self.box_nbytes(int(rows.min()), int(rows.max()) + 1, int(cols.min()), int(cols.max()) + 1)

    def union_read_helps(self, indices: Sequence[Index]) -> bool:
        return False


def _box(stored: StoredTensor, *ranges: tuple[int, int]) -> np.ndarray:
    return stored.read(tuple(ranges))


@functools.cache
def _float8_values(dtype: np.dtype) -> np.ndarray:
    """float32 value of each of the 256 codes of an 8-bit float dtype."""
    return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def _float32(codes: np.ndarray) -> np.ndarray:
    """`codes` as float32, in fresh aligned memory (one pass; 8-bit floats
    by a table of their 256 values, the same bits as a cast at a third of
    its CPU time)."""
    out = host_io.aligned_empty(codes.shape, np.dtype(np.float32))
    if codes.dtype.itemsize == 1 and codes.dtype.kind not in "iub":
        np.take(_float8_values(codes.dtype), codes.view(np.uint8), out=out, mode="clip")
    else:
        np.copyto(out, codes, casting="unsafe")
    return out


class Fp8Source(DequantizedSource):
    """`float32(weight) * scale`, the scale per tensor, per output channel or
    per `block` of `(rows, cols)`.

    Args:
        weight: e4m3 (or e5m2) `(out, in)`.
        scale: float `(1,)` / `()` per tensor, `(out, 1)` per channel, or
            `(ceil(out / rows), ceil(in / cols))` per block.
        block: `(rows, cols)` for block scales, else `None`.
        name: The weight's name, for messages.
    """

    def __init__(self, weight: StoredTensor, scale: StoredTensor, block: tuple[int, int] | None, name: str) -> None:
        self.weight, self.scale, self.block, self.name = weight, scale, block, name
        self.base = (int(weight.shape[0]), int(weight.shape[1]))
        self.shape = self.base
        self.dtype = np.dtype(np.float32)
        self.description = f"FP8 tensor {name!r} of {weight.file!r}"

    def _scale_box(self, o0: int, o1: int, i0: int, i1: int) -> tuple[tuple[int, int], ...]:
        """The block of the scale tensor covering `W[o0:o1, i0:i1]` (`()`:
        one scale for the tensor)."""
        if math.prod(self.scale.shape) == 1:
            return ()
        if self.block is None:  # per channel: (out, 1) or (out,)
            return ((o0, o1),) + ((0, 1),) * (len(self.scale.shape) - 1)
        rows, cols = self.block
        return ((o0 // rows, -(-o1 // rows)), (i0 // cols, -(-i1 // cols)))

    def box(self, o0: int, o1: int, i0: int, i1: int) -> np.ndarray:
        values = _float32(_box(self.weight, (o0, o1), (i0, i1)))
        ranges = self._scale_box(o0, o1, i0, i1)
        if not ranges:
            scale = self.scale.read(tuple((0, d) for d in self.scale.shape)).astype(np.float32).reshape(())
            values *= scale
            return values
        scale = self.scale.read(ranges).astype(np.float32)
        if self.block is None:
            values *= scale.reshape(-1, 1)
            return values
        # One block row at a time: the scales expand along the columns only
        # (never a second box-sized array on the host).
        rows, cols = self.block
        (g0, g1), (h0, _) = ranges
        for g in range(g0, g1):
            r0, r1 = max(o0, g * rows) - o0, min(o1, (g + 1) * rows) - o0
            line = np.repeat(scale[g - g0], cols)[i0 - h0 * cols : i1 - h0 * cols]
            values[r0:r1] *= line
        return values

    def box_nbytes(self, o0: int, o1: int, i0: int, i1: int) -> int:
        ranges = self._scale_box(o0, o1, i0, i1)
        scale = self.scale.nbytes if not ranges else self.scale.block_runs(ranges).nbytes
        return self.weight.block_runs(((o0, o1), (i0, i1))).nbytes + scale


class Int4Source(DequantizedSource):
    """`(q - z) * s` of 4-bit codes in groups along the input axis.

    Subclasses read their format's tensors into Keras's convention: `codes`
    (signed int8 in [-8, 7], `(out, in)` boxes), `group_scales` and
    `group_zeros` (`(out, groups)` boxes; zeros signed int8) and
    `group_index` (each input row's group).

    Attributes:
        group_size: Input rows per group.
        num_groups: Groups along the input axis.
    """

    group_size: int
    num_groups: int
    scales: StoredTensor
    g_idx: StoredTensor | None = None

    def _setup(self, out: int, inner: int, group_size: int, name: str, file: str) -> None:
        self.base = (int(out), int(inner))
        self.shape = self.base
        self.dtype = np.dtype(np.float32)
        self.group_size = int(group_size)
        self.num_groups = -(-int(inner) // self.group_size)
        self.name = name
        self.description = f"int4 tensor {name!r} of {file!r}"

    def codes(self, o0: int, o1: int, i0: int, i1: int) -> np.ndarray:
        raise NotImplementedError

    def group_scales(self, o0: int, o1: int, g0: int, g1: int) -> np.ndarray:
        raise NotImplementedError

    def group_zeros(self, o0: int, o1: int, g0: int, g1: int) -> np.ndarray:
        raise NotImplementedError

    def group_index(self, i0: int, i1: int) -> np.ndarray:
        """Group of each input row `i0:i1`, int64."""
        if self.g_idx is None:
            return np.arange(i0, i1, dtype=np.int64) // self.group_size
        return self.g_idx.read(((i0, i1),)).astype(np.int64)

    def box(self, o0: int, o1: int, i0: int, i1: int) -> np.ndarray:
        groups = self.group_index(i0, i1)
        g0, g1 = int(groups.min()), int(groups.max()) + 1
        scale = self.group_scales(o0, o1, g0, g1).astype(np.float32)
        zero = self.group_zeros(o0, o1, g0, g1).astype(np.float32)
        values = _float32(self.codes(o0, o1, i0, i1))
        if self.g_idx is None:  # contiguous groups: one column range each
            for g in range(g0, g1):
                c0, c1 = max(i0, g * self.group_size) - i0, min(i1, (g + 1) * self.group_size) - i0
                values[:, c0:c1] -= zero[:, g - g0 : g - g0 + 1]
                values[:, c0:c1] *= scale[:, g - g0 : g - g0 + 1]
            return values
        values -= zero[:, groups - g0]
        values *= scale[:, groups - g0]
        return values

    def box_nbytes(self, o0: int, o1: int, i0: int, i1: int) -> int:
        # Codes at half a byte each, and the scales / zeros of the groups.
        g0, g1 = (i0 // self.group_size, -(-i1 // self.group_size)) if self.g_idx is None else (0, self.num_groups)
        return (o1 - o0) * (i1 - i0) // 2 + (o1 - o0) * (g1 - g0) * (self.scales.dtype.itemsize + 1)


class CompressedInt4Source(Int4Source):
    """compressed-tensors `pack-quantized` 4-bit weights.

    Args:
        packed: `weight_packed` int32 `(out, in / 8)`, stored `q + 8`.
        scale: `weight_scale` `(out, groups)`.
        zero: `weight_zero_point` int32 `(out / 8, groups)`, packed along
            the output axis, stored `z + 8` (or, as older writers store it,
            `z` unpacked `(out, groups)`); `None` for symmetric.
        g_idx: `weight_g_idx` `(in,)` (activation order), or `None`.
        group_size: From the config.
        name: The module's weight name, for messages.
    """

    def __init__(self, packed: StoredTensor, scale: StoredTensor, zero: StoredTensor | None,
                 g_idx: StoredTensor | None, inner: int, group_size: int, name: str) -> None:
        self.packed, self.scales, self.zeros, self.g_idx = packed, scale, zero, g_idx
        self._setup(packed.shape[0], inner, group_size, name, packed.file)

    def codes(self, o0: int, o1: int, i0: int, i1: int) -> np.ndarray:
        p0, p1 = i0 // 8, -(-i1 // 8)
        fields = unpack_int32(_box(self.packed, (o0, o1), (p0, p1)), axis=1)
        values = fields[:, i0 - 8 * p0 : i1 - 8 * p0]
        values -= 8
        return values

    def group_scales(self, o0: int, o1: int, g0: int, g1: int) -> np.ndarray:
        return _box(self.scales, (o0, o1), (g0, g1))

    def group_zeros(self, o0: int, o1: int, g0: int, g1: int) -> np.ndarray:
        if self.zeros is None:
            return np.zeros((o1 - o0, g1 - g0), np.int8)
        if self.zeros.shape[0] == self.base[0] > 1:  # unpacked
            return _box(self.zeros, (o0, o1), (g0, g1)).astype(np.int8)
        r0, r1 = o0 // 8, -(-o1 // 8)
        fields = unpack_int32(_box(self.zeros, (r0, r1), (g0, g1)), axis=0)
        values = fields[o0 - 8 * r0 : o1 - 8 * r0]
        values -= 8
        return values


class GptqSource(Int4Source):
    """GPTQ 4-bit weights (`format: gptq`): `qweight` int32 `(in / 8, out)`
    packed along the input, `qzeros` int32 `(groups, out / 8)` storing
    `z - 1`, `scales` `(groups, out)`, `g_idx` `(in,)` (desc_act)."""

    def __init__(self, qweight: StoredTensor, qzeros: StoredTensor, scales: StoredTensor,
                 g_idx: StoredTensor | None, group_size: int, name: str, zero_offset: int = 1) -> None:
        self.qweight, self.qzeros, self.scales, self.g_idx = qweight, qzeros, scales, g_idx
        self.zero_offset = zero_offset
        self._setup(qweight.shape[1], qweight.shape[0] * 8, group_size, name, qweight.file)

    def codes(self, o0: int, o1: int, i0: int, i1: int) -> np.ndarray:
        p0, p1 = i0 // 8, -(-i1 // 8)
        fields = unpack_int32(_box(self.qweight, (p0, p1), (o0, o1)), axis=0)
        values = np.ascontiguousarray(fields[i0 - 8 * p0 : i1 - 8 * p0].T)
        values -= 8
        return values

    def group_scales(self, o0: int, o1: int, g0: int, g1: int) -> np.ndarray:
        return np.ascontiguousarray(_box(self.scales, (g0, g1), (o0, o1)).T)

    def group_zeros(self, o0: int, o1: int, g0: int, g1: int) -> np.ndarray:
        r0, r1 = o0 // 8, -(-o1 // 8)
        fields = unpack_int32(_box(self.qzeros, (g0, g1), (r0, r1)), axis=1, order=self._order())
        values = np.ascontiguousarray(fields[:, o0 - 8 * r0 : o1 - 8 * r0].T)
        values += self.zero_offset - 8
        return values

    def _order(self) -> Sequence[int]:
        return range(8)


class AwqSource(GptqSource):
    """AWQ GEMM 4-bit weights: `qweight` int32 `(in, out / 8)` and `qzeros`
    `(groups, out / 8)` packed along the output in the order 0, 2, 4, 6, 1,
    3, 5, 7, storing `z`; `scales` `(groups, out)`."""

    def __init__(self, qweight: StoredTensor, qzeros: StoredTensor, scales: StoredTensor,
                 group_size: int, name: str) -> None:
        self.qweight, self.qzeros, self.scales, self.g_idx = qweight, qzeros, scales, None
        self.zero_offset = 0
        self._setup(qweight.shape[1] * 8, qweight.shape[0], group_size, name, qweight.file)

    def _order(self) -> Sequence[int]:
        return _AWQ_ORDER

    def codes(self, o0: int, o1: int, i0: int, i1: int) -> np.ndarray:
        r0, r1 = o0 // 8, -(-o1 // 8)
        fields = unpack_int32(_box(self.qweight, (i0, i1), (r0, r1)), axis=1, order=_AWQ_ORDER)
        values = np.ascontiguousarray(fields[:, o0 - 8 * r0 : o1 - 8 * r0].T)
        values -= 8
        return values
