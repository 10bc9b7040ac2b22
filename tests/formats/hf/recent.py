"""Tiny Hugging Face checkpoints of the 2026 families KerasHub converts: Gemma 4, Qwen 3.5.

`hf_checkpoint(case, tied=..., dtype=...)` returns `(config, tensors)`: the
`config.json` contents and the `{HF tensor name: array}` state dict that
`transformers`' `save_pretrained` writes for a model of that family, with every
dimension shrunk (vocab 128, hidden 64, FFNs 64-256, 8 query / 2 key-value
heads, 8 experts, top-2; towers of width 32) so that each checkpoint stays
under 3 MB in float32 and heads, FFNs and experts still split 8 ways. Write
it with `writer.write_hf_checkpoint`.

Every published checkpoint of these families except a text-only Gemma 4 is
multimodal (`*ForConditionalGeneration`, text under `text_config`), so the
cases carry the tiny vision (and, for the E2B layout, audio) tower that the
real config declares and that the KerasHub 0.32 converter
(`keras_hub/src/utils/transformers/convert_{gemma4,qwen3_5,qwen3_5_moe}.py`)
builds and loads:

- `gemma4_text`: Gemma4ForCausalLM with the E2B text stack: per-layer token
  embeddings, K/V shared by the last two layers, double-wide MLP there.
- `gemma4`: gemma-4-E2B (Gemma4ForConditionalGeneration): that text stack, the
  vision tower with clipped linears and the audio conformer.
- `gemma4_moe`: gemma-4-26B-A4B: dense MLP plus 8 routed experts in every
  layer, K = V on the global layer, standardized vision tower, no audio.
- `qwen3_5`: Qwen3.5 dense (Qwen3_5ForConditionalGeneration), 3 gated
  delta-net layers then 1 full-attention layer, as `full_attention_interval` 4.
- `qwen3_5_moe` / `qwen3_5_moe_fused`: Qwen3.5-35B-A3B, experts stored one
  tensor per expert and projection / as the fused 3-D `experts.gate_up_proj`
  (E, 2*I, H) and `experts.down_proj` (E, H, I); the converter reads either.

The tensor set is exactly what those converters read: nothing they ignore
(no `mtp.*` weights, no K/V of KV-shared Gemma 4 layers, which
`transformers` does not instantiate), nothing they miss. Gemma 4 clip bounds
(`*.input_min` ...) are 0-d tensors, as `transformers` stores them, and must be
written 0-d: KerasHub's scalar variables reject shape (1,).
"""

from __future__ import annotations

import numpy as np

from tests.formats.hf.writer import float_dtype, random_float

__all__ = ["ALWAYS_TIED", "CASES", "NEVER_TIED", "hf_checkpoint"]

CASES: tuple[str, ...] = (
    "gemma4_text", "gemma4", "gemma4_moe", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_fused",
)

# Gemma4Backbone hard-codes a tied ReversibleEmbedding and convert_gemma4 never
# reads `lm_head.weight`; every Gemma 4 checkpoint is tied.
ALWAYS_TIED: frozenset[str] = frozenset({"gemma4_text", "gemma4", "gemma4_moe"})

# The Qwen 3.5 converters follow the top-level `tie_word_embeddings` and read
# `lm_head.weight` only when it is false (Qwen3.5-4B is tied, 9B and 35B-A3B untied).
NEVER_TIED: frozenset[str] = frozenset()

VOCAB, HIDDEN, HEADS, KV_HEADS = 128, 64, 8, 2
EXPERTS, TOP_K = 8, 2
_VERSION = "5.7.0"

_CLIPS = ("input_min", "input_max", "output_min", "output_max")

# ---------------------------------------------------------------- Gemma 4


def _gemma4_text_config(moe: bool, dtype: str) -> dict:
    """Gemma4TextConfig as serialized in gemma-4-E2B / gemma-4-26B-A4B."""
    if moe:  # 26B-A4B: 16/8 heads, 2 K=V heads on global layers, 128 experts top-8
        layer_types = ["sliding_attention", "full_attention"]
        extra = dict(enable_moe_block=True, num_experts=EXPERTS, top_k_experts=TOP_K,
                     moe_intermediate_size=64, attention_k_eq_v=True,
                     num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                     num_kv_shared_layers=0, use_double_wide_mlp=False,
                     use_bidirectional_attention="vision")
    else:  # E2B: 35 layers, the last 20 reuse the K/V of the last unshared layer of their type
        layer_types = ["sliding_attention", "full_attention"] * 2
        extra = dict(enable_moe_block=False, num_experts=None, top_k_experts=None,
                     moe_intermediate_size=None, attention_k_eq_v=False,
                     num_global_key_value_heads=None, hidden_size_per_layer_input=16,
                     num_kv_shared_layers=2, use_double_wide_mlp=True,
                     use_bidirectional_attention=None)
    return {
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 2, "dtype": dtype,
        "eos_token_id": 1, "final_logit_softcapping": 30.0,
        # Global layers have twice the head size of sliding ones (512 vs 256).
        "global_head_dim": 16, "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": 128,
        "layer_types": layer_types, "max_position_embeddings": 131072,
        "model_type": "gemma4_text", "num_attention_heads": HEADS,
        "num_hidden_layers": len(layer_types), "num_key_value_heads": KV_HEADS,
        "pad_token_id": 0, "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
        },
        "sliding_window": 4,  # shorter than the test sequences, so the mask matters
        "tie_word_embeddings": True, "use_cache": True, "vocab_size": VOCAB,
        "vocab_size_per_layer_input": VOCAB, **extra,
    }


def _gemma4_vision_config(big: bool, dtype: str) -> dict:
    """E2B/E4B towers clip their linears; 26B/31B ones standardize their output."""
    return {
        "attention_bias": False, "attention_dropout": 0.0, "default_output_length": 4,
        "dtype": dtype, "global_head_dim": 8, "head_dim": 8,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 32, "initializer_range": 0.02,
        "intermediate_size": 64, "max_position_embeddings": 131072,
        "model_type": "gemma4_vision", "num_attention_heads": 4, "num_hidden_layers": 2,
        "num_key_value_heads": 4, "patch_size": 4, "pooling_kernel_size": 2,
        "position_embedding_size": 16, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"},
        "standardize": big, "use_clipped_linears": not big,
    }


def _gemma4_audio_config(dtype: str) -> dict:
    return {
        "attention_chunk_size": 4, "attention_context_left": 5, "attention_context_right": 0,
        "attention_invalid_logits_value": -1e9, "attention_logit_cap": 50.0,
        "conv_kernel_size": 5, "dtype": dtype, "gradient_clipping": 1e10, "hidden_act": "silu",
        "hidden_size": 32, "initializer_range": 0.02, "model_type": "gemma4_audio",
        "num_attention_heads": 4, "num_hidden_layers": 1, "output_proj_dims": 32,
        "residual_weight": 0.5, "rms_norm_eps": 1e-6,
        # HF sizes input_proj_linear as (channels[0] // 4) * channels[1], KerasHub as
        # (128 mel bins // 4) * channels[1]: the two agree only for channels[0] == 128.
        "subsampling_conv_channels": [128, 8], "use_clipped_linears": True,
    }


def _gemma4_config(case: str, dtype: str) -> dict:
    text = _gemma4_text_config(case == "gemma4_moe", dtype)
    if case == "gemma4_text":
        return {"architectures": ["Gemma4ForCausalLM"], **text, "transformers_version": _VERSION}
    return {
        "architectures": ["Gemma4ForConditionalGeneration"],
        "audio_config": _gemma4_audio_config(dtype) if case == "gemma4" else None,
        "audio_token_id": VOCAB - 1, "boa_token_id": VOCAB - 2, "boi_token_id": VOCAB - 3,
        "dtype": dtype, "eoa_token_id": VOCAB - 4, "eoa_token_index": VOCAB - 4,
        "eoi_token_id": VOCAB - 5, "eos_token_id": [1, 106], "image_token_id": VOCAB - 6,
        "initializer_range": 0.02, "model_type": "gemma4", "text_config": text,
        "tie_word_embeddings": True, "transformers_version": _VERSION,
        "video_token_id": VOCAB - 7,
        "vision_config": _gemma4_vision_config(case == "gemma4_moe", dtype),
        "vision_soft_tokens_per_image": 4,
    }


def _clippable(shapes: dict, name: str, shape: tuple, clipped: bool) -> None:
    """Gemma4ClippableLinear: `.linear.weight` plus four 0-d clip-bound buffers."""
    shapes[f"{name}.linear.weight"] = shape
    if clipped:
        shapes.update({f"{name}.{b}": () for b in _CLIPS})


def _gemma4_text_shapes(c: dict, p: str) -> dict:
    n, hpl, ffn = c["num_hidden_layers"], c["hidden_size_per_layer_input"], c["intermediate_size"]
    first_shared = n - c["num_kv_shared_layers"]
    s = {p + "embed_tokens.weight": (VOCAB, HIDDEN)}
    for i, kind in enumerate(c["layer_types"]):
        q = f"{p}layers.{i}."
        full = kind == "full_attention"
        hd = c["global_head_dim"] if full else c["head_dim"]
        k_eq_v = full and c["attention_k_eq_v"]  # V is K's projection: no v_proj
        kv = c["num_global_key_value_heads"] if k_eq_v else KV_HEADS
        s[q + "self_attn.q_proj.weight"] = (HEADS * hd, HIDDEN)
        s[q + "self_attn.q_norm.weight"] = (hd,)
        if i < first_shared:  # shared layers read K/V of an earlier layer, own no k/v weights
            s[q + "self_attn.k_norm.weight"] = (hd,)
            s[q + "self_attn.k_proj.weight"] = (kv * hd, HIDDEN)
            if not k_eq_v:
                s[q + "self_attn.v_proj.weight"] = (kv * hd, HIDDEN)
        s[q + "self_attn.o_proj.weight"] = (HIDDEN, HEADS * hd)
        f = ffn * (2 if c["use_double_wide_mlp"] and i >= first_shared else 1)
        s[q + "mlp.gate_proj.weight"] = s[q + "mlp.up_proj.weight"] = (f, HIDDEN)
        s[q + "mlp.down_proj.weight"] = (HIDDEN, f)
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            s[f"{q}{norm}.weight"] = (HIDDEN,)
        if hpl:
            s[q + "per_layer_input_gate.weight"] = (hpl, HIDDEN)
            s[q + "per_layer_projection.weight"] = (HIDDEN, hpl)
            s[q + "post_per_layer_input_norm.weight"] = (HIDDEN,)
        if c["enable_moe_block"]:
            e, mi = c["num_experts"], c["moe_intermediate_size"]
            s[q + "router.proj.weight"] = (e, HIDDEN)
            s[q + "router.scale"] = (HIDDEN,)  # bare nn.Parameters: no ".weight"
            s[q + "router.per_expert_scale"] = (e,)
            s[q + "experts.gate_up_proj"] = (e, 2 * mi, HIDDEN)  # gate rows, then up rows
            s[q + "experts.down_proj"] = (e, HIDDEN, mi)
            for norm in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                         "pre_feedforward_layernorm_2"):
                s[f"{q}{norm}.weight"] = (HIDDEN,)
        s[q + "layer_scalar"] = (1,)  # a persistent buffer
    s[p + "norm.weight"] = (HIDDEN,)
    if hpl:
        s[p + "embed_tokens_per_layer.weight"] = (c["vocab_size_per_layer_input"], n * hpl)
        s[p + "per_layer_model_projection.weight"] = (n * hpl, HIDDEN)
        s[p + "per_layer_projection_norm.weight"] = (hpl,)
    return s


def _gemma4_vision_shapes(c: dict) -> dict:
    h, hd, ps, clip = c["hidden_size"], c["head_dim"], c["patch_size"], c["use_clipped_linears"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    ffn = c["intermediate_size"]
    v = "model.vision_tower."
    s = {v + "patch_embedder.input_proj.weight": (h, 3 * ps * ps),
         v + "patch_embedder.position_embedding_table": (2, c["position_embedding_size"], h)}
    for i in range(c["num_hidden_layers"]):
        e = f"{v}encoder.layers.{i}."
        for proj, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)),
                            ("o_proj", (h, q))):
            _clippable(s, f"{e}self_attn.{proj}", shape, clip)
        s[e + "self_attn.q_norm.weight"] = s[e + "self_attn.k_norm.weight"] = (hd,)
        for proj, shape in (("gate_proj", (ffn, h)), ("up_proj", (ffn, h)),
                            ("down_proj", (h, ffn))):
            _clippable(s, f"{e}mlp.{proj}", shape, clip)
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):
            s[f"{e}{norm}.weight"] = (h,)
    if c["standardize"]:
        s[v + "std_bias"] = s[v + "std_scale"] = (h,)
    s["model.embed_vision.embedding_projection.weight"] = (HIDDEN, h)
    return s


def _gemma4_audio_shapes(c: dict) -> dict:
    h, c0, c1 = c["hidden_size"], *c["subsampling_conv_channels"]
    a = "model.audio_tower."
    sub = a + "subsample_conv_projection."
    s = {sub + "layer0.conv.weight": (c0, 1, 3, 3), sub + "layer0.norm.weight": (c0,),
         sub + "layer1.conv.weight": (c1, c0, 3, 3), sub + "layer1.norm.weight": (c1,),
         sub + "input_proj_linear.weight": (h, c0 // 4 * c1)}
    for i in range(c["num_hidden_layers"]):
        b = f"{a}layers.{i}."
        for ff in ("feed_forward1", "feed_forward2"):
            _clippable(s, f"{b}{ff}.ffw_layer_1", (4 * h, h), True)
            _clippable(s, f"{b}{ff}.ffw_layer_2", (h, 4 * h), True)
            s[f"{b}{ff}.pre_layer_norm.weight"] = s[f"{b}{ff}.post_layer_norm.weight"] = (h,)
        for proj in ("q_proj", "k_proj", "v_proj", "post"):
            _clippable(s, f"{b}self_attn.{proj}", (h, h), True)
        s[b + "self_attn.relative_k_proj.weight"] = (h, h)
        s[b + "self_attn.per_dim_scale"] = (h // c["num_attention_heads"],)
        _clippable(s, b + "lconv1d.linear_start", (2 * h, h), True)
        _clippable(s, b + "lconv1d.linear_end", (h, h), True)
        s[b + "lconv1d.depthwise_conv1d.weight"] = (h, 1, c["conv_kernel_size"])
        for norm in ("lconv1d.pre_layer_norm", "lconv1d.conv_norm", "norm_pre_attn",
                     "norm_post_attn", "norm_out"):
            s[f"{b}{norm}.weight"] = (h,)
    s[a + "output_proj.weight"] = (c["output_proj_dims"], h)
    s[a + "output_proj.bias"] = (c["output_proj_dims"],)
    s["model.embed_audio.embedding_projection.weight"] = (HIDDEN, c["output_proj_dims"])
    return s


# ---------------------------------------------------------------- Qwen 3.5


def _qwen_text_config(moe: bool, tied: bool, dtype: str) -> dict:
    """Qwen3_5TextConfig / Qwen3_5MoeTextConfig as serialized in Qwen3.5-*/Qwen3.6-35B-A3B."""
    interval = 4
    c = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "bos_token_id": VOCAB - 8, "dtype": dtype, "eos_token_id": VOCAB - 8,
        "full_attention_interval": interval, "head_dim": 16, "hidden_act": "silu",
        "hidden_size": HIDDEN, "initializer_range": 0.02,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(interval)],
        # Gated delta-net: 16 key / 32 value heads of 128 in 35B-A3B.
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_num_key_heads": 8,
        "linear_num_value_heads": 16, "linear_value_head_dim": 8,
        "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        # The published checkpoints add `mtp.*` weights, which transformers never loads.
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": HEADS, "num_hidden_layers": interval,
        "num_key_value_heads": KV_HEADS, "pad_token_id": None, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-6,
        # M-RoPE pairs per axis: head_dim 16 * 0.25 = 4 rotary dims = 2 pairs.
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [1, 1, 0],
                            "partial_rotary_factor": 0.25, "rope_theta": 10_000_000,
                            "rope_type": "default"},
        "tie_word_embeddings": tied, "use_cache": True, "vocab_size": VOCAB,
    }
    if moe:  # no dense MLP: every layer is sparse, with a sigmoid-gated shared expert
        c.update(moe_intermediate_size=64, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                 output_router_logits=False, router_aux_loss_coef=0.001,
                 shared_expert_intermediate_size=128)
    else:
        c["intermediate_size"] = 128
    return c


def _qwen_config(case: str, tied: bool, dtype: str) -> dict:
    moe = case != "qwen3_5"
    name = "qwen3_5_moe" if moe else "qwen3_5"
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                          else "Qwen3_5ForConditionalGeneration"],
        "dtype": dtype, "image_token_id": VOCAB - 4, "model_type": name,
        "text_config": _qwen_text_config(moe, tied, dtype),
        "tie_word_embeddings": tied,  # the converter reads this one, not text_config's
        "transformers_version": "4.57.1", "video_token_id": VOCAB - 3,
        "vision_config": {
            "deepstack_visual_indexes": [], "depth": 2, "dtype": dtype,
            "hidden_act": "gelu_pytorch_tanh", "hidden_size": 32, "in_channels": 3,
            "initializer_range": 0.02, "intermediate_size": 64,
            "model_type": name,  # sic: the published vision_config repeats the top-level type
            "num_heads": 4, "num_position_embeddings": 16,  # a 4x4 grid, interpolated
            "out_hidden_size": HIDDEN, "patch_size": 4, "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": VOCAB - 5, "vision_start_token_id": VOCAB - 6,
    }


def _qwen_text_shapes(c: dict, fused: bool) -> dict:
    p = "model.language_model."
    hd, nk, nv = c["head_dim"], c["linear_num_key_heads"], c["linear_num_value_heads"]
    key_dim, value_dim = nk * c["linear_key_head_dim"], nv * c["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim  # the causal conv runs over q, k and v
    s = {p + "embed_tokens.weight": (VOCAB, HIDDEN)}
    for i, kind in enumerate(c["layer_types"]):
        q = f"{p}layers.{i}."
        if kind == "linear_attention":
            la = q + "linear_attn."
            s[la + "conv1d.weight"] = (conv_dim, 1, c["linear_conv_kernel_dim"])  # depthwise
            s[la + "dt_bias"] = s[la + "A_log"] = (nv,)
            s[la + "norm.weight"] = (c["linear_value_head_dim"],)
            s[la + "out_proj.weight"] = (HIDDEN, value_dim)
            s[la + "in_proj_qkv.weight"] = (conv_dim, HIDDEN)
            s[la + "in_proj_z.weight"] = (value_dim, HIDDEN)
            s[la + "in_proj_b.weight"] = s[la + "in_proj_a.weight"] = (nv, HIDDEN)
        else:
            # q_proj yields per head [query | output gate], hence 2 * head_dim.
            s[q + "self_attn.q_proj.weight"] = (HEADS * hd * 2, HIDDEN)
            s[q + "self_attn.k_proj.weight"] = (KV_HEADS * hd, HIDDEN)
            s[q + "self_attn.v_proj.weight"] = (KV_HEADS * hd, HIDDEN)
            s[q + "self_attn.o_proj.weight"] = (HIDDEN, HEADS * hd)
            s[q + "self_attn.q_norm.weight"] = s[q + "self_attn.k_norm.weight"] = (hd,)
        m = q + "mlp."
        if "num_experts" in c:
            e, mi = c["num_experts"], c["moe_intermediate_size"]
            s[m + "gate.weight"] = (e, HIDDEN)
            if fused:
                s[m + "experts.gate_up_proj"] = (e, 2 * mi, HIDDEN)
                s[m + "experts.down_proj"] = (e, HIDDEN, mi)
            else:
                for j in range(e):
                    s[f"{m}experts.{j}.gate_proj.weight"] = (mi, HIDDEN)
                    s[f"{m}experts.{j}.up_proj.weight"] = (mi, HIDDEN)
                    s[f"{m}experts.{j}.down_proj.weight"] = (HIDDEN, mi)
            m, ffn = m + "shared_expert.", c["shared_expert_intermediate_size"]
        else:
            ffn = c["intermediate_size"]
        s[m + "gate_proj.weight"] = s[m + "up_proj.weight"] = (ffn, HIDDEN)
        s[m + "down_proj.weight"] = (HIDDEN, ffn)
        if "num_experts" in c:
            s[q + "mlp.shared_expert_gate.weight"] = (1, HIDDEN)
        s[q + "input_layernorm.weight"] = s[q + "post_attention_layernorm.weight"] = (HIDDEN,)
    s[p + "norm.weight"] = (HIDDEN,)
    return s


def _qwen_vision_shapes(c: dict) -> dict:
    """Qwen3-VL-style ViT: Conv3d patches, learned 2-D positions, a 2x2 patch merger."""
    h, ffn, ps = c["hidden_size"], c["intermediate_size"], c["patch_size"]
    merged = h * c["spatial_merge_size"] ** 2
    v = "model.visual."
    s = {v + "patch_embed.proj.weight": (h, c["in_channels"], c["temporal_patch_size"], ps, ps),
         v + "patch_embed.proj.bias": (h,),
         v + "pos_embed.weight": (c["num_position_embeddings"], h)}
    for i in range(c["depth"]):
        b = f"{v}blocks.{i}."
        for name, out, inp in (("norm1", h, None), ("norm2", h, None), ("attn.qkv", 3 * h, h),
                               ("attn.proj", h, h), ("mlp.linear_fc1", ffn, h),
                               ("mlp.linear_fc2", h, ffn)):
            s[f"{b}{name}.weight"] = (out,) if inp is None else (out, inp)
            s[f"{b}{name}.bias"] = (out,)
    # The merger normalizes each patch before concatenating 2x2 of them.
    s[v + "merger.norm.weight"] = s[v + "merger.norm.bias"] = (h,)
    s[v + "merger.linear_fc1.weight"], s[v + "merger.linear_fc1.bias"] = (merged, merged), (merged,)
    s[v + "merger.linear_fc2.weight"] = (c["out_hidden_size"], merged)
    s[v + "merger.linear_fc2.bias"] = (c["out_hidden_size"],)
    return s


# ---------------------------------------------------------------- API


def hf_checkpoint(case: str, *, tied: bool, dtype: str, seed: int = 0
                  ) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json contents, {HF tensor name: array}) of a tiny checkpoint.

    Qwen 3.5: `tied=True` writes `tie_word_embeddings: true` (top level and
    text_config) and no `lm_head.weight`; `tied=False` writes `false` and an
    independent `lm_head.weight` (vocab, hidden). Gemma 4 cases are always
    tied (`ALWAYS_TIED`): `tied` is ignored and no `lm_head.weight` is written.
    `dtype` ("float32" / "bfloat16") is the dtype of every tensor and the
    config's `dtype` (transformers >= 4.56 no longer writes `torch_dtype`).
    Values are random normal (scale 0.5) from `np.random.default_rng(seed)`,
    a fresh draw per tensor, except Gemma 4 clip bounds: `*_min` is -(2 + |x|)
    and `*_max` is 2 + |x|, so that the clamps bracket zero.
    """
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; expected one of {CASES}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    tied = (tied or case in ALWAYS_TIED) and case not in NEVER_TIED
    if case.startswith("gemma4"):
        config = _gemma4_config(case, dtype)
        if case == "gemma4_text":
            # Gemma4ForCausalLM: the text model under "model." (no "language_model").
            shapes = _gemma4_text_shapes(config, "model.")
        else:
            shapes = {**_gemma4_text_shapes(config["text_config"], "model.language_model."),
                      **_gemma4_vision_shapes(config["vision_config"])}
            if config["audio_config"]:
                shapes.update(_gemma4_audio_shapes(config["audio_config"]))
    else:
        config = _qwen_config(case, tied, dtype)
        shapes = {**_qwen_vision_shapes(config["vision_config"]),
                  **_qwen_text_shapes(config["text_config"], fused=case.endswith("_fused"))}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith(_CLIPS):
            bound = 2.0 + abs(float(rng.standard_normal()))
            value = -bound if name.endswith("_min") else bound
            tensors[name] = np.asarray(value, dtype=float_dtype(dtype))
        else:
            tensors[name] = np.asarray(random_float(rng, shape, dtype))
    return config, tensors
