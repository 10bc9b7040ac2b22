"""Per-device memory accounting: live arrays per shard, compiled temps, host RSS.

Accelerators report their allocator's figures through `device.memory_stats()`
(`bytes_in_use`, `peak_bytes_in_use`); the CPU platform reports nothing, so on
CPU the per-device figure is the sum of the bytes of every live `jax.Array`
shard on that device (`jax.live_arrays()`, each array's `addressable_shards`,
each buffer counted once even when several arrays share it), plus the
temporary buffers of the XLA programs compiled while sampling
(`compiled.memory_analysis().temp_size_in_bytes`), which never appear as
arrays. Host memory is the process's resident set and its high-water mark
(`keras_hub_dist.measure.host_rss`, whose functions this module re-exports).
Compilations and runs are seen through `keras_hub_dist.measure.program_watch`.

Example:

```python
import jax
import jax.numpy as jnp
from keras_hub_dist.measure import memory

with memory.MemorySampler() as sampler:
    x = jnp.ones((1024, 1024))  # 4 MiB on device 0
    x.block_until_ready()
    sampler.sample()
print(sampler.peak_per_device[0] >= 4 * 2**20)  # True
```
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from keras_hub_dist.measure import program_watch
from keras_hub_dist.measure.host_rss import (
    current_rss_bytes,
    host_peak_rss_bytes,
    reset_host_peak_rss,
)
from keras_hub_dist.measure.live_bytes import (
    LiveTally,
    live_bytes_per_device,
    prune_shard_cache,
)

__all__ = [
    "MemorySampler",
    "compiled_memory",
    "current_rss_bytes",
    "device_memory_stats",
    "host_peak_rss_bytes",
    "live_bytes_per_device",
    "reset_host_peak_rss",
]



def device_memory_stats(device: Any) -> dict[str, int] | None:
    """`device.memory_stats()` when the platform reports `bytes_in_use`, else None.

    TPU and GPU report it; the CPU platform returns None.
    """
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - unimplemented on some platforms
        return None
    if not stats or "bytes_in_use" not in stats:
        return None
    return {str(k): int(v) for k, v in stats.items() if isinstance(v, int)}


_COMPILED_FIELDS = {
    "argument_bytes": "argument_size_in_bytes",
    "output_bytes": "output_size_in_bytes",
    "temp_bytes": "temp_size_in_bytes",
    "alias_bytes": "alias_size_in_bytes",
    "code_bytes": "generated_code_size_in_bytes",
    "peak_bytes": "peak_memory_in_bytes",
}


def _raw_memory_stats(compiled: Any) -> Any:
    if hasattr(compiled, "memory_analysis"):
        return compiled.memory_analysis()
    if hasattr(compiled, "get_compiled_memory_stats"):
        return compiled.get_compiled_memory_stats()
    raise TypeError(
        "Expected a `jax.stages.Compiled` (e.g. `jax.jit(f).lower(x).compile()`)"
        " or a loaded XLA executable. Received: "
        f"{type(compiled).__name__}."
    )


def compiled_memory(compiled: Any) -> dict[str, int]:
    """Per-device memory of one compiled program, from XLA's buffer assignment.

    Args:
        compiled: A `jax.stages.Compiled` or a loaded XLA executable.

    Returns:
        `argument_bytes`, `output_bytes`, `temp_bytes`, `alias_bytes`,
        `code_bytes` and, where XLA reports it, `peak_bytes`; figures of the
        program one device runs. Empty if the platform reports nothing.

    Example:

    >>> c = jax.jit(lambda x: x @ x.T).lower(jnp.ones((64, 64))).compile()
    >>> compiled_memory(c)["output_bytes"]
    16384
    """
    try:
        stats = _raw_memory_stats(compiled)
    except NotImplementedError:
        return {}
    if stats is None:
        return {}
    result = {}
    for key, attr in _COMPILED_FIELDS.items():
        value = getattr(stats, attr, None)
        if value is not None:
            result[key] = int(value)
    return result


def _compiled_device_ids(compiled: Any) -> list[int]:
    executable = compiled
    if hasattr(compiled, "runtime_executable"):
        executable = compiled.runtime_executable()
    try:
        return [int(d.id) for d in executable.local_devices()]
    except Exception:  # noqa: BLE001 - fall back to every local device
        return [int(d.id) for d in jax.local_devices()]


class _Window:
    """A program's temp buffers, from its run until its outputs are ready."""

    __slots__ = ("temp", "devices", "outputs", "until_next_compile")

    def __init__(
        self,
        temp: int,
        devices: Sequence[int],
        outputs: Sequence[Any],
        until_next_compile: bool = False,
    ) -> None:
        self.temp = temp
        self.devices = devices
        self.outputs = []
        for o in outputs:
            try:
                self.outputs.append(weakref.ref(o))
            except TypeError:  # not an array: nothing to wait for
                continue
        self.until_next_compile = until_next_compile

    def done(self) -> bool:
        if self.until_next_compile:
            return False
        for ref in self.outputs:
            array = ref()
            try:
                if array is not None and not array.is_deleted() and not array.is_ready():
                    return False
            except Exception:  # noqa: BLE001 - deleted meanwhile: done
                continue
        return True


class MemorySampler:
    """Samples per-device memory on a background thread while a block runs.

    On entering, Python's unreachable objects are collected first, then the
    host peak RSS is reset and sampling starts every `interval_s`; on exit a
    last sample is taken. (Garbage left by earlier work can hold arrays: were
    it counted in the start figure and collected inside the block, the
    block's final figure, taken against that start, would shrink by its
    bytes and its peak over final grow; a collection right after a load
    turned a 1.00x LoRA load into 2.07x.) Sampling cannot see an
    allocation that lives shorter than the interval, so call `sample()` at
    the points you know matter (or block on the work before leaving the
    block), and keep the interval short.

    Figures per device id:

    - `live_peak_per_device` / `live_final_per_device`: live-array bytes
      (see `live_bytes_per_device`), sampled.
    - `temp_per_device`: the largest temp buffer of any XLA program that was
      compiled or run in the block (watched automatically) or passed to
      `add_compiled`.
    - `peak_per_device`: where the platform has `memory_stats()`, the
      allocator's `peak_bytes_in_use` (which covers temps). Else, from live
      arrays and XLA's temp sizes: at each sample, the live bytes (of this
      sample or the one before) plus the temps of the programs running
      meanwhile, a program running from its call until its outputs are
      ready. JAX's C++ fast path (a jit object called again with the same
      argument types) is not watched, so such a repeat run's temps are not
      counted; programs passed to `add_compiled` (run who knows when) add
      their temp to the overall live peak.
    - `final_per_device`: `bytes_in_use`, else live bytes at exit.
    - `timeline`: `[(seconds since entry, {device id: bytes})]` of the same
      source as `peak_per_device` (without temps); `timeline_with_temps`
      adds the temps of the programs running at each sample (live-array
      source only; equal to `timeline` with `memory_stats()`).

    Args:
        interval_s: Seconds between samples.
        devices: Devices to report; default: `jax.local_devices()`.
        use_memory_stats: Use `device.memory_stats()`; default: when every
            device reports it.
        watch_compiles: Watch compilations and runs of XLA programs to count
            their temps automatically.

    Example:

    ```python
    with MemorySampler() as sampler:
        model = build_model()
        jax.block_until_ready([v.value for v in model.weights])
    sampler.peak_per_device, sampler.final_per_device, sampler.host_peak_rss
    ```
    """

    def __init__(
        self,
        interval_s: float = 0.002,
        *,
        devices: Sequence[Any] | None = None,
        use_memory_stats: bool | None = None,
        watch_compiles: bool = True,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(
                f"Expected interval_s > 0. Received: interval_s={interval_s}."
            )
        self.interval_s = float(interval_s)
        self.devices = list(devices if devices is not None else jax.local_devices())
        self.device_ids = [int(d.id) for d in self.devices]
        if use_memory_stats is None:
            use_memory_stats = all(
                device_memory_stats(d) is not None for d in self.devices
            )
        self.source = "memory_stats" if use_memory_stats else "live_arrays"
        self.watch_compiles = watch_compiles
        self.timeline: list[tuple[float, dict[int, int]]] = []
        self.timeline_with_temps: list[tuple[float, dict[int, int]]] = []
        self.host_timeline: list[tuple[float, int]] = []
        self.live_peak_per_device: dict[int, int] = dict.fromkeys(self.device_ids, 0)
        self.live_final_per_device: dict[int, int] = {}
        self.start_per_device: dict[int, int] = {}
        self.temp_per_device: dict[int, int] = dict.fromkeys(self.device_ids, 0)
        self.compiled: list[dict[str, Any]] = []
        self.executions_seen = 0
        self.peak_per_device: dict[int, int] = {}
        self.final_per_device: dict[int, int] = {}
        self.host_start_rss = 0
        self.host_final_rss = 0
        self.host_peak_rss = 0
        self.host_peak_reset = False
        self.wall_s = 0.0
        self._explicit_temp: dict[int, int] = dict.fromkeys(self.device_ids, 0)
        self._bound_peak: dict[int, int] = dict.fromkeys(self.device_ids, 0)
        self._prev_live: dict[int, int] = dict.fromkeys(self.device_ids, 0)
        self._programs: dict[int, tuple[Any, int, list[int]]] = {}
        self._windows: list[_Window] = []
        self._watching_runs = False
        self._stats_peak: dict[int, int] = dict.fromkeys(self.device_ids, 0)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watches: list[Any] = []
        self._tally = LiveTally(self.devices)
        self._t0 = 0.0
        self._running = False

    # -- sampling ---------------------------------------------------------

    def _stats_bytes(self) -> dict[int, int]:
        result = {}
        for device in self.devices:
            stats = device_memory_stats(device) or {}
            did = int(device.id)
            result[did] = stats.get("bytes_in_use", 0)
            peak = stats.get("peak_bytes_in_use", result[did])
            self._stats_peak[did] = max(self._stats_peak[did], peak)
        return result

    def sample(self) -> dict[int, int]:
        """Takes one sample now and returns it (bytes per device id)."""
        # A window counts with every live snapshot that begins while it is
        # open, and with the first that begins after it closed: that one holds
        # the program's outputs. (Reading the windows only after the walk, which
        # can take a while, would pair a temp with a snapshot from before the
        # program's outputs existed.)
        with self._lock:
            opened = list(self._windows)
            closed = {id(w) for w in opened if w.done()}
        live = self._tally.count()
        live = {d: live.get(d, 0) for d in self.device_ids}
        now = time.perf_counter() - self._t0
        rss = current_rss_bytes()
        with self._lock:
            if self.source == "memory_stats":
                point = self._stats_bytes()
            else:
                point = live
            running = dict.fromkeys(self.device_ids, 0)
            for window in opened:
                for d in window.devices:
                    if d in running:
                        running[d] += window.temp
            self._windows = [w for w in self._windows if id(w) not in closed]
            for d, b in live.items():
                if b > self.live_peak_per_device[d]:
                    self.live_peak_per_device[d] = b
                bound = max(b, self._prev_live[d]) + running[d]
                if bound > self._bound_peak[d]:
                    self._bound_peak[d] = bound
            self._prev_live = live
            self.timeline.append((now, point))
            if self.source == "memory_stats":
                self.timeline_with_temps.append((now, point))
            else:
                self.timeline_with_temps.append(
                    (now, {d: live[d] + running[d] for d in self.device_ids})
                )
            self.host_timeline.append((now, rss))
        return point

    def _run(self) -> None:
        count = 0
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - keep sampling; a sample may race
                continue
            count += 1
            if count % 500 == 0:
                prune_shard_cache()

    def _program(self, executable: Any, name: str | None) -> tuple[int, list[int]]:
        # Keeping the executable alive keeps its id unique while we hold it.
        known = self._programs.get(id(executable))
        if known is not None:
            return known[1], known[2]
        figures = compiled_memory(executable)
        devices = _compiled_device_ids(executable)
        temp = figures.get("temp_bytes", 0)
        self._programs[id(executable)] = (executable, temp, devices)
        for d in devices:
            self.temp_per_device[d] = max(self.temp_per_device.get(d, 0), temp)
        self.compiled.append(
            {
                "t": time.perf_counter() - self._t0 if self._t0 else 0.0,
                "name": name or "?",
                "devices": devices,
                **figures,
            }
        )
        return temp, devices

    def _on_compile(self, executable: Any, name: str) -> None:
        with self._lock:
            temp, devices = self._program(executable, name)
            if not self._watching_runs:
                # No run hook: assume it runs until the next compilation.
                for w in self._windows:
                    w.until_next_compile = False
                self._windows.append(_Window(temp, devices, (), until_next_compile=True))

    def _on_execute(self, executable: Any, outputs: Any) -> None:
        with self._lock:
            temp, devices = self._program(executable, None)
            self.executions_seen += 1
            if temp:
                self._windows.append(_Window(temp, devices, list(outputs or ())))

    def add_compiled(self, compiled: Any, *, name: str | None = None) -> dict[str, int]:
        """Counts a compiled program's temp buffers on each of its devices.

        Programs compiled or run inside the block are watched automatically
        (unless `watch_compiles=False`); add the ones you ran through a path
        that is not watched yourself: their temp is added to the live peak.

        Returns:
            The program's `compiled_memory` figures.
        """
        figures = compiled_memory(compiled)
        device_ids = _compiled_device_ids(compiled)
        temp = figures.get("temp_bytes", 0)
        with self._lock:
            for d in device_ids:
                self._explicit_temp[d] = max(self._explicit_temp.get(d, 0), temp)
                self.temp_per_device[d] = max(self.temp_per_device.get(d, 0), temp)
            self.compiled.append(
                {
                    "t": time.perf_counter() - self._t0 if self._t0 else 0.0,
                    "name": name or "?",
                    "devices": device_ids,
                    **figures,
                }
            )
        return figures

    # -- context manager --------------------------------------------------

    def __enter__(self) -> "MemorySampler":
        if self._running:
            raise RuntimeError("Expected a MemorySampler to be entered once at a time.")
        self._running = True
        gc.collect()
        self.host_peak_reset = reset_host_peak_rss()
        self._t0 = time.perf_counter()
        self.host_start_rss = current_rss_bytes()
        self.start_per_device = dict(self.sample())
        if self.watch_compiles:
            runs = program_watch.watch_executions(self._on_execute)
            self._watching_runs = runs.__enter__()
            compiles = program_watch.watch_compilations(self._on_compile)
            compiles.__enter__()
            self._watches = [compiles, runs]
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._run, name="keras_hub_dist-memory-sampler", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for watch in self._watches:
            watch.__exit__(None, None, None)
        self._watches = []
        last = self.sample()
        self.wall_s = time.perf_counter() - self._t0
        self.live_final_per_device = {
            d: live_bytes_per_device(devices=self.devices).get(d, 0)
            for d in self.device_ids
        }
        if self.source == "memory_stats":
            self.final_per_device = dict(last)
            self.peak_per_device = {
                d: max(self._stats_peak[d], max(p[d] for _, p in self.timeline))
                for d in self.device_ids
            }
        else:
            self.final_per_device = dict(self.live_final_per_device)
            self.peak_per_device = {
                d: max(
                    self._bound_peak.get(d, 0),
                    self.live_peak_per_device[d] + self._explicit_temp.get(d, 0),
                )
                for d in self.device_ids
            }
        self.host_final_rss = current_rss_bytes()
        self.host_peak_rss = max(host_peak_rss_bytes(), self.host_final_rss)
        self._windows = []
        self._programs.clear()
        self._running = False
        self._tally = LiveTally(self.devices)  # lets go of its weak references
        prune_shard_cache()

    # -- summaries --------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict (device ids as strings)."""

        def by_id(values: Mapping[int, int]) -> dict[str, int]:
            return {str(d): int(values.get(d, 0)) for d in self.device_ids}

        return {
            "source": self.source,
            "interval_s": self.interval_s,
            "wall_s": self.wall_s,
            "devices": [
                {"id": int(d.id), "platform": d.platform, "kind": d.device_kind}
                for d in self.devices
            ],
            "start_per_device": by_id(self.start_per_device),
            "peak_per_device": by_id(self.peak_per_device),
            "final_per_device": by_id(self.final_per_device),
            "live_peak_per_device": by_id(self.live_peak_per_device),
            "live_final_per_device": by_id(self.live_final_per_device),
            "temp_per_device": by_id(self.temp_per_device),
            "host_start_rss": self.host_start_rss,
            "host_final_rss": self.host_final_rss,
            "host_peak_rss": self.host_peak_rss,
            "host_peak_reset": self.host_peak_reset,
            "compiled_programs": len(self.compiled),
            "program_runs_seen": self.executions_seen,
        }
