"""Per-device and host memory measurement: the public name of `keras_hub_dist.measure.memory`.

Kept at the package root so `keras_hub_dist.memory.X` and
`from keras_hub_dist.memory import X` keep working; the code lives in
`keras_hub_dist/measure/memory.py`.
"""

from keras_hub_dist.measure import memory as _memory
from keras_hub_dist.measure.memory import *  # noqa: F401,F403

__all__ = list(_memory.__all__)
