"""A local checkpoint is untrusted input: the names its indexes and configs
give, and its symlinks, never reach a file outside its directory
(`storage.names`), except a Hugging Face cache snapshot's links into its
own repository's `blobs/`, which load byte-identical.

Every refusal is a `PresetError` naming the file, the rule and the fix,
raised before any value is read.
"""

import json
import os
import shutil

import keras
import keras_hub
import numpy as np
import pytest

from keras_hub_dist import PresetError, load_sharded_preset, write_synthetic_preset
from tests.formats.hf import dense
from tests.formats.hf.writer import write_hf_checkpoint

SHARD = "model-00001-of-00002.safetensors"
TINY = dict(vocabulary_size=64, num_layers=1, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=16, intermediate_dim=32, head_dim=8)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A two-shard Hugging Face checkpoint, written once (tests copy it)."""
    config, tensors = dense.hf_checkpoint("llama", tied=False, dtype="float32", seed=0)
    return write_hf_checkpoint(str(tmp_path_factory.mktemp("hf") / "llama"), config, tensors, num_shards=2)


@pytest.fixture(scope="module")
def keras_dir(tmp_path_factory):
    """A tiny KerasHub Gemma preset with its tokenizer, written once."""
    path = write_synthetic_preset(str(tmp_path_factory.mktemp("keras") / "gemma"),
                                  keras_hub.models.GemmaBackbone, dtype="float32", tokenizer=True,
                                  progress=False, **TINY)
    keras.distribution.set_distribution(None)
    return path


def _copy(source, tmp_path, name="ckpt"):
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def _rename_in_index(path, old, new):
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: (new if v == old else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))


def _refused(path, match, clean_state, **kwargs):
    with clean_state(), pytest.raises(PresetError, match=match) as info:
        load_sharded_preset(str(path), mesh=(1, 8), progress=False, **kwargs)
    return str(info.value)


def test_index_naming_a_shard_outside_with_dot_dot_is_refused(hf_dir, tmp_path, clean_state):
    ckpt = _copy(hf_dir, tmp_path)
    (tmp_path / "elsewhere").mkdir()
    shutil.move(ckpt / SHARD, tmp_path / "elsewhere" / SHARD)
    _rename_in_index(ckpt, SHARD, f"../elsewhere/{SHARD}")
    message = _refused(ckpt, r"has a '\.\.' segment", clean_state)
    assert "model.safetensors.index.json" in message and f"../elsewhere/{SHARD}" in message
    assert "Fix the name" in message


def test_index_naming_an_absolute_path_is_refused(hf_dir, tmp_path, clean_state):
    ckpt = _copy(hf_dir, tmp_path)
    outside = tmp_path / SHARD
    shutil.move(ckpt / SHARD, outside)
    _rename_in_index(ckpt, SHARD, str(outside))
    _refused(ckpt, "is an absolute path", clean_state)


@pytest.mark.parametrize("name,rule", [
    (f"sub//{SHARD}", "empty segment"), (f"sub\\{SHARD}", "backslash"),
    (f"C:{SHARD}", "drive letter"), (f"{SHARD}\x00.txt", "NUL"),
])
def test_index_names_breaking_the_other_rules_are_refused(hf_dir, tmp_path, clean_state, name, rule):
    ckpt = _copy(hf_dir, tmp_path)
    os.makedirs(ckpt / "sub", exist_ok=True)
    shutil.copy(ckpt / SHARD, ckpt / "sub" / SHARD)  # `sub//x` opens it on POSIX
    _rename_in_index(ckpt, SHARD, name)
    _refused(ckpt, rule, clean_state)


def test_shard_symlinked_outside_the_directory_is_refused(hf_dir, tmp_path, clean_state):
    ckpt = _copy(hf_dir, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.move(ckpt / SHARD, outside)
    os.symlink(outside, ckpt / SHARD)
    message = _refused(ckpt, "outside the checkpoint", clean_state)
    assert str(outside) in message and "Copy the file into the checkpoint" in message


def test_keras_weights_symlinked_outside_is_refused(keras_dir, tmp_path, clean_state):
    ckpt = _copy(keras_dir, tmp_path)
    outside = tmp_path / "outside.weights.h5"
    shutil.move(ckpt / "model.weights.h5", outside)
    os.symlink(outside, ckpt / "model.weights.h5")
    _refused(ckpt, "outside the checkpoint", clean_state)


def test_keras_shard_index_naming_a_file_outside_is_refused(keras_dir, tmp_path, clean_state):
    ckpt = _copy(keras_dir, tmp_path)
    shutil.move(ckpt / "model.weights.h5", tmp_path / "model_00000.weights.h5")
    (ckpt / "model.weights.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {"/vars": "../model_00000.weights.h5"}}))
    message = _refused(ckpt, r"has a '\.\.' segment", clean_state)
    assert "model.weights.json" in message


def test_tokenizer_config_naming_a_file_outside_is_refused(keras_dir, tmp_path, clean_state):
    """KerasHub's tokenizers open a string `proto` as a path, as given: a
    preset's tokenizer.json must not name one (stock writes null)."""
    ckpt = _copy(keras_dir, tmp_path)
    outside = tmp_path / "outside.spm"
    shutil.copy(ckpt / "assets" / "tokenizer" / "vocabulary.spm", outside)
    config = json.loads((ckpt / "tokenizer.json").read_text())
    assert config["config"]["proto"] is None  # as stock saves it
    config["config"]["proto"] = str(outside)
    (ckpt / "tokenizer.json").write_text(json.dumps(config))
    message = _refused(ckpt, "proto=", clean_state, task="causal_lm")
    assert "tokenizer.json" in message and str(outside) in message


def test_hf_cache_snapshot_links_into_its_blobs_load_byte_identical(hf_dir, tmp_path, monkeypatch):
    """The real cache layout: every snapshot file a relative symlink to
    `../../blobs/<hash>` of the same repository."""
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--someone--tiny-llama"
    snapshot = repo / "snapshots" / ("a" * 40)
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, name in enumerate(sorted(os.listdir(hf_dir))):
        shutil.copy(os.path.join(hf_dir, name), repo / "blobs" / f"{i:064x}")
        os.symlink(f"../../blobs/{i:064x}", snapshot / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    cached = load_sharded_preset("hf://someone/tiny-llama", mesh=(2, 4), progress=False)
    keras.distribution.set_distribution(None)
    local = load_sharded_preset(hf_dir, mesh=(2, 4), progress=False)
    keras.distribution.set_distribution(None)
    assert len(cached.weights) == len(local.weights) > 0
    for a, b in zip(cached.weights, local.weights):
        assert np.asarray(a.value).tobytes() == np.asarray(b.value).tobytes(), a.path
    # A link of that snapshot to another repository's blobs is refused.
    other = tmp_path / "hub" / "models--else--where" / "blobs"
    other.mkdir(parents=True)
    os.replace(repo / "blobs" / f"{0:064x}", other / "x")
    link = snapshot / sorted(os.listdir(hf_dir))[0]
    link.unlink()
    os.symlink(other / "x", link)
    with pytest.raises(PresetError, match="outside the checkpoint"):
        load_sharded_preset("hf://someone/tiny-llama", mesh=(2, 4), progress=False)
    keras.distribution.set_distribution(None)


@pytest.mark.parametrize("linked", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_peft_adapter_file_symlinked_outside_is_refused(hf_dir, tmp_path, clean_state, linked):
    import safetensors.numpy

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "bias": "none"}))
    safetensors.numpy.save_file(
        {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": np.zeros((2, 64), np.float32)},
        str(adapter / "adapter_model.safetensors"))
    shutil.move(adapter / linked, tmp_path / linked)
    os.symlink(tmp_path / linked, adapter / linked)
    with clean_state(), pytest.raises(PresetError, match="outside the checkpoint") as info:
        load_sharded_preset(hf_dir, mesh=(1, 8), progress=False, lora_adapter=str(adapter))
    assert linked in str(info.value)


@pytest.mark.parametrize("linked", ["pytree", "pytree/manifest.ocdbt"])
def test_an_orbax_step_reaching_outside_through_a_symlink_is_refused(tmp_path, linked):
    pytest.importorskip("orbax.checkpoint")
    from keras_hub_dist import CheckpointError
    from keras_hub_dist.load import orbax_checkpoint

    step = tmp_path / "ckpt" / "3"
    (step / "pytree").mkdir(parents=True)
    (step / "_CHECKPOINT_METADATA").write_text("{}")
    (step / "pytree" / "manifest.ocdbt").write_bytes(b"")
    outside = tmp_path / "outside" / linked
    outside.parent.mkdir(parents=True)
    shutil.move(step / linked, outside)
    os.symlink(outside, step / linked)
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        orbax_checkpoint.resolve_step(str(step), None)
