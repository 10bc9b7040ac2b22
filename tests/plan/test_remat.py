"""`remat=`: Keras's rematerialization scope entered around our builds.

The memory test compiles only (XLA's `memory_analysis()` of Keras's train
step on abstract models, no weight allocated): 4 small programs.
"""

import jax
import keras
import keras_hub
import numpy as np
import pytest

import keras_hub_dist
from keras_hub_dist.measure.step_memory import train_step_memory
from keras_hub_dist.plan.build import build_without_values, remat_scope

TINY_MISTRAL = dict(
    vocabulary_size=64, num_layers=1, num_query_heads=2, num_key_value_heads=1,
    hidden_dim=16, intermediate_dim=32, dtype="float32",
)
TINY_GEMMA = dict(
    vocabulary_size=64, num_layers=2, num_query_heads=2, num_key_value_heads=1,
    hidden_dim=16, intermediate_dim=32, head_dim=8, dtype="float32",
)
# Tiny weights, wide activations: 8 heads' (512 x 512) scores dominate a
# layer's saved activations, as they do in a long-context fit.
WIDE_GEMMA = dict(
    vocabulary_size=256, num_query_heads=8, num_key_value_heads=1,
    hidden_dim=256, intermediate_dim=512, head_dim=32, dtype="float32",
)


def _modes(model):
    """Each layer's mode as `(mode, threshold, layer names)`, or None."""
    return {
        None if m is None else (m.mode, m.output_size_threshold, tuple(m.layer_names))
        for m in (l._remat_mode for l in model._flatten_layers(include_self=True))
    }


def test_remat_scope_takes_keras_modes_and_scopes():
    assert remat_scope(None) is None
    assert remat_scope("full").mode == "full"
    scope = keras.RematScope("larger_than", output_size_threshold=7)
    assert remat_scope(scope) is scope
    for bad in ("ful", "none", 1):
        with pytest.raises(ValueError, match=r"Expected remat= to be one of \[None, 'full'.*Received: remat="):
            remat_scope(bad)


def test_unknown_mode_fails_before_anything_is_built(clean_state):
    with clean_state():
        with pytest.raises(ValueError, match="Received: remat='fast'"):
            keras_hub_dist.gemma_backbone(TINY_GEMMA, remat="fast")
        with pytest.raises(ValueError, match="Received: remat='fast'"):
            # No such preset: the mode is checked before it is looked for.
            keras_hub_dist.load_sharded_preset("/no/such/preset", remat="fast")
    backbone = keras_hub_dist.mistral_backbone(TINY_MISTRAL)
    with pytest.raises(ValueError, match="Received: remat='fast'"):
        keras_hub_dist.enable_lora(backbone, rank=2, remat="fast")
    assert not any("lora" in v.path for v in backbone.weights)


def test_every_layer_gets_the_mode():
    scope = keras.RematScope("list_of_layers", layer_names=["decoder_block_1"])
    model, _ = build_without_values(keras_hub.models.GemmaBackbone, TINY_GEMMA, scope)
    assert _modes(model) == {("list_of_layers", 1024, ("decoder_block_1",))}
    built = keras_hub_dist.gemma_backbone(TINY_GEMMA, remat="full")
    assert _modes(built) == {("full", 1024, ())}
    # An already built model (enable_lora): set on every layer; None keeps it.
    backbone = keras_hub_dist.mistral_backbone(TINY_MISTRAL)
    assert _modes(backbone) == {None}
    keras_hub_dist.enable_lora(backbone, rank=2, target_modules=["q_proj"], remat="full")
    assert _modes(backbone) == {("full", 1024, ())}
    keras_hub_dist.enable_lora(backbone, rank=2, target_modules=["v_proj"])
    assert _modes(backbone) == {("full", 1024, ())}


def test_full_remat_cuts_per_layer_fit_temporaries():
    batch, length = 8, 512
    x = {
        "token_ids": jax.ShapeDtypeStruct((batch, length), "int32"),
        "padding_mask": jax.ShapeDtypeStruct((batch, length), "int32"),
    }
    y = jax.ShapeDtypeStruct((batch, length, WIDE_GEMMA["hidden_dim"]), "float32")
    temps = {}
    for mode in (None, "full"):
        for layers in (1, 2):
            keras.backend.clear_session()
            model, _ = build_without_values(
                keras_hub.models.GemmaBackbone, dict(WIDE_GEMMA, num_layers=layers), mode
            )
            temps[mode, layers] = train_step_memory(model, x, y)["temp_bytes"]
    per_layer = {m: temps[m, 2] - temps[m, 1] for m in (None, "full")}
    # Measured 0.46x (118 vs 258 MiB per layer, XLA:CPU, jax 0.10.2).
    assert per_layer["full"] <= 0.5 * per_layer[None], (temps, per_layer)


def test_one_train_step_with_remat_matches_without():
    keras.utils.set_random_seed(3)
    plain = keras_hub_dist.gemma_backbone(TINY_GEMMA)
    remat = keras_hub_dist.gemma_backbone(TINY_GEMMA, remat="full")
    remat.set_weights(plain.get_weights())
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 64, (2, 12)).astype("int32"),
        "padding_mask": np.ones((2, 12), "int32"),
    }
    y = rng.standard_normal((2, 12, 16)).astype("float32")
    losses = []
    for model in (plain, remat):
        # SGD: the update is the gradient itself (Adam's first step is about
        # lr * sign(g), which turns float noise in a ~0 gradient into lr).
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        losses.append(model.train_on_batch(x, y))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    for a, b in zip(plain.get_weights(), remat.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
