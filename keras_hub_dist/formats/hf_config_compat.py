"""What `transformers` 5 writes under names KerasHub 0.32's converters do not read.

KerasHub's converters (`keras_hub/src/utils/transformers/convert_*.py`) were
written against the config.json files of the published checkpoints, most of
them saved by `transformers` 4. A checkpoint saved by `transformers` 5 (5.23
measured: `tools/write_transformers_configs.py`, fixtures in
`tests/data/transformers5/`) spells some of them differently, and stock
`Backbone.from_preset` then fails or, worse, silently builds another model:

- `qwen3_moe`: `num_experts` is written `num_local_experts` (stock: `KeyError`);
- `llama`, `gpt_oss`: `rope_scaling` is folded into `rope_parameters`
  (with `rope_theta`); the converters read `rope_scaling` and, finding none,
  build the model without Llama 3's frequency adjustment or gpt-oss's YaRN
  factor (stock: no error, other RoPE);
- `gemma4`, `gemma4_text`: `global_head_dim` and `num_global_key_value_heads`
  become per-layer overrides, `per_layer_config: {"<layer>": {"head_dim": ..,
  "num_key_value_heads": ..}}` on the full-attention layers (stock: the global
  layers get the sliding layers' head size, and loading fails on a reshape);
- `gemma3` (multimodal): the SigLIP tower's tensors are saved as
  `vision_tower.*` instead of `vision_tower.vision_model.*` (stock:
  `SafetensorError`, tensor not found).

`compatible_config` applies the table to a copy of config.json before the
converter sees it (the user's file and dict are never changed), and
`stored_tensor_name` says under which name a tensor the converter asks for is
stored. An entry acts only where the converter's key is absent; where both
spellings are present and disagree, the checkpoint is ambiguous and a
`PresetError` says so. Families not listed (and any key not listed) are
passed through unchanged, so a key missing for another reason keeps the
converter's clear error.

Example:

```python
config = {"model_type": "qwen3_moe", "num_local_experts": 128, ...}
compatible_config(config, "./Qwen3-30B-A3B")["num_experts"]  # 128
```
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from keras_hub_dist.errors import PresetError

__all__ = [
    "CONFIG_RENAMES",
    "TENSOR_RENAMES",
    "READ_TRANSFORMERS_VERSIONS",
    "compatible_config",
    "renames_of",
    "stored_tensor_name",
]

# The versions whose config.json files the test suite reads (fixtures of
# every tested family, written by the newest release).
READ_TRANSFORMERS_VERSIONS = "4.x and 5.x up to 5.23"


def _section(config: dict[str, Any], section: str | None) -> dict[str, Any] | None:
    if section is None:
        return config
    value = config.get(section)
    return value if isinstance(value, dict) else None


def _key(section: str | None, key: str) -> str:
    return f"{section}.{key}" if section else key


def _conflict(label: str, model_type: str, old: str, old_value: Any, new: str, new_value: Any) -> PresetError:
    return PresetError(
        f"The config.json of {label!r} (model_type={model_type!r}) holds both "
        f"{old!r} (read by KerasHub's converter) and {new!r} (its spelling in "
        "transformers 5), with different values. Expected one of them, or equal "
        f"values. Received: {old}={old_value!r}, {new}={new_value!r}. Fix: keep "
        "the key that matches the weights and delete the other."
    )


@dataclasses.dataclass(frozen=True)
class KeyRename:
    """transformers 5 writes `new` where the converter reads `old`, same value."""

    old: str
    new: str
    section: str | None = None  # e.g. "text_config" of a multimodal config

    def describe(self) -> str:
        return f"{_key(self.section, self.new)} -> {_key(self.section, self.old)}"

    def apply(self, config: dict[str, Any], label: str) -> None:
        part = _section(config, self.section)
        if part is None or self.new not in part:
            return
        if self.old not in part:
            part[self.old] = part[self.new]
        elif part[self.old] != part[self.new]:
            raise _conflict(label, config.get("model_type"), _key(self.section, self.old),
                            part[self.old], _key(self.section, self.new), part[self.new])


@dataclasses.dataclass(frozen=True)
class RopeScalingFromParameters:
    """`rope_scaling` from transformers 5's `rope_parameters`.

    transformers 5 writes one dict, `rope_parameters`, holding `rope_theta`,
    `rope_type` and the scaling fields that transformers 4 wrote as
    `rope_scaling` (`rope_type` "default" meaning no scaling, as
    `rope_scaling: null` did). `rope_scaling: null` counts as absent:
    transformers 5 itself reads `rope_parameters` then.
    """

    section: str | None = None

    def describe(self) -> str:
        return (f"{_key(self.section, 'rope_parameters')} (minus rope_theta) -> "
                f"{_key(self.section, 'rope_scaling')}")

    def apply(self, config: dict[str, Any], label: str) -> None:
        part = _section(config, self.section)
        params = None if part is None else part.get("rope_parameters")
        if not isinstance(params, Mapping) or params.get("rope_type", "default") == "default":
            return
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if part.get("rope_scaling") is None:
            part["rope_scaling"] = scaling
        elif dict(part["rope_scaling"]) != scaling:
            raise _conflict(label, config.get("model_type"), _key(self.section, "rope_scaling"),
                            part["rope_scaling"], _key(self.section, "rope_parameters"), dict(params))


@dataclasses.dataclass(frozen=True)
class Gemma4GlobalAttention:
    """`global_head_dim` / `num_global_key_value_heads` from `per_layer_config`.

    transformers 5 (5.23) writes Gemma 4's global-attention sizes as
    per-layer overrides of every `full_attention` layer. KerasHub's
    Gemma4Backbone has one size for all of them, so the overrides must be
    the same on every full-attention layer and nowhere else, and override
    nothing else; a config that is really heterogeneous is refused.
    """

    section: str | None = None

    def describe(self) -> str:
        return (f"{_key(self.section, 'per_layer_config')} of the full_attention layers -> "
                f"{_key(self.section, 'global_head_dim')}, "
                f"{_key(self.section, 'num_global_key_value_heads')}")

    def apply(self, config: dict[str, Any], label: str) -> None:
        part = _section(config, self.section)
        per_layer = None if part is None else part.get("per_layer_config")
        if not per_layer:
            return
        model_type = config.get("model_type")
        layer_types = list(part.get("layer_types") or [])
        full = {i for i, kind in enumerate(layer_types) if kind == "full_attention"}
        overrides = {int(i): dict(v) for i, v in per_layer.items()}
        distinct = {tuple(sorted(v.items())) for v in overrides.values()}
        allowed = {"head_dim", "num_key_value_heads"}
        if set(overrides) != full or len(distinct) != 1 or not set(overrides[min(full)]) <= allowed:
            raise PresetError(
                f"The config.json of {label!r} (model_type={model_type!r}) has per-layer "
                "attention sizes KerasHub's Gemma4Backbone cannot build. Expected "
                "`per_layer_config` to give every full_attention layer (indices "
                f"{sorted(full)}) the same {sorted(allowed)} and no other layer an "
                f"entry, as transformers 5 writes for the published Gemma 4 models. "
                f"Received: {_key(self.section, 'per_layer_config')}={per_layer!r}."
            )
        for old, new in (("global_head_dim", "head_dim"),
                         ("num_global_key_value_heads", "num_key_value_heads")):
            if new not in overrides[min(full)]:
                continue
            value = overrides[min(full)][new]
            if part.get(old) is None:
                part[old] = value
            elif part[old] != value:
                raise _conflict(label, model_type, _key(self.section, old), part[old],
                                _key(self.section, f"per_layer_config.*.{new}"), value)


@dataclasses.dataclass(frozen=True)
class TensorPrefix:
    """Tensors the converter reads under `old...` are stored as `new...`."""

    old: str
    new: str

    def describe(self) -> str:
        return f"tensors {self.new}* -> {self.old}*"

    def stored(self, name: str) -> str | None:
        return self.new + name[len(self.old):] if name.startswith(self.old) else None


ConfigEntry = KeyRename | RopeScalingFromParameters | Gemma4GlobalAttention

# Per model_type: what transformers 5 renamed, measured on checkpoints it
# saved (tools/write_transformers_configs.py); each entry is exercised by a
# fixture of tests/data/transformers5/.
CONFIG_RENAMES: dict[str, tuple[ConfigEntry, ...]] = {
    "qwen3_moe": (KeyRename(old="num_experts", new="num_local_experts"),),
    "llama": (RopeScalingFromParameters(),),
    "gpt_oss": (RopeScalingFromParameters(),),
    "gemma4_text": (Gemma4GlobalAttention(),),
    "gemma4": (Gemma4GlobalAttention(section="text_config"),),
}

TENSOR_RENAMES: dict[str, tuple[TensorPrefix, ...]] = {
    # SigLIP's `vision_model` level is gone from transformers 5's
    # SiglipVisionModel, and save_pretrained does not put it back.
    "gemma3": (TensorPrefix(old="vision_tower.vision_model.", new="vision_tower."),),
}


def renames_of(model_type: str) -> list[str]:
    """What is read under another name for `model_type`, as text (for messages)."""
    entries = (*CONFIG_RENAMES.get(model_type, ()), *TENSOR_RENAMES.get(model_type, ()))
    return [e.describe() for e in entries]


def compatible_config(config: Mapping[str, Any], label: str) -> dict[str, Any]:
    """A copy of config.json with the keys KerasHub's converter reads.

    Args:
        config: config.json contents, as written by `transformers` 4 or 5.
        label: the checkpoint, for error messages.

    Returns:
        A deep copy, with the converter's key added wherever only the
        `transformers` 5 spelling is present; `config` itself is unchanged.

    Raises:
        PresetError: both spellings are present with different values, or a
            value has no form the converter can read (see the entries).

    Example:

    >>> compatible_config({"model_type": "qwen3_moe", "num_local_experts": 8}, "ckpt")
    {'model_type': 'qwen3_moe', 'num_local_experts': 8, 'num_experts': 8}
    """
    result = copy.deepcopy(dict(config))
    for entry in CONFIG_RENAMES.get(str(config.get("model_type")), ()):
        entry.apply(result, label)
    return result


def stored_tensor_name(model_type: str, name: str, exists: Callable[[str], bool]) -> str | None:
    """The name under which `transformers` 5 stored the tensor `name`, if renamed.

    Args:
        model_type: config.json's `model_type`.
        name: the tensor KerasHub's converter asks for.
        exists: whether the checkpoint holds a tensor of that name.

    Returns:
        The stored name when `name` is absent and its `transformers` 5
        spelling is present; None otherwise.

    Example:

    >>> stored_tensor_name("gemma3", "vision_tower.vision_model.post_layernorm.weight",
    ...                    {"vision_tower.post_layernorm.weight"}.__contains__)
    'vision_tower.post_layernorm.weight'
    """
    if exists(name):
        return None
    for entry in TENSOR_RENAMES.get(model_type, ()):
        stored = entry.stored(name)
        if stored is not None and exists(stored):
            return stored
    return None
