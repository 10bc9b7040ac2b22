"""Tiny Hugging Face checkpoints of the mixture-of-experts families KerasHub converts.

`hf_checkpoint(case, tied=..., dtype=...)` returns `(config, tensors)`: the
`config.json` contents and the `{HF tensor name: array}` state dict of a
published checkpoint of that family, with every dimension shrunk (vocab 128,
hidden 64, expert FFNs 32, 2 layers, 8 query / 2 key-value heads, 8 experts,
top-2) so that experts, heads and FFNs still split 8 ways. Write it with
`writer.write_hf_checkpoint`.

The tensor set is exactly what the KerasHub 0.32 converter of each family
(`keras_hub/src/utils/transformers/convert_{mixtral,qwen_moe,qwen3_moe,gpt_oss}.py`)
reads: nothing it ignores, nothing it misses. Experts are stored one tensor
per expert (`...experts.{e}.w1.weight`), as the published Mixtral / Qwen MoE
checkpoints are, except gpt-oss, whose experts are fused 3-D tensors in
MXFP4 (`*_blocks` / `*_scales`, uint8) with float biases.
"""

from __future__ import annotations

import numpy as np

from tests.formats.hf.writer import random_float

__all__ = ["ALWAYS_TIED", "CASES", "NEVER_TIED", "hf_checkpoint"]

CASES: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss")

# No MoE backbone here always ties.
ALWAYS_TIED: frozenset[str] = frozenset()

# MixtralBackbone and GptOssBackbone hard-code tie_weights=False, and
# convert_qwen_moe never passes `tie_word_embeddings` to QwenMoeBackbone (whose
# default is False); all three converters read `lm_head.weight`
# unconditionally, so a tied checkpoint (no lm_head) could not be loaded.
# Every published checkpoint of these families is untied. Only convert_qwen3_moe
# follows the config's `tie_word_embeddings` flag.
NEVER_TIED: frozenset[str] = frozenset({"mixtral", "qwen2_moe", "gpt_oss"})

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 128, 64, 2, 8, 2
EXPERTS, TOP_K = 8, 2
EXPERT_FFN = 32  # a multiple of 32: gpt-oss packs down_proj's input dim in MXFP4 blocks
DENSE_FFN = 64   # Qwen MoE `intermediate_size` / `shared_expert_intermediate_size`

# Qwen3-MoE and gpt-oss have num_heads * head_dim != hidden_size
# (Qwen3-30B-A3B 32*128 vs 2048, gpt-oss-20b 64*64 vs 2880); keep that property.
# Mixtral and Qwen2-MoE derive head_dim from hidden_size and have no such key.
_HEAD_DIM = {"mixtral": HIDDEN // HEADS, "qwen2_moe": HIDDEN // HEADS,
             "qwen3_moe": 16, "gpt_oss": 16}

# MXFP4: 32 FP4 (E2M1) values per block, two per byte, one E8M0 scale per block.
_MXFP4_BLOCK = 32
# E8M0 scales 2**(s - 127) for s in [120, 127]: FP4 values (|v| <= 6) times
# 2**-7 .. 2**0, i.e. weights of magnitude <= 6, most well below 1.
_SCALE_LOW, _SCALE_HIGH = 120, 128


def _config(case: str, tied: bool, dtype: str) -> dict:
    """config.json contents, keys and values as in the published config of the family."""
    common = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "output_router_logits": False,
        "tie_word_embeddings": tied,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if case == "mixtral":  # mistralai/Mixtral-8x7B-v0.1
        return {
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common,
            "intermediate_size": EXPERT_FFN,  # Mixtral's per-expert FFN size
            "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K,
            "router_aux_loss_coef": 0.02, "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "sliding_window": None,
            "bos_token_id": 1, "eos_token_id": 2, "transformers_version": "4.36.0.dev0",
        }
    if case == "qwen2_moe":  # Qwen/Qwen1.5-MoE-A2.7B
        return {
            "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", **common,
            # intermediate_size only sizes dense (non-MoE) layers; with
            # decoder_sparse_step 1 and no mlp_only_layers every layer is MoE.
            "intermediate_size": DENSE_FFN, "moe_intermediate_size": EXPERT_FFN,
            "shared_expert_intermediate_size": DENSE_FFN,
            "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": False,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
            "max_position_embeddings": 8192, "max_window_layers": LAYERS,
            "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
            "use_sliding_window": False, "sliding_window": 32768,
            "bos_token_id": VOCAB - 1, "eos_token_id": VOCAB - 1,  # real ids past our vocab
            "transformers_version": "4.39.0.dev0",
        }
    if case == "qwen3_moe":  # Qwen/Qwen3-30B-A3B
        return {
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
            "head_dim": _HEAD_DIM[case], "attention_bias": False,
            "intermediate_size": DENSE_FFN, "moe_intermediate_size": EXPERT_FFN,
            "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
            "max_position_embeddings": 40960, "max_window_layers": LAYERS,
            "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 1_000_000.0,
            "use_sliding_window": False, "sliding_window": None,
            "bos_token_id": VOCAB - 2, "eos_token_id": VOCAB - 1,  # real ids past our vocab
            "transformers_version": "4.51.0",
        }
    if case == "gpt_oss":  # openai/gpt-oss-20b
        return {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", **common,
            "head_dim": _HEAD_DIM[case], "attention_bias": True,
            "intermediate_size": EXPERT_FFN, "swiglu_limit": 7.0,
            "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K,
            "experts_per_token": TOP_K, "router_aux_loss_coef": 0.9,
            "initial_context_length": 4096, "max_position_embeddings": 131072,
            # Transformers alternates sliding / full starting with sliding at layer 0.
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                            for i in range(LAYERS)],
            "sliding_window": 4,  # real: 128; shorter than test sequences so it matters
            "rms_norm_eps": 1e-5, "rope_theta": 150000,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096,
                             "rope_type": "yarn", "truncate": False},
            "quantization_config": {
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"],
                "quant_method": "mxfp4",
            },
            "pad_token_id": VOCAB - 2, "eos_token_id": VOCAB - 1,  # real ids past our vocab
            "transformers_version": "4.55.0.dev0",
        }
    raise ValueError(f"unknown case {case!r}; expected one of {CASES}")


def _attention(case: str, p: str) -> dict[str, tuple[int, ...]]:
    hd = _HEAD_DIM[case]
    q, kv = HEADS * hd, KV_HEADS * hd
    shapes = {}
    if case == "gpt_oss":  # one learned attention-sink logit per query head
        shapes[p + "self_attn.sinks"] = (HEADS,)
    # Qwen2-MoE has q/k/v biases, gpt-oss biases on all four projections.
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("o_proj", HIDDEN)):
        shapes[f"{p}self_attn.{name}.weight"] = (rows, q if name == "o_proj" else HIDDEN)
        if case == "gpt_oss" or (case == "qwen2_moe" and name != "o_proj"):
            shapes[f"{p}self_attn.{name}.bias"] = (rows,)
    if case == "qwen3_moe":  # per-head RMSNorm on q and k
        shapes[p + "self_attn.q_norm.weight"] = (hd,)
        shapes[p + "self_attn.k_norm.weight"] = (hd,)
    return shapes


def _moe(case: str, p: str) -> dict[str, tuple[int, ...]]:
    """Router and experts; per-expert Linears are (out, in) as nn.Linear stores them."""
    shapes = {}
    if case == "mixtral":
        m = p + "block_sparse_moe."
        shapes[m + "gate.weight"] = (EXPERTS, HIDDEN)
        for e in range(EXPERTS):
            shapes[f"{m}experts.{e}.w1.weight"] = (EXPERT_FFN, HIDDEN)  # gate
            shapes[f"{m}experts.{e}.w2.weight"] = (HIDDEN, EXPERT_FFN)  # down
            shapes[f"{m}experts.{e}.w3.weight"] = (EXPERT_FFN, HIDDEN)  # up
        return shapes
    if case == "gpt_oss":
        m = p + "mlp."
        shapes[m + "router.weight"] = (EXPERTS, HIDDEN)
        shapes[m + "router.bias"] = (EXPERTS,)
        # Fused experts, MXFP4 over the input dim: gate_up_proj (hidden ->
        # 2 * ffn, rows interleaving gate (even) and up (odd) channels) and
        # down_proj (ffn -> hidden). See _tensor for the blocks / scales.
        for name, rows, cols in (("gate_up_proj", 2 * EXPERT_FFN, HIDDEN),
                                 ("down_proj", HIDDEN, EXPERT_FFN)):
            groups = cols // _MXFP4_BLOCK
            shapes[f"{m}experts.{name}_blocks"] = (EXPERTS, rows, groups, _MXFP4_BLOCK // 2)
            shapes[f"{m}experts.{name}_scales"] = (EXPERTS, rows, groups)
            shapes[f"{m}experts.{name}_bias"] = (EXPERTS, rows)
        return shapes
    m = p + "mlp."
    shapes[m + "gate.weight"] = (EXPERTS, HIDDEN)
    for e in range(EXPERTS):
        shapes[f"{m}experts.{e}.gate_proj.weight"] = (EXPERT_FFN, HIDDEN)
        shapes[f"{m}experts.{e}.up_proj.weight"] = (EXPERT_FFN, HIDDEN)
        shapes[f"{m}experts.{e}.down_proj.weight"] = (HIDDEN, EXPERT_FFN)
    if case == "qwen2_moe":  # an always-on shared expert, scaled by a sigmoid gate
        shapes[m + "shared_expert.gate_proj.weight"] = (DENSE_FFN, HIDDEN)
        shapes[m + "shared_expert.up_proj.weight"] = (DENSE_FFN, HIDDEN)
        shapes[m + "shared_expert.down_proj.weight"] = (HIDDEN, DENSE_FFN)
        shapes[m + "shared_expert_gate.weight"] = (1, HIDDEN)
    return shapes


def _shapes(case: str, tied: bool) -> dict[str, tuple[int, ...]]:
    """Every tensor, in the order of the HF module's state dict."""
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update(_attention(case, p))
        shapes.update(_moe(case, p))
        shapes[p + "input_layernorm.weight"] = (HIDDEN,)
        shapes[p + "post_attention_layernorm.weight"] = (HIDDEN,)
    shapes["model.norm.weight"] = (HIDDEN,)
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    return shapes


def _tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    # MXFP4 blocks hold two FP4 (E2M1) codes per byte, the low nibble being the
    # even column, so any byte is valid; scales are E8M0 exponents.
    if name.endswith("_blocks"):
        return rng.integers(0, 256, shape, dtype=np.uint8)
    if name.endswith("_scales"):
        return rng.integers(_SCALE_LOW, _SCALE_HIGH, shape, dtype=np.uint8)
    return random_float(rng, shape, dtype)


def hf_checkpoint(case: str, *, tied: bool, dtype: str, seed: int = 0
                  ) -> tuple[dict, dict[str, np.ndarray]]:
    """(config.json contents, {HF tensor name: array}) of a tiny checkpoint.

    `tied=True` writes `tie_word_embeddings: true` and no `lm_head.weight`;
    `tied=False` writes `tie_word_embeddings: false` and an independent
    `lm_head.weight` of shape (vocab, hidden). Cases in `NEVER_TIED` (all but
    qwen3_moe) are always written untied, whatever `tied` says.
    `dtype` ("float32" / "bfloat16") is the dtype of every float tensor and the
    config's `torch_dtype`; gpt-oss's MXFP4 blocks and scales are uint8 either
    way, its expert biases, router, attention and sinks in `dtype`. Values are
    random normal (scale 0.5) drawn from `np.random.default_rng(seed)`, a fresh
    draw for every tensor; MXFP4 blocks are uniformly random bytes.
    """
    if case not in CASES:
        raise ValueError(f"unknown case {case!r}; expected one of {CASES}")
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    tied = (tied or case in ALWAYS_TIED) and case not in NEVER_TIED
    config = _config(case, tied, dtype)
    rng = np.random.default_rng(seed)
    return config, {name: _tensor(rng, name, shape, dtype)
                    for name, shape in _shapes(case, tied).items()}
