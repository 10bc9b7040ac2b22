"""Pre-quantized checkpoints of every family the issue names load sharded,
equal to the same weights dequantized into a plain float32 checkpoint.

Per family (Qwen 2.5, Qwen 3, Mistral, Gemma 2, Gemma 3 text, Qwen 3 MoE,
Mixtral; Llama is tests/formats/test_prequantized.py's, against the writers'
own readers) and per recipe, `write_synthetic_hf_checkpoint(...,
quantization=)` writes the checkpoint as llmcompressor lays it out:

- what is quantized: every attention projection (q / k / v / o) and every
  MLP projection (gate / up / down), for the MoE families each expert's
  (Qwen 3 MoE's `experts.{e}.{gate,up,down}_proj`, Mixtral's
  `experts.{e}.w1 / w2 / w3`); what is not (the recipes `ignore` it): the
  embeddings, the norms, Qwen 2.5's q / k / v biases, the MoE routers
  (`mlp.gate`, `block_sparse_moe.gate`) and lm_head;
- `fp8_block`: e4m3 weights, a float32 scale per 128 x 128 block;
  `w4a16`: int4 weights packed eight to an int32 along the input, a scale
  per group of 128 inputs, symmetric.

The reference is computed here, in NumPy, from the safetensors bytes alone
(FP8: `float32(code) * block scale`; int4: `(nibble - 8) * group scale`),
written as a float32 checkpoint of the same family, and loaded through the
package's float path (KerasHub's converter, as for any float checkpoint).
Every weight of the pre-quantized load equals the reference's bitwise: FP8
loads dequantized, in float32; W4A16 loads the kernels Keras's int4 matrix
can take (each the transpose of its weight) as int4 layers holding the
checkpoint's codes, compared after Keras's own dequantization, and the rest
(Gemma's q / k / v, whose converter scrambles the groups, and the MoE expert
banks, which are not Keras `Dense` / `EinsumDense` layers) dequantized into
float32. KerasHub's Mistral converter casts every weight to float16: its int4
layers hold the checkpoint's values, which round to the float path's
kernels. The W4A16 logits are within 1e-4 of the reference's. Each byte of
the files is read once (one process holds the 8 devices; an int4 group's
scales at most twice). Widths are 128, the group and block size; one layer;
mesh (2, 4) (test_prequantized.py sweeps the meshes on Llama).
"""

import json
import os
import re
import struct

import keras
import keras_hub
import ml_dtypes
import numpy as np
import pytest
from conftest import jitted_outputs

from keras_hub_dist import load_sharded_preset, write_synthetic_hf_checkpoint
from tests.formats.hf.writer import write_hf_checkpoint

TOLERANCE = 1e-4
GROUP = 128  # the writer's FP8 block side and int4 group size
_TINY = dict(vocabulary_size=128, num_layers=1, num_query_heads=8, num_key_value_heads=4, hidden_dim=128)
# The layers a W4A16 load makes int4: every projection whose kernel is its
# weight transposed on Keras's int4 matrix. Gemma's converters scramble the
# q / k / v groups (dequantized); the MoE expert banks are not Keras Dense /
# EinsumDense layers (dequantized).
_ATTENTION = {"query", "key", "value", "attention_output"}
_LLAMA_LIKE = _ATTENTION | {"feedforward_gate_dense", "feedforward_intermediate_dense", "feedforward_output_dense"}
_GEMMA = {"attention_output", "ffw_gating", "ffw_gating_2", "ffw_linear"}

# family: (backbone class, config, its int4 layers' names).
FAMILIES = {
    "qwen2.5": (keras_hub.models.QwenBackbone, dict(_TINY, intermediate_dim=128, tie_word_embeddings=False),
                _LLAMA_LIKE),
    "qwen3": (keras_hub.models.Qwen3Backbone, dict(_TINY, head_dim=16, intermediate_dim=128,
                                                  tie_word_embeddings=False), _LLAMA_LIKE),
    "mistral": (keras_hub.models.MistralBackbone, dict(_TINY, intermediate_dim=128, sliding_window=None),
                _LLAMA_LIKE),
    "gemma2": (keras_hub.models.GemmaBackbone, dict(
        _TINY, head_dim=16, intermediate_dim=256, use_post_ffw_norm=True, use_post_attention_norm=True,
        attention_logit_soft_cap=50.0, final_logit_soft_cap=30.0, use_sliding_window_attention=True,
        sliding_window_size=4), _GEMMA),
    "gemma3_text": (keras_hub.models.Gemma3Backbone, dict(
        _TINY, image_size=None, head_dim=16, intermediate_dim=128, use_post_ffw_norm=True,
        use_post_attention_norm=True, use_sliding_window_attention=True, sliding_window_size=4), _GEMMA),
    "qwen3_moe": (keras_hub.models.Qwen3MoeBackbone, dict(
        _TINY, head_dim=16, intermediate_dim=128, moe_intermediate_dim=128, num_experts=4, top_k=2,
        norm_top_k_prob=True), _ATTENTION),
    "mixtral": (keras_hub.models.MixtralBackbone, dict(
        _TINY, intermediate_dim=128, num_experts=4, top_k=2, sliding_window=None), _ATTENTION),
}
# KerasHub's Mistral converter casts every weight to float16 (then the
# variable's float32): the float path's kernels are the int4 ones so rounded.
_CONVERTER_DTYPE = {"mistral": np.float16}

_SAFETENSORS = {"F32": np.float32, "I32": np.int32, "F8_E4M3": ml_dtypes.float8_e4m3fn}


def read_safetensors(path):
    """`{name: array}` of a safetensors file, parsed here from its bytes."""
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header, base = json.loads(data[8 : 8 + size]), 8 + size
    return {
        name: np.frombuffer(data[base + entry["data_offsets"][0] : base + entry["data_offsets"][1]],
                            _SAFETENSORS[entry["dtype"]]).reshape(entry["shape"])
        for name, entry in header.items() if name != "__metadata__"
    }


def dequantized(tensors):
    """The float32 state dict the compressed-tensors tensors stand for."""
    out = {}
    for name, value in tensors.items():
        if name.endswith("_scale"):
            continue
        if name.endswith("weight_packed"):  # W4A16: nibble j of an int32 is input 8 k + j, stored q + 8
            weight = name[: -len("_packed")]
            shifts = np.arange(8, dtype=np.uint32) * 4
            nibbles = (value.view(np.uint32)[..., None] >> shifts) & 0xF
            codes = nibbles.reshape(value.shape[0], -1).astype(np.float32) - 8
            out[weight] = codes * np.repeat(tensors[weight + "_scale"], GROUP, axis=1)
        elif value.dtype == ml_dtypes.float8_e4m3fn:  # FP8: one scale per 128 x 128 block
            scale = np.repeat(np.repeat(tensors[name + "_scale"], GROUP, axis=0), GROUP, axis=1)
            out[name] = value.astype(np.float32) * scale[: value.shape[0], : value.shape[1]]
        else:
            out[name] = value
    return out


def _checkpoints(root, family, quantization):
    """The pre-quantized checkpoint, and its dequantized float32 twin."""
    cls, config, _ = FAMILIES[family]
    quantized = str(root / quantization)
    write_synthetic_hf_checkpoint(quantized, cls, config, dtype="float32", quantization=quantization,
                                  seed=7, progress=False)
    with open(os.path.join(quantized, "config.json")) as f:
        hf_config = json.load(f)
    assert hf_config.pop("quantization_config")["format"] == (
        "float-quantized" if quantization == "fp8_block" else "pack-quantized")
    stored = read_safetensors(os.path.join(quantized, "model.safetensors"))
    tensors = dequantized(stored)
    # Quantized: every projection and every expert's Linear; not the routers.
    held = {n.removesuffix("_packed") for n, v in stored.items()
            if n.endswith("weight_packed") or v.dtype == ml_dtypes.float8_e4m3fn}
    assert held == {n for n in tensors if re.search(r"(_proj|experts\.\d+\.w[123])\.weight$", n)}
    assert any(".experts." in n for n in held) == (family in ("qwen3_moe", "mixtral"))
    reference = write_hf_checkpoint(str(root / "reference"), hf_config, tensors)
    scale_bytes = sum(v.nbytes for n, v in stored.items() if n.endswith("_scale"))
    return quantized, reference, scale_bytes


def _leaf_layers(backbone):
    return [layer for layer in backbone._flatten_layers() if not list(layer._flatten_layers(include_self=False))]


def int4_kernel(layer, shape):
    """Keras's own dequantization of an int4 layer's kernel (`dequantize_with_sz_map`):
    `scale * (q - zero)` per group, the codes unpacked by Keras."""
    scale, zero = np.asarray(layer.kernel_scale), np.asarray(layer.kernel_zero)
    codes = np.asarray(keras.quantizers.unpack_int4(np.asarray(layer._kernel), scale.shape[1], axis=-1, dtype="int8"))
    groups = np.asarray(layer.g_idx).astype(np.int32)
    matrix = scale[groups] * (codes.astype(np.float32) - zero[groups].astype(np.float32))
    return matrix.reshape(shape)


def _logits(backbone):
    """One jitted forward pass (one compilation, not one per eager op)."""
    ids = np.array([[3, 17, 5, 90, 41, 8, 66, 12]], dtype=np.int32)
    hidden = jitted_outputs(backbone, {"token_ids": ids, "padding_mask": np.ones_like(ids)})
    embedding = backbone.token_embedding
    output = embedding.reverse_embeddings if not embedding.tie_weights else np.asarray(embedding.embeddings).T
    return np.asarray(hidden, np.float32) @ np.asarray(output, np.float32)


@pytest.mark.parametrize("quantization", ["fp8_block", "w4a16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_loads_equal_to_its_dequantized_float_checkpoint(tmp_path, family, quantization):
    quantized, reference, scale_bytes = _checkpoints(tmp_path, family, quantization)
    model, report = load_sharded_preset(quantized, mesh=(2, 4), dtype="float32", memory_report=True,
                                        progress=False)
    assert report.fallbacks == ()
    # Each byte read once (one process holds every device); an int4 group's
    # scales may be read by two blocks.
    assert report.file_bytes <= report.bytes_read <= report.file_bytes + (quantization == "w4a16") * scale_bytes
    expected = load_sharded_preset(reference, mesh=(2, 4), dtype="float32", progress=False)
    keras.distribution.set_distribution(None)
    ours, theirs = _leaf_layers(model), _leaf_layers(expected)
    assert [type(a).__name__ for a in ours] == [type(b).__name__ for b in theirs]
    assert sum(len(layer.weights) for layer in theirs) == len(expected.weights)  # every weight compared
    int4 = []
    for layer, ref in zip(ours, theirs):
        if getattr(layer, "quantization_mode", None) == "int4":
            int4.append(layer.name)
            kernel = np.asarray(ref.kernel)
            assert layer.dtype_policy.name == f"int4/{GROUP}_from_float32", layer.path
            converted = int4_kernel(layer, kernel.shape).astype(_CONVERTER_DTYPE.get(family, np.float32))
            assert np.array_equal(converted.astype(np.float32), kernel), layer.path
            continue
        assert getattr(layer, "quantization_mode", None) is None, layer.path
        assert len(layer.weights) == len(ref.weights), layer.path
        for a, b in zip(layer.weights, ref.weights):
            assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b)), a.path
    if quantization == "fp8_block":
        assert int4 == []  # dequantized into the compute dtype
        return
    assert len(int4) == len(FAMILIES[family][2]) and set(int4) == FAMILIES[family][2], int4
    np.testing.assert_allclose(_logits(model), _logits(expected), rtol=0, atol=TOLERANCE)
