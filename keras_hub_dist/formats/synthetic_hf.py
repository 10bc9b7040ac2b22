"""Write a full-size Hugging Face checkpoint with random weights, streaming.

The Hugging Face twin of `formats.synthetic`: `config.json` as Transformers
writes it, and the tensors in safetensors files (one file per
`shard_bytes`, with `model.safetensors.index.json`), written one tensor at a
time in bands of at most 64 MB, so host memory stays flat whatever the model
size. The header of each file is computed first (every tensor's shape and
byte range is known from the config), then the data streamed after it.

Families: Gemma (`model_type="gemma"`) and Llama (`"llama"`), the ones the
benchmarks and `keras-hub-dist validate --checkpoint_format huggingface` use.
KerasHub's own converter reads the result (that is how tests check it).

`quantization=` writes the projections pre-quantized, in the
compressed-tensors layout `llmcompressor` writes (embeddings, norms and
lm_head in `dtype`, as its recipes `ignore` them): `"fp8_block"` (FP8_BLOCK:
e4m3 weights, float32 `weight_scale` per 128 x 128 block) or `"w4a16"`
(W4A16: `weight_packed` int32, eight 4-bit values each along the input,
`weight_scale` in `dtype` per group of 128, symmetric).

Example:

```python
write_synthetic_hf_checkpoint(
    "/tmp/gemma7b_hf", keras_hub.models.GemmaBackbone,
    keras_hub_dist.presets.resolve("gemma_7b_en").config_json()["config"],
    dtype="bfloat16",
)
```
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from keras_hub_dist._progress import byte_progress
from keras_hub_dist.errors import PresetError
from keras_hub_dist.formats.base import numpy_dtype
from keras_hub_dist.formats.safetensors_files import INDEX_FILE, SINGLE_FILE

__all__ = ["QUANTIZATIONS", "SUPPORTED_CLASSES", "hf_layout", "write_synthetic_hf_checkpoint"]

QUANTIZATIONS = ("fp8_block", "w4a16")
_PROJECTIONS = ("_proj.weight",)
_GROUP = 128

SUPPORTED_CLASSES = ("GemmaBackbone", "LlamaBackbone", "Llama3Backbone")
_BAND_BYTES = 64 * 1024 * 1024
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_STORED = {"int32": "I32", "float8_e4m3fn": "F8_E4M3", **_SAFETENSORS_DTYPES}
# Uniform on [-a, a] with standard deviation 0.02, as `formats.synthetic`.
_HALF_WIDTH = 0.02 * math.sqrt(3.0)


def hf_layout(cls: type, config: Mapping[str, Any], dtype: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """`(config.json, {tensor name: shape})` of a KerasHub backbone config.

    Raises:
        PresetError: A backbone class this writer has no layout for.
    """
    name = cls.__name__
    if name not in SUPPORTED_CLASSES:
        raise PresetError(
            f"No Hugging Face layout for {name}. Expected one of "
            f"{list(SUPPORTED_CLASSES)}. Received: {name}. Write a KerasHub "
            "preset instead (`write_synthetic_preset`)."
        )
    c = dict(config)
    layers, hidden, heads = c["num_layers"], c["hidden_dim"], c["num_query_heads"]
    kv_heads = c.get("num_key_value_heads", heads)
    vocab = c["vocabulary_size"]
    if name == "GemmaBackbone":
        head_dim, ffn, tied = c["head_dim"], c["intermediate_dim"] // 2, True
        hf = dict(
            architectures=["GemmaForCausalLM"], model_type="gemma", hidden_act="gelu",
            hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
            rope_theta=10000.0, rms_norm_eps=c.get("layer_norm_epsilon", 1e-6),
        )
    else:
        head_dim, ffn = hidden // heads, c["intermediate_dim"]
        tied = bool(c.get("tie_word_embeddings", False))
        hf = dict(
            architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
            max_position_embeddings=8192, rope_theta=float(c.get("rope_max_wavelength", 10000.0)),
            rms_norm_eps=c.get("layer_norm_epsilon", 1e-6), rope_scaling=None,
        )
    hf.update(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=tied, torch_dtype=dtype, bos_token_id=2, eos_token_id=1,
    )
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        })
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return hf, shapes


def _quantized_shapes(
    shapes: Mapping[str, tuple[int, ...]], dtype: str, quantization: str | None
) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{tensor: (shape, dtype)}`, the projections quantized."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shape in shapes.items():
        if quantization is None or not name.endswith(_PROJECTIONS):
            out[name] = (shape, dtype)
            continue
        rows, cols = shape
        if quantization == "fp8_block":
            out[name] = (shape, "float8_e4m3fn")
            out[name + "_scale"] = ((-(-rows // _GROUP), -(-cols // _GROUP)), "float32")
        else:
            out[name + "_packed"] = ((rows, cols // 8), "int32")
            out[name + "_scale"] = ((rows, cols // _GROUP), dtype)
    return out


def _quantization_config(quantization: str) -> dict[str, Any]:
    if quantization == "fp8_block":
        weights = {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [_GROUP, _GROUP],
                   "symmetric": True, "dynamic": False, "group_size": None, "actorder": None}
        fmt = "float-quantized"
    else:
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": _GROUP,
                   "symmetric": True, "dynamic": False, "block_structure": None, "actorder": None}
        fmt = "pack-quantized"
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None, "output_activations": None, "format": fmt}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
    }


def _header(shapes: Mapping[str, tuple[tuple[int, ...], str]]) -> bytes:
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, (shape, dtype) in shapes.items():
        size = math.prod(shape) * numpy_dtype(dtype).itemsize
        entries[name] = {"dtype": _STORED[dtype], "shape": list(shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data 8-byte aligned, as safetensors writes
    return struct.pack("<Q", len(text)) + text


def _write_tensor(
    f: Any, name: str, shape: tuple[int, ...], dtype: np.dtype, seed: int, bar: Any, quantization: str | None = None
) -> None:
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    remaining = math.prod(shape)
    band = max(1, _BAND_BYTES // 4)
    while remaining:
        n = min(band, remaining)
        if dtype == np.dtype(np.int32):  # packed 4-bit codes: any bits
            data = rng.integers(0, 2**32, n, dtype=np.uint32).view(np.int32)
        elif dtype.itemsize == 1:  # e4m3 codes over their whole range
            data = (rng.random(n, dtype=np.float32) * 896.0 - 448.0).astype(dtype)
        elif name.endswith("_scale"):  # weights of about the float ones' size
            largest = 448.0 if quantization == "fp8_block" else 7.0
            data = ((rng.random(n, dtype=np.float32) + 0.5) * (_HALF_WIDTH / largest)).astype(dtype)
        else:
            values = rng.random(n, dtype=np.float32)
            values *= 2 * _HALF_WIDTH
            values -= _HALF_WIDTH
            data = values.astype(dtype, copy=False)
        f.write(data.view(np.uint8))
        bar.update(data.nbytes)
        remaining -= n


def write_synthetic_hf_checkpoint(
    out_dir: str,
    cls: type,
    config: Mapping[str, Any],
    *,
    dtype: str = "bfloat16",
    seed: int = 0,
    shard_bytes: int = 5 * 10**9,
    overwrite: bool = False,
    progress: bool | None = None,
    quantization: str | None = None,
) -> dict[str, Any]:
    """Writes a Hugging Face checkpoint of a KerasHub backbone config.

    Args:
        out_dir: Directory to create.
        cls: The backbone class (`GemmaBackbone`, `Llama3Backbone`, ...).
        config: Its constructor config (e.g. a named architecture's).
        dtype: `"bfloat16"`, `"float16"` or `"float32"`.
        seed: Seed of the random values (deterministic per tensor name).
        shard_bytes: Bytes per safetensors file before starting another
            (`transformers` uses 5 GB); one file gets no index.
        overwrite: Replace an existing `out_dir`.
        progress: Show a progress bar (default: when stderr is a terminal).
        quantization: `None`, or one of `QUANTIZATIONS`: the projections
            pre-quantized in compressed-tensors' layout.

    Returns:
        The config.json written.

    Raises:
        PresetError: The directory exists and `overwrite` is False, or no
            layout exists for `cls`.
    """
    if dtype not in _SAFETENSORS_DTYPES:
        raise PresetError(
            f"Expected dtype in {sorted(_SAFETENSORS_DTYPES)}. Received: dtype={dtype!r}."
        )
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise PresetError(
            f"Expected quantization in {list(QUANTIZATIONS)} or None. Received: quantization={quantization!r}."
        )
    hf_config, float_shapes = hf_layout(cls, config, dtype)
    if quantization is not None:
        hf_config["quantization_config"] = _quantization_config(quantization)
    shapes = _quantized_shapes(float_shapes, dtype, quantization)
    if os.path.exists(out_dir):
        if not overwrite:
            raise PresetError(
                f"{out_dir!r} exists. Expected a new directory. Pass overwrite=True to replace it."
            )
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    files: list[dict[str, tuple[tuple[int, ...], str]]] = [{}]
    size = 0
    for name, (shape, stored) in shapes.items():
        nbytes = math.prod(shape) * numpy_dtype(stored).itemsize
        if files[-1] and size + nbytes > shard_bytes:
            files.append({})
            size = 0
        files[-1][name] = (shape, stored)
        size += nbytes
    names = [SINGLE_FILE] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))
    ]
    total = sum(math.prod(s) * numpy_dtype(d).itemsize for s, d in shapes.values())
    with byte_progress(total, "Writing synthetic HF checkpoint", progress) as bar:
        for fname, part in zip(names, files):
            with open(os.path.join(out_dir, fname), "wb") as f:
                f.write(_header(part))
                for name, (shape, stored) in part.items():
                    _write_tensor(f, name, shape, numpy_dtype(stored), seed, bar, quantization)
    if len(files) > 1:
        weight_map = {name: fname for fname, part in zip(names, files) for name in part}
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(hf_config, f, indent=2)
    return hf_config
