"""Test setup: 8 simulated CPU devices and the JAX backend, before any import."""

import contextlib
import functools
import gc
import os
import re
import weakref

# XLA's LLVM optimizations of the suite's tiny programs cost more than they
# save: compiling is most of the suite's time (e.g. stock `from_preset`
# compiles one random initializer per weight shape), and at level 0
# tests/formats/test_huggingface_families.py -k "qwen3 and not moe" took
# 16.0 s against 29.6 s. Every comparison is ours against stock (or
# Transformers) in the same process, under the same flags; the benchmarks
# and the validation report run with XLA's defaults. Subprocesses inherit the
# flags (tests/multiprocess_jobs.child_env); a value in XLA_FLAGS wins.
# Two more of XLA's CPU compiler choices cost the suite more than they save
# (tests/plan/test_auto_layout.py and tests/init/test_factories.py with an
# empty compilation cache: XLA's compile time 39 s -> 13 s, the files 47 s ->
# 31 s): its newer fusion emitters (the older loop emitters compile a tiny
# fusion faster) and splitting each program's codegen over threads (two
# workers already use both cores).
_FAST_COMPILE = {
    "--xla_backend_optimization_level": "0",
    "--xla_cpu_use_fusion_emitters": "false",
    "--xla_cpu_parallel_codegen_split_count": "1",
}
for _flag, _value in _FAST_COMPILE.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}={_value}"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import keras  # noqa: E402
import pytest  # noqa: E402

from tests.compile_cache import write_entries_atomically  # noqa: E402

# XLA's compiled programs, kept on disk and shared by the xdist workers and by
# the next run: about half of the suite's time is compiling, and the same
# programs recur (stock's eager ops, the samplers, the forward passes of the
# same tiny configs in many files). An entry is the executable XLA compiled
# for exactly that program and those options (JAX's own key), so results are
# the same bits. No size limit: with one, JAX locks and scans the whole
# directory on every write (tests/compile_cache.py, which makes each write
# atomic instead). JAX_COMPILATION_CACHE_DIR overrides the place,
# JAX_ENABLE_COMPILATION_CACHE=false turns it off. Set in the environment, so
# the subprocesses of the multi-process and CLI tests (which compile the same
# programs in every job) share it too.
COMPILATION_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".cache", "jax-tests"
)
for _name, _value in {
    "JAX_COMPILATION_CACHE_DIR": COMPILATION_CACHE,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
    "JAX_COMPILATION_CACHE_MAX_SIZE": "-1",
}.items():
    os.environ.setdefault(_name, _value)
jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
jax.config.update("jax_compilation_cache_max_size", int(os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"]))
write_entries_atomically()

MESH_SHAPES = [(1, 8), (2, 4), (8, 1)]


class lazy_import:  # noqa: N801 - stands for a module
    """`pytest.importorskip(name)` on first use, not at collection: both
    xdist workers collect every file, and torch, transformers and peft cost
    each ~5-10 s to import while only one worker runs the tests using them."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        # pytest's collection probes every module-level object for dunders
        # and mock markers (`__test__`, `_mock_name`, `__wrapped__`): those
        # must not import the module (8 s of each worker's collection).
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(pytest.importorskip(self._name), attr)


def live_device_bytes():
    """Bytes of every live JAX array, summed over the devices."""
    from keras_hub_dist.measure import memory

    return sum(memory.live_bytes_per_device().values())


def jitted_outputs(model, inputs):
    """`model(inputs)` as one jitted program on the model's own (possibly
    sharded) weights: one XLA compilation, not one per eager op and
    sharding. The outputs as the model returns them (an array or a dict)."""
    call = jax.jit(lambda trainable, non_trainable, x: model.stateless_call(trainable, non_trainable, x)[0])
    return call([v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables], inputs)


def quantize_collecting_once(model, mode):
    """`model.quantize(mode)`, Keras's own, with its garbage collections
    deferred to one at the end. Keras's `Layer.__delattr__` runs
    `gc.collect()` for every variable a quantize replaces (to free device
    memory at once): 2.5 s of a 3.3 s stock `quantize("int4")` of a tiny
    Llama. The values are the same; only when Python frees the old floats
    differs. For references and tests of values, never of memory."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        model.quantize(mode)
    finally:
        gc.collect = collect
    gc.collect()


# The expert banks of the MoE families (Mixtral / Qwen3-MoE / Qwen 3.5 MoE,
# gpt-oss, Gemma 4 MoE): never to be replicated whole.
EXPERT_BANK = re.compile(
    r".*(experts/(expert_feedforward_\w+_dense|gate_up_proj|down_proj)"
    r"|moe_expert_bank/(gate|up|down)_proj)"
)


def pytest_configure(config):
    assert jax.device_count() == 8, (
        "tests need 8 simulated CPU devices; XLA_FLAGS was set too late: "
        f"{jax.devices()}"
    )


def pytest_collection_finish(session):
    # Everything imported so far (Keras, TensorFlow, JAX, the test modules)
    # lives for the whole session: freezing it keeps each `gc.collect()` of
    # the tests (a few hundred) from walking it again (~0.35 s each).
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _no_leaked_distribution():
    """Every test starts and ends with no global Keras distribution."""
    keras.distribution.set_distribution(None)
    yield
    keras.distribution.set_distribution(None)


@pytest.fixture(autouse=True)
def _freeze_what_outlives_the_test():
    """What a test leaves alive (JAX's jit and lowering caches grow by 3-5k
    objects a test, module fixtures) is frozen when it ends, after one
    collection of its own garbage: the many `gc.collect()`s of later tests
    (each memory report, each variable a stock `quantize` replaces) then walk
    only what their own test made. In tests/formats/test_huggingface_families.py
    a memory report's collection had grown to 0.08-0.16 s by the module's
    30th test, walking 110k-190k objects the earlier tests had left."""
    yield
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="module", autouse=True)
def _release_module_caches(request):
    """Models a test module caches (`functools.cache`) for its own tests are
    freed when the module ends. Kept for the whole session they were 10k+
    live arrays, and every later `jax.live_arrays()` walk (each memory
    sample) took ~90 ms instead of ~1 ms.

    What outlives the collection after that (JAX's and Keras's caches, the
    session's fixtures) is frozen too, as at the start: every later
    `gc.collect()` walks only what later modules made. Keras's
    `Layer.__delattr__` collects once per variable a stock `quantize`
    replaces; walking the whole session's heap each time was ~180 s of
    py-spy's samples over the suite, the module ends and `clean_state` ~80 s
    more (1,650 samples-seconds in all against ~1,300 CPU-seconds)."""
    yield
    module = request.module
    for value in vars(module).values():
        if getattr(value, "__module__", None) == module.__name__ and hasattr(
            value, "cache_clear"
        ):
            value.cache_clear()
    gc.collect()
    if any(not _SURVIVORS.holds(array) for array in jax.live_arrays()):
        # A module fixture's or cache's model was frozen alive after a test
        # and has since become cyclic garbage that a collection of the
        # unfrozen objects cannot see: walk everything once, so no array
        # outlives its module. The walk (1-2 s: the whole session's heap)
        # only when an array is alive that no earlier walk found still held.
        gc.unfreeze()
        gc.collect()
        _SURVIVORS.remember(jax.live_arrays())
    gc.freeze()


class _Survivors:
    """The arrays a whole-heap collection left alive: something that
    outlives modules holds them (a session fixture, a cache of a helper
    module, a global of Keras), so another walk would not free them. Once
    such an array was alive, every later module end walked the session's
    heap again (1-2 s each; 35 s over a run's 51 walks, most freeing
    nothing)."""

    def __init__(self):
        self._refs = {}

    def remember(self, arrays):
        self._refs = {id(array): weakref.ref(array) for array in arrays}

    def holds(self, array):
        ref = self._refs.get(id(array))
        return ref is not None and ref() is array


_SURVIVORS = _Survivors()


@pytest.fixture(scope="module")
def short_delta_chunks():
    """Qwen 3.5's chunked Gated DeltaNet unrolls a Python loop over a 64-token
    chunk; 2-token chunks compute the same result (the chunked form is exact
    for any chunk size), stock and ours alike, with a far smaller graph to
    compile. Module-scoped, for module-scoped fixtures that run models:
    `pytestmark = pytest.mark.usefixtures("short_delta_chunks")`."""
    from keras_hub.src.models.qwen3_5 import qwen3_5_gated_delta_net as module

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            module,
            "_chunk_gated_delta_rule",
            functools.partial(module._chunk_gated_delta_rule, chunk_size=2),
        )
        yield


def layout_sharding(mesh, axes, rank):
    """The `NamedSharding` a variable of `rank` with layout `axes` must have
    on the Keras `DeviceMesh` `mesh` (trailing `None`s dropped)."""
    entries = list(axes) + [None] * (rank - len(axes))
    while entries and entries[-1] is None:
        entries.pop()
    return jax.sharding.NamedSharding(
        mesh.backend_mesh, jax.sharding.PartitionSpec(*entries)
    )


def assert_laid_out_as(variables, layout_map, mesh):
    """Every variable's array has the sharding its `layout_map` entry says
    (replicated where the map has none)."""
    for variable in variables:
        layout = layout_map[variable.path]
        axes = tuple(layout.axes) if layout is not None else ()
        rank = len(variable.shape)
        expected = layout_sharding(mesh, axes, rank)
        assert variable.value.sharding.is_equivalent_to(expected, rank), (
            variable.path, variable.value.sharding, expected,
        )


def failing_on_call(real, n, error):
    """`real(fd, buffers, offset)` that raises `error` at its `n`-th call: a
    disk or read fault injected at a known moment. The offsets of every call
    are kept in the wrapper's `calls`."""
    calls = []

    def wrapper(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == n:
            raise error
        return real(fd, buffers, offset)

    wrapper.calls = calls
    return wrapper


def make_model_parallel(mesh_shape, layout_entries=None):
    """A `ModelParallel` over (batch, model) with the given layout entries."""
    mesh = keras.distribution.DeviceMesh(
        shape=mesh_shape, axis_names=("batch", "model"), devices=jax.devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in (layout_entries or {}).items():
        layout_map[key] = axes
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


@pytest.fixture
def clean_state():
    """Fails the test if a failed load leaves device memory, a distribution
    or a deferred variable behind: use as `with clean_state(): load(...)`."""

    @contextlib.contextmanager
    def check():
        from keras_hub_dist import _compat

        gc.collect()
        baseline = live_device_bytes()
        yield
        gc.collect()
        assert keras.distribution.distribution() is None
        assert _compat.deferred_variables() == []
        assert live_device_bytes() <= baseline + 1024

    return check
