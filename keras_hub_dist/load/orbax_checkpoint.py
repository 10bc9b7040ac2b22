"""Reading what `keras.callbacks.OrbaxCheckpoint` wrote, through Orbax itself.

The callback writes, per saved step, `<directory>/<step>/pytree` (the
model's `get_state_tree()`, arrays in TensorStore's OCDBT / zarr3 layout),
beside `model_config` and `assets`, through Orbax's v1 API
(`orbax.checkpoint.v1`, Keras's own choice). Reading it with the same
library keeps every location Orbax reads (local, `gs://`, what `etils.epath`
opens) and its layout decisions out of this package; Orbax (TensorStore)
reads only the chunks a requested array's blocks cover.

Three things are asked of it here:

- `resolve_step`: the step directory of a checkpoint (the latest finished
  step, or a given one), with errors that say what is there instead;
- `stored_arrays`: the key path, shape and dtype of every array of the
  step's `pytree` item, from its metadata (no array is read);
- `read_arrays`: some arrays of it (a partial load), each straight into a
  given sharding: each process reads only the blocks its devices hold, once
  per process, and places them (`jax.device_put` per device).

`orbax-checkpoint` is an optional dependency (`pip install
"keras-hub-dist[checkpoint]"`), imported on first use.

Example:

```python
step, step_dir = resolve_step("/ckpt", None)
stored = stored_arrays(step_dir)
arrays = read_arrays(step_dir, {s.key: jax.ShapeDtypeStruct(s.shape, s.dtype,
                                                            sharding=...)
                                for s in stored[:3]})
```
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax

from keras_hub_dist.errors import CheckpointError
from keras_hub_dist.load.restore_plan import Stored
from keras_hub_dist.storage.locations import is_url
from keras_hub_dist.storage.names import local_path

__all__ = ["ITEM", "orbax_version", "read_arrays", "require_orbax", "resolve_step", "stored_arrays"]

# The item `keras.callbacks.OrbaxCheckpoint` saves the state tree under.
ITEM = "pytree"
_TMP_MARK = ".orbax-checkpoint-tmp"
_SHOWN = 12


def require_orbax() -> Any:
    """`orbax.checkpoint`, or an ImportError that says how to install it."""
    try:
        import orbax.checkpoint as ocp
    except ImportError as error:
        raise ImportError(
            "Restoring a keras.callbacks.OrbaxCheckpoint checkpoint needs "
            "orbax-checkpoint. Install it with: pip install "
            "\"keras-hub-dist[checkpoint]\" (or pip install orbax-checkpoint)."
        ) from error
    return ocp


def orbax_version() -> str:
    return str(getattr(require_orbax(), "__version__", "?"))


def _path(directory: Any) -> Any:
    from etils import epath  # an orbax-checkpoint dependency

    text = os.fspath(directory) if isinstance(directory, os.PathLike) else str(directory)
    if not is_url(text):
        # Orbax's TensorStore (OCDBT) reads arrays by absolute path only: under
        # a relative one its metadata has no arrays at all (measured, 0.12.8).
        text = os.path.abspath(text)
    return epath.Path(text)


def _names(path: Any) -> list[str]:
    return sorted(p.name for p in path.iterdir())


def _shown(names: list[str]) -> str:
    if not names:
        return "nothing"
    more = len(names) - _SHOWN
    return ", ".join(names[:_SHOWN]) + (f" and {more} more" if more > 0 else "")


def resolve_step(directory: Any, step: int | None) -> tuple[int, str]:
    """The step to read and its directory.

    Args:
        directory: The directory given to `OrbaxCheckpoint` (its steps are
            numbered subdirectories), or one step's directory itself.
        step: A saved step, or `None` for the latest finished one.

    Returns:
        `(step, step directory)`.

    Raises:
        CheckpointError: No such directory; no finished step in it (what
            is there is listed: another kind of checkpoint, or only steps
            still being written or left by a killed save); no such step (the
            saved steps are listed); a step without the `pytree` item.
    """
    ocp = require_orbax()
    label = str(directory)
    root = _path(directory)
    expected = (
        "Expected a directory written by keras.callbacks.OrbaxCheckpoint "
        "(numbered step directories, each with a `pytree` item)."
    )
    if not root.exists():
        raise CheckpointError(f"{expected} Received: '{label}', which does not exist.")
    if not root.is_dir():
        raise CheckpointError(f"{expected} Received: '{label}', which is a file.")
    names = _names(root)
    if ITEM in names and ("_CHECKPOINT_METADATA" in names or root.name.isdigit()):
        # One step's directory, as `model.load_weights` also accepts.
        own = int(root.name) if root.name.isdigit() else None
        if step is not None and own is not None and step != own:
            raise CheckpointError(
                f"Expected step={step} to be the step of '{label}', a step "
                f"directory. Received: the directory of step {own}. Pass "
                "its parent directory to choose among the saved steps."
            )
        _check_inside(str(root), str(root), label)
        return (own if own is not None else -1), str(root)
    finished = {}
    for path in ocp.path.step.checkpoint_steps_paths(root):
        finished[ocp.path.step.step_from_checkpoint_name(path.name)] = path
    if not finished:
        unfinished = [n for n in names if _TMP_MARK in n]
        what = (
            f"only unfinished steps ({_shown(unfinished)}): a save still running, "
            "or killed before it finished"
            if unfinished
            else f"no saved step (it holds: {_shown(names)})"
        )
        hint = " (a KerasHub preset: load it with load_sharded_preset)" if "config.json" in names else ""
        raise CheckpointError(f"{expected} Received: '{label}', with {what}{hint}.")
    if step is None:
        step = max(finished)
    elif step not in finished:
        raise CheckpointError(
            f"Expected step to be one of the steps saved in '{label}': "
            f"{sorted(finished)}. Received: step={step}."
        )
    step_dir = finished[step]
    items = _names(step_dir)
    if ITEM not in items:
        raise CheckpointError(
            f"{expected} Received: step {step} of '{label}', whose items are "
            f"{_shown(items)}, not `{ITEM}`."
        )
    _check_inside(str(root), str(step_dir), label)
    return step, str(step_dir)


def _check_inside(root: str, step_dir: str, label: str) -> None:
    """Refuses a local step whose files (the `pytree` item's, walked without
    following links) resolve outside the checkpoint (`storage.names`)."""
    if is_url(root):
        return  # Orbax reads remote paths through its own store
    item = os.path.join(step_dir, ITEM)
    named = [os.path.relpath(item, root)]
    for folder, subfolders, files in os.walk(item):
        named += [os.path.relpath(os.path.join(folder, n), root) for n in subfolders + files]
    for name in named:
        local_path(root, name.replace(os.sep, "/"), source=f"the checkpoint '{label}'", error=CheckpointError)


def stored_arrays(step_dir: str) -> list[Stored]:
    """Every array of the step's `pytree` item, from its metadata."""
    ocp = require_orbax()
    tree = ocp.v1.metadata(step_dir, checkpointable_name=ITEM).metadata
    found: list[Stored] = []

    def walk(node: Any, key: tuple[str, ...]) -> None:
        if isinstance(node, Mapping):
            for name, child in node.items():
                walk(child, key + (str(name),))
            return
        shape, dtype = getattr(node, "shape", None), getattr(node, "dtype", None)
        if shape is None or dtype is None:
            raise CheckpointError(
                "Expected every leaf of the checkpoint's state tree to be an "
                f"array (as OrbaxCheckpoint saves on JAX). Received: "
                f"{type(node).__name__} at '{'/'.join(key)}' of {step_dir}."
            )
        found.append(Stored(key, tuple(int(d) for d in shape), dtype))

    walk(tree, ())
    return found


def _context(ocp: Any) -> Any:
    context = ocp.v1.Context()
    # Only the arrays asked for are read.
    context.pytree.loading.partial_load = True
    return context


def read_arrays(step_dir: str, targets: Mapping[tuple[str, ...], jax.ShapeDtypeStruct]) -> dict[tuple[str, ...], jax.Array]:
    """Reads the arrays `targets` names, each into its target's sharding.

    Must be called by every process of the job, with the same keys (Orbax
    agrees on each read across the processes).
    """
    ocp = require_orbax()
    tree: dict[str, Any] = {}
    for key, target in targets.items():
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = target
    with _context(ocp):
        loaded = ocp.v1.load(step_dir, tree, checkpointable_name=ITEM)
    out = {}
    for key in targets:
        node = loaded
        for part in key:
            node = node[part]
        out[key] = node
    return out
