"""Layout maps of Gemma 4, Qwen 3.5 (+ MoE), Qwen 3 MoE, Mixtral and gpt-oss.

Every named preset of these families (one per distinct configuration, with
its vision / audio towers where the preset has them) is built abstractly, no
weight allocated, and checked on (1, n) and (n, 1) meshes. Tiny instances
check the expert-bank errors and, where the experts are split along their FFN
width, that a forward pass sharded with the map equals the unsharded one
(tests/load/test_new_models.py loads every family sharded with its map).
"""

import json
import re
import warnings

import jax
import keras
import keras_hub
import numpy as np
import pytest

import keras_hub_dist
from keras_hub_dist import _compat
from keras_hub_dist.plan import layouts
from keras_hub_dist.plan import presets
from keras_hub_dist.plan import specs as spec_lib
from keras_hub_dist.shaping.apply import build_shaped
from keras_hub_dist.plan.abstract import per_device_bytes
from keras_hub_dist.plan.mesh import abstract_device_mesh
from conftest import EXPERT_BANK, jitted_outputs

DEVICES = [1, 2, 4, 8, 16]
FAMILIES = {"gemma4", "qwen3_5", "qwen3_5_moe", "qwen3_moe", "mixtral", "gpt_oss"}


def _distinct_presets():
    """One named preset per distinct backbone config of these families
    (e.g. `gemma4_31b` stands for `gemma4_instruct_31b` too)."""
    first = {}
    for name in presets.names():
        entry = presets.resolve(name)
        if entry.family in FAMILIES:
            config = dict(entry.config, name=None)
            first.setdefault(json.dumps(config, sort_keys=True), name)
    return sorted(first.values())


ARCHITECTURES = _distinct_presets()


def _abstract(name):
    # Not cached: 19 named architectures kept alive to the module's end (to
    # 235B's 94 layers) made every `gc.collect()` after them (each
    # `clear_session` of the tiny tests, the module's end) walk them all,
    # ~1.9 s each, 15 s of the file's CPU. One build serves each test.
    return keras_hub_dist.abstract_backbone(name)


def _quiet_map(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_hub_dist.LayoutFallbackWarning)
        return keras_hub_dist.get_layout_map(*args, **kwargs)


def _model_axis(axes):
    return "model" in layouts._names_of(axes)


def test_every_family_is_supported_and_has_named_presets():
    assert FAMILIES <= set(layouts.supported_families())
    assert {presets.resolve(name).family for name in ARCHITECTURES} == FAMILIES


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_maps_are_valid_on_every_mesh_and_big_models_balanced(name):
    """(1, n) and (n, 1) for n in 1..16: every layout divides its shape, and
    no expert bank is ever replicated over the model axis.

    Models of 4B parameters or more: the most loaded device holds at most
    1.01x its even share of the weights on (1, 8) and (1, 16) (the same
    maps: one abstract build for both checks)."""
    report = _abstract(name)
    big = report.parameter_count >= 4e9
    balanced = set()
    for n in DEVICES:
        for shape in dict.fromkeys(((1, n), (n, 1))):  # (1, 1) once
            mesh = abstract_device_mesh(shape)
            layout_map = _quiet_map(report, mesh)
            assert layout_map.report.checked
            assert layout_map.report.source in ("keras_hub", "keras_hub_dist")
            if n == 1:
                assert layout_map.report.fallbacks == ()
            banks = 0
            for spec in report.variables:
                layout = layout_map[spec.path]
                if EXPERT_BANK.fullmatch(spec.path):
                    banks += 1
                    assert layout is not None
                    assert shape[1] == 1 or _model_axis(layout.axes), spec.path
                if layout is not None:
                    spec_lib.validate_spec(spec.path, spec.shape, layout.axes, mesh)
                elif len(spec.shape) >= 2:  # no large matrix left out
                    assert spec.size < 1 << 20, spec.path
            assert (banks > 0) == bool(report.config.get("num_experts")), name
            if big and shape in ((1, 8), (1, 16)):
                per_device = per_device_bytes(report.variables, mesh, layout_map)
                ratio = max(per_device.values()) / (report.total_bytes / n)
                assert ratio <= 1.01, (name, n, ratio)
                balanced.add(shape)
    assert balanced == ({(1, 8), (1, 16)} if big else set())


def test_mixtral_experts_move_to_the_ffn_axis_with_a_warning():
    report = _abstract("mixtral_8_7b_en")
    mesh = abstract_device_mesh((1, 16))  # 8 experts, ffn 14336
    with pytest.warns(keras_hub_dist.LayoutFallbackWarning) as record:
        layout_map = keras_hub_dist.get_layout_map(report, mesh)
    banks = [f for f in layout_map.report.fallbacks if EXPERT_BANK.fullmatch(f.path)]
    layers = report.config["num_layers"]
    assert len(banks) == 3 * layers
    for fallback in banks:
        assert fallback.replicated_axes == ()
        assert "expert count 8" in fallback.reason
        if fallback.path.endswith("output_dense"):
            assert fallback.used == (None, "model", "batch")
        else:
            assert fallback.used == (None, "batch", "model")
    assert "expert_feedforward_gate_dense" in str(record[0].message)
    # Every bank of a rule fell back alike: the rule itself is rewritten (no
    # exact-path entries), so another build whose auto-named MoE blocks get
    # a `_<n>` suffix still matches.
    keys = list(layout_map.keys())
    assert not any(fallback.path in keys for fallback in banks)
    assert {fallback.rule for fallback in banks} <= set(keys)
    again = keras_hub_dist.abstract_backbone("mixtral_8_7b_en")
    for spec in again.variables:
        if spec.path.endswith("experts/expert_feedforward_gate_dense"):
            assert layout_map[spec.path].axes == (None, "batch", "model")
    # 8 devices divide the 8 experts: no fallback at all.
    assert _quiet_map(report, abstract_device_mesh((1, 8))).report.fallbacks == ()


# --- Tiny instances -------------------------------------------------------

def _tiny(family, experts=8, expert_ffn=16):
    common = dict(vocabulary_size=64, num_query_heads=8, num_key_value_heads=2,
                  hidden_dim=32, dtype="float32")
    if family == "gemma4":
        return keras_hub.models.Gemma4Backbone, dict(
            common, image_size=None, vision_encoder=None, audio_encoder=None,
            num_layers=4, intermediate_dim=32, head_dim=8, global_head_dim=16,
            sliding_window_pattern=2, num_global_key_value_heads=1,
            num_kv_shared_layers=2, use_double_wide_mlp=True,
            hidden_size_per_layer_input=8,
        )
    if family == "gemma4_moe":
        return keras_hub.models.Gemma4Backbone, dict(
            common, image_size=None, vision_encoder=None, audio_encoder=None,
            num_layers=2, intermediate_dim=32, head_dim=8,
            sliding_window_pattern=2, enable_moe_block=True,
            num_experts=experts, expert_intermediate_dim=expert_ffn,
            num_experts_per_token=2,
        )
    linear = dict(vision_encoder=None, num_layers=2, head_dim=8,
                  layer_types=["linear_attention", "full_attention"],
                  linear_num_key_heads=4, linear_num_value_heads=8,
                  linear_key_head_dim=8, linear_value_head_dim=8)
    if family == "qwen3_5":
        return keras_hub.models.Qwen3_5Backbone, dict(
            common, **linear, intermediate_dim=32,
        )
    if family == "qwen3_5_moe":
        return keras_hub.models.Qwen3_5MoeBackbone, dict(
            common, **linear, moe_intermediate_dim=expert_ffn,
            shared_expert_intermediate_size=16, num_experts=experts, top_k=2,
        )
    if family == "qwen3_moe":
        return keras_hub.models.Qwen3MoeBackbone, dict(
            common, num_layers=2, intermediate_dim=32,
            moe_intermediate_dim=expert_ffn, num_experts=experts, head_dim=8,
            top_k=2,
        )
    if family == "mixtral":
        return keras_hub.models.MixtralBackbone, dict(
            common, num_layers=2, intermediate_dim=expert_ffn,
            num_experts=experts, top_k=2,
        )
    assert family == "gpt_oss"
    return keras_hub.models.GptOssBackbone, dict(
        common, num_layers=2, intermediate_dim=expert_ffn, num_experts=experts,
        top_k=2, head_dim=8,
    )


MOE_FAMILIES = ["gemma4_moe", "qwen3_5_moe", "qwen3_moe", "mixtral", "gpt_oss"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_banks_that_divide_nothing_are_an_error(family):
    """3 experts of FFN width 6 on 4 devices: no silent replication."""
    cls, config = _tiny(family, experts=3, expert_ffn=6)
    report = keras_hub_dist.abstract_backbone(config, backbone_class=cls)
    with pytest.raises(keras_hub_dist.LayoutError) as info:
        _quiet_map(report, abstract_device_mesh((1, 4)))
    message = str(info.value)
    match = re.search(
        r"Cannot shard expert bank '([^']+)' of shape (\(3, 32, 6\)|\(3, 6, 32\))",
        message,
    )
    assert match and EXPERT_BANK.fullmatch(match.group(1)), message
    ffn_dim = 2 if match.group(2) == "(3, 32, 6)" else 1
    assert "mesh axis 'model' of size 4" in message
    assert "expert count (3, dimension 0)" in message
    assert f"expert FFN width (6, dimension {ffn_dim})" in message
    assert "with 4 devices: [2]" in message
    # A model axis dividing the experts or their width is fine.
    for mesh in ((1, 3), (1, 2), (4, 1)):
        _quiet_map(report, abstract_device_mesh(mesh))


@pytest.mark.parametrize("mesh", [(1, 8), (2, 4), (8, 1)])
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_banks_split_their_experts_over_both_axes(family, mesh):
    """Every expert bank (and gpt-oss's per-expert biases) keeps its experts
    over both mesh axes, the rest whole: a device computes its own experts
    on every token as on (1, 8), and no bank is gathered over the data axis
    to compute a batch split over it (module doc of `plan.family_rules`)."""
    cls, config = _tiny(family, experts=8)
    report = keras_hub_dist.abstract_backbone(config, backbone_class=cls)
    ours = _quiet_map(report, abstract_device_mesh(mesh))  # the tiny KV heads fall back
    banks = [s for s in report.variables if EXPERT_BANK.fullmatch(s.path) or "proj_bias" in s.path]
    assert banks and not {f.path for f in ours.report.fallbacks} & {s.path for s in banks}
    for spec in banks:
        axes = tuple(ours[spec.path].axes)
        assert axes == (("batch", "model"),) + (None,) * (len(spec.shape) - 1), (spec.path, axes)
        assert spec_lib.shard_shape(spec.shape, axes, dict(zip(("batch", "model"), mesh)))[0] == 1


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_banks_the_mesh_does_not_divide_keep_the_model_axis(family):
    """4 experts on (2, 4): the model axis alone splits them, the data axis
    another dimension, and the report says why."""
    cls, config = _tiny(family, experts=4)
    report = keras_hub_dist.abstract_backbone(config, backbone_class=cls)
    ours = _quiet_map(report, abstract_device_mesh((2, 4)))
    banks = [s for s in report.variables if EXPERT_BANK.fullmatch(s.path)]
    assert banks
    for spec in banks:
        axes = tuple(ours[spec.path].axes)
        assert axes[0] == "model" and "batch" in layouts._names_of(axes[1:]), (spec.path, axes)
    reasons = {f.path: f.reason for f in ours.report.fallbacks}
    for spec in banks:
        assert "do not divide the expert count 4: the bank keeps its experts on the model axis only" in reasons[spec.path]


def test_qwen3_moe_extends_kerashub_map_with_the_expert_banks():
    cls, config = _tiny("qwen3_moe")
    report = keras_hub_dist.abstract_backbone(config, backbone_class=cls)
    mesh = abstract_device_mesh((2, 4))
    stock = keras_hub.models.Qwen3MoeBackbone.get_layout_map(mesh)
    ours = _quiet_map(report, mesh)
    assert ours.report.source == "keras_hub"
    banks = [s for s in report.variables if EXPERT_BANK.fullmatch(s.path)]
    assert len(banks) == 2 * config["num_layers"]
    for spec in banks:
        assert stock[spec.path] is None  # KerasHub would replicate them.
        assert ours[spec.path].axes[0] == ("batch", "model")
    for key in stock:
        # Except the vocabulary table, over both axes (`vocabulary_rules`).
        expected = (("batch", "model"), None) if key == "token_embedding/embeddings" else stock[key].axes
        assert ours[key].axes == expected


def _build(cls, config, values=None):
    """Builds the model with `values` (path -> array) instead of drawing its
    initializers (far fewer XLA compilations than an eager random build),
    laid out by the active distribution."""
    model, created = build_shaped(cls, config)
    if values is None:
        rng = np.random.default_rng(0)
        values = {
            w.path: (0.1 * rng.standard_normal(w.shape)).astype("float32")
            for w in model.weights
        }
    for weight in model.weights:
        value = values[weight.path]
        _compat.set_pending_initializer(
            weight, lambda shape, dtype=None, value=value: value
        )
    _compat.initialize_pending(created)
    return model, values


def _inputs(model):
    rng = np.random.default_rng(1)
    batch, length = 2, 6
    values = {
        "token_ids": rng.integers(1, 64, (batch, length)).astype("int32"),
        "padding_mask": np.array([[1] * length, [1] * (length - 2) + [0] * 2],
                                 dtype="int32"),
        "position_ids": np.tile(np.arange(length, dtype="int32"), (batch, 1)),
    }
    return {tensor.name: values[tensor.name] for tensor in model.inputs}


def _forward(model, inputs):
    """One jitted forward pass (one XLA compilation, not one per op)."""
    return np.asarray(jitted_outputs(model, inputs))


def test_expert_ffn_split_forward_equals_unsharded():
    """Mixtral with 4 experts on (1, 8): the expert banks are split along
    their FFN width (and on (2, 4) along the experts); the map's layouts are
    the variables' shardings and the forward pass equals the unsharded one.
    Every family's map (experts split over the expert axis) is checked the
    same way by loading tiny presets (tests/load/test_new_models.py)."""
    cls, config = _tiny("mixtral", experts=4)
    # One layer: the expert banks are what is split, and every layer's are
    # alike; each of the three builds is traced and compiled once.
    config = dict(config, num_layers=1)
    # Each build starts a session: the same auto-generated layer names, so
    # the exact-path fallbacks computed on `reference` match `sharded`.
    keras.backend.clear_session()
    reference, values = _build(cls, config)
    inputs = _inputs(reference)
    expected = _forward(reference, inputs)
    for mesh_shape in ((2, 4), (1, 8)):
        mesh = keras.distribution.DeviceMesh(
            mesh_shape, ("batch", "model"), jax.devices()
        )
        layout_map = _quiet_map(reference, mesh)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
        keras.backend.clear_session()  # (it would also drop the scope)
        with distribution.scope():
            sharded, _ = _build(cls, config, values)
            split = 0
            for variable in sharded.weights:
                layout = layout_map[variable.path]
                if layout is None:
                    continue
                rank = len(variable.shape)
                spec = tuple(variable.value.sharding.spec)
                assert spec + (None,) * (rank - len(spec)) == tuple(
                    layout.axes
                ) + (None,) * (rank - len(layout.axes)), variable.path
                split += _model_axis(layout.axes)
                if EXPERT_BANK.fullmatch(variable.path):
                    assert _model_axis(layout.axes), variable.path
            assert split > 0
            actual = _forward(sharded, inputs)
        np.testing.assert_allclose(actual, expected, atol=1e-5, rtol=0)
    keras.backend.clear_session()


@pytest.mark.parametrize("mesh", [(2, 4), (8, 1)])
def test_mixtral_banks_put_the_data_axis_on_the_ffn_dimension(mesh):
    """Separate gate / up `(E, hidden, ffn)` and down `(E, ffn, hidden)`
    kernels: the data axis on the FFN dimension, so `generate` gathers no
    kernel over it (Mixtral-8x7B width, 2 layers, 8 x 1024 on (2, 4): 4,372
    -> 3,028 MiB per device; docs/layouts.md; since each block's weights are
    gathered inside generate's loops, 3,009 -> 2,336 MiB, here 0.91x)."""
    from keras_hub_dist.jobs import programs
    from keras_hub_dist.jobs.abstract_job import abstract_job

    cls, config = _tiny("mixtral", experts=4, expert_ffn=1024)
    config = dict(config, hidden_dim=64)
    totals = {}
    for dims in ("ffn", "hidden"):
        keras.backend.clear_session()
        job = abstract_job(cls, config, mesh)
        layout_map = keras_hub_dist.get_layout_map(job.task.backbone, job.distribution.device_mesh)
        banks = {k: layout_map[k].axes for k in layout_map.keys() if "experts" in k}
        assert banks == {
            "transformer_layer.*experts.expert_feedforward_(gate|intermediate)_dense": ("model", None, "batch"),
            "transformer_layer.*experts.expert_feedforward_output_dense": ("model", "batch", None),
        }
        if dims == "hidden":  # the other families' placement, for comparison
            for key, (experts, a, b) in banks.items():
                del layout_map[key]
                layout_map[key] = (experts, b, a)
            keras.backend.clear_session()
            job = abstract_job(cls, config, mesh, layout_map=layout_map)
        lowered, _ = programs.lower_generate(job, 8, 128, prompt_chunk=64, shard_batch=True)
        totals[dims] = programs.program_memory(lowered.compile())["total_bytes"]
    assert totals["ffn"] < 0.93 * totals["hidden"], totals
