"""`save_sharded_preset` in one process: the preset stock `save_to_preset`
writes (dataset for dataset), loadable by stock and by us on other meshes,
no device spike, crash-safe, checksummed, and clear errors."""

import contextlib
import gc
import json
import os
import shutil

import h5py
import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES, failing_on_call

from keras_hub_dist import _compat
from keras_hub_dist import PresetError, SaveError, load_sharded_preset, save_sharded_preset
from keras_hub_dist import write_synthetic_preset
from keras_hub_dist.formats import checksums, keras_h5
from keras_hub_dist.plan.build import build_without_values
from keras_hub_dist.save import saver
from keras_hub_dist.measure import memory
from keras_hub_dist.measure.event_samples import sampling_after_calls

SMALL = dict(
    vocabulary_size=512, num_layers=2, num_query_heads=8, num_key_value_heads=8,
    hidden_dim=64, intermediate_dim=128,
)
FAMILIES = {
    "gemma": (keras_hub.models.GemmaBackbone, dict(SMALL, head_dim=8)),
    "llama": (keras_hub.models.LlamaBackbone, SMALL),
    "qwen": (keras_hub.models.QwenBackbone, SMALL),
}


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    root = tmp_path_factory.mktemp("save_sources")
    return {
        name: write_synthetic_preset(
            str(root / name), cls, dtype="float32", tokenizer=True, seed=i, **kw
        )
        for i, (name, (cls, kw)) in enumerate(FAMILIES.items())
    }


def _weights_entry(folder):
    for name in ("model.weights.h5", "model.weights.json"):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise AssertionError(f"no weights in {os.listdir(folder)}")


def _datasets(folder, weights_name=None):
    """Every dataset of a preset's weights: name -> (values, attrs), plus
    every group's attributes."""
    entry = os.path.join(folder, weights_name) if weights_name else _weights_entry(folder)
    out = {}
    for path in keras_h5.weights_files(entry):
        with h5py.File(path, "r") as h5:
            def visit(name, obj, file=os.path.basename(path)):
                attrs = {k: str(v) for k, v in obj.attrs.items()}
                if isinstance(obj, h5py.Dataset):
                    out[name] = (file, obj[()], attrs, obj.dtype.str)
                else:
                    out[name + "/"] = (file, None, attrs, None)
            h5.visititems(visit)
    return out


def _assert_same_preset(ours, stock, weights_name=None):
    """Same files, same configs, same metadata (but the date and our
    checksums), every dataset and group equal (values bitwise)."""
    ours_files = sorted(f for f in os.listdir(ours))
    assert ours_files == sorted(os.listdir(stock))
    for name in ours_files:
        if name.endswith(".json") and name != "metadata.json":
            with open(os.path.join(ours, name)) as a, open(os.path.join(stock, name)) as b:
                assert json.load(a) == json.load(b), name
    with open(os.path.join(ours, "metadata.json")) as a, open(os.path.join(stock, "metadata.json")) as b:
        meta_ours, meta_stock = json.load(a), json.load(b)
    assert set(meta_ours.pop(checksums.METADATA_KEY)["checksums"]) >= {
        n for n in ours_files if ".weights." in n}
    meta_ours.pop("date_saved"), meta_stock.pop("date_saved")
    assert meta_ours == meta_stock
    a, b = _datasets(ours, weights_name), _datasets(stock, weights_name)
    assert sorted(a) == sorted(b)
    for name in a:
        (file_a, values_a, attrs_a, dtype_a), (file_b, values_b, attrs_b, dtype_b) = a[name], b[name]
        assert (file_a, attrs_a, dtype_a) == (file_b, attrs_b, dtype_b), name
        if values_a is not None:
            assert values_a.shape == values_b.shape and values_a.tobytes() == values_b.tobytes(), name


def _save_with_sampler(model, path, at_each_write=False, **kwargs):
    """Saves; returns (max over devices of peak / before, max added bytes,
    the samples taken as each value was written).

    With `at_each_write`, one sample is also taken as each value is written
    (`sampling_after_calls` on `saver.write_value`): a value that lives
    only while it is written (a merged LoRA kernel) is then measured at
    that moment, not only when the background thread happens to sample."""
    gc.collect()  # earlier tests' garbage must not be freed mid-sample
    with memory.MemorySampler() as sampler:
        with (sampling_after_calls(sampler, saver, "write_value") if at_each_write
              else contextlib.nullcontext([])) as at_writes:
            save_sharded_preset(model, path, **kwargs)
    devices = [d for d in sampler.start_per_device if sampler.start_per_device[d]]
    ratio = max(sampler.peak_per_device[d] / sampler.start_per_device[d] for d in devices)
    added = max(sampler.peak_per_device[d] - sampler.start_per_device[d] for d in devices)
    at_writes = [{d: s[d] - sampler.start_per_device[d] for d in devices} for s in at_writes]
    return ratio, added, at_writes, sampler


def _assert_same_weights(a, b):
    for x, y in zip(a.weights, b.weights, strict=True):
        assert x.path == y.path
        np.testing.assert_array_equal(np.asarray(x.value), np.asarray(y.value), err_msg=x.path)


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_backbone_saves_what_stock_saves(family, mesh_shape, presets, tmp_path):
    model = load_sharded_preset(presets[family], mesh=mesh_shape, progress=False)
    peak, *_ = _save_with_sampler(model, str(tmp_path / "ours"))
    assert peak <= 1.0  # no device computes or gathers anything
    model.save_to_preset(str(tmp_path / "stock"))  # stock, same model
    _assert_same_preset(str(tmp_path / "ours"), str(tmp_path / "stock"))

    keras.distribution.set_distribution(None)
    reference = keras_hub.models.Backbone.from_preset(presets[family])
    _assert_same_weights(reference, keras_hub.models.Backbone.from_preset(str(tmp_path / "ours")))
    other_mesh = (mesh_shape[1], mesh_shape[0])
    again = load_sharded_preset(str(tmp_path / "ours"), mesh=other_mesh, verify=True, progress=False)
    _assert_same_weights(reference, again)


def test_causal_lm_with_tokenizer_and_bfloat16(presets, tmp_path):
    lm = load_sharded_preset(presets["gemma"], mesh=(2, 4), task="causal_lm",
                             dtype="bfloat16", progress=False)
    save_sharded_preset(lm, str(tmp_path / "ours"))
    lm.save_to_preset(str(tmp_path / "stock"))
    _assert_same_preset(str(tmp_path / "ours"), str(tmp_path / "stock"))
    assert "tokenizer.json" in os.listdir(tmp_path / "ours")
    with h5py.File(tmp_path / "ours" / "model.weights.h5") as h5:
        embeddings = h5["layers/reversible_embedding/vars/0"]
        assert embeddings.attrs["dtype"] == "bfloat16" and embeddings.dtype.itemsize == 2

    keras.distribution.set_distribution(None)
    stock = keras_hub.models.CausalLM.from_preset(str(tmp_path / "ours"))
    ours = load_sharded_preset(str(tmp_path / "ours"), mesh=(1, 8), task="causal_lm",
                               verify=True, progress=False)
    _assert_same_weights(stock.backbone, ours.backbone)
    ours.compile(sampler="greedy")
    prompt = ["the quick brown fox", "a"]
    tokens = ours.generate(prompt, max_length=12)
    keras.distribution.set_distribution(None)
    stock.compile(sampler="greedy")
    assert tokens == stock.generate(prompt, max_length=12)


def test_multi_file_weights_as_keras_shards_them(presets, tmp_path):
    model = load_sharded_preset(presets["llama"], mesh=(1, 8), progress=False)
    save_sharded_preset(model, str(tmp_path / "ours"), max_shard_size=0.0002)
    model.save_to_preset(str(tmp_path / "stock"), max_shard_size=0.0002)
    files = sorted(os.listdir(tmp_path / "ours"))
    assert "model.weights.json" in files and "model_00002.weights.h5" in files
    _assert_same_preset(str(tmp_path / "ours"), str(tmp_path / "stock"))
    with open(tmp_path / "ours" / "model.weights.json") as a, open(tmp_path / "stock" / "model.weights.json") as b:
        assert json.load(a) == json.load(b)
    keras.distribution.set_distribution(None)
    _assert_same_weights(keras_hub.models.Backbone.from_preset(presets["llama"]),
                         load_sharded_preset(str(tmp_path / "ours"), mesh=(2, 4), verify=True,
                                             progress=False))


def test_lora_saves_merged_kernels_like_stock(presets, tmp_path):
    model = load_sharded_preset(presets["llama"], mesh=(1, 8), progress=False)
    model.enable_lora(rank=2)
    rng = np.random.default_rng(0)
    for variable in model.trainable_variables:  # the LoRA factors
        variable.assign(rng.standard_normal(variable.shape).astype("float32") * 0.1)
    _, added, at_writes, sampler = _save_with_sampler(model, str(tmp_path / "ours"), at_each_write=True)
    model.save_to_preset(str(tmp_path / "stock"))
    _assert_same_preset(str(tmp_path / "ours"), str(tmp_path / "stock"))
    lora_layers = [layer for layer in model._flatten_layers() if getattr(layer, "lora_enabled", False)]
    assert len(lora_layers) == 4
    kernel = int(np.prod(lora_layers[0]._kernel.shape)) * 4  # f32, all four alike
    assert all(int(np.prod(layer._kernel.shape)) * 4 == kernel for layer in lora_layers)
    # Measured at each write: a merged kernel is written in the kernel's own
    # sharding (JAX's `kernel + update` takes the sharded operand's), so the
    # only bytes added while it is written are one device's block of it.
    merged = [s for s in at_writes if any(s.values())]
    assert len(merged) == 4
    shard = kernel // 8  # mesh (1, 8): the kernel is split over 8 devices
    assert all(s == dict.fromkeys(s, shard) for s in merged), merged
    # Computing the merge is what costs: Keras's `(alpha / rank) *
    # matmul(lora_a, lora_b)` makes the LoRA product whole on every device
    # (its factors are replicated), then its scaled copy beside it, plus the
    # scalar: 2 kernels + 4 bytes per device for a moment, one layer at a
    # time (never all four), plus at most the temp of a program running
    # then. The background thread may or may not see that moment; whatever
    # it sees lies between the two bounds.
    temps = max(sampler.temp_per_device.values())
    assert shard <= added <= 2 * kernel + 4 + temps, (added, kernel, temps)


def test_overwrite_replaces_only_when_complete(presets, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(presets["qwen"], target)
    model = load_sharded_preset(presets["gemma"], mesh=(1, 8), progress=False)
    with pytest.raises(SaveError, match="non-empty directory.*overwrite=True"):
        save_sharded_preset(model, str(target))
    assert sorted(os.listdir(target)) == sorted(os.listdir(presets["qwen"]))
    save_sharded_preset(model, str(target), overwrite=True)
    keras.distribution.set_distribution(None)
    _assert_same_weights(keras_hub.models.Backbone.from_preset(presets["gemma"]),
                         keras_hub.models.Backbone.from_preset(str(target)))
    assert sorted(os.listdir(tmp_path)) == ["target"]  # nothing left beside it
    (tmp_path / "empty").mkdir()
    save_sharded_preset(model, str(tmp_path / "empty"))  # an empty directory is fine
    save_sharded_preset(model, str(tmp_path / "a" / "b" / "new"))  # parents are created


def test_overwrite_the_preset_the_model_was_loaded_from(presets, tmp_path):
    source = tmp_path / "source"
    shutil.copytree(presets["llama"], source)
    model = load_sharded_preset(str(source), mesh=(2, 4), progress=False)
    save_sharded_preset(model, str(source), overwrite=True)
    keras.distribution.set_distribution(None)
    _assert_same_weights(keras_hub.models.Backbone.from_preset(presets["llama"]),
                         keras_hub.models.Backbone.from_preset(str(source)))


def test_failed_write_leaves_the_target_untouched(presets, tmp_path, monkeypatch):
    target = tmp_path / "target"
    shutil.copytree(presets["qwen"], target)
    before = {n: (target / n).read_bytes() for n in os.listdir(target) if (target / n).is_file()}
    model = load_sharded_preset(presets["gemma"], mesh=(1, 8), progress=False)
    monkeypatch.setattr(os, "pwritev", failing_on_call(os.pwritev, 5, OSError(28, "No space left on device")))
    with pytest.raises(SaveError, match=r"Writing the weights failed.*writing '.*' \(dataset .*No space left"):
        save_sharded_preset(model, str(target), overwrite=True)
    monkeypatch.undo()
    assert {n: (target / n).read_bytes() for n in before} == before
    assert sorted(os.listdir(tmp_path)) == ["target"]  # the staging directory is gone
    assert all(not a.is_deleted() for a in jax.live_arrays())
    save_sharded_preset(model, str(target), overwrite=True)  # and a retry works


def test_verify_detects_changed_truncated_and_missing_checksums(presets, tmp_path):
    model = load_sharded_preset(presets["llama"], mesh=(1, 8), progress=False)
    save_sharded_preset(model, str(tmp_path / "p"))
    weights = tmp_path / "p" / "model.weights.h5"
    metadata = json.loads((tmp_path / "p" / "metadata.json").read_text())
    entry = metadata[checksums.METADATA_KEY]["checksums"]["model.weights.h5"]
    assert entry["size"] == weights.stat().st_size
    assert entry["sha256"] == checksums.file_checksum(str(weights)).digest

    original = weights.read_bytes()
    data = bytearray(original)
    middle = len(data) // 2
    data[middle] ^= 1
    weights.write_bytes(bytes(data))
    load_sharded_preset(str(tmp_path / "p"), mesh=(1, 8), progress=False)  # stock behaviour: silent
    with pytest.raises(PresetError, match=r"not the one that was saved.*bytes 0:\d+ of .*model.weights.h5"):
        load_sharded_preset(str(tmp_path / "p"), mesh=(1, 8), verify=True, progress=False)

    weights.write_bytes(bytes(data[:-100]))
    with pytest.raises(PresetError, match="truncated"):
        load_sharded_preset(str(tmp_path / "p"), mesh=(1, 8), verify=True, progress=False)

    with pytest.raises(PresetError, match="records no checksums.*verify=False"):
        load_sharded_preset(presets["llama"], mesh=(1, 8), verify=True, progress=False)

    weights.write_bytes(original)
    load_sharded_preset(str(tmp_path / "p"), mesh=(1, 8), verify=True, progress=False)
    metadata[checksums.METADATA_KEY]["checksums"]["model.weights.h5"]["sha256"] = "00"
    (tmp_path / "p" / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(PresetError, match="malformed"):
        load_sharded_preset(str(tmp_path / "p"), mesh=(1, 8), verify=True, progress=False)


def test_large_file_chunks_are_hashed_and_checked_each(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "CHUNK_BYTES", 1000)
    path = tmp_path / "w.h5"
    path.write_bytes(np.arange(3500, dtype=np.uint8).tobytes())
    entry = checksums.file_checksum(str(path))
    assert len(entry.chunks) == 4 and entry.size == 3500
    metadata = {checksums.METADATA_KEY: {"checksums": {"w.h5": entry.to_json()}}}
    checksums.verify_files([str(path)], metadata, "p")
    data = bytearray(path.read_bytes())
    data[2500] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(PresetError, match=r"bytes 2000:3000 of .*w.h5. changed"):
        checksums.verify_files([str(path)], metadata, "p")


def test_bad_inputs(presets, tmp_path):
    model = load_sharded_preset(presets["gemma"], mesh=(1, 8), progress=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(SaveError, match="Expected a directory.*Received: a file"):
        save_sharded_preset(model, str(tmp_path / "file"))
    with pytest.raises(SaveError, match="is a file, so nothing can be created"):
        save_sharded_preset(model, str(tmp_path / "file" / "preset"))
    with pytest.raises(SaveError, match="Expected a keras_hub.models.Backbone or Task.*Sequential"):
        save_sharded_preset(keras.Sequential([keras.layers.Dense(2)]), str(tmp_path / "s"))
    abstract, created = build_without_values(
        keras_hub.models.GemmaBackbone, dict(FAMILIES["gemma"][1], num_layers=1))
    try:
        with pytest.raises(SaveError, match="Expected every variable to hold a value"):
            save_sharded_preset(abstract, str(tmp_path / "abstract"))
    finally:
        _compat.forget_deferred_variables(created)
    model.built = False
    with pytest.raises(SaveError, match="Expected a built model"):
        save_sharded_preset(model, str(tmp_path / "unbuilt"))
    model.built = True
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing was created


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_read_only_parent(presets, tmp_path):
    model = load_sharded_preset(presets["gemma"], mesh=(1, 8), progress=False)
    (tmp_path / "ro").mkdir()
    os.chmod(tmp_path / "ro", 0o500)
    try:
        with pytest.raises(SaveError, match="cannot write to"):
            save_sharded_preset(model, str(tmp_path / "ro" / "preset"))
    finally:
        os.chmod(tmp_path / "ro", 0o700)


def test_unwritable_filesystem(presets):
    model = load_sharded_preset(presets["gemma"], mesh=(1, 8), progress=False)
    with pytest.raises(SaveError, match="Expected to create a directory beside preset_dir.*writable"):
        save_sharded_preset(model, "/proc/keras_hub_dist_preset")


def test_silent_unless_asked_and_progress_bar(presets, tmp_path, capsys):
    model = load_sharded_preset(presets["gemma"], mesh=(1, 8), progress=False)
    save_sharded_preset(model, str(tmp_path / "quiet"))
    assert capsys.readouterr() == ("", "")
    save_sharded_preset(model, str(tmp_path / "loud"), progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "Saving loud" in err


def test_fine_tune_and_save_example_of_the_readme(presets, tmp_path):
    """The README's "Fine-tune and save": load sharded -> LoRA fit ->
    save_sharded_preset -> stock from_preset."""
    lm = load_sharded_preset(presets["gemma"], mesh=(2, 4), task="causal_lm", progress=False)
    lm.backbone.enable_lora(rank=4)
    lm.preprocessor.sequence_length = 16
    lm.compile(optimizer=keras.optimizers.Adam(1e-2), weighted_metrics=["accuracy"])
    before = {v.path: np.asarray(v.value) for v in lm.backbone.trainable_variables}
    history = lm.fit(["the quick brown fox", "over the lazy dog"] * 4, epochs=2, batch_size=4,
                     verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert any(not np.array_equal(before[v.path], np.asarray(v.value))
               for v in lm.backbone.trainable_variables)
    save_sharded_preset(lm, str(tmp_path / "tuned"))
    lm.save_to_preset(str(tmp_path / "stock"))
    _assert_same_preset(str(tmp_path / "tuned"), str(tmp_path / "stock"))

    keras.distribution.set_distribution(None)
    stock = keras_hub.models.CausalLM.from_preset(str(tmp_path / "tuned"))
    stock.compile(sampler="greedy")
    tokens = stock.generate(["the quick brown fox"], max_length=12)
    ours = load_sharded_preset(str(tmp_path / "tuned"), mesh=(1, 8), task="causal_lm",
                               verify=True, progress=False)
    ours.compile(sampler="greedy")
    assert ours.generate(["the quick brown fox"], max_length=12) == tokens


def test_a_weight_larger_than_max_shard_size(presets, tmp_path):
    model = load_sharded_preset(presets["llama"], mesh=(1, 8), progress=False)
    with pytest.raises(SaveError, match=r"larger than max_shard_size.*Raise max_shard_size"):
        save_sharded_preset(model, str(tmp_path / "p"), max_shard_size=0.00001)
    assert os.listdir(tmp_path) == []
