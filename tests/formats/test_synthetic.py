"""The streaming synthetic-preset writer: Keras's exact layout, stock-loadable."""

import gc
import json
import os

import h5py
import keras
import keras_hub
import numpy as np
import pytest
from conftest import live_device_bytes

from keras_hub_dist import PresetError, UnknownPresetError, write_synthetic_preset
from keras_hub_dist.measure import memory
from keras_hub_dist.formats import synthetic
from keras_hub_dist.formats.keras_h5 import read_datasets

GEMMA = dict(
    vocabulary_size=512, num_layers=2, num_query_heads=4, num_key_value_heads=2,
    hidden_dim=32, intermediate_dim=64, head_dim=8,
)
LLAMA = dict(
    vocabulary_size=512, num_layers=2, num_query_heads=4, num_key_value_heads=2,
    hidden_dim=32, intermediate_dim=64,
)


def _structure(path):
    """Every group and dataset with what Keras writes, minus auto-generated
    layer names (which differ between any two models in one process)."""
    out = {}
    with h5py.File(path) as h5:
        def visit(name, obj):
            attrs = {k: v for k, v in obj.attrs.items() if k != "name"}
            if isinstance(obj, h5py.Dataset):
                out[name] = (
                    "dataset", obj.shape, obj.dtype.str, attrs, obj.chunks, obj.compression,
                    obj.id.get_offset() is not None,
                )
            else:
                out[name] = ("group", "name" in obj.attrs, attrs)
        h5.visititems(visit)
    return out


def _without_names(config):
    if isinstance(config, dict):
        return {k: _without_names(v) for k, v in config.items() if k != "name"}
    if isinstance(config, list):
        return [_without_names(v) for v in config]
    return config


@pytest.mark.parametrize(
    "cls, kwargs", [(keras_hub.models.GemmaBackbone, GEMMA), (keras_hub.models.LlamaBackbone, LLAMA)]
)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_files_as_save_to_preset(cls, kwargs, dtype, tmp_path):
    ours = write_synthetic_preset(str(tmp_path / "ours"), cls, dtype=dtype, tokenizer=False, **kwargs)
    cls(**kwargs, dtype=dtype).save_to_preset(str(tmp_path / "stock"))
    assert sorted(os.listdir(ours)) == sorted(os.listdir(tmp_path / "stock"))
    assert _structure(os.path.join(ours, "model.weights.h5")) == _structure(
        tmp_path / "stock" / "model.weights.h5"
    )
    with open(os.path.join(ours, "config.json")) as f, open(tmp_path / "stock" / "config.json") as g:
        assert _without_names(json.load(f)) == _without_names(json.load(g))
    with open(os.path.join(ours, "metadata.json")) as f, open(tmp_path / "stock" / "metadata.json") as g:
        mine, theirs = json.load(f), json.load(g)
    assert mine["parameter_count"] == theirs["parameter_count"]
    assert mine["tasks"] == theirs["tasks"]


def test_stock_from_preset_loads_it_and_values_are_random_and_seeded(tmp_path):
    a = write_synthetic_preset(str(tmp_path / "a"), keras_hub.models.GemmaBackbone, seed=1, **GEMMA)
    b = write_synthetic_preset(str(tmp_path / "b"), keras_hub.models.GemmaBackbone, seed=1, **GEMMA)
    c = write_synthetic_preset(str(tmp_path / "c"), keras_hub.models.GemmaBackbone, seed=2, **GEMMA)
    backbone = keras_hub.models.Backbone.from_preset(a)
    assert isinstance(backbone, keras_hub.models.GemmaBackbone)
    table = np.asarray(backbone.token_embedding.embeddings.numpy())
    assert abs(table.std() - 0.02) < 0.002 and abs(table.mean()) < 0.002
    values = {p: [np.asarray(v.numpy()) for v in keras_hub.models.Backbone.from_preset(p).weights] for p in (b, c)}
    for x, y in zip(values[b], [np.asarray(v.numpy()) for v in backbone.weights]):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(values[b][0], values[c][0])
    # Distinct variables get distinct values.
    assert not np.array_equal(values[b][2], values[b][3])


def test_streaming_keeps_host_memory_bounded(tmp_path):
    # A 256 MB float32 embedding written in 8 MB bands: neither the model
    # nor a whole tensor is ever in memory.
    kwargs = dict(GEMMA, vocabulary_size=65536, hidden_dim=1024, num_layers=1, intermediate_dim=64)
    gc.collect()
    live_before = live_device_bytes()
    memory.reset_host_peak_rss()
    rss_before = memory.current_rss_bytes()
    path = write_synthetic_preset(
        str(tmp_path / "big"), keras_hub.models.GemmaBackbone, dtype="float32",
        chunk_bytes=8 << 20, tokenizer=False, **kwargs,
    )
    growth = memory.host_peak_rss_bytes() - rss_before
    size = os.path.getsize(os.path.join(path, "model.weights.h5"))
    assert size > 256e6
    assert growth < 64e6, f"host peak grew {growth / 1e6:.1f} MB writing {size / 1e6:.0f} MB"
    assert live_device_bytes() <= live_before + 1024
    datasets = read_datasets([os.path.join(path, "model.weights.h5")])
    assert all(d.contiguous for d in datasets.values())


@pytest.mark.parametrize("cls", [keras_hub.models.GemmaBackbone, keras_hub.models.LlamaBackbone, keras_hub.models.QwenBackbone])
def test_tokenizer_makes_task_loading_work(cls, tmp_path):
    kwargs = dict(LLAMA, num_layers=1)
    if cls is keras_hub.models.GemmaBackbone:
        kwargs["head_dim"] = 8
    path = write_synthetic_preset(str(tmp_path / "p"), cls, tokenizer=True, **kwargs)
    assert os.path.exists(os.path.join(path, "tokenizer.json"))
    lm = keras_hub.models.CausalLM.from_preset(path)
    assert lm.preprocessor.tokenizer.vocabulary_size() == kwargs["vocabulary_size"]
    out = lm.generate(["the quick brown"], max_length=8)
    assert isinstance(out[0], str) and out[0].startswith("the quick")


def test_named_architecture_with_overrides(tmp_path):
    path = write_synthetic_preset(
        str(tmp_path / "g"), "gemma2_7b", num_layers=1, vocabulary_size=512,
        hidden_dim=64, intermediate_dim=128, num_query_heads=4, num_key_value_heads=4,
        head_dim=16, dtype="bfloat16",
    )
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["registered_name"] == "keras_hub>GemmaBackbone"
    assert config["config"]["num_layers"] == 1 and config["config"]["hidden_dim"] == 64
    assert config["config"]["dtype"]["config"]["name"] == "bfloat16"
    backbone = keras_hub.models.Backbone.from_preset(path, dtype="bfloat16")
    with open(os.path.join(path, "metadata.json")) as f:
        assert json.load(f)["parameter_count"] == backbone.count_params()


def test_bad_input(tmp_path, monkeypatch):
    os.makedirs(tmp_path / "exists")
    with pytest.raises(PresetError, match="already exists"):
        write_synthetic_preset(str(tmp_path / "exists"), "gemma_2b_en")
    with pytest.raises(UnknownPresetError, match="gemma_7b"):
        write_synthetic_preset(str(tmp_path / "x"), "gemma_7bb")
    with pytest.raises(PresetError, match="Expected architecture to be"):
        write_synthetic_preset(str(tmp_path / "y"), 42)
    # A failure while writing (here: the 3rd band of random values) removes
    # the half-written directory.
    calls = []
    real = synthetic._random

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(synthetic, "_random", failing)
    with pytest.raises(OSError, match="No space left"):
        write_synthetic_preset(str(tmp_path / "z"), keras_hub.models.GemmaBackbone, **GEMMA)
    assert len(calls) == 3
    assert not os.path.exists(tmp_path / "z")
    assert keras.distribution.distribution() is None
