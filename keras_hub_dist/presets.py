"""Named architectures: the public name of `keras_hub_dist.plan.presets`.

Kept at the package root so `keras_hub_dist.presets.X` and
`from keras_hub_dist.presets import X` keep working; the code lives in
`keras_hub_dist/plan/presets.py`.
"""

from keras_hub_dist.plan.presets import (  # noqa: F401
    PresetEntry,
    aliases,
    backbone_config,
    entries,
    names,
    resolve,
)

__all__ = [
    "PresetEntry",
    "aliases",
    "backbone_config",
    "entries",
    "names",
    "resolve",
]
