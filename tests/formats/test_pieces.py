"""Affine pieces (`formats.pieces`) and the safetensors writer: exact
against NumPy on every transform chain the converters and exporters use,
and against the `safetensors` library byte for byte."""

import itertools
import math
import os

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save

from keras_hub_dist.formats import pieces as P
from keras_hub_dist.formats.base import StoredTensor
from keras_hub_dist.formats.lazy_numpy import LazyArray
from keras_hub_dist.formats.safetensors_writer import TensorSpec, create_files, index_json, plan_files
from keras_hub_dist.formats.transforms import view

H, D, HID = 4, 3, 6
# Each: (function of NumPy-like arrays, input shapes), the shapes of the
# exporters' and converters' transforms.
CHAINS = {
    "q_proj export": (lambda x: np.transpose(np.reshape(x, (HID, H * D))), [(HID, H, D)]),
    "gemma q_proj (stock, across heads)": (
        lambda x: np.transpose(np.reshape(np.transpose(x, (1, 0, 2)), (-1, HID))), [(H, HID, D)]),
    "o_proj export": (lambda x: np.reshape(np.transpose(x, (2, 0, 1)), (HID, -1)), [(H, D, HID)]),
    "o_proj import": (lambda t: np.reshape(np.transpose(t), (H, D, HID)), [(HID, H * D)]),
    "expert of a bank": (lambda x: np.transpose(x[1]), [(5, HID, 8)]),
    "gate/up concat": (lambda x, y: np.concatenate([x.T, y.T], axis=0), [(HID, 8), (HID, 4)]),
    "expert stack": (lambda x, y: np.stack([x.T, y.T], axis=0), [(HID, 8), (HID, 8)]),
    "reshape, transpose, slice": (
        lambda x: np.transpose(np.reshape(x, (2, 3, 4, 5)), (2, 0, 3, 1))[1:3, :, 2:5], [(6, 20)]),
    "kv heads import": (
        lambda t: np.transpose(np.reshape(t, (H, D, HID)), (0, 2, 1)), [(H * D, HID)]),
    "column slice": (lambda x: x[:, 2:7].T, [(6, 10)]),
    "expand dims": (lambda x: np.expand_dims(x, 1), [(6, 10)]),
    "cast": (lambda x: x.astype(np.float16).T, [(6, 10)]),
}


def _blocks(shape):
    """A grid of uneven blocks (2-3 per dimension)."""
    cuts = [sorted({0, d // 3, (2 * d) // 3, d}) for d in shape]
    return list(itertools.product(*(list(zip(c[:-1], c[1:])) for c in cuts)))


def _trace(fn, shapes):
    lazies, reals, leaves, base = [], [], {}, 0
    for i, shape in enumerate(shapes):
        stored = StoredTensor(f"f{i}", 0, shape, np.dtype(np.float32))
        real = np.arange(base, base + math.prod(shape), dtype=np.float64).reshape(shape)
        base += real.size + 1000
        lazies.append(LazyArray(view(stored, shape, f"f{i}")))
        reals.append(real)
        leaves[(f"f{i}", 0)] = real
    return P.pieces_of(fn(*lazies).source), fn(*reals), leaves


@pytest.mark.parametrize("name", list(CHAINS))
def test_pieces_map_every_output_element_to_its_leaf_element(name):
    pieces, expected, leaves = _trace(*CHAINS[name])
    flat = expected.reshape(-1)
    covered = np.zeros(flat.size, int)
    for piece in pieces:
        leaf = leaves[piece.leaf].reshape(-1)
        for digits in itertools.product(*(range(a.size) for a in piece.atoms)):
            out = piece.out_base + sum(i * a.out_step for i, a in zip(digits, piece.atoms))
            src = piece.leaf_base + sum(i * a.leaf_step for i, a in zip(digits, piece.atoms))
            assert flat[out] == leaf[src]
            covered[out] += 1
    assert (covered == 1).all()  # every element exactly once


@pytest.mark.parametrize("name", list(CHAINS))
def test_block_writes_of_every_block_reassemble_the_output(name):
    """What an exporter does: each block of a leaf writes its part, at byte
    runs, from a strided view of the block; together exactly the output."""
    pieces, expected, leaves = _trace(*CHAINS[name])
    flat = np.full(expected.size, np.nan)
    written = np.zeros(expected.size, int)
    for key, leaf in leaves.items():
        mine = [p for p in pieces if p.leaf == key]
        for block in _blocks(leaf.shape):
            values = leaf[tuple(slice(a, b) for a, b in block)]
            for piece in mine:
                for write in P.block_writes(piece, leaf.shape, block, 0, 8):
                    data = np.ascontiguousarray(write.values(values)).reshape(-1)
                    position = 0
                    for offset, length in write.runs():
                        flat[offset // 8 : (offset + length) // 8] = data[position : position + length // 8]
                        written[offset // 8 : (offset + length) // 8] += 1
                        position += length // 8
    assert (written == 1).all()
    np.testing.assert_array_equal(flat, expected.reshape(-1))


def test_inverting_the_import_gives_the_export():
    """The importer's `reshape(transpose(t))` read backwards is the
    exporter's `transpose(reshape(x))`: the same pieces."""
    (imported,), _, _ = _trace(CHAINS["o_proj import"][0], CHAINS["o_proj import"][1])
    (exported,), _, _ = _trace(CHAINS["o_proj export"][0], CHAINS["o_proj export"][1])
    assert P.canonical(P.invert(imported, ("f0", 0))) == P.canonical(exported)


def test_a_write_splits_into_slabs_of_its_outer_axis():
    (piece,), expected, leaves = _trace(*CHAINS["q_proj export"])
    leaf = leaves[("f0", 0)]
    (write,) = P.block_writes(piece, leaf.shape, tuple((0, d) for d in leaf.shape), 0, 8)
    def bytes_of(runs):
        return [b for offset, length in runs for b in range(offset, offset + length)]

    whole = bytes_of(write.runs())
    assert write.shape[0] > 2
    # The slabs, in order, are the whole write's bytes in order.
    assert bytes_of(write.runs(0, 2)) + bytes_of(write.runs(2, write.shape[0])) == whole


def test_value_boxes_cover_a_range_exactly():
    sizes, steps = (3, 4, 5), (40, 6, 1)  # gaps between the inner ranges
    for start, stop in [(0, 120), (7, 93), (25, 27), (44, 46), (0, 1)]:
        found = set()
        for box in P.value_boxes(start, stop, sizes, steps):
            for digits in itertools.product(*(range(a, b) for a, b in box)):
                value = sum(d * s for d, s in zip(digits, steps))
                assert value not in found
                found.add(value)
        every = {sum(d * s for d, s in zip(x, steps)) for x in itertools.product(*map(range, sizes))}
        assert found == {v for v in every if start <= v < stop}


def test_an_elementwise_transform_is_not_affine():
    stored = StoredTensor("f", 0, (4, 4), np.dtype(np.float32))
    with pytest.raises(P.NotAffine, match="does not only move elements"):
        P.pieces_of((LazyArray(view(stored, (4, 4), "f")) * 2).source)


def _random_tensors():
    rng = np.random.default_rng(0)
    return {
        "b.weight": rng.standard_normal((3, 5)).astype(np.float32),
        "a.weight": rng.standard_normal(7).astype(np.float16),
        "c.count": np.arange(3, dtype=np.int64),
        "z.mask": np.ones(5, np.uint8),
        "x.weight": rng.standard_normal((2, 2)).astype(ml_dtypes.bfloat16),
        "w.scalar": np.array(2.5, np.float32),
    }


def test_files_hold_the_bytes_the_safetensors_library_writes(tmp_path):
    tensors = _random_tensors()
    layout = plan_files([TensorSpec(k, v.shape, v.dtype) for k, v in tensors.items()])
    (file,) = layout.files
    assert file.name == "model-00001-of-00001.safetensors"
    create_files(layout, str(tmp_path))
    path = tmp_path / file.name
    assert path.stat().st_size == file.size
    fd = os.open(path, os.O_WRONLY)
    for name, value in tensors.items():
        os.pwrite(fd, np.ascontiguousarray(value).tobytes(), file.offsets[name])
    os.close(fd)
    assert path.read_bytes() == save(tensors, metadata={"format": "pt"})


def test_shards_split_as_transformers_does():
    """In order, a new file when the next tensor would pass the limit, and
    a file of its own for a tensor over it (60, 14, 24, 5, 8, 4 bytes; 40)."""
    tensors = _random_tensors()
    layout = plan_files([TensorSpec(k, v.shape, v.dtype) for k, v in tensors.items()], max_shard_size=40)
    assert [sorted(f.offsets) for f in layout.files] == [
        ["b.weight"], ["a.weight", "c.count"], ["w.scalar", "x.weight", "z.mask"]]
    count = len(layout.files)
    assert [f.name for f in layout.files] == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    index = index_json(layout, {"extra": 1})
    assert '"total_size": ' + str(sum(v.nbytes for v in tensors.values())) in index and '"extra": 1' in index


def test_a_dtype_safetensors_cannot_hold():
    with pytest.raises(ValueError, match="cannot hold"):
        plan_files([TensorSpec("t", (2,), np.dtype(np.complex64))])
