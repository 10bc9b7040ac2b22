"""Resume a training run in place: `restore_checkpoint`.

`keras.callbacks.OrbaxCheckpoint` saves a model's weights and its
optimizer's state; stock Keras restores them with `model.load_weights(dir)`,
which has Orbax build the whole restored state tree beside the live one and
only then assigns it: every device peaks at twice its final bytes
(BENCHMARKS.md). `restore_checkpoint` instead:

1. resolves the step, reads the checkpoint's metadata (no array), and
   matches every variable of the model and of its optimizer to a stored
   array (`restore_plan`), validating paths, shapes and dtypes; an
   optimizer not yet built (compiled, never fitted: the usual restart) is
   matched through a copy of it built without values. Any error is raised
   here, before any device memory changes;
2. builds an optimizer not yet built with its variables left without
   values (no zeros are made only to be replaced; Keras would make each
   moment under 250 MB whole on one device, then reshard it);
3. group by group (at most `GROUP_BYTES` read per process): deletes the
   group's current arrays, then has Orbax read the group straight into the
   same shardings, or for an optimizer variable without a value the layout
   Keras would give it (`orbax_checkpoint.read_arrays`: each process reads
   only its own devices' blocks, each block once), and gives each variable
   its new array (`assign`, which keeps an array already in the
   variable's layout as it is). A device therefore never holds more than
   its final bytes: the old value of a variable is gone before its new one
   arrives.

The checkpoint's mesh and the model's may differ: the arrays are read
straight into the model's shardings (Orbax reads the blocks each device
needs, whatever the layout they were saved from).

Example:

```python
lm = keras_hub_dist.load_sharded_preset("gemma_7b_en", mesh=(2, 4), task="causal_lm")
lm.compile(optimizer=keras.optimizers.Adam(5e-5))
step = keras_hub_dist.restore_checkpoint(lm, "/ckpt")
lm.fit(data, callbacks=[keras.callbacks.OrbaxCheckpoint("/ckpt", save_freq=100)])
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from keras_hub_dist import _compat, _processes
from keras_hub_dist._progress import byte_progress
from keras_hub_dist.errors import CheckpointError
from keras_hub_dist.load import orbax_checkpoint
from keras_hub_dist.load.restore_plan import (
    OPTIMIZER_SECTION,
    RestorePlan,
    Wanted,
    group_reads,
    plan_restore,
)
from keras_hub_dist.storage import host_io

__all__ = ["GROUP_BYTES", "restore_checkpoint"]

# The most bytes one group of variables reads on any one process: the host
# buffers Orbax fills before placing them (per process, at a time).
GROUP_BYTES = 256 << 20


@_processes.raises_process_lost(CheckpointError, "the restore", _processes.RESTORE_LEFT)
def restore_checkpoint(
    model: Any,
    directory: str | os.PathLike,
    *,
    step: int | None = None,
    progress: bool | None = None,
) -> int:
    """Restores a model and its optimizer in place from an Orbax checkpoint.

    Reads a directory written by `keras.callbacks.OrbaxCheckpoint` (the
    latest step, or `step`) into `model`: every trainable and non-trainable
    variable, and every variable of `model.optimizer` (moments, iterations,
    learning rate, loss-scale state). Each process reads only the blocks its
    own devices hold, straight into each variable's current sharding, one
    group of variables at a time; a variable's previous array is deleted
    before its new one is read, so no device holds more than its final bytes
    at any moment (stock `model.load_weights(directory)`: twice). The mesh
    the checkpoint was saved on may differ from the model's.

    Every process of a `jax.distributed` job must call it, with the same
    arguments. The model must hold values (built by `load_sharded_preset`, a
    factory, or by hand); compile it first to restore the optimizer too (an
    optimizer never built, as after `compile`, is built here). A checkpoint
    saved with `save_weights_only=True` restores the weights of a model
    whose optimizer has no state yet (or that has none). Metric states are not
    restored (`fit` resets them every epoch). Arrays the variables held
    before are deleted, not just dropped: references kept to them elsewhere
    become unusable.

    Args:
        model: A built Keras model (JAX backend), compiled to restore the
            optimizer's state.
        directory: The directory given to `OrbaxCheckpoint` (or one step's
            directory), anywhere Orbax reads (local, `gs://`, ...).
        step: The step to restore; default: the latest finished one.
        progress: Show a progress bar on stderr; default: when stderr is a
            terminal.

    Returns:
        The step restored.

    Raises:
        ImportError: orbax-checkpoint is not installed
            (`pip install "keras-hub-dist[checkpoint]"`).
        CheckpointError: Before anything changes: not a directory
            `OrbaxCheckpoint` wrote (the message says what is there), a step
            that was not saved (the saved ones are listed), a checkpoint of
            another model (variables missing or extra, or a shape / dtype
            that differs: the variable and both values), an optimizer whose
            variables differ from the saved ones, or optimizer state
            missing. The model is left as it was. Also raised if reading
            fails midway: the variables read so far are restored, those of
            the group being read have no value (call it again).

    Example:

    ```python
    lm.compile(optimizer=keras.optimizers.Adam(5e-5))
    step = keras_hub_dist.restore_checkpoint(lm, "/ckpt")  # latest step
    lm.optimizer.iterations  # as saved
    ```
    """
    orbax_checkpoint.require_orbax()
    if step is not None and (isinstance(step, bool) or not isinstance(step, (int, np.integer))):
        raise TypeError(f"Expected step to be an int or None. Received: step={step!r}.")
    label = os.fspath(directory) if isinstance(directory, os.PathLike) else str(directory)
    variables = _model_variables(model)
    optimizer = getattr(model, "optimizer", None)
    with host_io.collector_paused():
        found, step_dir, plan, built = _validate(model, variables, optimizer, label, step)
        pending: list[Any] = []
        if not built:
            with _compat.creating_variables_without_values() as pending:
                optimizer.build(model.trainable_variables)
        restored = variables + (list(optimizer.variables) if len(plan.paths) > len(variables) else [])
        try:
            if [v.path for v in restored] != list(plan.paths):
                raise RuntimeError(
                    "Expected the optimizer to build the variables its copy built. "
                    f"Received: {[v.path for v in restored][len(variables):]} instead "
                    f"of {list(plan.paths)[len(variables):]}."
                )
            targets = [_target(v) for v in restored]
            sizes = [_local_and_max_read_bytes(sharding, v) for v, (sharding, _) in zip(restored, targets)]
            plan = dataclasses.replace(
                plan,
                groups=group_reads([most for _, most in sizes], GROUP_BYTES),
                read_bytes=sum(most for _, most in sizes),
            )
            _execute(plan, restored, targets, [local for local, _ in sizes], step_dir, label, model, progress)
        finally:
            # Whatever a failure left without a value gets Keras's own
            # initial value: the optimizer is then as `build` leaves it.
            _compat.initialize_pending(v for v in pending if _compat.is_pending(v))
    return found


def _model_variables(model: Any) -> list[Any]:
    """The variables `get_state_tree` saves for the model, each once."""
    seen, out = set(), []
    for v in list(model.trainable_variables) + list(model.non_trainable_variables):
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    for v in out:
        if not isinstance(_compat.variable_array(v), jax.Array):
            raise CheckpointError(
                f"Expected every variable of the model to hold a value. "
                f"Received: '{v.path}' without one (a model built without "
                "values, or not built). Build the model first."
            )
    return out


def _target(variable: Any) -> tuple[jax.sharding.Sharding, Any]:
    """Where a variable's restored array goes, and the layout to give a
    variable without a value: its current array's sharding, else the layout
    Keras would initialize it in."""
    array = _compat.variable_array(variable)
    if isinstance(array, jax.Array):
        return array.sharding, None
    layout = _compat.pending_layout(variable)
    if layout is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0]), None
    return getattr(layout, "backend_layout", layout), layout


def _local_and_max_read_bytes(sharding: jax.sharding.Sharding, variable: Any) -> tuple[int, int]:
    """Bytes of the distinct blocks this process reads for `variable` in
    `sharding`, and the most any process reads."""
    shape = tuple(variable.shape)
    blocks: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(shape).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        blocks.setdefault(device.process_index, set()).add(key)
    itemsize = np.dtype(variable.dtype).itemsize
    per_process = {
        p: sum(math.prod(b - a for a, b in key) * itemsize for key in keys)
        for p, keys in blocks.items()
    }
    return per_process.get(jax.process_index(), 0), max(per_process.values(), default=0)


def _wanted(variable: Any) -> Wanted:
    return Wanted(variable.path, tuple(variable.shape), np.dtype(variable.dtype))


def _describe(optimizer: Any) -> str:
    return f"{type(optimizer).__name__} '{optimizer.name}'"


def _optimizer_wanted(model: Any, optimizer: Any) -> tuple[list[Wanted], bool]:
    """What the optimizer's variables are, built or not: an optimizer never
    built is copied (`from_config`) and the copy built without values, so
    the real one is built only once the checkpoint is known to fit."""
    if optimizer.built:
        return [_wanted(v) for v in optimizer.variables], True
    copy = type(optimizer).from_config(optimizer.get_config())
    try:
        with _compat.creating_variables_without_values():
            copy.build(model.trainable_variables)
        return [_wanted(v) for v in copy.variables], False
    finally:
        # Its iteration and learning-rate scalars were created with values.
        for v in copy.variables:
            array = _compat.variable_array(v)
            if isinstance(array, jax.Array):
                array.delete()


def _agree(error: BaseException | None) -> None:
    """Raises `error` on every process if any process has one."""
    if jax.process_count() == 1:
        if error is not None:
            raise error
        return
    _processes.check_all(
        None if error is None else f"{type(error).__name__}: {error}",
        CheckpointError, "Restoring the checkpoint failed",
    )


def _validate(
    model: Any, variables: list[Any], optimizer: Any, label: str, step: int | None
) -> tuple[int, str, RestorePlan, bool]:
    """Step, step directory, the validated plan and whether the optimizer
    was built; raises (on every process) before anything changes."""
    error: BaseException | None = None
    found, step_dir = -1, ""
    try:
        found, step_dir = orbax_checkpoint.resolve_step(label, step)
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised
        error = e
    _agree(error)
    chosen = int(_processes.broadcast_string(str(found)))
    if chosen != found:  # a save finished between the processes' listings
        found, step_dir = orbax_checkpoint.resolve_step(label, chosen)
    plan, built = None, True
    try:
        stored = orbax_checkpoint.stored_arrays(step_dir)
        optimizer_wanted = None
        saved_optimizer = any(s.key[0] == OPTIMIZER_SECTION for s in stored)
        # A weights-only checkpoint restores into a model whose optimizer
        # has no state yet (compiled, never fitted); it stays unbuilt.
        if optimizer is not None and (optimizer.built or saved_optimizer):
            optimizer_wanted, built = _optimizer_wanted(model, optimizer)
        plan = plan_restore(
            [_wanted(v) for v in variables], optimizer_wanted, stored,
            step=found, label=label, budget=GROUP_BYTES,
            optimizer_name="" if optimizer is None else _describe(optimizer),
        )
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised
        error = e
    _agree(error)
    return found, step_dir, plan, built


def _held_elsewhere(model: Any, restored: Sequence[Any]) -> set[int]:
    """Ids of arrays that variables not being restored also hold (metric
    states): never deleted."""
    ids = {id(v) for v in restored}
    return {
        id(_compat.variable_array(v))
        for v in list(getattr(model, "metrics_variables", ()) or ())
        if id(v) not in ids and _compat.variable_array(v) is not None
    }


def _execute(
    plan: RestorePlan, variables: Sequence[Any], targets: Sequence[tuple[Any, Any]],
    local: Sequence[int], step_dir: str, label: str, model: Any, progress: bool | None,
) -> None:
    keep = _held_elsewhere(model, variables)
    bar = byte_progress(sum(local), f"Restoring step {plan.step}", progress)
    done = 0
    with contextlib.closing(bar):
        for group in plan.groups:
            wanted = {
                plan.keys[i]: jax.ShapeDtypeStruct(
                    tuple(variables[i].shape), np.dtype(variables[i].dtype), sharding=targets[i][0]
                )
                for i in group
            }
            # The old values go first: their memory is what the new take.
            for i in group:
                old = _compat.variable_array(variables[i])
                if isinstance(old, jax.Array) and id(old) not in keep and not old.is_deleted():
                    old.delete()
                del old
            try:
                # Orbax's cross-process waits never end on a lost process: watched.
                arrays = _processes.watching_peers(orbax_checkpoint.read_arrays, step_dir, wanted)
                for i in group:
                    array = arrays[plan.keys[i]]
                    if _compat.is_pending(variables[i]):
                        _compat.materialize_deferred_variable(variables[i], array, targets[i][1])
                    else:
                        variables[i].assign(array)
                jax.block_until_ready(list(arrays.values()))
            except Exception as error:
                paths = [variables[i].path for i in group]
                raise CheckpointError(
                    f"Expected to read step {plan.step} of '{label}'. Received: an "
                    f"error while reading {len(paths)} variables ({', '.join(paths[:4])}"
                    f"{' ...' if len(paths) > 4 else ''}): {error}. The {done} variables "
                    "before them are restored, these have no value now: call "
                    "restore_checkpoint again once the checkpoint can be read."
                ) from error
            del arrays
            done += len(group)
            bar.update(sum(local[i] for i in group))
