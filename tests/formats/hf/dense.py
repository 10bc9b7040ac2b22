"""Tiny Hugging Face checkpoints of the dense decoder-only families KerasHub converts.

`hf_checkpoint(case, tied=..., dtype=...)` returns `(config, tensors)`: the
`config.json` contents and the `{HF tensor name: array}` state dict that
`transformers`' `save_pretrained` would write for a model of that family, with
every dimension shrunk (vocab 128, hidden 64, intermediate 128, 2 layers,
8 query / 2 key-value heads) so that each checkpoint stays far below 1 MB while
the vocab, hidden, intermediate and projection dimensions still split 8 ways.
Write it with `writer.write_hf_checkpoint`.

The tensor set is exactly what the KerasHub 0.32 converter of each family
(`keras_hub/src/utils/transformers/convert_*.py`) reads: nothing it ignores,
nothing it misses.
"""

from __future__ import annotations

import numpy as np

from tests.formats.hf.writer import random_float

__all__ = ["ALWAYS_TIED", "CASES", "hf_checkpoint"]

CASES: tuple[str, ...] = (
    "gemma", "gemma2", "gemma3", "gemma3_text", "llama", "mistral", "qwen2", "qwen3", "smollm3",
)

# KerasHub's Gemma / Gemma3 / SmolLM3 backbones always tie their output
# projection to the token embedding and the converters never read
# `lm_head.weight`; the published checkpoints of these families have none.
ALWAYS_TIED: frozenset[str] = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "smollm3"})

# The opposite case, which the public API has no name for: `MistralBackbone`
# never ties and `convert_mistral` always reads `lm_head.weight`, so a tied
# Mistral checkpoint (no `lm_head.weight`) could not be loaded. `tied=True` is
# therefore ignored for it; every published Mistral checkpoint is untied.
_NEVER_TIED = frozenset({"mistral"})

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 128, 64, 128, 2, 8, 2

# Gemma and Qwen3 checkpoints have num_heads * head_dim != hidden_size
# (gemma-7b 16*256 vs 3072, Qwen3-0.6B 16*128 vs 1024); keep that property.
_HEAD_DIM = {"gemma": 16, "gemma2": 16, "gemma3": 16, "gemma3_text": 16, "qwen3": 16}

# Gemma3ForConditionalGeneration's SigLIP tower: 32x32 images of 4x4 patches
# give an 8x8 patch grid, which the projector average-pools 4x4 (KerasHub
# hard-codes pool_size=4) down to mm_tokens_per_image = 2*2 = 4 soft tokens.
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, image_size=32, patch_size=4)


def _head_dim(case: str) -> int:
    return _HEAD_DIM.get(case, HIDDEN // HEADS)


def _text_config(case: str, tied: bool, dtype: str) -> dict:
    """Keys shared by every family, in the spelling of the published configs."""
    return {
        "model_type": case,
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": _head_dim(case),
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "torch_dtype": dtype,
        "transformers_version": "4.53.0",
    }


def _gemma3_text_config(config: dict) -> dict:
    """Gemma 3 text keys, as in gemma-3-1b-it / the text_config of gemma-3-4b-it."""
    # Transformers derives layer_types from sliding_window_pattern: every 6th
    # layer is global, which is also what Gemma3Backbone hard-codes.
    pattern = 6
    config.update(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=config["head_dim"],
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        sliding_window=4,  # shorter than the test sequences, so the mask matters
        sliding_window_pattern=pattern,
        layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(LAYERS)],
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        use_bidirectional_attention=False,
        pad_token_id=0,
        eos_token_id=[1, 106],
        cache_implementation="hybrid",
    )
    del config["hidden_act"]  # Gemma3TextConfig only has hidden_activation
    return config


def _config(case: str, tied: bool, dtype: str) -> dict:
    c = _text_config(case, tied, dtype)
    if case == "gemma":  # gemma-2b / gemma-7b
        c.update(architectures=["GemmaForCausalLM"], hidden_act="gelu",
                 hidden_activation="gelu_pytorch_tanh", pad_token_id=0)
    elif case == "gemma2":  # gemma-2-2b
        c.update(architectures=["Gemma2ForCausalLM"], hidden_act="gelu_pytorch_tanh",
                 hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=c["head_dim"],
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 sliding_window=4, cache_implementation="hybrid", pad_token_id=0)
    elif case == "gemma3_text":
        c = _gemma3_text_config(c)
    elif case == "gemma3":  # gemma-3-4b-it: text_config + SigLIP vision_config
        text = _gemma3_text_config(c)
        text["rope_scaling"] = {"factor": 8.0, "rope_type": "linear"}
        for key in ("architectures", "torch_dtype", "transformers_version"):
            del text[key]
        side = _VISION["image_size"] // _VISION["patch_size"] // 4
        c = {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": text,
            "vision_config": {
                "model_type": "siglip_vision_model",
                **_VISION,
                "num_channels": 3,
                "hidden_act": "gelu_pytorch_tanh",
                "layer_norm_eps": 1e-6,
                "attention_dropout": 0.0,
                "vision_use_head": False,
            },
            "mm_tokens_per_image": side * side,
            "boi_token_index": VOCAB - 3,
            "eoi_token_index": VOCAB - 2,
            "image_token_index": VOCAB - 1,
            "eos_token_id": [1, 106],
            "initializer_range": 0.02,
            "torch_dtype": dtype,
            "transformers_version": "4.53.0",
        }
    elif case == "llama":  # Llama-3.2-1B (tied) / Llama-3.1-8B (untied)
        c.update(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, rope_theta=500000.0,
                 mlp_bias=False, pretraining_tp=1,
                 rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                               "original_max_position_embeddings": 1024,
                               "rope_type": "llama3"})
    elif case == "mistral":  # Mistral-7B-v0.3
        c.update(architectures=["MistralForCausalLM"], rms_norm_eps=1e-5,
                 rope_theta=1_000_000.0, sliding_window=None)
        del c["rope_scaling"], c["attention_bias"]
    elif case == "qwen2":  # Qwen2.5-0.5B (tied) / Qwen2.5-7B (untied)
        c.update(architectures=["Qwen2ForCausalLM"], rope_theta=1_000_000.0,
                 use_sliding_window=False, sliding_window=2048, max_window_layers=LAYERS,
                 use_mrope=False)
        # Qwen2 derives head_dim from hidden_size; its configs carry no such key.
        del c["head_dim"], c["rope_scaling"], c["attention_bias"]
    elif case == "qwen3":  # Qwen3-0.6B (tied) / Qwen3-8B (untied)
        c.update(architectures=["Qwen3ForCausalLM"], rope_theta=1_000_000.0,
                 use_sliding_window=False, sliding_window=None, max_window_layers=LAYERS)
    elif case == "smollm3":  # SmolLM3-3B
        # Transformers sets no_rope_layers[i] = int((i + 1) % interval != 0); the
        # real interval is 4, 2 makes the second of our two layers a NoPE layer.
        interval = 2
        c.update(architectures=["SmolLM3ForCausalLM"], rope_theta=5_000_000.0,
                 mlp_bias=False, use_sliding_window=False, sliding_window=None,
                 max_window_layers=LAYERS, pretraining_tp=2, no_rope_layer_interval=interval,
                 no_rope_layers=[int((i + 1) % interval != 0) for i in range(LAYERS)],
                 layer_types=["full_attention"] * LAYERS, pad_token_id=VOCAB - 1)
        del c["head_dim"]  # derived from hidden_size, like Llama before 4.45
    else:
        raise ValueError(f"unknown case {case!r}; expected one of {CASES}")
    return {"architectures": c.pop("architectures"), **c}


def _decoder_shapes(case: str, prefix: str) -> dict[str, tuple[int, ...]]:
    """Decoder-stack tensors, in the order of the HF modules' state dict."""
    hd = _head_dim(case)
    q, kv = HEADS * hd, KV_HEADS * hd
    shapes = {f"{prefix}embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"{prefix}layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q, HIDDEN)
        if case == "qwen2":  # Qwen2 is the only family here with q/k/v biases
            shapes[p + "self_attn.q_proj.bias"] = (q,)
        shapes[p + "self_attn.k_proj.weight"] = (kv, HIDDEN)
        if case == "qwen2":
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
        shapes[p + "self_attn.v_proj.weight"] = (kv, HIDDEN)
        if case == "qwen2":
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (HIDDEN, q)
        if case in ("qwen3", "gemma3", "gemma3_text"):  # per-head RMSNorm on q and k
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "mlp.gate_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.up_proj.weight"] = (INTERMEDIATE, HIDDEN)
        shapes[p + "mlp.down_proj.weight"] = (HIDDEN, INTERMEDIATE)
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
        if case in ("gemma2", "gemma3", "gemma3_text"):  # sandwich norms around the MLP
            shapes[p + "pre_feedforward_layernorm.weight"] = (HIDDEN,)
            shapes[p + "post_feedforward_layernorm.weight"] = (HIDDEN,)
    shapes[f"{prefix}norm.weight"] = (HIDDEN,)
    return shapes


def _vision_shapes() -> dict[str, tuple[int, ...]]:
    """SigLIP tower (no pooling head) and Gemma3MultiModalProjector."""
    h, mlp, p = _VISION["hidden_size"], _VISION["intermediate_size"], _VISION["patch_size"]
    num_patches = (_VISION["image_size"] // p) ** 2
    v = "vision_tower.vision_model."
    shapes = {
        v + "embeddings.patch_embedding.weight": (h, 3, p, p),
        v + "embeddings.patch_embedding.bias": (h,),
        v + "embeddings.position_embedding.weight": (num_patches, h),
    }
    for i in range(_VISION["num_hidden_layers"]):
        e = f"{v}encoder.layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj", "out_proj"):
            shapes[f"{e}self_attn.{proj}.weight"] = (h, h)
            shapes[f"{e}self_attn.{proj}.bias"] = (h,)
        shapes[e + "layer_norm1.weight"] = shapes[e + "layer_norm1.bias"] = (h,)
        shapes[e + "mlp.fc1.weight"], shapes[e + "mlp.fc1.bias"] = (mlp, h), (mlp,)
        shapes[e + "mlp.fc2.weight"], shapes[e + "mlp.fc2.bias"] = (h, mlp), (h,)
        shapes[e + "layer_norm2.weight"] = shapes[e + "layer_norm2.bias"] = (h,)
    shapes[v + "post_layernorm.weight"] = shapes[v + "post_layernorm.bias"] = (h,)
    # A bare nn.Parameter of shape (vision hidden, text hidden): no ".weight".
    shapes["multi_modal_projector.mm_input_projection_weight"] = (h, HIDDEN)
    shapes["multi_modal_projector.mm_soft_emb_norm.weight"] = (h,)
    return shapes


def hf_checkpoint(case: str, *, tied: bool, dtype: str, seed: int = 0
                  ) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json contents, {HF tensor name: array}) of a tiny checkpoint.

    `tied=True` writes `tie_word_embeddings: true` and no `lm_head.weight`,
    `tied=False` writes `tie_word_embeddings: false` and an independent
    `lm_head.weight` of shape (vocab, hidden). Cases in `ALWAYS_TIED` are
    always written tied and Mistral always untied, whatever `tied` says.
    `dtype` ("float32" / "bfloat16") is the dtype of every tensor and the
    config's `torch_dtype`. Values are random normal (scale 0.5) drawn from
    `np.random.default_rng(seed)`, a fresh draw for every tensor.
    """
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; expected one of {CASES}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    tied = (tied or case in ALWAYS_TIED) and case not in _NEVER_TIED
    config = _config(case, tied, dtype)
    if case == "gemma3":
        # The layout of the published Gemma 3 checkpoints (and of what
        # transformers 4.x save_pretrained writes): language model under
        # "language_model.model.", tower and projector at the top level.
        shapes = {**_decoder_shapes(case, "language_model.model."), **_vision_shapes()}
    else:
        shapes = _decoder_shapes(case, "model.")
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    rng = np.random.default_rng(seed)
    return config, {name: random_float(rng, shape, dtype) for name, shape in shapes.items()}
