"""Tests of the per-device memory accounting (keras_hub_dist.memory)."""

import gc
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from keras_hub_dist.measure import memory
from conftest import MESH_SHAPES

MIB = 2**20


@pytest.fixture(autouse=True)
def _no_garbage_from_earlier_tests():
    """The sampler tests assert exact byte deltas: arrays of models that
    earlier tests left to the cycle collector must not be freed mid-test."""
    gc.collect()
    yield


def _mesh(shape):
    devices = np.array(jax.devices()).reshape(shape)
    return Mesh(devices, ("batch", "model"))


def _full_on_device0(rows=1024, cols=1024):
    # 4 MiB of f32, whole on device 0.
    x = jax.device_put(np.ones((rows, cols), np.float32), jax.devices()[0])
    return x.block_until_ready()


def _baseline():
    # Arrays other tests or JAX itself keep alive must not leak into ours.
    return memory.live_bytes_per_device()


def _delta(after, before):
    return {d: after[d] - before.get(d, 0) for d in after}


def _background_samples(sampler, count=2, timeout_s=60.0):
    """Waits until the sampler's own thread has taken `count` more samples
    (however busy the machine), so what exists now is seen by the thread
    itself, not by a sleep that hopes it was long enough."""
    with sampler._lock:
        target = len(sampler.timeline) + count
    deadline = time.monotonic() + timeout_s
    while len(sampler.timeline) < target:
        assert time.monotonic() < deadline, "the sampler thread took no samples"
        time.sleep(0.001)


def test_live_bytes_full_array_on_device0():
    before = _baseline()
    x = _full_on_device0()
    delta = _delta(memory.live_bytes_per_device(), before)
    assert delta[0] == 4 * MIB
    assert all(delta[d] == 0 for d in range(1, 8))
    del x


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_live_bytes_sharded_array_per_shard(mesh_shape):
    before = _baseline()
    mesh = _mesh(mesh_shape)
    y = jax.device_put(
        np.ones((1024, 1024), np.float32),
        NamedSharding(mesh, PartitionSpec("batch", "model")),
    )
    delta = _delta(memory.live_bytes_per_device(), before)
    assert all(delta[d] == 4 * MIB // 8 for d in range(8)), delta
    del y


def test_replicated_array_counts_on_every_device():
    before = _baseline()
    mesh = _mesh((1, 8))
    y = jax.device_put(np.ones((256, 256), np.float32), NamedSharding(mesh, PartitionSpec()))
    delta = _delta(memory.live_bytes_per_device(), before)
    assert all(delta[d] == 256 * 256 * 4 for d in range(8))
    del y


def test_shared_buffers_are_counted_once():
    before = _baseline()
    mesh = _mesh((1, 8))
    sharding = NamedSharding(mesh, PartitionSpec(None, "model"))
    pieces = [
        jax.device_put(np.full((64, 8), i, np.float32), d)
        for i, d in enumerate(mesh.devices.flat)
    ]
    whole = jax.make_array_from_single_device_arrays((64, 64), sharding, pieces)
    shard_views = [s.data for s in whole.addressable_shards]
    delta = _delta(memory.live_bytes_per_device(), before)
    # `pieces`, `whole` and `shard_views` hold the same 8 buffers.
    assert all(delta[d] == 64 * 8 * 4 for d in range(8)), delta
    del whole, pieces, shard_views


def test_deleted_and_dropped_arrays_disappear():
    before = _baseline()
    x = _full_on_device0()
    y = _full_on_device0(512, 512)
    assert _delta(memory.live_bytes_per_device(), before)[0] == 5 * MIB
    x.delete()
    assert _delta(memory.live_bytes_per_device(), before)[0] == MIB
    del y
    assert _delta(memory.live_bytes_per_device(), before)[0] == 0


def test_live_tally_equals_a_fresh_walk_through_churn():
    """The sampler's incremental count equals `live_bytes_per_device()` after
    every kind of change: new arrays, shared buffers, deletion, donation
    (the freed buffer reused by the output), arrays freed and their ids
    reused by new arrays of other sizes."""
    from keras_hub_dist.measure.live_bytes import LiveTally

    tally = LiveTally(jax.local_devices())
    steps = []
    keep = [_full_on_device0(256, 256)]
    steps.append(tally.count() == memory.live_bytes_per_device())
    mesh = _mesh((2, 4))
    sharded = jax.device_put(np.ones((64, 64), np.float32), NamedSharding(mesh, PartitionSpec("batch", "model")))
    views = [s.data for s in sharded.addressable_shards]  # the same buffers again
    steps.append(tally.count() == memory.live_bytes_per_device())
    keep[0].delete()
    steps.append(tally.count() == memory.live_bytes_per_device())
    donated = jax.jit(lambda x: x * 2, donate_argnums=0)(sharded)
    steps.append(tally.count() == memory.live_bytes_per_device())
    del views, sharded
    for rows in (8, 300, 17, 1024):  # ids freed and reused, other sizes each time
        keep = [_full_on_device0(rows, 64) for _ in range(3)]
        steps.append(tally.count() == memory.live_bytes_per_device())
    del keep, donated
    steps.append(tally.count() == memory.live_bytes_per_device())
    assert all(steps), steps


def test_explicit_arrays_argument():
    x = _full_on_device0(256, 256)
    counted = memory.live_bytes_per_device([x, x])
    assert counted[0] == 256 * 256 * 4
    assert set(counted) == set(range(8))


@pytest.mark.parametrize("mesh_shape", MESH_SHAPES)
def test_sampler_known_pattern_peaks(mesh_shape):
    """One full array on device 0, then a sharded one: the classic spike."""
    mesh = _mesh(mesh_shape)
    base = _baseline()
    with memory.MemorySampler(interval_s=0.001, watch_compiles=False) as sampler:
        x = _full_on_device0()  # 4 MiB on device 0
        _background_samples(sampler)  # the background thread sees it too
        # From host memory, so each device receives only its own block.
        sharded = jax.device_put(
            np.ones((1024, 1024), np.float32),
            NamedSharding(mesh, PartitionSpec("batch", "model")),
        )
        sharded.block_until_ready()
        sampler.sample()
        del x
        _background_samples(sampler)
    peak = _delta(sampler.peak_per_device, base)
    final = _delta(sampler.final_per_device, base)
    shard = 4 * MIB // 8
    # Device 0 held the whole array and its own shard at once.
    assert peak[0] == 4 * MIB + shard
    assert all(peak[d] == shard for d in range(1, 8)), peak
    assert all(final[d] == shard for d in range(8)), final
    assert sampler.source == "live_arrays"
    # The timeline shows the spike before the shards existed.
    assert any(p[0] - base[0] == 4 * MIB and p[1] - base[1] == 0 for _, p in sampler.timeline)
    del sharded


def test_garbage_from_before_the_block_is_not_the_blocks_memory():
    """Arrays held only by a reference cycle left before the block are
    collected on entering: collected inside the block instead (an automatic
    collection right after a load), they would have been counted in the
    start figure and taken off the final one."""
    gc.disable()
    try:
        cycle = [_full_on_device0()]  # 4 MiB that only a cycle keeps
        cycle.append(cycle)
        del cycle
        base = _baseline()  # the cycle's 4 MiB still counted here
        with memory.MemorySampler(interval_s=0.001, watch_compiles=False) as sampler:
            x = _full_on_device0(512, 512)  # the block's own 1 MiB
            sampler.sample()
            gc.collect()
    finally:
        gc.enable()
    start = _delta(sampler.start_per_device, base)
    assert start[0] == -4 * MIB  # the garbage went before the start figure
    assert sampler.peak_per_device[0] - sampler.start_per_device[0] == MIB
    assert sampler.final_per_device[0] - sampler.start_per_device[0] == MIB
    del x


def test_sampler_background_thread_catches_unsampled_spike():
    base = _baseline()
    with memory.MemorySampler(interval_s=0.001, watch_compiles=False) as sampler:
        x = _full_on_device0()
        _background_samples(sampler)  # no explicit sample(): only the thread sees it
        del x
    assert sampler.peak_per_device[0] - base[0] == 4 * MIB
    assert sampler.final_per_device[0] - base[0] == 0


def test_sampler_counts_compiled_temps():
    mesh = _mesh((1, 8))
    sharding = NamedSharding(mesh, PartitionSpec(None, "model"))
    y = jax.device_put(np.ones((512, 512), np.float32), sharding)

    def f(a):
        # The row-sum needs the full matrix gathered: a temp, never an array.
        return jnp.sin(a) @ a.T

    with memory.MemorySampler(interval_s=0.005) as sampler:
        z = jax.jit(f, out_shardings=sharding)(y)
        z.block_until_ready()
    programs = [c for c in sampler.compiled if c["name"].endswith("f")]
    assert programs, sampler.compiled
    temp = max(c["temp_bytes"] for c in programs)
    assert temp > 0
    assert set(programs[0]["devices"]) == set(range(8))
    for d in range(8):
        assert sampler.temp_per_device[d] >= temp
        # The program ran while `y` (and then `z`) was alive: its temp counts
        # on top of them, but within the live peak plus the largest temp.
        assert sampler.peak_per_device[d] >= sampler.final_per_device[d] + temp
        # The timeline with temps shows the program's temp while it ran.
        assert max(p[d] for _, p in sampler.timeline_with_temps) >= (
            sampler.final_per_device[d] + temp
        )
        assert max(p[d] for _, p in sampler.timeline) < sampler.final_per_device[d] + temp
        assert (
            sampler.peak_per_device[d]
            <= sampler.live_peak_per_device[d] + sampler.temp_per_device[d]
        )
    del y, z


def test_sampler_temps_do_not_count_before_their_program():
    """A big allocation freed before a program compiles is not added to its temp.

    Samples are taken at the events only (no background thread: a thread's
    sample whose walk of the live arrays began before `del x` could end
    after the program started, and pair x with the program's temp: an upper
    bound by design, not what this test checks)."""
    mesh = _mesh((1, 8))
    sharding = NamedSharding(mesh, PartitionSpec(None, "model"))
    base = _baseline()
    with memory.MemorySampler(interval_s=3600) as sampler:
        x = _full_on_device0(2048, 1024)  # 8 MiB, freed before the program
        sampler.sample()
        del x
        sampler.sample()
        y = jax.device_put(np.ones((512, 512), np.float32), sharding)
        z = jax.jit(lambda a: jnp.sin(a) @ a.T, out_shardings=sharding)(y)
        z.block_until_ready()
        sampler.sample()  # the first sample after the program: its temp counts here
    temp = sampler.temp_per_device[0]
    assert 0 < temp < 8 * MIB
    assert sampler.live_peak_per_device[0] - base[0] == 8 * MIB
    assert sampler.peak_per_device[0] - base[0] == 8 * MIB
    del y, z


def test_sampler_temps_end_with_their_program():
    """A program's temp is not added to what is allocated after it finished.

    Samples at the events only: a background sample that began while the
    program ran may end its walk after x exists, and by design counts the
    temp with what it saw (an upper bound; a clean-clone CI run caught
    exactly that once: peak = live peak + the 2 MiB temp)."""
    mesh = _mesh((1, 8))
    sharding = NamedSharding(mesh, PartitionSpec(None, "model"))
    y = jax.device_put(np.ones((512, 512), np.float32), sharding)
    base = _baseline()
    with memory.MemorySampler(interval_s=3600) as sampler:
        z = jax.jit(lambda a: jnp.cos(a) @ a.T, out_shardings=sharding)(y)
        z.block_until_ready()
        sampler.sample()
        x = _full_on_device0(2048, 1024)  # 8 MiB, after the program
        sampler.sample()
        del x
    temp = sampler.temp_per_device[0]
    assert temp > 0 and sampler.executions_seen >= 1
    assert sampler.live_peak_per_device[0] - base[0] == 8 * MIB + 512 * 512 * 4 // 8
    assert sampler.peak_per_device[0] == sampler.live_peak_per_device[0]
    del y, z


def test_add_compiled_and_compiled_memory():
    compiled = jax.jit(lambda x: x @ x.T).lower(jnp.ones((64, 64))).compile()
    figures = memory.compiled_memory(compiled)
    assert figures["output_bytes"] == 64 * 64 * 4
    assert figures["argument_bytes"] == 64 * 64 * 4
    assert {"temp_bytes", "alias_bytes", "code_bytes"} <= set(figures)
    base = _baseline()
    with memory.MemorySampler(watch_compiles=False) as sampler:
        x = _full_on_device0(256, 256)
        sampler.sample()
        del x
        sampler.add_compiled(compiled)
    assert sampler.compiled[0]["devices"] == [jax.devices()[0].id]
    assert sampler.temp_per_device[0] == figures["temp_bytes"]
    # Run at an unknown time: its temp adds to the overall live peak.
    assert sampler.peak_per_device[0] - base[0] == 256 * 256 * 4 + figures["temp_bytes"]
    with pytest.raises(TypeError, match="Expected a `jax.stages.Compiled`"):
        memory.compiled_memory(object())


def test_compile_watch_is_removed_after_exit():
    from jax._src import compiler

    original = compiler.compile_or_get_cached
    with memory.MemorySampler(watch_compiles=True):
        assert compiler.compile_or_get_cached is not original
    assert compiler.compile_or_get_cached is original


def test_host_rss_figures_and_reset():
    rss = memory.current_rss_bytes()
    assert rss > 0
    block = np.ones(64 * MIB // 8)  # 64 MiB touched
    assert memory.host_peak_rss_bytes() >= rss
    del block
    assert memory.reset_host_peak_rss() is True
    # After the reset the high-water mark is back near the current RSS.
    assert memory.host_peak_rss_bytes() < memory.current_rss_bytes() + 32 * MIB


def test_sampler_host_peak_sees_a_host_spike():
    with memory.MemorySampler(watch_compiles=False) as sampler:
        block = np.ones(128 * MIB // 8)
        block[::512] = 2.0
        del block
    assert sampler.host_peak_reset
    assert sampler.host_peak_rss - sampler.host_start_rss >= 100 * MIB
    assert sampler.host_final_rss < sampler.host_peak_rss


def test_report_is_json_ready():
    import json

    with memory.MemorySampler(watch_compiles=False) as sampler:
        pass
    report = json.loads(json.dumps(sampler.report()))
    assert report["source"] == "live_arrays"
    assert set(report["peak_per_device"]) == {str(d) for d in range(8)}
    assert report["wall_s"] >= 0


def test_bad_interval():
    with pytest.raises(ValueError, match="Expected interval_s > 0"):
        memory.MemorySampler(interval_s=0)


def test_device_memory_stats_is_none_on_cpu():
    assert memory.device_memory_stats(jax.devices()[0]) is None


def test_sampler_without_run_hook_counts_temps_until_next_compile(monkeypatch):
    from keras_hub_dist import _compat

    monkeypatch.setattr(_compat, "CAN_WATCH_EXECUTIONS", False)
    mesh = _mesh((1, 8))
    sharding = NamedSharding(mesh, PartitionSpec(None, "model"))
    y = jax.device_put(np.ones((256, 512), np.float32), sharding)
    with memory.MemorySampler(interval_s=0.001) as sampler:
        z = jax.jit(lambda a: jnp.tanh(a) @ a.T, out_shardings=sharding)(y)
        z.block_until_ready()
        sampler.sample()
    assert sampler.executions_seen == 0
    temp = sampler.temp_per_device[0]
    assert temp > 0
    assert sampler.peak_per_device[0] >= sampler.final_per_device[0] + temp
    del y, z


def test_current_rss_is_psutils_and_follows_forks():
    import os

    import psutil

    from keras_hub_dist.measure import host_rss

    rss = memory.current_rss_bytes()
    assert abs(rss - psutil.Process().memory_info().rss) < 64 * MIB
    # A cached psutil.Process of another pid (as after a fork) is replaced.
    host_rss._process = psutil.Process(os.getppid())
    assert abs(memory.current_rss_bytes() - rss) < 64 * MIB
    assert host_rss._process.pid == os.getpid()


def test_program_watch_patches_once_survives_listener_errors_and_restores():
    from keras_hub_dist import _compat
    from keras_hub_dist.measure import program_watch

    original = _compat._jax_compiler.compile_or_get_cached
    outer, inner = [], []

    def broken(executable, name):
        raise RuntimeError("a listener's bug")

    with program_watch.watch_compilations(lambda e, n: outer.append(n)) as watching:
        assert watching
        patched = _compat._jax_compiler.compile_or_get_cached
        assert patched is not original
        with program_watch.watch_compilations(broken), program_watch.watch_compilations(
            lambda e, n: inner.append(n)
        ):
            assert _compat._jax_compiler.compile_or_get_cached is patched  # one patch
            out = jax.jit(lambda a: a * 3 + 1)(jnp.arange(4.0))
        jax.jit(lambda a: a - 2)(jnp.arange(5.0)).block_until_ready()
    assert _compat._jax_compiler.compile_or_get_cached is original
    np.testing.assert_array_equal(np.asarray(out), [1.0, 4.0, 7.0, 10.0])
    assert "jit__lambda" in inner
    assert len(outer) > len(inner)  # the outer watcher also saw the last compile
