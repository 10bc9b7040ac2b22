"""Which checkpoint format a preset is in, from its config.json alone.

The user never names the format: each format module says whether it
`recognizes` a config, and the first that does reads the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from keras_hub_dist.errors import PresetError
from keras_hub_dist.formats import huggingface, keras_h5

__all__ = ["FORMATS", "checkpoint_format"]

# Each module has `FORMAT`, `recognizes(config)`,
# `backbone_config(config, label)` and
# `index_checkpoint(model, ref, label, config)`.
FORMATS: tuple[ModuleType, ...] = (keras_h5, huggingface)


def checkpoint_format(config: Mapping[str, Any], label: str) -> ModuleType:
    """The format module that reads the preset whose config.json is `config`.

    Raises:
        PresetError: No format recognizes the config.
    """
    for module in FORMATS:
        if module.recognizes(config):
            return module
    raise PresetError(
        f"The preset {label!r} has a config.json of no known format. Expected a "
        "KerasHub preset's ('registered_name', written by `save_to_preset`) or a "
        "Hugging Face Transformers one ('model_type'). Received keys: "
        f"{sorted(config)[:12]}."
    )
