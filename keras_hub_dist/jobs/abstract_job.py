"""A job's model built on a mesh with no weight allocated.

`abstract_job` builds the task a job runs (a KerasHub causal LM around its
backbone) exactly as `load_sharded_preset` lays it out — the same layout
map, dtype, quantization, LoRA and remat — with every variable created
without a value and given the layout Keras would give it
(`Variable._initialize_layout`, through `_compat`). Keras's own optimizer
and metric variables, built later for a fit, then take their model
variables' layouts as they do in a real `fit`: the programs lowered on
these variables' `jax.ShapeDtypeStruct`s are the programs the job compiles
(`programs`), and nothing is allocated.

Example:

```python
import keras_hub_dist
from keras_hub_dist.jobs.abstract_job import abstract_job

cls, config, _ = keras_hub_dist.presets.backbone_config("gemma_7b_en", num_layers=2)
job = abstract_job(cls, config, (1, 8))
job.task            # a GemmaCausalLM whose variables have no value
job.distribution    # the keras.distribution.ModelParallel it is laid out on
```
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import keras
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.adapters import enable_lora_without_values
from keras_hub_dist.errors import LayoutError
from keras_hub_dist.shaping.tasks import task_class
from keras_hub_dist.plan.build import build_abstract
from keras_hub_dist.shaping.apply import shape_model
from keras_hub_dist.plan.layouts import get_layout_map
from keras_hub_dist.plan.mesh import axis_sizes, device_mesh
from keras_hub_dist.plan.quantization import quantize_without_values

__all__ = ["AbstractJob", "abstract_job", "sharding_of"]


@dataclasses.dataclass
class AbstractJob:
    """A causal LM on a mesh, every variable laid out and none allocated.

    Attributes:
        task: The KerasHub causal LM (its backbone is `task.backbone`).
        distribution: The `keras.distribution.ModelParallel` it is laid out on.
        mesh_axis_sizes: Mesh axis name -> size.
        layout_source: `"keras_hub_dist"` (the package's default maps) or
            `"keras_hub"` (the backbone's own `get_layout_map`, as stock).
    """

    task: keras.Model
    distribution: keras.distribution.ModelParallel
    mesh_axis_sizes: Mapping[str, int]
    layout_source: str

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The job's distribution as Keras's global one, restored on exit."""
        previous = keras.distribution.distribution()
        keras.distribution.set_distribution(self.distribution)
        try:
            yield
        finally:
            keras.distribution.set_distribution(previous)

    @contextlib.contextmanager
    def without_values(self) -> Iterator[None]:
        """In the job's scope, the variables made in the block (an optimizer's
        step count and learning rate, the metrics' totals, a sampler's seed,
        made by `task.compile`) get no value and then the layout Keras would
        give them: a compile-only device (a TPU / GPU target planned from a
        CPU host) can hold no array."""
        with self.scope():
            with _compat.creating_variables_without_values() as created, _constants_deferred():
                yield
            self.lay_out(created)

    def lay_out(self, variables: Any) -> None:
        """Gives variables created without a value the layout Keras would."""
        with self.scope():
            for variable in variables:
                _compat.initialize_layout(variable)


@contextlib.contextmanager
def _constants_deferred() -> Iterator[None]:
    """Inside `creating_variables_without_values`, a variable made from a
    constant (an optimizer's step count and learning rate, made when it is
    constructed) takes an initializer returning it instead: Keras refuses a
    constant in a stateless scope, and a value would be an array on the
    distribution's devices, which a compile-only TPU / GPU target cannot
    hold. `keras.Variable.__init__` is wrapped for the block only."""
    cls = keras.Variable
    own = "__init__" in vars(cls)
    original = cls.__init__

    def init(self, initializer=None, shape=None, dtype=None, *args, **kwargs):
        if initializer is not None and not callable(initializer) and not isinstance(initializer, str):
            value = np.asarray(initializer)
            dtype, shape = dtype or value.dtype.name, value.shape if shape is None else shape

            def initializer(shape, dtype=None, value=value):
                return keras.ops.cast(keras.ops.reshape(value, shape), dtype)

        original(self, initializer, shape, dtype, *args, **kwargs)

    cls.__init__ = init
    try:
        yield
    finally:
        if own:
            cls.__init__ = original
        else:
            del cls.__init__


def sharding_of(variable: Any, distribution: keras.distribution.Distribution) -> jax.sharding.Sharding:
    """The `jax.sharding.Sharding` a variable has, or will have once it has a value."""
    if not _compat.is_pending(variable):
        return variable.value.sharding
    layout = _compat.pending_layout(variable)
    if layout is None:
        return jax.sharding.NamedSharding(
            distribution.device_mesh.backend_mesh, jax.sharding.PartitionSpec()
        )
    return layout.backend_layout


def _stock_layout_map(cls: type, mesh: keras.distribution.DeviceMesh, model: keras.Model) -> Any:
    """The backbone's own KerasHub map where it has one (what a stock user
    passes to `ModelParallel`), else the package's."""
    keras_hub_map = getattr(cls, "get_layout_map", None)
    if callable(keras_hub_map):
        return keras_hub_map(mesh), "keras_hub"
    return get_layout_map(model, mesh), "keras_hub_dist"


def _concrete_task(task_cls: type, backbone_cls: type) -> type:
    """The task class built around `backbone_cls` (e.g. `Llama3CausalLM`
    for `CausalLM`), as `from_preset` picks it."""
    import keras_hub

    if getattr(task_cls, "backbone_cls", None) is backbone_cls:
        return task_cls
    for name in dir(keras_hub.models):
        candidate = getattr(keras_hub.models, name)
        if (
            isinstance(candidate, type)
            and issubclass(candidate, task_cls)
            and getattr(candidate, "backbone_cls", None) is backbone_cls
            and _built_from_a_backbone(candidate)
        ):
            return candidate
    raise LayoutError(
        f"Expected a {task_cls.__name__} for {backbone_cls.__name__}. Received: "
        "none in keras_hub.models."
    )


def _built_from_a_backbone(cls: type) -> bool:
    """Whether `cls(backbone=..., preprocessor=None)` constructs it: not a
    task that needs more (Gemma 4's `Gemma4AssistantCausalLM`, a drafter
    with its own sizes, shares `Gemma4Backbone` with `Gemma4CausalLM`)."""
    required = [
        p.name for p in inspect.signature(cls.__init__).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return set(required) <= {"self", "backbone", "preprocessor"}


def abstract_job(
    backbone_cls: type,
    config: Mapping[str, Any],
    mesh: Any,
    *,
    layout_map: Any = None,
    stock_layout: bool = False,
    quantize: str | None = None,
    lora_rank: int | None = None,
    remat: Any = None,
    task: str = "causal_lm",
) -> AbstractJob:
    """Builds the job's task on `mesh` with no weight allocated.

    Args:
        backbone_cls: The KerasHub backbone class.
        config: Its constructor arguments (dtype included).
        mesh: A mesh of real devices (the programs are compiled for them):
            a `(batch, model)` shape, a dict, a Keras or JAX mesh.
        layout_map: A `keras.distribution.LayoutMap`; default the package's
            map for the family, checked per shape (`get_layout_map`).
        stock_layout: Use the backbone's own KerasHub map instead, and
            leave the blocks' outputs to XLA (stock).
        quantize: `"int8"` / `"int4"`: the layers Keras would quantize hold
            quantized variables, laid out as a quantized load lays them out.
        lora_rank: LoRA on the projections PEFT adapts (`enable_lora`).
        remat: Rematerialization of the decoder blocks (`load_sharded_preset`'s
            `remat=`: a `keras.RematScope` mode or scope).
        task: The task, `"causal_lm"`.

    Raises:
        LayoutError: The mesh needs more devices than this process has.
    """
    keras_mesh = device_mesh(mesh)
    backbone = build_abstract(backbone_cls, config)
    shape_model(backbone, remat, batch_split=not stock_layout)
    if quantize is not None:
        quantize_without_values(backbone, quantize)
    source = "keras_hub_dist"
    if layout_map is None and stock_layout:
        layout_map, source = _stock_layout_map(backbone_cls, keras_mesh, backbone)
    elif layout_map is None:
        layout_map = get_layout_map(backbone, keras_mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name=keras_mesh.axis_names[0]
    )
    task_cls = _concrete_task(task_class(task, backbone_cls, {}, backbone_cls.__name__), backbone_cls)
    job = AbstractJob(None, distribution, axis_sizes(keras_mesh), source)
    with job.scope():
        job.lay_out(backbone.weights)
        # The task's constructor compiles it (KerasHub's default optimizer
        # and sampler): their variables too are created without a value.
        with _compat.creating_variables_without_values() as created, _constants_deferred():
            job.task = task_cls(backbone=backbone, preprocessor=None)
        job.lay_out(created)
        if lora_rank is not None:
            job.lay_out(enable_lora_without_values(job.task, rank=lora_rank))
    return job
