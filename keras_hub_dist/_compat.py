"""Every private Keras / JAX name the package touches, in one place.

An upgrade of Keras, KerasHub or JAX that moves one of these names should only
need an edit here. Each gate is a version tuple so the intent stays readable.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import keras

__all__ = [
    "builtin_preset_names", "CAN_WATCH_COMPILATIONS", "CAN_WATCH_EXECUTIONS", "computation_name",
    "compute_fans", "context_mesh", "creating_variables_without_values", "deferred_variables",
    "distributed_client", "distribution_layout_map", "draw_seed", "einsum_reduction", "executed_program",
    "forget_deferred_variables", "H5IOStore", "host_array", "in_stateless_scope", "initialize_layout",
    "initialize_pending", "is_pending", "JAX_VERSION", "KERAS_VERSION", "leaf_layers",
    "materialize_deferred_variable", "own_dtype_policies", "pending_initializer", "pending_layout",
    "preset_file", "preset_file_names", "preset_has_file", "quantization_modes", "quantize_layer_structure",
    "require_jax_backend", "safetensor_loader_class", "save_preset_config", "save_preset_metadata",
    "saveable_being_saved", "set_pending_initializer", "set_remat_mode", "swap_compile_function",
    "swap_execute_method", "symbolic_build", "transformers_converter", "unfilled_weights_store",
    "variable_array", "variables_size_in_bytes", "walk_saved_variables",
]


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        match = re.match(r"\d+", piece)
        parts.append(int(match.group()) if match else 0)
    return tuple(parts)


JAX_VERSION = _version_tuple(jax.__version__)
KERAS_VERSION = _version_tuple(keras.__version__)

# Keras turns an initializer's `seed` into raw threefry key data through this private
# helper; the sharded initializers must draw exactly the same key as the parent.
from keras.src.random.seed_generator import draw_seed  # noqa: E402

# Fan computation of `VarianceScaling`; private but stable since Keras 3.0.
from keras.src.initializers.random_initializers import compute_fans  # noqa: E402

# The mesh `jax.set_mesh` installs: `jax.sharding.get_mesh` from JAX 0.7, private before.
if JAX_VERSION >= (0, 7, 0):
    from jax.sharding import get_mesh as _get_context_mesh
else:  # pragma: no cover - older JAX
    from jax._src.mesh import get_concrete_mesh as _get_context_mesh


def context_mesh() -> jax.sharding.Mesh | None:
    """Returns the concrete mesh set with `jax.set_mesh`, or `None`."""
    mesh = _get_context_mesh()
    if mesh is None or getattr(mesh, "empty", False):
        return None
    return mesh


def require_jax_backend() -> None:
    """Raises unless Keras runs on JAX: sharded init and loading are JAX-only."""
    backend = keras.backend.backend()
    if backend != "jax":
        raise RuntimeError(
            "keras_hub_dist needs the JAX backend of Keras. Expected "
            f"KERAS_BACKEND='jax'. Received: keras.backend.backend()="
            f"{backend!r} (KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). "
            "Set KERAS_BACKEND=jax before importing keras."
        )


def distribution_layout_map(distribution) -> "keras.distribution.LayoutMap | None":
    """The LayoutMap of a `ModelParallel` distribution (a private attribute)."""
    if distribution is None:
        return None
    return getattr(distribution, "_layout_map", None)


# Every XLA program JAX compiles (jit, eager ops, `lower().compile()`) goes through this
# private function, and a jitted program's first run with new arguments (and every run of
# a fresh jit object) through this private class's `__call__` before JAX's C++ fast path.
# The memory sampler wraps both (`measure.program_watch` keeps the listeners) to see
# compiled programs' temp buffers, which never appear in `jax.live_arrays()`.
try:
    from jax._src import compiler as _jax_compiler

    CAN_WATCH_COMPILATIONS = callable(
        getattr(_jax_compiler, "compile_or_get_cached", None)
    )
except ImportError:  # pragma: no cover - JAX moved the module
    _jax_compiler = None
    CAN_WATCH_COMPILATIONS = False

try:
    from jax._src.interpreters import pxla as _jax_pxla

    CAN_WATCH_EXECUTIONS = callable(
        getattr(getattr(_jax_pxla, "ExecuteReplicated", None), "__call__", None)
    )
except ImportError:  # pragma: no cover - JAX moved the module
    _jax_pxla = None
    CAN_WATCH_EXECUTIONS = False


def swap_compile_function(function: Callable[..., Any]) -> Callable[..., Any]:
    """Installs `function` as JAX's `compile_or_get_cached(backend,
    computation, ...)`, returning the one it replaces."""
    previous = _jax_compiler.compile_or_get_cached
    _jax_compiler.compile_or_get_cached = function
    return previous


def swap_execute_method(method: Callable[..., Any]) -> Callable[..., Any]:
    """Installs `method` as JAX's `ExecuteReplicated.__call__(self, *args)`,
    returning the one it replaces."""
    previous = _jax_pxla.ExecuteReplicated.__call__
    _jax_pxla.ExecuteReplicated.__call__ = method
    return previous


def executed_program(execute_replicated: Any) -> Any:
    """The loaded XLA executable an `ExecuteReplicated` runs."""
    return execute_replicated.xla_executable


def computation_name(computation: Any) -> str:
    """The MLIR module name of a computation being compiled (`"?"` if none)."""
    try:
        from jax._src.lib.mlir import ir

        attr = computation.operation.attributes["sym_name"]
        return ir.StringAttr(attr).value
    except Exception:  # noqa: BLE001 - a name is only a label
        return "?"


# Variables created inside a `keras.StatelessScope` get no value: Keras keeps
# the initializer on the variable (`_initializer`) and appends the variable to
# a thread-local list that the outermost scope initializes on exit. Building a
# model from shapes only, or swapping a variable's initializer before any value
# exists, both rely on these private names (stable since Keras 3.0).
from keras.src.backend.common import global_state as _keras_global_state  # noqa: E402
from keras.src.backend.common.stateless_scope import (  # noqa: E402
    in_stateless_scope,
)

_UNINITIALIZED_VARIABLES = "uninitialized_variables"


@contextlib.contextmanager
def creating_variables_without_values() -> Iterator[list]:
    """Leaves every Keras variable created in the block without a value.

    Yields a list that, once the block exits (normally or by an exception),
    holds the variables created inside it, still uninitialized. Keras's own
    pending list is restored exactly as it was, so no later scope exit ever
    initializes (allocates) them behind the caller's back.

    Raises:
        RuntimeError: called inside another `StatelessScope`, where variables
            could not be initialized afterwards.
    """
    if in_stateless_scope():
        raise RuntimeError(
            "Expected to be called outside any keras.StatelessScope. "
            "Received: an active StatelessScope. Build the model outside it."
        )
    previous = _keras_global_state.get_global_attribute(_UNINITIALIZED_VARIABLES)
    _keras_global_state.set_global_attribute(_UNINITIALIZED_VARIABLES, [])
    created: list = []
    try:
        with keras.StatelessScope(initialize_variables=False):
            yield created
    finally:
        created.extend(
            _keras_global_state.get_global_attribute(_UNINITIALIZED_VARIABLES)
            or []
        )
        _keras_global_state.set_global_attribute(
            _UNINITIALIZED_VARIABLES, previous
        )


def is_pending(variable: Any) -> bool:
    """Whether `variable` was created without a value (see above)."""
    return (
        getattr(variable, "_value", None) is None
        and getattr(variable, "_initializer", None) is not None
    )


def pending_initializer(variable: Any) -> Any:
    """The initializer a pending variable will be initialized with."""
    if not is_pending(variable):
        raise ValueError(
            f"Expected a variable created inside "
            f"creating_variables_without_values() that has "
            f"no value yet. Received: '{variable.path}', which has a value."
        )
    return variable._initializer


def set_pending_initializer(variable: Any, initializer: Any) -> None:
    """Replaces the initializer a pending variable will be initialized with."""
    pending_initializer(variable)  # validates
    variable._initializer = initializer


def initialize_pending(variables: Iterator[Any] | list) -> None:
    """Initializes pending variables, in order, under the active distribution.

    Keras's own deferred path (`Variable._deferred_initialize`) is used, so
    the layout and the initializer call are exactly those of an eager build.
    A failure names the variable path (as a note on the original exception).
    """
    for variable in variables:
        if not is_pending(variable):
            continue
        try:
            variable._deferred_initialize()
        except Exception as error:
            if hasattr(error, "add_note"):
                error.add_note(
                    f"While initializing variable '{variable.path}' "
                    f"(shape {tuple(variable.shape)}, dtype {variable.dtype})."
                )
            raise


# --- Sharded loading (`load_sharded_preset`, `write_synthetic_preset`) -------

# `model.weights.h5` names its datasets after the walk Keras's saver makes over
# the model's attributes (layer paths + "vars/<i>"), not after variable paths.
# Replaying that exact walk with our own store is the only mapping that stays
# right for every layer that overrides `save_own_variables`.
from keras.src.saving import saving_lib as _saving_lib  # noqa: E402

H5IOStore = _saving_lib.H5IOStore


def walk_saved_variables(model: Any, store: Any, skip: Any = ()) -> None:
    """Runs Keras's `save_weights` walk over `model`, writing into `store`.

    `store` must be an `H5IOStore` subclass: Keras checks the type, then calls
    `store.make(inner_path, metadata)` per saveable and `store[key] = value`
    per saved variable, in file order. `skip` are saveables left out (as
    `keras.saving.save_weights(..., objects_to_skip=...)` does).
    """
    _remember_attr_skipsets()
    _saving_lib._save_state(
        model,
        weights_store=store,
        assets_store=None,
        inner_path="",
        visited_saveables={id(o) for o in skip},
    )


def _remember_attr_skipsets() -> None:
    """Keras 3.15's `get_attr_skipset` reads its cache as `..._skiplist_<type>`, writes `..._skipset_<type>`:
    each object walked built a fresh `Layer()` for its `dir()` (a tiny Llama's load 0.30 -> 0.24 s).
    The same sets, stored where Keras reads them (again after `clear_session`)."""
    for obj_type in ("Layer", "Functional", "Operation"):
        key = f"saving_attr_skiplist_{obj_type}"
        if _keras_global_state.get_global_attribute(key) is None:
            _keras_global_state.set_global_attribute(key, _saving_lib.get_attr_skipset(obj_type))


def saveable_being_saved() -> Any:
    """From inside a weights store's `make`, the saveable Keras is about to
    call `save_own_variables` of: `_save_state` hands the store only its
    path, and the object is its local `saveable` (two frames up: this
    function, then `make`). Lets a value Keras computes while saving (a
    LoRA-merged kernel) be computed again later, from its layer alone."""
    import sys

    return sys._getframe(2).f_locals.get("saveable")


def unfilled_weights_store(path: Any, max_shard_size: float | None, create_dataset: Callable[[Any, str, Any], None]) -> Any:
    """Keras's own weights store in write mode (`H5IOStore`, or
    `ShardedH5IOStore` for `max_shard_size` GB per file) where
    `store[key] = dataset` calls `create_dataset(h5 group, key, dataset)`
    instead of writing a value. Groups, their metadata, when a new file
    starts and the weight map stay Keras's; `dataset` needs `name`, `nbytes`.
    """
    from keras_hub_dist.errors import SaveError

    class _Store(_saving_lib.H5IOStore):
        def __setitem__(self, key: str, dataset: Any) -> None:
            if not self._h5_entry_initialized:
                self._create_h5_group(self._h5_entry_path)
            create_dataset(self._h5_entry_group, key, dataset)

    class _ShardedStore(_saving_lib.ShardedH5IOStore):
        # `ShardedH5IOStore.__setitem__` with the size taken from the layout
        # instead of the value.
        def __setitem__(self, key: str, dataset: Any) -> None:
            self._restore_h5_file()
            size = dataset.nbytes
            self.total_shard_size += size
            if size > self.max_shard_size:
                raise SaveError(
                    f"Dataset {dataset.name!r} ({size / 2**30:.2f} GiB) is larger "
                    f"than max_shard_size ({self.max_shard_size / 2**30:.2f} GiB). "
                    "Expected every saved value to fit in one weights file. "
                    "Raise max_shard_size (or pass None for a single file)."
                )
            self.current_shard_size += size
            if self.current_shard_size > self.max_shard_size:
                self.close()
                self.h5_file = self._create_new_shard_file()
                self.current_shard_size = size
            if not self._h5_entry_initialized:
                self._create_h5_group(self._h5_entry_path)
            create_dataset(self._h5_entry_group, key, dataset)
            variable_path = self._h5_entry_group.name
            shard_filename = self.current_shard_path.name
            weight_map = self.sharding_config["weight_map"]
            if variable_path not in weight_map:
                weight_map[variable_path] = shard_filename
            else:
                if not isinstance(weight_map[variable_path], list):
                    weight_map[variable_path] = [weight_map[variable_path]]
                if shard_filename not in weight_map[variable_path]:
                    weight_map[variable_path].append(shard_filename)

    if max_shard_size is None:
        return _Store(path, mode="w")
    return _ShardedStore(path, max_shard_size, mode="w")


def host_array(array: jax.Array) -> Any:
    """The host values of a single-device array, without caching them.

    `np.asarray(array)` keeps a host copy inside the array when it had to
    copy (every accelerator): writing a model's shards that way would leave a
    host copy of the whole model behind. On CPU the result is a view of the
    device buffer (no copy at all).
    """
    import numpy as np

    convert = getattr(array, "_single_device_array_to_np_array_did_copy", None)
    if convert is not None:
        return convert()[0]
    values = np.asarray(array)
    with contextlib.suppress(AttributeError):
        array._npy_value = None
    return values


def forget_deferred_variables(variables: Any) -> None:
    """Drops variables from Keras's list of deferred (uninitialized) ones.

    Variables created inside `StatelessScope(initialize_variables=False)` stay
    on that global list; the next top-level stateless scope would otherwise
    random-initialize them (or fail on ones we already filled).
    """
    ids = {id(v) for v in variables}
    pending = _keras_global_state.get_global_attribute(_UNINITIALIZED_VARIABLES, None)
    if pending:
        _keras_global_state.set_global_attribute(
            _UNINITIALIZED_VARIABLES, [v for v in pending if id(v) not in ids]
        )


def deferred_variables() -> list[Any]:
    """The variables Keras currently holds as deferred (a copy of its list)."""
    return list(_keras_global_state.get_global_attribute(_UNINITIALIZED_VARIABLES, None) or ())


def variable_array(variable: Any) -> Any:
    """The array a variable holds (`None` while deferred), without reading it
    through `.value` (which would run the initializer of a deferred one)."""
    return getattr(variable, "_value", None)


def pending_layout(variable: Any) -> Any:
    """The layout Keras gives a variable created without a value when it
    initializes it: its own (`layout=` at creation; an optimizer's variable
    takes its model variable's), else the active distribution's, else None
    (the default device)."""
    layout = getattr(variable, "_layout", None)
    distribution = keras.distribution.distribution()
    if layout is None and distribution is not None:
        layout = distribution.get_variable_layout(variable)
    return layout


def initialize_layout(variable: Any) -> None:
    """Sets a value-less variable's layout now, as its initialization would:
    the optimizer copies `_layout` into the moments it builds."""
    variable._initialize_layout()


def symbolic_build(model: Any, data_batch: Any) -> None:
    """A compiled model's optimizer, loss and metric state, as `fit` builds it."""
    model._symbolic_build(data_batch=data_batch)


def materialize_deferred_variable(variable: Any, value: Any, layout: Any) -> None:
    """Gives a deferred variable its first value, already in `layout`.

    `JaxVariable._initialize` skips the relayout when `value.sharding` is
    equivalent to the layout, so no byte moves; the initializer is dropped so
    nothing can ever random-initialize the variable later.
    """
    if getattr(variable, "_value", None) is not None:
        raise ValueError(
            f"Expected a deferred (uninitialized) variable. Received: "
            f"{variable.path!r}, which already holds a value."
        )
    variable._layout = layout
    variable._initializer = None
    variable._initialize(value)


# KerasHub resolves preset handles (built-in names, kaggle://, hf://, local directories)
# and downloads into its cache through this private module, imported on first use.
def _preset_utils() -> Any:
    from keras_hub.src.utils import preset_utils

    return preset_utils


def transformers_converter(config: dict) -> Any:
    """KerasHub's converter module for a Transformers config's `model_type`.

    Raises:
        ValueError: KerasHub has no converter for it.
    """
    from keras_hub.src.utils.transformers.preset_loader import TransformersPresetLoader

    return TransformersPresetLoader(None, config).converter


def safetensor_loader_class() -> type:
    """KerasHub's `SafetensorLoader` (what converters read tensors through)."""
    from keras_hub.src.utils.transformers.safetensor_utils import SafetensorLoader

    return SafetensorLoader


def preset_file(preset: str, name: str) -> str:
    """Local path of file `name` of `preset`, downloading it if needed."""
    return _preset_utils().get_file(preset, name)


def save_preset_config(obj: Any, preset_dir: str, file_name: str) -> None:
    """Writes `obj`'s config (config.json, task.json, ...) exactly as
    `save_to_preset` does (KerasHub's `KerasPresetSaver`)."""
    _preset_utils().KerasPresetSaver(preset_dir)._save_serialized_object(obj, file_name)


def save_preset_metadata(backbone: Any, preset_dir: str) -> None:
    """Writes metadata.json exactly as `save_to_preset` does."""
    _preset_utils().KerasPresetSaver(preset_dir)._save_metadata(backbone)


def variables_size_in_bytes(variables: Any) -> int:
    """KerasHub's measure of a backbone's size, which decides whether
    `save_to_preset` writes multi-file weights."""
    return int(_preset_utils().KerasPresetSaver._get_variables_size_in_bytes(None, variables))


def preset_file_names() -> dict[str, str]:
    """KerasHub's preset file names (config, metadata, task, weights)."""
    utils = _preset_utils()
    return {
        "config": utils.CONFIG_FILE,
        "metadata": utils.METADATA_FILE,
        "task": utils.TASK_CONFIG_FILE,
        "weights": utils.MODEL_WEIGHTS_FILE,
        "sharded_weights": utils.SHARDED_MODEL_WEIGHTS_CONFIG_FILE,
        "task_weights": utils.TASK_WEIGHTS_FILE,
    }


def preset_has_file(preset: str, name: str) -> bool:
    """Whether `preset` has file `name` (remote handles may download it)."""
    return _preset_utils().check_file_exists(preset, name)


def builtin_preset_names() -> list[str]:
    """Names of KerasHub's built-in presets (`"gemma_7b_en"`, ...)."""
    return list(getattr(_preset_utils(), "BUILTIN_PRESETS", {}))


def stock_hf_exporter() -> Any:
    """KerasHub's Transformers exporter (`hf_exporter`): its tables
    `MODEL_CONFIGS`, `MODEL_EXPORTERS`, `MODEL_TOKENIZER_CONFIGS` and its
    `export_tokenizer`, `export_generation_config`, ... functions."""
    from keras_hub.src.utils.transformers.export import hf_exporter

    return hf_exporter


@contextlib.contextmanager
def replaced_module_global(function: Any, name: str, value: Any) -> Iterator[None]:
    """Global `name` of `function`'s module is `value` while the context
    lasts (KerasHub's exporter modules call `ops.<op>` through their
    module global `ops`)."""
    namespace = function.__globals__
    missing = object()
    original = namespace.get(name, missing)
    namespace[name] = value
    try:
        yield
    finally:
        if original is missing:
            del namespace[name]
        else:
            namespace[name] = original


# --- Quantization (`quantize="int8" | "int4"`) -------------------------------
# `Layer.quantize` computes values and builds the quantized variables at once;
# the structure alone (no float value allocated) replays its private steps.
from keras.src.quantizers import quantization_config as _quantization_config  # noqa: E402


def quantization_modes() -> tuple[str, ...]:
    """The quantization modes this Keras knows (`Layer.quantize` checks)."""
    return tuple(_quantization_config.QUANTIZATION_MODES)


def leaf_layers(model: Any) -> list[Any]:
    """The layers `Model.quantize` visits: every layer without sublayers."""
    return [l for l in model._flatten_layers() if len(list(l._flatten_layers())) == 1]


def einsum_reduction(layer: Any) -> dict[str, tuple[int, ...]]:
    """An `EinsumDense`'s kernel reduction analysis (set as `quantize` does)."""
    layer._set_quantization_info()
    return {n: tuple(getattr(layer, f"_kernel_{n}_axes")) for n in ("reduced", "transpose", "expand", "squeeze")}


def own_dtype_policies(model: Any) -> None:
    """Gives each layer built with a quantized `DTypePolicyMap` entry that policy
    as its own, as `quantize` does (saving reads the map's mode: None)."""
    for layer in model._flatten_layers():
        if isinstance(layer._dtype_policy, keras.dtype_policies.DTypePolicyMap) and layer.quantization_mode:
            layer._dtype_policy = layer._dtype_policy[layer.path]


def quantize_layer_structure(layer: Any, mode: str, float_shape: tuple[int, ...], block_size: int | None = None) -> Any:
    """`layer.quantize(mode)` without values: Keras's checks, float variables
    untracked (no `gc.collect()` as `del` runs), `quantized_build`, policy;
    int4 in groups of `block_size` (default: Keras's 128)."""
    given = None
    if mode == "int4" and block_size is not None:
        given = _quantization_config.Int4QuantizationConfig(block_size=block_size)
    config = _quantization_config.validate_and_resolve_config(mode, given)
    layer._check_quantize_args(config.mode, layer.compute_dtype)
    names = ["_embeddings" if hasattr(layer, "_embeddings") else "_kernel"]
    names += ["reverse_embeddings"] if getattr(layer, "reverse_embeddings", None) is not None else []
    layer._tracker.unlock()
    try:
        layer.quantization_config = config
        for name in names:
            layer._untrack_variable(getattr(layer, name))
            object.__delattr__(layer, name)
        layer.quantized_build(float_shape, config.mode, config)
        policy = mode if mode != "int4" else f"int4/{config.block_size or -1}"
        layer.dtype_policy = keras.dtype_policies.get(f"{policy}_from_{layer.dtype_policy.name}")
    finally:
        layer._tracker.lock()
    return config


# `Operation.__init__` stores the active `RematScope` as `_remat_mode`, which
# `__call__` applies: layers of a built model get it set here (None: off).
from keras.src.backend.common import remat as _remat  # noqa: E402


def set_remat_mode(layers: Any, scope: "keras.RematScope | None") -> None:
    """Gives each of `layers` `scope`'s mode, as if built inside it."""
    on = scope is not None and scope.mode is not None
    mode = _remat.RematMode(scope.mode, scope.output_size_threshold, list(scope.layer_names)) if on else None
    for layer in layers:
        layer._remat_mode = mode


def distributed_client(detach: bool = False) -> Any:
    """JAX's distributed client (or None); `detach`: it, the service and preemption manager out of JAX's
    state, never freed: after a lost process, exit-time `shutdown()` and destructors wait for nobody."""
    import ctypes
    from jax._src import distributed
    client = distributed.global_state.client
    for name in ("preemption_sync_manager", "client", "service") if detach else ():
        if (held := getattr(distributed.global_state, name)) is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(held))
            setattr(distributed.global_state, name, None)
    return client
