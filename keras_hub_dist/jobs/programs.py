"""The programs a job runs, lowered on abstract values, and what XLA says of them.

`lower_fit` lowers Keras's own JAX train step (`model.train_step`, jitted
exactly as `Trainer.make_train_function` jits it: the state donated, its
output shardings those of the variables) on `jax.ShapeDtypeStruct`s of the
job's variables, optimizer and metric state, and of one batch laid out as
Keras's `ModelParallel` lays out a batch (`distribution.get_data_layout`).
The optimizer and metric variables are built the way `fit` builds them
(`Trainer._symbolic_build`), without values: their layouts are those a
real `fit` gives them, and nothing is allocated. `program_memory` reads
XLA's memory analysis of the compiled program: the bytes of one device's
arguments, outputs, aliases and temporaries.

Tested equal, field by field, to the analysis of the program a real `fit`
compiles (tests/jobs/test_memory_plan.py).

Example:

```python
from keras_hub_dist.jobs import programs
from keras_hub_dist.jobs.abstract_job import abstract_job

job = abstract_job("gemma_7b_en", (1, 8), dtype="bfloat16", overrides={"num_layers": 1})
lowered = programs.lower_fit(job, batch_size=8, sequence_length=512, optimizer="adam")
programs.program_memory(lowered.compile())  # {'argument_bytes': ..., 'temp_bytes': ...}
```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import keras

from keras_hub_dist import _compat
from keras_hub_dist.errors import PlanError
from keras_hub_dist.jobs.abstract_job import AbstractJob, sharding_of
from keras_hub_dist.shaping import generate as load_generate
from keras_hub_dist.measure.memory import compiled_memory
from keras_hub_dist.shaping import stationary_weights
from keras_hub_dist.plan.sizes import itemsize

__all__ = [
    "fit_batch",
    "kv_cache_bytes",
    "lower_fit",
    "lower_generate",
    "optimizer_for",
    "program_memory",
    "variable_specs",
]


def optimizer_for(optimizer: Any) -> keras.optimizers.Optimizer:
    """A fresh Keras optimizer from a name (`"adam"`, `"adamw"`, ...) or an
    instance's config: a plan never builds (or changes) the caller's own.

    Raises:
        ValueError: A name Keras does not know (the message lists some).
    """
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return type(optimizer).from_config(optimizer.get_config())
    try:
        return keras.optimizers.get(optimizer)
    except ValueError:
        known = ["adam", "adamw", "adafactor", "lion", "sgd", "rmsprop", "adagrad"]
        raise ValueError(
            f"Unknown optimizer. Expected a keras.optimizers.Optimizer or one of "
            f"Keras's names, e.g. {known}. Received: optimizer={optimizer!r}."
        ) from None


def variable_specs(variables: Sequence[Any], job: AbstractJob) -> list[jax.ShapeDtypeStruct]:
    """One `jax.ShapeDtypeStruct` per variable, in its (final) sharding."""
    return [
        jax.ShapeDtypeStruct(
            tuple(int(d) for d in v.shape), v.dtype, sharding=sharding_of(v, job.distribution)
        )
        for v in variables
    ]


def fit_batch(job: AbstractJob, batch_size: int, sequence_length: int) -> tuple:
    """`(x, y, sample_weight)` of one batch, as a causal LM's preprocessor
    gives it and Keras's `ModelParallel` lays it out (batch on the data axis)."""

    def spec(dtype: str, shape: tuple[int, ...] = (batch_size, sequence_length)) -> jax.ShapeDtypeStruct:
        layout = job.distribution.get_data_layout(shape)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=layout.backend_layout)

    x = {"token_ids": spec("int32"), "padding_mask": spec("bool")}
    backbone = job.task.backbone
    shared, layers = getattr(backbone, "num_kv_shared_layers", 0), getattr(backbone, "num_layers", 0)
    if shared and shared >= layers:
        # Gemma 4's assistants (drafters): every layer attends with the keys
        # and values of the model it drafts for, which a fit step lacks.
        raise PlanError(
            "Expected a backbone that computes its own keys and values to plan a "
            f"fit. Received: {type(backbone).__name__} with num_kv_shared_layers="
            f"{shared} of num_layers={layers} (a drafter: every layer reads the "
            'target model\'s cache); plan its job="generate" or job="load".'
        )
    # A multimodal backbone takes its media as inputs too: a text-only batch
    # holds none of them, the arrays KerasHub's own preprocessors put in for
    # text (Qwen 3.5's `__call__`, Gemma 4's text-only dummies): no media
    # item, per-token position ids and masks of the text's length.
    for name, tensor in _named_inputs(backbone).items():
        if name in x:
            continue
        shape = _text_only_shape(name, tuple(tensor.shape), backbone, batch_size, sequence_length)
        if shape is None:
            raise PlanError(
                "Expected a backbone whose fit batch is text (token ids, padding "
                "mask, position ids, empty media). Received: "
                f"{type(backbone).__name__}, which also takes {name!r} of shape "
                f"{tuple(tensor.shape)}: its fit is not planned; plan its "
                'job="generate" or job="load".'
            )
        x[name] = spec(tensor.dtype, shape)
    return x, spec("int32"), spec("bool")


# Per-token inputs of a text batch: the sequence's length.
_PER_TOKEN = ("position_ids", "vision_mask", "audio_mask")
# Media inputs: none in a text batch (batch x 0 items x ...).
_MEDIA = (
    "pixel_values", "pixel_position_ids", "image_grid_thw", "vision_indices",
    "audio_mel", "audio_mel_mask", "audio_indices",
)


def _text_only_shape(
    name: str, shape: tuple, backbone: Any, batch_size: int, sequence_length: int
) -> tuple[int, ...] | None:
    """The shape of input `name` in a batch of text only; None: not known."""
    if name in _PER_TOKEN and len(shape) == 2:
        return (batch_size, sequence_length)
    if name not in _MEDIA or len(shape) < 2:
        return None
    rest = [1 if size is None else size for size in shape[2:]]
    if name == "pixel_values" and shape[-1] is None:
        # Flattened RGB patches (Gemma 4): what the vision encoder's patch
        # projection reads, even for zero images.
        patch = getattr(getattr(backbone, "vision_encoder", None), "patch_size", None)
        if patch is None:
            return None
        rest[-1] = 3 * patch * patch
    return (batch_size, 0, *rest)


def _named_inputs(backbone: Any) -> dict[str, Any]:
    inputs = getattr(backbone, "input", None)
    return dict(inputs) if isinstance(inputs, dict) else {}


def lower_fit(job: AbstractJob, batch_size: int, sequence_length: int, optimizer: Any) -> jax.stages.Lowered:
    """Keras's JAX train step for one batch, lowered on abstract values.

    Compiles the task (KerasHub's default loss and weighted metrics) with
    `optimizer`, builds the optimizer's moments and the metric variables
    without values,
    and lowers `jax.jit(task.train_step, donate_argnums=0, out_shardings=
    (None, state shardings))`, as Keras's `make_train_function` does.
    """
    task = job.task
    data = fit_batch(job, batch_size, sequence_length)
    # The optimizer's and the metrics' scalars (step count, learning rate,
    # loss tracker), made when they are constructed, get no value either.
    with job.without_values():
        task.compile(optimizer=optimizer_for(optimizer))
    with job.scope():
        with _compat.creating_variables_without_values() as created:
            _compat.symbolic_build(task, data)
        job.lay_out(created)
        state = (
            variable_specs(task.trainable_variables, job),
            variable_specs(task.non_trainable_variables, job),
            variable_specs(task.optimizer.variables, job),
            variable_specs(task.metrics_variables, job),
        )
        shardings = jax.tree.map(lambda s: s.sharding, state)
        step = jax.jit(task.train_step, donate_argnums=0, out_shardings=(None, shardings))
        return step.lower(state, data)


def program_memory(compiled: Any) -> dict[str, int]:
    """XLA's per-device figures of one compiled program (bytes):
    `argument_bytes`, `output_bytes`, `alias_bytes`, `temp_bytes`, and
    `total_bytes` = arguments + outputs + temporaries - aliases (an output
    written into a donated argument's buffer is not counted twice)."""
    memory = compiled_memory(compiled)
    memory["total_bytes"] = (
        memory.get("argument_bytes", 0)
        + memory.get("output_bytes", 0)
        + memory.get("temp_bytes", 0)
        - memory.get("alias_bytes", 0)
    )
    return memory


def lower_generate(
    job: AbstractJob, batch_size: int, max_length: int, *, prompt_chunk: int | None, shard_batch: bool
) -> tuple[jax.stages.Lowered, int | None]:
    """KerasHub's generate program for one batch, lowered on abstract values,
    and the KV cache's bytes per device where this package lays it out.

    The task generates as `load_sharded_preset(..., task="causal_lm")`
    returns it (`shard_generate(prompt_chunk=..., shard_batch=...)`; `None`
    and `False`: stock), with KerasHub's default sampler; `lower_generate`
    of `shaping.generate` lowers the very jitted function `generate` calls.
    """
    task = job.task
    with job.scope():
        load_generate.shard_generate(task, prompt_chunk=prompt_chunk, shard_batch=shard_batch)
        lowered = load_generate.lower_generate(task, batch_size, max_length)
    return lowered, kv_cache_bytes(job, batch_size, max_length) if shard_batch else None


def kv_cache_bytes(job: AbstractJob, batch_size: int, max_length: int) -> int | None:
    """Per-device bytes of the stacked KV cache `[B, layers, 2, S, kv_heads,
    head_dim]` the stacked-cache causal LMs build, split as `shard_generate`
    constrains it (`shaping/generate.py`'s `_constrain_cache`): the batch over
    the data axis and the KV heads over the model axis, each where it
    divides, and with fewer KV heads than the model axis their head
    dimension there; where the data axis is over 1 and a mesh axis divides
    the KV heads, the heads over the axes that divide them and the batch
    over the others (`shaping/stationary_weights.py`). `None` for another
    cache."""
    task = job.task
    if not load_generate.has_stacked_cache(task):
        return None
    backbone = task.backbone
    heads = backbone.num_key_value_heads
    head_dim = getattr(backbone, "head_dim", None) or backbone.hidden_dim // backbone.num_query_heads
    sizes = job.mesh_axis_sizes
    with job.scope():
        split = stationary_weights.backbone_split(backbone, sizes, next(iter(sizes)), batch_size)
    if split is not None:
        rows = batch_size // math.prod(sizes[a] for a in split.batch)
        heads //= math.prod(sizes[a] for a in split.heads)
    else:
        data, model = sizes.values()
        rows = batch_size // data if batch_size % data == 0 else batch_size
        if heads % model == 0:
            heads //= model
        elif head_dim % model == 0:
            head_dim //= model
    elements = rows * backbone.num_layers * 2 * max_length * heads * head_dim
    return elements * itemsize(keras.backend.standardize_dtype(task.compute_dtype))
