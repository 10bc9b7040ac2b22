"""`remat=`: the decoder blocks rematerialized (`shaping.remat`), never the
embedding, so a causal LM's `fit` works; and what it saves.

The memory test compiles only (XLA's `memory_analysis()` of Keras's train
step of the causal LM on abstract models, no weight allocated): 4 small
programs, and the residuals the forward pass saves for the backward pass
(the jaxpr of `jax.vjp`, no compiler involved).
"""

import jax
import keras
import keras_hub
import numpy as np
import pytest

import keras_hub_dist
from keras_hub_dist.jobs import programs
from keras_hub_dist.jobs.abstract_job import abstract_job
from keras_hub_dist.shaping import block_gathers
from keras_hub_dist.shaping.apply import build_shaped
from keras_hub_dist.shaping.remat import apply_remat, checkpointed, remat_scope

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


def _rematerialized(model):
    """The paths of the layers whose call is checkpointed, and each layer's
    Keras mode (`(mode, threshold, names)` or None)."""
    layers = list(model._flatten_layers(include_self=True))
    checkpointed = {l.name for l in layers if hasattr(l.call, "unrematerialized")}
    modes = {None if m is None else (m.mode, m.output_size_threshold, tuple(m.layer_names))
             for m in (l._remat_mode for l in layers)}
    return checkpointed, modes


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


def test_only_the_decoder_blocks_are_rematerialized():
    blocks = {"decoder_block_0", "decoder_block_1"}
    built = keras_hub_dist.gemma_backbone(TINY_GEMMA, remat="full")
    assert _rematerialized(built) == (blocks, {None})
    scope = keras.RematScope("list_of_layers", layer_names=["decoder_block_1", "token_embedding"])
    model, _ = build_shaped(keras_hub.models.GemmaBackbone, TINY_GEMMA, scope)
    assert _rematerialized(model) == ({"decoder_block_1"}, {None})
    model, _ = build_shaped(keras_hub.models.GemmaBackbone, TINY_GEMMA, "activations")
    checkpointed, modes = _rematerialized(model)
    assert not checkpointed and modes == {None, ("activations", 1024, ())}
    assert model.get_layer("token_embedding")._remat_mode is None
    # An already built model (enable_lora): replaced; None keeps it.
    backbone = keras_hub_dist.mistral_backbone(TINY_MISTRAL)
    assert _rematerialized(backbone) == (set(), {None})
    keras_hub_dist.enable_lora(backbone, rank=2, target_modules=["q_proj"], remat="full")
    assert _rematerialized(backbone) == ({"transformer_layer_0"}, {None})
    keras_hub_dist.enable_lora(backbone, rank=2, target_modules=["v_proj"])
    assert _rematerialized(backbone)[0] == {"transformer_layer_0"}


def _saved_residual_bytes(job, batch, length):
    """Bytes the forward pass of the train step's loss saves for its backward
    pass (`jax.vjp`'s residuals, the weights themselves not counted)."""
    task = job.task
    specs = lambda vs: [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in vs]
    state = [specs(vs) for vs in (task.non_trainable_variables, task.metrics_variables, task.optimizer.variables)]
    x, y, sample_weight = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), programs.fit_batch(job, batch, length)
    )

    def pullback(trainable, state, x, y, sample_weight):
        def loss(trainable):
            return task.compute_loss_and_updates(
                trainable, state[0], state[1], x, y, sample_weight, training=True, optimizer_variables=state[2]
            )[0]

        return jax.vjp(loss, trainable)[1]

    with job.scope():
        closed = jax.make_jaxpr(pullback)(specs(task.trainable_variables), state, x, y, sample_weight)
    inputs = set(closed.jaxpr.invars)
    saved = [v for v in closed.jaxpr.outvars if type(v).__name__ == "Var" and v not in inputs]
    return sum(v.aval.size * v.aval.dtype.itemsize for v in saved)


def test_full_remat_cuts_per_layer_fit_memory():
    batch, length = 8, 512
    temps, saved = {}, {}
    for mode in (None, "full"):
        for layers in (1, 2):
            keras.backend.clear_session()
            config = dict(WIDE_GEMMA, num_layers=layers)
            job = abstract_job(keras_hub.models.GemmaBackbone, config, (1, 8), remat=mode)
            lowered = programs.lower_fit(job, batch, length, "sgd")
            temps[mode, layers] = programs.program_memory(lowered.compile())["temp_bytes"]
            saved[mode, layers] = _saved_residual_bytes(job, batch, length)
    per_layer = {m: temps[m, 2] - temps[m, 1] for m in (None, "full")}
    saved_per_layer = {m: saved[m, 2] - saved[m, 1] for m in (None, "full")}
    # Saved for the backward pass, per layer (any compiler): the block's
    # input alone, 8 x 512 x 256 f32 = 4 MiB, against 384 MiB (0.011x).
    assert saved_per_layer["full"] == batch * length * WIDE_GEMMA["hidden_dim"] * 4, saved_per_layer
    assert saved_per_layer["full"] <= 0.02 * saved_per_layer[None], saved_per_layer
    # XLA:CPU's temporaries per layer: measured 4.1 MiB against 60.7 MiB
    # (0.067x; jax.checkpoint's own gave 0.46x, docs/plan.md).
    assert per_layer["full"] <= 0.2 * per_layer[None], (temps, per_layer)


@pytest.mark.parametrize("mesh", [(1, 8), (2, 4)])
def test_causal_lm_fit_with_remat_matches_without(mesh, tmp_path, monkeypatch):
    """Two SGD steps with dropout, with `remat="full"` and without: the same
    losses, weights and dropout seeds. On (2, 4) each rematerialized block
    also runs `block_gathers.gathered_again_in_backward` inside, whose
    backward pass is traced within the recomputation's."""
    wrapper, regathered = block_gathers.gathered_again_in_backward, []
    monkeypatch.setattr(
        block_gathers, "gathered_again_in_backward", lambda *a: regathered.append(a[0].name) or wrapper(*a)
    )
    preset = keras_hub_dist.write_synthetic_preset(
        str(tmp_path / "gemma"), keras_hub.models.GemmaBackbone, tokenizer=True, **TINY_GEMMA, dropout=0.5
    )
    lm = keras_hub_dist.load_sharded_preset(preset, mesh=mesh, task="causal_lm", remat="full")
    lm.preprocessor = None
    initial = lm.get_weights()
    seeds = [v for v in lm.variables if v.path.endswith("seed_generator_state")]
    first_seeds = [np.asarray(v.value) for v in seeds]
    rng = np.random.default_rng(0)
    x = {"token_ids": rng.integers(0, 64, (8, 12)).astype("int32"), "padding_mask": np.ones((8, 12), bool)}
    y = rng.integers(0, 64, (8, 12)).astype("int32")
    losses, weights = [], []
    for remat in ("full", None):
        apply_remat(lm, remat)
        lm.set_weights(initial)
        for seed, value in zip(seeds, first_seeds):
            seed.assign(value)  # the same dropout masks both ways
        # SGD: the update is the gradient itself (Adam's first step is about
        # lr * sign(g), which turns float noise in a ~0 gradient into lr).
        lm.compile(optimizer=keras.optimizers.SGD(0.1))
        # Two steps: the second draws other dropout masks (the seeds
        # advanced), and each recomputation the forward pass's.
        losses.append(lm.fit(x, y, sample_weight=x["padding_mask"], batch_size=8, epochs=2, verbose=0).history["loss"])
        weights.append([*lm.get_weights(), *[np.asarray(v.value) for v in seeds]])
    keras.distribution.set_distribution(None)
    assert len(seeds) >= 4 and losses[0][0] != losses[0][1]  # 2 in each block
    assert bool(regathered) == (mesh == (2, 4))
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_non_finite_cotangent_reaches_what_it_reaches_without_remat(clean_state):
    """The recomputation's inputs depend on the output's cotangent through a
    zero made from its first element; an inf there (a loss weighting a
    position infinitely) must not make that zero NaN and every gradient
    with it."""
    with clean_state():
        layer = keras.layers.Dense(4)
        layer.build((2, 3))
        rematerialized = checkpointed(layer, layer.call)
        x = np.arange(1, 7, dtype="float32").reshape(2, 3)
        weight = np.ones((2, 4), "float32")
        weight[0, 0] = np.inf

        def loss(kernel, bias, x, call):
            with keras.StatelessScope(state_mapping=[(layer.kernel, kernel), (layer.bias, bias)]):
                return jax.numpy.sum(call(x) * weight)

        grads = [
            jax.grad(loss, argnums=(0, 1, 2))(layer.kernel.value, layer.bias.value, x, call)
            for call in (rematerialized, layer.call)
        ]
    for with_remat, without in zip(*grads):
        np.testing.assert_array_equal(with_remat, without)  # inf where inf, the rest finite
    kernel_grad = grads[0][0]
    assert np.isinf(kernel_grad[:, 0]).all() and np.isfinite(kernel_grad[:, 1:]).all()
