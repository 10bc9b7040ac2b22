"""What a Transformers checkpoint of a family holds where KerasHub's exporter
says nothing or says it wrong: tensor names and shapes, and config.json.

KerasHub 0.32 exports Gemma, Gemma 3, Gemma 4, Llama 3, Mistral, Qwen 2,
Qwen 3.5 and GPT-2 (`get_*_config` / `get_*_weights_map`, replayed by
`save.hf_mapping`). It imports, but cannot export, Qwen 3, Qwen3-MoE,
Mixtral, gpt-oss and SmolLM3. For those, this module gives only the *layout*
of the checkpoint Transformers reads (each tensor's name and shape, in the
order of Transformers' state dict, which decides the shard split) and its
config.json; which variable elements go where is KerasHub's import
converter, traced on that very layout and inverted (`save.hf_mapping`), and
the layout is checked by that trace (a missing, extra or misshapen tensor
is an error).

Corrections of stock, each tested against Transformers:

- Gemma: `get_gemma_weights_map` keeps only the first K/V head
  (`key_dense.weights[0][0]`) and reshapes the query kernel across heads
  (`reshape(-1, hidden_dim)` of a (hidden, heads, head_dim) array); both
  are only right for one K/V head and `heads * head_dim == hidden_dim`
  (gemma_2b's shape, not gemma_7b's). The shapes here are Transformers'
  (`(heads * head_dim, hidden)`), and the values KerasHub's converter's.
- Gemma 2 (a `GemmaBackbone` with post norms and soft caps) is written as a
  `gemma2` checkpoint; stock writes it as `gemma`, without the post norms.
- Qwen 2: `get_qwen_config` has no `use_sliding_window` / `sliding_window`,
  which KerasHub's own converter requires: they are added.
- Gemma 4: stock's config gives the global layers' RoPE no `rope_type`,
  which Transformers reads as "default"; KerasHub computes it as
  "proportional" (logits differ by ~1e-2 otherwise). It writes
  `num_global_key_value_heads` = `num_key_value_heads` for a model without
  separate global K/V heads, which KerasHub's importer reads as a model
  whose global layers share K and V (other weights). Its text-only config
  names `Gemma4TextModel` (no LM head) as the architecture.
- `architectures`: the causal-LM class where stock names none or one
  without the LM head (Gemma, Gemma 3 text, Gemma 4 text, Qwen 2, GPT-2);
  vLLM and SGLang pick the model class by it.

Example:

```python
family = FAMILIES["Qwen3Backbone"]
family.layout(backbone)   # [("model.embed_tokens.weight", (vocab, hidden)), ...]
family.config(backbone)   # config.json contents
```
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["FAMILIES", "GEMMA2", "Family", "corrected_layout", "corrected_config", "gemma2_like"]

Layout = list[tuple[str, tuple[int, ...]]]


@dataclass(frozen=True)
class Family:
    """A family KerasHub cannot export.

    Attributes:
        model_type: Transformers' `model_type`.
        layout: Backbone -> `[(tensor name, shape)]`, in state-dict order.
        config: Backbone -> config.json contents (without token ids).
        traced_as: Tensor name -> the `(name, shape, dtype)`s KerasHub's
            converter reads instead (gpt-oss's experts: MXFP4 blocks and
            scales), for tracing the converter only; `None` if it reads the
            layout as written.
    """

    model_type: str
    layout: Callable[[Any], Layout]
    config: Callable[[Any], dict[str, Any]]
    traced_as: Callable[[str, tuple[int, ...]], list[tuple[str, tuple[int, ...], str]] | None] | None = None


def _attention(
    p: str, hidden: int, heads: int, kv_heads: int, head_dim: int, *, bias: bool = False,
    out_bias: bool = False, qk_norm: bool = False, sinks: bool = False,
) -> Layout:
    q, kv = heads * head_dim, kv_heads * head_dim
    t: Layout = [(f"{p}self_attn.q_proj.weight", (q, hidden))]
    t += [(f"{p}self_attn.q_proj.bias", (q,))] if bias else []
    t += [(f"{p}self_attn.k_proj.weight", (kv, hidden))]
    t += [(f"{p}self_attn.k_proj.bias", (kv,))] if bias else []
    t += [(f"{p}self_attn.v_proj.weight", (kv, hidden))]
    t += [(f"{p}self_attn.v_proj.bias", (kv,))] if bias else []
    t += [(f"{p}self_attn.o_proj.weight", (hidden, q))]
    t += [(f"{p}self_attn.o_proj.bias", (hidden,))] if out_bias else []
    t += [(f"{p}self_attn.q_norm.weight", (head_dim,)), (f"{p}self_attn.k_norm.weight", (head_dim,))] if qk_norm else []
    t += [(f"{p}self_attn.sinks", (heads,))] if sinks else []
    return t


def _mlp(p: str, hidden: int, intermediate: int) -> Layout:
    return [
        (f"{p}gate_proj.weight", (intermediate, hidden)),
        (f"{p}up_proj.weight", (intermediate, hidden)),
        (f"{p}down_proj.weight", (hidden, intermediate)),
    ]


def _norms(p: str, hidden: int) -> Layout:
    return [(f"{p}input_layernorm.weight", (hidden,)), (f"{p}post_attention_layernorm.weight", (hidden,))]


def _model(backbone: Any, layers: Callable[[int, str], Layout], tied: bool) -> Layout:
    c = backbone.get_config()
    hidden = c["hidden_dim"]
    t: Layout = [("model.embed_tokens.weight", (c["vocabulary_size"], hidden))]
    for i in range(c["num_layers"]):
        t += layers(i, f"model.layers.{i}.")
    t += [("model.norm.weight", (hidden,))]
    t += [] if tied else [("lm_head.weight", (c["vocabulary_size"], hidden))]
    return t


def _rope(theta: float, factor: float | None) -> dict[str, Any]:
    scaling = None if factor in (None, 1.0) else {"rope_type": "linear", "factor": factor}
    return {"rope_theta": theta, "rope_scaling": scaling}


def _dtype(backbone: Any) -> str:
    return backbone.dtype_policy.variable_dtype


def _decoder_config(backbone: Any, architecture: str, model_type: str, heads: str = "num_query_heads") -> dict[str, Any]:
    """The keys every decoder family's config.json shares."""
    c = backbone.get_config()
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": c["vocabulary_size"],
        "hidden_size": c["hidden_dim"],
        "intermediate_size": c["intermediate_dim"],
        "num_hidden_layers": c["num_layers"],
        "num_attention_heads": c[heads],
        "num_key_value_heads": c["num_key_value_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": c["layer_norm_epsilon"],
        "attention_dropout": c.get("dropout", c.get("attention_dropout", 0.0)),
        "torch_dtype": _dtype(backbone),
    }


# --- Qwen 3 ------------------------------------------------------------------


def _qwen3_layout(backbone: Any) -> Layout:
    """Qwen 3, and Qwen3-MoE (whose sparse layers hold a router and one
    gate / up / down projection per expert)."""
    c = backbone.get_config()
    h = c["hidden_dim"]

    def layer(i: int, p: str) -> Layout:
        t = _attention(p, h, c["num_query_heads"], c["num_key_value_heads"], c["head_dim"], qk_norm=True)
        if "num_experts" in c and _is_moe_layer(c, i):
            t += [(f"{p}mlp.gate.weight", (c["num_experts"], h))]
            for e in range(c["num_experts"]):
                t += _mlp(f"{p}mlp.experts.{e}.", h, c["moe_intermediate_dim"])
        else:
            t += _mlp(p + "mlp.", h, c["intermediate_dim"])
        return t + _norms(p, h)

    return _model(backbone, layer, c["tie_word_embeddings"])


def _is_moe_layer(c: dict[str, Any], i: int) -> bool:
    return (
        i not in (c.get("mlp_only_layers") or [])
        and c["num_experts"] > 0
        and (i + 1) % c["decoder_sparse_step"] == 0
    )


def _qwen3_config(backbone: Any) -> dict[str, Any]:
    c = backbone.get_config()
    window = c.get("sliding_window_size")
    return {
        **_decoder_config(backbone, "Qwen3ForCausalLM", "qwen3"),
        "head_dim": c["head_dim"],
        **_rope(c["rope_max_wavelength"], c.get("rope_scaling_factor")),
        "attention_bias": False,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "tie_word_embeddings": c["tie_word_embeddings"],
    }


# --- Qwen3-MoE ---------------------------------------------------------------


def _qwen3_moe_config(backbone: Any) -> dict[str, Any]:
    c = backbone.get_config()
    return {
        **_qwen3_config(backbone),
        **_decoder_config(backbone, "Qwen3MoeForCausalLM", "qwen3_moe"),
        "moe_intermediate_size": c["moe_intermediate_dim"],
        "num_experts": c["num_experts"],
        "num_experts_per_tok": c["top_k"],
        "norm_topk_prob": c["norm_top_k_prob"],
        "decoder_sparse_step": c["decoder_sparse_step"],
        "mlp_only_layers": list(c.get("mlp_only_layers") or []),
        "router_aux_loss_coef": c["router_aux_loss_coefficient"],
        "output_router_logits": False,
        # KerasHub's converter reads `sliding_window` whatever this says.
        "use_sliding_window": False,
    }


# --- Mixtral -----------------------------------------------------------------


def _mixtral_layout(backbone: Any) -> Layout:
    c = backbone.get_config()
    h, experts, inter = c["hidden_dim"], c["num_experts"], c["intermediate_dim"]
    head_dim = h // c["num_query_heads"]

    def layer(i: int, p: str) -> Layout:
        t = _attention(p, h, c["num_query_heads"], c["num_key_value_heads"], head_dim)
        t += [(f"{p}block_sparse_moe.gate.weight", (experts, h))]
        for e in range(experts):
            q = f"{p}block_sparse_moe.experts.{e}."
            t += [(f"{q}w1.weight", (inter, h)), (f"{q}w2.weight", (h, inter)), (f"{q}w3.weight", (inter, h))]
        return t + _norms(p, h)

    return _model(backbone, layer, tied=False)


def _mixtral_config(backbone: Any) -> dict[str, Any]:
    c = backbone.get_config()
    return {
        **_decoder_config(backbone, "MixtralForCausalLM", "mixtral"),
        "head_dim": c["hidden_dim"] // c["num_query_heads"],
        "num_local_experts": c["num_experts"],
        "num_experts_per_tok": c["top_k"],
        "router_aux_loss_coef": c["router_aux_loss_coef"],
        "router_jitter_noise": c.get("router_jitter_noise", 0.0),
        "output_router_logits": False,
        **_rope(c["rope_max_wavelength"], c.get("rope_scaling_factor")),
        "sliding_window": c["sliding_window"],
        "tie_word_embeddings": False,
    }


# --- gpt-oss -----------------------------------------------------------------

_MXFP4_GROUP = 32


def _gpt_oss_head_dim(c: dict[str, Any]) -> int:
    return c.get("head_dim") or c["hidden_dim"] // c["num_query_heads"]


def _gpt_oss_layout(backbone: Any) -> Layout:
    c = backbone.get_config()
    h, experts, inter = c["hidden_dim"], c["num_experts"], c["intermediate_dim"]

    def layer(i: int, p: str) -> Layout:
        t = _attention(
            p, h, c["num_query_heads"], c["num_key_value_heads"], _gpt_oss_head_dim(c),
            bias=True, out_bias=True, sinks=True,
        )
        t += [(f"{p}mlp.router.weight", (experts, h)), (f"{p}mlp.router.bias", (experts,))]
        t += [
            (f"{p}mlp.experts.gate_up_proj", (experts, h, 2 * inter)),
            (f"{p}mlp.experts.gate_up_proj_bias", (experts, 2 * inter)),
            (f"{p}mlp.experts.down_proj", (experts, inter, h)),
            (f"{p}mlp.experts.down_proj_bias", (experts, h)),
        ]
        return t + _norms(p, h)

    return _model(backbone, layer, tied=False)


def _gpt_oss_traced_as(name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], str]] | None:
    """KerasHub reads gpt-oss experts only as MXFP4 (`*_blocks`, `*_scales`
    of the transposed (experts, out, in) matrix); the unquantized layout
    Transformers reads (`gate_up_proj` (experts, hidden, 2 * ffn)) is
    KerasHub's variable as it is."""
    if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return None
    experts, inputs, outputs = shape
    groups = -(-inputs // _MXFP4_GROUP)
    return [
        (f"{name}_blocks", (experts, outputs, groups, _MXFP4_GROUP // 2), "uint8"),
        (f"{name}_scales", (experts, outputs, groups), "uint8"),
    ]


def _gpt_oss_config(backbone: Any) -> dict[str, Any]:
    c = backbone.get_config()
    config = {
        **_decoder_config(backbone, "GptOssForCausalLM", "gpt_oss"),
        "head_dim": _gpt_oss_head_dim(c),
        "num_local_experts": c["num_experts"],
        "num_experts_per_tok": c["top_k"],
        "experts_per_token": c["top_k"],
        "output_router_logits": False,
        "rope_theta": c["rope_max_wavelength"],
        # KerasHub's gpt-oss always applies YaRN with these parameters.
        "rope_scaling": {
            "rope_type": "yarn", "factor": c.get("rope_scaling_factor") or 1.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096,
        },
        "sliding_window": c["sliding_window"],
        # KerasHub's gpt-oss slides on odd layers; Transformers' default
        # (and the published config) on even ones: written as the model is.
        "layer_types": [
            "sliding_attention" if i % 2 == 1 else "full_attention" for i in range(c["num_layers"])
        ],
        "attention_bias": True,
        "tie_word_embeddings": False,
    }
    return config


# --- SmolLM3 -----------------------------------------------------------------


def _smollm3_layout(backbone: Any) -> Layout:
    c = backbone.get_config()
    h = c["hidden_dim"]
    heads = c["num_attention_heads"]

    def layer(i: int, p: str) -> Layout:
        attn = _attention(p, h, heads, c["num_key_value_heads"], h // heads, bias=c["attention_bias"])
        if c["attention_bias"]:
            attn.append((f"{p}self_attn.o_proj.bias", (h,)))
        return attn + _mlp(p + "mlp.", h, c["intermediate_dim"]) + _norms(p, h)

    return _model(backbone, layer, tied=True)


def _smollm3_config(backbone: Any) -> dict[str, Any]:
    c = backbone.get_config()
    return {
        **_decoder_config(backbone, "SmolLM3ForCausalLM", "smollm3", heads="num_attention_heads"),
        "max_position_embeddings": c["max_position_embeddings"],
        "rope_theta": c["rope_theta"],
        "rope_scaling": None,
        "no_rope_layers": [int(bool(x)) for x in c["rope_layer_enabled_list"]],
        "layer_types": list(c["layer_types"]),
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": c["attention_bias"],
        "mlp_bias": c["mlp_bias"],
        "tie_word_embeddings": True,
        # Transformers' defaults are SmolLM3's real ids; the tokenizer's, if
        # any, replace them.
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }


# --- Gemma 2 (a GemmaBackbone stock exports as Gemma 1) ------------------------


def gemma2_like(backbone: Any) -> bool:
    """Whether a `GemmaBackbone` is a Gemma 2 (post norms, soft caps)."""
    c = backbone.get_config()
    return bool(c.get("use_post_ffw_norm") or c.get("use_post_attention_norm"))


def _gemma_layout(backbone: Any, gemma2: bool) -> Layout:
    c = backbone.get_config()
    h = c["hidden_dim"]

    def layer(i: int, p: str) -> Layout:
        t = _attention(p, h, c["num_query_heads"], c["num_key_value_heads"], c["head_dim"])
        t += _mlp(p + "mlp.", h, c["intermediate_dim"] // 2) + _norms(p, h)
        if gemma2:
            t += [(f"{p}pre_feedforward_layernorm.weight", (h,)), (f"{p}post_feedforward_layernorm.weight", (h,))]
        return t

    return _model(backbone, layer, tied=True)


def _gemma2_config(backbone: Any) -> dict[str, Any]:
    c = backbone.get_config()
    config = _decoder_config(backbone, "Gemma2ForCausalLM", "gemma2")
    del config["hidden_act"]
    return {
        **config,
        "intermediate_size": c["intermediate_dim"] // 2,
        "head_dim": c["head_dim"],
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": 10000.0,
        "query_pre_attn_scalar": (
            c["head_dim"] if c["query_head_dim_normalize"] else c["hidden_dim"] // c["num_query_heads"]
        ),
        "attn_logit_softcapping": c["attention_logit_soft_cap"],
        "final_logit_softcapping": c["final_logit_soft_cap"],
        "sliding_window": c["sliding_window_size"],
        "layer_types": [
            "sliding_attention" if c["use_sliding_window_attention"] and i % 2 == 0 else "full_attention"
            for i in range(c["num_layers"])
        ],
        "tie_word_embeddings": True,
        "pad_token_id": 0,
    }


FAMILIES: dict[str, Family] = {
    "Qwen3Backbone": Family("qwen3", _qwen3_layout, _qwen3_config),
    "Qwen3MoeBackbone": Family("qwen3_moe", _qwen3_layout, _qwen3_moe_config),
    "MixtralBackbone": Family("mixtral", _mixtral_layout, _mixtral_config),
    "GptOssBackbone": Family("gpt_oss", _gpt_oss_layout, _gpt_oss_config, _gpt_oss_traced_as),
    "SmolLM3Backbone": Family("smollm3", _smollm3_layout, _smollm3_config),
}
# A `GemmaBackbone` with post norms (`gemma2_like`).
GEMMA2 = Family("gemma2", lambda b: _gemma_layout(b, True), _gemma2_config)


def corrected_layout(backbone: Any, layout: Layout) -> Layout:
    """Stock's layout with the shapes Transformers reads where stock's are
    wrong (Gemma's q/k/v, see the module docstring)."""
    if type(backbone).__name__ != "GemmaBackbone":
        return layout
    right = dict(_gemma_layout(backbone, False))
    return [(name, right.get(name, shape)) for name, shape in layout]


# Transformers' causal-LM class per text `model_type`, where stock's config
# names none or a class without the LM head.
_CAUSAL_LM = {
    "gemma": "GemmaForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
}


def corrected_config(backbone: Any, config: dict[str, Any]) -> dict[str, Any]:
    """Stock's config.json with what Transformers 5 and KerasHub's own
    converter need (see the module docstring)."""
    config = dict(config)
    name = type(backbone).__name__
    if name == "QwenBackbone":
        c = backbone.get_config()
        config.setdefault("use_sliding_window", bool(c.get("use_sliding_window_attention")))
        config.setdefault("sliding_window", c.get("sliding_window_size"))
    if name == "Gemma4Backbone":
        # KerasHub computes Gemma 4's global RoPE as Transformers'
        # "proportional" type; stock names no type, which means "default".
        text = config.get("text_config", config)
        rope = text.get("rope_parameters") or {}
        if "full_attention" in rope and "rope_type" not in rope["full_attention"]:
            rope["full_attention"] = {**rope["full_attention"], "rope_type": "proportional"}
        if "sliding_attention" in rope:
            rope["sliding_attention"] = {"rope_type": "default", **rope["sliding_attention"]}
        # Stock writes num_key_value_heads where the model has none, which
        # KerasHub's importer reads as K = V on the global layers.
        if backbone.get_config().get("num_global_key_value_heads") is None:
            text["num_global_key_value_heads"] = None
    causal = _CAUSAL_LM.get(config.get("model_type"))
    if causal and config.get("architectures") != [causal]:
        config = {"architectures": [causal], **{k: v for k, v in config.items() if k != "architectures"}}
    return config
