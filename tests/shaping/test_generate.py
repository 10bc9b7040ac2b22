"""`shard_generate` / `lower_generate`: the chunked prompt pass generates
stock's tokens on every mesh, holds a fraction of stock's temporaries, splits
the KV cache over the batch axis, and refuses bad arguments clearly."""

import re
import warnings

import jax
import jax.numpy as jnp
import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES

import keras_hub_dist
from keras_hub_dist import GenerateFallbackWarning, load_sharded_preset, lower_generate, shard_generate
from keras_hub_dist.plan.mesh import device_mesh
from keras_hub_dist.shaping.apply import shape_model

VOCAB = 128
SMALL = dict(
    vocabulary_size=VOCAB, num_layers=1, num_query_heads=8, num_key_value_heads=8,
    hidden_dim=64, intermediate_dim=128, dtype="float32",
)
FAMILIES = {
    "gemma": (keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM, dict(SMALL, head_dim=8)),
    "llama": (keras_hub.models.LlamaBackbone, keras_hub.models.LlamaCausalLM, SMALL),
    # 4 KV heads: on (2, 4) one axis splits them, the other the batch.
    "gemma_4kv": (
        keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM,
        dict(SMALL, head_dim=8, num_key_value_heads=4),
    ),
    "llama_4kv": (keras_hub.models.LlamaBackbone, keras_hub.models.LlamaCausalLM, dict(SMALL, num_key_value_heads=4)),
    # A text prompt; a per-layer tuple cache, sliding layers whose window (3)
    # is shorter than a chunk, and a global one.
    "gemma3": (
        keras_hub.models.Gemma3Backbone, keras_hub.models.Gemma3CausalLM,
        dict(SMALL, num_layers=2, head_dim=8, image_size=16, vision_encoder=None, sliding_window_size=3,
             sliding_window_pattern=2),
    ),
    # One stacked cache as wide as the global layer's heads (16 against 8),
    # and a last (sliding) layer that reads the first one's keys and values.
    "gemma4": (
        keras_hub.models.Gemma4Backbone, keras_hub.models.Gemma4CausalLM,
        dict(SMALL, num_layers=3, head_dim=8, global_head_dim=16, image_size=None, vision_encoder=None,
             audio_encoder=None, sliding_window_size=3, sliding_window_pattern=2, num_kv_shared_layers=1),
    ),
}
# Gemma 3 / 4: `_build_cache(token_ids, img_embeddings, vision_mask,
# padding_mask, vision_indices)`, with the padding mask.
TEXT_PROMPT_FAMILIES = ("gemma3", "gemma4")
# max_length 13 with chunks of 4: three full chunks in the loop and a
# remainder of one; every prompt (5 to 9 tokens) spans several chunks.
BATCH, LENGTH, CHUNK = 8, 13, 4


def _inputs():
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 10, BATCH)
    mask = np.arange(LENGTH)[None] < lengths[:, None]
    tokens = np.where(mask, rng.integers(1, VOCAB, (BATCH, LENGTH)), 0).astype("int32")
    return {"token_ids": tokens, "padding_mask": mask}


def _distribution(backbone_cls, mesh_shape, config=None):
    """The package's map for `backbone_cls`, checked against `config`'s
    shapes where given (4 KV heads on 8 devices fall back)."""
    dm = device_mesh(mesh_shape)
    model = backbone_cls if config is None else keras_hub_dist.abstract_backbone(config, backbone_class=backbone_cls)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", keras_hub_dist.LayoutFallbackWarning)
        layout_map = keras_hub_dist.get_layout_map(model, dm)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _greedy_tokens(lm, inputs):
    """`lm.generate`'s tokens; for Gemma 3 its program's (KerasHub 0.32's
    `Gemma3CausalLM.generate` without a preprocessor raises: it
    concatenates the `images: None` its program returns for a text
    prompt)."""
    if type(lm).__name__ == "Gemma3CausalLM":
        if lm.generate_function is None:
            lm.make_generate_function()
        inputs = {k: jnp.asarray(v) for k, v in inputs.items()}
        return np.asarray(lm.generate_function(inputs, None)["token_ids"])
    return np.asarray(lm.generate(dict(inputs), stop_token_ids=None)["token_ids"])


def _prompt_logits(lm, token_ids, padding_mask):
    # The logits of the prompt pass (from the hidden states `_build_cache`
    # returns), and its cache.
    if type(lm).__name__ in ("Gemma3CausalLM", "Gemma4CausalLM"):
        hidden, cache = lm._build_cache(token_ids, None, None, padding_mask, None)
    else:
        hidden, cache = lm._build_cache(token_ids)
    return lm.backbone.token_embedding(hidden, reverse=True), cache


@pytest.fixture(scope="module")
def stock_reference():
    """Stock, unsharded: weights, greedy tokens and prompt-pass logits."""
    refs = {}
    inputs = _inputs()
    keras.distribution.set_distribution(None)
    for name, (backbone_cls, task_cls, config) in FAMILIES.items():
        keras.utils.set_random_seed(7)
        lm = task_cls(backbone=backbone_cls(**config), preprocessor=None)
        lm.compile(sampler="greedy")
        tokens = _greedy_tokens(lm, inputs)
        logits = np.asarray(jax.jit(lambda ids, mask: _prompt_logits(lm, ids, mask))(inputs["token_ids"], inputs["padding_mask"])[0])
        refs[name] = ([np.asarray(v.numpy()) for v in lm.backbone.weights], tokens, logits)
    return inputs, refs


@pytest.mark.parametrize(
    "family, mesh_shape",
    # 4 KV heads on (8, 1): the batch-split layout, which 8 KV heads take there too.
    [(f, m) for f in FAMILIES for m in MESH_SHAPES if not (f.endswith("_4kv") and m == (8, 1))],
)
def test_chunked_generate_equals_stock(family, mesh_shape, stock_reference):
    inputs, refs = stock_reference
    weights, ref_tokens, ref_logits = refs[family]
    backbone_cls, task_cls, config = FAMILIES[family]
    distribution = _distribution(backbone_cls, mesh_shape, config)
    keras.distribution.set_distribution(distribution)
    with distribution.scope():
        lm = task_cls(backbone=backbone_cls(**config), preprocessor=None)
    for variable, value in zip(lm.backbone.weights, weights):
        variable.assign(value)
    lm.compile(sampler="greedy")
    lm.generate_function = object()  # shard_generate resets stock's compiled program
    assert shard_generate(lm, prompt_chunk=CHUNK) is lm
    assert lm.generate_function is None and type(lm) is task_cls

    tokens = _greedy_tokens(lm, inputs)
    np.testing.assert_array_equal(tokens, ref_tokens)
    logits, cache = jax.jit(lambda ids, mask: _prompt_logits(lm, ids, mask))(inputs["token_ids"], inputs["padding_mask"])
    np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-4, rtol=0)
    sizes = dict(zip(("batch", "model"), mesh_shape))
    if family in TEXT_PROMPT_FAMILIES:
        # The batch on "batch" (every layer's keys and values for Gemma 3).
        assert {leaf.addressable_shards[0].data.shape[0] for leaf in jax.tree.leaves(cache)} == {
            BATCH // sizes["batch"]
        }
        return
    # The cache of the chunked pass: on (1, 8) the KV heads on "model"
    # where it divides them;
    # where the data axis is over 1, the heads over the axis that splits the
    # key kernel's heads (Gemma's model axis, Llama's data axis) and over
    # the other where the mesh divides them, else the batch over the other
    # (`shaping/stationary_weights.py`); else the batch on "batch".
    spec = tuple(cache.sharding.spec) + (None,) * 6
    shard = cache.addressable_shards[0].data.shape
    kv_heads = config["num_key_value_heads"]
    major, minor = ("model", "batch") if family.startswith("gemma") else ("batch", "model")
    entries = [(e,) if isinstance(e, str) else tuple(e or ()) for e in spec]
    if sizes["batch"] == 1:
        # Fewer KV heads than the model axis: their head dimension on it.
        assert spec[4] == ("model" if kv_heads % 8 == 0 else None) and shard[0] == BATCH
        assert spec[5] == (None if kv_heads % 8 == 0 else "model")
    elif kv_heads % 8 == 0:
        assert entries[0] == () and entries[4] == tuple(a for a in (major, minor) if sizes[a] > 1)
        assert shard[0] == BATCH and shard[4] == 1
    elif sizes[major] > 1 and kv_heads % sizes[major] == 0:
        assert entries[0] == (minor,) and entries[4] == (major,)
        assert shard[0] == BATCH // sizes[minor] and shard[4] == kv_heads // sizes[major]
    else:
        assert entries[0] == ("batch",) and shard[0] == BATCH // sizes["batch"]


@pytest.mark.parametrize("family", ["gemma", *TEXT_PROMPT_FAMILIES])
def test_prompt_up_to_a_chunk_runs_exactly_stock(family):
    backbone_cls, task_cls, config = FAMILIES[family]
    keras.utils.set_random_seed(1)
    lm = task_cls(backbone=backbone_cls(**config), preprocessor=None)

    def build_cache(length, **media):
        ids = jax.ShapeDtypeStruct((2, length), jnp.int32)
        if family not in TEXT_PROMPT_FAMILIES:
            return str(jax.make_jaxpr(lm._build_cache)(ids))
        mask = jax.ShapeDtypeStruct((2, length), jnp.bool_)
        prompt_pass = lambda ids, mask: lm._build_cache(ids, None, None, mask, None, **media)  # noqa: E731
        return str(jax.make_jaxpr(prompt_pass)(ids, mask))

    stock = build_cache(CHUNK)
    shard_generate(lm, prompt_chunk=CHUNK, shard_batch=False)
    assert build_cache(CHUNK) == stock
    longer = build_cache(3 * CHUNK + 1)
    assert "scan" in longer or "while" in longer  # one loop, not unrolled
    if family == "gemma4":
        # A prompt with media goes to stock's single pass, said (which this
        # backbone, without an audio encoder, cannot run).
        audio = jnp.zeros((2, 1, config["hidden_dim"]))
        with (
            pytest.warns(GenerateFallbackWarning, match=r"\['audio_embeddings', 'audio_indices'\] in stock's single pass"),
            pytest.raises(AttributeError, match="audio_interleave_embeddings"),
        ):
            build_cache(3 * CHUNK + 1, audio_embeddings=audio, audio_indices=jnp.zeros((2, 1), "int32"))
    shard_generate(lm, prompt_chunk=None, shard_batch=False)  # stock again
    assert not {"_build_cache", "call_with_cache", "generate_step"} & set(lm.__dict__)


def _cache_bytes_per_device(compiled, layers, length):
    # The partitioned program's [B, layers, 2, S, kv_heads, head_dim] buffer.
    shapes = [tuple(int(d) for d in dims.split(",")) for dims in re.findall(r"f32\[([0-9,]+)\]", compiled.as_text())]
    return 4 * max(
        int(np.prod(s)) for s in shapes
        if len(s) == 6 and s[1] == layers and s[2] == 2 and s[3] == length
    )


def test_memory_of_the_abstract_programs():
    # An abstract backbone (no variable has a value), lowered and compiled
    # from shapes and layouts alone. Tiny but long, two layers: stock's f32
    # scores [B, H/8, S, S] dominate its program (the last layer's
    # prompt-pass attention feeds only hidden states the greedy sampler
    # drops, so XLA removes it; the first's feeds the second's cache).
    batch, length, layers = 8, 256, 2
    figures = {}
    for mesh_shape, chunk in (((1, 8), None), ((1, 8), 16), ((2, 4), 16)):
        # Shaped as the loader and the factories shape what they build.
        model = shape_model(keras_hub_dist.abstract_backbone(
            dict(SMALL, num_layers=layers), backbone_class=keras_hub.models.LlamaBackbone
        ).model)
        layout_map = keras_hub_dist.get_layout_map(model, device_mesh(mesh_shape))
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
        )
        lm = keras_hub.models.LlamaCausalLM(backbone=model, preprocessor=None)
        lm.compile(sampler="greedy")
        shard_generate(lm, prompt_chunk=chunk, shard_batch=chunk is not None)
        compiled = lower_generate(lm, batch, length).compile()
        figures[mesh_shape, chunk] = (
            _cache_bytes_per_device(compiled, layers, length),
            compiled.memory_analysis().temp_size_in_bytes,
        )
    stock, ours, ours_2x4 = figures.values()
    assert ours[1] <= 0.25 * stock[1], figures
    # The whole f32 cache (B x layers x (k, v) x S x kv_heads x head_dim)
    # split 8 ways on both meshes (stock: 4x that on (2, 4), every batch
    # row on every device). Temporaries on (2, 4) within 8% of (1, 8)'s
    # (measured +7.2%; +1.8% before the vocabulary tables were split over
    # both axes, whose lookup now sums every batch row's embeddings over the
    # eight devices: in this tiny model that is a large part; at Llama-3-8B
    # width, 2 layers, 8 x 1024, (2, 4) costs 1,260 MiB against (1, 8)'s
    # 1,292). Llama's layout map puts the query heads on the batch axis
    # too, and XLA computes the attention with them there (as many KV as
    # query heads here; with grouped KV heads `shaping.batch_axis` keeps
    # q / k / v on (batch, heads): tests/shaping/test_batch_axis.py).
    assert ours[0] == ours_2x4[0] == batch * layers * 2 * length * 8 * 8 * 4 // 8, figures
    assert ours_2x4[1] <= 1.08 * ours[1], figures


def test_bad_arguments_are_refused():
    backbone_cls, task_cls, config = FAMILIES["llama"]
    model = keras_hub_dist.abstract_backbone(
        dict(config, num_layers=1), backbone_class=backbone_cls
    ).model
    with pytest.raises(TypeError, match="Expected a keras_hub.models.CausalLM.*Received: LlamaBackbone"):
        shard_generate(model)
    with pytest.raises(TypeError, match="Received: LlamaBackbone"):
        lower_generate(model, 1, 8)
    lm = task_cls(backbone=model, preprocessor=None)
    for bad in (0, -3, 1.5, True, "512"):
        with pytest.raises(ValueError, match=re.escape(f"Received: prompt_chunk={bad!r}")):
            shard_generate(lm, prompt_chunk=bad)
    with pytest.raises(ValueError, match=r"Expected batch_size to be a positive int\. Received: batch_size=0"):
        lower_generate(lm, 0, 8)
    with pytest.raises(ValueError, match="Received: prompt_chunk=0"):
        load_sharded_preset("gemma_2b_en", prompt_chunk=0)  # before anything is read
    lm.run_eagerly = True
    lm.generate_function = None
    with pytest.raises(TypeError, match="Expected KerasHub's jitted JAX generate program"):
        lower_generate(lm, 1, 8)


class _OwnCacheCall(keras_hub.models.LlamaCausalLM):
    """A causal LM whose `call_with_cache` is not one read in KerasHub's source."""

    def call_with_cache(self, *args, **kwargs):
        return super().call_with_cache(*args, **kwargs)


def test_an_unread_causal_lm_keeps_stocks_prompt_pass_with_a_warning():
    # Left stock (documented), its batch still constrained, its program
    # still lowering (abstract: no compile, no value).
    model = shape_model(keras_hub_dist.abstract_backbone(
        dict(SMALL, num_layers=1), backbone_class=keras_hub.models.LlamaBackbone
    ).model)
    layout_map = keras_hub_dist.get_layout_map(model, device_mesh((2, 4)))
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    )
    lm = _OwnCacheCall(backbone=model, preprocessor=None)
    assert not keras_hub_dist.shaping.generate.supports_chunked_prompt(lm)
    with pytest.warns(GenerateFallbackWarning, match="_OwnCacheCall keeps stock KerasHub's prompt pass"):
        shard_generate(lm, prompt_chunk=CHUNK)
    text = lower_generate(lm, BATCH, 2 * CHUNK).as_text()
    assert "sharding_constraint" in text, text[:2000]


def test_load_sharded_preset_applies_it(tmp_path):
    preset = keras_hub_dist.write_synthetic_preset(
        str(tmp_path / "llama"), keras_hub.models.LlamaBackbone, tokenizer=True, seed=0,
        **dict(SMALL, num_layers=1, dtype=None),
    )
    lm = load_sharded_preset(preset, mesh=(2, 4), task="causal_lm", progress=False)
    assert "_build_cache" in lm.__dict__ and type(lm) is keras_hub.models.LlamaCausalLM
    lm = load_sharded_preset(preset, mesh=(2, 4), task="causal_lm", progress=False, prompt_chunk=None)
    assert "_build_cache" not in lm.__dict__
