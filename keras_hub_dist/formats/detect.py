"""Which checkpoint format a preset is in, from its config.json alone.

The user never names the format: each format module says whether it
`recognizes` a config, and the first that does reads the checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

from keras_hub_dist.errors import PresetError
from keras_hub_dist.formats import keras_h5

__all__ = ["FORMATS", "checkpoint_format"]

# Each module has `FORMAT`, `recognizes(config)`,
# `backbone_config(config, label)` and `index_checkpoint(model, ref, label)`.
FORMATS: tuple[ModuleType, ...] = (keras_h5,)


def checkpoint_format(config: Mapping[str, Any], label: str) -> ModuleType:
    """The format module that reads the preset whose config.json is `config`.

    Raises:
        PresetError: No format recognizes the config.
    """
    for module in FORMATS:
        if module.recognizes(config):
            return module
    kind = "a Transformers" if "model_type" in config else "an unknown"
    raise PresetError(
        f"The preset {label!r} has {kind} config.json. Expected a KerasHub "
        "(Keras-format) preset with 'registered_name', whose weights are a "
        "`model.weights.h5`. Convert it once with "
        "`keras_hub.models.Backbone.from_preset(...).save_to_preset(dir)`."
    )
