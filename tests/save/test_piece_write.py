"""`piece_write.permuted`: which views XLA may rearrange (a pure permutation
of a contiguous array), and the rearranged bytes."""

import numpy as np
import pytest

from keras_hub_dist.save import piece_write


@pytest.mark.parametrize("perm", [(1, 0), (0, 1), (2, 0, 1), (1, 2, 0)])
def test_a_permuted_contiguous_array_is_found_with_its_permutation(perm):
    array = np.arange(4 * 6 * (8 if len(perm) == 3 else 1), dtype=np.float32).reshape((4, 6, 8)[: len(perm)])
    view = array.transpose(perm)
    base, found = piece_write.permuted(view)
    assert np.shares_memory(base, array) and base.flags.c_contiguous
    np.testing.assert_array_equal(base.transpose(found), view)


@pytest.mark.parametrize("index", [np.s_[:, 1:3], np.s_[::2, :], np.s_[1:, :]])
def test_a_slice_of_a_transpose_is_not_a_permutation(index):
    view = np.arange(48, dtype=np.float32).reshape(6, 8).T[index]
    result = piece_write.permuted(view)
    if view.T.flags.c_contiguous:  # a slice of the leading rows stays contiguous
        assert result is not None
    else:
        assert result is None


def test_the_writer_rearranges_through_xla_bitwise(tmp_path, monkeypatch):
    """The same transposed write with and without a transpose device gives
    the same file bytes: the transpose's."""
    import os

    import jax
    import ml_dtypes

    from keras_hub_dist.storage import host_io
    from keras_hub_dist.formats.pieces import Atom, Piece, block_writes

    monkeypatch.setattr(piece_write, "XLA_TRANSPOSE_MIN_BYTES", 0)
    monkeypatch.setattr(piece_write, "XLA_SLAB_BYTES", 5 * 48 * 2)  # 5 rows: 13 slabs, the last of 4
    perms, transposer = [], piece_write._transposer

    def counted(perm):
        def run(slab):
            perms.append(perm)
            return transposer(perm)(slab)
        return run

    monkeypatch.setattr(piece_write, "_transposer", counted)
    block = np.random.default_rng(0).integers(0, 1 << 16, (64, 48), dtype=np.uint16).view(ml_dtypes.bfloat16)
    # Leaf (64, 48) -> output (48, 64): leaf row i is output column i.
    transpose = Piece("leaf", 0, 0, (Atom(64, 48, 1), Atom(48, 1, 64)))
    writes = block_writes(transpose, block.shape, ((0, 64), (0, 48)), 0, 2)
    path = str(tmp_path / "out.bin")
    results = []
    for device in (None, jax.local_devices(backend="cpu")[0]):
        with open(path, "wb") as f:
            f.truncate(block.nbytes)
        files = host_io.FileDescriptors(os.O_WRONLY)
        writer = piece_write.PieceWriter(files, transpose_device=device)
        writer.write(block, [(path, w, block.dtype) for w in writes])
        files.close()
        results.append(open(path, "rb").read())
        assert writer.stats.bytes_written == block.nbytes
    assert perms == [(1, 0)] * 13  # one program per slab, only for the writer with a device
    assert results[0] == results[1] == np.ascontiguousarray(block.T).tobytes()
