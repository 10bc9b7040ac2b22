"""Write a full-size Hugging Face checkpoint with random weights, streaming.

The Hugging Face twin of `formats.synthetic`: `config.json` as Transformers
writes it, and the tensors in safetensors files (one file per
`shard_bytes`, with `model.safetensors.index.json`), written one tensor at a
time in bands of at most 64 MB, so host memory stays flat whatever the model
size. The header of each file is computed first (every tensor's shape and
byte range is known from the config), then the data streamed after it.

Families (`SUPPORTED_CLASSES`): Gemma (`model_type="gemma"`, or `"gemma2"`
for a GemmaBackbone with Gemma 2's post-attention and post-FFW norms), Gemma 3
text (`"gemma3_text"`), Llama (`"llama"`), Mistral, Mixtral, Qwen 2.5
(`QwenBackbone`: `"qwen2"`), Qwen 3 and Qwen 3 MoE, the ones the benchmarks,
`keras-hub-dist validate --checkpoint_format huggingface` and the
pre-quantized tests use. KerasHub's own converter reads the result (that is
how tests check it).

`quantization=` writes the Linear weights pre-quantized (every attention and
MLP projection, each expert's of an MoE), in the compressed-tensors layout
`llmcompressor` writes (embeddings, norms, MoE routers and lm_head in
`dtype`, as its recipes `ignore` them): `"fp8_block"` (FP8_BLOCK:
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
import re
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
_GROUP = 128

SUPPORTED_CLASSES = (
    "GemmaBackbone", "Gemma3Backbone", "LlamaBackbone", "Llama3Backbone", "MistralBackbone",
    "MixtralBackbone", "QwenBackbone", "Qwen3Backbone", "Qwen3MoeBackbone",
)
# `(model_type, architecture)` per class (GemmaBackbone with Gemma 2's norms:
# "gemma2").
_MODEL_TYPES = {
    "GemmaBackbone": ("gemma", "GemmaForCausalLM"),
    "Gemma3Backbone": ("gemma3_text", "Gemma3ForCausalLM"),
    "LlamaBackbone": ("llama", "LlamaForCausalLM"),
    "Llama3Backbone": ("llama", "LlamaForCausalLM"),
    "MistralBackbone": ("mistral", "MistralForCausalLM"),
    "MixtralBackbone": ("mixtral", "MixtralForCausalLM"),
    "QwenBackbone": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3Backbone": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeBackbone": ("qwen3_moe", "Qwen3MoeForCausalLM"),
}
# Whether the class ties its output projection by default (Gemma's always
# do; Mistral's and Mixtral's never).
_TIED_DEFAULT = {"QwenBackbone": True, "Qwen3Backbone": True}
_ALWAYS_TIED = ("GemmaBackbone", "Gemma3Backbone")
_NEVER_TIED = ("MistralBackbone", "MixtralBackbone")
# MoE routers stay in `dtype`, as llmcompressor's MoE recipes ignore them.
_ROUTERS = {"MixtralBackbone": "block_sparse_moe.gate", "Qwen3MoeBackbone": "mlp.gate"}
_BAND_BYTES = 64 * 1024 * 1024
_SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_STORED = {"int32": "I32", "float8_e4m3fn": "F8_E4M3", **_SAFETENSORS_DTYPES}
# Uniform on [-a, a] with standard deviation 0.02, as `formats.synthetic`.
_HALF_WIDTH = 0.02 * math.sqrt(3.0)


def _family_config(name: str, c: Mapping[str, Any], head_dim: int) -> dict[str, Any]:
    """The family's own config.json keys, as its KerasHub converter reads them back."""
    hidden, heads, layers = c["hidden_dim"], c["num_query_heads"], c["num_layers"]
    eps = c.get("layer_norm_epsilon", 1e-6)
    rope = float(c.get("rope_max_wavelength", 10000.0))
    scalar = head_dim if c.get("query_head_dim_normalize", True) else hidden // heads
    if name == "GemmaBackbone":
        hf = dict(hidden_act="gelu", hidden_activation="gelu_pytorch_tanh", rope_theta=10000.0, rms_norm_eps=eps)
        if c.get("use_post_ffw_norm") and c.get("use_post_attention_norm"):  # Gemma 2
            hf.update(hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
                      attn_logit_softcapping=c.get("attention_logit_soft_cap"),
                      final_logit_softcapping=c.get("final_logit_soft_cap"),
                      sliding_window=c.get("sliding_window_size", 4096))
        return hf
    if name == "Gemma3Backbone":
        norms = [c.get("use_query_key_norm", True), c.get("use_post_ffw_norm"), c.get("use_post_attention_norm")]
        if c.get("vision_encoder") is not None or c.get("is_embedding_model") or not all(norms):
            raise PresetError(
                "No Hugging Face layout for a Gemma3Backbone with a vision encoder, an embedding "
                "head, or without its query / key and post-attention / post-FFW norms (KerasHub's "
                "converter reads them all). Expected a text-only causal LM config as Gemma 3's "
                f"(vision_encoder=None, the norms True). Received: norms {norms}. Write a KerasHub "
                "preset instead (`write_synthetic_preset`)."
            )
        sliding = c.get("use_sliding_window_attention", False)
        factor = c.get("global_rope_scaling_factor", 1.0)
        local = c.get("local_rope_scaling_factor", 1.0)
        hf = dict(
            hidden_activation="gelu_pytorch_tanh", rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
            rms_norm_eps=eps, query_pre_attn_scalar=scalar,
            attn_logit_softcapping=c.get("attention_logit_soft_cap"),
            final_logit_softcapping=c.get("final_logit_soft_cap"),
            sliding_window=c.get("sliding_window_size", 1024),
            # Gemma3Backbone makes every 6th layer global, as Transformers' default pattern.
            layer_types=["full_attention" if not sliding or (i + 1) % 6 == 0 else "sliding_attention"
                         for i in range(layers)],
            rope_scaling=None if factor == 1.0 else {"factor": factor, "rope_type": "linear"},
            use_bidirectional_attention=c.get("use_bidirectional_attention", False),
        )
        if local != 1.0:
            hf["rope_parameters"] = {"sliding_attention": {"factor": local}}
        return hf
    hf = dict(hidden_act="silu", rope_theta=rope, rms_norm_eps=eps)
    if name in ("LlamaBackbone", "Llama3Backbone"):
        hf.update(rope_scaling=None)
    elif name in ("MistralBackbone", "MixtralBackbone"):
        hf.update(sliding_window=c.get("sliding_window", 512))
        if name == "MixtralBackbone":
            hf.update(num_local_experts=c["num_experts"], num_experts_per_tok=c.get("top_k", 2),
                      router_aux_loss_coef=c.get("router_aux_loss_coef", 0.02),
                      output_router_logits=c.get("output_router_logits", False))
    elif name == "QwenBackbone":
        hf.update(use_sliding_window=c.get("use_sliding_window_attention", False),
                  sliding_window=c.get("sliding_window_size", 32768), max_window_layers=layers)
    else:  # Qwen 3, Qwen 3 MoE
        window = c.get("sliding_window_size", 32768)
        hf.update(use_sliding_window=window is not None, sliding_window=window, max_window_layers=layers)
        if name == "Qwen3MoeBackbone":
            if c.get("mlp_only_layers"):
                raise PresetError(
                    "No Hugging Face layout for a Qwen3MoeBackbone with mlp_only_layers: "
                    "KerasHub's converter does not read them back. Expected mlp_only_layers "
                    f"None or []. Received: {c['mlp_only_layers']!r}."
                )
            hf.update(moe_intermediate_size=c["moe_intermediate_dim"], num_experts=c["num_experts"],
                      num_experts_per_tok=c.get("top_k", 4), norm_topk_prob=c.get("norm_top_k_prob", False),
                      decoder_sparse_step=c.get("decoder_sparse_step", 1), mlp_only_layers=[],
                      router_aux_loss_coef=c.get("router_aux_loss_coefficient", 0.001))
    return hf


def _mlp_shapes(name: str, c: Mapping[str, Any], p: str, i: int, hidden: int, ffn: int) -> dict[str, tuple[int, ...]]:
    """A block's feed-forward tensors: dense, or a router and per-expert Linears."""
    step = c.get("decoder_sparse_step", 1)
    if name == "MixtralBackbone":
        m = p + "block_sparse_moe."
        shapes = {m + "gate.weight": (c["num_experts"], hidden)}
        for e in range(c["num_experts"]):  # w1 gate, w2 down, w3 up
            shapes.update({f"{m}experts.{e}.w1.weight": (ffn, hidden), f"{m}experts.{e}.w2.weight": (hidden, ffn),
                           f"{m}experts.{e}.w3.weight": (ffn, hidden)})
        return shapes
    if name == "Qwen3MoeBackbone" and c["num_experts"] > 0 and (i + 1) % step == 0:
        m, moe = p + "mlp.", c["moe_intermediate_dim"]
        shapes = {m + "gate.weight": (c["num_experts"], hidden)}
        for e in range(c["num_experts"]):
            shapes.update({f"{m}experts.{e}.gate_proj.weight": (moe, hidden),
                           f"{m}experts.{e}.up_proj.weight": (moe, hidden),
                           f"{m}experts.{e}.down_proj.weight": (hidden, moe)})
        return shapes
    return {p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn)}


def hf_layout(cls: type, config: Mapping[str, Any], dtype: str) -> tuple[dict, dict[str, tuple[int, ...]]]:
    """`(config.json, {tensor name: shape})` of a KerasHub backbone config.

    Raises:
        PresetError: A backbone class (or a variant of one) this writer has
            no layout for.
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
    head_dim = c.get("head_dim") or hidden // heads
    # GemmaBackbone's intermediate_dim is twice the Hugging Face one.
    ffn = c["intermediate_dim"] // 2 if name == "GemmaBackbone" else c["intermediate_dim"]
    tied = name in _ALWAYS_TIED or (
        name not in _NEVER_TIED and bool(c.get("tie_word_embeddings", _TIED_DEFAULT.get(name, False)))
    )
    hf = _family_config(name, c, head_dim)
    model_type, architecture = _MODEL_TYPES[name]
    if "query_pre_attn_scalar" in hf and name == "GemmaBackbone":
        model_type, architecture = "gemma2", "Gemma2ForCausalLM"
    hf = dict(architectures=[architecture], model_type=model_type, max_position_embeddings=8192, **hf)
    hf.update(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        tie_word_embeddings=tied, torch_dtype=dtype, bos_token_id=2, eos_token_id=1,
    )
    sandwich = model_type in ("gemma2", "gemma3_text")  # norms before and after the MLP
    qk_norm = model_type in ("qwen3", "qwen3_moe", "gemma3_text")
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        for proj, rows, cols in (("q", heads * head_dim, hidden), ("k", kv_heads * head_dim, hidden),
                                 ("v", kv_heads * head_dim, hidden), ("o", hidden, heads * head_dim)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (rows, cols)
            if model_type == "qwen2" and proj != "o":  # Qwen 2's q / k / v biases
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (rows,)
        if qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)})
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        if sandwich:
            shapes.update({p + "pre_feedforward_layernorm.weight": (hidden,),
                           p + "post_feedforward_layernorm.weight": (hidden,)})
        shapes.update(_mlp_shapes(name, c, p, i, hidden, ffn))
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return hf, shapes


def _is_quantized(name: str) -> bool:
    """A Linear weight the recipes quantize: every projection, Mixtral's
    experts (`w1` / `w2` / `w3`); not the routers, embeddings, norms, lm_head."""
    return name.endswith("_proj.weight") or re.search(r"\.w[123]\.weight$", name) is not None


def _quantized_shapes(
    shapes: Mapping[str, tuple[int, ...]], dtype: str, quantization: str | None
) -> dict[str, tuple[tuple[int, ...], str]]:
    """`{tensor: (shape, dtype)}`, the projections quantized."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, shape in shapes.items():
        if quantization is None or not _is_quantized(name):
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


def _quantization_config(quantization: str, router: str | None) -> dict[str, Any]:
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
        "ignore": ["lm_head"] + ([f"re:.*{router}$"] if router else []), "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
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
        hf_config["quantization_config"] = _quantization_config(quantization, _ROUTERS.get(cls.__name__))
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
