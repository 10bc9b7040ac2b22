"""Distributed initializers: values, shardings, memory and bad input."""

import gc
import json
import math
import warnings

import jax
import jax.numpy as jnp
import keras
import numpy as np
import pytest
from conftest import MESH_SHAPES
from conftest import make_model_parallel
from jax.extend import random as jax_random_ext

import keras_hub_dist
from keras_hub_dist.init import sharded_random as _sharded_random
from keras_hub_dist.init import initializers as khd_init

EMBEDDING = "token_embedding/embeddings"
SHAPE = (512, 64)

# (Keras class, distributed class, constructor kwargs)
CASES = [
    (keras.initializers.RandomNormal, keras_hub_dist.DistributedRandomNormal,
     dict(mean=0.1, stddev=0.02)),
    (keras.initializers.TruncatedNormal, keras_hub_dist.DistributedTruncatedNormal,
     dict(mean=0.0, stddev=0.5)),
    (keras.initializers.RandomUniform, keras_hub_dist.DistributedRandomUniform,
     dict(minval=-0.3, maxval=0.7)),
    (keras.initializers.VarianceScaling, keras_hub_dist.DistributedVarianceScaling,
     dict(scale=1.0, mode="fan_in", distribution="untruncated_normal")),
    (keras.initializers.VarianceScaling, keras_hub_dist.DistributedVarianceScaling,
     dict(scale=2.0, mode="fan_avg", distribution="truncated_normal")),
    (keras.initializers.VarianceScaling, keras_hub_dist.DistributedVarianceScaling,
     dict(scale=0.5, mode="fan_out", distribution="uniform")),
    (keras.initializers.GlorotUniform, keras_hub_dist.DistributedGlorotUniform, {}),
    (keras.initializers.GlorotNormal, keras_hub_dist.DistributedGlorotNormal, {}),
    (keras.initializers.HeNormal, keras_hub_dist.DistributedHeNormal, {}),
    (keras.initializers.HeUniform, keras_hub_dist.DistributedHeUniform, {}),
    (keras.initializers.LecunNormal, keras_hub_dist.DistributedLecunNormal, {}),
    (keras.initializers.LecunUniform, keras_hub_dist.DistributedLecunUniform, {}),
]
CASE_IDS = [f"{c[1].__name__}-{i}" for i, c in enumerate(CASES)]


def fusion_rounding(a, b):
    """Max |a - b| in units of the last place of the arrays' largest value.

    XLA may fuse `x * scale + shift` differently from Keras's eager ops, which
    changes the result by an ulp of the intermediate, not of the (possibly
    tiny) output value; this measures the difference on that scale.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.spacing(np.max(np.abs(b)).astype(np.float32))
    return float(np.max(np.abs(a - b)) / scale)


def embedding_distribution(mesh_shape, axes=("model", "batch")):
    return make_model_parallel(mesh_shape, {EMBEDDING: axes})


@pytest.mark.parametrize("keras_cls,ours_cls,kwargs", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_distribution_returns_parent_values(keras_cls, ours_cls, kwargs, dtype):
    expected = keras_cls(seed=11, **kwargs)(SHAPE, dtype=dtype)
    got = ours_cls(seed=11, **kwargs)(SHAPE, dtype=dtype)
    assert isinstance(got, jax.Array)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.mark.parametrize("keras_cls,ours_cls,kwargs", CASES, ids=CASE_IDS)
def test_sharded_values_are_mesh_independent_and_match_parent(
    keras_cls, ours_cls, kwargs
):
    parent = np.asarray(keras_cls(seed=5, **kwargs)(SHAPE))
    results = []
    for mesh_shape in MESH_SHAPES:
        distribution = embedding_distribution(mesh_shape)
        with distribution.scope():
            value = ours_cls(seed=5, **kwargs)(SHAPE)
        mesh = distribution.device_mesh.backend_mesh
        expected = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model", "batch"))
        assert value.sharding.is_equivalent_to(expected, len(SHAPE))
        batch, model = mesh_shape
        for shard in value.addressable_shards:
            assert shard.data.shape == (SHAPE[0] // model, SHAPE[1] // batch)
        results.append(np.asarray(value))
    for other in results[1:]:
        np.testing.assert_array_equal(other, results[0])
    assert fusion_rounding(results[0], parent) <= 2


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_layer_path_equals_direct_call(mesh_shape):
    """Keras passes `layout=`; the result is the direct call's, bit for bit."""
    init = keras_hub_dist.DistributedVarianceScaling(
        mode="fan_in", distribution="untruncated_normal", seed=3
    )
    distribution = embedding_distribution(mesh_shape)
    with distribution.scope():
        direct = init(SHAPE)
        layer = keras.layers.Embedding(
            SHAPE[0], SHAPE[1], embeddings_initializer=init, name="token_embedding"
        )
        layer.build(None)
    variable = layer.embeddings
    assert variable.path == EMBEDDING
    value = variable.value
    assert value.sharding.is_equivalent_to(direct.sharding, 2)
    np.testing.assert_array_equal(np.asarray(value), np.asarray(direct))
    # The layout Keras passes is the variable's, even for a path the
    # initializer was not told about.
    renamed = keras_hub_dist.DistributedRandomNormal(seed=3, path="elsewhere")
    with embedding_distribution(mesh_shape).scope():
        other = keras.layers.Embedding(
            SHAPE[0], SHAPE[1], embeddings_initializer=renamed, name="token_embedding"
        )
        other.build(None)
    assert other.embeddings.value.sharding.is_equivalent_to(direct.sharding, 2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_chunked_draw_matches_single_draw(monkeypatch, dtype):
    """Chunks over several dims (and a non-leading one) reproduce the draw."""
    shape = (4, 6, 40, 10)
    key = jnp.array([9, 4], jnp.uint32)
    expected = jax.random.normal(key, shape, dtype)
    mesh = jax.make_mesh((2, 4), ("batch", "model"))
    spec = jax.sharding.PartitionSpec("batch", None, "model")
    monkeypatch.setattr(_sharded_random, "_MIN_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(_sharded_random, "_CHUNK_FRACTION", 16)
    block = (2, 6, 10, 10)
    assert _sharded_random.chunk_plan(block) == (2, 5)  # walks two outer dims
    sample = lambda block_shape, dt, k: jax.random.normal(k, block_shape, dt)  # noqa: E731
    got = _sharded_random.sharded_sample(sample, shape, dtype, mesh, spec, key)
    np.testing.assert_array_equal(
        np.asarray(got).view(np.uint8), np.asarray(expected).view(np.uint8)
    )


def test_chunk_plan_bounds_chunk_size():
    dim, rows = _sharded_random.chunk_plan((32000, 3072))
    assert dim == 0 and 32000 % rows == 0
    assert rows * 3072 <= 32000 * 3072 // 32
    assert _sharded_random.chunk_plan((8, 8)) == (0, 8)


def test_block_bits_beyond_32_bit_flat_index():
    """Counters of a block whose flat index exceeds 2**32 are exact."""
    full_shape = (70000, 70000, 2)
    start = (65432, 1234, 0)
    block = (2, 3, 2)
    impl = _sharded_random.block_prng_impl(full_shape)
    key = jnp.array([1, 2] + list(start), jnp.uint32)
    got = jax.random.bits(jax.random.wrap_key_data(key, impl=impl), block, jnp.uint32)
    index = np.zeros(block, np.uint64)
    strides = (70000 * 2, 2, 1)
    for dim, (s, stride) in enumerate(zip(start, strides)):
        coords = (s + np.arange(block[dim], dtype=np.uint64)).reshape(
            [-1 if d == dim else 1 for d in range(3)]
        )
        index = index + coords * np.uint64(stride)
    assert index.max() > 2**32
    high = jnp.asarray((index >> np.uint64(32)).astype(np.uint32))
    low = jnp.asarray((index & np.uint64(0xFFFFFFFF)).astype(np.uint32))
    bits1, bits2 = jax_random_ext.threefry2x32_p.bind(
        jnp.uint32(1), jnp.uint32(2), high, low
    )
    np.testing.assert_array_equal(np.asarray(got), np.asarray(bits1 ^ bits2))


def test_compiled_program_needs_at_most_twice_the_shard():
    shape, dtype = (8192, 2048), "float32"  # 64 MiB, 8 MiB per shard
    mesh = jax.make_mesh((1, 8), ("batch", "model"))
    spec = jax.sharding.PartitionSpec("model", None)
    init = keras_hub_dist.DistributedRandomNormal(seed=0)
    sampler = _sharded_random.sharded_sampler(
        lambda b, dt, k: init._sample_block(shape, b, dt, k), shape, dtype, mesh, spec
    )
    analysis = sampler.lower(jnp.zeros(2, jnp.uint32)).compile().memory_analysis()
    shard_bytes = math.prod(shape) * 4 // 8
    assert analysis.output_size_in_bytes == shard_bytes
    assert analysis.output_size_in_bytes + analysis.temp_size_in_bytes <= 2 * shard_bytes


def test_indivisible_dimension_names_path_shape_and_fix():
    mesh = keras.distribution.DeviceMesh((1, 6), ("batch", "model"), jax.devices()[:6])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[EMBEDDING] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    with distribution.scope(), pytest.raises(keras_hub_dist.LayoutError) as info:
        keras_hub_dist.DistributedRandomNormal(seed=0)((1000, 64))
    message = str(info.value)
    for fragment in (EMBEDDING, "(1000, 64)", "'model': 6", "Expected a multiple of 6",
                     "Received:", "e.g. [1, 2, 4, 5, 8, 10]"):
        assert fragment in message, message


def test_unknown_mesh_axis_is_rejected():
    # Keras's LayoutMap checks names itself; a layout given directly is ours.
    layout = keras.distribution.TensorLayout(("tensor", None))
    with embedding_distribution((1, 8)).scope():
        with pytest.raises(keras_hub_dist.LayoutError) as info:
            keras_hub_dist.DistributedRandomNormal(seed=0)(SHAPE, layout=layout)
    assert "'tensor'" in str(info.value) and "['batch', 'model']" in str(info.value)


@pytest.mark.parametrize("distributed", [False, True])
def test_non_float_dtype_is_rejected(distributed):
    init = keras_hub_dist.DistributedVarianceScaling(seed=0)
    distribution = embedding_distribution((2, 4))
    with distribution.scope() if distributed else _nullcontext():
        with pytest.raises(ValueError) as info:
            init(SHAPE, dtype="int32")
    message = str(info.value)
    assert EMBEDDING in message and "(512, 64)" in message and "int32" in message
    if distributed:
        assert "'model': 4" in message


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_missing_layout_warns_once_and_behaves_like_parent():
    path = "unmapped_table/embeddings"
    distribution = make_model_parallel((1, 8), {"other/kernel": ("model", None)})
    expected = keras.initializers.RandomNormal(seed=4)(SHAPE)
    init = keras_hub_dist.DistributedRandomNormal(seed=4, path=path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distribution.scope():
            first = init(SHAPE)
            init(SHAPE)
    missing = [w for w in caught if issubclass(w.category, keras_hub_dist.MissingLayoutWarning)]
    assert len(missing) == 1
    text = str(missing[0].message)
    assert path in text and "<explicit path>" in text and "other/kernel" in text
    np.testing.assert_array_equal(np.asarray(first), np.asarray(expected))


def test_layer_replicated_by_keras_warns():
    """A layer whose path the LayoutMap misses is replicated, never silently."""
    distribution = make_model_parallel((1, 8), {"other/kernel": ("model", None)})
    init = keras_hub_dist.DistributedRandomNormal(seed=4, path="replicated_emb/embeddings")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with distribution.scope():
            layer = keras.layers.Embedding(64, 8, embeddings_initializer=init,
                                           name="replicated_emb")
            layer.build(None)
    assert any(issubclass(w.category, keras_hub_dist.MissingLayoutWarning)
               and "replicated_emb/embeddings" in str(w.message) for w in caught)
    assert layer.embeddings.value.sharding.is_fully_replicated


def test_registry_path_is_read_at_call_time():
    init = keras_hub_dist.DistributedRandomNormal(seed=1)
    distribution = make_model_parallel((1, 8), {"custom/table": ("model", None)})
    with keras_hub_dist.registry.override("default", "custom/table"):
        with distribution.scope():
            value = init((64, 8))
    assert value.sharding.spec == jax.sharding.PartitionSpec("model", None)


@pytest.mark.parametrize("keras_cls,ours_cls,kwargs", CASES, ids=CASE_IDS)
def test_config_round_trip_and_serialization(keras_cls, ours_cls, kwargs):
    init = ours_cls(seed=2, path="a/b", **kwargs)
    config = init.get_config()
    assert config["path"] == "a/b"
    clone = ours_cls.from_config(config)
    assert clone.get_config() == config
    serialized = keras.initializers.serialize(init)
    json.dumps(serialized)
    restored = keras.initializers.deserialize(serialized)
    assert type(restored) is ours_cls and restored.get_config() == config
    np.testing.assert_array_equal(np.asarray(restored((16, 4))), np.asarray(init((16, 4))))


def test_model_using_initializer_saves_and_reloads(tmp_path):
    init = keras_hub_dist.DistributedVarianceScaling(seed=0, path=EMBEDDING)
    inputs = keras.Input((3,), dtype="int32")
    outputs = keras.layers.Embedding(32, 4, embeddings_initializer=init,
                                     name="token_embedding")(inputs)
    model = keras.Model(inputs, outputs)
    model.save(tmp_path / "m.keras")
    reloaded = keras.saving.load_model(tmp_path / "m.keras")
    layer = reloaded.get_layer("token_embedding")
    assert type(layer.embeddings_initializer) is keras_hub_dist.DistributedVarianceScaling
    assert layer.embeddings_initializer.path == EMBEDDING
    np.testing.assert_array_equal(reloaded.get_weights()[0], model.get_weights()[0])


@pytest.mark.parametrize("keras_cls,ours_cls,kwargs", CASES, ids=CASE_IDS)
def test_distributed_like_reproduces_even_unseeded(keras_cls, ours_cls, kwargs):
    stock = keras_cls(**kwargs)  # unseeded: Keras draws a seed now
    twin = khd_init.distributed_like(stock, path=EMBEDDING)
    assert type(twin) is ours_cls and twin.path == EMBEDDING
    np.testing.assert_array_equal(np.asarray(twin(SHAPE)), np.asarray(stock(SHAPE)))


def test_distributed_like_rejects_unknown_initializer():
    with pytest.raises(TypeError, match="Received: Zeros"):
        khd_init.distributed_like(keras.initializers.Zeros())


def test_seed_generator_draws_once_per_call():
    ours = keras_hub_dist.DistributedRandomNormal(seed=keras.random.SeedGenerator(8))
    stock = keras.initializers.RandomNormal(seed=keras.random.SeedGenerator(8))
    distribution = embedding_distribution((2, 4))
    for _ in range(2):  # the generator advances identically
        expected = np.asarray(stock(SHAPE))
        with distribution.scope():
            got = np.asarray(ours(SHAPE))
        assert fusion_rounding(got, expected) <= 2


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_initialize_variables_places_shards_without_a_copy(mesh_shape):
    from keras_hub_dist import _compat
    from keras_hub_dist.measure.memory import MemorySampler

    shape = (16384, 512)  # 32 MiB: at least 4 chunks per shard
    init = keras_hub_dist.DistributedVarianceScaling(seed=6)
    distribution = embedding_distribution(mesh_shape)
    with distribution.scope():
        direct = np.asarray(init(shape))
        with _compat.creating_variables_without_values() as created:
            layer = keras.layers.Embedding(*shape, embeddings_initializer=init,
                                           name="token_embedding")
            layer.build(None)
        assert _compat.is_pending(layer.embeddings)
        gc.collect()  # earlier tests' arrays must not be freed mid-sample
        with MemorySampler(interval_s=0.001) as sampler:
            khd_init.initialize_variables(created)
            value = jax.block_until_ready(layer.embeddings.value)
    assert not _compat.is_pending(layer.embeddings)
    assert value.sharding.is_equivalent_to(
        distribution.get_variable_layout(layer.embeddings).backend_layout, 2)
    np.testing.assert_array_equal(np.asarray(value), direct)
    # Only the sharded draw ran: no reshard/copy program, and no device held
    # more than its shard (plus the draw's chunk temporaries).
    assert [c["name"] for c in sampler.compiled] == ["jit_per_device"] or all(
        "reshard" not in c["name"] for c in sampler.compiled)
    shard = value.addressable_shards[0].data.nbytes
    scalars = 1024  # the uint32[2] key and loop counters may be live too
    for device, start in sampler.start_per_device.items():
        assert sampler.live_peak_per_device[device] - start <= shard + scalars
        assert sampler.peak_per_device[device] - start <= 2 * shard


def test_initialize_variables_names_the_failing_path():
    from keras_hub_dist import _compat

    mesh = keras.distribution.DeviceMesh((1, 6), ("batch", "model"), jax.devices()[:6])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["token_embedding/embeddings"] = ("model", None)
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    init = keras_hub_dist.DistributedRandomNormal(seed=0)
    with distribution.scope():
        with _compat.creating_variables_without_values() as created:
            layer = keras.layers.Embedding(1000, 8, embeddings_initializer=init,
                                           name="token_embedding")
            layer.build(None)
        with pytest.raises(keras_hub_dist.LayoutError) as info:
            khd_init.initialize_variables(created)
    assert "While initializing variable 'token_embedding/embeddings'" in str(
        info.value.__notes__)


def test_compiled_sampler_is_reused_only_for_the_same_statistics():
    distribution = embedding_distribution((2, 4))
    _sharded_random._SAMPLER_CACHE.clear()
    with distribution.scope():
        first = keras_hub_dist.DistributedRandomNormal(stddev=0.02, seed=1)(SHAPE)
        second = keras_hub_dist.DistributedRandomNormal(stddev=0.02, seed=2)(SHAPE)
        assert len(_sharded_random._SAMPLER_CACHE) == 1  # new seed, same program
        wide = keras_hub_dist.DistributedRandomNormal(stddev=1.0, seed=1)(SHAPE)
        assert len(_sharded_random._SAMPLER_CACHE) == 2  # new statistics, new one
    for value, (stddev, seed) in ((first, (0.02, 1)), (second, (0.02, 2)),
                                  (wide, (1.0, 1))):
        parent = keras.initializers.RandomNormal(stddev=stddev, seed=seed)(SHAPE)
        assert fusion_rounding(value, parent) <= 2
