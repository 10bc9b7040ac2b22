"""This year's families load sharded equal to stock: Gemma 4 (dense, MoE),
Qwen 3.5 (dense, MoE), Qwen3-MoE, Mixtral, gpt-oss and Llama 3.2-style
Llama 3, as tiny KerasHub presets; greedy `generate` of the MoE causal LMs
sharded equals unsharded."""

import warnings

import jax
import keras
import keras_hub
import numpy as np
import pytest

import keras_hub_dist
from keras_hub_dist import load_sharded_preset, write_synthetic_preset
from keras_hub_dist.formats import huggingface
from conftest import EXPERT_BANK, assert_laid_out_as, jitted_outputs
from tests.formats.hf import dense, moe, recent

pytestmark = pytest.mark.usefixtures("short_delta_chunks")

# (fixture module, case): the tiny configs of the Hugging Face tests,
# converted to KerasHub configs by KerasHub's own converters.
FAMILIES = {
    "gemma4": (recent, "gemma4_text"),
    "gemma4_moe": (recent, "gemma4_moe"),
    "qwen3_5": (recent, "qwen3_5"),
    "qwen3_5_moe": (recent, "qwen3_5_moe"),
    "qwen3_moe": (moe, "qwen3_moe"),
    "mixtral": (moe, "mixtral"),
    "gpt_oss": (moe, "gpt_oss"),
    "llama3": (dense, "llama"),
}
MOE = {"gemma4_moe", "qwen3_5_moe", "qwen3_moe", "mixtral", "gpt_oss"}
VOCAB = 512
PROMPTS = ["the quick brown fox", "w1 w2 w3", "over the lazy dog", "a"]


def _config(family):
    module, case = FAMILIES[family]
    hf_config, _ = module.hf_checkpoint(case, tied=False, dtype="float32")
    cls, config = huggingface.backbone_config(hf_config, case)
    config = dict(config, vocabulary_size=VOCAB)
    for tower in ("vision_encoder", "audio_encoder"):  # text only: no media inputs
        if tower in config:
            config[tower] = None
    if "vocabulary_size_per_layer_input" in config:
        config["vocabulary_size_per_layer_input"] = VOCAB
    if family in ("qwen3_5", "qwen3_5_moe"):
        # One Gated DeltaNet layer and one full-attention layer (the
        # checkpoint's 3 + 1): both kinds are loaded, laid out and run, and
        # the DeltaNet traces and compiles (the file's slowest part) halve.
        config.update(
            num_layers=2, layer_types=["linear_attention", "full_attention"]
        )
    return cls, config


@pytest.fixture(scope="module")
def tiny_presets(tmp_path_factory):
    root = tmp_path_factory.mktemp("new_models")
    out = {}
    for i, family in enumerate(FAMILIES):
        cls, config = _config(family)
        out[family] = write_synthetic_preset(
            str(root / family), cls, dtype="float32", tokenizer=True, seed=i, **config
        )
    return out


def _inputs(backbone):
    token_ids = (np.arange(16, dtype="int32").reshape(2, 8) * 7 + 3) % VOCAB
    inputs = {
        "token_ids": token_ids,
        "padding_mask": np.ones_like(token_ids),
        "position_ids": np.broadcast_to(np.arange(8, dtype="int32"), token_ids.shape).copy(),
    }
    missing = set(backbone.input) - set(inputs)
    assert not missing, missing
    return {k: v for k, v in inputs.items() if k in backbone.input}


def _forward(backbone):
    """One jitted forward pass (eager Gated DeltaNet runs op by op: minutes)."""
    return np.asarray(jitted_outputs(backbone, _inputs(backbone)))


@pytest.fixture(scope="module")
def stock_outputs(tiny_presets):
    """Stock, unsharded: `(weights in model order, forward output)`."""
    keras.distribution.set_distribution(None)
    out = {}
    for family, preset in tiny_presets.items():
        backbone = keras_hub.models.Backbone.from_preset(preset)
        weights = [np.asarray(v.value) for v in backbone.weights]
        out[family] = (weights, _forward(backbone))
    return out


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_loads_sharded_equal_to_stock(family, mesh_shape, tiny_presets, stock_outputs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tiny head counts fall back on 8 devices
        backbone = load_sharded_preset(tiny_presets[family], mesh=mesh_shape, progress=False)
    stock_weights, stock_output = stock_outputs[family]
    # Each variable is laid out as the family's map says; expert banks are
    # split over the model axis (their experts over both axes where the mesh
    # divides them), never replicated.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_hub_dist.LayoutFallbackWarning)
        mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"), jax.devices())
        layout_map = keras_hub_dist.get_layout_map(backbone, mesh)
    assert_laid_out_as(backbone.weights, layout_map, mesh)
    banks = [v for v in backbone.weights if EXPERT_BANK.fullmatch(v.path)]
    assert bool(banks) == (family in MOE), family
    for variable in banks:
        axes = [a for e in variable.value.sharding.spec for a in ((e,) if isinstance(e, str) else e or ())]
        assert "model" in axes, variable.path
    # Same order (paths may differ by Keras's per-process layer-name counters).
    for ours, theirs in zip(backbone.weights, stock_weights, strict=True):
        np.testing.assert_array_equal(np.asarray(ours.value), theirs)
    sharded = [v for v in backbone.weights if not v.value.sharding.is_fully_replicated]
    assert len(sharded) >= len(backbone.weights) // 3, family
    np.testing.assert_allclose(
        _forward(backbone), stock_output, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_causal_lm_generates_the_unsharded_tokens(family, tiny_presets):
    keras.distribution.set_distribution(None)
    reference = keras_hub.models.CausalLM.from_preset(tiny_presets[family])
    reference.compile(sampler="greedy")
    expected = reference.generate(PROMPTS, max_length=12)
    for mesh_shape in [(1, 8), (2, 4)]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lm = load_sharded_preset(tiny_presets[family], mesh=mesh_shape, task="causal_lm",
                                     progress=False)
        expert_banks = [v for v in lm.backbone.weights if v.ndim == 3 and "expert" in v.path]
        assert expert_banks and all(
            not v.value.sharding.is_fully_replicated for v in expert_banks), family
        lm.compile(sampler="greedy")
        assert lm.generate(PROMPTS, max_length=12) == expected, mesh_shape
        keras.distribution.set_distribution(None)
