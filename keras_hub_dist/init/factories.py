"""KerasHub backbones whose token embedding is created directly in its shards.

Each factory returns the real KerasHub backbone class, built from a named
architecture or a config, with `token_embedding.embeddings_initializer`
(and, for Gemma 4, `per_layer_token_embedding.embeddings_initializer`)
replaced by its distributed twin
(`keras_hub_dist.initializers.distributed_like`: same class statistics, same
seed, same values). Nothing is patched: the backbone is constructed with its
variables left without values (inside a `keras.StatelessScope`), the
embedding variables' pending initializers are swapped for the twins, and then
every variable is initialized under the active distribution: each one with a
Keras random initializer (the embedding and every kernel) through the twin of
that initializer, straight into its shards; each one with a Keras `Zeros`,
`Ones` or `Constant` initializer (norm scales, biases, Gemma 4's expert
banks) filled straight into its layout; any other (a custom initializer)
through Keras's own deferred path. So no weight is ever generated only to be
thrown away, and no class, registry entry or Keras global is left changed,
whether the factory returns or raises.

The backbone saves with `save_to_preset` and reloads with the stock
`keras_hub.models.Backbone.from_preset` (its config is the stock one).

Factories: `gemma_backbone` (Gemma, Gemma 2), `gemma3_backbone`,
`gemma4_backbone`, `llama_backbone` (Llama 2, Llama 3), `mistral_backbone`,
`mixtral_backbone`, `qwen_backbone` (Qwen 2.5), `qwen3_backbone`,
`qwen3_moe_backbone`, `qwen3_5_backbone`, `qwen3_5_moe_backbone` and
`gpt_oss_backbone`. Like `gemma3_backbone` (whose named architectures are
the text-only ones), the Gemma 4 and Qwen 3.5 factories build the text-only
model by default: the config's vision (and audio) encoder is dropped unless
`text_only=False` is passed. Every factory takes `remat=` (`None`, a
`keras.RematScope` mode or scope): a later `fit` rematerializes the
decoder blocks (`shaping.remat`).

Example:

```python
import keras
import keras_hub_dist

mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"))
layout_map = keras_hub_dist.get_layout_map("gemma_7b_en", mesh)
distribution = keras.distribution.ModelParallel(
    layout_map=layout_map, batch_dim_name="batch"
)
with distribution.scope():
    backbone = keras_hub_dist.gemma_backbone(
        "gemma_7b_en", num_layers=2, dtype="bfloat16"
    )
```
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_hub_dist import _compat
from keras_hub_dist.init import initializers
from keras_hub_dist.init import registry
from keras_hub_dist.init.quantized import initialize_quantized
from keras_hub_dist.plan import presets
from keras_hub_dist.shaping.apply import build_shaped
from keras_hub_dist.shaping.remat import remat_scope
from keras_hub_dist.plan.quantization import check_quantize_arguments

__all__ = [
    "factory_for_class",
    "gemma3_backbone",
    "gemma4_backbone",
    "gemma_backbone",
    "gpt_oss_backbone",
    "llama_backbone",
    "mistral_backbone",
    "mixtral_backbone",
    "qwen3_5_backbone",
    "qwen3_5_moe_backbone",
    "qwen3_backbone",
    "qwen3_moe_backbone",
    "qwen_backbone",
    "supported_class_names",
]

# factory name -> (registry families it builds, default class for plain dicts)
_FACTORIES: dict[str, tuple[tuple[str, ...], str]] = {
    "gemma_backbone": (("gemma",), "GemmaBackbone"),
    "gemma3_backbone": (("gemma3",), "Gemma3Backbone"),
    "llama_backbone": (("llama", "llama3"), "LlamaBackbone"),
    "qwen_backbone": (("qwen",), "QwenBackbone"),
    "qwen3_backbone": (("qwen3",), "Qwen3Backbone"),
    "mistral_backbone": (("mistral",), "MistralBackbone"),
    "gemma4_backbone": (("gemma4",), "Gemma4Backbone"),
    "qwen3_moe_backbone": (("qwen3_moe",), "Qwen3MoeBackbone"),
    "qwen3_5_backbone": (("qwen3_5",), "Qwen3_5Backbone"),
    "qwen3_5_moe_backbone": (("qwen3_5_moe",), "Qwen3_5MoeBackbone"),
    "mixtral_backbone": (("mixtral",), "MixtralBackbone"),
    "gpt_oss_backbone": (("gpt_oss",), "GptOssBackbone"),
}

# The multimodal towers' constructor arguments, by factory. With
# `text_only=True` (the default) they are set to `None`, as the named Gemma 3
# architectures are text-only; with `text_only=False` the config's towers are
# kept (a missing key still becomes `None`: these classes' `from_config`
# requires `vision_encoder`).
_TOWERS: dict[str, tuple[str, ...]] = {
    "gemma4_backbone": ("vision_encoder", "audio_encoder"),
    "qwen3_5_backbone": ("vision_encoder",),
    "qwen3_5_moe_backbone": ("vision_encoder",),
}

# Token-indexed tables besides `token_embedding`, by registry family: the
# backbone attribute holding the `keras.layers.Embedding`. Their twins are
# given the layer's own variable path. Gemma 4 has a per-layer input
# embedding (`per_layer_token_embedding/embeddings`, vocabulary x
# num_layers * hidden_size_per_layer_input) when
# `hidden_size_per_layer_input > 0`.
_EXTRA_EMBEDDINGS: dict[str, tuple[str, ...]] = {
    "gemma4": ("per_layer_token_embedding",),
}


def _factory_for(family: str | None) -> str | None:
    for factory, (families, _) in _FACTORIES.items():
        if family in families:
            return factory
    return None


def factory_for_class(cls_or_name: type | str) -> Callable[..., Any] | None:
    """The factory that builds a KerasHub backbone class (or class name).

    Returns:
        e.g. `gemma_backbone` for `GemmaBackbone`; `None` for a class of a
        family no factory builds.
    """
    import keras_hub

    cls = cls_or_name
    if isinstance(cls_or_name, str):
        cls = getattr(keras_hub.models, cls_or_name, None)
    if not isinstance(cls, type):
        return None
    name = _factory_for(registry.family_of(cls))
    return globals()[name] if name else None


def supported_class_names() -> list[str]:
    """Names of the `keras_hub.models` backbone classes a factory builds."""
    import keras_hub

    return sorted(
        name
        for name in dir(keras_hub.models)
        if isinstance(getattr(keras_hub.models, name), type)
        and issubclass(getattr(keras_hub.models, name), keras_hub.models.Backbone)
        and factory_for_class(name) is not None
    )


def _inject_twin(embedding: Any, path: str) -> None:
    """Swaps an embedding layer's initializer (and its table's pending one)."""
    twin = initializers.distributed_like(embedding.embeddings_initializer, path=path)
    embedding.embeddings_initializer = twin
    _compat.set_pending_initializer(embedding.embeddings, twin)


def _towers(factory: str, config: dict[str, Any], overrides: dict[str, Any],
            text_only: bool) -> None:
    towers = _TOWERS.get(factory, ())
    given = [key for key in towers if overrides.get(key) is not None]
    if text_only and given:
        raise ValueError(
            f"{factory}(text_only=True) builds the text-only model. Expected "
            f"no encoder override, or text_only=False to build one. Received: "
            f"{', '.join(f'{key}=...' for key in given)}."
        )
    for key in towers:
        if text_only:
            config[key] = None
        else:
            config.setdefault(key, None)


def _build(factory: str, name_or_config: Any, overrides: dict[str, Any],
           text_only: bool = True):
    import keras_hub

    families, default_class = _FACTORIES[factory]
    quantize = overrides.pop("quantize", None)
    mode = check_quantize_arguments(quantize, overrides.get("dtype"))
    remat = overrides.pop("remat", None)
    remat_scope(remat)  # an unknown mode fails before anything is built
    cls, config, entry = presets.backbone_config(
        name_or_config,
        backbone_class=getattr(keras_hub.models, default_class),
        **overrides,
    )
    family = registry.family_of(cls)
    if family not in families:
        right = _factory_for(family)
        what = f"'{entry.name}'" if entry is not None else "this config"
        raise ValueError(
            f"{factory} builds {', '.join(families)} backbones. Expected a "
            f"named architecture or config of that family. Received: {what}, "
            f"a {cls.__name__} (family {family!r}). "
            + (
                f"Use keras_hub_dist.{right}() instead."
                if right else
                "No keras_hub_dist factory builds that family."
            )
        )
    _towers(factory, config, overrides, text_only)
    path = registry.lookup(family)
    backbone, created = build_shaped(cls, config, remat)
    _inject_twin(backbone.token_embedding, path)
    for attribute in _EXTRA_EMBEDDINGS.get(family, ()):
        layer = getattr(backbone, attribute, None)
        if layer is not None:
            _inject_twin(layer, layer.embeddings.path)
    # Every random-initialized variable (the embedding and the kernels) is
    # drawn straight into its shards by a twin of its stock initializer, every
    # constant one (norm scales, biases) filled in its layout; anything else
    # goes through Keras's deferred initialization.
    if mode is not None:
        initialize_quantized(backbone, created, mode)
        return backbone
    initializers.initialize_variables(created, distribute_all=True)
    return backbone


def gemma_backbone(name_or_config: Any, /, **overrides: Any):
    """A `keras_hub.models.GemmaBackbone` (Gemma, Gemma 2) with a sharded embedding.

    Args:
        name_or_config: A named architecture or alias (`"gemma_7b_en"`,
            `"gemma2_9b_en"`, `"gemma2_7b"` = `gemma_7b_en`), a preset
            directory, a KerasHub `config.json` object or a plain dict of
            `GemmaBackbone` arguments.
        **overrides: Constructor arguments replacing the config's, e.g.
            `num_layers=2, dtype="bfloat16"`; and `quantize="int8"` or
            `"int4"`: the backbone `backbone.quantize(mode)` would give,
            bitwise, each float kernel drawn in its shards and quantized on
            the host one at a time (`init.quantized`); and `remat=`:
            rematerialization in training, `None` (off), a
            `keras.RematScope` mode (`"full"`, ...) or a `keras.RematScope`,
            on the decoder blocks (`shaping.remat.apply_remat`).

    Returns:
        The backbone; `backbone.token_embedding.embeddings_initializer` is a
        `DistributedVarianceScaling`. Under an active `ModelParallel` whose
        layout map covers the embedding, the table is created sharded.

    Example:

    >>> backbone = gemma_backbone("gemma_2b_en", num_layers=1)  # doctest: +SKIP
    """
    return _build("gemma_backbone", name_or_config, overrides)


def gemma3_backbone(name_or_config: Any, /, **overrides: Any):
    """A text-only `keras_hub.models.Gemma3Backbone` with a sharded embedding.

    Same arguments as `gemma_backbone`; named architectures `gemma3_270m`,
    `gemma3_1b`, `gemma3_4b_text`, `gemma3_12b_text`, `gemma3_27b_text`.
    """
    return _build("gemma3_backbone", name_or_config, overrides)


def llama_backbone(name_or_config: Any, /, **overrides: Any):
    """A `LlamaBackbone` / `Llama3Backbone` with a sharded embedding.

    Same arguments as `gemma_backbone`; named architectures `llama2_7b_en`
    (`LlamaBackbone`), `llama3_8b_en`, `llama3.1_8b`, `llama3.2_1b`
    (`Llama3Backbone`). A plain dict builds a `LlamaBackbone`. The twin is a
    `DistributedRandomNormal`.
    """
    return _build("llama_backbone", name_or_config, overrides)


def qwen_backbone(name_or_config: Any, /, **overrides: Any):
    """A `keras_hub.models.QwenBackbone` (Qwen 2.5) with a sharded embedding.

    Same arguments as `gemma_backbone`; named architectures `qwen2.5_0.5b_en`,
    `qwen2.5_3b_en`, `qwen2.5_7b_en`.
    """
    return _build("qwen_backbone", name_or_config, overrides)


def qwen3_backbone(name_or_config: Any, /, **overrides: Any):
    """A `keras_hub.models.Qwen3Backbone` with a sharded embedding.

    Same arguments as `gemma_backbone`; named architectures `qwen3_0.6b_en`
    to `qwen3_32b_en`.
    """
    return _build("qwen3_backbone", name_or_config, overrides)


def mistral_backbone(name_or_config: Any, /, **overrides: Any):
    """A `keras_hub.models.MistralBackbone` with a sharded embedding.

    Same arguments as `gemma_backbone`; named architectures `mistral_7b_en`,
    `mistral_0.3_7b_en`.
    """
    return _build("mistral_backbone", name_or_config, overrides)


def gemma4_backbone(
    name_or_config: Any, /, *, text_only: bool = True, **overrides: Any
):
    """A `keras_hub.models.Gemma4Backbone` with sharded embeddings.

    Same arguments as `gemma_backbone` (named architectures `gemma4_2b`,
    `gemma4_4b`, `gemma4_26b_a4b`, `gemma4_31b`, ...), plus:

    Args:
        text_only: Build the text-only model (the default, as
            `gemma3_backbone` does): `vision_encoder` and `audio_encoder` are
            set to `None` whatever the config holds (the named architectures
            hold both). With `False` the config's encoders are built too,
            their kernels drawn by twins like the decoder's.

    Both `token_embedding` (a `DistributedVarianceScaling`) and, when
    `hidden_size_per_layer_input > 0`, the per-layer input embedding
    `per_layer_token_embedding` (a `DistributedRandomUniform`, variable path
    `per_layer_token_embedding/embeddings`, vocabulary x num_layers *
    hidden_size_per_layer_input) are created in their shards. The MoE expert
    banks (`enable_moe_block`) start at zeros, as in KerasHub, filled in
    their layout.

    Example:

    >>> backbone = gemma4_backbone(  # doctest: +SKIP
    ...     "gemma4_2b", num_layers=2, dtype="bfloat16"
    ... )
    """
    return _build("gemma4_backbone", name_or_config, overrides, text_only)


def qwen3_moe_backbone(name_or_config: Any, /, **overrides: Any):
    """A `keras_hub.models.Qwen3MoeBackbone` with a sharded embedding.

    Same arguments as `gemma_backbone` (e.g. the named architecture
    `qwen3_moe_30b_a3b_en`). The twin is a `DistributedRandomNormal`; the
    stacked expert kernels are drawn in their shards by twins too.
    """
    return _build("qwen3_moe_backbone", name_or_config, overrides)


def qwen3_5_backbone(
    name_or_config: Any, /, *, text_only: bool = True, **overrides: Any
):
    """A text-only `keras_hub.models.Qwen3_5Backbone` with a sharded embedding.

    Same arguments as `gemma4_backbone` (named architectures `qwen3_5_0.8b`
    to `qwen3_5_27b`): text-only by default, `vision_encoder` set to `None`
    unless `text_only=False`. The twin is a `DistributedRandomNormal`.
    """
    return _build("qwen3_5_backbone", name_or_config, overrides, text_only)


def qwen3_5_moe_backbone(
    name_or_config: Any, /, *, text_only: bool = True, **overrides: Any
):
    """A text-only `keras_hub.models.Qwen3_5MoeBackbone` with a sharded embedding.

    Same arguments as `qwen3_5_backbone` (named architecture
    `qwen3_5_moe_35b_a3b`). The twin is a `DistributedRandomNormal`.
    """
    return _build("qwen3_5_moe_backbone", name_or_config, overrides, text_only)


def mixtral_backbone(name_or_config: Any, /, **overrides: Any):
    """A `keras_hub.models.MixtralBackbone` with a sharded embedding.

    Same arguments as `gemma_backbone` (e.g. the named architecture
    `mixtral_8_7b_en`). The twin is a `DistributedRandomNormal`.
    """
    return _build("mixtral_backbone", name_or_config, overrides)


def gpt_oss_backbone(name_or_config: Any, /, **overrides: Any):
    """A `keras_hub.models.GptOssBackbone` (gpt-oss) with a sharded embedding.

    Same arguments as `gemma_backbone` (e.g. the named architecture
    `gpt_oss_20b_en`). The twin is a `DistributedRandomNormal`; the attention
    sinks and expert kernels are drawn by twins too, the biases start at
    zeros.
    """
    return _build("gpt_oss_backbone", name_or_config, overrides)
