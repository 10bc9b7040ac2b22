"""`load_sharded_preset`: equals stock `from_preset`, no spike, clear errors."""

import gc
import json
import os
import shutil
import threading

import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES, failing_on_call, jitted_outputs

import keras_hub_dist
from keras_hub_dist import LayoutError, PresetError, _compat
from keras_hub_dist.storage import host_io
from keras_hub_dist.measure import memory, program_watch
from keras_hub_dist.measure.event_samples import sampling_after_calls
from keras_hub_dist import load_sharded_preset, write_synthetic_preset
from keras_hub_dist.load.source import resolve_source

SMALL = dict(
    vocabulary_size=512, num_layers=2, num_query_heads=8, num_key_value_heads=8,
    hidden_dim=64, intermediate_dim=128,
)
FAMILIES = {
    "gemma": (keras_hub.models.GemmaBackbone, dict(SMALL, head_dim=8)),
    "llama": (keras_hub.models.LlamaBackbone, SMALL),
    "qwen": (keras_hub.models.QwenBackbone, SMALL),
}
PROMPTS = ["the quick brown fox", "w1 w2 w3", "over the lazy dog", "a"] * 2


def _forward(backbone, inputs):
    """The backbone's outputs, jitted: one compilation per model and mesh
    (the same program on the same mesh comes from the compilation cache)."""
    return np.asarray(jitted_outputs(backbone, inputs))


@pytest.fixture(scope="module")
def family_presets(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {
        # One decoder block keeps the nine generate() compilations cheap;
        # two-block presets are covered by the tests below.
        name: write_synthetic_preset(
            str(root / name), cls, dtype="float32", tokenizer=True, seed=i,
            **dict(kw, num_layers=1),
        )
        for i, (name, (cls, kw)) in enumerate(FAMILIES.items())
    }


@pytest.fixture(scope="module")
def stock_reference(family_presets):
    """Stock, unsharded `CausalLM.from_preset`: logits and greedy tokens."""
    refs = {}
    keras.distribution.set_distribution(None)
    for name, preset in family_presets.items():
        lm = keras_hub.models.CausalLM.from_preset(preset)
        lm.compile(sampler="greedy")
        inputs = lm.preprocessor.generate_preprocess(PROMPTS, sequence_length=8)
        inputs = {k: np.asarray(v) for k, v in inputs.items()}
        logits = _forward(lm.backbone, inputs)
        lm.preprocessor = None
        tokens = np.asarray(lm.generate(inputs, stop_token_ids=None)["token_ids"])
        refs[name] = (inputs, logits, tokens)
    return refs


@pytest.fixture(scope="module")
def stock_saved_gemma(tmp_path_factory):
    keras.utils.set_random_seed(3)
    backbone = keras_hub.models.GemmaBackbone(**FAMILIES["gemma"][1], dtype="float32")
    path = str(tmp_path_factory.mktemp("stock_saved") / "gemma")
    backbone.save_to_preset(path)
    return path


@pytest.fixture
def gemma_preset(stock_saved_gemma, tmp_path):
    """A backbone preset written by stock `save_to_preset` (float32): the
    test's own copy (tests edit, truncate or delete it) of one preset built
    once per module (each build compiled and ran stock's initializers)."""
    shutil.copytree(stock_saved_gemma, tmp_path / "gemma")
    return str(tmp_path / "gemma")


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharded_causal_lm_equals_stock_unsharded(family, mesh_shape, family_presets, stock_reference):
    inputs, ref_logits, ref_tokens = stock_reference[family]
    lm = load_sharded_preset(family_presets[family], mesh=mesh_shape, task="causal_lm")
    assert isinstance(lm, keras_hub.models.CausalLM)
    assert lm.preprocessor is not None and lm.preprocessor.tokenizer is not None

    distribution = keras.distribution.distribution()
    assert isinstance(distribution, keras.distribution.ModelParallel)
    assert tuple(distribution.device_mesh.shape) == mesh_shape
    sizes = dict(zip(("batch", "model"), mesh_shape))
    sharded = 0
    for variable in lm.backbone.weights:
        value = variable.value
        axes = tuple(distribution.get_variable_layout(variable).axes)
        spec = tuple(value.sharding.spec) + (None,) * (value.ndim - len(value.sharding.spec))
        assert spec == axes + (None,) * (value.ndim - len(axes)), variable.path
        parts = [
            int(np.prod([sizes[a] for a in ((e,) if isinstance(e, str) else e or ())]))
            for e in spec
        ]
        expected_shard = tuple(d // p for d, p in zip(value.shape, parts))
        assert {s.data.shape for s in value.addressable_shards} == {expected_shard}
        sharded += max(parts) > 1
    assert sharded >= len(lm.backbone.weights) // 2

    logits = _forward(lm.backbone, inputs)
    np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=0)
    if mesh_shape != (2, 4):
        # The logits checked the weights' placement on this mesh; generating
        # (a compiled sampling loop per mesh, most of this test's time) is
        # checked on the mesh that shards both axes.
        return
    lm.compile(sampler="greedy")
    lm.preprocessor = None
    tokens = np.asarray(lm.generate(inputs, stop_token_ids=None)["token_ids"])
    np.testing.assert_array_equal(tokens, ref_tokens)


@pytest.mark.parametrize(
    "saved, loaded", [("bfloat16", "float32"), ("float32", "bfloat16")]
)
def test_values_and_casts_equal_stock(saved, loaded, tmp_path):
    keras.utils.set_random_seed(4)
    kw = FAMILIES["llama"][1]
    keras_hub.models.LlamaBackbone(**kw, dtype=saved).save_to_preset(str(tmp_path / "p"))
    stock = keras_hub.models.Backbone.from_preset(str(tmp_path / "p"), dtype=loaded)
    stock_values = {v.path: np.asarray(v.numpy()) for v in stock.weights}
    ours = load_sharded_preset(str(tmp_path / "p"), mesh=(2, 4), dtype=loaded)
    for v in ours.weights:
        assert keras.backend.standardize_dtype(v.dtype) == loaded
        np.testing.assert_array_equal(np.asarray(v.numpy()), stock_values[v.path], err_msg=v.path)


def test_default_dtype_follows_from_preset(tmp_path):
    keras.utils.set_random_seed(5)
    kw = FAMILIES["qwen"][1]
    keras_hub.models.QwenBackbone(**kw, dtype="bfloat16").save_to_preset(str(tmp_path / "p"))
    stock = keras_hub.models.Backbone.from_preset(str(tmp_path / "p"))
    ours = load_sharded_preset(str(tmp_path / "p"))
    assert [v.dtype for v in ours.weights] == [v.dtype for v in stock.weights]


def test_task_preset_saved_by_kerashub(family_presets, stock_reference, tmp_path):
    # A preset with task.json / preprocessor.json, as `CausalLM.save_to_preset`
    # writes it.
    keras.distribution.set_distribution(None)
    lm = keras_hub.models.CausalLM.from_preset(family_presets["gemma"])
    lm.save_to_preset(str(tmp_path / "task"))
    assert os.path.exists(tmp_path / "task" / "task.json")
    ours = load_sharded_preset(str(tmp_path / "task"), mesh=(2, 4), task="causal_lm")
    assert type(ours) is type(lm)
    inputs, ref_logits, _ = stock_reference["gemma"]
    np.testing.assert_allclose(_forward(ours.backbone, inputs), ref_logits, atol=1e-5, rtol=0)


def test_chunked_compressed_dataset_is_read_through_h5py(gemma_preset):
    # Keras writes contiguous datasets; other tools may chunk and compress.
    name = "layers/gemma_decoder_block/gating_ffw/vars/0"

    def rechunk(h5):
        data = h5[name][()]
        del h5[name]
        h5.create_dataset(name, data=data, chunks=(16, 16), compression="gzip")

    _edit_weights(gemma_preset, rechunk)
    stock = keras_hub.models.Backbone.from_preset(gemma_preset)
    ours, report = load_sharded_preset(gemma_preset, mesh=(2, 4), memory_report=True)
    for a, b in zip(ours.weights, stock.weights):
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()), err_msg=a.path)
    assert report.bytes_read == report.file_bytes


def test_backbone_default_mesh_and_mesh_forms(gemma_preset):
    devices = jax.devices()
    forms = [
        None,
        (1, 8),
        {"batch": 1, "model": 8},
        keras.distribution.DeviceMesh((1, 8), ("batch", "model"), devices),
        jax.sharding.Mesh(np.array(devices).reshape(1, 8), ("batch", "model")),
    ]
    specs = None
    for form in forms:
        keras.distribution.set_distribution(None)
        backbone = load_sharded_preset(gemma_preset, mesh=form)
        assert isinstance(backbone, keras_hub.models.GemmaBackbone)
        mesh = keras.distribution.distribution().device_mesh
        assert tuple(mesh.shape) == (1, 8) and tuple(mesh.axis_names) == ("batch", "model")
        got = [tuple(v.value.sharding.spec) for v in backbone.weights]
        assert specs is None or got == specs
        specs = got
    # A user layout map (dict of regexes) replaces the family's.
    keras.distribution.set_distribution(None)
    backbone = load_sharded_preset(
        gemma_preset, mesh=(2, 4), layout_map={"token_embedding/embeddings": ("model", "batch")}
    )
    for v in backbone.weights:
        expected = ("model", "batch") if v.path == "token_embedding/embeddings" else ()
        assert tuple(e for e in v.value.sharding.spec if e) == tuple(e for e in expected if e)


def test_no_program_is_compiled_and_nothing_is_random_initialized(gemma_preset):
    compiled = []

    def record(executable, name):
        compiled.append((name, memory.compiled_memory(executable).get("output_bytes", 0)))

    with program_watch.watch_compilations(record):
        backbone = load_sharded_preset(gemma_preset, mesh=(2, 4))
    # Random init (or any re-shard) would compile an XLA program producing
    # weight-sized outputs. (KerasHub's constructors may compile scalar
    # helpers such as sqrt(hidden_dim) the first time in a process.)
    assert all(output_bytes <= 64 for _, output_bytes in compiled), compiled
    stock = keras_hub.models.Backbone.from_preset(gemma_preset)
    for a, b in zip(backbone.weights, stock.weights):
        np.testing.assert_array_equal(np.asarray(a.numpy()), np.asarray(b.numpy()))
    assert _compat.deferred_variables() == []


def test_model_owns_its_memory(gemma_preset):
    backbone = load_sharded_preset(gemma_preset, mesh=(1, 8))
    before = {v.path: np.array(v.numpy()) for v in backbone.weights}
    weights = os.path.join(gemma_preset, "model.weights.h5")
    size = os.path.getsize(weights)
    with open(weights, "r+b") as f:  # overwrite in place (a mapping would see it)
        f.write(b"\x00" * size)
    shutil.rmtree(gemma_preset)
    for v in backbone.weights:
        np.testing.assert_array_equal(np.asarray(v.numpy()), before[v.path], err_msg=v.path)
        for shard in v.value.addressable_shards:
            assert shard.data.is_fully_addressable


@pytest.fixture(scope="module")
def big_gemma(tmp_path_factory):
    """Bigger tables (4 MB embedding) so one whole tensor on a device shows:
    one preset (only read) for the three meshes and the stock measurement."""
    keras.utils.set_random_seed(6)
    kw = dict(FAMILIES["gemma"][1], vocabulary_size=8192, hidden_dim=128, intermediate_dim=256)
    path = str(tmp_path_factory.mktemp("big_gemma") / "p")
    keras_hub.models.GemmaBackbone(**kw, dtype="float32").save_to_preset(path)
    return path


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_each_byte_read_once_and_no_spike(mesh_shape, big_gemma):
    gc.collect()
    with memory.MemorySampler(interval_s=0.001) as sampler:
        backbone, report = load_sharded_preset(big_gemma, mesh=mesh_shape, memory_report=True)
    assert report.bytes_read == report.file_bytes
    assert report.model_bytes == sum(int(np.prod(v.shape)) * 4 for v in backbone.weights)
    added_final = {d: sampler.final_per_device[d] - sampler.start_per_device[d] for d in sampler.device_ids}
    added_peak = {d: sampler.peak_per_device[d] - sampler.start_per_device[d] for d in sampler.device_ids}
    # A few bytes of Keras scalars aside, devices hold exactly the plan.
    for d, final in added_final.items():
        assert 0 <= final - report.expected_per_device[d] <= 64, (d, final)
    for d, final in added_final.items():
        assert added_peak[d] / final <= 1.05, (d, added_peak[d], final)
    assert report.peak_over_final <= 1.05
    assert "peak/final" in str(report)


def test_stock_spike_is_visible_to_the_same_measurement(big_gemma):
    # The measurement above can fail: stock from_preset under the same
    # ModelParallel makes each tensor whole on device 0 (`assign` converts the
    # file's array there), then `jax.device_put`s it into its layout. One
    # sample right after each of those calls, while the whole tensor is still
    # referenced, sees that moment every time.
    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), jax.devices())
    layout_map = keras_hub_dist.get_layout_map(keras_hub.models.GemmaBackbone, mesh)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    gc.collect()
    with memory.MemorySampler(interval_s=0.001) as sampler:
        with sampling_after_calls(sampler, jax, "device_put") as at_device_put:
            with distribution.scope():
                backbone = keras_hub.models.Backbone.from_preset(big_gemma)
    start, final = sampler.start_per_device, sampler.final_per_device
    table = 8192 * 128 * 4  # the token embedding, 4 MiB
    # At the embedding's device_put, device 0 held the whole table.
    assert max(s[0] - start[0] for s in at_device_put) >= table
    ratios = [
        (sampler.peak_per_device[d] - start[d]) / (final[d] - start[d])
        for d in sampler.device_ids
    ]
    assert max(ratios) > 2.0
    del backbone


def test_progress_bar(gemma_preset, capsys):
    load_sharded_preset(gemma_preset, progress=False)
    assert capsys.readouterr().err == ""
    keras.distribution.set_distribution(None)
    load_sharded_preset(gemma_preset)  # stderr is not a TTY under pytest
    assert capsys.readouterr().err == ""
    keras.distribution.set_distribution(None)
    load_sharded_preset(gemma_preset, progress=True)
    err = capsys.readouterr().err
    assert "Loading gemma" in err and "100%" in err and err.endswith("\n")


def test_named_architecture_resolves_to_its_kerashub_handle():
    source = resolve_source("gemma2_7b")
    assert source.ref == keras_hub_dist.presets.resolve("gemma_7b_en").handle
    assert "gemma_7b_en" in source.ref


# --- bad input: a clear error before any device memory, nothing left behind --
# (`clean_state` is in conftest.py)


def _edit_weights(preset, edit):
    import h5py

    with h5py.File(os.path.join(preset, "model.weights.h5"), "r+") as h5:
        edit(h5)


def test_missing_weights_file(gemma_preset, clean_state):
    os.remove(os.path.join(gemma_preset, "model.weights.h5"))
    with clean_state(), pytest.raises(PresetError, match="has no weights. Expected model.weights.h5"):
        load_sharded_preset(gemma_preset)


def test_missing_config(tmp_path, clean_state):
    os.makedirs(tmp_path / "empty")
    with clean_state(), pytest.raises(PresetError, match="has no config.json"):
        load_sharded_preset(str(tmp_path / "empty"))


def test_misspelled_preset_name_suggests_close_names(clean_state):
    with clean_state(), pytest.raises(PresetError) as info:
        load_sharded_preset("gemma_7x_en", mesh=(1, 8))
    message = str(info.value)
    assert "Unknown preset 'gemma_7x_en'" in message
    assert "Did you mean" in message and "'gemma_7b_en'" in message
    assert "Unknown preset identifier" not in message  # not KerasHub's text


def test_directory_that_does_not_exist(tmp_path, clean_state):
    missing = str(tmp_path / "no_such_preset")
    with clean_state(), pytest.raises(PresetError) as info:
        load_sharded_preset(missing, mesh=(1, 8))
    assert f"The preset directory {missing!r} does not exist" in str(info.value)
    assert "its parent exists" in str(info.value)


def test_a_file_where_a_preset_directory_is_expected(gemma_preset, clean_state):
    config = os.path.join(gemma_preset, "config.json")
    with clean_state(), pytest.raises(PresetError) as info:
        load_sharded_preset(config, mesh=(1, 8))
    message = str(info.value)
    assert f"The preset {config!r} is a file. Expected a preset directory" in message
    assert f"Pass the directory it is in, {gemma_preset!r}" in message
    assert "does not exist" not in message


def test_layout_map_key_that_is_not_a_regular_expression(gemma_preset, clean_state):
    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), jax.devices())
    as_layout_map = keras.distribution.LayoutMap(mesh)
    as_layout_map["["] = (None, "model")
    for layout_map in ({"[": (None, "model")}, as_layout_map):
        with clean_state(), pytest.raises(LayoutError) as info:
            load_sharded_preset(gemma_preset, mesh=(1, 8), layout_map=layout_map)
        message = str(info.value)
        assert "Layout map key '[' is not a valid regular expression (unterminated character set" in message
        assert "Expected each layout-map key to be a regular expression" in message
        assert "escape it (re.escape): '\\\\['" in message


@pytest.mark.parametrize("dtype", ["int8", "int4", "int32", "int8_from_float32"])
def test_integer_dtype_points_to_quantize(gemma_preset, dtype, clean_state):
    with clean_state(), pytest.raises(keras_hub_dist.QuantizationError) as info:
        load_sharded_preset(gemma_preset, mesh=(1, 8), dtype=dtype)
    message = str(info.value)
    assert "Weights are loaded in a float dtype. Expected dtype to be a float dtype" in message
    assert f"Received: dtype={dtype!r}." in message
    assert 'For int8 weights, load in a float dtype and quantize: quantize="int8"' in message
    assert "(quantize= takes one of 'int8', 'int4')" in message
    assert "Cannot convert `policy`" not in message  # not Keras's text


def test_invalid_config_json_names_the_file_and_line(gemma_preset, clean_state):
    path = os.path.join(gemma_preset, "config.json")
    with open(path, "w") as f:
        f.write('{\n  "module": "keras_hub.src.models",\n  "class_name": \n}\n')
    with clean_state(), pytest.raises(PresetError) as info:
        load_sharded_preset(gemma_preset)
    message = str(info.value)
    assert repr(path) in message and "is not valid JSON" in message
    assert "line 4" in message


def test_truncated_weights_file(gemma_preset, clean_state):
    path = os.path.join(gemma_preset, "model.weights.h5")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)
    with clean_state(), pytest.raises(PresetError, match="is truncated"):
        load_sharded_preset(gemma_preset)


def test_variable_missing_from_file(gemma_preset, clean_state):
    _edit_weights(gemma_preset, lambda h5: h5.__delitem__("layers/rms_normalization/vars/0"))
    with clean_state(), pytest.raises(PresetError, match=r"missing from the file:\s+final_normalization/scale \(shape \(64,\)"):
        load_sharded_preset(gemma_preset)


def test_variable_extra_in_file(gemma_preset, clean_state):
    _edit_weights(gemma_preset, lambda h5: h5.create_dataset("layers/extra/vars/0", data=np.ones(3)))
    with clean_state(), pytest.raises(PresetError, match=r"match no variable[\s\S]*layers/extra/vars/0"):
        load_sharded_preset(gemma_preset)


def test_shape_mismatch(gemma_preset, clean_state):
    def edit(h5):
        del h5["layers/reversible_embedding/vars/0"]
        h5.create_dataset("layers/reversible_embedding/vars/0", data=np.zeros((500, 64), np.float32))

    _edit_weights(gemma_preset, edit)
    with clean_state(), pytest.raises(PresetError, match=r"token_embedding/embeddings: shape mismatch. Expected \(512, 64\). Received on disk: \(500, 64\)"):
        load_sharded_preset(gemma_preset)


def test_dtype_mismatch(gemma_preset, clean_state):
    def edit(h5):
        del h5["layers/rms_normalization/vars/0"]
        h5.create_dataset("layers/rms_normalization/vars/0", data=np.zeros((64,), np.int8))

    _edit_weights(gemma_preset, edit)
    with clean_state(), pytest.raises(PresetError, match=r"final_normalization/scale: dtype mismatch. Expected float32 .* Received on disk: int8"):
        load_sharded_preset(gemma_preset)


def test_unsupported_architecture(gemma_preset, tmp_path, clean_state):
    config_path = os.path.join(gemma_preset, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["registered_name"] = "keras_hub>NoSuchBackbone"
    with open(config_path, "w") as f:
        json.dump(config, f)
    with clean_state(), pytest.raises(PresetError, match="Unsupported architecture.*NoSuchBackbone"):
        load_sharded_preset(gemma_preset)

    hf = tmp_path / "hf"
    os.makedirs(hf)
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with clean_state(), pytest.raises(
        PresetError, match=r"converter for model_type='llama' cannot read the config.json.*no key 'rope_theta'"
    ):
        load_sharded_preset(str(hf))
    (hf / "config.json").write_text(json.dumps({"architecture": "llama"}))
    with clean_state(), pytest.raises(PresetError, match="no known format.*'architecture'"):
        load_sharded_preset(str(hf))



def test_family_without_a_layout_map_is_planned(tmp_path):
    """A registered backbone with no hand-written map loads with plan_layout."""
    keras.utils.set_random_seed(1)
    stock = keras_hub.models.BertBackbone(
        vocabulary_size=64, num_layers=1, num_heads=2, hidden_dim=16,
        intermediate_dim=32, max_sequence_length=16,
    )
    stock.save_to_preset(str(tmp_path / "bert"))
    inputs = {"token_ids": np.arange(16).reshape(2, 8) % 64,
              "segment_ids": np.zeros((2, 8), "int32"),
              "padding_mask": np.ones((2, 8), "int32")}

    def sequence_output(backbone):
        return np.asarray(jitted_outputs(backbone, inputs)["sequence_output"])

    expected = sequence_output(stock)
    with pytest.warns(keras_hub_dist.LayoutFallbackWarning, match="plan_layout"):
        model = load_sharded_preset(str(tmp_path / "bert"), mesh=(1, 8), progress=False)
    table = model.get_layer("token_embedding").embeddings.value
    assert table.sharding.spec[0] == "model"  # planned: vocabulary split
    np.testing.assert_allclose(sequence_output(model), expected, rtol=1e-5, atol=1e-5)


def test_mesh_axis_names_the_map_does_not_use(gemma_preset, clean_state):
    with clean_state(), pytest.raises(LayoutError, match=r"mesh axis names \('data', 'tensor'\).*Expected axes named 'model'"):
        load_sharded_preset(gemma_preset, mesh={"data": 1, "tensor": 8})
    with clean_state(), pytest.raises(LayoutError, match="names mesh axis 'model', which the mesh does not have"):
        load_sharded_preset(
            gemma_preset, mesh={"batch": 1, "tensor": 8},
            layout_map={"token_embedding/embeddings": ("model", None)},
        )
    with clean_state(), pytest.raises(LayoutError, match=r"mesh axes \['model'\] are used by no layout"):
        load_sharded_preset(gemma_preset, mesh=(1, 8), layout_map={"nothing_matches": (None,)})


def test_indivisible_dimension_suggests_a_mesh(tmp_path, clean_state):
    keras.utils.set_random_seed(7)
    kw = dict(FAMILIES["gemma"][1], vocabulary_size=260)
    keras_hub.models.GemmaBackbone(**kw, dtype="float32").save_to_preset(str(tmp_path / "p"))
    with clean_state(), pytest.raises(LayoutError) as info:
        load_sharded_preset(
            str(tmp_path / "p"), mesh=(1, 8),
            layout_map={"token_embedding/embeddings": ("model", None), ".*ffw_gating.*": (None, "model")},
        )
    message = str(info.value)
    assert "'token_embedding/embeddings' of shape (260, 64)" in message
    assert "dimension 0 (260)" in message
    assert "A mesh that works: mesh=(2, 4)" in message


def test_failure_while_reading_leaves_nothing_half_loaded(gemma_preset, monkeypatch, clean_state):
    flaky = failing_on_call(host_io.preadv_full, 6, OSError(5, "Input/output error"))
    monkeypatch.setattr(host_io, "preadv_full", flaky)
    with clean_state(), pytest.raises(PresetError, match=r"Loading variable '[^']+' .* failed: OSError"):
        load_sharded_preset(gemma_preset, mesh=(2, 4))
    # Every reader thread ended with the load: nothing reads on after it
    # (variables read ahead of the failing one may have finished first).
    assert not [t.name for t in threading.enumerate() if t.name.startswith("keras_hub_dist-")]
    assert len(flaky.calls) >= 6


def test_unknown_or_unavailable_task(gemma_preset, clean_state):
    with clean_state(), pytest.raises(PresetError, match="Unknown task 'poetry'"):
        load_sharded_preset(gemma_preset, task="poetry")
    with clean_state(), pytest.raises(PresetError, match="has no ImageClassifier task"):
        load_sharded_preset(gemma_preset, task="image_classifier")
