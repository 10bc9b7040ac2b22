"""Traced NumPy transforms compute every block exactly as NumPy on the whole."""

import itertools
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from keras_hub_dist.formats import mxfp4, transforms
from keras_hub_dist.formats.lazy_numpy import LazyArray, Opaque
from keras_hub_dist.formats.safetensors_files import read_header


@pytest.fixture
def stored(tmp_path):
    """`name -> (LazyArray, the same values as a NumPy array)` from one file."""
    rng = np.random.default_rng(0)
    arrays = {
        "q": rng.standard_normal((24, 16), dtype=np.float32),   # (heads*dim, hidden)
        "o": rng.standard_normal((16, 24), dtype=np.float32),
        "b": rng.standard_normal((24,), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "e0": rng.standard_normal((8, 16), dtype=np.float32),
        "e1": rng.standard_normal((8, 16), dtype=np.float32),
        "e2": rng.standard_normal((8, 16), dtype=np.float32),
        "conv": rng.standard_normal((12, 1, 4), dtype=np.float32),
    }
    path = os.path.join(tmp_path, "model.safetensors")
    save_file(arrays, path)
    header = read_header(path)
    return {
        k: (LazyArray(transforms.view(t, t.shape, k), frozenset({k})), arrays[k])
        for k, t in header.tensors.items()
    }


def _blocks(shape):
    """A few blocks per dimension: whole, halves, and an odd range."""
    per_dim = []
    for d in shape:
        options = {(0, d), (0, max(d // 2, 1)), (d // 2, d), (min(1, d - 1), d)}
        per_dim.append(sorted(o for o in options if o[0] < o[1]))
    return list(itertools.product(*per_dim))


def _check(lazy, expected, block_wise=True):
    assert isinstance(lazy, LazyArray)
    assert lazy.shape == expected.shape and lazy.dtype == expected.dtype
    for index in _blocks(expected.shape):
        got = lazy.source.read(index)
        want = expected[tuple(slice(a, b) for a, b in index)]
        assert got.flags.c_contiguous and got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), np.ascontiguousarray(want).view(np.uint8))
    assert (transforms.fallbacks(lazy.source) == []) == block_wise


CASES = {
    "transpose": lambda x: np.transpose(x["q"], axes=(1, 0)),
    "dot_T": lambda x: x["o"].T,
    "heads_then_transpose": lambda x: np.transpose(np.reshape(x["q"], (3, 8, 16)), axes=(0, 2, 1)),
    "transpose_then_heads": lambda x: np.reshape(np.transpose(x["o"]), (3, 8, 16)),
    "transpose_then_merge": lambda x: np.reshape(np.transpose(np.reshape(x["q"], (3, 8, 16)), (2, 0, 1)), (16, 24)),
    "cast_f16": lambda x: np.transpose(x["q"].astype(np.float16)),
    "cast_bf16_then_reshape": lambda x: x["q"].astype(ml_dtypes.bfloat16).reshape(3, 8, 16),
    "bias_heads": lambda x: np.reshape(x["b"], (3, 8)),
    "stack_experts": lambda x: np.stack([np.transpose(x[k]) for k in ("e0", "e1", "e2")], axis=0),
    "stack_last": lambda x: np.stack([x["e0"], x["e1"]], axis=-1),
    "concat_gate_up": lambda x: np.concatenate([x["e0"].T, x["e1"].T], axis=-1),
    "concat_rows": lambda x: np.concatenate([x["e0"], x["e1"], x["e2"]], axis=0),
    "stack_mixed": lambda x: np.stack([x["e0"].T, x["e1"].T, np.transpose(x["e2"])], axis=1),
    "stack_of_concats": lambda x: np.stack(
        [np.concatenate([x["e0"].T, x["e1"].T], axis=-1), np.concatenate([x["e2"].T, x["e0"].T], axis=-1)]
    ),
    "stack_untransposed_and_transposed": lambda x: np.stack([x["e0"][:, :8], x["e1"][:, :8].T]),
    "slice_rows": lambda x: x["q"][8:16],
    "slice_int": lambda x: x["q"][3, 2:10],
    "ellipsis": lambda x: x["conv"][..., 1:3],
    "squeeze": lambda x: np.squeeze(x["conv"], axis=1),
    "squeeze_transpose": lambda x: np.transpose(np.squeeze(x["conv"]), (1, 0)),
    "expand_dims": lambda x: np.expand_dims(x["e0"], 0),
    "moveaxis": lambda x: np.moveaxis(np.reshape(x["q"], (3, 8, 16)), 0, -1),
    "swapaxes": lambda x: np.swapaxes(x["conv"], 0, 2),
    "plus_one": lambda x: x["q"] + 1.0,
    "one_minus": lambda x: 1 - np.transpose(x["q"]) * 2,
    "negate_exp": lambda x: -np.exp(x["e0"]),
    "two_operands": lambda x: x["e0"] * x["e1"],
    "bf16_plus": lambda x: x["b"] + 1,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_block_reads_equal_numpy(stored, name):
    lazy = {k: v[0] for k, v in stored.items()}
    real = {k: v[1] for k, v in stored.items()}
    _check(CASES[name](lazy), CASES[name](real))


def test_a_shared_transpose_moves_outside_stacks_and_concats(stored):
    lazy = {k: v[0] for k, v in stored.items()}
    bank = np.stack([np.concatenate([lazy["e0"].T, lazy["e1"].T], axis=-1)] * 2)
    assert isinstance(bank.source, transforms.Transpose)  # at the root: a device transpose
    assert isinstance(bank.source.child, transforms.Stack)


def test_heads_reshape_reads_only_the_block(stored):
    lazy, _ = stored["q"]
    kernel = np.transpose(np.reshape(lazy, (3, 8, 16)), axes=(0, 2, 1))  # (heads, hidden, dim)
    head = ((1, 2), (0, 16), (0, 8))
    assert kernel.source.read_nbytes(head) == 8 * 16 * 4  # one head, no more


def test_non_commuting_reshape_falls_back_and_says_so(stored):
    lazy = {k: v[0] for k, v in stored.items()}
    real = {k: v[1] for k, v in stored.items()}

    def fn(x):  # merges dimensions that the transpose separated
        return np.reshape(np.transpose(np.reshape(x["q"], (3, 8, 16)), (1, 0, 2)), (24, 16))

    _check(fn(lazy), fn(real), block_wise=False)
    assert "reshape" in transforms.fallbacks(fn(lazy).source)[0]


def test_untraceable_operations_give_opaque_with_their_tensors(stored):
    lazy = {k: v[0] for k, v in stored.items()}
    out = np.empty_like(lazy["q"], dtype=np.float32)
    out[lazy["q"] > 0] = lazy["o"].T[lazy["q"] > 0]
    result = np.transpose(out.reshape(3, 8, 16), (0, 2, 1)) * np.repeat(lazy["b"][:, None], 2, axis=1)
    assert isinstance(result, Opaque)
    assert result.leaves == {"q", "o", "b"}
    with pytest.raises(TypeError, match="cannot be turned into a NumPy array"):
        np.asarray(lazy["q"])


def test_numpy_errors_are_kept(stored):
    lazy, _ = stored["q"]
    with pytest.raises(ValueError, match="cannot reshape array of size 384"):
        np.reshape(lazy, (5, 16))
    with pytest.raises(ValueError, match="axes"):
        np.transpose(lazy, (0, 0))
    with pytest.raises(IndexError):
        lazy[30]


def _stock_dequantize(blocks, scales):
    """KerasHub 0.32's `dequantize_mxfp4` (convert_gpt_oss.py), verbatim."""
    scales = 2.0 ** (scales.astype(np.float32) - 127.0)
    num_experts, out_dim, num_blocks, block_size = blocks.shape
    blocks_uint8 = blocks.astype(np.uint8)
    blocks_4bit = np.stack([blocks_uint8 & 0xF, (blocks_uint8 >> 4) & 0xF], axis=-1)
    blocks_4bit = blocks_4bit.reshape(num_experts, out_dim, num_blocks, block_size * 2)
    s, e, m = (blocks_4bit >> 3) & 0x1, (blocks_4bit >> 1) & 0x3, blocks_4bit & 0x1
    sign = 1.0 - 2.0 * s
    normal = e != 0
    values = np.empty_like(blocks_4bit, dtype=np.float32)
    values[normal] = sign[normal] * (2.0 ** (e[normal].astype(np.float32) - 1.0)) * (
        1.0 + m[normal].astype(np.float32) / 2.0
    )
    values[~normal] = sign[~normal] * (2.0 ** 0.0) * (m[~normal].astype(np.float32) / 2.0)
    values = values.reshape(num_experts, out_dim, num_blocks * block_size * 2)
    expanded = np.repeat(scales[..., np.newaxis], block_size * 2, axis=3)
    return values * expanded.reshape(num_experts, out_dim, num_blocks * block_size * 2)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_mxfp4_blocks_equal_the_converters_dequantization(tmp_path):
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (4, 6, 3, 16), dtype=np.uint8)
    scales = rng.integers(100, 140, (4, 6, 3), dtype=np.uint8)
    scales[0, 0, 0], scales[1, 1, 1] = 255, 0  # inf and the smallest scale
    path = os.path.join(tmp_path, "e.safetensors")
    save_file({"x_blocks": blocks, "x_scales": scales}, path)
    header = read_header(path)
    source = mxfp4.Mxfp4Source(header.tensors["x_blocks"], header.tensors["x_scales"])
    expected = np.transpose(_stock_dequantize(blocks, scales), (0, 2, 1))
    assert source.shape == expected.shape == (4, 96, 6)
    for index in _blocks(expected.shape) + [((1, 3), (31, 65), (2, 5))]:
        got = source.read(index)
        want = np.ascontiguousarray(expected[tuple(slice(a, b) for a, b in index)])
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    # Only the 32-groups covering the range are read.
    assert source.read_nbytes(((0, 1), (32, 64), (0, 1))) == 16 + 1


def test_large_transposes_equal_numpy(tmp_path):
    rng = np.random.default_rng(2)
    arrays = {
        "w": rng.standard_normal((600, 700), dtype=np.float32).astype(ml_dtypes.bfloat16),
        "h": rng.standard_normal((3 * 200, 300), dtype=np.float32),
    }
    path = os.path.join(tmp_path, "big.safetensors")
    save_file(arrays, path)
    header = read_header(path)
    w = LazyArray(transforms.view(header.tensors["w"], (600, 700), "w"))
    h = LazyArray(transforms.view(header.tensors["h"], (600, 300), "h"))
    _check(w.T, arrays["w"].T)
    fn = lambda x: np.transpose(np.reshape(x, (3, 200, 300)), (0, 2, 1))  # noqa: E731
    _check(fn(h), fn(arrays["h"]))
