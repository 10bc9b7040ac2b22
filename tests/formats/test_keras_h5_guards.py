"""A hostile `model.weights.h5` cannot make the indexer read outside the file
(external links, external raw storage, virtual datasets) nor declare more
data than the file stores (a size bomb): each is refused with a
`PresetError` naming the file and the dataset, before a weight byte is read."""

import os
import zlib

import h5py
import numpy as np
import pytest

from keras_hub_dist import PresetError
from keras_hub_dist.formats.keras_h5 import read_datasets


def _refused(path, *patterns):
    with pytest.raises(PresetError) as info:
        read_datasets([str(path)])
    message = str(info.value)
    assert repr(str(path)) in message, message
    for pattern in patterns:
        assert pattern in message, message
    return message


def test_an_external_link_is_refused(tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as h5:
        h5["x"] = np.ones(4, np.float32)
    path = tmp_path / "model.weights.h5"
    with h5py.File(path, "w") as h5:
        h5["vars/0"] = np.ones(4, np.float32)
        h5["vars/1"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/x")
    _refused(path, "ExternalLink", "'vars/1'")


def test_external_raw_storage_is_refused(tmp_path):
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.arange(16, dtype=np.float32).tobytes())
    path = tmp_path / "model.weights.h5"
    with h5py.File(path, "w") as h5:
        h5.create_dataset("vars/0", shape=(16,), dtype=np.float32, external=[(str(raw), 0, 64)])
    _refused(path, "'vars/0'", "external file")


def test_a_virtual_dataset_is_refused(tmp_path):
    with h5py.File(tmp_path / "source.h5", "w") as h5:
        h5["x"] = np.ones(8, np.float32)
    layout = h5py.VirtualLayout(shape=(8,), dtype=np.float32)
    layout[:] = h5py.VirtualSource(str(tmp_path / "source.h5"), "x", shape=(8,))
    path = tmp_path / "model.weights.h5"
    with h5py.File(path, "w") as h5:
        h5.create_virtual_dataset("vars/0", layout)
    _refused(path, "'vars/0'", "virtual dataset")


def test_chunks_never_written_are_a_size_bomb(tmp_path):
    # 4 GiB declared in a file of a few kB: every chunk would read as fill.
    path = tmp_path / "model.weights.h5"
    with h5py.File(path, "w") as h5:
        h5.create_dataset("vars/0", shape=(2**30,), dtype=np.float32, chunks=(2**16,), compression="gzip")
    assert os.path.getsize(path) < 100_000
    _refused(path, "'vars/0'", "declares shape (1073741824,)", "4294967296 declared bytes",
             "only 0 of its 16384 chunks are stored", "Download or save the preset again")


def test_a_chunk_compressed_past_any_writer_is_a_size_bomb(tmp_path):
    # One 256 MiB chunk stored as 20-odd deflate bytes (written raw, so
    # HDF5 never checks it inflates to its size).
    path = tmp_path / "model.weights.h5"
    with h5py.File(path, "w") as h5:
        ds = h5.create_dataset("vars/0", shape=(2**26,), dtype=np.float32, chunks=(2**26,), compression="gzip")
        ds.id.write_direct_chunk((0,), zlib.compress(bytes(1000)))
    _refused(path, "'vars/0'", "268435456 declared bytes", "over 2048:1")


def test_contiguous_data_larger_than_the_file_is_refused(tmp_path, monkeypatch):
    # HDF5 refuses a file shorter than its superblock says; the loader also
    # bounds each dataset by the length it reads from (a remote object's).
    path = tmp_path / "model.weights.h5"
    with h5py.File(path, "w") as h5:
        h5["vars/0"] = np.ones(2**18, np.float32)
    real = os.path.getsize
    monkeypatch.setattr(os.path, "getsize", lambda p: 200_000 if str(p) == str(path) else real(p))
    _refused(path, "is truncated", "'vars/0'", "1048576 declared bytes", "the whole file is 200000 bytes")


def test_well_compressed_zeros_still_load(tmp_path):
    # Deflate's best ratio (~1000:1, all zeros) stays inside the bound.
    path = tmp_path / "model.weights.h5"
    with h5py.File(path, "w") as h5:
        h5.create_dataset("vars/0", data=np.zeros((1024, 1024), np.float32), chunks=(512, 1024),
                          compression="gzip", compression_opts=9)
    dataset = read_datasets([str(path)])["vars/0"]
    assert dataset.shape == (1024, 1024) and dataset.nbytes == 4 * 2**20
