"""The distributed initializers: the public name of `keras_hub_dist.init.initializers`.

Kept at the package root so `keras_hub_dist.initializers.X` and
`from keras_hub_dist.initializers import X` keep working; the code lives in
`keras_hub_dist/init/initializers.py`.
"""

from keras_hub_dist.init.initializers import (  # noqa: F401
    DistributedGlorotNormal,
    DistributedGlorotUniform,
    DistributedHeNormal,
    DistributedHeUniform,
    DistributedLecunNormal,
    DistributedLecunUniform,
    DistributedRandomNormal,
    DistributedRandomUniform,
    DistributedTruncatedNormal,
    DistributedVarianceScaling,
    distributed_like,
    initialize_variables,
)

__all__ = [
    "DistributedGlorotNormal",
    "DistributedGlorotUniform",
    "DistributedHeNormal",
    "DistributedHeUniform",
    "DistributedLecunNormal",
    "DistributedLecunUniform",
    "DistributedRandomNormal",
    "DistributedRandomUniform",
    "DistributedTruncatedNormal",
    "DistributedVarianceScaling",
    "distributed_like",
    "initialize_variables",
]
