"""PEFT LoRA adapter directories: `adapter_config.json` and
`adapter_model.safetensors`, as `peft`'s `save_pretrained` writes them and
`PeftModel.from_pretrained`, vLLM (`--enable-lora`) and SGLang read them.

A tensor is named after the Transformers module it adapts, under PEFT's
prefix: `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`
(`A`, shape `(r, in)`) and `...lora_B.weight` (`B`, shape `(out, r)`); the
update of `W (out, in)` is `W + scaling * B @ A`, `scaling = lora_alpha / r`
(`lora_alpha / sqrt(r)` with `use_rslora`).

`read_config` accepts exactly the LoRA PEFT computes as above and names any
other feature it finds (DoRA, per-module ranks or alphas, trained biases,
modules saved whole, ...), rather than dropping it.

Example:

```python
adapter = read_config(json.loads(open("adapter/adapter_config.json").read()), "adapter")
adapter.rank, adapter.scaling, adapter.target_modules
tensor_name("model.layers.0.self_attn.q_proj", "A")
```
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from keras_hub_dist.errors import PresetError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterConfig",
    "adapter_config_json",
    "module_of",
    "read_config",
    "tensor_name",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Not PEFT's: where `save_lora_adapter` records the weights file's checksums
# (as the Hugging Face export does in `model.safetensors.index.json`).
ADAPTER_INDEX = ADAPTER_WEIGHTS + ".index.json"
_PREFIX = "base_model.model."

# PEFT options whose non-default values change what the adapter computes,
# with the value that changes nothing; each is named if set otherwise.
_NEUTRAL = {
    "use_dora": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "bias": ("none", None),
    "modules_to_save": (None, []),
    "fan_in_fan_out": (False, None),
    "lora_bias": (False, None),
    "layer_replication": (None, []),
    "trainable_token_indices": (None, {}, []),
    "target_parameters": (None, []),
    "use_qalora": (False, None),
    "alora_invocation_tokens": (None, []),
    "use_bdlora": (None, False, {}),
    "megatron_config": (None,),
}
_WHAT = {
    "use_dora": "DoRA (use_dora)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "bias": "trained biases (bias != 'none')",
    "modules_to_save": "modules saved whole (modules_to_save)",
    "fan_in_fan_out": "Conv1D-style weights (fan_in_fan_out)",
    "lora_bias": "LoRA biases (lora_bias)",
    "layer_replication": "layer replication (layer_replication)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "target_parameters": "parameter targets (target_parameters)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora)",
    "megatron_config": "Megatron layers (megatron_config)",
}


@dataclass(frozen=True)
class AdapterConfig:
    """What a LoRA adapter computes, from its `adapter_config.json`.

    Attributes:
        rank: `r`.
        lora_alpha: `lora_alpha`.
        scaling: The factor of `B @ A`.
        target_modules: Module names (or a regex string, as PEFT allows).
        base_model_name_or_path: The base model it was trained on.
        raw: The whole file.
    """

    rank: int
    lora_alpha: float
    scaling: float
    target_modules: tuple[str, ...] | str
    base_model_name_or_path: str | None
    raw: Mapping[str, Any]


def read_config(raw: Any, label: str) -> AdapterConfig:
    """Validates an `adapter_config.json`'s contents.

    Raises:
        PresetError: Not a LoRA adapter, or one using a PEFT feature this
            package does not compute (each is named).
    """
    where = f"{label}/{ADAPTER_CONFIG}"
    if not isinstance(raw, dict):
        raise PresetError(f"Expected a JSON object in {where!r}. Received: a JSON {type(raw).__name__}.")
    if raw.get("peft_type") != "LORA":
        raise PresetError(
            f"Expected a LoRA adapter (peft_type 'LORA') in {where!r}. Received: "
            f"peft_type={raw.get('peft_type')!r}."
        )
    used = [
        f"{_WHAT[key]}: {raw[key]!r}"
        for key, neutral in _NEUTRAL.items()
        if key in raw and raw[key] not in neutral
    ]
    if used:
        raise PresetError(
            f"Expected a plain LoRA adapter. Received: {where!r} uses PEFT features keras_hub_dist "
            f"does not compute: {'; '.join(used)}. Merge them into the base model with peft "
            "(`merge_and_unload`) or train an adapter without them."
        )
    try:
        rank = int(raw["r"])
        alpha = float(raw.get("lora_alpha", rank))
    except (KeyError, TypeError, ValueError) as e:
        raise PresetError(f"Expected an integer 'r' and a number 'lora_alpha' in {where!r}. Received: {e!r}.") from e
    if rank <= 0:
        raise PresetError(f"Expected r >= 1 in {where!r}. Received: r={rank}.")
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        targets = tuple(str(t) for t in targets)
    elif not isinstance(targets, str):
        raise PresetError(
            f"Expected target_modules (a list of module names, or a regex) in {where!r}. "
            f"Received: {targets!r}."
        )
    scaling = alpha / (math.sqrt(rank) if raw.get("use_rslora") else rank)
    return AdapterConfig(rank, alpha, scaling, targets, raw.get("base_model_name_or_path"), raw)


def adapter_config_json(
    rank: int, lora_alpha: float, target_modules: Sequence[str], base_model_name_or_path: str | None
) -> str:
    """`adapter_config.json` of a plain LoRA adapter, as `peft` writes it
    (the keys vLLM and `LoraConfig` read; the others at their defaults)."""
    alpha: float | int = int(lora_alpha) if float(lora_alpha).is_integer() else float(lora_alpha)
    config = {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": int(rank),
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(set(target_modules)),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def tensor_name(module: str, factor: str) -> str:
    """The adapter tensor of Transformers module `module`, factor `"A"` or `"B"`."""
    return f"{_PREFIX}{module}.lora_{factor}.weight"


def module_of(name: str) -> tuple[str, str] | None:
    """`(module, "A" | "B")` of an adapter tensor name (`None`: not a LoRA
    factor of a linear module). A `.default` adapter name inside is
    dropped, as `peft` does on loading."""
    name = name.replace(".default.", ".")
    for factor in ("A", "B"):
        suffix = f".lora_{factor}.weight"
        if name.endswith(suffix):
            module = name[: -len(suffix)]
            return (module[len(_PREFIX):] if module.startswith(_PREFIX) else module), factor
    return None
