"""Writes the named-architecture files of issue 14 (`presets/<name>.json`).

Gemma 4, Qwen 3.5 (dense and MoE), Qwen 3 MoE, Mixtral, gpt-oss and the
Llama 3.2 presets missing so far. No network: the Hugging Face `config.json`
fields of each checkpoint are transcribed in `make_preset_entries_configs.json`
beside this script (each with its source), turned
into KerasHub backbone arguments by KerasHub's own converter
(`keras_hub/src/utils/transformers/convert_<family>.py`,
`convert_backbone_config`, exactly as `Backbone.from_preset("hf://...")` does
when KerasHub converts a checkpoint), built without allocating a weight, and
serialized the way `save_to_preset` writes `config.json`
(`keras.saving.serialize_keras_object`, minus the top-level `build_config` and
`compile_config`). The parameter count of every build is printed next to
KerasHub's published metadata.

    KERAS_BACKEND=jax python tools/make_preset_entries.py            # write
    KERAS_BACKEND=jax python tools/make_preset_entries.py --check    # compare

Existing files are not touched unless named with `--only` (or `--force`).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import math
import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRESETS = os.path.join(REPO, "presets")
DTYPE = "bfloat16"

DTYPE_NOTE = (
    "dtype: bfloat16, the checkpoint's own dtype (Hugging Face torch_dtype / "
    "dtype). KerasHub's Kaggle config.json could not be read here, so the "
    "policy it was saved with is not verified; loading uses the preset's own "
    "config.json, and keras_hub_dist overrides accept any dtype."
)
CONVERTED = (
    "Converted with KerasHub 0.32's own converter "
    "(keras_hub/src/utils/transformers/convert_{family}.py, "
    "convert_backbone_config) and serialized as save_to_preset does "
    "(tools/make_preset_entries.py)."
)

# ---------------------------------------------------------------------------
# Hugging Face configs (only the fields KerasHub's converters read): the
# published config.json values, each with its source, are data beside this
# script.
# ---------------------------------------------------------------------------

CONFIG_TABLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "make_preset_entries_configs.json")
with open(CONFIG_TABLES, encoding="utf-8") as _f:
    _TABLES = json.load(_f)
HF = {name: table["config"] for name, table in _TABLES["configs"].items()}


def _gemma4_text(**overrides):
    text = copy.deepcopy(_TABLES["gemma4_text_defaults"])
    text.update(overrides)
    return text


def _gemma4_assistant(target, hidden, heads, intermediate):
    """A Gemma4AssistantForCausalLM config (text model only; no towers).

    4 layers (3 sliding + 1 full), every layer KV-shared with the target
    (Gemma4AssistantConfig sets num_kv_shared_layers = num_hidden_layers), no
    per-layer embeddings, no MoE; attention geometry (head dims, KV heads,
    window, RoPE) as the target's, whose KV cache it reads.
    """
    t = target["text_config"]
    return {
        "model_type": "gemma4_assistant",
        "text_config": _gemma4_text(
            hidden_size=hidden, intermediate_size=intermediate,
            num_hidden_layers=4,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            num_attention_heads=heads,
            num_key_value_heads=t["num_key_value_heads"],
            num_global_key_value_heads=t["num_global_key_value_heads"],
            num_kv_shared_layers=4, sliding_window=t["sliding_window"],
            hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        ),
    }


# ---------------------------------------------------------------------------
# Entries.
# ---------------------------------------------------------------------------

_SRC_GEMMA4 = (
    "Hugging Face config of google/{hf} (not downloadable here), from "
    "huggingface/transformers src/transformers/models/gemma4/"
    "convert_gemma4_weights.py (_VARIANTS) with the defaults of "
    "configuration_gemma4.py; text and vision fields as in "
    "AI-Hypercomputer/maxtext src/maxtext/checkpoint_conversion/utils/"
    "hf_model_configs.py ({maxtext}). " + CONVERTED.format(family="gemma4")
)
_SRC_GEMMA4_ASSISTANT = (
    "Hugging Face config of google/{hf} could not be found in any stored "
    "source. Architecture as documented for Gemma4AssistantForCausalLM "
    "(huggingface/transformers src/transformers/models/gemma4_assistant/"
    "configuration_gemma4_assistant.py: every layer KV-shared, no per-layer "
    "embeddings, no MoE, no double-wide MLP) and KerasHub's "
    "Gemma4AssistantCausalLM (4 layers); sizes as stated in notes. "
    + CONVERTED.format(family="gemma4_assistant")
)
_SRC_QWEN3_5 = (
    "Hugging Face config of Qwen/{hf} (not downloadable here): text geometry "
    "{text}; shared Qwen 3.5 fields (M-RoPE [11, 11, 10], rope_theta 1e7, "
    "partial_rotary_factor 0.25, Gated DeltaNet dims, a full-attention layer "
    "every 4th) from the Qwen3.5-35B-A3B config.json copied in "
    "AI-Hypercomputer/maxtext src/maxtext/checkpoint_conversion/utils/"
    "hf_model_configs.py; vision tower {vision}. "
    + CONVERTED.format(family="qwen3_5")
)
_SRC_QWEN3_5_MOE = (
    "Hugging Face config of Qwen/Qwen3.5-35B-A3B as copied in "
    "AI-Hypercomputer/maxtext src/maxtext/checkpoint_conversion/utils/"
    "hf_model_configs.py (qwen3_5_35b_a3b_dict); THUDM/slime "
    "scripts/models/qwen3.5-35B-A3B.sh agrees. "
    + CONVERTED.format(family="qwen3_5_moe")
)
_SRC_QWEN3_MOE_30B = (
    "Hugging Face config of Qwen/Qwen3-30B-A3B (not downloadable here): "
    "AI-Hypercomputer/maxtext src/maxtext/checkpoint_conversion/utils/"
    "hf_model_configs.py (qwen3_30b_a3b_base_config, same architecture) and "
    "THUDM/slime scripts/models/qwen3-30B-A3B.sh (rotary base 1e6). "
    + CONVERTED.format(family="qwen3_moe")
)
_SRC_QWEN3_MOE_235B = (
    "Hugging Face config of Qwen/Qwen3-235B-A22B (not downloadable here): "
    "THUDM/slime scripts/models/qwen3-235B-A22B.sh (geometry, rotary base 1e6) "
    "with the remaining fields of AI-Hypercomputer/maxtext "
    "src/maxtext/checkpoint_conversion/utils/hf_model_configs.py "
    "(qwen3_235b_a22b_thinking_2507_config; its rope_theta 5e6 is the 2507 "
    "refresh's, not this checkpoint's). " + CONVERTED.format(family="qwen3_moe")
)
_SRC_QWEN3_CODER = (
    "Hugging Face config.json of Qwen/Qwen3-Coder-30B-A3B-Instruct as copied "
    "in ztxz16/fastllm Qwen3-Coder-30B-A3B-Instruct/config.json. "
    + CONVERTED.format(family="qwen3_moe")
)
_SRC_MIXTRAL = (
    "Hugging Face config.json of mistralai/Mixtral-8x7B-Instruct-v0.1 as "
    "copied in AI-Hypercomputer/maxtext src/maxtext/checkpoint_conversion/"
    "utils/hf_model_configs.py (mixtral_8x7b_dict); the base v0.1 checkpoint "
    "has the same architecture. " + CONVERTED.format(family="mixtral")
)
_SRC_GPT_OSS = (
    "Hugging Face config.json of openai/{hf} as copied in "
    "AI-Hypercomputer/maxtext src/maxtext/checkpoint_conversion/utils/"
    "hf_model_configs.py ({maxtext}, MXFP4 quantization_config removed); "
    "gpt-oss-safeguard shares the architecture. "
    + CONVERTED.format(family="gpt_oss")
)
_SRC_LLAMA3_2 = (
    "Same KerasHub config as presets/llama3.2_1b.json (the Llama 3.2 presets "
    "were converted together), {dims}. Geometry of meta-llama/{hf}: "
    "THUDM/slime scripts/models/llama3.2-3B-Instruct.sh (28 layers, hidden "
    "3072, FFN 8192, 24/8 heads, rope base 500000, llama3 rope scaling 32)."
)

_GEMMA4_ROUNDED = (
    "KerasHub publishes this count rounded ({published}); the named "
    "architecture, which is KerasHub's preset (text decoder{towers}), has "
    "{count:,} parameters ({diff:+.2f}% of the rounded figure, which it rounds "
    "to at KerasHub's precision). Text decoder alone: {text:,}."
)


def _entry(name, cls, family, hf, source, aliases=(), notes=(), fixed_config=None):
    return dict(
        name=name, cls=cls, family=family, hf=hf, source=source,
        aliases=list(aliases), notes=list(notes), fixed_config=fixed_config,
    )


def _entries():
    e = []
    # Gemma 4.
    for size, hf_name, hf, maxtext, aliases in (
        ("2b", "gemma-4-E2B", HF["gemma4_e2b"], "gemma4_e2b_dict", ["gemma4_e2b"]),
        ("4b", "gemma-4-E4B", HF["gemma4_e4b"], "gemma4_e4b_dict", ["gemma4_e4b"]),
        ("26b_a4b", "gemma-4-26B-A4B", HF["gemma4_26b_a4b"], "gemma4_26b_dict", ["gemma4_26b"]),
        ("31b", "gemma-4-31B", HF["gemma4_31b"], "gemma4_31b_dict", []),
    ):
        src = _SRC_GEMMA4.format(hf=hf_name, maxtext=maxtext)
        e.append(_entry(f"gemma4_{size}", "Gemma4Backbone", "gemma4", hf, src, aliases))
        it_alias = {"2b": "gemma4_e2b_it", "4b": "gemma4_e4b_it",
                    "26b_a4b": "gemma4_26b_a4b_it", "31b": "gemma4_31b_it"}[size]
        e.append(_entry(
            f"gemma4_instruct_{size}", "Gemma4Backbone", "gemma4", hf,
            src.replace(hf_name, hf_name + "-it"), [it_alias],
        ))
    for size, target_name, target, hidden, heads, ffn, inferred in (
        ("2b", "gemma-4-E2B-it", HF["gemma4_e2b"], 256, 4, 2048, False),
        ("4b", "gemma-4-E4B-it", HF["gemma4_e4b"], 256, 4, 2048, False),
        ("26b_a4b", "gemma-4-26B-A4B-it", HF["gemma4_26b_a4b"], 1024, 24, 5920, True),
        ("31b", "gemma-4-31B-it", HF["gemma4_31b"], 1024, 16, 10400, True),
    ):
        alias = {"2b": "gemma4_e2b_it_assistant", "4b": "gemma4_e4b_it_assistant",
                 "26b_a4b": "gemma4_26b_a4b_it_assistant", "31b": "gemma4_31b_it_assistant"}[size]
        e.append(_entry(
            f"gemma4_instruct_{size}_assistant", "Gemma4Backbone", "gemma4",
            _gemma4_assistant(target, hidden, heads, ffn),
            _SRC_GEMMA4_ASSISTANT.format(hf=target_name + "-assistant"), [alias],
            notes=[("inferred" if inferred else "derived", target_name)],
        ))
    # Qwen 3.5 dense.
    for name, hf_name, hf, text, vision, aliases in (
        ("qwen3_5_0.8b_base", "Qwen3.5-0.8B-Base", HF["qwen3_5_0_8b"], "THUDM/slime scripts/models/qwen3.5-0.8B.sh", "12 x 768 (0.8B)", ["qwen3.5_0.8b_base"]),
        ("qwen3_5_0.8b", "Qwen3.5-0.8B", HF["qwen3_5_0_8b"], "THUDM/slime scripts/models/qwen3.5-0.8B.sh", "12 x 768 (0.8B)", ["qwen3.5_0.8b"]),
        ("qwen3_5_2b_base", "Qwen3.5-2B-Base", HF["qwen3_5_2b"], "the Qwen3.5-2B model card", "24 x 1024 (2B, 4B)", ["qwen3.5_2b_base"]),
        ("qwen3_5_2b", "Qwen3.5-2B", HF["qwen3_5_2b"], "the Qwen3.5-2B model card", "24 x 1024 (2B, 4B)", ["qwen3.5_2b"]),
        ("qwen3_5_4b_base", "Qwen3.5-4B-Base", HF["qwen3_5_4b"], "THUDM/slime scripts/models/qwen3.5-4B.sh", "24 x 1024 (2B, 4B)", ["qwen3.5_4b_base"]),
        ("qwen3_5_4b", "Qwen3.5-4B", HF["qwen3_5_4b"], "THUDM/slime scripts/models/qwen3.5-4B.sh", "24 x 1024 (2B, 4B)", ["qwen3.5_4b"]),
        ("qwen3_5_9b_base", "Qwen3.5-9B-Base", HF["qwen3_5_9b"], "THUDM/slime scripts/models/qwen3.5-9B.sh", "27 x 1152 (9B, 27B, 35B-A3B)", ["qwen3.5_9b_base"]),
        ("qwen3_5_9b", "Qwen3.5-9B", HF["qwen3_5_9b"], "THUDM/slime scripts/models/qwen3.5-9B.sh", "27 x 1152 (9B, 27B, 35B-A3B)", ["qwen3.5_9b"]),
        ("qwen3_5_27b", "Qwen3.5-27B", HF["qwen3_5_27b"], "THUDM/slime scripts/models/qwen3.5-27B.sh", "27 x 1152 (9B, 27B, 35B-A3B)", ["qwen3.5_27b"]),
        ("qwen3_6_27b", "Qwen3.6-27B", HF["qwen3_5_27b"], "THUDM/slime scripts/models/qwen3.5-27B.sh (Qwen3.6-27B keeps the Qwen3.5-27B architecture)", "27 x 1152 (9B, 27B, 35B-A3B)", ["qwen3.6_27b"]),
        ("qwen3_8_27b", "Qwen3.8-27B", HF["qwen3_5_27b"], "THUDM/slime scripts/models/qwen3.5-27B.sh (Qwen3.8-27B is built on the Qwen3.5-27B architecture, per KerasHub's description)", "27 x 1152 (9B, 27B, 35B-A3B)", ["qwen3.8_27b"]),
    ):
        e.append(_entry(
            name, "Qwen3_5Backbone", "qwen3_5", hf,
            _SRC_QWEN3_5.format(hf=hf_name, text=text, vision=vision), aliases,
            notes=["Includes the vision tower (Qwen3_5VisionEncoder), as KerasHub's preset does: the published count is text + vision exactly (the multi-token-prediction head of the Hugging Face checkpoint is not part of KerasHub's model)."],
        ))
    # Qwen 3.5 MoE.
    for name, hf_name, aliases in (
        ("qwen3_5_moe_35b_a3b_base", "Qwen3.5-35B-A3B-Base", ["qwen3.5_35b_a3b_base"]),
        ("qwen3_5_moe_35b_a3b", "Qwen3.5-35B-A3B", ["qwen3.5_35b_a3b"]),
        ("qwen3_6_moe_35b_a3b", "Qwen3.6-35B-A3B", ["qwen3.6_35b_a3b"]),
    ):
        src = _SRC_QWEN3_5_MOE if hf_name == "Qwen3.5-35B-A3B" else _SRC_QWEN3_5_MOE.replace(
            "Hugging Face config of Qwen/Qwen3.5-35B-A3B",
            f"Hugging Face config of Qwen/{hf_name} (same architecture as Qwen/Qwen3.5-35B-A3B)",
        )
        e.append(_entry(
            name, "Qwen3_5MoeBackbone", "qwen3_5_moe", HF["qwen3_5_35b_a3b"], src, aliases,
            notes=["Includes the vision tower (Qwen3_5VisionEncoder, 27 x 1152), as KerasHub's preset does: the published count is text + vision exactly."],
        ))
    e.append(_entry(
        "qwen_agent_world_35b_a3b", "Qwen3_5MoeBackbone", "qwen3_5_moe",
        HF["qwen_agent_world_35b_a3b"],
        _SRC_QWEN3_5_MOE.replace(
            "Hugging Face config of Qwen/Qwen3.5-35B-A3B",
            "Text model of Qwen/Qwen-AgentWorld-35B-A3B, the Qwen3.5-35B-A3B architecture",
        ).replace("hf_model_configs.py (qwen3_5_35b_a3b_dict)",
                  "hf_model_configs.py (qwen3_5_35b_a3b_dict) converted with language_model_only=True"),
        ["qwen_agentworld_35b_a3b"],
        notes=["Text only: KerasHub's published count (34,660,610,688) is exactly the Qwen3.5-35B-A3B count less its 446,571,248-parameter vision tower, so KerasHub's AgentWorld preset has no vision encoder (vision_encoder null)."],
    ))
    # Qwen 3 MoE.
    e.append(_entry("qwen3_moe_30b_a3b_en", "Qwen3MoeBackbone", "qwen3_moe", HF["qwen3_moe_30b_a3b"],
                    _SRC_QWEN3_MOE_30B, ["qwen3_moe_30b_a3b", "qwen3_30b_a3b"]))
    e.append(_entry("qwen3_moe_235b_a22b_en", "Qwen3MoeBackbone", "qwen3_moe", HF["qwen3_moe_235b_a22b"],
                    _SRC_QWEN3_MOE_235B, ["qwen3_moe_235b_a22b", "qwen3_235b_a22b"]))
    e.append(_entry("qwen3_coder_instruct_30b_a3b_en", "Qwen3MoeBackbone", "qwen3_moe", HF["qwen3_coder_30b_a3b"],
                    _SRC_QWEN3_CODER, ["qwen3_coder_30b_a3b", "qwen3_coder_instruct_30b_a3b"]))
    # Mixtral.
    e.append(_entry("mixtral_8_7b_en", "MixtralBackbone", "mixtral", HF["mixtral_8x7b"], _SRC_MIXTRAL,
                    ["mixtral_8x7b", "mixtral_8x7b_en"]))
    e.append(_entry("mixtral_8_instruct_7b_en", "MixtralBackbone", "mixtral", HF["mixtral_8x7b"], _SRC_MIXTRAL,
                    ["mixtral_8x7b_instruct", "mixtral_8x7b_instruct_en"]))
    # gpt-oss.
    for name, hf_name, hf, maxtext, aliases in (
        ("gpt_oss_20b_en", "gpt-oss-20b", HF["gpt_oss_20b"], "gpt_oss_20b_dict", ["gpt_oss_20b"]),
        ("gpt_oss_120b_en", "gpt-oss-120b", HF["gpt_oss_120b"], "gpt_oss_120b_dict", ["gpt_oss_120b"]),
        ("gpt_oss_safeguard_20b_en", "gpt-oss-20b", HF["gpt_oss_20b"], "gpt_oss_20b_dict", ["gpt_oss_safeguard_20b"]),
        ("gpt_oss_safeguard_120b_en", "gpt-oss-120b", HF["gpt_oss_120b"], "gpt_oss_120b_dict", ["gpt_oss_safeguard_120b"]),
    ):
        e.append(_entry(name, "GptOssBackbone", "gpt_oss", hf,
                        _SRC_GPT_OSS.format(hf=hf_name, maxtext=maxtext), aliases))
    # Llama 3.2.
    e.append(_entry("llama3.2_3b", "Llama3Backbone", "llama3", None,
                    _SRC_LLAMA3_2.format(dims="with the 3B geometry", hf="Llama-3.2-3B"),
                    ["llama3.2_3b_en"], fixed_config="3b"))
    e.append(_entry("llama3.2_instruct_3b", "Llama3Backbone", "llama3", None,
                    _SRC_LLAMA3_2.format(dims="with the 3B geometry", hf="Llama-3.2-3B-Instruct"),
                    ["llama3.2_instruct_3b_en"], fixed_config="3b"))
    e.append(_entry("llama3.2_instruct_1b", "Llama3Backbone", "llama3", None,
                    "Same KerasHub config as presets/llama3.2_1b.json: Llama-3.2-1B-Instruct "
                    "has the Llama-3.2-1B architecture (KerasHub publishes the same count).",
                    ["llama3.2_instruct_1b_en"], fixed_config="1b"))
    e.append(_entry("llama3.2_guard_1b", "Llama3Backbone", "llama3", None,
                    "Same KerasHub config as presets/llama3.2_1b.json: Llama-Guard-3-1B is "
                    "Llama-3.2-1B fine-tuned (KerasHub publishes the same count).",
                    ["llama3.2_guard_1b_en", "llama_guard3_1b"], fixed_config="1b"))
    return e


# ---------------------------------------------------------------------------
# Building.
# ---------------------------------------------------------------------------


def _llama3_2_config(size):
    with open(os.path.join(PRESETS, "llama3.2_1b.json"), encoding="utf-8") as f:
        config = json.load(f)["config"]
    if size == "3b":
        config["config"].update(
            num_layers=28, num_query_heads=24, hidden_dim=3072,
            intermediate_dim=8192, num_key_value_heads=8,
        )
    return config


def _serializable(kwargs):
    import keras

    return {
        key: keras.layers.serialize(value) if isinstance(value, keras.layers.Layer) else value
        for key, value in kwargs.items()
    }


def build_config(spec):
    """`(config.json object, parameter count, model)` of one entry."""
    import keras
    import keras_hub
    from keras.src.utils.naming import to_snake_case

    from keras_hub_dist.plan.build import build_without_values

    # A fresh name scope per entry, as in KerasHub's one-checkpoint-per-process
    # conversion: nested layers keep their default names (no `_1` suffixes).
    keras.backend.clear_session()
    cls = getattr(keras_hub.models, spec["cls"])
    if spec["fixed_config"]:
        config_json = _llama3_2_config(spec["fixed_config"])
        model, _ = build_without_values(cls, dict(config_json["config"]))
    else:
        converter = importlib.import_module(
            f"keras_hub.src.utils.transformers.convert_{spec['family']}"
        )
        kwargs = _serializable(converter.convert_backbone_config(copy.deepcopy(spec["hf"])))
        kwargs["dtype"] = DTYPE
        if spec["cls"] in ("Qwen3_5Backbone", "Qwen3_5MoeBackbone", "Gemma4Backbone"):
            kwargs.setdefault("vision_encoder", None)
        model, _ = build_without_values(cls, kwargs)
        config_json = keras.saving.serialize_keras_object(model)
        for key in ("build_config", "compile_config"):
            config_json.pop(key, None)
        config_json["config"]["name"] = to_snake_case(cls.__name__)
        config_json = json.loads(json.dumps(config_json))
    count = sum(math.prod(w.shape) for w in model.weights)
    return config_json, count, model


def _part(model, attr):
    layer = getattr(model, attr, None)
    return sum(math.prod(w.shape) for w in layer.weights) if layer is not None else 0


def assistant_head_params(config, target_hidden, centroids):
    """Parameters of Gemma4AssistantCausalLM outside its backbone.

    pre_projection (2 * target_hidden -> hidden), post_projection (hidden ->
    target_hidden) and, with ordered embeddings (E2B/E4B), the 2048-centroid
    router; the token_ordering buffer is not counted (as KerasHub's conversion
    script counts).
    """
    hidden = config["hidden_dim"]
    return 3 * target_hidden * hidden + (2048 * hidden if centroids else 0)


def _notes(spec, count, model, published):
    notes = []
    name = spec["name"]
    if spec["family"] == "gemma4" and "assistant" not in name:
        towers = " + vision encoder" + (" + audio encoder" if model.audio_encoder is not None else "")
        text = count - _part(model, "vision_encoder") - _part(model, "audio_encoder")
        rounded = f"{published / 1e9:g}B"
        notes.append(_GEMMA4_ROUNDED.format(
            published=rounded, towers=towers, count=count,
            diff=(count - published) / published * 100, text=text,
        ))
        if name.endswith(("26b_a4b", "31b")):
            notes.append(
                "Google's model card gives the text model as "
                + ("25.2B" if "26b" in name else "30.7B")
                + " (this decoder); KerasHub's 26B / 31B are the model names, "
                "not a count, so the difference to them is more than 0.5% "
                "(the new tests check rounding at KerasHub's precision)."
            )
        if model.audio_encoder is not None:
            notes.append(
                "The nested audio_encoder config carries its own float32 dtype "
                "policy: KerasHub's converter builds the encoders under Keras's "
                "global policy, and only the backbone gets the preset dtype."
            )
    elif "assistant" in name:
        kind, target = spec["notes"][0]
        target_hidden = {"gemma-4-E2B-it": 1536, "gemma-4-E4B-it": 2560,
                         "gemma-4-26B-A4B-it": 2816, "gemma-4-31B-it": 5376}[target]
        centroids = target.startswith("gemma-4-E")
        head = assistant_head_params(spec_config(spec)["config"], target_hidden, centroids)
        notes.append(
            "KerasHub's published count is Gemma4AssistantCausalLM's, less its "
            "token_ordering buffer (as tools/checkpoint_conversion/"
            "convert_gemma4_hf_checkpoints.py counts it): this backbone "
            f"({count:,}) plus the head's pre_projection (2 x {target_hidden} x "
            f"hidden) and post_projection (hidden x {target_hidden})"
            + (" and 2048 centroids (hidden x 2048)" if centroids else "")
            + f", {head:,} parameters; together {count + head:,}."
        )
        if kind == "derived":
            notes.append(
                "Sizes: hidden 256, 4 layers (3 sliding with head_dim 256, 1 "
                "full with head_dim 512), 4 query heads, no K/V projections "
                "(as a published LiteRT extraction of the E4B drafter describes "
                "it, and KerasHub's Gemma4AssistantCausalLM docstring: "
                "hidden_dim=256, num_layers=4); intermediate 2048 is the only "
                "value that, with "
                "these, gives KerasHub's exact count for the E2B assistant. KV "
                "heads, window and RoPE follow the target, whose KV cache the "
                "assistant reads (they hold no parameters here)."
            )
        else:
            notes.append(
                "INFERRED, not sourced: hidden 1024 and the 4-layer layout "
                "(3 sliding x head_dim 256, 1 full x head_dim 512) are the only "
                "ones consistent with KerasHub's exact count; of the (query "
                "heads, intermediate) pairs that give the exact count, this "
                "entry takes the one whose query heads are a multiple of the "
                "target's KV heads ("
                + ("24 heads over 8 KV heads, intermediate 5920" if "26b" in name
                   else "16 heads over 16 KV heads, intermediate 10400")
                + "). Verify against the Hugging Face config.json of google/"
                + target + "-assistant when it can be read."
            )
        if name == "gemma4_instruct_4b_assistant":
            notes.append(
                "KerasHub publishes 77,731,332 for this preset, the E2B "
                "assistant's figure: with the same 76,027,396-parameter "
                "backbone, the E4B head (projections to the 2560-wide E4B) has "
                "2,490,368 parameters, so the assistant has 78,517,764 "
                "(78,779,908 with token_ordering, the 78.8M its GGUF builds "
                "report). The published figure is kept as params."
            )
    if spec["family"] == "llama3":
        notes.append(
            "Llama 3.2 ties its input and output embeddings; KerasHub's preset "
            "stores them as two tables (its published count includes both), so "
            "this config keeps tie_word_embeddings at LlamaBackbone's default, "
            "False, as presets/llama3.2_1b.json does."
        )
    if name == "llama3.2_3b":
        notes.append(
            "KerasHub's description of llama3.2_3b says 26 layers; Llama 3.2 3B "
            "has 28, and only 28 give KerasHub's published count."
        )
    notes.extend(n for n in spec["notes"] if isinstance(n, str))
    if not spec["fixed_config"]:
        notes.append(DTYPE_NOTE)
    return [n for n in notes if n]


_CONFIG_CACHE = {}


def spec_config(spec):
    key = spec["name"]
    if key not in _CONFIG_CACHE:
        _CONFIG_CACHE[key] = build_config(spec)[0]
    return _CONFIG_CACHE[key]


def make_file(spec, metadata):
    config_json, count, model = build_config(spec)
    _CONFIG_CACHE[spec["name"]] = config_json
    published = metadata["metadata"]["params"]
    data = {
        "name": spec["name"],
        "family": spec["family"],
        "backbone_class": spec["cls"],
        "description": metadata["metadata"].get("description", ""),
        "kerashub_preset": spec["name"],
        "handle": metadata["kaggle_handle"],
        "params": published,
        "params_preset": spec["name"],
        "aliases": spec["aliases"],
        "alias_notes": {},
        "notes": _notes(spec, count, model, published),
        "source": spec["source"],
        "config": config_json,
    }
    return data, count


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="entry names to (re)write")
    parser.add_argument("--force", action="store_true", help="overwrite existing files")
    parser.add_argument("--check", action="store_true", help="compare, write nothing")
    args = parser.parse_args(argv)

    import keras_hub  # noqa: F401  (registers the presets)
    from keras_hub.src.utils.preset_utils import BUILTIN_PRESETS

    status = 0
    for spec in _entries():
        if args.only and spec["name"] not in args.only:
            continue
        path = os.path.join(PRESETS, spec["name"] + ".json")
        metadata = BUILTIN_PRESETS[spec["name"]]
        data, count = make_file(spec, metadata)
        published = data["params"]
        print(f"{spec['name']:36s} built {count:>15,}  KerasHub {published:>15,}  "
              f"({(count - published) / published * 100:+.3f}%)")
        text = json.dumps(data, indent=2, ensure_ascii=False) + "\n"
        if args.check:
            if not os.path.exists(path):
                print(f"  missing: {path}")
                status = 1
            else:
                with open(path, encoding="utf-8") as f:
                    if f.read() != text:
                        print(f"  differs: {path}")
                        status = 1
            continue
        if os.path.exists(path) and not (args.force or args.only):
            print(f"  exists, kept: {path}")
            continue
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return status


if __name__ == "__main__":
    sys.exit(main())
