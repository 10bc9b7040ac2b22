"""What the processes of a `jax.distributed` job must agree on, and how.

Saving and verifying a preset are split across processes; a failure seen by
one of them must end the operation on all of them, with the same error, or
the others would wait forever at the next collective. Each step therefore
ends with `check_all`: every process reports its own error (or none) and all
raise the first one together. With one process these are plain function
calls: no collective, no compilation.

The collectives are `jax.experimental.multihost_utils.process_allgather`
over small host arrays (gloo on CPU, the accelerator's own otherwise), and
`sum_disjoint_bytes` for the parts of a remote save that several processes
hold bytes of.

A process of the job lost mid-operation (preempted, OOM-killed) ends the
operation on the survivors with its `ProcessLostError`
(`raises_process_lost`, on every public operation), wherever they wait:
`_lost.py`, on the beats `initialize` starts. See docs/multi-host.md.

Example:

```python
error = None
try:
    write_my_blocks()
except OSError as e:
    error = f"writing failed: {e}"
check_all(error, SaveError, "Saving the preset failed")  # raises everywhere
```
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Sequence

import jax
import numpy as np

from keras_hub_dist import _compat, _lost
from keras_hub_dist._lost import (  # noqa: F401 - the operations' names for them
    LOAD_LEFT,
    RESTORE_LEFT,
    SAVE_LEFT,
    await_ready,
    lost_process_cause,
    lost_processes,
    process_lost,
    raises_process_lost,
    reached,
    watching_peers,
)

__all__ = [
    "broadcast_string",
    "check_all",
    "gather_bytes",
    "gather_strings",
    "initialize",
    "max_over_processes",
    "await_ready",
    "process_lost",
    "raises_process_lost",
    "watching_peers",
    "sum_disjoint_bytes",
    "sum_over_processes",
]

# A gathered string is cut to this many UTF-8 bytes (error messages, paths).
_MAX_STRING_BYTES = 8192


def _allgather(values: np.ndarray) -> np.ndarray:
    """Every process's `values`, stacked in process order: what
    `multihost_utils.process_allgather(values)` returns, but its wait is
    `await_ready` (a lost process raises within the heartbeat instead of
    holding `np.asarray` in native code)."""
    from jax.sharding import NamedSharding, PartitionSpec

    _lost.refuse_after_loss()
    reached("step")
    local = [d for d in jax.devices() if d.process_index == jax.process_index()]
    mesh, gather = _gatherer(jax.process_count(), len(local))
    host = np.ascontiguousarray(values)[None]
    spread = jax.make_array_from_single_device_arrays(
        (jax.process_count(), *values.shape), NamedSharding(mesh, PartitionSpec("processes")),
        [jax.device_put(host, device) for device in local],
    )
    gathered = gather(spread)
    await_ready(gathered)
    return np.asarray(gathered.addressable_data(0))


@functools.lru_cache(maxsize=None)
def _gatherer(process_count: int, local_count: int) -> tuple[jax.sharding.Mesh, object]:
    """The processes x local devices mesh, and the program that replicates
    a `(processes, ...)` array split over the processes."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array([
        [d for d in jax.devices() if d.process_index == p] for p in range(process_count)
    ])
    mesh = Mesh(devices, ("processes", "local"))
    return mesh, jax.jit(lambda x: x, out_shardings=NamedSharding(mesh, PartitionSpec()))


def gather_strings(text: str) -> list[str]:
    """Every process's `text`, in process order (on every process)."""
    if jax.process_count() == 1:
        return [text]
    data = text.encode("utf-8")[:_MAX_STRING_BYTES]
    packed = np.zeros(_MAX_STRING_BYTES + 4, np.uint8)
    packed[:4] = np.frombuffer(len(data).to_bytes(4, "little"), np.uint8)
    packed[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)
    out = []
    for row in _allgather(packed):
        length = int.from_bytes(row[:4].tobytes(), "little")
        out.append(row[4 : 4 + length].tobytes().decode("utf-8", errors="replace"))
    return out


def gather_bytes(data: bytes) -> list[bytes]:
    """Every process's `data`, whole, in process order (on every process):
    the lengths first, then the bytes padded to the longest."""
    if jax.process_count() == 1:
        return [data]
    lengths = _allgather(np.array([len(data)], np.int64)).reshape(-1)
    padded = np.zeros(max(1, int(lengths.max())), np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    return [row[: int(n)].tobytes() for row, n in zip(_allgather(padded), lengths)]


def broadcast_string(text: str) -> str:
    """Process 0's `text`, on every process."""
    return gather_strings(text)[0]


def sum_over_processes(values: np.ndarray) -> np.ndarray:
    """Element-wise sum of every process's `values` (same shape and dtype)."""
    if jax.process_count() == 1:
        return values
    return _allgather(values).sum(axis=0, dtype=values.dtype)


@functools.lru_cache(maxsize=None)
def _word_summer(process_count: int, local_count: int) -> tuple[jax.sharding.Mesh, object]:
    """The processes x local devices mesh, and a program summing a
    `(processes, words)` array over the processes into `(words,)` split over
    each process's own devices."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array([
        [d for d in jax.devices() if d.process_index == p] for p in range(process_count)
    ])
    mesh = Mesh(devices, ("processes", "local"))
    summer = jax.jit(
        lambda words: words.sum(axis=0, dtype=words.dtype),
        out_shardings=NamedSharding(mesh, PartitionSpec("local")),
    )
    return mesh, summer


def sum_disjoint_bytes(data: np.ndarray) -> np.ndarray:
    """Every process's `data` (uint8, same length), summed over the
    processes, where each byte is nonzero on at most one process (the pieces
    of a part that several processes write): the part, on every process.

    The bytes are summed as uint32 words (no byte carries into another, as at
    most one addend of each is nonzero), split over each process's devices:
    a device holds `2 x len(data) / local devices` bytes for a moment, where
    an all-gather (`sum_over_processes`) puts `(processes + 1) x len(data)`
    on every device (measured: 1.56x the per-device bytes of a 0.36 GB model
    saved by 2 processes with 8 MiB slices).
    """
    count = jax.process_count()
    if count == 1:
        return data
    from jax.sharding import NamedSharding, PartitionSpec

    _lost.refuse_after_loss()
    reached("step")
    _lost.STEP[0] = "Combining the bytes of a part that several processes hold"
    local = [d for d in jax.devices() if d.process_index == jax.process_index()]
    mesh, summer = _word_summer(count, len(local))
    per_device = -(-len(data) // (4 * len(local)))  # words
    words = np.zeros(per_device * len(local), np.uint32)
    words.view(np.uint8)[: len(data)] = data
    pieces = [
        jax.device_put(words[None, i * per_device : (i + 1) * per_device], device)
        for i, device in enumerate(local)
    ]
    spread = jax.make_array_from_single_device_arrays(
        (count, len(words)), NamedSharding(mesh, PartitionSpec("processes", "local")), pieces
    )
    del pieces
    summed = summer(spread)
    await_ready(summed)  # a lost process: raises, not waits forever
    spread.delete()
    out = np.empty(len(words), np.uint32)
    for shard in summed.addressable_shards:
        out[shard.index] = np.asarray(shard.data)
    summed.delete()
    return out.view(np.uint8)[: len(data)]


def check_all(error: str | None, error_class: type[Exception], context: str) -> None:
    """Raises `error_class` on every process if any process reports an error.

    Args:
        error: This process's error message, or `None`.
        error_class: The exception class raised everywhere.
        context: What was being done, the start of the message.

    Raises:
        error_class: With every failing process's message (prefixed by its
            index when there are several processes).
    """
    _lost.STEP[0] = context.removesuffix(" failed")
    if context.startswith("Publishing"):
        # Process 0 has published (error None) or failed to: a process lost
        # from here on leaves the target whole and readable.
        reached("publish")
        if error is None and jax.process_index() == 0:
            _lost.LEFT_NOW[:] = [_lost.PUBLISHED_LEFT]
    errors: Sequence[str] = gather_strings(error or "")
    failed = [(i, e) for i, e in enumerate(errors) if e]
    if not failed:
        return
    if len(errors) == 1:
        raise error_class(f"{context}: {failed[0][1]}")
    raise error_class(
        f"{context} on {len(failed)} of {len(errors)} processes: "
        + " | ".join(f"process {i}: {e}" for i, e in failed)
    )


def max_over_processes(values: np.ndarray) -> np.ndarray:
    """Element-wise maximum of every process's `values` (same shape, dtype)."""
    if jax.process_count() == 1:
        return values
    return _allgather(values).max(axis=0)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    heartbeat_timeout_s: int = 10,
    shutdown_timeout_s: int = 30,
    initialization_timeout_s: int = 300,
    seed: int | None = None,
) -> None:
    """Joins this process to the `jax.distributed` job, as
    `keras.distribution.initialize()` does (the same environment variables,
    one random seed for all processes), with timeouts that suit a pod where
    a host can be lost.

    JAX's defaults notice a lost process after a 100 s heartbeat and let a
    process wait 300 s for the others at exit; here a process that stops
    sending heartbeats for `heartbeat_timeout_s` is declared lost, and the
    survivors raise the operation's `ProcessLostError` within a few seconds
    more wherever they wait (docs/multi-host.md). Each process's host name
    and address are recorded, so that a `ProcessLostError` can name the
    lost process's host.

    Args:
        coordinator_address: Process 0's `host:port`; default: the first of
            `KERAS_DISTRIBUTION_JOB_ADDRESSES` (comma-separated), else JAX's
            own detection (TPU, Slurm, Open MPI, `JAX_COORDINATOR_ADDRESS`).
        num_processes: Default: `KERAS_DISTRIBUTION_NUM_PROCESSES`, else
            JAX's detection.
        process_id: Default: `KERAS_DISTRIBUTION_PROCESS_ID`, else JAX's
            detection.
        heartbeat_timeout_s: Seconds without a heartbeat after which the
            coordinator declares a process lost (JAX: 100).
        shutdown_timeout_s: Seconds a finishing process waits for the
            others at exit (JAX: 300).
        initialization_timeout_s: Seconds to wait for every process to join.
        seed: The random seed of every process; default: one drawn on each
            process and summed (as `keras.distribution.initialize()`).
    """
    env = os.environ
    if coordinator_address is None and env.get("KERAS_DISTRIBUTION_JOB_ADDRESSES"):
        coordinator_address = env["KERAS_DISTRIBUTION_JOB_ADDRESSES"].split(",")[0]
    if num_processes is None and env.get("KERAS_DISTRIBUTION_NUM_PROCESSES"):
        num_processes = int(env["KERAS_DISTRIBUTION_NUM_PROCESSES"])
    if process_id is None and env.get("KERAS_DISTRIBUTION_PROCESS_ID"):
        process_id = int(env["KERAS_DISTRIBUTION_PROCESS_ID"])
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=initialization_timeout_s,
        # JAX's coordinator aborts every process once one misses its
        # heartbeat (the PollForError it answers; nothing of Python runs):
        # later than the beats here notice the loss and the survivors raise
        # it or end (at most 1 + 1.5 heartbeats after), so that JAX's abort
        # is never reached (docs/multi-host.md: why not recoverability).
        heartbeat_timeout_seconds=4 * heartbeat_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s,
    )
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = "unknown address"
    client = _compat.distributed_client()
    if client is not None and jax.process_count() > 1:
        _lost.start_beats(client, heartbeat_timeout_s)
        # A test hook, documented in _lost.py: a process killed at an event.
        _lost.arm_test_kill(env.get("KERAS_HUB_DIST_TEST_KILL_AT"))
    drawn = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
    rows = [row.split(" ", 1) for row in gather_strings(f"{drawn} {name} ({address})")]
    _lost.HOSTS.update({index: host for index, (_, host) in enumerate(rows)})
    if seed is None:
        seed = sum(int(drawn) for drawn, _ in rows) % (1 << 32)
    import keras

    keras.utils.set_random_seed(seed)
