"""Backbone factories: real KerasHub classes, sharded embedding, no side effects."""

import functools
import random
import warnings

import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import assert_laid_out_as, jitted_outputs, layout_sharding

import keras_hub_dist
from keras_hub_dist import _compat
from keras_hub_dist.plan import specs as spec_lib
from keras_hub_dist.init import initializers
from keras_hub_dist.init import registry

TINY = dict(
    vocabulary_size=128, num_layers=1, num_query_heads=4, num_key_value_heads=2,
    hidden_dim=32, intermediate_dim=32, dtype="float32",
)
WITH_HEAD_DIM = dict(TINY, head_dim=8)

# factory, named architecture, overrides that make it tiny, stock class,
# stock embedding initializer class.
FAMILIES = {
    "gemma": (
        keras_hub_dist.gemma_backbone, "gemma2_2b_en", WITH_HEAD_DIM,
        keras_hub.models.GemmaBackbone, keras.initializers.VarianceScaling,
    ),
    "gemma3": (
        keras_hub_dist.gemma3_backbone, "gemma3_1b",
        dict(WITH_HEAD_DIM, sliding_window_size=4),
        keras_hub.models.Gemma3Backbone, keras.initializers.VarianceScaling,
    ),
    "llama": (
        keras_hub_dist.llama_backbone, "llama3.1_8b", TINY,
        keras_hub.models.Llama3Backbone, keras.initializers.RandomNormal,
    ),
    "qwen": (
        keras_hub_dist.qwen_backbone, "qwen2.5_7b_en", TINY,
        keras_hub.models.QwenBackbone, keras.initializers.RandomNormal,
    ),
    "qwen3": (
        keras_hub_dist.qwen3_backbone, "qwen3_0.6b_en", WITH_HEAD_DIM,
        keras_hub.models.Qwen3Backbone, keras.initializers.RandomNormal,
    ),
    "mistral": (
        keras_hub_dist.mistral_backbone, "mistral_7b_en", TINY,
        keras_hub.models.MistralBackbone, keras.initializers.RandomNormal,
    ),
}

INPUTS = {
    "token_ids": (np.arange(16, dtype="int32").reshape(2, 8) * 7) % 128,
    "padding_mask": np.array([[1] * 8, [1] * 6 + [0] * 2], dtype="int32"),
}


def _build(family, seed=0, **extra):
    factory, name, overrides, _, _ = FAMILIES[family]
    keras.utils.set_random_seed(seed)
    return factory(name, **{**overrides, **extra})


def _forward(model):
    """One jitted forward pass (one compile instead of one per eager op)."""
    return np.asarray(jitted_outputs(model, INPUTS))


@functools.cache
def _reference(family):
    """The unsharded factory model, its outputs and the random state after it."""
    assert keras.distribution.distribution() is None
    model = _build(family)
    state = random.getstate()
    return model, state, _forward(model)


@functools.cache
def _abstract(family):
    """The family's abstract model: one for both meshes (it has no mesh)."""
    _, name, overrides, _, _ = FAMILIES[family]
    return keras_hub_dist.abstract_backbone(name, **overrides)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_factory_returns_stock_class_with_twin_of_stock_initializer(family):
    factory, name, overrides, cls, stock_init = FAMILIES[family]
    model, state_after_factory, _ = _reference(family)
    assert type(model) is cls
    twin = model.token_embedding.embeddings_initializer
    assert type(twin) is dict(initializers._TWINS)[stock_init]
    assert isinstance(twin, stock_init)
    assert twin.path == registry.lookup(registry.family_of(cls))
    # The same model built by the stock class with the same seed: the same
    # initializer statistics and seed, bitwise the same weights, and the same
    # use of Python's random state afterwards.
    config = {**keras_hub_dist.presets.resolve(name).config, **overrides}
    keras.utils.set_random_seed(0)
    stock = cls.from_config(config)
    assert random.getstate() == state_after_factory
    stock_embedding_init = stock.token_embedding.embeddings_initializer
    assert type(stock_embedding_init) is stock_init
    # The twin's config names the seed it really uses (the stock one drew it
    # at construction), so reloading the twin reproduces its values.
    assert {**stock_embedding_init.get_config(), "seed": stock_embedding_init.seed,
            "path": twin.path} == twin.get_config()
    assert twin.seed == stock_embedding_init.seed
    assert [v.path for v in model.weights] == [v.path for v in stock.weights]
    for ours, theirs in zip(model.weights, stock.weights):
        np.testing.assert_array_equal(
            np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path
        )


@pytest.mark.parametrize("mesh_shape", [(1, 8), (2, 4)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_build_matches_layouts_and_unsharded_outputs(
    family, mesh_shape, monkeypatch
):
    factory, name, overrides, _, _ = FAMILIES[family]
    reference, _, expected_outputs = _reference(family)

    abstract = _abstract(family)
    mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"), jax.devices())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_hub_dist.LayoutFallbackWarning)
        layout_map = keras_hub_dist.get_layout_map(abstract, mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )

    # Record what the embedding initializer itself returned: the table must be
    # born sharded, not created whole and re-laid out afterwards.
    created = []
    original_call = initializers._Distributed.__call__

    def recording_call(self, shape, dtype=None, layout=None):
        value = original_call(self, shape, dtype=dtype, layout=layout)
        created.append((self.path, tuple(shape), value))
        return value

    monkeypatch.setattr(initializers._Distributed, "__call__", recording_call)
    with distribution.scope():
        model = _build(family)
        outputs = _forward(model)
    monkeypatch.undo()

    assert_laid_out_as(model.weights, layout_map, mesh)
    embedding = model.token_embedding.embeddings
    emb_axes = tuple(layout_map[embedding.path].axes)
    block = spec_lib.shard_shape(embedding.shape, emb_axes, mesh)
    # Split along the vocabulary over both axes (`family_rules.vocabulary_rules`).
    assert block == (128 // 8, 32)
    born_by_path = {path: value for path, _, value in created}
    assert len(born_by_path) == len(created)  # each variable drawn once
    born = born_by_path[embedding.path]
    assert born.sharding.is_equivalent_to(
        layout_sharding(mesh, emb_axes, 2), 2
    )
    assert {tuple(s.data.shape) for s in born.addressable_shards} == {block}
    assert len(born.addressable_shards) == 8
    # Every kernel with a Keras random initializer was drawn by its twin,
    # already in the variable's final sharding (no re-layout afterwards).
    weights = {v.path: v for v in model.weights}
    kernels = [p for p in weights if p.endswith("kernel")]
    assert kernels and set(kernels) <= set(born_by_path)
    for path, value in born_by_path.items():
        final = weights[path].value
        assert value.sharding.is_equivalent_to(final.sharding, final.ndim), path

    for ours, theirs in zip(model.weights, reference.weights):
        np.testing.assert_allclose(
            np.asarray(ours.value), np.asarray(theirs.value),
            rtol=1e-6, atol=1e-7, err_msg=ours.path,
        )
    np.testing.assert_allclose(outputs, expected_outputs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_saves_and_reloads_with_stock_from_preset(family, tmp_path):
    _, _, _, cls, stock_init = FAMILIES[family]
    model, _, outputs = _reference(family)
    model.save_to_preset(str(tmp_path))
    reloaded = keras_hub.models.Backbone.from_preset(str(tmp_path))
    assert type(reloaded) is cls
    # The saved config is the stock one: reloading gives the stock initializer.
    assert type(reloaded.token_embedding.embeddings_initializer) is stock_init
    for ours, theirs in zip(model.weights, reloaded.weights):
        np.testing.assert_array_equal(
            np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path
        )
    np.testing.assert_array_equal(_forward(reloaded), outputs)


def test_named_architecture_alias_and_dtype_override():
    model = keras_hub_dist.gemma_backbone(
        "gemma2_7b", num_layers=1, vocabulary_size=64, hidden_dim=16,
        intermediate_dim=32, num_query_heads=2, num_key_value_heads=2,
        dtype="bfloat16",
    )
    assert model.num_layers == 1 and model.hidden_dim == 16
    assert model.token_embedding.embeddings.dtype == "bfloat16"
    # Everything not overridden comes from gemma_7b_en's config.
    assert model.head_dim == 256 and model.attention_logit_soft_cap is None
    assert model.use_post_ffw_norm is False
    assert isinstance(
        model.token_embedding.embeddings_initializer,
        keras_hub_dist.DistributedVarianceScaling,
    )


def test_plain_config_dicts_and_family_mismatch():
    plain = dict(TINY, vocabulary_size=64)
    assert type(keras_hub_dist.llama_backbone(plain)) is keras_hub.models.LlamaBackbone
    assert type(keras_hub_dist.mistral_backbone(plain)) is (
        keras_hub.models.MistralBackbone
    )
    with pytest.raises(ValueError) as info:
        keras_hub_dist.gemma_backbone("llama3_8b_en", num_layers=1)
    message = str(info.value)
    assert "'llama3_8b_en'" in message and "keras_hub_dist.llama_backbone()" in message
    with pytest.raises(keras_hub_dist.UnknownPresetError, match="gemma_7b"):
        keras_hub_dist.gemma_backbone("gemma_7bb")


def _global_state():
    classes = (
        keras_hub.models.GemmaBackbone, keras_hub.models.Gemma3Backbone,
        keras_hub.models.LlamaBackbone, keras_hub.models.Llama3Backbone,
        keras_hub.models.QwenBackbone, keras_hub.models.Qwen3Backbone,
        keras_hub.models.MistralBackbone, keras_hub.models.Backbone,
        keras.layers.ReversibleEmbedding, keras.layers.Embedding,
        type(keras.Variable(0.0)), keras.initializers.VarianceScaling,
        keras.initializers.RandomNormal, initializers.DistributedVarianceScaling,
        initializers.DistributedRandomNormal, keras.StatelessScope,
    )
    pending = _compat._keras_global_state.get_global_attribute(
        "uninitialized_variables"
    ) or []
    return {
        "distribution": keras.distribution.distribution(),
        "registry": registry.entries(),
        "pending": [id(v) for v in pending],
        "stateless": _compat.in_stateless_scope(),
        "floatx": keras.config.floatx(),
        "policy": keras.config.dtype_policy().name,
        "context_mesh": _compat.context_mesh(),
        "classes": {cls: dict(vars(cls)) for cls in classes},
    }


def test_no_global_state_changed_when_factories_return_or_raise():
    # A variable someone else left pending must stay pending and listed.
    with keras.StatelessScope(initialize_variables=False):
        sentinel = keras.Variable(initializer="zeros", shape=(2,), name="sentinel")
    try:
        before = _global_state()

        _build("gemma")
        assert _global_state() == before

        # Raises inside construction, after some variables were created.
        with pytest.raises(ValueError, match="fully-defined"):
            keras_hub_dist.gemma_backbone(
                "gemma_2b_en", **dict(WITH_HEAD_DIM, head_dim=None)
            )
        assert _global_state() == before

        # Raises before construction (wrong family).
        with pytest.raises(ValueError):
            keras_hub_dist.qwen_backbone("gemma_2b_en")
        assert _global_state() == before

        # Raises while initializing under a distribution: a vocabulary the
        # model axis does not divide, with a hand-written layout map.
        mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), jax.devices())
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map["token_embedding/embeddings"] = ("model", None)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
        with distribution.scope():
            inside = _global_state()
            with pytest.raises(keras_hub_dist.LayoutError) as info:
                _build("qwen3", vocabulary_size=100)
            assert _global_state() == inside
        notes = " ".join(getattr(info.value, "__notes__", []))
        assert "token_embedding/embeddings" in str(info.value) + notes
        assert _global_state() == before
        assert sentinel._value is None
    finally:
        _compat._keras_global_state.set_global_attribute(
            "uninitialized_variables", []
        )


def test_factory_inside_a_stateless_scope_is_refused():
    with keras.StatelessScope():
        with pytest.raises(RuntimeError, match="StatelessScope"):
            keras_hub_dist.gemma_backbone("gemma_2b_en", **WITH_HEAD_DIM)
