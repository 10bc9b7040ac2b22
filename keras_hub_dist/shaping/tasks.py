"""Tasks (`task="causal_lm"`): the task class, built around a loaded backbone."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import keras

from keras_hub_dist.errors import PresetError
from keras_hub_dist.storage.locations import Location, keras_hub_configs

__all__ = ["build_task", "check_classes", "task_class"]

TASK_WEIGHTS_FILE = "task.weights.h5"
# The only packages Keras's deserialization imports a class from by its
# `module` (keras.src.saving.serialization_lib._retrieve_class_or_fn).
_IMPORTED_PACKAGES = ("keras", "keras_hub", "keras_cv", "keras_nlp")


def _snake(name: str) -> str:
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def task_class(task: Any, backbone_cls: type, metadata: Mapping[str, Any], label: str) -> type:
    import keras_hub

    if isinstance(task, type) and issubclass(task, keras_hub.models.Task):
        cls = task
    else:
        wanted = str(task).replace("-", "_").lower()
        candidates = {
            _snake(n): getattr(keras_hub.models, n)
            for n in dir(keras_hub.models)
            if isinstance(getattr(keras_hub.models, n), type)
            and issubclass(getattr(keras_hub.models, n), keras_hub.models.Task)
        }
        cls = candidates.get(wanted) or candidates.get(wanted.replace("_", ""))
        if cls is None:
            listed = metadata.get("tasks") or []
            raise PresetError(
                f"Unknown task {task!r}. Expected the snake_case name of a "
                f"KerasHub task class, e.g. 'causal_lm'"
                + (f"; this preset lists {[_snake(t) for t in listed]}" if listed else "")
                + f". Received: task={task!r}."
            )
    custom = set(keras.saving.get_custom_objects().values())
    compatible = [
        c for c in custom | {cls}
        if isinstance(c, type) and issubclass(c, cls) and getattr(c, "backbone_cls", None) is backbone_cls
    ]
    if not compatible:
        listed = metadata.get("tasks") or []
        raise PresetError(
            f"The preset {label!r} ({backbone_cls.__name__}) has no "
            f"{cls.__name__} task. Expected one of the tasks it lists: "
            f"{[_snake(t) for t in listed] or 'none listed'}. Received: task={task!r}."
        )
    return cls


def check_classes(location: Location) -> None:
    """Refuses a task, preprocessor or tokenizer config naming a class that
    is neither registered with Keras nor of Keras / KerasHub, before
    KerasHub's loaders see it (Keras would not import it either: this says
    so first, as a `PresetError`). No module is imported here; what is
    built is built by Keras inside its safe mode, which this package never
    turns off."""
    for name, config in keras_hub_configs(location):
        stack: list[Any] = [config]
        while stack:
            node = stack.pop()
            if isinstance(node, list):
                stack.extend(node)
            if not isinstance(node, dict):
                continue
            stack.extend(node.values())
            module, registered = node.get("module"), node.get("registered_name")
            if "class_name" not in node or not isinstance(module, str):
                continue
            if module.split(".")[0] in _IMPORTED_PACKAGES or (
                isinstance(registered, str) and keras.saving.get_registered_object(registered) is not None
            ):
                continue
            raise PresetError(
                f"{location.path_of(name)} names the class {node['class_name']!r} of module "
                f"{module!r} (registered_name={registered!r}). Expected a class registered "
                "with Keras (keras.saving.register_keras_serializable) or one of Keras / "
                "KerasHub. Received: neither; nothing was imported. Import the package "
                "that registers it first if you trust it, or do not load this preset."
            )


def build_task(
    task_cls: type, location: Location, backbone: keras.Model, task_kwargs: Mapping[str, Any]
) -> keras.Model:
    # KerasHub's own loader builds the task around our backbone (with the
    # preprocessor / tokenizer assets of the preset) and, with
    # load_weights=False, reads no backbone weight.
    model = task_cls.from_preset(
        location.keras_hub_dir(), load_weights=False, backbone=backbone, **task_kwargs
    )
    if location.has(TASK_WEIGHTS_FILE) and model.has_task_weights():
        # Task heads are small; Keras's own loader places them.
        model.load_task_weights(location.local_copy(TASK_WEIGHTS_FILE))
    return model
