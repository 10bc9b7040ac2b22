"""Factories with `quantize=`: stock's build-then-`quantize`, bitwise, sharded."""

import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import quantize_collecting_once

import keras_hub_dist
from keras_hub_dist import QuantizationError

SMALL = dict(vocabulary_size=512, num_layers=1, num_query_heads=8, num_key_value_heads=8,
             hidden_dim=64, intermediate_dim=128)


@pytest.fixture(scope="module")
def stock():
    out = {}
    for mode in ("int8", "int4"):
        keras.utils.set_random_seed(3)
        backbone = keras_hub.models.LlamaBackbone(**SMALL, dtype="bfloat16")
        quantize_collecting_once(backbone, mode)
        out[mode] = [(v.path, np.asarray(v.value).tobytes()) for v in backbone.weights]
    return out


# One mesh using both axes: each mesh costs its sharded samplers' compiles
# (loads cover the three meshes).
@pytest.mark.parametrize("mesh_shape", [(2, 4)])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_random_init_equals_stock_quantize(mode, mesh_shape, stock):
    mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"), jax.devices())
    layout_map = keras_hub_dist.get_layout_map(keras_hub.models.LlamaBackbone, mesh)
    keras.utils.set_random_seed(3)
    with keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch").scope():
        backbone = keras_hub_dist.llama_backbone(dict(SMALL), dtype="bfloat16", quantize=mode)
    assert [(v.path, np.asarray(v.value).tobytes()) for v in backbone.weights] == stock[mode]
    kernels = [v for v in backbone.weights if v.dtype == "int8"]
    sharded = [v for v in kernels if len(v.value.sharding.device_set) == 8 and v.value.addressable_shards[0].data.size < v.value.size]
    assert len(sharded) >= len(kernels) // 2


def test_factory_refuses_a_bad_mode():
    with pytest.raises(QuantizationError, match="Expected quantize= to be one of 'int8', 'int4'"):
        keras_hub_dist.llama_backbone(dict(SMALL), quantize="fp8")
