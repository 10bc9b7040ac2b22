"""Keras's int8 / int4 quantization on the host, block by block, bitwise.

Every check compares with Keras's own functions (`abs_max_quantize`,
`abs_max_quantize_grouped_with_zero_point`, `pack_int4`) on whole arrays:
random values, ties at .5 (round half to even), zero columns, rows that
are not a multiple of the group, bfloat16 inputs (whose scales and
products NumPy computes in the dtypes its promotion gives, as in Keras:
`keras_math.step_dtype`).
"""

import itertools

import keras
import ml_dtypes
import numpy as np
import pytest

from keras_hub_dist import _processes
from keras_hub_dist.quantize import quantizer as fq
from keras_hub_dist.quantize import keras_math as qm
from keras_hub_dist.formats import transforms
from keras_hub_dist.quantize.combine import combine_statistics
from keras_hub_dist.quantize.flat_reshape import FlatReshape, blockwise_reshape, flat_boxes
from keras_hub_dist.plan.quantization import Int4Rule, Int8Rule, QuantizedTensor

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def _values(rows: int, cols: int, dtype) -> np.ndarray:
    """Random values, a column of ties (scale 1: max 127, halves), a zero
    column and a column whose groups span exactly 15 (int4 scale 1)."""
    rng = np.random.default_rng(rows * 1000 + cols)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[:, 0] = np.resize([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5], rows)
    x[:, 1] = 0.0
    x[:, 2] = np.resize([7.5, -7.5, 2.5, -3.5, 0.5], rows)
    return x.astype(dtype)


def _splits(n: int, parts: int) -> list[tuple[int, int]]:
    edges = np.linspace(0, n, parts + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:]) if b > a]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows_parts", [1, 3])
def test_int8_from_partial_maxima_equals_keras(dtype, rows_parts):
    x = _values(50, 12, DTYPES[dtype])
    values, scale = keras.quantizers.abs_max_quantize(x, axis=0, to_numpy=True)
    # The maximum of a split axis, combined with np.maximum.
    top = None
    for a, b in _splits(50, rows_parts):
        part = qm.abs_max(x[a:b], (0,))
        top = part if top is None else np.maximum(top, part)
    ours_scale = qm.int8_scale(top)
    assert ours_scale.astype(DTYPES[dtype]).tobytes() == np.asarray(scale).tobytes()
    for a, b in _splits(50, rows_parts):
        assert qm.int8_values(x[a:b], ours_scale).tobytes() == np.asarray(values)[a:b].tobytes()
    assert (np.asarray(values)[:, 0][:4] == [127, 2, -4, 0]).all()  # half to even


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows", [256, 300, 100])  # whole groups, a padded tail, one padded group
def test_int4_groups_from_any_row_split_equal_keras(dtype, rows):
    x = _values(rows, 10, DTYPES[dtype])
    values, scale, zero = keras.quantizers.abs_max_quantize_grouped_with_zero_point(
        x, block_size=128, to_numpy=True
    )
    uneven = [(a, min(b, rows)) for a, b in [(0, 5), (5, 130), (130, rows)] if a < rows]
    for splits in (_splits(rows, 1), _splits(rows, 3), uneven):
        low = high = None
        for a, b in splits:
            lo, hi = qm.group_stats(x[a:b], 0, a, 128)
            first = a // 128
            pad = ((first, -(-rows // 128) - first - lo.shape[0]), (0, 0))
            lo = np.pad(lo.astype(np.float32), pad, constant_values=np.inf).astype(x.dtype)
            hi = np.pad(hi.astype(np.float32), pad, constant_values=-np.inf).astype(x.dtype)
            low = lo if low is None else np.minimum(low, lo)
            high = hi if high is None else np.maximum(high, hi)
        low, high = qm.finish_group_stats(low, high, 0, 0, rows, 128)
        s, z = qm.group_params(low, high)
        assert s.astype(DTYPES[dtype]).tobytes() == np.asarray(scale).tobytes()
        assert z.astype("int8").tobytes() == np.asarray(zero).tobytes()
        for a, b in splits:
            first = a // 128
            last = -(-b // 128)
            ours = qm.group_values(x[a:b], 0, a, 128, s[first:last], z[first:last])
            assert ours.tobytes() == np.asarray(values)[a:b].tobytes()


def test_int4_groups_along_axis_1_equal_keras_on_the_transpose():
    # An embedding table is quantized as its transpose (groups along its
    # output axis): the same statistics along axis 1 give the same bits.
    x = _values(140, 9, np.float32).T.copy()  # (9, 140)
    values_t, scale_t, zero_t = keras.quantizers.abs_max_quantize_grouped_with_zero_point(
        x.T, block_size=128, to_numpy=True
    )
    low, high = qm.group_stats(x, 1, 0, 128)
    low, high = qm.finish_group_stats(low, high, 1, 0, 140, 128)
    s, z = qm.group_params(low, high)
    assert s.tobytes() == np.asarray(scale_t).T.copy().tobytes()
    assert qm.group_values(x, 1, 0, 128, s, z).tobytes() == np.asarray(values_t).T.copy().tobytes()
    # The same statistics from column blocks that cut the first group
    # (`reduceat` at each block's own group starts), combined.
    parts = [qm.group_stats(x[:, a:b], 1, a, 128) for a, b in [(0, 5), (5, 130), (130, 140)]]
    low_split = np.concatenate([np.minimum(parts[0][0], parts[1][0][:, :1]), np.minimum(parts[1][0][:, 1:], parts[2][0])], axis=1)
    high_split = np.concatenate([np.maximum(parts[0][1], parts[1][1][:, :1]), np.maximum(parts[1][1][:, 1:], parts[2][1])], axis=1)
    assert [a.shape for a, _ in parts] == [(9, 1), (9, 2), (9, 1)]
    whole = qm.group_stats(x, 1, 0, 128)
    assert low_split.tobytes() == whole[0].tobytes() and high_split.tobytes() == whole[1].tobytes()


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("length", [6, 7])
def test_pack_int4_equals_keras(axis, length):
    rng = np.random.default_rng(length)
    shape = [5, 5]
    shape[axis] = length
    x = rng.integers(-8, 8, size=shape).astype(np.int8)
    packed, _, _ = keras.quantizers.pack_int4(x, axis=axis)
    assert qm.pack_int4(x, axis).tobytes() == np.asarray(packed).tobytes()


def test_flat_reshape_reads_only_its_blocks():
    rng = np.random.default_rng(0)
    stored = rng.standard_normal((4, 6, 5)).astype(np.float32)  # e.g. (heads, head_dim, hidden)
    source = transforms.Transpose(transforms.Constant(stored), (0, 2, 1))  # (4, 5, 6)
    whole = np.transpose(stored, (0, 2, 1)).reshape(5, 24)  # Gemma's scrambled (hidden, heads*head_dim)
    reshaped = blockwise_reshape(source, (5, 24))
    assert isinstance(reshaped, FlatReshape)
    for rows, cols in itertools.product(_splits(5, 2), _splits(24, 3)):
        index = (rows, cols)
        np.testing.assert_array_equal(reshaped.read(index), whole[rows[0]:rows[1], cols[0]:cols[1]])
    boxes = flat_boxes((4, 5, 6), 7, 53)
    covered = sum(np.prod([b - a for a, b in box]) for box in boxes)
    assert covered == 46 and len(boxes) <= 5


def _tensor(rule, shape, scale_shape) -> QuantizedTensor:
    class V:
        def __init__(self, path, shape):
            self.path, self.shape = path, shape

    return QuantizedTensor("l", "int8" if isinstance(rule, Int8Rule) else "int4", "l/kernel",
                           shape, rule, V("l/kernel", shape), V("l/kernel_scale", scale_shape))


def _keras_quantized(mode: str, x: np.ndarray, pack_axis: int):
    """`(rule, scale shape, [values, scale])` of Keras's own quantization of
    a 2-D `x` (int8 per column; int4 in groups of 128 rows)."""
    rows, cols = x.shape
    if mode == "int8":
        values, scale = keras.quantizers.abs_max_quantize(x, axis=0, to_numpy=True)
        return Int8Rule((0,), (1,)), (cols,), [np.asarray(values), np.asarray(scale).reshape(cols)]
    values, scale, _ = keras.quantizers.abs_max_quantize_grouped_with_zero_point(x, block_size=128, to_numpy=True)
    packed = np.asarray(keras.quantizers.pack_int4(values, axis=pack_axis)[0])
    return Int4Rule((rows, cols), 0, pack_axis, 128), (-(-rows // 128), cols), [packed, np.asarray(scale)]


@pytest.mark.parametrize("slab_bytes", [fq.SLAB_BYTES, 200])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_statistics_combined_across_processes(mode, slab_bytes, monkeypatch):
    # Rows split between two "processes": each reduces its own blocks, the
    # collective takes the maximum of the vectors; the result is Keras's.
    # With 200-byte slabs every block is read and quantized in pieces.
    monkeypatch.setattr(fq, "SLAB_BYTES", slab_bytes)
    x = _values(260, 8, np.float32)
    rule, scale_shape, expected = _keras_quantized(mode, x, pack_axis=1)
    tensor = _tensor(rule, (260, 8), scale_shape)
    shape = fq.TensorQuantizer(tensor, transforms.Constant(x), "float32").values_source().shape
    mine = [((0, 100), (0, shape[1])), ((100, 150), (0, shape[1]))]
    theirs = [((150, 260), (0, shape[1]))]
    other = fq.TensorQuantizer(tensor, transforms.Constant(x), "float32")
    gathered = {}
    monkeypatch.setattr(_processes, "max_over_processes", lambda v: gathered.setdefault("v", v))
    combine_statistics([(other, theirs)])
    monkeypatch.setattr(_processes, "max_over_processes", lambda v: np.maximum(v, gathered["v"]))
    quantizer = fq.TensorQuantizer(tensor, transforms.Constant(x), "float32")
    combine_statistics([(quantizer, mine)])
    got = np.concatenate([quantizer.values(index) for index in mine + theirs], axis=0)
    assert got.tobytes() == expected[0].tobytes()
    assert quantizer.scale(tuple((0, d) for d in scale_shape)).tobytes() == expected[1].tobytes()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_int8_extremes_equal_keras(dtype):
    # Columns at the edges of the range (huge, tiny, subnormal, zero, one
    # value, all equal): Keras's clip never changes a value, so leaving it
    # out gives its bits.
    columns = [
        [3e38, -3e38, 1e38, 2.9e38], [1e-38, -1e-38, 5e-39, 0.0], [1e-40, -2e-40, 0.0, 3e-40],
        [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 7.0], [-5.0, -5.0, -5.0, -5.0], [1.0, -1.0, 0.5, -0.5],
    ]
    x = np.asarray(columns, dtype=np.float32).T.astype(DTYPES[dtype])
    values, scale = keras.quantizers.abs_max_quantize(x, axis=0, to_numpy=True)
    ours_scale = qm.int8_scale(qm.abs_max(x, (0,)))
    assert ours_scale.astype(DTYPES[dtype]).tobytes() == np.asarray(scale).tobytes()
    assert qm.int8_values(x, ours_scale).tobytes() == np.asarray(values).tobytes()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_in_place_and_strided_outputs_give_the_same_bits(dtype):
    # The loader computes in scratch memory (`overwrite=True`) and writes
    # each slab's values into a column strip of the block (`out=`, strided).
    x = _values(256, 12, DTYPES[dtype])
    wide = x.astype(np.float32)
    scale = qm.int8_scale(qm.abs_max(x, (0,)))
    block = np.zeros((256, 20), np.int8)
    # Widened to float32, each product rounded to the dtype Keras's has.
    qm.int8_values(wide.copy(), scale, overwrite=True, out=block[:, 4:16], step=qm.step_dtype(x.dtype, scale))
    assert block[:, 4:16].tobytes() == qm.int8_values(x, scale).tobytes()
    assert not block[:, :4].any() and not block[:, 16:].any()

    low, high = qm.finish_group_stats(*qm.group_stats(x, 0, 0, 128), 0, 0, 256, 128)
    s, z = qm.group_params(low, high)
    expected = qm.group_values(x, 0, 0, 128, s, z)
    values = np.zeros((256, 20), np.int8)
    scratch = wide.copy()
    qm.group_values(scratch, 0, 0, 128, s, z, overwrite=True, out=values[:, 2:14], step=qm.step_dtype(x.dtype, s))
    assert values[:, 2:14].tobytes() == expected.tobytes()
    assert np.result_type(wide, s) != wide.dtype or not np.array_equal(scratch, wide)  # it did overwrite
    for axis in (0, 1):
        packed = np.zeros((128, 20) if axis == 0 else (256, 20), np.int8)
        target = packed[:, 3:15] if axis == 0 else packed[:, 3:9]
        qm.pack_int4(expected, axis, out=target)
        assert target.tobytes() == np.asarray(keras.quantizers.pack_int4(expected, axis=axis)[0]).tobytes()


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_stored_float32_quantized_as_bfloat16_in_reused_scratch(mode, kernels, tmp_path, monkeypatch):
    # A float32 checkpoint tensor loaded as bfloat16 and quantized: read
    # straight into scratch memory, rounded to bfloat16 as stock's assign
    # does, and quantized to Keras's bits, by the kernels (a unit at once)
    # or by keras_math's steps (slab by slab, many slabs sharing a few
    # buffers).
    from keras_hub_dist.storage import host_io
    from keras_hub_dist.formats.base import StoredTensor, StoredTensorSource

    if not kernels:
        monkeypatch.setattr(fq.qk, "supported", lambda block, ndim=2: False)
    monkeypatch.setattr(fq, "READ_BYTES", 256 * 4 * 12)  # read 12 columns of 256 float32 rows at a time
    monkeypatch.setattr(fq, "SLAB_BYTES", 64 * 4 * 12)  # computed 64 rows (int4: a group of 128) at a time
    x = _values(256, 40, np.float32)
    path = tmp_path / "x.bin"
    path.write_bytes(b"\0" * 16 + x.tobytes())
    source = StoredTensorSource(StoredTensor(str(path), 16, x.shape, np.dtype(np.float32)))
    rule, scale_shape, expected = _keras_quantized(mode, x.astype(ml_dtypes.bfloat16), pack_axis=0)
    slabs = []
    rounded_rows = fq.TensorQuantizer._rounded_rows

    def counting(self, unit, src, rounded):
        for rows, block, scratch in rounded_rows(self, unit, src, rounded):
            slabs.append(rows)
            yield rows, block, scratch

    monkeypatch.setattr(fq.TensorQuantizer, "_rounded_rows", counting)
    allocations = []
    original = host_io.aligned_empty
    monkeypatch.setattr(host_io, "aligned_empty", lambda *a: allocations.append(a) or original(*a))
    quantizer = fq.TensorQuantizer(_tensor(rule, (256, 40), scale_shape), source, "bfloat16")
    shape = quantizer.values_source().shape
    got = quantizer.values_source().read(((0, shape[0]), (0, 40)))
    assert got.tobytes() == expected[0].tobytes()
    assert quantizer.scale(tuple((0, d) for d in scale_shape)).tobytes() == expected[1].tobytes()
    units = quantizer._units(((0, 256), (0, 40)))
    scratch = [a for a in allocations if a[1] == np.uint8]
    expected_slabs = {"int8": 4 * 3 + 2, "int4": 2 * 4}[mode] if not kernels else 0  # the last unit is 4 columns wide
    assert (len(units), len(slabs)) == (4, expected_slabs) and len(scratch) <= 4 * fq.SLAB_THREADS  # not one per slab and step
    assert len(allocations) == len(scratch) + 1  # and the values block: no slab read in fresh memory
