"""`plan_memory`: XLA's analysis of the very programs a job runs, from no weights."""

import functools
import gc
import json
import re

import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES

import keras_hub_dist
from keras_hub_dist import PlanError, UnknownPresetError
from keras_hub_dist.jobs import programs
from keras_hub_dist.jobs.abstract_job import abstract_job
from keras_hub_dist.jobs.memory_plan import plan_memory
from keras_hub_dist.measure import memory, program_watch
from keras_hub_dist.cli.main import main as cli_main

TINY = dict(
    vocabulary_size=256, num_layers=1, num_query_heads=8, num_key_value_heads=8,
    hidden_dim=64, intermediate_dim=128, head_dim=8,
)
PLAN = dict(batch_size=8, sequence_length=16, dtype="float32")
FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")


@pytest.fixture(scope="module")
def gemma_preset(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "gemma"
    return keras_hub_dist.write_synthetic_preset(
        str(path), keras_hub.models.GemmaBackbone, dtype="float32", tokenizer=True, **TINY
    )


@functools.cache
def _fit_plan(preset, mesh):
    """The plain fit plan (Adam, the default optimizer) of a mesh: one plan
    for the tests that read it (a plan is a pure function of its arguments)."""
    return plan_memory(preset, mesh, job="fit", optimizer="adam", **PLAN)


def _real_program_memory(run, program):
    """XLA's figures of the one program named `program` that `run()`
    compiles, captured at its compilation."""
    seen = []
    with program_watch.watch_compilations(lambda executable, name: seen.append((name, executable))):
        run()
    figures = [memory.compiled_memory(e) for name, e in seen if program in name]
    assert len(figures) == 1, [name for name, _ in seen]
    return figures[0]


@pytest.mark.parametrize("mesh", MESH_SHAPES)
def test_fit_plan_equals_the_real_train_step(gemma_preset, mesh):
    plan = _fit_plan(gemma_preset, mesh)
    lm = keras_hub_dist.load_sharded_preset(gemma_preset, mesh=mesh, task="causal_lm")
    lm.preprocessor = None
    lm.compile(optimizer=keras.optimizers.Adam(1e-3))
    tokens = np.ones((8, 16), "int32")
    x = {"token_ids": tokens, "padding_mask": np.ones((8, 16), bool)}
    real = _real_program_memory(
        lambda: lm.fit(x, tokens, sample_weight=np.ones((8, 16), bool), batch_size=8, verbose=0), "train_step"
    )
    for field in FIELDS:
        assert getattr(plan, field) == real[field], field
    assert plan.total_bytes == real["argument_bytes"] + real["output_bytes"] + real["temp_bytes"] - real["alias_bytes"]
    # The breakdown from the shardings: weights and Adam's two moments, each
    # split over the 8 devices (an odd replicated norm scale aside).
    weights = sum(v.value.addressable_shards[0].data.nbytes for v in lm.weights)
    assert plan.weights_bytes == weights
    moments = sum(v.value.addressable_shards[0].data.nbytes for v in lm.optimizer.variables)
    assert plan.optimizer_bytes == moments
    assert plan.compiler.startswith("cpu")


@pytest.mark.parametrize(
    "mesh, stock",
    # Stock's program once, on the mesh where its cache differs from ours.
    [*((mesh, False) for mesh in MESH_SHAPES), ((2, 4), True)],
    ids=["ours-1x8", "ours-2x4", "ours-8x1", "stock-2x4"],
)
def test_generate_plan_equals_the_real_generate(gemma_preset, mesh, stock):
    plan = plan_memory(gemma_preset, mesh, job="generate", stock=stock, prompt_chunk=4, **PLAN)
    # Stock: KerasHub's own map, as a stock user passes it (ours splits the
    # norm scales too: family_rules.gemma_residual_rules).
    lm = keras_hub_dist.load_sharded_preset(
        gemma_preset, mesh=mesh, task="causal_lm", prompt_chunk=None if stock else 4,
        layout_map=keras_hub.models.GemmaBackbone.get_layout_map if stock else None,
    )
    if stock:
        keras_hub_dist.shard_generate(lm, prompt_chunk=None, shard_batch=False)
    lm.preprocessor = None
    tokens = np.ones((8, 16), "int32")
    mask = np.arange(16)[None, :] < np.array([3, 5, 7, 9, 3, 5, 7, 9])[:, None]
    real = _real_program_memory(
        lambda: lm.generate({"token_ids": tokens, "padding_mask": mask}, stop_token_ids=None),
        "generate",
    )
    for field in FIELDS:
        assert getattr(plan, field) == real[field], field
    if stock:
        assert plan.kv_cache_bytes is None
    else:
        # [8, 1 layer, 2, 16, 8 KV heads, 8] f32, an eighth per device: on
        # (1, 8) the heads over the model axis; on (2, 4) and (8, 1) every
        # batch row, the heads over both axes (shaping/stationary_weights.py).
        assert plan.kv_cache_bytes == 8 * 1 * 2 * 16 * 8 * 8 * 4 // 8


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_the_kv_cache_figure_is_the_compiled_caches_share(kv_heads, clean_state):
    """Fewer KV heads than the model axis: `generate` puts the cache's head
    dimension on it (or, on (2, 4) with 2 heads, the heads on the data
    axis and the batch on the model axis); the figure counts that share,
    the partitioned program's `[B, layers, 2, S, kv_heads, head_dim]`
    buffer per device (it counted the head dimension whole: 8x on (1, 8))."""
    config = dict(
        vocabulary_size=256, num_layers=2, num_query_heads=16, num_key_value_heads=kv_heads,
        hidden_dim=256, intermediate_dim=512, dtype="float32",
    )
    for mesh in MESH_SHAPES:
        with clean_state():
            job = abstract_job(keras_hub.models.LlamaBackbone, config, mesh)
            lowered, figure = programs.lower_generate(job, 8, 128, prompt_chunk=64, shard_batch=True)
            shards = [
                tuple(int(d) for d in dims.split(","))
                for dims in re.findall(r"f32\[([0-9,]+)\]", lowered.compile().as_text())
            ]
        caches = {s for s in shards if len(s) == 6 and s[1:4] == (2, 2, 128)}
        assert len(caches) == 1, (mesh, caches)
        assert figure == 4 * int(np.prod(caches.pop())) == 8 * 2 * 2 * 128 * kv_heads * 16 * 4 // 8, mesh


def test_quantized_generate_plan_equals_the_real_generate(gemma_preset):
    plan = plan_memory(gemma_preset, (2, 4), job="generate", quantize="int8", prompt_chunk=4, **PLAN)
    lm = keras_hub_dist.load_sharded_preset(
        gemma_preset, mesh=(2, 4), task="causal_lm", quantize="int8", prompt_chunk=4
    )
    lm.preprocessor = None
    inputs = {"token_ids": np.ones((8, 16), "int32"), "padding_mask": np.ones((8, 16), bool)}
    real = _real_program_memory(lambda: lm.generate(inputs, stop_token_ids=None), "generate")
    for field in FIELDS:
        assert getattr(plan, field) == real[field], field
    assert plan.weights_bytes == sum(v.value.addressable_shards[0].data.nbytes for v in lm.weights)


def test_lora_plan_trains_only_the_factors(gemma_preset):
    full = _fit_plan(gemma_preset, (1, 8))
    lora = plan_memory(gemma_preset, (1, 8), job="fit", lora_rank=4, **PLAN)
    assert lora.lora_bytes > 0 and full.lora_bytes == 0
    assert lora.weights_bytes == full.weights_bytes
    # Adam's moments of the factors only (and its step count / learning rate).
    assert lora.optimizer_bytes < 2.1 * lora.lora_bytes + 64
    assert lora.total_bytes < full.total_bytes


@pytest.mark.filterwarnings("ignore::keras_hub_dist.LayoutFallbackWarning")  # gemma_2b_en's 1 KV head
def test_a_fit_costs_a_device_no_more_on_2x4_than_on_1x8():
    """With the batch kept on the batch axis, each block's weights gathered
    again in its backward pass and the vocabulary tables split along the
    vocabulary over both axes, a fit step on (2, 4) costs a device no more
    than on (1, 8) (here 0.95x; 1.002x with the tables stored as KerasHub
    stores them; at Llama-3-8B width, 2 layers, 8 x 512: 2,884 against
    3,090 MiB, 3,416 before)."""
    widths = dict(hidden_dim=256, intermediate_dim=512, num_query_heads=8, num_key_value_heads=4, vocabulary_size=8192)
    totals = {
        mesh: plan_memory(
            "llama3_8b_en", mesh, job="fit", batch_size=8, sequence_length=128, dtype="bfloat16",
            num_layers=2, overrides=widths, alternatives=False,
        ).total_bytes
        for mesh in ((1, 8), (2, 4))
    }
    assert totals[2, 4] <= 0.97 * totals[1, 8], totals


def test_load_plan_is_the_weights_share():
    plan = plan_memory("gemma_2b_en", (1, 8), job="load", dtype="bfloat16")
    expected = keras_hub_dist.abstract_backbone("gemma_2b_en", mesh=(1, 8), dtype="bfloat16")
    assert plan.weights_bytes == plan.total_bytes == expected.max_device_bytes
    assert plan.temp_bytes == 0


@pytest.mark.parametrize("remat", [None, "full"])
def test_a_plan_of_a_loaded_model_allocates_nothing(gemma_preset, remat):
    lm = keras_hub_dist.load_sharded_preset(gemma_preset, mesh=(2, 4), task="causal_lm")
    gc.collect()
    before = jax.live_arrays()  # held: their ids stay theirs
    known = {id(a) for a in before}
    # With remat, each block's call crosses a `jax.custom_vjp` (whose
    # weights, passed through `jax.closure_convert`, once stayed cached).
    plan = plan_memory(lm, (2, 4), job="fit", remat=remat, **PLAN)
    # The plan's own optimizer and metric scalars (step count, learning
    # rate, loss tracker) are garbage once it returns. (An earlier test's
    # array that JAX or Keras frees meanwhile is no concern here.)
    gc.collect()
    new = [a for a in jax.live_arrays() if id(a) not in known]
    assert memory.live_bytes_per_device(new) == memory.live_bytes_per_device([]), new
    del before
    assert plan.weights_bytes == sum(v.value.addressable_shards[0].data.nbytes for v in lm.weights)


def test_a_job_that_does_not_fit_plans_what_would(gemma_preset):
    tight = _fit_plan(gemma_preset, (1, 8))
    budget_gb = (tight.total_bytes - 1) / 2**30
    plan = plan_memory(gemma_preset, (1, 8), job="fit", hbm_gb=budget_gb, **PLAN)
    assert plan.fits is False
    changes = {alt.change: alt for alt in plan.alternatives}
    assert {"lora_rank=8", "batch_size=4", "mesh 2x4", "mesh 8x1"} <= set(changes)
    assert changes["lora_rank=8"].fits and changes["batch_size=4"].fits
    assert "does NOT fit" in plan.summary() and "lora_rank=8" in plan.summary()
    assert json.loads(json.dumps(plan.to_json()))["alternatives"]


@pytest.mark.parametrize(
    "kwargs, error, text",
    [
        (dict(job="train"), PlanError, "Expected one of ['fit', 'generate', 'load']"),
        (dict(batch_size=3, mesh=(2, 4)), PlanError, "Expected a batch_size it divides, e.g. [2, 4, 6, 8]"),
        (dict(lora_rank=0), PlanError, "Received: lora_rank=0"),
        (dict(optimizer="adamm"), PlanError, "Received: optimizer='adamm'"),
        (dict(remat="everything"), PlanError, "Received: remat='everything'"),
        (dict(mesh=(2, 8)), PlanError, "Expected at least 16 devices"),
        (dict(sequence_length=0), PlanError, "Received: sequence_length=0"),
        (dict(job="generate", prompt_chunk=0), PlanError, "Received: prompt_chunk=0"),
    ],
)
def test_bad_inputs_fail_before_anything_is_built(kwargs, error, text, monkeypatch):
    from keras_hub_dist.jobs import abstract_job

    monkeypatch.setattr(abstract_job, "build_abstract", lambda *a: pytest.fail("built"))
    mesh = kwargs.pop("mesh", (1, 8))
    with pytest.raises(error) as raised:
        plan_memory("gemma_2b_en", mesh, **kwargs)
    assert text in str(raised.value)


def test_a_sequence_past_the_checkpoints_positions_is_refused(tmp_path, monkeypatch):
    from keras_hub_dist.jobs import abstract_job

    path = str(tmp_path / "llama_hf")
    keras_hub_dist.write_synthetic_hf_checkpoint(path, keras_hub.models.LlamaBackbone, dict(TINY, head_dim=None))
    monkeypatch.setattr(abstract_job, "build_abstract", lambda *a: pytest.fail("built"))
    with pytest.raises(PlanError, match=r"Expected sequence_length <= 8192. Received: sequence_length=8193"):
        plan_memory(path, (1, 8), job="generate", sequence_length=8193)


def test_unknown_preset():
    with pytest.raises(UnknownPresetError, match="gemma_7b_en"):
        plan_memory("gemma_7bb_en", (1, 8), job="load")


def test_cli_prints_the_plan_and_its_verdict(gemma_preset, capsys):
    code = cli_main(["plan", gemma_preset, "--mesh", "2x4", "--job", "load", "--dtype", "float32", "--hbm_gb", "1"])
    out = capsys.readouterr().out
    assert code == 0 and "load" in out and "fits in 1 GiB per device" in out
    code = cli_main(["plan", gemma_preset, "--mesh", "1x8", "--job", "load", "--hbm_gb", "1e-9",
                     "--no-alternatives", "--json", "-"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["fits"] is False and report["mesh_axis_sizes"] == {"batch": 1, "model": 8}
    assert cli_main(["plan", gemma_preset, "--mesh", "3x8"]) == 2
    assert "Expected at least 24 devices" in capsys.readouterr().err


GEMMA4_TEXT = {
    # Per token: the text's length.
    "token_ids": (8, 16), "padding_mask": (8, 16), "position_ids": (8, 16),
    "vision_mask": (8, 16), "audio_mask": (8, 16),
    # No media item: what Gemma 4's preprocessor puts in for text only
    # (3 x 16 x 16 = the vision encoder's flattened patch).
    "pixel_values": (8, 0, 1, 768), "pixel_position_ids": (8, 0, 1, 2), "vision_indices": (8, 0),
    "audio_mel": (8, 0, 1, 128), "audio_mel_mask": (8, 0, 1), "audio_indices": (8, 0),
}


@pytest.mark.parametrize(
    "name, task, inputs",
    [
        # Gemma4AssistantCausalLM (a drafter with sizes of its own) shares
        # Gemma4Backbone: the job is Gemma4CausalLM's, as a load builds it;
        # its text batch also holds position ids, media masks, no media.
        ("gemma4_2b", "Gemma4CausalLM", GEMMA4_TEXT),
        # A vision-language backbone: a text-only batch, no image in it.
        ("qwen3_5_0.8b", "Qwen3_5CausalLM", {"token_ids": (8, 16), "padding_mask": (8, 16),
                                             "pixel_values": (8, 0, 2, 16, 16, 3), "image_grid_thw": (8, 0, 3),
                                             "vision_indices": (8, 0)}),
    ],
)
def test_a_job_is_the_task_a_load_builds_with_a_text_batch(name, task, inputs):
    cls, config, _ = keras_hub_dist.presets.backbone_config(name, num_layers=1)
    job = abstract_job(cls, config, (2, 4))
    assert type(job.task).__name__ == task
    x, y, weights = programs.fit_batch(job, 8, 16)
    assert {k: spec.shape for k, spec in x.items()} == inputs
    for key, spec in x.items():
        assert spec.sharding.spec[0] == "batch", key
    assert y.shape == weights.shape == (8, 16)
    if name == "gemma4_2b":
        # Keras's train step takes it (compiling it as well costs the suite
        # 8 s more; benchmarks/sweep_plans.py compiles every fit plan). Its
        # program reads token ids, position ids, both media masks and the
        # labels (int32), padding mask and sample weights (bool); the empty
        # media hold no element and JAX drops them as unused.
        text = programs.lower_fit(job, 8, 16, "sgd").as_text()
        main = text[text.index("@main("):]
        signature = re.findall(r"tensor<(8x[^>]*)>", main[: main.index("{\n")])
        assert sorted(a for a in signature if a.startswith("8x16x")) == ["8x16xi1"] * 2 + ["8x16xi32"] * 5, signature


def test_a_drafter_fit_is_refused():
    cls, config, _ = keras_hub_dist.presets.backbone_config("gemma4_instruct_2b_assistant", num_layers=1)
    job = abstract_job(cls, config, (1, 8))
    with pytest.raises(PlanError, match=r"computes its own keys and values .*Received: Gemma4Backbone with "
                       r"num_kv_shared_layers=1 of num_layers=1 \(a drafter"):
        programs.fit_batch(job, 8, 16)


def test_a_backbone_input_that_is_not_text_is_refused(monkeypatch):
    cls, config, _ = keras_hub_dist.presets.backbone_config("gemma4_2b", num_layers=1)
    job = abstract_job(cls, config, (1, 8))
    named = programs._named_inputs(job.task.backbone)
    named["depth_map"] = keras.KerasTensor((None, None, None), dtype="float32")
    monkeypatch.setattr(programs, "_named_inputs", lambda backbone: named)
    with pytest.raises(PlanError, match=r"Expected a backbone whose fit batch is text .*Received: "
                       r"Gemma4Backbone, which also takes 'depth_map' of shape \(None, None, None\)"):
        programs.fit_batch(job, 8, 16)
