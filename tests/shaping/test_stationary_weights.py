"""`generate` computing with each block's weights where they are stored,
the batch whole and the heads over every mesh axis, where the mesh divides
the KV heads (`shaping.stationary_weights`).

Compile only (XLA's analysis of KerasHub's generate on abstract models, no
weight allocated); the tokens and logits of the real `generate` on every
mesh are tests/shaping/test_generate.py's (Gemma and Llama, 8 KV heads).
"""

import re

import jax
import keras_hub
import pytest

from keras_hub_dist.jobs import programs
from keras_hub_dist.jobs.abstract_job import abstract_job
from keras_hub_dist.plan import specs
from keras_hub_dist.shaping import stationary_weights

# 8 KV heads: a mesh of 8 divides them.
LLAMA = dict(
    vocabulary_size=256, num_layers=2, num_query_heads=16, num_key_value_heads=8,
    hidden_dim=256, intermediate_dim=512, dtype="float32",
)
GEMMA = dict(
    vocabulary_size=256, num_layers=2, num_query_heads=16, num_key_value_heads=8,
    hidden_dim=256, intermediate_dim=1024, head_dim=16, dtype="float32",
)
BACKBONES = {"llama": (keras_hub.models.LlamaBackbone, LLAMA), "gemma": (keras_hub.models.GemmaBackbone, GEMMA)}
# 4 KV heads: on (2, 4) the key kernel's heads axis splits them, the other
# axis the batch.
FOUR_KV_HEADS = {
    family: (cls, dict(config, num_key_value_heads=4)) for family, (cls, config) in BACKBONES.items()
}
BATCH, MAX_LENGTH = 8, 512


def test_the_heads_span_the_mesh_where_it_divides_them():
    Split = stationary_weights.Split
    mesh = jax.make_mesh((2, 4), ("batch", "model"))
    assert stationary_weights.heads_axes(8, mesh, "batch") == Split(("batch", "model"))
    assert stationary_weights.heads_axes(16, mesh, "batch", major="model") == Split(("model", "batch"))
    # Where the mesh does not divide the KV heads, the key kernel's heads
    # axis splits them and the other the batch, where it divides it.
    assert stationary_weights.heads_axes(4, mesh, "batch", batch_size=8) == Split(("batch",), ("model",))
    assert stationary_weights.heads_axes(4, mesh, "batch", major="model", batch_size=8) == Split(("model",), ("batch",))
    assert stationary_weights.heads_axes(4, mesh, "batch", batch_size=6) is None  # the batch stays on the data axis
    assert stationary_weights.heads_axes(4, mesh, "batch") is None
    assert stationary_weights.heads_axes(1, mesh, "batch", batch_size=8) is None
    assert stationary_weights.heads_axes(8, jax.make_mesh((1, 8), ("batch", "model")), "batch") is None
    all_data = {"batch": 8, "model": 1}
    assert stationary_weights.heads_axes(8, all_data, "batch") == Split(("batch", "model"))
    assert stationary_weights.heads_axes(4, all_data, "batch", major="model", batch_size=8) is None


@pytest.mark.parametrize("family, axis", [("llama", "batch"), ("gemma", "model")])
def test_the_kv_heads_axis_is_the_key_kernels(family, axis, clean_state):
    # Llama's map splits q / k / v's heads on the data axis, Gemma's on the
    # model axis: a device's heads are part of what its kernel shard computes.
    cls, config = BACKBONES[family]
    with clean_state():
        job = abstract_job(cls, config, (2, 4))
        with job.distribution.scope():
            assert stationary_weights.kv_heads_axis(job.task.backbone) == axis


def _generate(family, mesh, backbones=BACKBONES):
    cls, config = backbones[family]
    job = abstract_job(cls, config, mesh)
    lowered, _ = programs.lower_generate(job, BATCH, MAX_LENGTH, prompt_chunk=64, shard_batch=True)
    compiled = lowered.compile()
    gathered = set(re.findall(r"= \w+\[([\d,]*)\][^ ]* all-gather\(", compiled.as_text()))
    return job, lowered.as_text(), programs.program_memory(compiled)["total_bytes"], gathered


def _kernels_gathered_over_the_data_axis(job, mesh):
    """Each block kernel's shard shape with its data axis gathered: what a
    device holds when XLA gathers the kernel to compute a split batch."""
    sizes = dict(zip(("batch", "model"), mesh))
    shapes = set()
    for variable in job.task.backbone.weights:
        if "kernel" not in variable.path or "embedding" in variable.path:
            continue
        axes = job.distribution.get_variable_layout(variable).axes
        kept = [tuple(a for a in specs.entry_axes(entry) if a != "batch") or None for entry in axes]
        shapes.add(",".join(map(str, specs.shard_shape(tuple(variable.shape), kept, sizes))))
    return shapes


@pytest.mark.parametrize("family", list(BACKBONES))
@pytest.mark.parametrize("mesh", [(2, 4), (8, 1)])
def test_generate_moves_activations_not_weights(family, mesh, monkeypatch, clean_state):
    """Where the data axis is over 1, `generate` used to gather each block's
    weights over it for every prompt chunk and decode step (Llama-3-8B
    width, 32 layers, 8 x 1024 on (2, 4): 7,253 MiB against (1, 8)'s
    6,384). With the weights where they are stored, no kernel is gathered
    and a device holds no more than on (1, 8)."""
    with clean_state():
        _, _, one_by_eight, _ = _generate(family, (1, 8))
        job, text, total, gathered = _generate(family, mesh)
        kernels = _kernels_gathered_over_the_data_axis(job, mesh)
        monkeypatch.setattr(stationary_weights, "heads_axes", lambda *args, **kwargs: None)
        _, weights_text, weights_total, weights_gathered = _generate(family, mesh)
    # The KV cache: every batch row, the heads over both axes, the axis that
    # splits the key kernel's heads first.
    major = {"llama": "batch", "gemma": "model"}[family]
    heads = "{" + ", ".join(f'"{a}"' for a in (major, *({"batch", "model"} - {major}))) + "}"
    assert f"<@mesh, [{{}}, {{?}}, {{?}}, {{?}}, {heads}, {{?}}]>" in text
    # Each block's weights read after its input, as where they are gathered:
    # what XLA computes from them stays in the loops (2 blocks x 2 loops).
    assert text.count("optimization_barrier") == weights_text.count("optimization_barrier") == 4
    assert not gathered & kernels, gathered & kernels
    assert weights_gathered & kernels  # the test can fail: those shapes are kernels'
    # Measured, total per device against (1, 8)'s: Llama (2, 4) 0.965x,
    # (8, 1) 0.998x; Gemma 1.004x / 1.003x, a few small activations moved
    # at this toy width (real widths: BENCHMARKS.md). With the weights
    # gathered: Llama 1.007x / 1.27x, Gemma 1.08x / 1.29x.
    assert total <= {"llama": 1.0, "gemma": 1.005}[family] * one_by_eight, (total, one_by_eight)
    assert total < weights_total, (total, weights_total)


@pytest.mark.parametrize("family", list(BACKBONES))
def test_few_kv_heads_split_the_batch_in_the_attention(family, monkeypatch, clean_state):
    """4 KV heads on (2, 4): the axis that splits the key kernel's heads
    splits the cache's and the attention's heads, the other axis their
    batch, and the projections still compute with their weights where they
    are stored. Qwen-3-30B-A3B width, 2 layers, 8 x 1024: 1,809 -> 1,706
    MiB per device ((1, 8): 1,925); Qwen 2.5 7B 1,297 -> 1,255 (2,033)."""
    mesh = (2, 4)
    with clean_state():
        _, _, one_by_eight, _ = _generate(family, (1, 8), FOUR_KV_HEADS)
        job, text, total, gathered = _generate(family, mesh, FOUR_KV_HEADS)
        kernels = _kernels_gathered_over_the_data_axis(job, mesh)
        cache_bytes = programs.kv_cache_bytes(job, BATCH, MAX_LENGTH)
        monkeypatch.setattr(stationary_weights, "heads_axes", lambda *args, **kwargs: None)
        _, _, weights_total, weights_gathered = _generate(family, mesh, FOUR_KV_HEADS)
    major, minor = {"llama": ("batch", "model"), "gemma": ("model", "batch")}[family]
    assert f'<@mesh, [{{"{minor}"}}, {{?}}, {{?}}, {{?}}, {{"{major}"}}, {{?}}]>' in text
    config = FOUR_KV_HEADS[family][1]
    head_dim = config.get("head_dim") or config["hidden_dim"] // config["num_query_heads"]
    sizes = dict(zip(("batch", "model"), mesh))
    rows, heads = BATCH // sizes[minor], 4 // sizes[major]
    assert cache_bytes == rows * config["num_layers"] * 2 * MAX_LENGTH * heads * head_dim * 4
    assert not gathered & kernels, gathered & kernels
    assert weights_gathered & kernels
    # Measured against (1, 8)'s total: Llama 0.86x, Gemma 0.97x.
    assert total <= one_by_eight, (total, one_by_eight)
    assert total < weights_total, (total, weights_total)
