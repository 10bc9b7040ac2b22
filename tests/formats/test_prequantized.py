"""The Hub's pre-quantized checkpoints (FP8, compressed-tensors int4, GPTQ,
AWQ), loaded sharded, against their writers' own readers.

The fixtures in tests/data/prequantized/ were written by the real writers
(llmcompressor 0.14, transformers' FineGrainedFP8Config, gptqmodel 7.7) on a
tiny Llama, with the logits of their readers (transformers, float32, CPU;
gptqmodel's decoded weights in a float32 forward); regenerate
them with tools/make_prequantized_fixtures.py in a separate venv. The suite
needs none of those installs.
"""

import functools
import json
import os
import shutil

import numpy as np
import pytest
from conftest import MESH_SHAPES, jitted_outputs, quantize_collecting_once

from keras_hub_dist import PresetError, load_sharded_preset, save_sharded_preset

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "prequantized")
FP8 = ("fp8_native", "ct_fp8_block", "ct_fp8_dynamic")
INT4 = ("ct_w4a16", "ct_w4a16_asym", "gptq", "gptq_desc_act", "awq_gemm")
TOLERANCE = 1e-4


def _token_ids():
    with open(os.path.join(DATA, "token_ids.json")) as f:
        return np.array(json.load(f), dtype=np.int32)


def _logits(backbone):
    """The backbone's forward pass jitted, then Keras's reverse embedding."""
    ids = _token_ids()
    hidden = jitted_outputs(backbone, {"token_ids": ids, "padding_mask": np.ones_like(ids)})
    return np.asarray(backbone.token_embedding(hidden, reverse=True), dtype=np.float32)


@functools.cache
def _loaded(name, mesh_shape, quantize=None):
    return load_sharded_preset(
        os.path.join(DATA, name), mesh=mesh_shape, dtype="float32", quantize=quantize, progress=False
    )


def _reference(name):
    return np.load(os.path.join(DATA, name, "reference_logits.npy"))


def _modes(backbone):
    return {
        layer.path: layer.quantization_mode
        for layer in backbone._flatten_layers()
        if getattr(layer, "quantization_mode", None) is not None
    }


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
@pytest.mark.parametrize("name", FP8 + INT4)
def test_loads_equal_to_the_writers_reader(name, mesh_shape):
    backbone = _loaded(name, mesh_shape)
    logits = _logits(backbone)
    assert logits.dtype == np.float32
    np.testing.assert_allclose(logits, _reference(name), rtol=0, atol=TOLERANCE)
    modes = _modes(backbone)
    if name in INT4:
        # Every projection in Keras's int4 layers, the checkpoint's groups of
        # 128; lm_head (ignored by the recipe) and the embeddings in float.
        assert len(modes) == 7 and set(modes.values()) == {"int4"}
        layer = backbone.get_layer("transformer_layer_0")._feedforward_gate_dense
        assert layer.dtype_policy.name == "int4/128_from_float32"
        kernel = layer._kernel
        assert kernel.dtype == "int8" and tuple(kernel.shape) == (256, 128)  # 4 bits a weight
    else:
        assert modes == {}  # dequantized into the compute dtype


def test_fp8_into_keras_int8_equals_quantizing_the_float_load():
    """quantize="int8": Keras's int8 of the dequantized weights, bitwise."""
    quantized = _loaded("ct_fp8_block", (2, 4), "int8")
    assert set(_modes(quantized).values()) == {"int8"}
    fresh = load_sharded_preset(os.path.join(DATA, "ct_fp8_block"), mesh=(2, 4), dtype="float32", progress=False)
    quantize_collecting_once(fresh, "int8")  # Keras's own quantize, its gc.collect()s deferred
    ours = {v.path: np.asarray(v) for v in quantized.weights}
    stock = {v.path: np.asarray(v) for v in fresh.weights}
    assert ours.keys() == stock.keys()
    for path, value in stock.items():
        assert ours[path].dtype == value.dtype and np.array_equal(ours[path], value), path


def test_int4_saves_as_a_keras_quantized_preset_and_reloads_equal(tmp_path):
    backbone = _loaded("ct_w4a16_asym", (2, 4))
    save_sharded_preset(backbone, str(tmp_path / "preset"))
    reloaded = load_sharded_preset(str(tmp_path / "preset"), mesh=(8, 1), dtype="float32", progress=False)
    assert _modes(reloaded) == _modes(backbone)
    for a, b in zip(backbone.weights, reloaded.weights):
        assert a.path == b.path and np.array_equal(np.asarray(a), np.asarray(b)), a.path


def _copy(tmp_path, name, edit_config=None):
    target = tmp_path / name
    shutil.copytree(os.path.join(DATA, name), target)
    if edit_config is not None:
        with open(target / "config.json") as f:
            config = json.load(f)
        edit_config(config["quantization_config"])
        with open(target / "config.json", "w") as f:
            json.dump(config, f)
    return str(target)


def _fails(path, clean_state, match):
    with clean_state(), pytest.raises(PresetError, match=match) as info:
        load_sharded_preset(path, progress=False)
    return str(info.value)


def _group(c):
    return c["config_groups"]["group_0"]["weights"]


_VARIANTS = [
    ("ct_w4a16", lambda c: _group(c).update(num_bits=8), "8-bit int weights in the 'pack-quantized' format"),
    ("ct_w4a16", lambda c: _group(c).update(num_bits=2), "2-bit int weights"),
    ("ct_w4a16", lambda c: _group(c).update(strategy="tensor_group"), "strategy 'tensor_group'"),
    ("ct_w4a16", lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask"}), "sparsity_config"),
    ("fp8_native", lambda c: c.update(activation_scheme="static"), "static activation scales"),
    ("fp8_native", lambda c: c.update(quant_method="gptq", bits=3), "quant_method='gptq': bits=3"),
    ("fp8_native", lambda c: c.update(quant_method="awq", bits=4, version="gemv"), "version='gemv'"),
    ("gptq", lambda c: c.update(bits=8), "quant_method='gptq': bits=8"),
    ("gptq", lambda c: c.update(checkpoint_format="marlin"), "checkpoint_format='marlin'"),
]


def test_unsupported_variants_are_named(tmp_path, clean_state):
    """Refused from config.json alone, before the model is built (one
    clean-state check around them all: each is a few milliseconds)."""
    with clean_state():
        for k, (name, edit, match) in enumerate(_VARIANTS):
            path = _copy(tmp_path / str(k), name, edit)
            with pytest.raises(PresetError, match=match) as info:
                load_sharded_preset(path, progress=False)
            assert "keras_hub_dist reads quant_method 'fp8'" in str(info.value)


def test_group_size_that_does_not_divide_the_input(tmp_path, clean_state):
    path = _copy(tmp_path, "ct_w4a16", lambda c: _group(c).update(group_size=96))
    _fails(path, clean_state, r"q_proj.weight' \(compressed-tensors\): the input axis \(256\) is not a multiple of group_size 96")


def test_tensors_that_disagree_with_the_config(tmp_path, clean_state):
    cases = [
        ("gptq_desc_act", lambda c: c.update(group_size=64),
         r"down_proj.weight' \(gptq\): 'model.layers.0.mlp.down_proj.qzeros' has shape \[2, 32\], expected \[4, 32\]"),
        ("fp8_native", lambda c: c.update(weight_block_size=[64, 64]),
         r"weight_scale_inv' has shape \[2, 2\], expected \[4, 4\] for 64 x 64 blocks"),
        ("ct_w4a16", lambda c: _group(c).update(group_size=64), r"weight_scale' has shape \[256, 2\], expected \[256, 4\]"),
    ]
    with clean_state():
        for k, (name, edit, match) in enumerate(cases):
            with pytest.raises(PresetError, match=match):
                load_sharded_preset(_copy(tmp_path / str(k), name, edit), progress=False)


@pytest.mark.parametrize("quantization", ["fp8_block", "w4a16"])
def test_synthetic_writer_quantized_checkpoints_load(tmp_path, quantization):
    """`write_synthetic_hf_checkpoint(..., quantization=)` (the benchmark's
    writer) writes what the loader reads: FP8 dequantized as float32(code) *
    block scale, W4A16 into Keras's int4 layers."""
    import keras_hub

    from keras_hub_dist import write_synthetic_hf_checkpoint
    from keras_hub_dist.formats.safetensors_files import checkpoint_files
    from keras_hub_dist.storage.locations import open_location

    config = dict(vocabulary_size=64, num_layers=1, num_query_heads=2, num_key_value_heads=1,
                  hidden_dim=256, intermediate_dim=256)
    path = str(tmp_path / quantization)
    write_synthetic_hf_checkpoint(path, keras_hub.models.Llama3Backbone, config, dtype="float32",
                                  quantization=quantization)
    backbone = load_sharded_preset(path, mesh=(2, 4), dtype="float32", progress=False)
    modes = set(_modes(backbone).values())
    assert modes == (set() if quantization == "fp8_block" else {"int4"})
    assert np.isfinite(_logits(backbone)).all()
    if quantization == "fp8_block":
        with open_location(path, path) as location:
            tensors = {n: t for h in checkpoint_files(location, path).headers.values() for n, t in h.tensors.items()}
        name = "model.layers.0.mlp.gate_proj.weight"
        codes = tensors[name].read(((0, 256), (0, 256))).astype(np.float32)
        scale = tensors[name + "_scale"].read(((0, 2), (0, 2)))
        expected = (codes * np.kron(scale, np.ones((128, 128), np.float32))).T
        layer = backbone.get_layer("transformer_layer_0")._feedforward_gate_dense
        assert np.array_equal(np.asarray(layer.kernel), expected)


@pytest.mark.parametrize("name", ["gptq_desc_act", "awq_gemm"])
def test_int4_kernels_keras_cannot_take_load_dequantized(name, monkeypatch):
    """A kernel that is not the transpose of its weight on Keras's int4
    matrix (e.g. Gemma's query kernels) loads dequantized per block, in the
    float dtype: here every kernel, forced so."""
    from keras_hub_dist.quantize import prequantized

    monkeypatch.setattr(prequantized, "int4_kernels", lambda backbone, index: {})
    backbone = load_sharded_preset(os.path.join(DATA, name), mesh=(2, 4), dtype="float32", progress=False)
    assert _modes(backbone) == {}
    np.testing.assert_allclose(_logits(backbone), _reference(name), rtol=0, atol=TOLERANCE)


def test_dequantized_blocks_of_a_reshaped_weight_equal_the_whole_tensors():
    """Any block of a converter's reshape / transpose of a quantized weight
    (heads split out of the rows, a block cut across heads) equals that
    block of the whole dequantized tensor."""
    from keras_hub_dist.formats import prequantized, transforms
    from keras_hub_dist.formats.safetensors_files import checkpoint_files
    from keras_hub_dist.storage.locations import open_location

    for name in ("ct_fp8_block", "gptq_desc_act", "awq_gemm", "ct_w4a16_asym"):
        path = os.path.join(DATA, name)
        with open(os.path.join(path, "config.json")) as f:
            scheme = prequantized.scheme(json.load(f), name)
        with open_location(path, name) as location:
            tensors = {n: t for h in checkpoint_files(location, name).headers.values() for n, t in h.tensors.items()}
        _, source = prequantized.dequantized_tensor(scheme, "model.layers.0.self_attn.q_proj.weight", tensors)
        whole = source.read(((0, 256), (0, 256)))
        heads = transforms.Transpose(transforms.reshape(source, (2, 128, 256)), (2, 0, 1))  # (in, heads, head_dim)
        expected = whole.reshape(2, 128, 256).transpose(2, 0, 1)
        for index in (((0, 256), (0, 2), (32, 96)), ((100, 200), (1, 2), (0, 128)), ((0, 256), (0, 2), (0, 128))):
            block = heads.read(index)
            assert np.array_equal(block, expected[tuple(slice(a, b) for a, b in index)]), (name, index)


def test_unpacked_zero_points_of_older_compressed_tensors(tmp_path):
    """compressed-tensors before packing zero points stored them as they
    are, `(out, groups)`: read the same."""
    from safetensors.numpy import load_file, save_file

    from keras_hub_dist.formats import prequantized
    from keras_hub_dist.formats.dequantize import unpack_int32
    from keras_hub_dist.formats.safetensors_files import checkpoint_files
    from keras_hub_dist.storage.locations import open_location

    path = os.path.join(DATA, "ct_w4a16_asym")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    zero = tensors[name + "_zero_point"]
    tensors[name + "_zero_point"] = np.ascontiguousarray(unpack_int32(zero, axis=0) - np.int8(8))
    with open(os.path.join(path, "config.json")) as f:
        scheme = prequantized.scheme(json.load(f), path)
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    save_file(tensors, str(unpacked / "model.safetensors"))
    reads = []
    for directory in (path, str(unpacked)):
        with open_location(directory, directory) as location:
            stored = {n: t for h in checkpoint_files(location, directory).headers.values() for n, t in h.tensors.items()}
        _, source = prequantized.dequantized_tensor(scheme, name, stored)
        reads.append(source.read(((0, 256), (0, 256))))
    assert np.array_equal(reads[0], reads[1])
