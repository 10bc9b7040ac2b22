"""`load_sharded_preset(..., quantize=)`: bitwise stock's `quantize`, sharded.

The reference is stock, unsharded: `Backbone.from_preset(...)` then
`backbone.quantize(mode)`. Each family's float model comes from a tiny
Hugging Face checkpoint (float32 or bfloat16 file) and, saved by stock
`save_to_preset`, from a KerasHub preset with the same values; both must
load quantized to the reference's exact bits on every mesh.
"""

import functools
import gc
import os
import re
import threading

import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES, assert_laid_out_as, quantize_collecting_once

import keras_hub_dist
from keras_hub_dist import LayoutError, QuantizationError, load_sharded_preset
from keras_hub_dist import _compat
from keras_hub_dist.formats import synthetic
from keras_hub_dist.measure import memory
from tests.formats.hf import dense, moe
from tests.formats.hf.writer import write_hf_checkpoint

FAMILIES = {"gemma": dense, "llama": dense, "qwen3": dense, "qwen3_moe": moe}
# Each family's Hugging Face file in one float dtype, loaded into the other:
# a float32 file into bfloat16 (cast, then quantized in bfloat16), a
# bfloat16 file into float32 (quantized in float32). The KerasHub preset,
# saved from the loaded model, holds the model dtype: each family is loaded
# from both file dtypes, and both compute dtypes are covered.
FILE_DTYPE = {"gemma": "float32", "llama": "bfloat16", "qwen3": "float32", "qwen3_moe": "bfloat16"}
MODEL_DTYPE = {"float32": "bfloat16", "bfloat16": "float32"}
MODES = ("int8", "int4")


def _bits(array) -> bytes:
    return np.asarray(array).tobytes()


def _path(variable) -> str:
    """The path without the build-count suffix of an MoE block's name."""
    return re.sub(r"(moe_block)_\d+", r"\1", variable.path)


@functools.cache
def _checkpoints(root: str, family: str, file_dtype: str) -> dict:
    """The HF checkpoint, a KerasHub preset of the same float values, and
    the stock references of both modes."""
    config, tensors = FAMILIES[family].hf_checkpoint(family, tied=False, dtype=file_dtype, seed=7)
    hf = write_hf_checkpoint(os.path.join(root, f"{family}_{file_dtype}_hf"), config, tensors)
    keras.distribution.set_distribution(None)
    stock = keras_hub.models.Backbone.from_preset(hf, dtype=MODEL_DTYPE[file_dtype])
    kerashub = os.path.join(root, f"{family}_{file_dtype}_keras")
    stock.save_to_preset(kerashub)
    # Stock, unsharded: from_preset, then quantize. The model just saved is
    # the first mode's float model (one stock `from_preset` fewer); the
    # other mode quantizes a second one.
    references = {}
    for mode in MODES:
        if references:
            stock = keras_hub.models.Backbone.from_preset(hf, dtype=MODEL_DTYPE[file_dtype])
        quantize_collecting_once(stock, mode)
        references[mode] = {
            "weights": [(_path(v), str(v.dtype), tuple(v.shape), _bits(v.value)) for v in stock.weights],
            "policies": _quantized_policies(stock),
        }
    return {"huggingface": hf, "keras": kerashub, "references": references}


def _reference(root: str, family: str, file_dtype: str, mode: str) -> dict[str, tuple]:
    """Stock, unsharded: from_preset, then quantize: path -> (dtype, shape, bits)."""
    return _checkpoints(root, family, file_dtype)["references"][mode]


def _quantized_policies(model) -> dict[str, str]:
    """Layer path -> dtype policy name, of the quantized layers."""
    return {
        re.sub(r"(moe_block)_\d+", r"\1", l.path): l.dtype_policy.name
        for l in model._flatten_layers() if l.quantization_mode
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("quantize"))


# The KerasHub preset on the three meshes; the Hugging Face checkpoint (the
# same bytes read through another index, then the same quantization) on the
# mesh that shards both axes: its reads are checked on every mesh in
# tests/formats/test_huggingface_families.py.
FORMAT_MESHES = [("keras", mesh) for mesh in MESH_SHAPES] + [("huggingface", (2, 4))]


@pytest.mark.parametrize("fmt,mesh_shape", FORMAT_MESHES, ids=[f"{f}-{m[0]}x{m[1]}" for f, m in FORMAT_MESHES])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_quantized_load_is_stock_quantize_bitwise(family, mode, fmt, mesh_shape, root):
    file_dtype = FILE_DTYPE[family]
    reference = _reference(root, family, file_dtype, mode)
    model = load_sharded_preset(
        _checkpoints(root, family, file_dtype)[fmt], mesh=mesh_shape,
        dtype=MODEL_DTYPE[file_dtype], quantize=mode, progress=False,
    )
    ours = [(_path(v), str(v.dtype), tuple(v.shape), _bits(v.value)) for v in model.weights]
    assert [o[:3] for o in ours] == [r[:3] for r in reference["weights"]]
    different = [o[0] for o, r in zip(ours, reference["weights"]) if o[3] != r[3]]
    assert not different
    assert _quantized_policies(model) == reference["policies"]
    distribution = keras.distribution.distribution()
    assert_laid_out_as(model.weights, _compat.distribution_layout_map(distribution), distribution.device_mesh)
    if family == "qwen3_moe":  # expert banks: Keras leaves them in float
        banks = [v for v in model.weights if "experts" in v.path]
        assert banks and all(v.dtype == MODEL_DTYPE[file_dtype] for v in banks)
        assert any(v.value.sharding.spec != jax.sharding.PartitionSpec() for v in banks)


def _hard(tensors: dict, seed: int) -> dict:
    """The tensors with what decides a quantized bit: a spread of scales
    across both axes of each matrix (e^-3 .. e^1), a zero row and column (a
    zero channel), an outlier (40); still in the file's dtype."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, x in tensors.items():
        if x.ndim >= 2 and (x.dtype.kind == "f" or str(x.dtype) == "bfloat16"):
            wide = x.astype(np.float32)
            for axis in (-1, -2):
                spread = np.exp(rng.uniform(-3, 1, wide.shape[axis])).astype(np.float32)
                wide = wide * (spread if axis == -1 else spread[:, None])
            wide[..., 3] = 0.0
            wide[..., 3, :] = 0.0
            wide.reshape(-1)[5] = 40.0
            x = wide.astype(x.dtype)
        out[name] = x
    return out


@functools.cache
def _bfloat16_in_bfloat16(root: str, family: str) -> tuple[str, dict]:
    """A bfloat16 Hugging Face file of hard values and stock's quantized
    bfloat16 models (from_preset(dtype="bfloat16"), then quantize)."""
    config, tensors = FAMILIES[family].hf_checkpoint(family, tied=False, dtype="bfloat16", seed=11)
    hf = write_hf_checkpoint(os.path.join(root, f"{family}_bf16_in_bf16"), config, _hard(tensors, 11))
    references = {}
    for mode in MODES:
        keras.distribution.set_distribution(None)
        stock = keras_hub.models.Backbone.from_preset(hf, dtype="bfloat16")
        quantize_collecting_once(stock, mode)
        references[mode] = [(_path(v), str(v.dtype), tuple(v.shape), _bits(v.value)) for v in stock.weights]
    return hf, references


# A bfloat16 file quantized in bfloat16, the pair in which Keras's scale,
# products and quotients are bfloat16 (under ml_dtypes 0.7's NEP 50
# promotion), on values that decide bits (Gemma and Qwen3 also meet it
# through their KerasHub presets above, saved in bfloat16).
@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)], ids=["1x8", "2x4"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_file_quantized_in_bfloat16_is_stock_bitwise(family, mode, mesh_shape, root):
    hf, references = _bfloat16_in_bfloat16(root, family)
    model = load_sharded_preset(hf, mesh=mesh_shape, dtype="bfloat16", quantize=mode, progress=False)
    ours = [(_path(v), str(v.dtype), tuple(v.shape), _bits(v.value)) for v in model.weights]
    assert [o[:3] for o in ours] == [r[:3] for r in references[mode]]
    assert sum(o[1] == "int8" for o in ours) >= 2 * 4 + 1  # the embedding, each layer's attention
    assert not [o[0] for o, r in zip(ours, references[mode]) if o[3] != r[3]]


# --- a causal LM: generate, save, reload --------------------------------------

PROMPTS = ["the quick brown fox", "w1 w2 w3", "over the lazy dog", "a"] * 2
LM = dict(vocabulary_size=512, num_layers=1, num_query_heads=8, num_key_value_heads=8,
          hidden_dim=64, intermediate_dim=128)


@functools.cache
def _lm_preset(root: str) -> str:
    return synthetic.write_synthetic_preset(
        os.path.join(root, "lm"), keras_hub.models.LlamaBackbone, dtype="float32",
        tokenizer=True, seed=5, **LM,
    )


@functools.cache
def _stock_lm(root: str, mode: str):
    """Stock, unsharded: CausalLM.from_preset, then quantize."""
    keras.distribution.set_distribution(None)
    lm = keras_hub.models.CausalLM.from_preset(_lm_preset(root))
    # `lm.quantize` fails on the (unbuilt) tokenizer: quantize the backbone.
    quantize_collecting_once(lm.backbone, mode)
    return lm


def _greedy(lm, inputs):
    lm.compile(sampler="greedy")
    preprocessor, lm.preprocessor = lm.preprocessor, None
    try:
        return np.asarray(lm.generate(inputs, stop_token_ids=None)["token_ids"])
    finally:
        lm.preprocessor = preprocessor


def test_generate_of_a_quantized_lm_sharded_equals_stock(root):
    stock = _stock_lm(root, "int4")
    inputs = stock.preprocessor.generate_preprocess(PROMPTS, sequence_length=8)
    inputs = {k: np.asarray(v) for k, v in inputs.items()}
    tokens = _greedy(stock, inputs)
    keras.distribution.set_distribution(None)
    lm = load_sharded_preset(_lm_preset(root), mesh=(2, 4), task="causal_lm", quantize="int4", progress=False)
    np.testing.assert_array_equal(_greedy(lm, inputs), tokens)


@pytest.mark.parametrize("mode", MODES)
def test_quantized_preset_round_trips(mode, root, tmp_path):
    stock = _stock_lm(root, mode)
    keras.distribution.set_distribution(None)
    lm = load_sharded_preset(_lm_preset(root), mesh=(2, 4), task="causal_lm", quantize=mode, progress=False)
    assert lm.backbone.token_embedding.quantization_mode == mode
    for ours, ref in zip(lm.backbone.weights, stock.backbone.weights):
        assert ours.path == ref.path and _bits(ours.value) == _bits(ref.value), ours.path

    # Our sharded save, our sharded load on another mesh: bitwise.
    saved = str(tmp_path / "saved")
    keras_hub_dist.save_sharded_preset(lm, saved)
    keras.distribution.set_distribution(None)
    again = load_sharded_preset(saved, mesh=(8, 1), task="causal_lm", progress=False)
    assert [(v.path, _bits(v.value)) for v in again.backbone.weights] == [
        (v.path, _bits(v.value)) for v in lm.backbone.weights
    ]
    assert again.backbone.token_embedding.dtype_policy.name.startswith(mode)
    # Stock reloads it as it reloads its own quantized task presets (through
    # task.json), and not as a backbone: `Backbone.from_preset` passes
    # dtype=None over the saved policy map (see the README).
    keras.distribution.set_distribution(None)
    reloaded = keras_hub.models.CausalLM.from_preset(saved)
    assert [_bits(v.value) for v in reloaded.backbone.weights] == [_bits(v.value) for v in lm.backbone.weights]
    with pytest.raises(ValueError, match="could not be loaded"):
        keras_hub.models.Backbone.from_preset(saved)


def test_stock_quantized_backbone_preset_loads_sharded(root, tmp_path):
    stock = _stock_lm(root, "int4")
    stock.backbone.save_to_preset(str(tmp_path / "q"))
    with pytest.raises(ValueError, match="could not be loaded"):  # stock itself
        keras_hub.models.Backbone.from_preset(str(tmp_path / "q"))
    for mesh_shape in MESH_SHAPES:
        keras.distribution.set_distribution(None)
        ours = load_sharded_preset(str(tmp_path / "q"), mesh=mesh_shape, progress=False)
        assert [(v.path, _bits(v.value)) for v in ours.weights] == [
            (v.path, _bits(v.value)) for v in stock.backbone.weights
        ]
        distribution = keras.distribution.distribution()
        assert_laid_out_as(ours.weights, _compat.distribution_layout_map(distribution), distribution.device_mesh)


@pytest.mark.parametrize("mode", MODES)
def test_quantize_after_a_float_load_is_sharded_and_equals_stock(mode, root):
    # Stock under a plain ModelParallel: int4 kernels keep their float
    # kernels' paths, so a path-keyed layout map gives them the wrong rank.
    stock = _stock_lm(root, mode)
    model = load_sharded_preset(_lm_preset(root), mesh=(2, 4), progress=False)
    quantize_collecting_once(model, mode)
    assert [(v.path, _bits(v.value)) for v in model.weights] == [
        (v.path, _bits(v.value)) for v in stock.backbone.weights
    ]
    layout_map = keras_hub_dist.get_layout_map(model, keras.distribution.distribution().device_mesh)
    assert_laid_out_as(model.weights, layout_map, keras.distribution.distribution().device_mesh)
    sharded = [v for v in model.weights if v.dtype == "int8" and v.value.sharding.spec != jax.sharding.PartitionSpec()]
    assert len(sharded) >= 8


# --- memory: nothing but quantized blocks ever reaches a device -------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
def test_no_float_block_reaches_a_device(mode, mesh_shape, root, monkeypatch):
    kw = dict(LM, vocabulary_size=4096, hidden_dim=256, intermediate_dim=512, num_layers=1)
    preset = os.path.join(root, "memory")
    if not os.path.exists(preset):
        synthetic.write_synthetic_preset(preset, keras_hub.models.LlamaBackbone, dtype="float32", seed=2, **kw)
    placed: dict[int, int] = {}
    sampler = memory.MemorySampler(interval_s=60)
    put = jax.device_put

    def recording_put(value, device=None, *args, **kwargs):
        out = put(value, device, *args, **kwargs)
        if isinstance(device, jax.Device):
            placed[device.id] = placed.get(device.id, 0) + value.nbytes
            if np.dtype(value.dtype).kind == "f":  # a float block: only small ones
                assert value.nbytes <= 4 * kw["vocabulary_size"], (value.shape, value.dtype)
            sampler.sample()  # at the moment each block lands
        return out

    monkeypatch.setattr(jax, "device_put", recording_put)
    gc.collect()
    with sampler:
        model, report = load_sharded_preset(
            preset, mesh=mesh_shape, dtype="bfloat16", quantize=mode, memory_report=True, progress=False
        )
    final = {d: sampler.final_per_device[d] - sampler.start_per_device[d] for d in sampler.device_ids}
    peak = {d: sampler.peak_per_device[d] - sampler.start_per_device[d] for d in sampler.device_ids}
    for d in sampler.device_ids:
        assert 0 <= final[d] - report.expected_per_device[d] <= 64
        assert placed[d] == report.expected_per_device[d]  # each byte placed once
        assert peak[d] <= 1.05 * final[d], (d, peak[d], final[d])
    float_bytes = sum(np.prod(v.shape) * 2 for v in model.weights if v.dtype == "bfloat16")
    assert float_bytes < 0.1 * sum(report.expected_per_device.values())


@pytest.mark.parametrize("mode", MODES)
def test_each_float_tensor_is_read_once(mode, root, monkeypatch):
    """On one process with every reduced extent in one host block, a
    tensor's values, scale and zero come from one reading of it: the scale
    reuses the statistics the values kept (read one after another on one
    prefetch thread), a row-sharded embedding's scale included, assembled
    from every values block's."""
    from keras_hub_dist.quantize import quantizer as quantize_module

    read: dict[str, int] = {}
    size: dict[str, int] = {}
    lock = threading.Lock()  # the slabs of one tensor are read on several threads
    original = quantize_module.TensorQuantizer._read_raw

    def counting_read(self, x_index, scratch):
        block = original(self, x_index, scratch)
        with lock:
            read[self.tensor.float_path] = read.get(self.tensor.float_path, 0) + block.size
            size[self.tensor.float_path] = int(np.prod(self.x.shape))
        return block

    monkeypatch.setattr(quantize_module.TensorQuantizer, "_read_raw", counting_read)
    load_sharded_preset(_lm_preset(root), mesh=(1, 8), quantize=mode, progress=False)
    assert len(read) == 2 + 7 * LM["num_layers"], sorted(read)  # embeddings, lm head, 7 kernels a layer
    assert read == size


# --- bad input: a clear error before any device memory ----------------------


def test_unknown_mode_lists_the_modes(root, clean_state):
    with clean_state(), pytest.raises(QuantizationError, match=r"Expected quantize= to be one of 'int8', 'int4'.*Received: quantize='int2'"):
        load_sharded_preset(_lm_preset(root), quantize="int2")


def test_dtype_int8_points_to_quantize(root, clean_state):
    with clean_state(), pytest.raises(QuantizationError, match=r"Weights are loaded in a float dtype.*For int8 weights, load in a float dtype and quantize: quantize=\"int8\" \(quantize= takes one of 'int8', 'int4'\)"):
        load_sharded_preset(_lm_preset(root), dtype="int8")


def test_a_mode_this_keras_lacks(root, clean_state, monkeypatch):
    monkeypatch.setattr(_compat, "quantization_modes", lambda: ("int8", "float8"))
    with clean_state(), pytest.raises(QuantizationError, match=r"does not support quantize='int4'. Expected a mode of Keras's `model.quantize`: 'int8', 'float8'"):
        load_sharded_preset(_lm_preset(root), quantize="int4")


def test_int8_with_a_float16_dtype(root, clean_state):
    with clean_state(), pytest.raises(QuantizationError, match="quantize='int8' cannot take dtype='float16'"):
        load_sharded_preset(_lm_preset(root), quantize="int8", dtype="float16")


def test_int4_packed_axis_the_mesh_does_not_divide(tmp_path, clean_state):
    # Gate kernel (36, 24): float layout (None, 'model') is valid on 8
    # devices (24 = 8 x 3), its int4 packing (36, 12) is not, nor can the
    # 36 rows take the axis.
    preset = synthetic.write_synthetic_preset(
        str(tmp_path / "p"), keras_hub.models.LlamaBackbone, dtype="float32",
        vocabulary_size=64, num_layers=1, num_query_heads=6, num_key_value_heads=6,
        hidden_dim=36, intermediate_dim=24,
    )
    layout = {".*feedforward_gate_dense.kernel": (None, "model")}
    with clean_state(), pytest.raises(
        LayoutError,
        match=r"feedforward_gate_dense/kernel': they are packed two per byte along axis 1, which holds 12 bytes \(24 int4 values\).*e\.g\. \[1, 2, 3, 4, 6, 12\]",
    ):
        load_sharded_preset(preset, mesh=(1, 8), layout_map=layout, quantize="int4")
