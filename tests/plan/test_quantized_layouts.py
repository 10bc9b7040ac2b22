"""Layouts of quantized models, from shapes alone (abstract models, no devices).

A quantized variable's layout follows its float kernel's: int8 values keep
it, scales follow the output axes, int4 values carry it to the matrix Keras
packs (the same elements per device where the reshape allows), and every
map `get_layout_map` / `plan_layout` gives a quantized model is valid and
shards it as evenly as the float one.
"""

import warnings

import keras
import numpy as np
import pytest
from conftest import MESH_SHAPES

import keras_hub_dist
from keras_hub_dist import LayoutError, LayoutFallbackWarning
from keras_hub_dist.plan import quantization, specs
from keras_hub_dist.plan.mesh import abstract_device_mesh
from keras_hub_dist.plan.quantized_layouts import add_quantized_entries, matrix_axes, quantized_axes

SIZES = {"batch": 2, "model": 4}


def test_matrix_axes_carry_the_elements_each_device_holds():
    # Llama query (hidden, heads, head_dim) -> (hidden, heads*head_dim):
    # whole dimensions merge; the merged axis takes its leading entry.
    assert matrix_axes((64, 8, 8), ("model", "batch", None), (64, 64), SIZES) == (("model", "batch"), True)
    # Gemma query (heads, hidden, head_dim) -> (hidden, heads*head_dim): no
    # whole-dimension merge, but the heads' contiguous slices are row slices.
    assert matrix_axes((8, 64, 8), ("model", None, None), (64, 64), SIZES) == (("model", None), True)
    # Gemma's (model, batch, None) on both axes: same bytes, other elements.
    assert matrix_axes((8, 64, 8), ("model", "batch", None), (64, 64), SIZES) == (("model", "batch"), False)
    # Attention output (heads, head_dim, hidden) -> (heads*head_dim, hidden).
    assert matrix_axes((8, 8, 64), ("model", None, "batch"), (64, 64), SIZES) == (("model", "batch"), True)
    # A head_dim sharded under a merge is not contiguous: rows take it.
    assert matrix_axes((64, 8, 8), (None, None, "model"), (64, 64), SIZES)[1] is False


def _abstract_quantized(name, mode):
    report = keras_hub_dist.abstract_backbone(name, num_layers=1)
    quantization.quantize_without_values(report.model, mode)
    return report.model


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("name", ["gemma_7b_en", "llama3_8b_en", "qwen3_8b_en", "mixtral_8_7b_en"])
def test_get_layout_map_and_plan_layout_cover_quantized_models(name, mode):
    model = _abstract_quantized(name, mode)
    tensors = quantization.quantized_tensors(model)
    assert tensors and all(t.mode == mode for t in tensors)
    for shape in MESH_SHAPES:
        mesh = abstract_device_mesh(shape)
        sizes = dict(zip(mesh.axis_names, mesh.shape))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LayoutFallbackWarning)
            maps = [keras_hub_dist.get_layout_map(model, mesh), keras_hub_dist.plan_layout(model, mesh)]
        for layout_map in maps:
            total = per_device = 0
            for v in model.weights:
                layout = layout_map[v.path]
                axes = tuple(layout.axes) if layout is not None else ()
                specs.validate_spec(v.path, v.shape, axes, sizes)
                nbytes = np.dtype(v.dtype if v.dtype != "bfloat16" else "float16").itemsize
                total += int(np.prod(v.shape)) * nbytes
                per_device += int(np.prod(specs.shard_shape(v.shape, axes, sizes))) * nbytes
            # As evenly as the float model: scales aside, 1/8 per device.
            assert per_device * 8 <= 1.01 * total, (name, mode, shape, layout_map.__class__)


def test_int8_scales_follow_the_output_axes():
    model = _abstract_quantized("gemma_7b_en", "int8")
    layout_map = keras_hub_dist.get_layout_map(model, abstract_device_mesh((2, 4)))
    query = next(t for t in quantization.quantized_tensors(model) if t.float_path.endswith("query/kernel"))
    assert tuple(layout_map[query.values.path].axes) == ("model", "batch", None)
    # (1, 1, heads, head_dim): the heads axis keeps the kernel's entry.
    assert tuple(query.scale.shape) == (1, 1, 16, 256)
    assert tuple(layout_map[query.scale.path].axes) == (None, None, "model", None)


def test_int4_packed_axis_moves_or_raises():
    model = _abstract_quantized("mixtral_8_7b_en", "int4")
    router = next(t for t in quantization.quantized_tensors(model) if "sparse_feedforward_gate" in t.float_path)
    assert tuple(router.values.shape) == (4096, 4)  # 8 experts, two per byte
    # Column-parallel on 8 devices: the 4 bytes cannot split 8 ways; the
    # 4096 rows take the axis (warned once for the map).
    mesh = abstract_device_mesh((1, 8))
    layout_map = keras.distribution.LayoutMap(mesh)
    with pytest.warns(LayoutFallbackWarning, match=r"int4 packed axis 1 \(4 bytes\)"):
        add_quantized_entries(layout_map, [router], {router.float_path: (None, "model")})
    assert tuple(layout_map[router.values.path].axes) == ("model", None)
    # Rows already sharded: nowhere to go.
    with pytest.raises(LayoutError, match=r"packed two per byte along axis 1, which holds 4 bytes \(8 int4 values\)"):
        quantized_axes(router, ("batch", "model"), {"batch": 2, "model": 8})
