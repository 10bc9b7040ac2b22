"""Indexing `model.weights.h5`: variable -> dataset, offsets, validation."""

import json
import os
import shutil

import h5py
import keras
import keras_hub
import ml_dtypes
import numpy as np
import pytest

from keras_hub_dist import PresetError
from keras_hub_dist.formats import keras_h5 as _h5_index
from keras_hub_dist.formats.base import compatible_dtypes
from keras_hub_dist.formats.keras_h5 import (
    build_index,
    expected_datasets,
    read_datasets,
    weights_files,
)
from keras_hub_dist.plan import presets
from keras_hub_dist.plan.build import build_without_values

GEMMA = dict(
    vocabulary_size=256, num_layers=2, num_query_heads=4, num_key_value_heads=2,
    hidden_dim=32, intermediate_dim=64, head_dim=8,
)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def preset(request, tmp_path_factory):
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GemmaBackbone(**GEMMA, dtype=request.param)
    path = tmp_path_factory.mktemp(f"gemma_{request.param}")
    backbone.save_to_preset(str(path))
    return str(path)


def _build_abstract(config, dtype):
    cls, kwargs, _ = presets.backbone_config(config, dtype=dtype)
    return build_without_values(cls, kwargs)


def _abstract(preset_dir, dtype=None):
    with open(os.path.join(preset_dir, "config.json")) as f:
        config = json.load(f)
    backbone, _ = _build_abstract(config, dtype)
    return backbone


def _copy(preset_dir, tmp_path):
    target = tmp_path / "preset"
    shutil.copytree(preset_dir, target)
    return str(target), str(target / "model.weights.h5")


def test_every_variable_maps_to_the_dataset_keras_loads_it_from(preset):
    backbone = _abstract(preset, dtype="float32")
    index = build_index(backbone, os.path.join(preset, "model.weights.h5"))
    assert [e.path for e in index.entries] == [v.path for v in backbone.weights]
    assert index.entries[0].source.dataset.name == "layers/reversible_embedding/vars/0"
    stock = keras_hub.models.Backbone.from_preset(preset, dtype="float32")
    stock_values = {v.path: np.asarray(v.numpy()) for v in stock.weights}
    with open(os.path.join(preset, "model.weights.h5"), "rb") as f:
        raw = f.read()
    for entry in index.entries:
        ds = entry.source.dataset
        assert ds.offset is not None and ds.nbytes > 0
        on_disk = np.frombuffer(raw[ds.offset : ds.offset + ds.nbytes], ds.dtype).reshape(ds.shape)
        # The bytes at the recorded offset are exactly what stock Keras
        # assigns to this variable path.
        np.testing.assert_array_equal(on_disk.astype(np.float32), stock_values[entry.path])
        with h5py.File(ds.file) as h5:
            assert h5[ds.name].shape == ds.shape


def test_bfloat16_datasets_are_recognized(preset):
    datasets = read_datasets(weights_files(os.path.join(preset, "model.weights.h5")))
    dtypes = {d.dtype for d in datasets.values()}
    expected = np.dtype(ml_dtypes.bfloat16) if "bfloat16" in preset else np.dtype("float32")
    assert dtypes == {expected}


def test_expected_datasets_of_an_abstract_model_allocate_nothing(preset):
    backbone = _abstract(preset)
    names = expected_datasets(backbone)
    assert len(names) == len(backbone.weights)
    assert all(getattr(v, "_value", None) is None for v in backbone.weights)


def test_missing_weights_file(tmp_path):
    with pytest.raises(PresetError, match="does not exist"):
        weights_files(str(tmp_path / "model.weights.h5"))


def test_truncated_file(preset, tmp_path):
    _, weights = _copy(preset, tmp_path)
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with pytest.raises(PresetError, match="truncated"):
        build_index(_abstract(preset), weights)


def test_dataset_past_the_end_of_the_file_is_caught_by_offsets(preset, monkeypatch):
    # HDF5 itself refuses a file shorter than its superblock says (above);
    # the loader also checks every dataset's byte range against the file
    # length it will read from, naming the dataset.
    weights = os.path.join(preset, "model.weights.h5")
    datasets = read_datasets([weights])
    last = max(datasets.values(), key=lambda d: d.offset + d.nbytes)
    end = last.offset + last.nbytes
    real_getsize = os.path.getsize
    monkeypatch.setattr(
        _h5_index.os.path, "getsize",
        lambda p: end - 1 if p == weights else real_getsize(p),
    )
    with pytest.raises(PresetError) as info:
        read_datasets([weights])
    message = str(info.value)
    assert "is truncated" in message and repr(last.name) in message
    assert f"ends at byte {end}" in message and f"Received: {end - 1} bytes" in message


def test_variable_missing_from_the_file(preset, tmp_path):
    _, weights = _copy(preset, tmp_path)
    with h5py.File(weights, "r+") as h5:
        del h5["layers/gemma_decoder_block_1/gating_ffw/vars/0"]
    with pytest.raises(PresetError) as info:
        build_index(_abstract(preset), weights)
    message = str(info.value)
    assert "1 variable(s) missing from the file" in message
    assert "decoder_block_1/ffw_gating/kernel" in message
    assert "layers/gemma_decoder_block_1/gating_ffw/vars/0" in message


def test_extra_dataset_in_the_file(preset, tmp_path):
    _, weights = _copy(preset, tmp_path)
    with h5py.File(weights, "r+") as h5:
        h5.create_dataset("layers/lm_head/vars/0", data=np.zeros((4, 4), np.float32))
    with pytest.raises(PresetError, match=r"in the file match no variable[\s\S]*layers/lm_head/vars/0 \(shape \(4, 4\)"):
        build_index(_abstract(preset), weights)


def test_shape_mismatch_names_path_expected_and_on_disk(preset, tmp_path):
    _, weights = _copy(preset, tmp_path)
    name = "layers/gemma_decoder_block/attention/query_dense/vars/0"
    with h5py.File(weights, "r+") as h5:
        del h5[name]
        h5.create_dataset(name, data=np.zeros((4, 32, 4), np.float32))
    with pytest.raises(PresetError) as info:
        build_index(_abstract(preset), weights)
    message = str(info.value)
    assert "decoder_block_0/attention/query/kernel: shape mismatch" in message
    assert "Expected (4, 32, 8)" in message
    assert "Received on disk: (4, 32, 4)" in message


def test_dtype_mismatch_names_path_expected_and_on_disk(preset, tmp_path):
    _, weights = _copy(preset, tmp_path)
    name = "layers/rms_normalization/vars/0"
    with h5py.File(weights, "r+") as h5:
        del h5[name]
        h5.create_dataset(name, data=np.zeros((32,), np.int32))
    with pytest.raises(PresetError) as info:
        build_index(_abstract(preset, dtype="float32"), weights)
    message = str(info.value)
    assert "final_normalization/scale: dtype mismatch" in message
    assert "Expected float32" in message
    assert "Received on disk: int32" in message


def test_not_an_hdf5_file(tmp_path):
    path = tmp_path / "model.weights.h5"
    path.write_bytes(b"not hdf5" * 100)
    with pytest.raises(PresetError, match="not a readable HDF5 file"):
        read_datasets([str(path)])


def test_chunked_datasets_have_no_offset_and_are_checked(tmp_path):
    path = str(tmp_path / "chunked.h5")
    with h5py.File(path, "w") as h5:
        h5.create_dataset("vars/0", data=np.ones((64, 8), np.float32), chunks=(8, 8), compression="gzip")
        h5.create_dataset("vars/1", data=np.ones((4,), np.float32))
        h5["link"] = h5py.SoftLink("/vars/1")
    with pytest.raises(PresetError, match="SoftLink"):
        read_datasets([path])
    with h5py.File(path, "r+") as h5:
        del h5["link"]
    datasets = read_datasets([path])
    assert datasets["vars/0"].offset is None and not datasets["vars/0"].contiguous
    assert datasets["vars/1"].offset is not None


def test_sharded_weights_json(tmp_path):
    keras.utils.set_random_seed(2)
    backbone = keras_hub.models.GemmaBackbone(**GEMMA, dtype="float32")
    path = str(tmp_path / "model.weights.json")
    backbone.save_weights(path, max_shard_size=0.00004)  # ~40 kB shards
    files = weights_files(path)
    assert len(files) > 1
    index = build_index(_abstract_from(backbone), path)
    assert {e.source.dataset.file for e in index.entries} == set(files)
    for entry, variable in zip(index.entries, backbone.weights):
        with h5py.File(entry.source.dataset.file) as h5:
            np.testing.assert_array_equal(h5[entry.source.dataset.name][()], variable.numpy())


def _abstract_from(backbone):
    config = keras.saving.serialize_keras_object(backbone)
    model, _ = _build_abstract(config, "float32")
    return model


def test_compatible_dtypes():
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert compatible_dtypes(np.float32, bf16)
    assert compatible_dtypes(bf16, np.float16)
    assert compatible_dtypes(np.dtype(">f4"), np.float32)
    assert compatible_dtypes(np.int8, np.int8)
    assert not compatible_dtypes(np.int8, np.float32)
    assert not compatible_dtypes(np.float32, np.int32)
    assert not compatible_dtypes(np.int8, np.int32)
