"""Factories of the MoE / hybrid families: Gemma 4, Qwen 3.5 (+ MoE), Qwen3-MoE,
Mixtral and gpt-oss.

Each family is built tiny (float32) from a plain config dict, laid out by
`get_layout_map` (the automatic planner, `plan_layout`, only for a family
without rules). Keras names unnamed
sublayers (the MoE blocks) with a process-wide counter, so the session is
cleared before the stock build without values (which the maps are planned
on) and again before the factory call: both builds then give every variable
the same path, and the planner's exact-path keys match.
"""

import dataclasses
import functools
import gc
import random
import warnings

import jax
import keras
import keras_hub
import numpy as np
import pytest
from jax.sharding import PartitionSpec
from conftest import assert_laid_out_as, layout_sharding

import keras_hub_dist
from keras_hub_dist import _compat
from keras_hub_dist.init import factories
from keras_hub_dist.init import initializers
from keras_hub_dist.init import registry
from keras_hub_dist.plan import layouts
from keras_hub_dist.plan import specs as spec_lib
from keras_hub_dist.plan.build import build_without_values
from keras_hub_dist.measure.event_samples import sampling_after_calls
from keras_hub_dist.measure.memory import MemorySampler

MESH_SHAPES = [(1, 8), (2, 4)]

# Sized so that the embedding tables (drawn first) are about a quarter of the
# model and every later variable is small against the whole: a sampled draw's
# XLA temporaries (~3x its shard for shards this small) then stay within 5%
# of the final bytes, as they do for a real model's chunked draws.
_COMMON = dict(
    vocabulary_size=256, num_query_heads=4, num_key_value_heads=2,
    hidden_dim=32, dtype="float32",
)


@dataclasses.dataclass(frozen=True)
class Family:
    factory: object
    cls: type
    config: dict  # what the factory is given (no multimodal keys)
    embedding_init: type  # the stock token-embedding initializer class
    extra_embeddings: tuple = ()  # other token-indexed tables: (path, init)
    text_only_keys: tuple = ()  # keys the factory fills in (None)

    def stock_config(self):
        return {**self.config, **dict.fromkeys(self.text_only_keys)}


FAMILIES = {
    "gemma4": Family(
        keras_hub_dist.gemma4_backbone, keras_hub.models.Gemma4Backbone,
        dict(
            _COMMON, image_size=16, num_layers=4, intermediate_dim=32,
            head_dim=8, sliding_window_size=4, sliding_window_pattern=2,
            global_head_dim=16, num_global_key_value_heads=1,
            hidden_size_per_layer_input=4, enable_moe_block=True,
            num_experts=4, expert_intermediate_dim=8, num_experts_per_token=2,
        ),
        keras.initializers.VarianceScaling,
        (("per_layer_token_embedding/embeddings", keras.initializers.RandomUniform),),
        ("vision_encoder", "audio_encoder"),
    ),
    "qwen3_5": Family(
        keras_hub_dist.qwen3_5_backbone, keras_hub.models.Qwen3_5Backbone,
        dict(
            _COMMON, num_layers=4, head_dim=8, intermediate_dim=32,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8,
        ),
        keras.initializers.RandomNormal,
        text_only_keys=("vision_encoder",),
    ),
    "qwen3_5_moe": Family(
        keras_hub_dist.qwen3_5_moe_backbone, keras_hub.models.Qwen3_5MoeBackbone,
        dict(
            _COMMON, num_layers=4, head_dim=8,
            layer_types=["linear_attention", "full_attention"] * 2,
            moe_intermediate_dim=8, shared_expert_intermediate_size=16,
            num_experts=4, top_k=2, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
        keras.initializers.RandomNormal,
        text_only_keys=("vision_encoder",),
    ),
    "qwen3_moe": Family(
        keras_hub_dist.qwen3_moe_backbone, keras_hub.models.Qwen3MoeBackbone,
        dict(
            _COMMON, num_layers=4, intermediate_dim=32, moe_intermediate_dim=8,
            num_experts=4, top_k=2, head_dim=8,
        ),
        keras.initializers.RandomNormal,
    ),
    "mixtral": Family(
        keras_hub_dist.mixtral_backbone, keras_hub.models.MixtralBackbone,
        dict(
            _COMMON, num_layers=4, intermediate_dim=8, num_experts=4, top_k=2,
            sliding_window=4,
        ),
        keras.initializers.RandomNormal,
    ),
    "gpt_oss": Family(
        keras_hub_dist.gpt_oss_backbone, keras_hub.models.GptOssBackbone,
        dict(
            _COMMON, num_layers=4, intermediate_dim=8, num_experts=4, top_k=2,
            head_dim=8, sliding_window=4,
        ),
        keras.initializers.RandomNormal,
    ),
}

EMBEDDING = "token_embedding/embeddings"
CONSTANT_INITIALIZERS = (
    keras.initializers.Zeros, keras.initializers.Ones, keras.initializers.Constant,
)


def _values(model):
    return [np.asarray(v.value) for v in model.weights]


def _without_name(config):
    return {k: v for k, v in config.items() if k != "name"}


@functools.cache
def _stock_build(family):
    """The stock class built without values (in a fresh session, so its
    paths are the factory builds'): its pending initializers are the stock
    ones, and the layout maps of both meshes are planned on its shapes."""
    spec = FAMILIES[family]
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    return build_without_values(spec.cls, spec.stock_config())


def _stock_initializers(family):
    """`{path: stock pending initializer}` of the stock class's variables."""
    _, created = _stock_build(family)
    return {v.path: _compat.pending_initializer(v) for v in created}


def _layout_map(family, mesh):
    """`get_layout_map` where it knows the family, else the automatic plan."""
    spec = FAMILIES[family]
    model, _ = _stock_build(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_hub_dist.LayoutFallbackWarning)
        if registry.family_of(spec.cls) in layouts.supported_families():
            return keras_hub_dist.get_layout_map(model, mesh)
        return keras_hub_dist.plan_layout(model, mesh)


@functools.cache
def _unsharded(family):
    """The factory model without a distribution, and the random state after."""
    assert keras.distribution.distribution() is None
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = FAMILIES[family].factory(dict(FAMILIES[family].config))
    return model, random.getstate(), _values(model)


@dataclasses.dataclass
class ShardedBuild:
    model: keras.Model
    layout_map: keras.distribution.LayoutMap
    mesh: keras.distribution.DeviceMesh
    sampler: MemorySampler
    born: dict  # path -> the array a distributed initializer returned
    drawn: list  # every path a distributed initializer drew, in order


@functools.cache
def _sharded(family, mesh_shape):
    """The factory model under `ModelParallel` on `mesh_shape`, measured."""
    spec = FAMILIES[family]
    mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"), jax.devices())
    layout_map = _layout_map(family, mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    # Record what each distributed initializer itself returned: the tables
    # must be born sharded, not created whole and re-laid out afterwards.
    drawn = []
    born = {}
    original_call = initializers._Distributed.__call__

    def recording_call(self, shape, dtype=None, layout=None):
        value = original_call(self, shape, dtype=dtype, layout=layout)
        drawn.append(self.path)
        born[self.path] = value
        return value

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(initializers._Distributed, "__call__", recording_call)
        keras.backend.clear_session()
        keras.utils.set_random_seed(0)
        gc.collect()  # earlier tests' arrays must not be freed mid-sample
        with distribution.scope():
            with MemorySampler(interval_s=0.001) as sampler:
                model = spec.factory(dict(spec.config))
                jax.block_until_ready([v.value for v in model.weights])
    return ShardedBuild(model, layout_map, mesh, sampler, born, drawn)


# --- unsharded: the stock model, bitwise ------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_factory_builds_stock_class_with_twins_and_stock_values(family):
    spec = FAMILIES[family]
    model, state_after_factory, _ = _unsharded(family)
    assert type(model) is spec.cls
    assert registry.lookup(family) == EMBEDDING
    assert registry.family_of(spec.cls) == family
    # The token table (and Gemma 4's per-layer table) carry the twin.
    tables = ((EMBEDDING, spec.embedding_init),) + spec.extra_embeddings
    for path, stock_class in tables:
        owner = getattr(model, path.split("/")[0])
        assert owner.embeddings.path == path
        twin = owner.embeddings_initializer
        assert type(twin) is dict(initializers._TWINS)[stock_class], path
        assert isinstance(twin, stock_class) and twin.path == path
    # Text-only by default: the factory filled in the encoders as None.
    for key in spec.text_only_keys:
        assert getattr(model, key) is None
    # The stock class with the same seed: the same weights bitwise, the same
    # use of Python's random state, and the same config.
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    stock = spec.cls.from_config(spec.stock_config())
    assert random.getstate() == state_after_factory
    assert type(stock.token_embedding.embeddings_initializer) is spec.embedding_init
    assert [v.path for v in model.weights] == [v.path for v in stock.weights]
    for ours, theirs in zip(model.weights, stock.weights):
        np.testing.assert_array_equal(
            np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path
        )
    assert _without_name(model.get_config()) == _without_name(stock.get_config())


# --- sharded: memory, layouts, values ---------------------------------------


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_build_memory_layouts_and_values(family, mesh_shape):
    spec = FAMILIES[family]
    build = _sharded(family, mesh_shape)
    model, layout_map, mesh, sampler = (
        build.model, build.layout_map, build.mesh, build.sampler
    )

    # No device ever held more than 5% over what it holds at the end: no
    # whole table on one device, no second copy of a shard.
    start, peak = sampler.start_per_device, sampler.peak_per_device
    final = sampler.final_per_device
    ratios = {d: (peak[d] - start[d]) / (final[d] - start[d]) for d in sampler.device_ids}
    print(f"{family} {mesh_shape}: per-device peak / final = "
          f"{max(ratios.values()):.3f} (max over devices)")
    assert max(ratios.values()) <= 1.05, ratios
    for d in sampler.device_ids:
        live = sampler.live_peak_per_device[d] - start[d]
        assert live <= final[d] - start[d], (d, live, final[d] - start[d])

    # Every variable ends in its layout map's sharding.
    assert_laid_out_as(model.weights, layout_map, mesh)

    # The token table (and Gemma 4's per-layer table) were born sharded over
    # the model axis (the token table on its vocabulary), each device holding
    # only its block.
    tables = (EMBEDDING,) + tuple(path for path, _ in spec.extra_embeddings)
    for path in tables:
        variable = next(v for v in model.weights if v.path == path)
        axes = tuple(layout_map[path].axes)
        entries = [spec_lib.entry_axes(entry) for entry in axes]
        assert any("model" in entry for entry in entries), (path, axes)
        if path == EMBEDDING:
            assert "model" in entries[0], (path, axes)
        block = spec_lib.shard_shape(variable.shape, axes, mesh)
        assert np.prod(block) * mesh_shape[1] <= np.prod(variable.shape)
        born = build.born[path]
        assert born.sharding.is_equivalent_to(
            layout_sharding(mesh, axes, 2), 2
        )
        assert {tuple(s.data.shape) for s in born.addressable_shards} == {block}
        assert len(born.addressable_shards) == 8

    # Every variable whose stock initializer has a twin was drawn once by it,
    # already in its final sharding; every other one has a constant stock
    # initializer (filled in its layout). None is left pending.
    stock_inits = _stock_initializers(family)
    assert sorted(stock_inits) == sorted(v.path for v in model.weights)
    twinned = {p for p, i in stock_inits.items() if initializers._twin_class(i)}
    assert len(build.drawn) == len(set(build.drawn))
    assert set(build.drawn) == twinned
    assert {p for p in stock_inits if p.endswith("kernel")} <= twinned
    others = {type(i).__name__ for p, i in stock_inits.items() if p not in twinned}
    assert all(
        isinstance(i, CONSTANT_INITIALIZERS)
        for p, i in stock_inits.items() if p not in twinned
    ), others
    weights = {v.path: v for v in model.weights}
    for path, value in build.born.items():
        final_value = weights[path].value
        assert value.sharding.is_equivalent_to(final_value.sharding, final_value.ndim)
    assert not any(_compat.is_pending(v) for v in model.weights)

    # The same values as the unsharded factory (= stock) model, up to the
    # rounding of a fused multiply-add.
    _, _, expected_values = _unsharded(family)
    for variable, expected in zip(model.weights, expected_values):
        np.testing.assert_allclose(
            np.asarray(variable.value), expected, rtol=1e-6, atol=1e-7,
            err_msg=variable.path,
        )


def test_stock_spike_is_visible_to_the_same_measurement():
    # The measurement above can fail: the stock class under a ModelParallel
    # creates each variable under Keras's 250 MB threshold whole on one device
    # first, then `jax.device_put`s it into its layout. One sample right after
    # each of those calls, while the whole value is still referenced, sees
    # that moment every time.
    spec = FAMILIES["gemma4"]
    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[EMBEDDING] = ("model", None)
    layout_map["per_layer_token_embedding/embeddings"] = ("model", None)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    gc.collect()
    with distribution.scope():
        with MemorySampler(interval_s=0.001) as sampler:
            with sampling_after_calls(sampler, jax, "device_put") as at_device_put:
                # One layer: the spike is the token table's; the layers
                # only add stock eager draws (and lower the ratio).
                stock = spec.cls.from_config(
                    dict(spec.stock_config(), vocabulary_size=16384, num_layers=1)
                )
                jax.block_until_ready([v.value for v in stock.weights])
    start, final = sampler.start_per_device, sampler.final_per_device
    table = next(v for v in stock.weights if v.path == EMBEDDING)
    table_bytes = table.value.nbytes
    # At the token table's device_put, one device held all of it.
    assert max(max(s[d] - start[d] for d in s) for s in at_device_put) >= table_bytes
    ratios = [
        (sampler.peak_per_device[d] - start[d]) / (final[d] - start[d])
        for d in sampler.device_ids
    ]
    print(f"stock gemma4 (1, 8): per-device peak / final = {max(ratios):.3f}")
    assert max(ratios) > 1.5


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_values_are_the_same_on_every_mesh(family):
    # Block-offset draws do not depend on the mesh: bitwise equal.
    first, second = (_sharded(family, shape).model for shape in MESH_SHAPES)
    for ours, theirs in zip(first.weights, second.weights):
        assert ours.path == theirs.path
        np.testing.assert_array_equal(
            np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path
        )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sharded_model_saves_and_reloads_with_stock_from_preset(family, tmp_path):
    spec = FAMILIES[family]
    model = _sharded(family, MESH_SHAPES[-1]).model
    model.save_to_preset(str(tmp_path))
    reloaded = keras_hub.models.Backbone.from_preset(str(tmp_path))
    assert type(reloaded) is spec.cls
    # The saved config is the stock one: reloading gives stock initializers.
    assert type(reloaded.token_embedding.embeddings_initializer) is spec.embedding_init
    for path, stock_class in spec.extra_embeddings:
        owner = getattr(reloaded, path.split("/")[0])
        assert type(owner.embeddings_initializer) is stock_class
    assert _without_name(reloaded.get_config()) == _without_name(model.get_config())
    for ours, theirs in zip(model.weights, reloaded.weights):
        np.testing.assert_array_equal(
            np.asarray(ours.value), np.asarray(theirs.value), err_msg=ours.path
        )


# --- API ----------------------------------------------------------------------


def test_new_factories_are_exported_and_found_by_class():
    for family, spec in FAMILIES.items():
        name = spec.factory.__name__
        assert name in keras_hub_dist.__all__ and name in factories.__all__
        assert getattr(keras_hub_dist, name) is spec.factory
        assert factories.factory_for_class(spec.cls) is spec.factory
        assert factories.factory_for_class(spec.cls.__name__) is spec.factory
        assert spec.cls.__name__ in factories.supported_class_names()
        assert registry.lookup(family) == EMBEDDING


def _config_json(family, **overrides):
    spec = FAMILIES[family]
    return {
        "class_name": spec.cls.__name__,
        "config": {**spec.stock_config(), **overrides},
    }


@pytest.mark.parametrize(
    "factory,family,right",
    [
        (keras_hub_dist.qwen3_5_backbone, "qwen3_5_moe", "qwen3_5_moe_backbone"),
        (keras_hub_dist.qwen3_5_moe_backbone, "qwen3_5", "qwen3_5_backbone"),
        (keras_hub_dist.qwen3_moe_backbone, "mixtral", "mixtral_backbone"),
        (keras_hub_dist.mixtral_backbone, "gpt_oss", "gpt_oss_backbone"),
        (keras_hub_dist.gpt_oss_backbone, "gemma4", "gemma4_backbone"),
        (keras_hub_dist.gemma4_backbone, "qwen3_moe", "qwen3_moe_backbone"),
    ],
)
def test_family_mismatch_names_the_right_factory(factory, family, right):
    with pytest.raises(ValueError) as info:
        factory(_config_json(family))
    message = str(info.value)
    assert FAMILIES[family].cls.__name__ in message
    assert f"keras_hub_dist.{right}()" in message


def test_named_architecture_of_another_family_is_refused():
    with pytest.raises(ValueError) as info:
        keras_hub_dist.gemma4_backbone("gemma3_1b", num_layers=1)
    message = str(info.value)
    assert "'gemma3_1b'" in message and "keras_hub_dist.gemma3_backbone()" in message
    with pytest.raises(ValueError, match="keras_hub_dist.gemma_backbone()"):
        keras_hub_dist.mixtral_backbone("gemma_2b_en")


# Named architectures of the multimodal families hold their encoders; the
# overrides make them tiny (and drop what only fits the full depth).
NAMED = {
    "gemma4": ("gemma4_2b", dict(
        layer_types=None, num_kv_shared_layers=0, vocab_size_per_layer_input=None,
    )),
    "qwen3_5": ("qwen3_5_0.8b", {}),
    "qwen3_5_moe": ("qwen3_5_moe_35b_a3b", {}),
}


@pytest.mark.parametrize("family", sorted(NAMED))
def test_named_multimodal_architecture_builds_text_only(family):
    spec = FAMILIES[family]
    name, extra = NAMED[family]
    entry = keras_hub_dist.presets.resolve(name)
    assert entry.config["vision_encoder"] is not None
    overrides = {**spec.config, **extra}
    keras.backend.clear_session()
    model = spec.factory(name, **overrides)
    assert type(model) is spec.cls
    for key in spec.text_only_keys:
        assert getattr(model, key) is None
    expected = {**entry.config, **overrides, **dict.fromkeys(spec.text_only_keys)}
    config = model.get_config()
    for key, value in expected.items():
        if key not in ("name", "dtype", "layer_types"):  # derived when None
            assert config[key] == value, key


def test_text_only_refuses_an_encoder_and_false_keeps_the_configs():
    spec = FAMILIES["qwen3_5"]
    with pytest.raises(ValueError, match="text_only=False"):
        keras_hub_dist.qwen3_5_backbone(dict(spec.config), vision_encoder={"x": 1})
    # With text_only=False the config's encoder reaches the stock class as is.
    with pytest.raises(Exception) as info:  # the stock deserializer's error
        keras_hub_dist.qwen3_5_backbone(
            dict(spec.config, vision_encoder="bogus"), text_only=False
        )
    assert "bogus" in str(info.value)
    # A config without the key still builds (the stock `from_config` needs it).
    keras.backend.clear_session()
    model = keras_hub_dist.qwen3_5_moe_backbone(
        dict(FAMILIES["qwen3_5_moe"].config), text_only=False
    )
    assert model.vision_encoder is None


class _Arange(keras.initializers.Initializer):
    """A custom initializer: no distributed twin, not a Keras constant."""

    def __call__(self, shape, dtype=None):
        count = int(np.prod(shape))
        return keras.ops.reshape(keras.ops.arange(count, dtype=dtype), shape)


def test_constant_and_custom_initializers_under_distribute_all(monkeypatch):
    # Constants are filled straight into their layout; a custom initializer
    # (or a Constant of a list) goes through Keras's deferred path; neither
    # is given to `distributed_like`, which only knows random initializers.
    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense/kernel"] = (None, "model")
    layout_map["dense/bias"] = ("model",)
    layout_map["norm/gamma"] = ("model",)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    through_keras = []
    original = _compat.initialize_pending

    def recording(variables):
        through_keras.extend(v.path for v in variables)
        return original(variables)

    monkeypatch.setattr(_compat, "initialize_pending", recording)
    with distribution.scope():
        with _compat.creating_variables_without_values() as created:
            dense = keras.layers.Dense(
                64, kernel_initializer=_Arange(),
                bias_initializer=keras.initializers.Constant(0.5), name="dense",
            )
            dense.build((None, 16))
            norm = keras.layers.LayerNormalization(
                name="norm", beta_initializer=keras.initializers.Constant([1.0] * 64)
            )
            norm.build((None, 64))
        initializers.initialize_variables(created, distribute_all=True)
    assert sorted(through_keras) == ["dense/kernel", "norm/beta"]
    np.testing.assert_array_equal(
        np.asarray(dense.kernel.value), np.arange(16 * 64).reshape(16, 64)
    )
    np.testing.assert_array_equal(np.asarray(dense.bias.value), np.full(64, 0.5))
    np.testing.assert_array_equal(np.asarray(norm.gamma.value), np.ones(64))
    np.testing.assert_array_equal(np.asarray(norm.beta.value), np.ones(64))
    for variable in (dense.bias, norm.gamma):
        assert variable.value.sharding.is_equivalent_to(
            jax.sharding.NamedSharding(mesh.backend_mesh, PartitionSpec("model")), 1
        )
        assert {s.data.shape for s in variable.value.addressable_shards} == {(8,)}
    assert not any(_compat.is_pending(v) for v in created)
