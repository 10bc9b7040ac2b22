"""Generate with the prompt in chunks and the batch on the batch axis:
`shard_generate`, and the program `generate` runs, lowered: `lower_generate`.

KerasHub's `CausalLM.generate` seeds its KV cache with one pass over all
`max_length` positions (`_build_cache` -> `call_with_cache(token_ids, cache,
0)`), so every layer materializes f32 attention scores `[B, H, S, S]`; and on
a mesh with a batch axis the cache and activations are not split over it
(every batch row on every device). `shard_generate` changes both, per
instance, leaving the task's class, config and `generate` API as they are:

1. the prompt pass runs `prompt_chunk` positions at a time inside one
   `jax.lax.fori_loop` (plus one static remainder chunk), each chunk
   attending to the whole cache, so scores are `[B, H, chunk, S]`; the
   cache is the same zero-initialized cache stock builds (stock's own
   `_build_cache` allocates it), the returned `(hidden_states, cache)` the
   same values (Gemma 3 / 4: a text prompt, each chunk with the padding
   mask stock's pass takes);
2. `jax.lax.with_sharding_constraint` puts the batch dimension of the token
   ids, padding mask, KV cache and hidden states on the distribution's data
   axis (where it divides the batch) and the cache's KV-heads dimension on
   the model axis (where it divides the heads); every other dimension is
   left to XLA. Where the data axis is over 1 and a mesh axis divides the
   KV heads, the batch is whole instead and the cache's KV heads are split
   over the axes that divide them (its batch over the others): each block
   then computes with its weights where they are stored
   (`shaping/stationary_weights.py`; Llama-3-8B width, 32 layers, 8 x 1024 on
   (2, 4): 7,253 -> 6,137 MiB per device, (1, 8): 6,384).

`load_sharded_preset(..., task="causal_lm")` applies it by default
(`prompt_chunk=512`). Measured with XLA's compiled memory analysis
(benchmarks/bench_generate.py, 2026-11-27: 8 simulated CPU devices, bf16,
abstract models, compile only, per device):

- Gemma-7B width, 2 layers, batch 8 x max_length 8192, mesh (1, 8):
  temporaries 13,950.7 MiB stock -> 2,373.2 MiB ours (0.170x); the KV
  cache (512 MiB) and arguments (319.8 MiB) are the same.
- Llama-3-8B width, 1 layer, 8 x 2048: KV cache 16 MiB on (1, 8), (2, 4)
  and (8, 1) (stock: 64 MiB on (2, 4), 4x); temporaries 741 / 885 / 741
  MiB (stock 1,118 / 925 / 1,118). On (2, 4) the layout map shards the
  query heads over the batch axis too, so XLA still computes attention
  there with the heads, not the batch, on that axis (1.19x (1, 8)'s
  temporaries; the cache itself is split 8 ways).

Example:

```python
import keras_hub
import keras_hub_dist

lm = keras_hub.models.GemmaCausalLM.from_preset("gemma_2b_en")
keras_hub_dist.shard_generate(lm, prompt_chunk=256)   # in place; returns lm
lm.generate("The capital of France is", max_length=1024)
lowered = keras_hub_dist.lower_generate(lm, batch_size=8, max_length=1024)
lowered.compile().memory_analysis().temp_size_in_bytes
keras_hub_dist.shard_generate(lm, prompt_chunk=None, shard_batch=False)  # stock again
```
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
import weakref
from typing import Any

import jax
import jax.numpy as jnp
import keras
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.errors import GenerateFallbackWarning
from keras_hub_dist.shaping import stationary_weights
from keras_hub_dist.shaping.batch_axis import constrain_where_divisible

__all__ = [
    "DEFAULT_PROMPT_CHUNK",
    "SUPPORTED_CAUSAL_LMS",
    "STACKED_CACHE_LMS",
    "TEXT_CHUNKED_LMS",
    "check_prompt_chunk",
    "has_stacked_cache",
    "lower_generate",
    "shard_generate",
    "supports_chunked_prompt",
]

# 512 positions: a chunk's scores are `[B, H, 512, S]` f32 (Gemma-7B width,
# batch 8, S = 8192, 2 heads per device on 8: 256 MiB per layer against
# stock's 4 GiB), while each chunk's matmuls still have B x 512 rows, enough
# to keep an accelerator's matrix units busy; S / 512 loop steps (16 at
# 8192) cost nothing next to the decode loop's S steps. Measured there
# (2 layers, (1, 8), temporaries per device): chunks of 256 / 512 / 1024 /
# 2048 positions 1,922 / 2,373 / 3,111 / 4,696 MiB (stock 13,951): below
# 512 the fixed part (the 512 MiB cache, the sampler's logits) dominates
# and halving the chunk saves under a fifth. Prompts up to 512 positions
# run exactly as stock.
DEFAULT_PROMPT_CHUNK = 512

# The causal LMs whose `_build_cache(self, token_ids)` zero-initializes one
# stacked cache `[B, layers, 2, S, kv_heads, head_dim]` and seeds it with
# `call_with_cache(token_ids, cache, 0)`, and whose attention masks a query
# block starting at `cache_update_index` against the whole cache (causal and
# sliding-window masks offset by the index): read in KerasHub 0.32's source
# and checked against stock, chunk by chunk (tests/shaping/test_generate.py,
# Gemma and Llama; the others by benchmarks/bench_generate.py --check).
# Gemma2 is `GemmaCausalLM`, Llama 3 a `LlamaCausalLM`. Their cache's
# heads are laid out with the weights (`shaping/stationary_weights.py`).
STACKED_CACHE_LMS = (
    "GemmaCausalLM",
    "LlamaCausalLM",
    "Llama3CausalLM",
    "MistralCausalLM",
    "MixtralCausalLM",
    "QwenCausalLM",
    "QwenMoeCausalLM",
    "Qwen3CausalLM",
    "Qwen3MoeCausalLM",
    "GptOssCausalLM",
)

# Gemma 3 and 4 seed their cache (Gemma 3: a per-layer tuple of `[B, S,
# kv_heads, head_dim]` pairs; Gemma 4: one stacked cache as wide as its
# widest head) with `_build_cache(token_ids, img_embeddings, vision_mask,
# padding_mask, vision_indices, ...)`, which calls `call_with_cache` with the
# padding mask; their masks are offset by `cache_update_index` as above,
# and a KV-shared layer reads its source layer's cache after that layer's
# update. A text prompt (no image or audio) runs in chunks, each with the
# whole padding mask (the rows of stock's masks); a prompt with media keeps
# stock's pass (images attend to each other both ways across chunks).
TEXT_CHUNKED_LMS = ("Gemma3CausalLM", "Gemma4CausalLM")

# Every causal LM whose prompt pass runs in chunks. PaliGemma, Gemma 3n and
# Qwen 3.5 (whose linear-attention layers carry a recurrent state) keep
# stock's prompt pass, with a `GenerateFallbackWarning`; so do GPT-2, OPT,
# Bloom, Falcon, GPT-NeoX, Phi-3 and SmolLM3, which have the right shape
# but were not checked (their position embeddings and masks unread).
SUPPORTED_CAUSAL_LMS = STACKED_CACHE_LMS + TEXT_CHUNKED_LMS

# Stands for "the data axis" in `_constrain`'s dims (its name is known only
# when `generate` traces, under the distribution then active).
_DATA = "<data axis>"

# The instance attributes `shard_generate` sets, shadowing the class's methods.
_PATCHED = ("_build_cache", "call_with_cache", "generate_step")


@dataclasses.dataclass(frozen=True)
class _Settings:
    prompt_chunk: int | None
    shard_batch: bool
    data_axis: str | None
    model_axis: str


def supports_chunked_prompt(causal_lm: Any) -> bool:
    """Whether `causal_lm`'s prompt pass can run in chunks (a text prompt,
    for Gemma 3 / 4).

    True when both `_build_cache` and `call_with_cache` are those of a class
    in `SUPPORTED_CAUSAL_LMS` (a subclass overriding either is not).
    """
    return _cache_methods_of(causal_lm, SUPPORTED_CAUSAL_LMS)


def has_stacked_cache(causal_lm: Any) -> bool:
    """Whether `causal_lm` builds one stacked `[B, layers, 2, S, kv_heads,
    head_dim]` cache from its token ids alone (`STACKED_CACHE_LMS`)."""
    return _cache_methods_of(causal_lm, STACKED_CACHE_LMS)


def _cache_methods_of(causal_lm: Any, class_names: tuple[str, ...]) -> bool:
    for name in ("_build_cache", "call_with_cache"):
        owner = next((c for c in type(causal_lm).__mro__ if name in c.__dict__), None)
        if owner is None or owner.__name__ not in class_names:
            return False
    return True


def check_prompt_chunk(prompt_chunk: Any) -> None:
    """Raises `ValueError` unless `prompt_chunk` is a positive int or None."""
    if prompt_chunk is not None and (
        isinstance(prompt_chunk, bool)
        or not isinstance(prompt_chunk, (int, np.integer))
        or prompt_chunk < 1
    ):
        raise ValueError(
            "Expected prompt_chunk to be a positive int (prompt positions per "
            f"step) or None (stock's single pass). Received: prompt_chunk={prompt_chunk!r}."
        )


def shard_generate(
    causal_lm: Any,
    prompt_chunk: int | None = DEFAULT_PROMPT_CHUNK,
    *,
    shard_batch: bool = True,
    data_axis: str | None = None,
    model_axis: str = "model",
) -> Any:
    """Makes `causal_lm.generate` chunk its prompt pass and split its batch.

    Changes the instance in place (its class, config and saved form stay
    KerasHub's): `_build_cache`, `call_with_cache` and `generate_step` are
    shadowed by wrappers of the class's own methods, and the compiled
    `generate_function` is reset so the next `generate` traces them. Calling
    it again replaces the previous settings; `prompt_chunk=None,
    shard_batch=False` restores stock.

    Args:
        causal_lm: A `keras_hub.models.CausalLM`.
        prompt_chunk: Prompt positions per step of the prompt pass (a
            positive int), or `None` for stock's single pass. A `max_length`
            up to `prompt_chunk` runs exactly as stock. A causal LM not in
            `SUPPORTED_CAUSAL_LMS`, and a Gemma 3 / 4 prompt with images or
            audio, keep stock's pass, with a `GenerateFallbackWarning`.
        shard_batch: Constrain the batch dimension of the token ids, padding
            mask, KV cache and hidden states to the data axis, and the
            cache's KV-heads dimension to the model axis, under the Keras
            distribution active when `generate` traces (none: no effect);
            where the mesh divides the KV heads and its data axis is over
            1, the batch whole and the KV heads over every axis instead.
        data_axis: The mesh axis of the batch; default: the distribution's
            `batch_dim_name`.
        model_axis: The mesh axis the KV heads are split over.

    Returns:
        `causal_lm`, changed in place.

    Raises:
        TypeError: `causal_lm` is not a KerasHub `CausalLM`.
        ValueError: `prompt_chunk` is not a positive int or `None`.

    Example:

    >>> lm = keras_hub_dist.shard_generate(lm, prompt_chunk=256)
    """
    import keras_hub

    if not isinstance(causal_lm, keras_hub.models.CausalLM):
        raise TypeError(
            "Expected a keras_hub.models.CausalLM (e.g. load_sharded_preset(..., "
            f"task='causal_lm')). Received: {type(causal_lm).__name__}."
        )
    check_prompt_chunk(prompt_chunk)
    if prompt_chunk is not None and not supports_chunked_prompt(causal_lm):
        warnings.warn(
            f"{type(causal_lm).__name__} keeps stock KerasHub's prompt pass over all "
            f"max_length positions at once: expected one of {list(SUPPORTED_CAUSAL_LMS)} "
            "(one stacked cache seeded by call_with_cache(token_ids, cache, index)). "
            f"Received: {type(causal_lm).__name__}. Its batch is still split "
            "(shard_batch) where its cache has that shape.",
            GenerateFallbackWarning,
            stacklevel=2,
        )
        prompt_chunk = None
    for name in _PATCHED:
        causal_lm.__dict__.pop(name, None)
    settings = _Settings(
        None if prompt_chunk is None else int(prompt_chunk), bool(shard_batch), data_axis, model_axis
    )
    if settings.prompt_chunk is not None or settings.shard_batch:
        lm_ref = weakref.ref(causal_lm)  # no cycle through the instance's own attributes
        # Plain instance attributes, set past Keras's attribute tracking
        # (a function is nothing it tracks), rather than a made-up subclass:
        # `type(lm)` stays the registered KerasHub class, so `get_config`,
        # `save_to_preset` (task.json names the class) and type checks are
        # stock's, and `prompt_chunk=None, shard_batch=False` undoes it.
        causal_lm.__dict__.update(
            _build_cache=lambda *a, **k: _build_cache(lm_ref(), settings, *a, **k),
            call_with_cache=lambda *a, **k: _call_with_cache(lm_ref(), settings, *a, **k),
            generate_step=lambda inputs, stop_token_ids=None: _generate_step(
                lm_ref(), settings, inputs, stop_token_ids
            ),
        )
    causal_lm.generate_function = None  # stock's compiled program traced the old methods
    return causal_lm


def lower_generate(
    causal_lm: Any,
    batch_size: int,
    max_length: int,
    *,
    stop_token_ids: Any = None,
) -> jax.stages.Lowered:
    """The program `causal_lm.generate` runs, lowered on abstract values.

    Exactly KerasHub's jitted `compiled_generate_function` of
    `causal_lm.make_generate_function()` (the one `generate` calls, with
    whatever `shard_generate` changed), lowered with `jax.ShapeDtypeStruct`s:
    each variable's shape, dtype and sharding (a loaded array's own, or for
    a variable without a value, e.g. an abstract backbone's, the layout the
    active distribution gives it), and the token ids / padding mask with
    the data layout `generate` puts them in. Nothing is allocated or read.

    Args:
        causal_lm: A KerasHub `CausalLM` on the JAX backend, not
            `run_eagerly`.
        batch_size: Rows per `generate` batch.
        max_length: `generate`'s `max_length` (the padded prompt length).
        stop_token_ids: As `generate` receives them (a tuple, or `None`).

    Returns:
        The `jax.stages.Lowered`; `.compile().memory_analysis()` gives the
        per-device argument / output / temporary bytes.

    Raises:
        TypeError: Not a `CausalLM`, or a `generate_function` that is not
            KerasHub's JAX program (another backend, `run_eagerly`).
        ValueError: `batch_size` or `max_length` not a positive int.
    """
    import keras_hub

    if not isinstance(causal_lm, keras_hub.models.CausalLM):
        raise TypeError(
            f"Expected a keras_hub.models.CausalLM. Received: {type(causal_lm).__name__}."
        )
    for name, value in (("batch_size", batch_size), ("max_length", max_length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"Expected {name} to be a positive int. Received: {name}={value!r}.")
    wrapped = causal_lm.make_generate_function()
    names = getattr(getattr(wrapped, "__code__", None), "co_freevars", ())
    if "compiled_generate_function" not in names:
        raise TypeError(
            "Expected KerasHub's jitted JAX generate program (JAX backend, "
            f"run_eagerly=False). Received: generate_function={wrapped!r}."
        )
    jitted = wrapped.__closure__[names.index("compiled_generate_function")].cell_contents
    if isinstance(stop_token_ids, list):
        stop_token_ids = tuple(stop_token_ids)
    shape = (int(batch_size), int(max_length))
    data = _data_sharding(shape)
    inputs = {
        "token_ids": jax.ShapeDtypeStruct(shape, jnp.int32, sharding=data),
        "padding_mask": jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=data),
    }
    state = (
        [_abstract(v) for v in causal_lm.sampler.variables],
        [_abstract(v) for v in causal_lm.trainable_variables],
        [_abstract(v) for v in causal_lm.non_trainable_variables],
    )
    return jitted.lower(inputs, stop_token_ids, state)


def _abstract(variable: Any) -> jax.ShapeDtypeStruct:
    array = _compat.variable_array(variable)
    if isinstance(array, jax.Array):
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=array.sharding)
    layout = _compat.pending_layout(variable)
    sharding = getattr(layout, "backend_layout", layout)
    dtype = keras.backend.standardize_dtype(variable.dtype)
    return jax.ShapeDtypeStruct(tuple(variable.shape), jnp.dtype(dtype), sharding=sharding)


def _data_sharding(shape: tuple[int, ...]) -> Any:
    # What stock `generate`'s `distribute` puts each input in.
    distribution = keras.distribution.distribution()
    layout = None if distribution is None else distribution.get_data_layout(shape)
    return None if layout is None else layout.backend_layout


def _mesh_axes(settings: _Settings) -> tuple[Any, str | None] | None:
    distribution = keras.distribution.distribution()
    if not settings.shard_batch or distribution is None:
        return None
    mesh = distribution.device_mesh.backend_mesh
    data_axis = settings.data_axis or getattr(distribution, "batch_dim_name", None)
    return mesh, data_axis


def _model_size(settings: _Settings) -> int:
    found = _mesh_axes(settings)
    return 1 if found is None else found[0].shape.get(settings.model_axis, 1)


def _constrain(x: Any, settings: _Settings, dims: dict[int, str | None]) -> Any:
    """`x` with `dims` (dimension -> mesh axis) constrained where the axis
    divides the dimension; every other dimension left to XLA. Only under a
    trace: an eager value keeps the placement it has."""
    found = _mesh_axes(settings)
    if found is None or not isinstance(x, jax.core.Tracer):
        return x
    mesh, data_axis = found
    return constrain_where_divisible(
        x, mesh, {dim: data_axis if axis == _DATA else axis for dim, axis in dims.items()}
    )


def _stationary_axes(lm: Any, settings: _Settings, batch_size: int) -> stationary_weights.Split | None:
    """How `lm`'s blocks split their attention (`batch_size` rows) while
    computing with their weights where they are stored
    (`shaping/stationary_weights.py`), or None."""
    found = _mesh_axes(settings)
    if found is None or not has_stacked_cache(lm):
        return None
    return stationary_weights.backbone_split(lm.backbone, *found, batch_size)


def _constrain_batch(lm: Any, settings: _Settings, x: Any) -> Any:
    """`x` with its batch on the data axis, or whole where `lm`'s blocks
    compute with their weights where they are stored."""
    if not isinstance(x, jax.core.Tracer) or _stationary_axes(lm, settings, x.shape[0]) is None:
        return _constrain(x, settings, {0: _DATA})
    return stationary_weights.batch_whole(x, _mesh_axes(settings)[0])


def _constrain_cache(lm: Any, settings: _Settings, cache: Any) -> Any:
    if not hasattr(cache, "ndim"):  # a per-layer tuple (Gemma 3): batch only
        return jax.tree.map(lambda c: _constrain(c, settings, {0: _DATA}), cache)
    dims = {0: _DATA}
    heads = getattr(lm.backbone, "num_key_value_heads", None)
    if cache.ndim == 6 and cache.shape[2] == 2 and cache.shape[4] == heads:  # [B, layers, 2, S, kv_heads, head_dim]
        split = _stationary_axes(lm, settings, cache.shape[0])
        if split is not None and isinstance(cache, jax.core.Tracer):
            # Each block computes with its weights where they are stored
            # (`shaping/stationary_weights.py`): every batch row, its share of
            # the KV heads.
            return stationary_weights.heads_over_the_mesh(cache, _mesh_axes(settings)[0], split, heads_dim=4)
        dims[4] = settings.model_axis
        if cache.shape[4] % _model_size(settings):
            # Fewer KV heads than the model axis (one: Gemma 2B, Gemma 4's
            # drafters): their head dimension on it, as XLA lays it out on
            # (1, 8); on (2, 4) it left it whole, 4x the cache's share.
            dims[5] = settings.model_axis
    return _constrain(cache, settings, dims)


def _call_with_cache(lm: Any, settings: _Settings, token_ids: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
    token_ids = _constrain_batch(lm, settings, token_ids)
    cache = _constrain_cache(lm, settings, cache)
    # The blocks' wrappers (`shaping/batch_axis.py`) read it while they trace.
    token = stationary_weights.HEADS_AXES.set(_stationary_axes(lm, settings, token_ids.shape[0]))
    try:
        logits, hidden_states, cache = type(lm).call_with_cache(lm, token_ids, cache, *args, **kwargs)
    finally:
        stationary_weights.HEADS_AXES.reset(token)
    hidden_states = _constrain_batch(lm, settings, hidden_states)
    return logits, hidden_states, _constrain_cache(lm, settings, cache)


def _generate_step(lm: Any, settings: _Settings, inputs: Any, stop_token_ids: Any) -> Any:
    if isinstance(inputs, dict):
        inputs = {
            k: _constrain_batch(lm, settings, v) if k in ("token_ids", "padding_mask") else v
            for k, v in inputs.items()
        }
    return type(lm).generate_step(lm, inputs, stop_token_ids)


def _build_cache(lm: Any, settings: _Settings, token_ids: Any, *args: Any, **kwargs: Any) -> Any:
    stock = type(lm)._build_cache
    chunk = settings.prompt_chunk
    length = token_ids.shape[1]
    seed = None if chunk is None or length <= chunk else _text_seed(lm, stock, token_ids, args, kwargs)
    if seed is None:
        return stock(lm, token_ids, *args, **kwargs)
    # The zero cache exactly as stock allocates it (its shape and dtype
    # rules differ per family): stock's own `_build_cache`, its seeding
    # call answered with the cache it was handed.
    call = lm.__dict__["call_with_cache"]
    lm.__dict__["call_with_cache"] = lambda *a, **k: (None, None, k["cache"] if "cache" in k else a[1])
    try:
        _, cache = stock(lm, token_ids, *args, **kwargs)
    finally:
        lm.__dict__["call_with_cache"] = call
    cache = _constrain_cache(lm, settings, cache)
    full, remainder = divmod(length, chunk)
    first = jax.lax.slice_in_dim(token_ids, 0, chunk, axis=1)
    # Shapes only (a trace, no computation): the buffer the chunks' hidden
    # states go into, unused by most samplers and then dropped by XLA.
    out = jax.eval_shape(lambda ids, c, s: call(ids, c, 0, **s)[1], first, cache, seed)
    hidden = jnp.zeros((out.shape[0], length) + out.shape[2:], out.dtype)
    hidden = _constrain_batch(lm, settings, hidden)

    def step(i: Any, carry: tuple[Any, Any]) -> tuple[Any, Any]:
        hidden, cache = carry
        start = i * chunk
        ids = jax.lax.dynamic_slice_in_dim(token_ids, start, chunk, axis=1)
        _, h, cache = call(ids, cache, start, **seed)
        return jax.lax.dynamic_update_slice_in_dim(hidden, h.astype(hidden.dtype), start, axis=1), cache

    # One traced body for all full chunks: compile time and program size do
    # not grow with max_length / chunk.
    hidden, cache = jax.lax.fori_loop(0, full, step, (hidden, cache))
    if remainder:
        start = full * chunk
        ids = jax.lax.slice_in_dim(token_ids, start, length, axis=1)
        _, h, cache = call(ids, cache, start, **seed)
        hidden = jax.lax.dynamic_update_slice_in_dim(hidden, h.astype(hidden.dtype), start, axis=1)
    return hidden, cache


def _text_seed(lm: Any, stock: Any, token_ids: Any, args: tuple, kwargs: dict) -> dict | None:
    """What each chunk's `call_with_cache` takes besides the token ids, the
    cache and the index: nothing for `STACKED_CACHE_LMS` (their
    `_build_cache(token_ids)`), the padding mask for a Gemma 3 / 4 text
    prompt; None (stock's pass) for a prompt with images or audio."""
    if not args and not kwargs:
        return {}
    bound = inspect.signature(stock).bind(lm, token_ids, *args, **kwargs)
    bound.apply_defaults()
    media = {k: v for k, v in list(bound.arguments.items())[2:] if k != "padding_mask" and v is not None}
    if media:
        warnings.warn(
            f"{type(lm).__name__} runs a prompt with {sorted(media)} in stock's single "
            "pass over all max_length positions: expected a text prompt (no image or "
            "audio) to run it in chunks of prompt_chunk positions. Received: a prompt "
            "with media, whose tokens attend to each other across chunks.",
            GenerateFallbackWarning,
            stacklevel=2,
        )
        return None
    mask = bound.arguments.get("padding_mask")
    return {} if mask is None else {"padding_mask": mask}
