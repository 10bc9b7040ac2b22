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
(`raises_process_lost`, on every public operation), noticed at once where a
collective's connection closes and within the heartbeat where a wait would
never end (`await_ready`, `watching_peers`, on the beats `initialize`
starts); the survivors then end without waiting for the lost process at
exit. See docs/multi-host.md.

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

import atexit
import contextlib
import functools
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.errors import ProcessLostError, process_lost_class

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
    from jax.experimental import multihost_utils

    _refuse_after_loss()
    return np.asarray(multihost_utils.process_allgather(values, tiled=False))


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

    _refuse_after_loss()
    _STEP[0] = "Combining the bytes of a part that several processes hold"
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
    _STEP[0] = context.removesuffix(" failed")
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


# --- A lost process: one error, named, raised fast, and an exit that waits
# for nobody.
#
# A process killed mid-operation (preempted, OOM-killed) shows up on the
# survivors as a JaxRuntimeError of the collective they were in or next
# enter: gloo's "Connection closed by peer" / "reset by peer" (immediately),
# "Gloo context initialization failed: DEADLINE_EXCEEDED" (a new group of
# devices: after gloo's 30 s), or the coordination service's "Task N
# heartbeat timeout". `raises_process_lost` turns any of them, wherever the
# operation wrapped it, into the operation's `ProcessLostError`, and detaches
# JAX's distributed client so that the exit-time `jax.distributed.shutdown()`
# does not wait for the lost process at a barrier.

_LOST_SIGNS = re.compile(
    r"Gloo [\w -]*failed|heartbeat timeout|stopped sending heartbeats|tasks? (?:are|is) unhealthy"
    r"|lost earlier in this job",
    re.IGNORECASE,
)
# Only from JAX's runtime: an object store's reset connection is no lost process.
_JAX_LOST_SIGNS = re.compile(
    r"Connection closed by peer|Connection reset by peer|Socket closed|Connection refused|Broken pipe",
    re.IGNORECASE,
)
# What each kind of operation leaves behind when a process is lost.
LOAD_LEFT = "nothing: no model is returned, nothing was written, this process's device arrays go with it"
SAVE_LEFT = (
    "nothing published at the target (a preset already there is unchanged); the staging directory, or in "
    "a bucket the owner record and any multipart uploads not aborted, are swept by the next save to the "
    "same target (docs/multi-host.md)"
)
RESTORE_LEFT = "the model's variables partly restored: restore the checkpoint again in the restarted job"
_LOST: list[str] = []  # the first lost-process error seen, if any
_HOSTS: dict[int, str] = {}  # process id -> "hostname (address)", from `initialize`
_PHASE: list[str] = []  # the operations and phases running, outermost first
_STEP = [""]  # the last cross-process step entered (check_all's context)


# Beats: with `initialize`, each process sets its key in the coordination
# service's key-value store every second; a process whose key stops changing
# for the heartbeat timeout is lost. JAX's own heartbeat notices the same,
# but on a CPU a program whose collective waits for a dead process never
# ends (gloo's ring waits on the local devices' links), and nothing of JAX's
# tells Python: the waits below watch the beats instead.
_BEATS: dict[str, Any] = {}  # "client", "timeout_s", "seen": {key: (value, since)}
_BEAT_KEY = "keras_hub_dist/beat/"


def _beat(client: Any, key: str) -> None:
    count = 0
    while not _LOST:
        count += 1
        try:
            client.key_value_set(key, str(count), allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator gone: JAX itself ends this process
            return
        time.sleep(1.0)


def _silent_processes() -> list[int]:
    """The processes whose beat has not changed for the heartbeat timeout
    (at most one key-value read a second)."""
    now, state = time.monotonic(), _BEATS
    if now - state.setdefault("read", 0.0) >= 1.0:
        state["read"] = now
        try:
            beats = dict(state["client"].key_value_dir_get(_BEAT_KEY))
        except Exception:  # noqa: BLE001 - the coordinator gone: JAX itself ends this process
            return []
        seen = state["seen"]
        for key, value in beats.items():
            if seen.get(key, (None,))[0] != value:
                seen[key] = (value, now)
    me = jax.process_index()
    return [
        p for p in range(jax.process_count())
        if p != me and now - state["seen"].get(f"{_BEAT_KEY}{p}", (None, now))[1] > state["timeout_s"]
    ]


def _silence(silent: list[int]) -> RuntimeError:
    return RuntimeError(
        " ".join(f"Task {p} heartbeat timeout." for p in silent)
        + f" (no keras_hub_dist beat for {_BEATS['timeout_s']} s)"
    )


def watching_peers(function: Callable, *args: Any) -> Any:
    """`function(*args)`, run in a helper thread while this one watches the
    beats: a lost process raises here (the call is left behind) instead of
    waiting in a cross-process wait that only its own timeout ends (Orbax's
    barriers: minutes)."""
    if not _BEATS or jax.process_count() == 1:
        return function(*args)
    done, box = threading.Event(), {}

    def run() -> None:
        try:
            box["value"] = function(*args)
        except BaseException as error:  # noqa: BLE001 - re-raised by the caller
            box["error"] = error
        finally:
            done.set()

    threading.Thread(target=run, name="khd-watched", daemon=True).start()
    while not done.wait(0.05):
        if silent := _silent_processes():
            raise _silence(silent)
    if "error" in box:
        raise box["error"]
    return box["value"]


def await_ready(array: jax.Array) -> None:
    """`array.block_until_ready()`, but a program waiting for a lost
    process raises (`Task N heartbeat timeout`) instead of waiting forever."""
    if not _BEATS or jax.process_count() == 1:
        array.block_until_ready()
        return
    pause = 0.001
    while not array.is_ready():
        time.sleep(pause)
        pause = min(2 * pause, 0.1)
        if silent := _silent_processes():
            raise _silence(silent)
    array.block_until_ready()  # raises the program's own error, if any


@atexit.register  # after JAX's (imported above), so it runs before JAX's clean-up
def _exit_after_loss() -> None:
    """A process that saw a lost process ends here, with status 1: JAX's
    exit-time clean-up would wait for programs stuck on the lost process
    (and for it at a shutdown barrier)."""
    if _LOST:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)


def _end_on_uncaught_loss() -> None:
    """An uncaught error ends the process as soon as its traceback is
    printed: Python would first join threads left waiting on the lost
    process (a thread pool's call stuck at an Orbax barrier)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, traceback: Any) -> None:
        previous(kind, value, traceback)
        _exit_after_loss()

    sys.excepthook = hook


def _refuse_after_loss() -> None:
    """Fails at once a collective entered after a loss (e.g. in a failed
    save's clean-up): it would wait up to gloo's 30 s for the lost process."""
    if _LOST:
        raise RuntimeError(f"A process of this job was lost earlier in this job: {_LOST[0]}")


def lost_process_cause(error: BaseException) -> BaseException | None:
    """The innermost error of `error`'s chain (causes, contexts, wrapped
    messages) that says a process of the job is gone, or `error` itself
    after a loss seen earlier; `None` if none does (or one process)."""
    if jax.process_count() == 1:
        return None
    seen: set[int] = set()
    found, current = None, error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = f"{type(current).__name__}: {current}"
        if _LOST_SIGNS.search(text) or (
            type(current).__name__ in ("JaxRuntimeError", "XlaRuntimeError") and _JAX_LOST_SIGNS.search(text)
        ):
            found = current
        current = current.__cause__ or current.__context__
    return found or (error if _LOST else None)


def lost_processes(text: str) -> tuple[int, ...]:
    """The process ids `text` names as lost: the coordination service's
    "Task N heartbeat timeout" / unhealthy tasks, or gloo's peer address
    when one other process has it; with 2 processes, the other one."""
    ids = {int(n) for n in re.findall(r"Task (\d+) heartbeat timeout", text)}
    if unhealthy := re.search(r"stopped sending heartbeats\):\s*([\d,\s]+)", text):
        ids |= {int(n) for n in re.findall(r"\d+", unhealthy.group(1))}
    me, count = jax.process_index(), jax.process_count()
    if not ids and (peer := re.search(r"peer \[([^\]]+)\]", text)):
        at = [p for p, host in _HOSTS.items() if p != me and host.endswith(f"({peer.group(1)})")]
        ids = set(at) if len(at) == 1 else ids
    if not ids and count == 2:
        ids = {1 - me}
    return tuple(sorted(ids - {me}))


def _first_line(text: str, limit: int = 400) -> str:
    line = " ".join(text.strip().split("\n")[0].split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def process_lost(error: BaseException, error_class: type[Exception], operation: str, left: str) -> ProcessLostError | None:
    """The `ProcessLostError` (also an `error_class`) that `error` amounts
    to, or `None` when it does not say a process is lost. Detaches JAX's
    distributed client once a loss is seen."""
    cause = lost_process_cause(error)
    if cause is None:
        return None
    text = f"{type(cause).__name__}: {cause}"
    if not _LOST:
        _LOST.append(_first_line(text))
        _compat.distributed_client(detach=True)
        _end_on_uncaught_loss()
    lost = lost_processes(text)
    hosts = [f"process {p}" + (f" on {_HOSTS[p]}" if p in _HOSTS else "") for p in lost]
    who = ", ".join(hosts) if hosts else f"another process (this one is process {jax.process_index()})"
    where = " > ".join(_PHASE) or operation
    step = f' (the last cross-process step begun: "{_STEP[0]}")' if _STEP[0] else ""
    return process_lost_class(error_class)(
        f"{operation.capitalize()} lost {who} of the {jax.process_count()}-process jax.distributed job "
        f"during {where}{step}. Expected every process to take part in that step; received from JAX on "
        f"process {jax.process_index()}: {_LOST[0]} No file or variable is at fault. Left behind: {left}. "
        "Fix: find why that process died (its log, the scheduler's preemption or OOM events), then "
        "restart the whole job, every process. This process no longer waits for the lost one at exit; "
        "start jobs with keras_hub_dist.initialize() so that a loss is noticed within its heartbeat.",
        lost=lost, phase=where, left=left,
    )


def raises_process_lost(error_class: type[Exception], operation: str, left: str) -> Callable:
    """Decorates a public operation: an error that says a process of the
    job was lost, wherever it was raised or wrapped, leaves as the
    operation's `ProcessLostError` (`process_lost`)."""

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            _PHASE.append(operation)
            try:
                return function(*args, **kwargs)
            except ProcessLostError:
                raise
            except Exception as error:
                lost = process_lost(error, error_class, operation, left)
                if lost is None:
                    raise
                raise lost from lost_process_cause(error)
            finally:
                _PHASE.pop()
                if not _PHASE:
                    _STEP[0] = ""

        return run

    return decorate


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
    sending heartbeats for `heartbeat_timeout_s` is declared lost. Each
    process's host name and address are recorded, so that a
    `ProcessLostError` can name the lost process's host.

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
        # heartbeat: later than the beats here notice the loss, so that the
        # survivors raise ProcessLostError first and end on their own.
        heartbeat_timeout_seconds=2 * heartbeat_timeout_s,
        shutdown_timeout_seconds=shutdown_timeout_s,
    )
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        address = "unknown address"
    client = _compat.distributed_client()
    if client is not None and jax.process_count() > 1:
        _BEATS.update(client=client, timeout_s=heartbeat_timeout_s, seen={})
        key = f"{_BEAT_KEY}{jax.process_index()}"
        threading.Thread(target=_beat, args=(client, key), name="khd-beat", daemon=True).start()
    drawn = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
    rows = [row.split(" ", 1) for row in gather_strings(f"{drawn} {name} ({address})")]
    _HOSTS.update({index: host for index, (_, host) in enumerate(rows)})
    if seed is None:
        seed = sum(int(drawn) for drawn, _ in rows) % (1 << 32)
    import keras

    keras.utils.set_random_seed(seed)
