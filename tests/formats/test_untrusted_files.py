"""What a hostile checkpoint cannot make the package do, and the guards that
already held: no code from a checkpoint (classes only registered Keras /
KerasHub ones, built in Keras's safe mode, which the package never turns
off), no file outside it through HDF5 (external links, external raw
storage, virtual datasets), no giant allocation from a safetensors header
length, no pickle anywhere.
"""

import json
import os
import pathlib
import re
import shutil
import struct
import sys

import h5py
import keras
import keras_hub
import numpy as np
import pytest

from keras_hub_dist import PresetError, load_sharded_preset, write_synthetic_preset
from keras_hub_dist.formats import keras_h5, safetensors_files
from keras_hub_dist.storage import locations

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "keras_hub_dist"
TINY = dict(vocabulary_size=64, num_layers=1, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=16, intermediate_dim=32, head_dim=8)


@pytest.fixture(scope="module")
def keras_dir(tmp_path_factory):
    path = write_synthetic_preset(str(tmp_path_factory.mktemp("keras") / "gemma"),
                                  keras_hub.models.GemmaBackbone, dtype="float32", tokenizer=True,
                                  progress=False, **TINY)
    keras.distribution.set_distribution(None)
    return path


def _package_sources():
    return {p: p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def test_the_package_never_unpickles():
    offenders = []
    for path, text in _package_sources().items():
        for n, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\bpickle\b|cPickle|torch\.load|joblib\.load|dill\b", code) or (
                re.search(r"\b(np|numpy)\.load\(", code) and "allow_pickle=False" not in code
            ):
                offenders.append(f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}")
    assert not offenders, offenders


def test_the_package_never_turns_keras_safe_mode_off():
    offenders = [
        f"{path.relative_to(PACKAGE)}: {m.group(0)}"
        for path, text in _package_sources().items()
        for m in re.finditer(r"enable_unsafe_deserialization|safe_mode\s*=\s*(False|0|None)|SafeModeScope\(\s*False", text)
    ]
    assert not offenders, offenders


def _edit_json(path, edit):
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


def test_a_tokenizer_of_an_unregistered_class_is_refused_and_nothing_is_imported(
        keras_dir, tmp_path, monkeypatch, clean_state):
    """Its module would run code on import: it is never imported."""
    marker = tmp_path / "ran"
    (tmp_path / "khd_payload.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n"
        "class Payload:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ckpt = tmp_path / "ckpt"
    shutil.copytree(keras_dir, ckpt)
    _edit_json(ckpt / "tokenizer.json", lambda c: c.update(
        module="khd_payload", class_name="Payload", registered_name="khd>Payload"))
    with clean_state(), pytest.raises(PresetError, match=r"names the class 'Payload' of module 'khd_payload'"):
        load_sharded_preset(str(ckpt), mesh=(1, 8), task="causal_lm", progress=False)
    assert not marker.exists() and "khd_payload" not in sys.modules


def test_keras_hub_own_path_guard_holds_inside_our_loader(keras_dir, tmp_path, monkeypatch):
    """Our loader builds the tokenizer in Keras's safe mode: with our own
    check of tokenizer paths out of the way, KerasHub's refuses the path."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(keras_dir, ckpt)
    outside = tmp_path / "outside.spm"
    shutil.copy(ckpt / "assets" / "tokenizer" / "vocabulary.spm", outside)
    _edit_json(ckpt / "tokenizer.json", lambda c: c["config"].update(proto=str(outside)))
    monkeypatch.setattr(locations, "check_asset_paths", lambda *a, **k: None, raising=False)
    with pytest.raises(Exception, match="outside of the model archive") as info:
        load_sharded_preset(str(ckpt), mesh=(1, 8), task="causal_lm", progress=False)
    assert "safe_mode=False" in str(info.value)  # Keras's safe mode said no
    keras.distribution.set_distribution(None)


def _h5_with(tmp_path, make):
    path = str(tmp_path / "model.weights.h5")
    with h5py.File(path, "w") as f:
        f.create_dataset("vars/0", data=np.zeros(4, np.float32))
        make(f, tmp_path)
    return path


def _external_link(f, tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as other:
        other.create_dataset("secret", data=np.arange(4, dtype=np.float32))
    f["vars/1"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "/secret")


def _external_storage(f, tmp_path):
    (tmp_path / "raw.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    f.create_dataset("vars/1", shape=(4,), dtype=np.float32, external=[(str(tmp_path / "raw.bin"), 0, 16)])


def _virtual(f, tmp_path):
    with h5py.File(tmp_path / "other.h5", "w") as other:
        other.create_dataset("secret", data=np.arange(4, dtype=np.float32))
    layout = h5py.VirtualLayout(shape=(4,), dtype=np.float32)
    layout[:] = h5py.VirtualSource(str(tmp_path / "other.h5"), "secret", shape=(4,))
    f.create_virtual_dataset("vars/1", layout)


@pytest.mark.parametrize("make,match", [
    (_external_link, "contains a ExternalLink"), (_external_storage, "stored in an external file"),
    (_virtual, "is a virtual dataset"),
])
def test_hdf5_reaching_another_file_is_refused(tmp_path, make, match):
    with pytest.raises(PresetError, match=match):
        keras_h5.read_datasets([_h5_with(tmp_path, make)])


def test_hdf5_external_link_is_refused_through_the_loader(keras_dir, tmp_path, clean_state):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(keras_dir, ckpt)
    with h5py.File(ckpt / "model.weights.h5", "a") as f:
        _external_link(f, tmp_path)
    with clean_state(), pytest.raises(PresetError, match="ExternalLink"):
        load_sharded_preset(str(ckpt), mesh=(1, 8), progress=False)


def test_a_safetensors_header_length_of_2_to_the_63_is_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", 2**63) + b'{"__metadata__":{}}')
    with pytest.raises(PresetError, match=str(2**63)):
        safetensors_files.read_header(str(path))
