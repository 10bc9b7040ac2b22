"""Checkpoints saved by `transformers` 5 load, bitwise equal to stock KerasHub.

The fixtures (`tests/data/transformers5/<case>/`) are what `transformers`
5.23 `save_pretrained` wrote for each tested family
(`tools/write_transformers_configs.py`): its config.json and the names and
shapes of the tensors it saved. Here, without torch:

(a) every fixture's config converts to exactly the backbone of the
    published-style config of the same case (`tests/formats/hf`), and stock
    KerasHub's converter fails on, or builds another model from, exactly
    the fixtures the table has an entry for;
(b) a checkpoint with the fixture's config and tensor names loads sharded,
    bitwise equal to stock `Backbone.from_preset` of the same weights with
    the config (and tensor names) renamed back to what stock reads, and
    stock fails on the fixture itself where it does;
(c) a key missing for any other reason keeps a clear error.
"""

import copy
import functools
import json
import os
import re

import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES
from safetensors import SafetensorError

from keras_hub_dist import PresetError, load_sharded_preset
from keras_hub_dist import _compat
from keras_hub_dist.formats import huggingface
from keras_hub_dist.formats.hf_config_compat import (
    CONFIG_RENAMES,
    TENSOR_RENAMES,
    Gemma4GlobalAttention,
    KeyRename,
    RopeScalingFromParameters,
    compatible_config,
    stored_tensor_name,
)
from tests.formats.hf import dense, moe, recent
from tests.formats.hf.writer import random_float, write_hf_checkpoint

pytestmark = pytest.mark.usefixtures("short_delta_chunks")

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "transformers5")
CASES = sorted(c for c in os.listdir(FIXTURES) if os.path.isdir(os.path.join(FIXTURES, c)))
PUBLISHED = {case: module for module in (dense, moe, recent) for case in module.CASES}

# What stock KerasHub's converter makes of each fixture's config.json as
# transformers 5 wrote it, when that is not the published model: the
# families that need an entry of the table.
STOCK_ON_FIXTURE = {
    "qwen3_moe": KeyError("num_experts"),
    "llama": {"rope_frequency_adjustment_factor": None, "rope_low_freq_factor": None,
              "rope_high_freq_factor": None, "rope_pretraining_sequence_length": None},
    "gpt_oss": {"rope_scaling_factor": None},  # the backbone's default, 1.0, applies
    "gemma4_text": {"global_head_dim": None},
    "gemma4": {"global_head_dim": None},
    "gemma4_moe": {"global_head_dim": None, "num_global_key_value_heads": None},
}

# Tensor names as the published checkpoints (and stock KerasHub) spell them,
# written out here rather than taken from the table under test.
_STOCK_TENSOR_NAME = {
    "gemma3": lambda name: re.sub(r"^vision_tower\.", "vision_tower.vision_model.", name),
}

# gpt-oss experts as published (MXFP4): transformers writes them only from a
# GPU-quantized model, so the fixture has them dequantized (loaded as they
# are, see test_gpt_oss_unquantized_experts_load_as_they_are); the other
# loads use these.
_MXFP4_EXPERTS = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)(_blocks|_scales)$")
_PLAIN_EXPERTS = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$")


@functools.cache
def _fixture(case):
    with open(os.path.join(FIXTURES, case, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(FIXTURES, case, "tensors.json")) as f:
        shapes = {name: tuple(shape) for name, shape, _ in json.load(f)}
    return config, shapes


def _published(case):
    return PUBLISHED[case].hf_checkpoint(case, tied=False, dtype="float32")


def _comparable(kwargs):
    """Backbone kwargs, minus what differs between two builds for no reason:
    auto names (`gemma_backbone_1`, `gemma3_vision_encoder_1`) and a sliding window
    size the model does not use (transformers 5 writes null / 0 for it)."""
    kwargs = copy.deepcopy(kwargs)
    kwargs.pop("name", None)
    for value in kwargs.values():
        if isinstance(value, dict) and isinstance(value.get("config"), dict):
            value["config"].pop("name", None)
    if False in (kwargs.get("use_sliding_window_attention"), kwargs.get("use_sliding_window")):
        kwargs.pop("sliding_window_size", None)
    return kwargs


def test_fixtures_come_from_transformers_5_and_cover_every_tested_model_type():
    model_types = {_fixture(c)[0]["model_type"] for c in CASES}
    assert set(huggingface.TESTED_MODEL_TYPES) <= model_types
    for case in CASES:
        assert _fixture(case)[0]["transformers_version"].startswith("5."), case
    # Every entry of the table acts on some fixture.
    for model_type in CONFIG_RENAMES:
        assert any(
            compatible_config(_fixture(c)[0], c) != _fixture(c)[0]
            for c in CASES if _fixture(c)[0]["model_type"] == model_type
        ), model_type
    for model_type, entries in TENSOR_RENAMES.items():
        for entry in entries:
            names = [n for c in CASES if _fixture(c)[0]["model_type"] == model_type
                     for n in _fixture(c)[1]]
            assert any(n.startswith(entry.new) for n in names)
            assert not any(n.startswith(entry.old) for n in names)


@pytest.mark.parametrize("case", CASES)
def test_fixture_config_converts_to_the_published_backbone(case):
    config, _ = _fixture(case)
    published, _ = _published(case)
    cls, ours = huggingface.backbone_config(config, case)
    published_cls, expected = huggingface.backbone_config(published, case)
    assert cls is published_cls
    assert _comparable(ours) == _comparable(expected)

    # Stock reads the fixture wrongly exactly where the table has an entry.
    convert = _compat.transformers_converter(config).convert_backbone_config
    stock_fails = STOCK_ON_FIXTURE.get(case)
    assert (config["model_type"] in CONFIG_RENAMES) == (stock_fails is not None)
    if isinstance(stock_fails, KeyError):
        with pytest.raises(KeyError, match=stock_fails.args[0]):
            convert(copy.deepcopy(config))
        return
    with _compat.creating_variables_without_values():
        raw = {k: keras.layers.serialize(v) if isinstance(v, keras.layers.Layer) else v
               for k, v in convert(copy.deepcopy(config)).items()}
    if stock_fails is None:  # no entry needed: stock reads the fixture as we do
        assert _comparable(raw) == _comparable(ours)
    for key, value in (stock_fails or {}).items():
        assert raw.get(key) == value != ours.get(key), key


def _stock_name(case, name):
    return _STOCK_TENSOR_NAME.get(case, lambda n: n)(name)


def _tensor_shapes(case, quantized_experts):
    """{name: shape} of the fixture; gpt-oss experts in MXFP4 if asked."""
    _, shapes = _fixture(case)
    if case != "gpt_oss" or not quantized_experts:
        return dict(shapes)
    published = {n: v.shape for n, v in _published(case)[1].items()}
    shapes = {n: s for n, s in shapes.items() if not _PLAIN_EXPERTS.search(n)}
    shapes.update({n: s for n, s in published.items() if _MXFP4_EXPERTS.search(n)})
    return shapes


def _values(shapes, seed=0):
    rng = np.random.default_rng(seed)
    values = {}
    for name, shape in sorted(shapes.items()):
        if name.endswith("_blocks"):
            values[name] = rng.integers(0, 256, shape, dtype=np.uint8)
        elif name.endswith("_scales"):
            values[name] = rng.integers(120, 128, shape, dtype=np.uint8)
        else:
            values[name] = np.asarray(random_float(rng, shape, "float32"))
    return values


@pytest.mark.parametrize("case", CASES)
def test_tensor_names_are_the_published_ones_but_the_listed_renames(case):
    """Renamed tensors would break loading as surely as renamed keys: apart
    from gemma3's tower (and gpt-oss's experts, MXFP4 only when published),
    transformers 5 writes every tensor under its published name and shape."""
    shapes = _tensor_shapes(case, quantized_experts=True)
    published = {n: tuple(v.shape) for n, v in _published(case)[1].items()}
    assert {_stock_name(case, n): s for n, s in shapes.items()} == published


def _load_cases():
    cases = [(case, MESH_SHAPES[i % len(MESH_SHAPES)]) for i, case in enumerate(CASES)]
    # One dense and one MoE family that needed an entry, on every mesh.
    for case in ("llama", "qwen3_moe"):
        cases += [(case, mesh) for mesh in MESH_SHAPES if (case, mesh) not in cases]
    return cases


def _bits(value):
    array = np.asarray(value)
    return array.dtype, array.shape, np.atleast_1d(array).view(np.uint8).tobytes()


def _unnumbered(path):
    return re.sub(r"_\d+(?=/|$)", "", path)


# The first mesh each case loads on above: the tests below that only check
# what stock does with the fixture, and which model we build, reuse that load.
_MESH = {}
for _case, _mesh in _load_cases():
    _MESH.setdefault(_case, _mesh)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("transformers5"))


@functools.cache
def _fixture_checkpoint(workdir, case):
    """The fixture's config and tensors (gpt-oss experts in MXFP4), written
    once per case: every test of the case reads the same files.
    Returns (path, values, config.json as written)."""
    config, _ = _fixture(case)
    values = _values(_tensor_shapes(case, quantized_experts=True))
    path = write_hf_checkpoint(os.path.join(workdir, case, "transformers5"), config, values)
    with open(os.path.join(path, "config.json")) as f:
        return path, values, f.read()


@functools.cache
def _stock_of_renamed_back(workdir, case):
    """Stock `from_preset` of the same weights with the config and tensor
    names renamed back: one per case, for all its meshes (it does not depend
    on the mesh)."""
    _, values, _ = _fixture_checkpoint(workdir, case)
    stock_dir = write_hf_checkpoint(
        os.path.join(workdir, case, "stock"), compatible_config(_fixture(case)[0], case),
        {_stock_name(case, n): v for n, v in values.items()},
    )
    return keras_hub.models.Backbone.from_preset(stock_dir)


@functools.cache
def _ours(workdir, case, mesh):
    """Our sharded load of the fixture checkpoint, once per (case, mesh)."""
    path, _, _ = _fixture_checkpoint(workdir, case)
    return load_sharded_preset(path, mesh=mesh, memory_report=True, progress=False)


@pytest.mark.parametrize("case,mesh", _load_cases(), ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_fixture_checkpoint_loads_bitwise_equal_to_stock_of_the_renamed_back_one(case, mesh, workdir):
    ours_dir, values, original = _fixture_checkpoint(workdir, case)
    stock = _stock_of_renamed_back(workdir, case)
    model, report = _ours(workdir, case, mesh)

    assert open(os.path.join(ours_dir, "config.json")).read() == original  # file untouched
    assert type(model) is type(stock)
    assert _comparable(model.get_config()) == _comparable(stock.get_config())
    # The converter asked for every tensor transformers wrote, each read once.
    assert report.file_bytes == sum(v.nbytes for v in values.values())
    assert report.bytes_read == report.file_bytes or case == "gpt_oss"
    assert [_unnumbered(w.path) for w in model.weights] == [_unnumbered(w.path) for w in stock.weights]
    for weight, stock_weight in zip(model.weights, stock.weights):
        assert _bits(weight.value) == _bits(stock_weight.value), weight.path
        for shard in weight.value.addressable_shards:
            assert shard.data.shape == weight.value.sharding.shard_shape(weight.shape)


# Stock `from_preset` on the fixture checkpoint as transformers 5 wrote it.
_STOCK_FAILURE = {
    "qwen3_moe": (KeyError, "num_experts"),
    "gemma3": (SafetensorError, "vision_tower.vision_model.embeddings.patch_embedding.weight"),
    "gemma4_text": (ValueError, "cannot reshape"),
}


@pytest.mark.parametrize("case", sorted(_STOCK_FAILURE))
def test_stock_fails_on_the_fixture_checkpoint_where_we_load(case, workdir):
    config, _ = _fixture(case)
    path, _, _ = _fixture_checkpoint(workdir, case)
    error, text = _STOCK_FAILURE[case]
    with pytest.raises(error, match=re.escape(text)):
        keras_hub.models.Backbone.from_preset(path)
    # Our load of these same files (on the case's mesh above; which model it
    # builds does not depend on the mesh).
    model, _ = _ours(workdir, case, _MESH[case])
    assert type(model).__name__ == huggingface.backbone_config(config, case)[0].__name__


@pytest.mark.parametrize("case,attribute,stock_value,value", [
    ("llama", "rope_frequency_adjustment_factor", None, 32.0),
    ("gpt_oss", "rope_scaling_factor", 1.0, 32.0),
])
def test_stock_loads_the_fixture_checkpoint_silently_with_another_rope(
    case, attribute, stock_value, value, workdir
):
    path, _, _ = _fixture_checkpoint(workdir, case)
    stock = keras_hub.models.Backbone.from_preset(path)
    model, _ = _ours(workdir, case, _MESH[case])  # the same files' load above
    assert getattr(stock, attribute) == stock_value
    assert getattr(model, attribute) == value


def test_gpt_oss_unquantized_experts_load_as_they_are(tmp_path):
    """Transformers' float experts (`experts.gate_up_proj` (experts, in, out))
    are KerasHub's variable layout: loaded as they are, bitwise, where stock
    (MXFP4 only) fails."""
    config, shapes = _fixture("gpt_oss")
    values = _values(shapes)
    path = write_hf_checkpoint(str(tmp_path / "gpt_oss"), config, values)
    with pytest.raises(SafetensorError, match="gate_up_proj_blocks"):
        keras_hub.models.Backbone.from_preset(path)
    model = load_sharded_preset(path, mesh=(1, 8), progress=False)
    keras.distribution.set_distribution(None)
    experts = {v.path: v for v in model.weights if "/experts/" in v.path}
    assert len(experts) == 8
    for layer in range(2):
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            value = np.asarray(experts[f"transformer_layer_{layer}/sparse_moe_block/experts/{name}"])
            stored = values[f"model.layers.{layer}.mlp.experts.{name}"]
            assert value.shape == stored.shape and value.tobytes() == stored.tobytes(), (layer, name)


# ------------------------------------------------------------------ (c)


def test_a_key_missing_for_another_reason_keeps_a_clear_error(tmp_path, clean_state):
    config = copy.deepcopy(_fixture("qwen3")[0])
    del config["intermediate_size"]
    with pytest.raises(PresetError) as info:
        huggingface.backbone_config(config, "ckpt")
    message = str(info.value)
    assert "model_type='qwen3'" in message and "no key 'intermediate_size'" in message
    assert "renamed for this model type, read under their new names: none" in message

    config = copy.deepcopy(_fixture("qwen3_moe")[0])
    del config["num_local_experts"]
    path = write_hf_checkpoint(str(tmp_path / "qwen3_moe"), config, {})
    with clean_state(), pytest.raises(PresetError) as info:
        load_sharded_preset(path, mesh=(1, 8), progress=False)
    message = str(info.value)
    assert "model_type='qwen3_moe'" in message and "no key 'num_experts'" in message
    assert "num_local_experts -> num_experts" in message and "Fix:" in message


# ------------------------------------------------------------------ entries


def test_key_rename_acts_only_where_the_old_key_is_absent():
    config = {"model_type": "qwen3_moe", "num_local_experts": 8}
    assert compatible_config(config, "c") == {**config, "num_experts": 8}
    assert config == {"model_type": "qwen3_moe", "num_local_experts": 8}  # not mutated
    both = {"model_type": "qwen3_moe", "num_local_experts": 8, "num_experts": 8}
    assert compatible_config(both, "c") == both
    assert compatible_config({"model_type": "qwen3_moe"}, "c") == {"model_type": "qwen3_moe"}
    with pytest.raises(PresetError, match=r"'num_experts'.*'num_local_experts'.*Received: "
                       r"num_experts=16, num_local_experts=8"):
        compatible_config({**both, "num_experts": 16}, "c")
    nested = {"model_type": "x", "text_config": {"new": 1}}
    KeyRename(old="old", new="new", section="text_config").apply(nested, "c")
    assert nested["text_config"] == {"new": 1, "old": 1}


def test_rope_scaling_comes_from_rope_parameters_unless_default():
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}
    config = {"model_type": "llama", "rope_parameters": llama3}
    assert compatible_config(config, "c")["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0}
    assert compatible_config({**config, "rope_scaling": None}, "c")["rope_scaling"]["factor"] == 8.0
    default = {"model_type": "llama", "rope_parameters": {"rope_type": "default", "rope_theta": 1.0}}
    assert "rope_scaling" not in compatible_config(default, "c")
    with pytest.raises(PresetError, match="rope_scaling"):
        compatible_config({**config, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}}, "c")
    same = {**config, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert compatible_config(same, "c") == same
    nested = {"text_config": {"rope_parameters": llama3}}
    RopeScalingFromParameters(section="text_config").apply(nested, "c")
    assert nested["text_config"]["rope_scaling"]["factor"] == 8.0


def test_gemma4_global_attention_from_per_layer_config():
    text = {"layer_types": ["sliding_attention", "full_attention"] * 2,
            "per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 1},
                                 "3": {"head_dim": 16, "num_key_value_heads": 1}}}
    got = compatible_config({"model_type": "gemma4", "text_config": text}, "c")["text_config"]
    assert (got["global_head_dim"], got["num_global_key_value_heads"]) == (16, 1)
    # Heterogeneous layers, an override elsewhere, or a conflict: refused.
    for per_layer in ({"1": {"head_dim": 16}, "3": {"head_dim": 32}},
                      {"1": {"head_dim": 16}},
                      {"0": {"head_dim": 16}, "1": {"head_dim": 16}, "3": {"head_dim": 16}},
                      {"1": {"head_dim": 16, "sliding_window": 8}, "3": {"head_dim": 16, "sliding_window": 8}}):
        with pytest.raises(PresetError, match="per-layer attention sizes.*Received: per_layer_config="):
            Gemma4GlobalAttention().apply({"model_type": "gemma4_text", **text, "per_layer_config": per_layer}, "c")
    with pytest.raises(PresetError, match="global_head_dim"):
        compatible_config({"model_type": "gemma4_text", **text, "global_head_dim": 32}, "c")


def test_stored_tensor_name_only_for_a_missing_tensor_whose_new_name_exists():
    old, new = "vision_tower.vision_model.post_layernorm.weight", "vision_tower.post_layernorm.weight"
    assert stored_tensor_name("gemma3", old, {new}.__contains__) == new
    assert stored_tensor_name("gemma3", old, {old, new}.__contains__) is None
    assert stored_tensor_name("gemma3", old, set().__contains__) is None
    assert stored_tensor_name("gemma3_text", old, {new}.__contains__) is None
