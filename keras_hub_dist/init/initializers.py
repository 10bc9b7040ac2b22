"""Keras random initializers that create a variable already split over devices.

Each class here is a subclass of the Keras initializer of the same name, with
the same arguments plus `path`, the variable path it is meant for (default: the
registry's embedding path, `keras_hub_dist.registry.lookup()`):

- With no distribution active it returns exactly the parent's values.
- Under a distribution that gives the variable a layout (passed by Keras as
  `layout=`, or found by looking `path` up in the active LayoutMap), it returns
  a `jax.Array` with exactly that sharding, generated shard by shard: no
  device ever holds more than its shard, and the compiled program needs about
  1.1x the shard instead of ~4x. Values are bitwise the same on every mesh
  shape and equal the parent's up to the rounding of a fused multiply-add.
- Under a distribution that has no layout for `path`, it warns once per path
  (`MissingLayoutWarning`) and behaves like the parent.

Example:

```python
import keras
import keras_hub_dist

mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"))
layout_map = keras.distribution.LayoutMap(mesh)
layout_map["token_embedding/embeddings"] = ("model", None)
distribution = keras.distribution.ModelParallel(layout_map=layout_map)

init = keras_hub_dist.DistributedRandomNormal(stddev=0.02, seed=0)
with distribution.scope():
    table = init((256000, 3072))  # sharded 8 ways on the vocabulary axis
```
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import keras
from jax.sharding import NamedSharding, PartitionSpec

from keras_hub_dist import _compat
from keras_hub_dist.errors import LayoutError
from keras_hub_dist.errors import MissingLayoutWarning
from keras_hub_dist.init import registry
from keras_hub_dist.init import sharded_random as _sharded_random
from keras_hub_dist.plan import specs
from keras_hub_dist.plan.mesh import axis_sizes, jax_mesh

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

_warned_paths: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


class _Distributed:
    """Mixin: draws the parent's values shard by shard under a layout.

    Subclasses put it before a Keras random initializer in their bases; the
    Keras parent then provides `__init__`'s statistics and the unsharded path.
    """

    def __init__(self, *args: Any, path: str | None = None, **kwargs: Any):
        if path is not None and (not isinstance(path, str) or not path):
            raise ValueError(
                "Expected `path` to be a non-empty variable path or None. "
                f"Received: path={path!r}."
            )
        self.path = path
        super().__init__(*args, **kwargs)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "path": self.path}

    # -- where the layout comes from -------------------------------------
    def _resolved_path(self) -> tuple[str, str]:
        """`(path, registry key)`: the explicit path, or the registry's."""
        if self.path is not None:
            return self.path, "<explicit path>"
        return registry.lookup(), registry.DEFAULT_FAMILY

    def _layout_from_distribution(
        self, distribution: Any, path: str, registry_key: str
    ) -> tuple[jax.sharding.Mesh, PartitionSpec] | None:
        layout, searched = specs.lookup_layout(path, distribution)
        if layout is None:
            if _compat.distribution_layout_map(distribution) is not None:
                self._warn_missing(path, registry_key, searched)
            return None
        return (
            jax_mesh(layout.device_mesh or distribution.device_mesh),
            specs.as_partition_spec(layout.axes),
        )

    @staticmethod
    def _warn_missing(path: str, registry_key: str, searched: tuple[str, ...]):
        with _warned_lock:
            if (path, registry_key) in _warned_paths:
                return
            _warned_paths.add((path, registry_key))
        warnings.warn(
            f"A distribution is active but its LayoutMap has no layout for "
            f"'{path}' (registry key: {registry_key!r}); searched LayoutMap "
            f"keys: {list(searched)}. The variable is created like the parent "
            "Keras initializer does and replicated on every device. Add a "
            "LayoutMap entry for this path, or pass `path=` / register the "
            "family's path with keras_hub_dist.registry.register().",
            MissingLayoutWarning,
            stacklevel=4,
        )

    @staticmethod
    def _layout_from_argument(
        layout: Any, distribution: Any
    ) -> tuple[jax.sharding.Mesh, PartitionSpec]:
        if isinstance(layout, keras.distribution.TensorLayout):
            mesh = layout.device_mesh or distribution.device_mesh
            return jax_mesh(mesh), specs.as_partition_spec(layout.axes)
        if isinstance(layout, NamedSharding):
            mesh = layout.mesh
            if not isinstance(mesh, jax.sharding.Mesh):
                # Keras passes a sharding on the abstract mesh of
                # `jax.sharding.explicit_axes`; the devices are the context's.
                mesh = _compat.context_mesh()
                if mesh is None and distribution is not None:
                    mesh = jax_mesh(distribution.device_mesh)
            if mesh is None:
                raise LayoutError(
                    "Expected a concrete device mesh for the layout passed to "
                    "the initializer. Received: a sharding on an abstract mesh "
                    "with no `jax.set_mesh` context and no active distribution."
                )
            return mesh, layout.spec
        raise TypeError(
            "Expected `layout` to be a keras.distribution.TensorLayout or a "
            f"jax.sharding.NamedSharding. Received: {layout!r}."
        )

    # -- drawing -----------------------------------------------------------
    def _sample_block(
        self, full_shape: tuple[int, ...], block_shape: tuple[int, ...],
        dtype: Any, key: jax.Array,
    ) -> jax.Array:
        """The parent's `__call__` for a block of a `full_shape` variable."""
        raise NotImplementedError

    def __call__(self, shape, dtype=None, layout=None):
        shape = tuple(int(d) for d in shape)
        dtype = keras.backend.standardize_dtype(dtype or keras.config.floatx())
        path, registry_key = self._resolved_path()
        distribution = keras.distribution.distribution()
        placement = None
        if layout is not None:
            placement = self._layout_from_argument(layout, distribution)
            if not any(placement[1]) and _compat.distribution_layout_map(
                distribution
            ) is not None:
                # Keras replicates variables its LayoutMap misses; say so
                # when that variable is the one this initializer is for.
                self._layout_from_distribution(distribution, path, registry_key)
        elif distribution is not None:
            placement = self._layout_from_distribution(
                distribution, path, registry_key
            )
        self._check_dtype(path, shape, dtype, placement)
        if placement is None:
            return super().__call__(shape, dtype=dtype)
        mesh, spec = placement
        specs.validate_spec(path, shape, spec, mesh)
        raw_key = _raw_key(_compat.draw_seed(self.seed))
        return _sharded_random.sharded_sample(
            lambda block, dt, key: self._sample_block(shape, block, dt, key),
            shape, dtype, mesh, spec, raw_key, draw_key=self._draw_key(),
        )

    def _draw_key(self) -> Hashable | None:
        """What the draw depends on besides the key: class and statistics.

        `None` (no reuse of compiled samplers) for a config that is not
        hashable, e.g. a user subclass holding an array.
        """
        config = {k: v for k, v in self.get_config().items()
                  if k not in ("seed", "path")}
        frozen = tuple(sorted(
            (k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()
        ))
        try:
            hash(frozen)
        except TypeError:
            return None
        return (type(self), frozen)

    @staticmethod
    def _check_dtype(path, shape, dtype, placement) -> None:
        if jnp.issubdtype(jnp.dtype(dtype), jnp.floating):
            return
        sizes = axis_sizes(placement[0]) if placement else {}
        raise ValueError(
            f"Cannot initialize '{path}' of shape {shape} (mesh axis sizes: "
            f"{sizes}) with a random float initializer. Expected a floating "
            f"dtype such as 'float32' or 'bfloat16'. Received: dtype={dtype!r}. "
            "Create integer variables with keras.initializers.Zeros or a "
            "constant instead."
        )


def _raw_key(seed: Any) -> jax.Array:
    if jax.dtypes.issubdtype(getattr(seed, "dtype", None), jax.dtypes.prng_key):
        seed = jax.random.key_data(seed)
    return jnp.asarray(seed, jnp.uint32).reshape(2)


def _variance_scaling_draw(
    init: keras.initializers.VarianceScaling,
    full_shape: tuple[int, ...],
    block_shape: tuple[int, ...],
    dtype: Any,
    key: jax.Array,
) -> jax.Array:
    # Mirrors keras.initializers.VarianceScaling.__call__: the statistics come
    # from the full shape, the sample only covers the block.
    scale = init.scale
    fan_in, fan_out = _compat.compute_fans(
        full_shape, input_axes=init.input_axes, output_axes=init.output_axes
    )
    if init.mode == "fan_in":
        scale /= max(1.0, fan_in)
    elif init.mode == "fan_out":
        scale /= max(1.0, fan_out)
    else:
        scale /= max(1.0, (fan_in + fan_out) / 2.0)
    if init.distribution == "truncated_normal":
        stddev = math.sqrt(scale) / 0.87962566103423978
        return keras.random.truncated_normal(
            block_shape, mean=0.0, stddev=stddev, dtype=dtype, seed=key
        )
    if init.distribution == "untruncated_normal":
        return keras.random.normal(
            block_shape, mean=0.0, stddev=math.sqrt(scale), dtype=dtype, seed=key
        )
    limit = math.sqrt(3.0 * scale)
    return keras.random.uniform(
        block_shape, minval=-limit, maxval=limit, dtype=dtype, seed=key
    )


def _register(cls: type) -> type:
    return keras.saving.register_keras_serializable(package="keras_hub_dist")(cls)


@_register
class DistributedRandomNormal(_Distributed, keras.initializers.RandomNormal):
    """`keras.initializers.RandomNormal`, created directly in its sharding.

    Args:
        mean: Mean of the values.
        stddev: Standard deviation of the values.
        seed: An integer or `keras.random.SeedGenerator`, as in Keras.
        path: The variable path this initializer is for (default: the
            registry's embedding path); used to find the layout when Keras
            does not pass one.

    Example:

    >>> init = DistributedRandomNormal(stddev=0.02, seed=1, path="emb/embeddings")
    >>> init((4, 2)).shape
    (4, 2)
    """

    def _sample_block(self, full_shape, block_shape, dtype, key):
        return keras.random.normal(
            block_shape, mean=self.mean, stddev=self.stddev, dtype=dtype, seed=key
        )


@_register
class DistributedTruncatedNormal(_Distributed, keras.initializers.TruncatedNormal):
    """`keras.initializers.TruncatedNormal`, created directly in its sharding.

    Same arguments as `DistributedRandomNormal`.
    """

    def _sample_block(self, full_shape, block_shape, dtype, key):
        return keras.random.truncated_normal(
            block_shape, mean=self.mean, stddev=self.stddev, dtype=dtype, seed=key
        )


@_register
class DistributedRandomUniform(_Distributed, keras.initializers.RandomUniform):
    """`keras.initializers.RandomUniform`, created directly in its sharding.

    Args:
        minval: Lower bound of the values.
        maxval: Upper bound of the values.
        seed: An integer or `keras.random.SeedGenerator`, as in Keras.
        path: The variable path this initializer is for.
    """

    def _sample_block(self, full_shape, block_shape, dtype, key):
        return keras.random.uniform(
            block_shape, minval=self.minval, maxval=self.maxval, dtype=dtype,
            seed=key,
        )


class _DistributedVarianceScalingFamily(_Distributed):
    def _sample_block(self, full_shape, block_shape, dtype, key):
        return _variance_scaling_draw(self, full_shape, block_shape, dtype, key)


@_register
class DistributedVarianceScaling(
    _DistributedVarianceScalingFamily, keras.initializers.VarianceScaling
):
    """`keras.initializers.VarianceScaling`, created directly in its sharding.

    The fans are computed from the full shape, so each shard has exactly the
    statistics (and the values) of the unsharded variable.

    Args:
        scale: Scaling factor (positive float).
        mode: One of `"fan_in"`, `"fan_out"`, `"fan_avg"`.
        distribution: One of `"truncated_normal"`, `"untruncated_normal"`,
            `"uniform"`.
        seed: An integer or `keras.random.SeedGenerator`, as in Keras.
        input_axes, output_axes: As in Keras, for the fan computation.
        path: The variable path this initializer is for (default: the
            registry's embedding path).

    Example:

    >>> init = DistributedVarianceScaling(
    ...     scale=1.0, mode="fan_in", distribution="untruncated_normal", seed=0
    ... )
    >>> init((8, 4)).shape
    (8, 4)
    """


@_register
class DistributedGlorotUniform(
    _DistributedVarianceScalingFamily, keras.initializers.GlorotUniform
):
    """`keras.initializers.GlorotUniform`, created directly in its sharding."""


@_register
class DistributedGlorotNormal(
    _DistributedVarianceScalingFamily, keras.initializers.GlorotNormal
):
    """`keras.initializers.GlorotNormal`, created directly in its sharding."""


@_register
class DistributedHeNormal(
    _DistributedVarianceScalingFamily, keras.initializers.HeNormal
):
    """`keras.initializers.HeNormal`, created directly in its sharding."""


@_register
class DistributedHeUniform(
    _DistributedVarianceScalingFamily, keras.initializers.HeUniform
):
    """`keras.initializers.HeUniform`, created directly in its sharding."""


@_register
class DistributedLecunNormal(
    _DistributedVarianceScalingFamily, keras.initializers.LecunNormal
):
    """`keras.initializers.LecunNormal`, created directly in its sharding."""


@_register
class DistributedLecunUniform(
    _DistributedVarianceScalingFamily, keras.initializers.LecunUniform
):
    """`keras.initializers.LecunUniform`, created directly in its sharding."""


# Most derived Keras classes first: `GlorotUniform` is a `VarianceScaling`.
_TWINS: tuple[tuple[type, type], ...] = (
    (keras.initializers.GlorotUniform, DistributedGlorotUniform),
    (keras.initializers.GlorotNormal, DistributedGlorotNormal),
    (keras.initializers.HeNormal, DistributedHeNormal),
    (keras.initializers.HeUniform, DistributedHeUniform),
    (keras.initializers.LecunNormal, DistributedLecunNormal),
    (keras.initializers.LecunUniform, DistributedLecunUniform),
    (keras.initializers.VarianceScaling, DistributedVarianceScaling),
    (keras.initializers.TruncatedNormal, DistributedTruncatedNormal),
    (keras.initializers.RandomNormal, DistributedRandomNormal),
    (keras.initializers.RandomUniform, DistributedRandomUniform),
)


def _twin_class(initializer: Any) -> type | None:
    """Our class drawing `initializer`'s values, for exact Keras classes only.

    A user subclass may change `__call__`, so only the Keras classes
    themselves (and our twins) qualify.
    """
    for keras_class, twin_class in _TWINS:
        if type(initializer) in (keras_class, twin_class):
            return twin_class
    return None


_CONSTANTS = (
    keras.initializers.Zeros, keras.initializers.Ones, keras.initializers.Constant,
)


def _constant_key(initializer: Any) -> tuple[type, tuple] | None:
    """`(class, config items)` of an exact Keras constant initializer, if any.

    `None` for other initializers, and for a `Constant` whose value is not a
    hashable scalar (Keras's own path handles it).
    """
    if type(initializer) not in _CONSTANTS:
        return None
    items = tuple(sorted(initializer.get_config().items()))
    try:
        hash(items)
    except TypeError:
        return None
    return type(initializer), items


@functools.lru_cache(maxsize=256)
def _constant_fill(
    constant: tuple[type, tuple], shape: tuple[int, ...], dtype: str,
    sharding: NamedSharding,
):
    """A jitted `() -> array` filling `shape` directly in `sharding`.

    Each device writes only its shard: the same program Keras compiles for
    variables over its sharding threshold, cached per shape and layout.
    """
    cls, items = constant
    initializer = cls(**dict(items))
    return jax.jit(
        lambda: initializer(shape, dtype=dtype), out_shardings=sharding
    )


def initialize_variables(variables: Any, *, distribute_all: bool = False) -> None:
    """Gives pending (deferred) variables their values, each in its layout.

    For variables created inside a `keras.StatelessScope` that left them
    without a value. A variable whose initializer is one of ours is drawn
    shard by shard straight into its final sharding and placed as is: Keras's
    own deferred path would call it under `jax.sharding.explicit_axes` and then
    reshard the result, which copies every shard once more (2x per device for a
    moment). Other variables go through Keras's own deferred initialization.

    Args:
        variables: Keras variables; those that already hold a value are
            skipped. Run under the distribution the variables belong to.
        distribute_all: Also draw every variable whose initializer is a Keras
            random initializer with a distributed twin through that twin
            (same seed, same values), so large kernels skip Keras's jitted
            init and its ~3x temporaries too; and fill every variable whose
            initializer is exactly `Zeros`, `Ones` or `Constant` (a scalar)
            straight into its layout, where Keras would create a variable
            under its 250 MB sharding threshold whole on one device first.
            Other initializers (custom ones, `Orthogonal`, ...) go through
            Keras's deferred path. The layers keep their stock initializer
            attributes and configs.

    Raises:
        Whatever the initializer raises, with the variable path added as a
        note (e.g. `LayoutError` for a layout that does not divide).
    """
    distribution = keras.distribution.distribution()
    for variable in variables:
        if not _compat.is_pending(variable):
            continue
        initializer = _compat.pending_initializer(variable)
        if distribute_all and _twin_class(initializer) is not None:
            initializer = distributed_like(initializer, path=variable.path)
        constant = None
        if distribute_all and distribution is not None:
            constant = _constant_key(initializer)
        if distribution is None or (
            constant is None and not isinstance(initializer, _Distributed)
        ):
            _compat.initialize_pending([variable])
            continue
        try:
            layout = distribution.get_variable_layout(variable)
            if constant is not None:
                mesh, spec = _Distributed._layout_from_argument(layout, distribution)
                fill = _constant_fill(
                    constant, tuple(int(d) for d in variable.shape),
                    keras.backend.standardize_dtype(variable.dtype),
                    NamedSharding(mesh, spec),
                )
                value = fill()
            else:
                value = initializer(
                    variable.shape, dtype=variable.dtype, layout=layout
                )
            _compat.materialize_deferred_variable(variable, value, layout)
        except Exception as error:
            error.add_note(
                f"While initializing variable '{variable.path}' (shape "
                f"{tuple(variable.shape)}, dtype {variable.dtype})."
            )
            raise
        _compat.forget_deferred_variables([variable])


def distributed_like(
    initializer: Any, path: str | None = None
) -> keras.initializers.Initializer:
    """The distributed twin of a Keras initializer, with the same config and seed.

    Args:
        initializer: A Keras random initializer (instance, name or config).
        path: The variable path the twin is for (default: registry's).

    Returns:
        An instance of the matching `Distributed*` class that draws the same
        values as `initializer` (same seed, including an unseeded one's
        generated seed).

    Raises:
        TypeError: no distributed twin exists for this initializer type.

    Example:

    >>> stock = keras.initializers.VarianceScaling(seed=3)
    >>> twin = distributed_like(stock, path="token_embedding/embeddings")
    >>> type(twin).__name__
    'DistributedVarianceScaling'
    """
    initializer = keras.initializers.get(initializer)
    if isinstance(initializer, _Distributed):
        if path is None or path == initializer.path:
            return initializer
    twin_class = _twin_class(initializer)
    if twin_class is not None:
        # The live seed, not the config's: an unseeded Keras initializer drew
        # its seed at construction, and passing it on reproduces its values
        # without drawing another from Python's `random`.
        config = {**initializer.get_config(), "seed": initializer.seed, "path": path}
        return twin_class.from_config(config)
    raise TypeError(
        "Expected one of the Keras random initializers "
        f"{[k.__name__ for k, _ in _TWINS]}. Received: "
        f"{type(initializer).__name__}. Only these have a distributed twin."
    )
