"""Random arrays generated shard by shard, bitwise equal to the unsharded draw.

JAX's partitionable threefry (`jax_threefry_partitionable`, the default since
JAX 0.5) derives element `i` of `jax.random.bits(key, shape)` from the key and
the element's flat row-major index alone. So any rectangular block of the full
array can be drawn on its own, given its global starting coordinates: this
module defines a PRNG implementation whose key carries those coordinates, and
lets JAX's own samplers (`normal`, `truncated_normal`, `uniform`) turn the bits
into values, so the float transforms are JAX's, not a copy of them.

Each device draws its block in chunks inside one `shard_map` program, writing
into its output buffer, so the compiled program needs the shard plus a few
chunks of temporaries instead of ~3x the shard that drawing the shard whole
takes on CPU.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import random as jax_random_ext
from jax.sharding import NamedSharding, PartitionSpec

from keras_hub_dist.plan import specs

__all__ = [
    "BlockSampler",
    "chunk_plan",
    "sharded_sample",
    "sharded_sampler",
]

# A block sampler draws the values of one block: (block_shape, dtype, key) ->
# array, where `key` is a typed PRNG key whose bits are the full array's.
BlockSampler = Callable[[tuple[int, ...], Any, jax.Array], jax.Array]

# Upper bound on one chunk's elements. Drawing a chunk takes ~4 chunk-sized
# temporaries (two counter words, bits, floats), so 1/32 of a shard costs
# ~1/8 of the shard in temps; shards under 128K elements stay one chunk.
_CHUNK_FRACTION = 32
_MIN_CHUNK_ELEMENTS = 1 << 17

_LOW16 = np.uint32(0xFFFF)


def _mul_wide(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
    """`a * b` as (high, low) uint32 words, for uint32 `a` and 0 <= b < 2**32.

    Written with 16-bit halves so it does not need `jax_enable_x64`.
    """
    b0, b1 = np.uint32(b & 0xFFFF), np.uint32(b >> 16)
    a0, a1 = a & _LOW16, a >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    middle = (p00 >> 16) + (p01 & _LOW16) + (p10 & _LOW16)
    high = p11 + (p01 >> 16) + (p10 >> 16) + (middle >> 16)
    return high, a * np.uint32(b)


def _add_wide(
    x: tuple[jax.Array, jax.Array], y: tuple[jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array]:
    low = x[1] + y[1]
    carry = (low < x[1]).astype(jnp.uint32)
    return x[0] + y[0] + carry, low


def _unused(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(
        "Block keys of keras_hub_dist only draw bits; they cannot be seeded, "
        "split or folded. Expected a call to a jax.random sampler."
    )


@functools.lru_cache(maxsize=256)
def block_prng_impl(full_shape: tuple[int, ...]) -> Any:
    """A threefry variant whose key is `[k0, k1, start_0, ..., start_{n-1}]`.

    `random_bits(key, width, block_shape)` returns the bits that the
    partitionable threefry gives `full_shape[start:start + block_shape]`.
    """
    strides = [math.prod(full_shape[d + 1 :]) for d in range(len(full_shape))]

    def random_bits(key: jax.Array, bit_width: int, shape: Sequence[int]):
        shape = tuple(shape)
        high = jnp.zeros(shape, jnp.uint32)
        low = jnp.zeros(shape, jnp.uint32)
        for dim, stride in enumerate(strides):
            coordinate = key[2 + dim] + lax.broadcasted_iota(jnp.uint32, shape, dim)
            term_high, term_low = _mul_wide(coordinate, stride & 0xFFFFFFFF)
            term_high = term_high + coordinate * np.uint32(stride >> 32)
            high, low = _add_wide((high, low), (term_high, term_low))
        bits1, bits2 = jax_random_ext.threefry2x32_p.bind(key[0], key[1], high, low)
        # Mirrors `_threefry_random_bits_partitionable` bit for bit.
        if bit_width == 64:
            return (bits1.astype(jnp.uint64) << 32) | bits2.astype(jnp.uint64)
        bits = bits1 ^ bits2
        if bit_width == 32:
            return bits
        return bits.astype({8: jnp.uint8, 16: jnp.uint16}[bit_width])

    return jax_random_ext.define_prng_impl(
        key_shape=(2 + len(full_shape),),
        seed=_unused,
        split=_unused,
        random_bits=random_bits,
        fold_in=_unused,
        name=f"keras_hub_dist_block_threefry{full_shape}",
        tag="khdb",
    )


def chunk_plan(block_shape: Sequence[int]) -> tuple[int, int]:
    """Chooses `(dim, rows)`: draw `rows` entries of `dim` at a time.

    Every dimension before `dim` is walked one index at a time, so each chunk
    is a rectangular block of at most ~1/32 of the shard (and never smaller
    than 128K elements unless the shard is). `rows` divides `block_shape[dim]`,
    so every chunk has one static shape.
    """
    block_shape = tuple(int(d) for d in block_shape)
    if not block_shape:
        return 0, 1
    total = math.prod(block_shape)
    target = max(_MIN_CHUNK_ELEMENTS, total // _CHUNK_FRACTION)
    if total <= target:
        return 0, block_shape[0]
    for dim in range(len(block_shape)):
        inner = math.prod(block_shape[dim + 1 :])
        if inner <= target:
            limit = max(1, target // inner)
            rows = max(r for r in range(1, min(limit, block_shape[dim]) + 1)
                       if block_shape[dim] % r == 0)
            return dim, rows
    return len(block_shape) - 1, 1



def _block_starts(
    spec: PartitionSpec, block_shape: tuple[int, ...]
) -> list[jax.Array]:
    """Global start of this device's block, per dimension (inside shard_map)."""
    starts = []
    for dim, size in enumerate(block_shape):
        axes = specs.entry_axes(spec[dim] if dim < len(spec) else None)
        if axes:
            index = lax.axis_index(axes if len(axes) > 1 else axes[0])
            starts.append(index.astype(jnp.uint32) * np.uint32(size))
        else:
            starts.append(jnp.uint32(0))
    return starts


def _draw_block(
    sample: BlockSampler,
    full_shape: tuple[int, ...],
    block_shape: tuple[int, ...],
    dtype: Any,
    raw_key: jax.Array,
    starts: list[jax.Array],
) -> jax.Array:
    impl = block_prng_impl(full_shape)
    if not block_shape:
        key = jax.random.wrap_key_data(raw_key, impl=impl)
        return sample((), dtype, key)
    dim, rows = chunk_plan(block_shape)
    chunk_shape = (1,) * dim + (rows,) + block_shape[dim + 1 :]
    outer = block_shape[:dim]
    steps_per_row = block_shape[dim] // rows
    steps = math.prod(outer) * steps_per_row

    def draw(step: jax.Array, out: jax.Array | None):
        outer_index = step // steps_per_row
        offsets = []
        for size in reversed(outer):
            offsets.append(outer_index % size)
            outer_index = outer_index // size
        offsets = list(reversed(offsets))
        offsets.append((step % steps_per_row) * rows)
        offsets += [jnp.int32(0)] * (len(block_shape) - dim - 1)
        coordinates = [
            start + offset.astype(jnp.uint32) for start, offset in zip(starts, offsets)
        ]
        key = jax.random.wrap_key_data(
            jnp.concatenate([raw_key, jnp.stack(coordinates)]), impl=impl
        )
        values = sample(chunk_shape, dtype, key).astype(dtype)
        if out is None:
            return values
        return lax.dynamic_update_slice(out, values, offsets)

    if steps == 1:
        return draw(jnp.int32(0), None).reshape(block_shape)
    out = jnp.empty(block_shape, dtype)
    return lax.fori_loop(0, steps, draw, out)


def sharded_sampler(
    sample: BlockSampler,
    full_shape: Sequence[int],
    dtype: Any,
    mesh: jax.sharding.Mesh,
    spec: PartitionSpec,
) -> Callable[[jax.Array], jax.Array]:
    """A jitted `raw_key -> array` drawing `full_shape` directly in `spec`.

    Args:
        sample: Draws one block from a block key (see `BlockSampler`).
        full_shape: Global shape of the array.
        dtype: Output dtype.
        mesh: The concrete device mesh.
        spec: How `full_shape` is split over `mesh` (must divide evenly).

    Returns:
        A jitted function of the raw `uint32[2]` threefry key data.
    """
    full_shape = tuple(int(d) for d in full_shape)
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    spec = PartitionSpec(*(tuple(spec) + (None,) * (len(full_shape) - len(spec))))
    block_shape = tuple(
        d // math.prod(sizes[a] for a in specs.entry_axes(e))
        for d, e in zip(full_shape, spec)
    )

    def per_device(raw_key: jax.Array) -> jax.Array:
        starts = _block_starts(spec, block_shape)
        return _draw_block(sample, full_shape, block_shape, dtype, raw_key, starts)

    mapped = jax.shard_map(
        per_device, mesh=mesh, in_specs=PartitionSpec(), out_specs=spec,
        check_vma=False,
    )
    return jax.jit(mapped, out_shardings=NamedSharding(mesh, spec))


# Compiled samplers by (draw key, shape, dtype, mesh, spec): every layer of a
# model has kernels of the same shapes, and re-tracing and re-compiling the
# same program per variable would dominate the init of a deep model.
_SAMPLER_CACHE: collections.OrderedDict[Hashable, Callable] = collections.OrderedDict()
_SAMPLER_CACHE_SIZE = 256
_sampler_cache_lock = threading.Lock()


def sharded_sample(
    sample: BlockSampler,
    full_shape: Sequence[int],
    dtype: Any,
    mesh: jax.sharding.Mesh,
    spec: PartitionSpec,
    raw_key: jax.Array,
    *,
    draw_key: Hashable | None = None,
) -> jax.Array:
    """Draws `full_shape` in sharding `NamedSharding(mesh, spec)`.

    Args:
        draw_key: Hashable identity of what `sample` computes (everything but
            the key, which is an argument). Given, the compiled program is
            reused by later calls with the same key, shape, dtype and layout.
    """
    raw_key = jnp.asarray(raw_key, jnp.uint32).reshape(2)
    mesh = _match_context_axis_types(mesh)
    if draw_key is None:
        return sharded_sampler(sample, full_shape, dtype, mesh, spec)(raw_key)
    cache_key = (
        draw_key, tuple(int(d) for d in full_shape), jnp.dtype(dtype).name,
        mesh, PartitionSpec(*spec),
    )
    with _sampler_cache_lock:
        sampler = _SAMPLER_CACHE.get(cache_key)
        if sampler is not None:
            _SAMPLER_CACHE.move_to_end(cache_key)
    if sampler is None:
        sampler = sharded_sampler(sample, full_shape, dtype, mesh, spec)
        with _sampler_cache_lock:
            _SAMPLER_CACHE[cache_key] = sampler
            while len(_SAMPLER_CACHE) > _SAMPLER_CACHE_SIZE:
                _SAMPLER_CACHE.popitem(last=False)
    return sampler(raw_key)


def _match_context_axis_types(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """`mesh` with the axis types of the enclosing mesh context, if any.

    Keras calls layout-aware initializers under `jax.sharding.explicit_axes`,
    and `shard_map` requires its mesh to match that context exactly; matching
    the axis types also makes Keras's final reshard a no-op.
    """
    context = jax.sharding.get_abstract_mesh()
    if (
        context is None
        or context.empty
        or tuple(context.axis_names) != tuple(mesh.axis_names)
        or tuple(context.axis_sizes) != tuple(mesh.axis_sizes)
        or tuple(context.axis_types) == tuple(mesh.axis_types)
    ):
        return mesh
    return jax.sharding.Mesh(
        mesh.devices, mesh.axis_names, axis_types=tuple(context.axis_types)
    )
