"""Tests of `plan_layout`: automatic tensor-parallel layouts for any model."""

import functools
import re
import warnings

import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES, jitted_outputs
from jax.sharding import NamedSharding, PartitionSpec
from keras import layers

import keras_hub_dist
from keras_hub_dist import _compat
from keras_hub_dist.plan.abstract import abstract_backbone
from keras_hub_dist.errors import LayoutError, LayoutFallbackWarning
from keras_hub_dist.plan.auto_layout import LayoutPlan, plan_layout

VOCAB = 256
BATCH = 8  # divisible by every batch axis of MESH_SHAPES
SEQ = 6

# Tiny configs: 8 query heads divide every model axis; 2 KV heads do not
# divide 4 or 8, so key/value kernels exercise the fallback.
_LLM = dict(vocabulary_size=VOCAB, num_layers=1, num_query_heads=8,
            num_key_value_heads=2, hidden_dim=32, intermediate_dim=64)
FAMILIES = {
    "gemma": lambda: keras_hub.models.GemmaBackbone(head_dim=8, **_LLM),
    "gemma2": lambda: keras_hub.models.GemmaBackbone(
        head_dim=8, use_post_ffw_norm=True, use_post_attention_norm=True,
        attention_logit_soft_cap=50.0, final_logit_soft_cap=30.0,
        use_sliding_window_attention=True, sliding_window_size=4, **_LLM),
    "gemma3": lambda: keras_hub.models.Gemma3Backbone(
        image_size=16, head_dim=8, **_LLM),
    "llama": lambda: keras_hub.models.LlamaBackbone(**_LLM),
    "llama3": lambda: keras_hub.models.Llama3Backbone(**_LLM),
    "qwen": lambda: keras_hub.models.QwenBackbone(**_LLM),
    "qwen3": lambda: keras_hub.models.Qwen3Backbone(head_dim=8, **_LLM),
    "mistral": lambda: keras_hub.models.MistralBackbone(**_LLM),
}

# 7B-class architectures (full configs from presets/): the per-device share of
# the automatic plan on 8 devices must be within 10% of total / 8.
BIG_ARCHITECTURES = [
    "gemma_7b_en", "gemma2_9b_en", "llama3_8b_en", "qwen2.5_7b_en",
    "qwen3_8b_en", "mistral_7b_en",
]


def _mesh(shape):
    return keras.distribution.DeviceMesh(
        shape=shape, axis_names=("batch", "model"), devices=jax.devices()
    )


def _plan(model, mesh, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LayoutFallbackWarning)
        return plan_layout(model, mesh, **kwargs)


def _token_inputs():
    rng = np.random.default_rng(0)
    mask = np.ones((BATCH, SEQ), "int32")
    mask[0, -2:] = 0
    return {
        "token_ids": rng.integers(1, VOCAB, (BATCH, SEQ)).astype("int32"),
        "padding_mask": mask,
    }


def _forward(model, x):
    """The model's forward pass, jitted, on its (possibly sharded) weights."""
    return np.asarray(jitted_outputs(model, x))


def _assert_planned_shardings(model, plan, mesh):
    """Every variable lives in exactly the planned sharding, per-device bytes
    measured from its shards equal the plan's figure, large ones are split."""
    per_device = {d.id: 0 for d in jax.devices()}
    for v in model.weights:
        axes = plan.spec(v.path)
        want = NamedSharding(mesh.backend_mesh, PartitionSpec(*axes))
        assert v.value.sharding.is_equivalent_to(want, len(v.shape)), (
            v.path, v.value.sharding, axes)
        for shard in v.value.addressable_shards:
            per_device[shard.device.id] += shard.data.nbytes
        decision = plan.decision(v.path)
        if len(v.shape) >= 2 and decision.role != "bias":
            assert not v.value.sharding.is_fully_replicated, v.path
        else:
            assert all(a is None for a in axes), (v.path, axes)
    assert set(per_device.values()) == {plan.per_device_bytes}


@functools.cache
def _reference(family):
    """A tiny family backbone built without distribution, and its weights."""
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(0)
    model = FAMILIES[family]()
    return model, model.get_weights()


@functools.cache
def _reference_output(family):
    return _forward(_reference(family)[0], _token_inputs())


# -- KerasHub families: forward pass -----------------------------------------


# Every family on the two meshes that split weights over the model axis; the
# pure data-parallel mesh (weights split over the batch axis only) for two.
# Every family on the tensor-parallel mesh with a data axis (2, 4); the 8-way
# tensor-parallel mesh (1, 8) and the pure data-parallel one (8, 1) for
# Gemma- and Llama-style families. (Gemma 2 is Gemma's backbone class with
# other flags: its roles are checked below.)
FORWARD_CASES = (
    [(f, (2, 4)) for f in sorted(FAMILIES) if f != "gemma2"]
    + [(f, (1, 8)) for f in ("gemma", "llama", "qwen3")]
    + [(f, (8, 1)) for f in ("gemma", "llama")]
)


def _case_id(case):
    return f"{case[0]}-{case[1][0]}x{case[1][1]}"


@pytest.mark.parametrize(
    "family,mesh_shape", FORWARD_CASES, ids=map(_case_id, FORWARD_CASES))
def test_family_forward_matches_unsharded(family, mesh_shape):
    ref, weights = _reference(family)
    expected = _reference_output(family)
    mesh = _mesh(mesh_shape)
    plan = _plan(ref, mesh)
    assert isinstance(plan, LayoutPlan)
    assert isinstance(plan, keras.distribution.LayoutMap)
    keras.distribution.set_distribution(plan.distribution())
    model = FAMILIES[family]()
    model.set_weights(weights)
    _assert_planned_shardings(model, plan, mesh)
    got = _forward(model, _token_inputs())
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_roles_follow_megatron_pattern(family):
    ref, _ = _reference(family)
    plan = _plan(ref, {"batch": 2, "model": 4})
    by_role = {}
    for d in plan.decisions:
        by_role.setdefault(d.role, []).append(d)
    # One embedding table, sharded on the vocabulary axis.
    (emb,) = by_role["embedding"]
    assert emb.shape[0] == VOCAB and emb.axes[0] == "model"
    q_heads_dim = 0 if family.startswith("gemma") else 1
    for d in plan.decisions:
        name, leaf = d.path.split("/")[-2:]
        if leaf == "bias":
            assert d.role == "bias" and set(d.axes) == {None}, d
        elif name == "query":
            # 8 heads divide 4: heads axis, column-parallel.
            assert d.role == "column" and d.axes[q_heads_dim] == "model", d
        elif name in ("key", "value"):
            # 2 KV heads do not divide 4: another axis, reported.
            assert d.role == "column" and d.axes[q_heads_dim] != "model", d
            assert "not divisible" in d.fallback and d.sharded
        elif name == "attention_output":
            assert d.role == "row" and d.axes[0] == "model", d
            assert any(p.endswith("query/kernel") for p in d.partners)
        elif name in ("ffw_gating", "ffw_gating_2", "feedforward_gate_dense",
                      "feedforward_intermediate_dense"):
            assert d.role == "column" and d.axes == ("batch", "model"), d
        elif name in ("ffw_linear", "feedforward_output_dense"):
            assert d.role == "row" and d.axes == ("model", "batch"), d
            assert len(d.partners) == 2
        elif len(d.shape) == 1:
            assert d.role == "vector" and d.axes == (None,), d


# -- Plain Keras models ------------------------------------------------------


def _mlp():
    return keras.Sequential(
        [
            keras.Input((16,)),
            layers.Dense(64, activation="relu", name="fc1"),
            layers.Dense(32, activation="relu", name="fc2"),
            layers.Dense(8, name="head"),
        ],
        name="mlp",
    )


def _transformer():
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCAB, 32, name="embed")(tokens)
    h = layers.LayerNormalization(name="ln1")(x)
    h = layers.MultiHeadAttention(4, 8, name="mha")(h, h, use_causal_mask=True)
    x = layers.Add(name="res1")([x, h])
    h = layers.LayerNormalization(name="ln2")(x)
    h = layers.Dense(64, activation="gelu", name="ff_in")(h)
    h = layers.Dense(32, name="ff_out")(h)
    x = layers.Add(name="res2")([x, h])
    logits = layers.Dense(VOCAB, name="lm_head")(x)
    return keras.Model(tokens, logits, name="tiny_transformer")


def _llama_causal_lm():
    return keras_hub.models.LlamaCausalLM(
        backbone=keras_hub.models.LlamaBackbone(**_LLM), preprocessor=None
    )


def _data(kind):
    rng = np.random.default_rng(1)
    if kind == "mlp":
        return (rng.normal(size=(BATCH, 16)).astype("float32"),
                rng.normal(size=(BATCH, 8)).astype("float32"))
    tokens = rng.integers(1, VOCAB, (BATCH, SEQ)).astype("int32")
    labels = np.roll(tokens, -1, axis=1)
    if kind == "transformer":
        return tokens, labels
    return _token_inputs(), labels


KERAS_MODELS = {"mlp": _mlp, "transformer": _transformer,
                "llama_causal_lm": _llama_causal_lm}


def _compile(model, kind):
    loss = "mse" if kind == "mlp" else keras.losses.SparseCategoricalCrossentropy(
        from_logits=True)
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-3), loss=loss)


@functools.cache
def _trained_reference(kind):
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(0)
    model = KERAS_MODELS[kind]()
    x, y = _data(kind)
    before = model.get_weights()
    expected_forward = None
    if kind != "llama_causal_lm":  # KerasHub forwards are covered above
        expected_forward = np.asarray(
            model.predict(x, batch_size=BATCH, verbose=0))
    _compile(model, kind)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return model, before, expected_forward, model.get_weights()


TRAINING_CASES = [("mlp", m) for m in MESH_SHAPES] + [
    ("transformer", (2, 4)), ("llama_causal_lm", (1, 8))]


@pytest.mark.parametrize(
    "kind,mesh_shape", TRAINING_CASES, ids=map(_case_id, TRAINING_CASES))
def test_training_step_matches_unsharded(kind, mesh_shape):
    ref, before, expected_forward, expected = _trained_reference(kind)
    mesh = _mesh(mesh_shape)
    plan = _plan(ref, mesh)
    keras.distribution.set_distribution(plan.distribution())
    model = KERAS_MODELS[kind]()
    model.set_weights(before)
    _assert_planned_shardings(model, plan, mesh)
    x, y = _data(kind)
    if expected_forward is not None:
        got = np.asarray(model.predict(x, batch_size=BATCH, verbose=0))
        np.testing.assert_allclose(got, expected_forward, rtol=1e-5, atol=1e-5)

    _compile(model, kind)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 1
    for got_w, want_w in zip(model.get_weights(), expected, strict=True):
        np.testing.assert_allclose(got_w, want_w, rtol=0, atol=1e-5)
    # Adam's slots carry their variable's sharding.
    slots = {v.name: v for v in model.optimizer.variables}
    for v in model.trainable_variables:
        for kind_ in ("momentum", "velocity"):
            slot = slots[f"{v.path.replace('/', '_')}_{kind_}"]
            assert slot.value.sharding.is_equivalent_to(
                v.value.sharding, len(v.shape)), (slot.path, v.path)
        if len(v.shape) >= 2 and plan.decision(v.path).role != "bias":
            assert not slot.value.sharding.is_fully_replicated


def test_keras_models_plan_structure():
    plan = _plan(_mlp(), {"batch": 1, "model": 8})
    assert plan.spec("mlp/fc1/kernel") == ("batch", "model")  # column
    assert plan.spec("mlp/fc2/kernel") == ("model", "batch")  # row
    head = plan.decision("mlp/head/kernel")  # 8 outputs on 8 devices: column
    assert head.role == "column" and head.axes == ("batch", "model")
    plan = _plan(_mlp(), {"batch": 1, "model": 16})
    head = plan.decision("mlp/head/kernel")  # 8 outputs, 16 devices: falls back
    assert head.axes == ("model", "batch") and "not divisible" in head.fallback

    plan = _plan(_transformer(), {"batch": 1, "model": 4})
    for name in ("query", "key", "value"):
        d = plan.decision(f"mha/{name}/kernel")  # (hidden, heads, head_dim)
        assert d.role == "column" and d.axes[1] == "model", d
        assert plan.decision(f"mha/{name}/bias").role == "bias"
    out = plan.decision("mha/attention_output/kernel")  # (heads, head_dim, d)
    assert out.role == "row" and out.axes[0] == "model"
    assert set(out.partners) == {f"mha/{n}/kernel" for n in ("query", "key", "value")}
    assert plan.decision("ff_out/kernel").partners == ("ff_in/kernel",)
    assert plan.decision("lm_head/kernel").axes == ("batch", "model")


def test_conv_and_position_embedding_roles():
    image = keras.Input((16, 16, 3))
    x = layers.Conv2D(16, 3, activation="relu", name="c1")(image)
    x = layers.Conv2D(32, 3, name="c2")(x)
    cnn = keras.Model(image, layers.GlobalAveragePooling2D()(x), name="cnn")
    plan = _plan(cnn, {"batch": 1, "model": 8})
    assert plan.decision("c1/kernel").role == "column"
    assert plan.spec("c1/kernel")[3] == "model"  # output features
    assert plan.decision("c2/kernel").role == "row"
    assert plan.spec("c2/kernel")[2] == "model"  # input features
    assert plan.decision("c2/kernel").partners == ("c1/kernel",)

    tokens = keras.Input((None,), dtype="int32")
    x = keras_hub.layers.TokenAndPositionEmbedding(VOCAB, 64, 32, name="tpe")(
        tokens)
    x = layers.Dense(32, name="proj")(x)
    plan = _plan(keras.Model(tokens, x), {"batch": 1, "model": 8})
    assert plan.decision("tpe/token_embedding/embeddings").role == "embedding"
    positions = plan.decision("tpe/position_embedding/embeddings")
    assert positions.role == "other" and positions.sharded  # not a bias
    assert plan.decision("proj/bias").role == "vector"


def test_variables_sharing_a_path_are_replicated_with_a_note():
    def block(width):  # built standalone: its variable paths are "proj/..."
        x = keras.Input((16,))
        return keras.Model(x, layers.Dense(width, name="proj")(x))

    a, b = block(32), block(64)
    x = keras.Input((16,))
    model = keras.Model(x, layers.Concatenate()([a(x), b(x)]))
    assert [v.path for v in model.weights].count("proj/kernel") == 2
    with pytest.warns(LayoutFallbackWarning, match="share the path"):
        plan = plan_layout(model, {"batch": 1, "model": 8})
    kernels = [d for d in plan.decisions if d.path == "proj/kernel"]
    assert [d.axes for d in kernels] == [(None, None)] * 2
    assert plan["proj/kernel"].axes == (None, None)


def test_reshape_keeps_identity_on_the_major_dimension():
    from keras_hub_dist.plan.weight_graph import _reshape_map

    assert _reshape_map((2, 5, 4, 8), (2, 5, 2, 2, 8)) == {0: 0, 1: 1, 2: 2, 4: 3}
    assert _reshape_map((2, 5, 2, 2, 8), (2, 5, 4, 8)) == {0: 0, 1: 1, 2: 2, 3: 4}
    assert _reshape_map((1, 6, 32), (6, 4, 8)) == {0: 1, 1: 2}


class _Swapped(keras.Model):
    """Names lie and attributes are declared in reverse call order."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up_proj = layers.Dense(16, name="up_proj")  # really the down
        self.down_proj = layers.Dense(64, name="down_proj")  # really the up

    def call(self, x):
        return self.up_proj(keras.activations.relu(self.down_proj(x)))


def test_pairs_come_from_data_flow_not_names():
    model = _Swapped(name="swapped")
    model(np.zeros((2, 16), "float32"))
    plan = _plan(model, {"batch": 1, "model": 8},
                 inputs=jax.ShapeDtypeStruct((2, 16), "float32"))
    assert plan.traced
    up = plan.decision("swapped/down_proj/kernel")
    down = plan.decision("swapped/up_proj/kernel")
    assert (up.role, up.axes) == ("column", ("batch", "model"))
    assert (down.role, down.axes) == ("row", ("model", "batch"))
    assert down.partners == ("swapped/down_proj/kernel",)

    # Without inputs a subclassed model cannot be traced: warned, still valid.
    with pytest.warns(LayoutFallbackWarning, match="no symbolic inputs"):
        untraced = plan_layout(model, {"batch": 1, "model": 8})
    assert not untraced.traced
    assert all(d.sharded for d in untraced.decisions if len(d.shape) == 2)


def test_unbuilt_model_is_planned_on_an_abstract_clone():
    model = keras.Sequential(
        [layers.Dense(64, name="fc1"), layers.Dense(16, name="fc2")], name="seq"
    )
    pending = list(_compat.deferred_variables())
    plan = _plan(model, _mesh((1, 8)),
                 inputs=jax.ShapeDtypeStruct((8, 16), "float32"))
    assert not model.built
    assert list(_compat.deferred_variables()) == pending
    keras.distribution.set_distribution(plan.distribution())
    model.build((None, 16))
    assert [v.path for v in model.weights] == [d.path for d in plan.decisions]
    assert model.weights[0].value.sharding.spec == PartitionSpec("batch", "model")
    with pytest.raises(LayoutError, match="not built"):
        plan_layout(keras.Sequential([layers.Dense(4)]), _mesh((1, 8)))


def test_keys_are_exact_and_plan_is_a_layout_map():
    ref, _ = _reference("gemma")
    plan = _plan(ref, _mesh((2, 4)))
    paths = [v.path for v in ref.weights]
    assert len(plan) == len(paths)
    for path in paths:
        assert [k for k in plan if re.fullmatch(k, path)] == [re.escape(path)]
    plain = plan.layout_map
    assert type(plain) is keras.distribution.LayoutMap
    assert {k: tuple(plain[k].axes) for k in plain} == {
        k: tuple(plan[k].axes) for k in plan}
    text = plan.summary()
    assert "fallbacks (2" in text and "key/kernel" in text
    assert str(plan) == text


def test_abstract_model_is_not_allocated_or_initialized():
    # Gemma 2 27B's full width; 2 of its 46 layers keep the test short (the
    # full model plans in ~2 s: benchmarks/plan_report.py).
    report = abstract_backbone("gemma2_27b_en", num_layers=2)
    model = report.model
    before = list(_compat.deferred_variables())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 32 heads / 16 KV heads divide 8
        plan = plan_layout(model, {"batch": 1, "model": 8})
    assert all(_compat.is_pending(v) for v in model.weights)
    assert list(_compat.deferred_variables()) == before
    assert keras.distribution.distribution() is None
    assert plan.device_mesh is None and len(plan.decisions) == len(model.weights)
    assert plan.balance < 1.001
    with pytest.raises(LayoutError, match="abstract mesh"):
        plan.distribution()


@pytest.mark.parametrize("name", BIG_ARCHITECTURES)
def test_7b_class_per_device_bytes_within_10_percent(name):
    # Full width; 4 of the layers (every layer has the same layout, and the
    # full-depth figures are in benchmarks/plan_report.py).
    model = abstract_backbone(name, num_layers=4).model
    plan = _plan(model, {"batch": 1, "model": 8})
    assert plan.traced
    print(f"{name}: per device {plan.per_device_bytes} B = "
          f"{plan.balance:.4f} x total/8")
    assert plan.per_device_bytes <= 1.10 * plan.total_bytes / 8
    for d in plan.decisions:
        if len(d.shape) >= 2 and d.role != "bias":
            assert d.sharded, d


def test_bad_mesh_axes_are_reported():
    ref, _ = _reference("llama")
    with pytest.raises(LayoutError, match="no axis named 'tp'.*model_axis"):
        plan_layout(ref, _mesh((1, 8)), model_axis="tp")
    with pytest.raises(LayoutError, match="data_axis=None"):
        plan_layout(ref, {"model": 8}, data_axis="batch")
    plan = _plan(ref, {"model": 8}, data_axis=None)
    assert all("batch" not in d.axes for d in plan.decisions)
    # One mesh parser for the package (plan.mesh): a shape larger than the
    # machine is an error; a smaller one takes the first devices.
    with pytest.raises(LayoutError, match="needs 16 devices"):
        plan_layout(ref, (2, 8))
    with pytest.warns(keras_hub_dist.LayoutFallbackWarning):
        smaller = plan_layout(ref, (2, 3))
    assert smaller.device_mesh.shape == (2, 3)
    assert [d.id for d in smaller.device_mesh.devices.flat] == list(range(6))
