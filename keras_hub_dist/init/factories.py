"""KerasHub backbones whose token embedding is created directly in its shards.

Each factory returns the real KerasHub backbone class, built from a named
architecture or a config, with `token_embedding.embeddings_initializer`
replaced by its distributed twin
(`keras_hub_dist.initializers.distributed_like`: same class statistics, same
seed, same values). Nothing is patched: the backbone is constructed with its
variables left without values (inside a `keras.StatelessScope`), the
embedding variable's pending initializer is swapped for the twin, and then
every variable is initialized under the active distribution: each one with a
Keras random initializer (the embedding and every kernel) through the twin of
that initializer, straight into its shards, the others (norm scales) through
Keras's own deferred path. So no weight is ever generated only to be thrown away,
and no class, registry entry or Keras global is left changed, whether the
factory returns or raises.

The backbone saves with `save_to_preset` and reloads with the stock
`keras_hub.models.Backbone.from_preset` (its config is the stock one).

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
from keras_hub_dist.plan import presets
from keras_hub_dist.plan.abstract import build_without_values

__all__ = [
    "factory_for_class",
    "gemma3_backbone",
    "gemma_backbone",
    "llama_backbone",
    "mistral_backbone",
    "qwen3_backbone",
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


def _build(factory: str, name_or_config: Any, overrides: dict[str, Any]):
    import keras_hub

    families, default_class = _FACTORIES[factory]
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
    path = registry.lookup(family)
    backbone, created = build_without_values(cls, config)
    embedding = backbone.token_embedding
    twin = initializers.distributed_like(embedding.embeddings_initializer, path=path)
    embedding.embeddings_initializer = twin
    _compat.set_pending_initializer(embedding.embeddings, twin)
    # Every random-initialized variable (the embedding and the kernels) is
    # drawn straight into its shards by a twin of its stock initializer; the
    # rest (norm scales, biases) goes through Keras's deferred initialization.
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
            `num_layers=2, dtype="bfloat16"`.

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
