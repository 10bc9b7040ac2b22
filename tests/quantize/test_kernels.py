"""The Numba kernels give Keras's int8 / int4 bits, and the loader uses them.

Each kernel is compared, bit for bit, with Keras's own quantizers on whole
arrays and with `keras_math` (Keras's steps, itself checked against
Keras in `test_keras_math.py`) on blocks that start inside a group:
random values, ties at .5 after the division (round half to even), float32
values halfway between two bfloat16 values (ties to even on the bits),
zero and constant groups, groups of one sign (the zero point clips), huge,
tiny and subnormal values. A NaN leaves the kernels to `keras_math`.
"""

import keras
import ml_dtypes
import numpy as np
import pytest

from keras_hub_dist.quantize import quantizer as fq
from keras_hub_dist.quantize import kernels as qk
from keras_hub_dist.quantize import keras_math as qm
from keras_hub_dist.formats import transforms
from keras_hub_dist.formats.base import StoredTensor, StoredTensorSource
from keras_hub_dist.quantize.flat_reshape import FlatReshape, blockwise_reshape
from keras_hub_dist.plan.quantization import Int4Rule, Int8Rule, QuantizedTensor

BF16 = ml_dtypes.bfloat16


def _hard_values(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """float32 values with the cases that decide bits, along both axes."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    halfway = np.float32(1 + 2**-8), np.float32(1 + 3 * 2**-8), np.float32(-(1 + 2**-8))  # bf16 ties
    specials = [0.5, -0.5, 1.5, 2.5, -3.5, 7.5, -7.5, 3e38, -3e38, 1e-40, -1e-40, 0.0, -0.0, *halfway]
    x[0, : min(cols, len(specials))] = specials[:cols]
    x[: min(rows, len(specials)), 0] = specials[:rows]
    x[:, 1] = 0.0  # a zero column
    if cols > 3:
        x[:, 2] = np.abs(x[:, 2]) + 100.0  # one sign, far from zero: the zero point clips
        x[:, 3] = -5.0  # constant
    if rows > 3:
        x[1] = np.abs(x[1]) + 3.0
        x[2] = np.resize(np.float32([7.5, -7.5, 2.5, -3.5, 0.5]), cols)  # span 15: scale 1, halves
    return x


def _step(float_dtype, scale: np.ndarray) -> bool:
    """Whether Keras rounds each product / quotient to bfloat16 (as the
    quantizer asks the kernels to)."""
    return qm.step_dtype(float_dtype, scale) == BF16


def _rounded(x: np.ndarray, to_bf16: bool) -> np.ndarray:
    return x.astype(BF16).astype(np.float32) if to_bf16 else x


@pytest.mark.parametrize("to_bf16", [True, False])
@pytest.mark.parametrize("group_axis, pack_axis", [(0, 1), (1, 1), (0, 0)])
def test_int4_kernels_equal_keras_on_whole_matrices(group_axis, pack_axis, to_bf16):
    # Keras groups along axis 0 (the transpose of a group-along-1 matrix).
    x = _hard_values(300, 258)
    float_dtype = BF16 if to_bf16 else np.float32
    oriented = x if group_axis == 0 else x.T
    values, scale, zero = keras.quantizers.abs_max_quantize_grouped_with_zero_point(
        oriented.astype(float_dtype), block_size=128, to_numpy=True
    )
    packed = np.asarray(keras.quantizers.pack_int4(values if group_axis == 0 else values.T, axis=pack_axis)[0])
    expected_scale = np.asarray(scale) if group_axis == 0 else np.asarray(scale).T

    stats = qk.int4_stats(x, group_axis, 0, 128)
    low, high = (s.astype(float_dtype) for s in qm.finish_group_stats(*stats, group_axis, 0, x.shape[group_axis], 128))
    s, z = qm.group_params(low, high)
    assert s.astype(float_dtype).tobytes() == np.ascontiguousarray(expected_scale).tobytes()
    out = np.full(packed.shape, 99, np.int8)
    qk.int4_values(x, to_bf16, group_axis, 0, 128, s, z, pack_axis, out, round_step=_step(float_dtype, s))
    assert out.tobytes() == packed.tobytes()
    expected_zero = np.asarray(zero) if group_axis == 0 else np.asarray(zero).T
    assert z.astype("int8").tobytes() == np.ascontiguousarray(expected_zero).tobytes()


@pytest.mark.parametrize("to_bf16", [True, False])
@pytest.mark.parametrize("group_axis, pack_axis", [(0, 1), (1, 1), (0, 0)])
@pytest.mark.parametrize("first, length", [(0, 256), (70, 190), (128, 127), (5, 3)])
def test_int4_kernels_equal_quantize_math_on_blocks(group_axis, pack_axis, first, length, to_bf16):
    # A block whose first row (or column) along the groups is global `first`:
    # groups cut at both ends, into strided outputs.
    other = 9
    shape = (length, other) if group_axis == 0 else (other, length)
    x = _hard_values(*shape, seed=first)
    stats = qk.int4_stats(x, group_axis, first, 128)
    reference = qm.group_stats(x, group_axis, first, 128)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(stats, reference))
    float_dtype = BF16 if to_bf16 else np.float32
    s, z = qm.group_params(*(a.astype(float_dtype) for a in stats))
    step = qm.step_dtype(float_dtype, s)
    expected = qm.pack_int4(qm.group_values(_rounded(x, to_bf16), group_axis, first, 128, s, z, step=step), pack_axis)
    wide = np.zeros((expected.shape[0] + 2, expected.shape[1] + 5), np.int8)
    target = wide[1:-1, 2:-3]
    qk.int4_values(x, to_bf16, group_axis, first, 128, s, z, pack_axis, target, round_step=_step(float_dtype, s))
    assert target.tobytes() == expected.tobytes()
    assert not wide[0].any() and not wide[-1].any() and not wide[:, :2].any() and not wide[:, -3:].any()


@pytest.mark.parametrize("to_bf16", [True, False])
@pytest.mark.parametrize("axis", [0, 1])
def test_int8_kernels_equal_keras(axis, to_bf16):
    x = _hard_values(77, 40)
    float_dtype = BF16 if to_bf16 else np.float32
    values, scale = keras.quantizers.abs_max_quantize(x.astype(float_dtype), axis=axis, to_numpy=True)
    top = qk.int8_abs_max(x, axis)
    assert top.tobytes() == qm.abs_max(x, (axis,)).tobytes()
    ours_scale = qm.int8_scale(top.astype(float_dtype))
    assert ours_scale.astype(float_dtype).tobytes() == np.asarray(scale).tobytes()
    out = np.zeros((77, 50), np.int8)
    qk.int8_values(x, to_bf16, ours_scale, axis, out[:, 5:45], round_step=_step(float_dtype, ours_scale))
    assert out[:, 5:45].tobytes() == np.asarray(values).tobytes()
    assert not out[:, :5].any() and not out[:, 45:].any()


@pytest.mark.parametrize("to_bf16", [True, False])
@pytest.mark.parametrize("axes", [(1,), (0, 1), (2,), (1, 2)])
def test_int8_kernels_on_a_run_of_reduced_axes_equal_keras(axes, to_bf16):
    # An EinsumDense kernel (heads, hidden, head_dim) reduces its middle
    # axis; others lead or trail. The kernels take the block viewed as
    # (axes before, reduced run, axes after).
    x = _hard_values(4 * 40, 6).reshape(4, 40, 6)
    float_dtype = BF16 if to_bf16 else np.float32
    values, scale = keras.quantizers.abs_max_quantize(x.astype(float_dtype), axis=axes, to_numpy=True)
    start, stop = axes[0], axes[-1] + 1
    run = x.reshape(int(np.prod(x.shape[:start])), int(np.prod(x.shape[start:stop])), int(np.prod(x.shape[stop:])))
    keepdims = [1 if a in axes else d for a, d in enumerate(x.shape)]
    top = qk.int8_abs_max_run(run).reshape(keepdims)
    assert top.tobytes() == qm.abs_max(x, axes).tobytes()
    ours_scale = qm.int8_scale(top.astype(float_dtype))
    assert ours_scale.astype(float_dtype).tobytes() == np.asarray(scale).tobytes()
    out = np.zeros((4, 40, 9), np.int8)
    target = out[:, :, 2:8]  # a strided view, as a unit's part of a values block is
    view = target.view()
    try:
        view.shape = run.shape  # as the quantizer views it: never a copy
    except AttributeError:  # the trailing run of a strided view: contiguous memory then
        out, target = np.zeros((4, 40, 6), np.int8), None
        view = out.reshape(run.shape)
    qk.int8_values_run(
        run, to_bf16, ours_scale.reshape(run.shape[0], 1, run.shape[2]), view, round_step=_step(float_dtype, ours_scale)
    )
    got = out if target is None else target
    assert got.tobytes() == np.asarray(values).tobytes()
    assert target is None or (not out[:, :, :2].any() and not out[:, :, 8:].any())


def test_a_nan_leaves_the_kernels():
    x = _hard_values(130, 8)
    x[129, 4] = np.nan
    for axis in (0, 1):
        assert qk.int4_stats(x, axis, 0, 128) is None
        assert qk.int8_abs_max(x, axis) is None
    assert qk.int8_abs_max_run(x.reshape(2, 65, 8)) is None
    x[129, 4] = -np.nan  # the sign bit set: below every key
    assert qk.int4_stats(x, 0, 0, 128) is None


def _tensor(rule, shape, scale_shape) -> QuantizedTensor:
    class V:
        def __init__(self, path, shape):
            self.path, self.shape = path, shape

    mode = "int8" if isinstance(rule, Int8Rule) else "int4"
    return QuantizedTensor("l", mode, "l/kernel", shape, rule, V("l/kernel", shape), V("l/kernel_scale", scale_shape))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_tensor_with_a_nan_is_quantized_as_keras_does(mode, monkeypatch):
    # The kernels decline it; keras_math's steps give Keras's bits.
    x = _hard_values(256, 6)
    x[3, 4] = np.nan
    calls = []
    monkeypatch.setattr(qm, "group_values", lambda *a, **k: calls.append(1) or _group_values(*a, **k))
    monkeypatch.setattr(qm, "int8_values", lambda *a, **k: calls.append(1) or _int8_values(*a, **k))
    if mode == "int8":
        values, scale = keras.quantizers.abs_max_quantize(x, axis=0, to_numpy=True)
        rule, scale_shape = Int8Rule((0,), (1,)), (6,)
    else:
        values, scale, _ = keras.quantizers.abs_max_quantize_grouped_with_zero_point(x, block_size=128, to_numpy=True)
        values = keras.quantizers.pack_int4(values, axis=1)[0]
        rule, scale_shape = Int4Rule((256, 6), 0, 1, 128), (2, 6)
    quantizer = fq.TensorQuantizer(_tensor(rule, (256, 6), scale_shape), transforms.Constant(x), "float32")
    got = quantizer.values_source().read(tuple((0, d) for d in quantizer.values_source().shape))
    assert got.tobytes() == np.asarray(values).tobytes() and calls


_group_values, _int8_values = qm.group_values, qm.int8_values


def test_einsum_kernel_blocks_read_only_their_bytes(tmp_path, monkeypatch):
    # An EinsumDense kernel (heads, hidden, head_dim), stored float32, loaded
    # as bfloat16 and quantized to int4 on its (hidden, heads * head_dim)
    # C-order matrix: each block reads its own bytes into scratch memory
    # (it read the whole tensor per block under the cast before).
    stored = _hard_values(4 * 256, 8).reshape(4, 256, 8)
    path = tmp_path / "k.bin"
    path.write_bytes(stored.tobytes())

    class Dataset(StoredTensorSource):  # what a KerasHub preset's contiguous dataset is
        pass

    source = Dataset(StoredTensor(str(path), 0, (4, 256, 8), np.dtype(np.float32)))
    matrix = stored.reshape(256, 32)
    values, scale, _ = keras.quantizers.abs_max_quantize_grouped_with_zero_point(
        matrix.astype(BF16), block_size=128, to_numpy=True
    )
    packed = np.asarray(keras.quantizers.pack_int4(values, axis=1)[0])
    quantizer = fq.TensorQuantizer(_tensor(Int4Rule((256, 32), 0, 1, 128), (4, 256, 8), (2, 32)), source, "bfloat16")
    read = []
    original = StoredTensor.read
    monkeypatch.setattr(StoredTensor, "read", lambda self, index, out=None: read.append(index) or original(self, index, out))
    blocks = [((0, 256), (0, 8)), ((0, 256), (8, 16))]
    got = np.concatenate([quantizer.values(index) for index in blocks], axis=1)
    assert got.tobytes() == packed[:, :16].tobytes()
    assert read == [((0, 256), (0, 16)), ((0, 256), (16, 32))]  # in matrix coordinates, once each
    assert quantizer.scale(((0, 2), (0, 32))).tobytes() == np.asarray(scale).tobytes()


def test_reshape_under_a_cast_stays_blockwise():
    stored = np.arange(4 * 5 * 6, dtype=np.float32).reshape(4, 6, 5)
    inner = transforms.Transpose(transforms.Constant(stored), (0, 2, 1))  # (4, 5, 6)
    reshaped = blockwise_reshape(transforms.Cast(inner, BF16), (5, 24))
    assert isinstance(reshaped, transforms.Cast) and isinstance(reshaped.child, FlatReshape)
    whole = np.transpose(stored, (0, 2, 1)).reshape(5, 24).astype(BF16)
    assert reshaped.read(((1, 3), (4, 20))).tobytes() == whole[1:3, 4:20].tobytes()


def test_values_of_whole_channels_are_not_read_as_a_union():
    # Blocks that each hold their groups' whole extent are computed one by
    # one (in parallel); blocks that split it are read as their union.
    x = _hard_values(256, 8)
    rule = Int4Rule((256, 8), 0, 1, 128)
    quantizer = fq.TensorQuantizer(_tensor(rule, (256, 8), (2, 8)), transforms.Constant(x), "float32")
    values = quantizer.values_source()
    assert not values.union_read_helps([((0, 256), (0, 2)), ((0, 256), (2, 4))])
    assert values.union_read_helps([((0, 100), (0, 4)), ((100, 256), (0, 4))])  # a group cut
    assert quantizer.scale_source(np.float32).union_read_helps([((0, 1), (0, 8)), ((1, 2), (0, 8))])
