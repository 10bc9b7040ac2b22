"""Bytes of live `jax.Array` shards per device: once, or kept up to date.

`live_bytes_per_device` walks every live array; `LiveTally` gives the same
figure for a sampler that asks every few milliseconds, at the cost of the
arrays that appeared or went since it last asked. A process holding 12,398
live arrays (tests/init/test_factories_new_models.py with
tests/load/test_loader.py in one pytest process) paid 15 ms a sample for the
whole walk: 27 s of that run's 92 s, with the sampler thread holding the GIL
the job needed.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import jax

# A live array's shard list never changes until it is deleted, so the
# (device, buffer pointer, bytes) triples are computed once per array.
_ShardEntries = tuple[tuple[int, Any, int], ...]
_shard_cache: dict[int, tuple[weakref.ref, _ShardEntries]] = {}
_shard_cache_lock = threading.Lock()


def shard_entries(array: jax.Array) -> _ShardEntries:
    """`(device id, buffer pointer, bytes)` of each addressable shard."""
    key = id(array)
    cached = _shard_cache.get(key)
    if cached is not None and cached[0]() is array:
        return cached[1]
    entries = []
    for index, shard in enumerate(array.addressable_shards):
        data = shard.data
        try:
            pointer: Any = data.unsafe_buffer_pointer()
        except Exception:  # noqa: BLE001 - platforms without raw pointers
            pointer = (key, index)
        entries.append((int(shard.device.id), pointer, int(data.nbytes)))
        del data
    entries_tuple = tuple(entries)
    with _shard_cache_lock:
        _shard_cache[key] = (weakref.ref(array), entries_tuple)
    return entries_tuple


def prune_shard_cache() -> None:
    """Forgets the shard lists of arrays that no longer exist."""
    with _shard_cache_lock:
        dead = [k for k, (ref, _) in _shard_cache.items() if ref() is None]
        for k in dead:
            del _shard_cache[k]


def live_bytes_per_device(
    arrays: Iterable[jax.Array] | None = None,
    devices: Sequence[Any] | None = None,
) -> dict[int, int]:
    """Bytes of live `jax.Array` shards per device id.

    Each array contributes each of its addressable shards' `nbytes` to the
    shard's device; a buffer held by several arrays (a shard's `.data`, an
    array assembled with `jax.make_array_from_single_device_arrays` from
    arrays still alive) is counted once. Deleted (or donated) arrays count
    nothing.

    Args:
        arrays: The arrays to count; default: `jax.live_arrays()`.
        devices: Devices always present in the result (with 0 bytes when
            empty); default: `jax.local_devices()`.

    Returns:
        A dict from `device.id` to bytes.

    Example:

    >>> x = jax.device_put(jnp.zeros((8, 4)), jax.devices()[0])
    >>> live_bytes_per_device()[jax.devices()[0].id] >= 128
    True
    """
    if devices is None:
        devices = jax.local_devices()
    totals = {int(d.id): 0 for d in devices}
    seen: set[tuple[int, Any]] = set()
    for array in jax.live_arrays() if arrays is None else arrays:
        try:
            if array.is_deleted():
                continue
            entries = shard_entries(array)
        except Exception:  # noqa: BLE001 - deleted by another thread meanwhile
            continue
        for device_id, pointer, nbytes in entries:
            if (device_id, pointer) in seen:
                continue
            seen.add((device_id, pointer))
            totals[device_id] = totals.get(device_id, 0) + nbytes
    return totals


class LiveTally:
    """`live_bytes_per_device()`, updated by the arrays that came and went.

    Each `count()` equals a fresh `live_bytes_per_device()` (tested side by
    side in tests/measure/test_memory.py); it looks at each live array's id
    only, and at the shards of the arrays it has not seen. An array leaves
    the tally when `jax.live_arrays()` stops listing it (deleted, donated)
    or when it is freed (a weak reference's callback, so that a freed
    array's id reused by a new array is never taken for the old one).
    Buffers shared by several arrays count once, as there.
    """

    def __init__(self, devices: Sequence[Any]) -> None:
        self._totals = {int(d.id): 0 for d in devices}
        self._known: dict[int, tuple[weakref.ref, _ShardEntries]] = {}
        self._holders: collections.Counter[tuple[int, Any]] = collections.Counter()
        # Appended to by whichever thread frees an array; drained by count().
        self._freed: collections.deque[tuple[int, weakref.ref]] = collections.deque()
        self._lock = threading.Lock()

    def count(self) -> dict[int, int]:
        """Bytes per device id of the arrays live now."""
        arrays = jax.live_arrays()
        with self._lock:
            while self._freed:
                key, ref = self._freed.popleft()
                known = self._known.get(key)
                if known is not None and known[0] is ref:
                    self._forget(key)
            # Gone before new: a buffer freed by a deleted array may already
            # hold a new array's bytes.
            for key in self._known.keys() - set(map(id, arrays)):
                self._forget(key)
            freed = self._freed.append
            for array in arrays:
                key = id(array)
                if key in self._known:
                    continue
                try:
                    entries = shard_entries(array)
                except Exception:  # noqa: BLE001 - deleted by another thread meanwhile
                    continue
                ref = weakref.ref(array, lambda ref, key=key: freed((key, ref)))
                self._known[key] = (ref, entries)
                for device_id, pointer, nbytes in entries:
                    self._holders[(device_id, pointer)] += 1
                    if self._holders[(device_id, pointer)] == 1:
                        self._totals[device_id] = self._totals.get(device_id, 0) + nbytes
            return dict(self._totals)

    def _forget(self, key: int) -> None:
        _, entries = self._known.pop(key)
        for device_id, pointer, nbytes in entries:
            self._holders[(device_id, pointer)] -= 1
            if not self._holders[(device_id, pointer)]:
                del self._holders[(device_id, pointer)]
                self._totals[device_id] -= nbytes
