"""Abstract backbones: built with no weights, counted and sized per device."""

import contextlib
import time
import warnings

import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES, live_device_bytes

import keras_hub_dist
from keras_hub_dist import _compat
from keras_hub_dist.measure import memory
from keras_hub_dist.plan import presets
from keras_hub_dist.plan.abstract import per_device_bytes
from keras_hub_dist.plan.mesh import abstract_device_mesh



# Every named architecture's count against KerasHub's published metadata is
# checked in tests/plan/test_layouts.py
# (test_every_map_is_valid_for_every_named_architecture), on the one abstract
# build per architecture that also checks its layout maps; this year's
# families in test_presets_new_models.py (one build per distinct config).


def test_27b_is_built_in_seconds_without_memory():
    rss_before = memory.current_rss_bytes()
    live_before = live_device_bytes()
    start = time.perf_counter()
    report = keras_hub_dist.abstract_backbone("gemma2_27b_en", mesh=(1, 16))
    seconds = time.perf_counter() - start
    assert report.parameter_count == 27_227_128_320
    assert seconds < 20, seconds
    assert live_device_bytes() - live_before < 1 << 20
    # 54 GB of bf16 weights; the process grows by Python objects only.
    assert memory.current_rss_bytes() - rss_before < 1 << 30
    assert report.mesh_axis_sizes == {"batch": 1, "model": 16}
    assert len(report.per_device_bytes) == 16
    # Everything in Gemma 2 27B divides 16 ways, the norm scales included
    # (on the model axis: family_rules.gemma_residual_rules).
    assert report.max_device_bytes == report.total_bytes // 16
    assert report.layout_report.checked and report.layout_report.fallbacks == ()


def test_overrides_and_dtype():
    report = keras_hub_dist.abstract_backbone(
        "gemma2_7b", num_layers=2, dtype="float32"
    )
    assert report.name == "gemma_7b_en" and report.config["num_layers"] == 2
    expected = 256000 * 3072 + 3072 + 2 * 276_830_208
    assert report.parameter_count == expected
    assert report.bytes_by_dtype == {"float32": 4 * expected}
    with pytest.raises(ValueError, match="fully-defined"):
        keras_hub_dist.abstract_backbone("gemma_2b_en", head_dim=None)


def test_abstract_model_traces_but_refuses_eager_reads():
    report = keras_hub_dist.abstract_backbone(
        "qwen3_0.6b_en", num_layers=1, dtype="float32"
    )
    model = report.model
    spec = model.compute_output_spec(
        {
            "token_ids": keras.KerasTensor((2, 8), "int32"),
            "padding_mask": keras.KerasTensor((2, 8), "int32"),
        }
    )
    assert tuple(spec.shape) == (2, 8, 1024)
    with pytest.raises(RuntimeError) as info:
        model.token_embedding.embeddings.value
    message = str(info.value)
    assert "token_embedding/embeddings" in message and "(151936, 1024)" in message
    assert "Expected symbolic use only" in message


def test_no_global_state_left_behind():
    with keras.StatelessScope(initialize_variables=False):
        sentinel = keras.Variable(initializer="zeros", shape=(3,), name="sentinel")
    pending = _compat._keras_global_state.get_global_attribute(
        "uninitialized_variables"
    )
    try:
        assert [id(v) for v in pending] == [id(sentinel)]
        keras_hub_dist.abstract_backbone("gemma_2b_en", num_layers=1)
        # Raises after the embedding variables were created.
        with pytest.raises(ValueError, match="fully-defined"):
            keras_hub_dist.abstract_backbone("gemma_2b_en", head_dim=None)
        after = _compat._keras_global_state.get_global_attribute(
            "uninitialized_variables"
        )
        assert [id(v) for v in after] == [id(sentinel)]
        assert not _compat.in_stateless_scope()
        assert sentinel._value is None
    finally:
        _compat._keras_global_state.set_global_attribute(
            "uninitialized_variables", []
        )


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_per_device_bytes_equal_a_real_sharded_model(mesh_shape):
    """The abstract figure equals the bytes the built model's shards hold."""
    config = dict(
        vocabulary_size=256, num_layers=2, num_query_heads=4,
        num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, head_dim=8,
    )
    cls = keras_hub.models.Qwen3Backbone
    report = keras_hub_dist.abstract_backbone(config, backbone_class=cls)
    mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"), jax.devices())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_hub_dist.LayoutFallbackWarning)
        layout_map = keras_hub_dist.get_layout_map(report, mesh)
    sized = report.on_mesh(mesh, layout_map)
    assert sized.per_device_bytes == per_device_bytes(
        report.variables, mesh, layout_map
    )
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    with distribution.scope():
        model = keras_hub_dist.qwen3_backbone(config)
    measured = {device.id: 0 for device in jax.devices()}
    for variable in model.weights:
        for shard in variable.value.addressable_shards:
            measured[shard.device.id] += shard.data.nbytes
    assert sized.per_device_bytes == measured
    assert sized.max_device_bytes == max(measured.values())
    assert sized.max_device_bytes < report.total_bytes


def test_invalid_layout_is_caught_from_shapes():
    # One layer: the first decoder block's KV kernel is the one named.
    report = keras_hub_dist.abstract_backbone("gemma_2b_en", num_layers=1)
    mesh = abstract_device_mesh((1, 8))
    stock = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    with pytest.raises(keras_hub_dist.LayoutError) as info:
        report.on_mesh(mesh, stock)
    assert "decoder_block_0/attention/key/kernel" in str(info.value)
    assert "(1, 2048, 256)" in str(info.value)


def test_each_kind_of_block_is_traced_once_and_builds_what_keras_builds(monkeypatch):
    """Blocks of one config are traced once per build; the model (weights,
    layers, output specs) is the one Keras's block-by-block tracing builds.
    gpt-oss alternates sliding-window and full attention: two kinds. (Most
    KerasHub blocks give their output shape without a trace.)"""
    from keras_hub_dist.plan import build

    cls, config, _ = presets.backbone_config("gpt_oss_20b_en")
    config = dict(config, num_layers=4)
    traced = []
    keras_spec = keras.Operation.compute_output_spec

    def counting(operation, *args, **kwargs):
        traced.append(type(operation).__name__)
        return keras_spec(operation, *args, **kwargs)

    def summary(model):
        keras.backend.clear_session()  # the next build's automatic names restart
        outputs = [(tuple(t.shape), t.dtype) for t in keras.tree.flatten(model.outputs)]
        return build.specs_of(model), [layer.name for layer in model.layers], outputs

    monkeypatch.setattr(keras.Operation, "compute_output_spec", counting)
    keras.backend.clear_session()
    ours = summary(build.build_abstract(cls, config))
    ours_traced, traced[:] = list(traced), []
    monkeypatch.setattr(build, "_each_layer_kind_traced_once", contextlib.nullcontext)
    assert ours == summary(build.build_abstract(cls, config))
    assert len([n for n in traced if "Decoder" in n]) == 4, traced
    assert len([n for n in ours_traced if "Decoder" in n]) == 2, ours_traced
