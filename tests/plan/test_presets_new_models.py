"""Named architectures of issue 14: Gemma 4, Qwen 3.5 (dense and MoE), Qwen 3
MoE, Mixtral, gpt-oss and the rest of Llama 3.2.

Every entry's abstract build (no weight allocated, 235B included) is counted
against KerasHub's published metadata (`BUILTIN_PRESETS[name]["metadata"]
["params"]`):

- EXACT: the count equals the metadata (Qwen 3.5, Qwen 3.5 MoE, Qwen 3 MoE,
  Mixtral, gpt-oss, Llama 3.2).
- ROUNDED: Gemma 4's 5.1B / 7.9B / 26B / 31B are rounded figures (26B and 31B
  are the model names). The count must round to the published figure at its
  own precision (within half a unit of its last significant digit). That is
  looser than 0.5% for three of them: E4B is 0.52% above 7.9B, 26B-A4B 0.75%
  below 26B, 31B 0.88% above 31B (see the entries' notes); all stay within 1%.
- ASSISTANT: Gemma 4's speculative-decoding assistants. KerasHub publishes
  the count of Gemma4AssistantCausalLM (without its token_ordering buffer):
  the named architecture (the backbone) plus the head's pre/post projections
  and, for E2B/E4B, 2048 centroids. Backbone + head equals the metadata
  exactly, except for the E4B assistant, whose metadata repeats the E2B
  assistant's figure (its own head is larger; see its notes).

Builds are cached per distinct config (instruct and base presets share one).
"""

import functools
import json

import keras_hub
import pytest
from keras_hub.src.utils.preset_utils import BUILTIN_PRESETS

import keras_hub_dist
from keras_hub_dist.plan import presets

EXACT, ROUNDED, ASSISTANT = "exact", "rounded", "assistant"

# name -> (backbone class, family, count check, aliases)
NEW = {
    # Gemma 4.
    "gemma4_2b": ("Gemma4Backbone", "gemma4", ROUNDED, ["gemma4_e2b"]),
    "gemma4_instruct_2b": ("Gemma4Backbone", "gemma4", ROUNDED, ["gemma4_e2b_it"]),
    "gemma4_4b": ("Gemma4Backbone", "gemma4", ROUNDED, ["gemma4_e4b"]),
    "gemma4_instruct_4b": ("Gemma4Backbone", "gemma4", ROUNDED, ["gemma4_e4b_it"]),
    "gemma4_26b_a4b": ("Gemma4Backbone", "gemma4", ROUNDED, ["gemma4_26b"]),
    "gemma4_instruct_26b_a4b": ("Gemma4Backbone", "gemma4", ROUNDED, ["gemma4_26b_a4b_it"]),
    "gemma4_31b": ("Gemma4Backbone", "gemma4", ROUNDED, []),
    "gemma4_instruct_31b": ("Gemma4Backbone", "gemma4", ROUNDED, ["gemma4_31b_it"]),
    "gemma4_instruct_2b_assistant": ("Gemma4Backbone", "gemma4", ASSISTANT, ["gemma4_e2b_it_assistant"]),
    "gemma4_instruct_4b_assistant": ("Gemma4Backbone", "gemma4", ASSISTANT, ["gemma4_e4b_it_assistant"]),
    "gemma4_instruct_26b_a4b_assistant": ("Gemma4Backbone", "gemma4", ASSISTANT, ["gemma4_26b_a4b_it_assistant"]),
    "gemma4_instruct_31b_assistant": ("Gemma4Backbone", "gemma4", ASSISTANT, ["gemma4_31b_it_assistant"]),
    # Qwen 3.5.
    "qwen3_5_0.8b_base": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.5_0.8b_base"]),
    "qwen3_5_0.8b": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.5_0.8b"]),
    "qwen3_5_2b_base": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.5_2b_base"]),
    "qwen3_5_2b": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.5_2b"]),
    "qwen3_5_4b_base": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.5_4b_base"]),
    "qwen3_5_4b": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.5_4b"]),
    "qwen3_5_9b_base": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.5_9b_base"]),
    "qwen3_5_9b": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.5_9b"]),
    "qwen3_5_27b": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.5_27b"]),
    "qwen3_6_27b": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.6_27b"]),
    "qwen3_8_27b": ("Qwen3_5Backbone", "qwen3_5", EXACT, ["qwen3.8_27b"]),
    # Qwen 3.5 MoE.
    "qwen3_5_moe_35b_a3b_base": ("Qwen3_5MoeBackbone", "qwen3_5_moe", EXACT, ["qwen3.5_35b_a3b_base"]),
    "qwen3_5_moe_35b_a3b": ("Qwen3_5MoeBackbone", "qwen3_5_moe", EXACT, ["qwen3.5_35b_a3b"]),
    "qwen3_6_moe_35b_a3b": ("Qwen3_5MoeBackbone", "qwen3_5_moe", EXACT, ["qwen3.6_35b_a3b"]),
    "qwen_agent_world_35b_a3b": ("Qwen3_5MoeBackbone", "qwen3_5_moe", EXACT, ["qwen_agentworld_35b_a3b"]),
    # Qwen 3 MoE.
    "qwen3_moe_30b_a3b_en": ("Qwen3MoeBackbone", "qwen3_moe", EXACT, ["qwen3_moe_30b_a3b", "qwen3_30b_a3b"]),
    "qwen3_moe_235b_a22b_en": ("Qwen3MoeBackbone", "qwen3_moe", EXACT, ["qwen3_moe_235b_a22b", "qwen3_235b_a22b"]),
    "qwen3_coder_instruct_30b_a3b_en": ("Qwen3MoeBackbone", "qwen3_moe", EXACT, ["qwen3_coder_30b_a3b", "qwen3_coder_instruct_30b_a3b"]),
    # Mixtral.
    "mixtral_8_7b_en": ("MixtralBackbone", "mixtral", EXACT, ["mixtral_8x7b", "mixtral_8x7b_en"]),
    "mixtral_8_instruct_7b_en": ("MixtralBackbone", "mixtral", EXACT, ["mixtral_8x7b_instruct", "mixtral_8x7b_instruct_en"]),
    # gpt-oss.
    "gpt_oss_20b_en": ("GptOssBackbone", "gpt_oss", EXACT, ["gpt_oss_20b"]),
    "gpt_oss_120b_en": ("GptOssBackbone", "gpt_oss", EXACT, ["gpt_oss_120b"]),
    "gpt_oss_safeguard_20b_en": ("GptOssBackbone", "gpt_oss", EXACT, ["gpt_oss_safeguard_20b"]),
    "gpt_oss_safeguard_120b_en": ("GptOssBackbone", "gpt_oss", EXACT, ["gpt_oss_safeguard_120b"]),
    # Llama 3.2.
    "llama3.2_3b": ("Llama3Backbone", "llama3", EXACT, ["llama3.2_3b_en"]),
    "llama3.2_instruct_1b": ("Llama3Backbone", "llama3", EXACT, ["llama3.2_instruct_1b_en"]),
    "llama3.2_instruct_3b": ("Llama3Backbone", "llama3", EXACT, ["llama3.2_instruct_3b_en"]),
    "llama3.2_guard_1b": ("Llama3Backbone", "llama3", EXACT, ["llama3.2_guard_1b_en", "llama_guard3_1b"]),
}

# Every preset of these classes is named (plus the Llama 3.2 ones).
ALL_PRESETS_OF = [
    "Gemma4Backbone", "Qwen3_5Backbone", "Qwen3_5MoeBackbone",
    "Qwen3MoeBackbone", "MixtralBackbone", "GptOssBackbone",
]

# Gemma 4 assistant -> (target instruct entry, ordered-embedding centroids).
ASSISTANT_TARGET = {
    "gemma4_instruct_2b_assistant": ("gemma4_instruct_2b", True),
    "gemma4_instruct_4b_assistant": ("gemma4_instruct_4b", True),
    "gemma4_instruct_26b_a4b_assistant": ("gemma4_instruct_26b_a4b", False),
    "gemma4_instruct_31b_assistant": ("gemma4_instruct_31b", False),
}
NUM_CENTROIDS = 2048


@functools.lru_cache(maxsize=None)
def _summary_of_config(key):
    """`(parameter count, bytes by dtype)` of the abstract build of one
    distinct config (the model itself is not kept: see
    test_235b_builds_without_memory)."""
    report = keras_hub_dist.abstract_backbone(_FIRST_NAME[key])
    # Shapes only: a 235B model is "built" without memory.
    assert report.total_bytes == sum(report.bytes_by_dtype.values())
    with pytest.raises(RuntimeError, match="Expected symbolic use only"):
        report.model.token_embedding.embeddings.value
    return report.parameter_count, dict(report.bytes_by_dtype)


def _count_of_config(key):
    return _summary_of_config(key)[0]


def _config_key(name):
    return json.dumps(presets.resolve(name).config_json(), sort_keys=True)


_FIRST_NAME = {}
for _name in NEW:
    _FIRST_NAME.setdefault(_config_key(_name), _name)


def abstract_count(name):
    return _count_of_config(_config_key(name))


def published(name):
    return BUILTIN_PRESETS[name]["metadata"]["params"]


def assistant_head(name):
    """Gemma4AssistantCausalLM parameters outside the backbone."""
    target, centroids = ASSISTANT_TARGET[name]
    hidden = presets.resolve(name).config["hidden_dim"]
    target_hidden = presets.resolve(target).config["hidden_dim"]
    pre_projection = 2 * target_hidden * hidden
    post_projection = hidden * target_hidden
    return pre_projection + post_projection + (NUM_CENTROIDS * hidden if centroids else 0)


def rounding_unit(figure):
    """Unit of a rounded figure's last significant digit: 5.1e9 -> 1e8."""
    digits = str(int(figure)).rstrip("0")
    return 10 ** (len(str(int(figure))) - len(digits))


def test_every_preset_of_the_new_classes_is_named():
    names = set(presets.names())
    for class_name in ALL_PRESETS_OF:
        cls = getattr(keras_hub.models, class_name)
        assert set(cls.presets) <= names, class_name
        assert {n for n, spec in NEW.items() if spec[0] == class_name} == set(cls.presets)
    llama3_2 = {n for n in keras_hub.models.Llama3Backbone.presets if n.startswith("llama3.2_")}
    assert llama3_2 <= names
    assert set(NEW) <= names


@pytest.mark.parametrize("name", sorted(NEW))
def test_entry_names_handle_and_class(name):
    class_name, family, _, aliases = NEW[name]
    entry = presets.resolve(name)
    assert entry.name == entry.kerashub_preset == name
    assert entry.family == family
    assert entry.backbone_class_name == class_name
    assert entry.backbone_class is getattr(keras_hub.models, class_name)
    assert entry.handle == BUILTIN_PRESETS[name]["kaggle_handle"]
    assert entry.parameter_count == published(name)
    assert entry.params_preset == name and entry.kerashub_metadata_params is None
    assert tuple(aliases) == entry.aliases
    for key in (name, name.upper(), entry.handle, *aliases):
        assert presets.resolve(key) is entry, key
    assert entry.source, "every new entry names the source of its config"
    assert entry.config_json()["registered_name"] == f"keras_hub>{class_name}"
    assert entry.config["dtype"]["config"]["name"] == "bfloat16"


@pytest.mark.parametrize("name", sorted(n for n, spec in NEW.items() if spec[2] == EXACT))
def test_exact_parameter_count(name):
    assert abstract_count(name) == published(name)


@pytest.mark.parametrize("name", sorted(n for n, spec in NEW.items() if spec[2] == ROUNDED))
def test_gemma4_count_rounds_to_kerashub_figure(name):
    count, figure = abstract_count(name), published(name)
    unit = rounding_unit(figure)
    assert unit >= 10**8  # KerasHub gives 5.1B, 7.9B, 26B, 31B.
    assert abs(count - figure) <= unit // 2, (count, figure)
    # Not always within 0.5% (E4B +0.52%, 26B-A4B -0.75%, 31B +0.88%); <1%.
    assert abs(count - figure) / figure < 0.01
    # The notes give the exact count and say why it differs.
    assert any(f"{count:,}" in note for note in presets.resolve(name).notes)


@pytest.mark.parametrize("name", sorted(ASSISTANT_TARGET))
def test_gemma4_assistant_count(name):
    backbone, head, figure = abstract_count(name), assistant_head(name), published(name)
    notes = " ".join(presets.resolve(name).notes)
    assert f"{backbone:,}" in notes and f"{head:,}" in notes
    if name == "gemma4_instruct_4b_assistant":
        # KerasHub's metadata repeats the E2B assistant's figure: same
        # backbone, but the E4B head (projections to 2560 wide) is larger.
        e2b = "gemma4_instruct_2b_assistant"
        assert figure == published(e2b)
        assert backbone == abstract_count(e2b)
        assert backbone + assistant_head(e2b) == figure
        assert backbone + head == 78_517_764 != figure
    else:
        assert backbone + head == figure


@pytest.mark.parametrize(
    "name, vision, audio",
    [
        ("gemma4_2b", True, True),
        ("gemma4_4b", True, True),
        ("gemma4_26b_a4b", True, False),
        ("gemma4_31b", True, False),
        ("gemma4_instruct_31b_assistant", False, False),
        ("qwen3_5_0.8b", True, None),
        ("qwen3_5_27b", True, None),
        ("qwen3_5_moe_35b_a3b", True, None),
        ("qwen_agent_world_35b_a3b", False, None),
    ],
)
def test_multimodal_towers_match_kerashub_presets(name, vision, audio):
    config = presets.resolve(name).config
    assert (config["vision_encoder"] is not None) == vision
    if audio is not None:
        assert (config["audio_encoder"] is not None) == audio


def test_shared_configs_are_identical():
    """Instruct/base twins share one config, so one build serves both."""
    twins = [
        ("gemma4_2b", "gemma4_instruct_2b"),
        ("gemma4_4b", "gemma4_instruct_4b"),
        ("gemma4_26b_a4b", "gemma4_instruct_26b_a4b"),
        ("gemma4_31b", "gemma4_instruct_31b"),
        ("qwen3_5_9b_base", "qwen3_5_9b"),
        ("qwen3_5_27b", "qwen3_8_27b"),
        ("qwen3_5_moe_35b_a3b", "qwen3_6_moe_35b_a3b"),
        ("mixtral_8_7b_en", "mixtral_8_instruct_7b_en"),
        ("gpt_oss_120b_en", "gpt_oss_safeguard_120b_en"),
        ("llama3.2_1b", "llama3.2_guard_1b"),
        ("llama3.2_3b", "llama3.2_instruct_3b"),
    ]
    for a, b in twins:
        assert _config_key(a) == _config_key(b), (a, b)


def test_235b_builds_without_memory():
    # The one abstract build of qwen3_moe_235b_a22b_en's config (the alias
    # resolves to it), shared with its exact count: every abstract build
    # there raises on an eager read of its token table.
    count, bytes_by_dtype = _summary_of_config(_config_key("qwen3_235b_a22b"))
    assert count == 235_093_634_560
    assert bytes_by_dtype == {"bfloat16": 2 * 235_093_634_560}
