"""The embedding-path registry: the public name of `keras_hub_dist.init.registry`.

Kept at the package root so `keras_hub_dist.registry.X` and
`from keras_hub_dist.registry import X` keep working; the code lives in
`keras_hub_dist/init/registry.py`.
"""

from keras_hub_dist.init.registry import (  # noqa: F401
    DEFAULT_FAMILY,
    ENV_VAR,
    entries,
    family_of,
    lookup,
    override,
    register,
    unregister,
)

__all__ = [
    "DEFAULT_FAMILY",
    "ENV_VAR",
    "entries",
    "family_of",
    "lookup",
    "override",
    "register",
    "unregister",
]
