"""`plan_memory`: what each device holds for a whole job, before any weight exists.

A job's memory is what XLA's compiler says of the program the job runs,
compiled for the target mesh on abstract values, the way MaxText's
`train_compile.py` plans a training run: `jobs.abstract_job` builds the
task with no weight allocated and every variable in its final sharding,
`jobs.programs` lowers Keras's own train step (`fit`) or KerasHub's own
generate (`generate`, with this package's shaping unless `stock=True`),
and `compiled.memory_analysis()` gives each device's arguments (weights,
optimizer state, LoRA factors, the batch), outputs, aliases and
temporaries. The breakdown of the arguments comes from the variables'
shardings; the temporaries are XLA's figure and include the KV cache of
`generate`. `load` is the weights alone: the sharded load never holds more
than them (1.00x, docs/load.md).

The figures are those of the compiler that ran the plan: on this package's
CPU machines XLA's CPU compiler, which upcasts bf16 dots to f32 and fuses
less than a TPU's or GPU's; run the same plan on a TPU / GPU host for that
compiler's figures (`MemoryPlan.compiler` says which it was).

Example:

```python
import keras_hub_dist

plan = keras_hub_dist.plan_memory(
    "gemma_7b_en", (1, 8), job="fit", lora_rank=8, batch_size=8,
    sequence_length=2048, dtype="bfloat16", hbm_gb=16,
)
print(plan.summary())
plan.fits, plan.total_bytes
```
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import keras
import numpy as np

from keras_hub_dist import _compat
from keras_hub_dist.errors import PlanError
from keras_hub_dist.formats import huggingface
from keras_hub_dist.jobs import programs, targets
from keras_hub_dist.jobs.abstract_job import AbstractJob, abstract_job, sharding_of
from keras_hub_dist.shaping.generate import check_prompt_chunk
from keras_hub_dist.plan import presets
from keras_hub_dist.shaping.remat import remat_scope
from keras_hub_dist.plan.mesh import axis_sizes, device_mesh
from keras_hub_dist.plan.sizes import itemsize

__all__ = ["JOBS", "MemoryPlan", "plan_memory"]

JOBS = ("fit", "generate", "load")
_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What the most loaded device holds for one job (bytes).

    Attributes:
        job: `"fit"`, `"generate"` or `"load"`.
        preset: What was planned (a name, or the model's class).
        mesh_axis_sizes: Mesh axis name -> size.
        options: The job's settings (batch, sequence, optimizer, LoRA rank,
            remat, quantize, dtype, stock).
        compiler: The XLA compiler whose analysis this is, e.g.
            `"cpu (XLA's CPU compiler)"`.
        weights_bytes: The model's weights (LoRA factors excluded).
        optimizer_bytes: The optimizer's state (moments, step count).
        lora_bytes: The LoRA factors.
        kv_cache_bytes: The KV cache `generate` holds, as it is sharded;
            part of `temp_bytes`; `None` where the cache is not laid out
            by this package (stock), for other jobs.
        argument_bytes: XLA: the program's inputs (state and batch).
        output_bytes: XLA: its outputs.
        alias_bytes: XLA: outputs written into donated inputs.
        temp_bytes: XLA: temporaries (activations, gradients, scores, cache).
        total_bytes: arguments + outputs + temporaries - aliases.
        hbm_bytes: The per-device budget, if given.
        alternatives: Plans of changed jobs, when this one does not fit.
        change: For an alternative, what was changed (e.g. `"remat='full'"`).
        target: The target compiled for (`"v5e-8"`), None: this host's CPU
            compiler.
        step_time: The ESTIMATED step time (`jobs.step_time.StepTime`), for
            a target; None on the CPU compiler or when refused.
        refusal: The target compiler's own out-of-memory refusal (TPU), if
            it refused the program: `total_bytes` is then its figure.
    """

    job: str
    preset: str
    mesh_axis_sizes: Mapping[str, int]
    options: Mapping[str, Any]
    compiler: str
    weights_bytes: int
    optimizer_bytes: int
    lora_bytes: int
    kv_cache_bytes: int | None
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    total_bytes: int
    hbm_bytes: int | None = None
    alternatives: tuple["MemoryPlan", ...] = ()
    change: str | None = None
    target: str | None = None
    step_time: Any = None
    refusal: str | None = None

    @property
    def fits(self) -> bool | None:
        """Whether `total_bytes` fits the budget (`None` without one)."""
        return None if self.hbm_bytes is None else self.total_bytes <= self.hbm_bytes

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (alternatives nested, `fits` included)."""
        out = dataclasses.asdict(self)
        out["fits"] = self.fits
        out["alternatives"] = [plan.to_json() for plan in self.alternatives]
        return out

    def summary(self) -> str:
        """A table: the breakdown in MiB, the verdict and the alternatives."""
        mesh = "x".join(str(size) for size in self.mesh_axis_sizes.values())
        settings = ", ".join(f"{k}={v}" for k, v in self.options.items() if v is not None)
        lines = [
            f"{self.job} {self.preset} on mesh {mesh} ({settings})",
            f"per device, from {self.compiler}:",
        ]
        rows = [
            ("weights", self.weights_bytes),
            ("optimizer state", self.optimizer_bytes),
            ("LoRA factors", self.lora_bytes),
            ("KV cache (in temporaries)", self.kv_cache_bytes),
            ("XLA arguments", self.argument_bytes),
            ("XLA temporaries", self.temp_bytes),
            ("XLA outputs - aliases", self.output_bytes - self.alias_bytes),
            ("total", self.total_bytes),
        ]
        for label, value in rows:
            if value is not None and (value or label in ("total", "XLA temporaries")):
                lines.append(f"  {label:<28}{value / _MIB:>12,.1f} MiB")
        if self.refusal is not None:
            lines.append(f"  the compiler refused it: {self.refusal}")
        if self.hbm_bytes is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"  {verdict} in {self.hbm_bytes / 2**30:g} GiB per device")
        if self.step_time is not None:
            lines.extend(self.step_time.lines())
        if self.alternatives:
            lines.append("alternatives:")
            for plan in self.alternatives:
                verdict = "fits" if plan.fits else "does not fit"
                lines.append(
                    f"  {plan.change:<36}{plan.total_bytes / _MIB:>12,.1f} MiB  {verdict}"
                )
        return "\n".join(lines)


def _check(job: str, batch_size: int, sequence_length: int, lora_rank: Any, remat: Any, sizes: Mapping[str, int]) -> None:
    if job not in JOBS:
        raise PlanError(f"Unknown job. Expected one of {list(JOBS)}. Received: job={job!r}.")
    for name, value in (("batch_size", batch_size), ("sequence_length", sequence_length)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise PlanError(f"Expected {name} to be a positive integer. Received: {name}={value!r}.")
    if lora_rank is not None and (not isinstance(lora_rank, (int, np.integer)) or lora_rank < 1):
        raise PlanError(
            f"Expected lora_rank to be a positive integer (or None for a full fine-tune). "
            f"Received: lora_rank={lora_rank!r}."
        )
    try:
        remat_scope(remat)
    except ValueError as error:
        raise PlanError(str(error)) from None
    data = next(iter(sizes.values()))
    if batch_size % data:
        works = [b for b in range(data, 4 * data + 1, data)]
        raise PlanError(
            f"The mesh's data axis ({next(iter(sizes))}={data}) splits the batch. "
            f"Expected a batch_size it divides, e.g. {works}. Received: "
            f"batch_size={batch_size} on mesh {dict(sizes)}."
        )


def _check_positions(source: _Source, sequence_length: int) -> None:
    """A Hugging Face checkpoint's config bounds its positions
    (`max_position_embeddings`). KerasHub's configs of the RoPE families
    keep no bound: a named architecture's sequence is planned as asked."""
    limit = source.max_positions
    if limit is not None and sequence_length > limit:
        raise PlanError(
            f"{source.label} has {limit} positions (max_position_embeddings in its "
            f"config.json). Expected sequence_length <= {limit}. Received: "
            f"sequence_length={sequence_length}."
        )


def _per_device_bytes(variables: Any, job: AbstractJob) -> int:
    total = 0
    for variable in variables:
        shape = tuple(int(d) for d in variable.shape)
        block = sharding_of(variable, job.distribution).shard_shape(shape)
        total += math.prod(block) * itemsize(str(variable.dtype))
    return total


def _compiler() -> str:
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", device.platform)
    if device.platform == "cpu":
        # Not a target's compiler: it upcasts bf16 dots to f32 and fuses less.
        return f"{targets.CPU_COMPILER}; plan_memory(..., target='v5e-8') for a TPU's"
    return f"{device.platform} (XLA's {device.platform.upper()} compiler, {kind})"


def _device_count_check(mesh: Any) -> None:
    sizes = mesh if isinstance(mesh, Mapping) else None
    if isinstance(mesh, (tuple, list)):
        needed = math.prod(mesh)
    elif sizes is not None:
        needed = math.prod(sizes.values())
    else:
        return
    if needed > jax.device_count():
        raise PlanError(
            f"The plan compiles the job for mesh {mesh}: Expected at least {needed} "
            f"devices. Received: {jax.device_count()} ({jax.devices()[0].platform}). "
            "On CPU, run `keras-hub-dist plan` (it simulates the devices), or call "
            f"jax.config.update('jax_num_cpu_devices', {needed}) before JAX starts."
        )


@dataclasses.dataclass(frozen=True)
class _Source:
    """What a plan builds: the backbone class and config, the layout map a
    loaded model was laid out with, a label, and the positions the
    checkpoint's config bounds (Hugging Face `max_position_embeddings`)."""

    backbone_cls: type
    config: Mapping[str, Any]
    layout_map: Any
    label: str
    max_positions: int | None


def _source(preset_or_model: Any, dtype: Any, overrides: Mapping[str, Any]) -> _Source:
    overrides = dict(overrides)
    if dtype is not None:
        overrides["dtype"] = dtype
    if isinstance(preset_or_model, keras.Model):
        backbone = getattr(preset_or_model, "backbone", preset_or_model)
        config = {**backbone.get_config(), **overrides}
        distribution = keras.distribution.distribution()
        layout_map = _compat.distribution_layout_map(distribution) if distribution else None
        return _Source(type(backbone), config, layout_map, type(backbone).__name__, None)
    label = os.fspath(preset_or_model) if isinstance(preset_or_model, os.PathLike) else preset_or_model
    config_file = os.path.join(str(label), "config.json")
    if isinstance(label, str) and os.path.isfile(config_file):
        hf_config = presets.read_json(config_file)
        if huggingface.recognizes(hf_config):
            cls, config = huggingface.backbone_config(hf_config, label)
            limit = hf_config.get("max_position_embeddings")
            return _Source(cls, {**config, **overrides}, None, label, limit if isinstance(limit, int) else None)
    cls, config, entry = presets.backbone_config(label, **overrides)
    return _Source(cls, config, None, entry.name if entry is not None else str(label), None)


def plan_memory(
    preset_or_model: Any,
    mesh: Any = None,
    *,
    job: str = "fit",
    batch_size: int = 8,
    sequence_length: int = 2048,
    optimizer: Any = "adam",
    lora_rank: int | None = None,
    remat: Any = None,
    dtype: Any = None,
    quantize: str | None = None,
    num_layers: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    stock: bool = False,
    prompt_chunk: int | None = 512,
    sampler: str = "top_k",
    hbm_gb: float | None = None,
    alternatives: bool = True,
    target: str | None = None,
) -> MemoryPlan:
    """Plans what each device holds for a job, from XLA, before any weight exists.

    Builds the job's causal LM on `mesh` with no weight allocated (as
    `load_sharded_preset(..., task="causal_lm")` lays it out), lowers the
    program the job runs on abstract values, compiles it for the mesh's
    devices and reads XLA's per-device memory analysis.

    Args:
        preset_or_model: A named architecture (`"gemma_7b_en"`), a KerasHub
            preset or Hugging Face checkpoint directory (its config.json),
            or a loaded model (its config, and on its own mesh its layout
            map, planned abstractly: nothing more is allocated).
        mesh: A `(batch, model)` shape such as `(1, 8)`, a dict, a Keras or
            JAX mesh; default all devices on the model axis.
        job: `"fit"` (Keras's train step for one batch), `"generate"`
            (KerasHub's generate: `sequence_length` is `max_length`, the
            prompt and the new tokens; any prompt within it compiles the
            same program) or `"load"` (the weights alone).
        batch_size: The global batch.
        sequence_length: Tokens per sequence (`max_length` for generate).
        optimizer: A Keras optimizer name or instance (fit).
        lora_rank: LoRA on the projections PEFT adapts (fit; None: full).
        remat: Rematerialization of the decoder blocks (`"full"`, ...,
            `load_sharded_preset`'s `remat=`).
        dtype: The weights' dtype policy, e.g. `"bfloat16"`.
        quantize: `"int8"` / `"int4"` weights, as `quantize=` loads them.
        num_layers: Plan a reduced depth (a quick look); default full depth.
        overrides: Other backbone config fields to replace.
        stock: Plan what stock KerasHub runs: the backbone's own layout map
            and KerasHub's own `generate` (no prompt chunks, no cache
            layout), for comparison.
        prompt_chunk: The prompt pass's chunk (generate, ours).
        sampler: KerasHub's sampler name (generate): `"top_k"` (a causal
            LM's default), `"greedy"`, ...
        hbm_gb: The per-device budget in GiB; the plan says whether the job
            fits and, if not, plans the alternatives.
        alternatives: Plan alternatives when the job does not fit.
        target: Compile with that chip's compiler from this host
            (`jobs.targets.TARGETS`: `"v5e-8"`, `"v6e-8"`, `"v4-8"`,
            `"v5p-8"`, larger slices, `"h100-8"`): `mesh` is then a shape of
            the target's devices, the budget defaults to a device's memory,
            and the plan has an estimated step time. None: this host's
            compiler (XLA's CPU compiler on simulated devices).

    Returns:
        A `MemoryPlan`: `summary()` for a table, `to_json()` for a dict.

    Raises:
        PlanError: An unknown job, optimizer or remat mode, a batch the
            data axis does not divide, `lora_rank` < 1, too few devices;
            an unknown target, its compiler not installed, a mesh that is
            not the target's device count, a budget over its memory.
        UnknownPresetError: An unknown named architecture.
    """
    if target is not None:
        target = targets.get_target(target)
        targets.check_budget(target, hbm_gb)
        hbm_gb = target.hbm_bytes / 2**30 if hbm_gb is None else hbm_gb
        mesh = targets.target_mesh(target, mesh)
    else:
        _device_count_check(mesh)
    sizes = axis_sizes(device_mesh(mesh, abstract=True))
    _check(job, batch_size, sequence_length, lora_rank, remat, sizes)
    try:
        check_prompt_chunk(prompt_chunk)
    except ValueError as error:
        raise PlanError(str(error)) from None
    if job == "fit":
        try:
            programs.optimizer_for(optimizer)
        except ValueError as error:
            raise PlanError(str(error)) from None
    all_overrides = dict(overrides or {})
    if num_layers is not None:
        all_overrides["num_layers"] = num_layers
    source = _source(preset_or_model, dtype, all_overrides)
    _check_positions(source, sequence_length)
    settings = dict(
        batch_size=batch_size,
        sequence_length=sequence_length,
        optimizer=(optimizer if isinstance(optimizer, str) else type(optimizer).__name__) if job == "fit" else None,
        lora_rank=lora_rank,
        remat=getattr(remat, "mode", remat),  # a RematScope by its mode, for JSON
        quantize=quantize,
        dtype=dtype,
        num_layers=num_layers,
        stock=stock,
    )
    if job == "generate" and sampler != "top_k":
        settings["sampler"] = sampler
    plan = _plan_once(source, mesh, job, settings, optimizer, prompt_chunk, hbm_gb, target=target)
    if alternatives and plan.fits is False:
        plan = dataclasses.replace(
            plan,
            alternatives=tuple(
                _plan_once(source, alt_mesh, job, alt, optimizer, prompt_chunk, hbm_gb, change=change, target=target)
                for change, alt_mesh, alt in _alternatives(job, settings, mesh, sizes)
            ),
        )
    return plan


def _alternatives(job: str, settings: Mapping[str, Any], mesh: Any, sizes: Mapping[str, int]):
    """`(what changed, mesh, settings)` for each job worth planning instead."""
    devices = math.prod(sizes.values())
    if job == "fit" and settings["remat"] is None:
        yield "remat='full'", mesh, {**settings, "remat": "full"}
    if job == "fit" and settings["lora_rank"] is None and settings["quantize"] is None:
        yield "lora_rank=8", mesh, {**settings, "lora_rank": 8}
    if job == "generate" and settings["quantize"] is None:
        yield "quantize='int8'", mesh, {**settings, "quantize": "int8"}
    data = next(iter(sizes.values()))
    half = settings["batch_size"] // 2
    if half >= data and half % data == 0:
        yield f"batch_size={half}", mesh, {**settings, "batch_size": half}
    for batch in range(1, devices + 1):
        other = (batch, devices // batch)
        if devices % batch or other == tuple(sizes.values()) or settings["batch_size"] % batch:
            continue
        yield f"mesh {other[0]}x{other[1]}", other, dict(settings)


def _plan_once(
    source: _Source, mesh: Any, job: str, settings: Mapping[str, Any], optimizer: Any,
    prompt_chunk: int | None, hbm_gb: float | None, change: str | None = None, target: Any = None,
) -> MemoryPlan:
    if target is not None and not isinstance(mesh, jax.sharding.Mesh):
        mesh = targets.target_mesh(target, mesh)
    # A loaded model's own layout map is for its own mesh only.
    layout_map = source.layout_map
    if layout_map is not None and axis_sizes(layout_map.device_mesh) != axis_sizes(device_mesh(mesh, abstract=True)):
        layout_map = None
    built = abstract_job(
        source.backbone_cls,
        source.config,
        mesh,
        layout_map=layout_map,
        stock_layout=settings["stock"],
        quantize=settings["quantize"],
        lora_rank=settings["lora_rank"] if job == "fit" else None,
        remat=settings["remat"],
    )
    task = built.task
    kv_cache = step_time = refusal = None
    lora = [v for v in task.weights if "lora_kernel" in v.path]
    lora_ids = {id(v) for v in lora}
    weights_bytes = _per_device_bytes([v for v in task.weights if id(v) not in lora_ids], built)
    if job == "fit":
        lowered = programs.lower_fit(built, settings["batch_size"], settings["sequence_length"], optimizer)
    elif job == "generate":
        if settings.get("sampler"):
            with built.without_values():
                task.compile(sampler=settings["sampler"])
        lowered, kv_cache = programs.lower_generate(
            built, settings["batch_size"], settings["sequence_length"],
            prompt_chunk=None if settings["stock"] else prompt_chunk, shard_batch=not settings["stock"],
        )
    if job in ("fit", "generate"):
        memory, step_time, refusal = targets.compile_job(
            lowered, target, job, task.backbone, built.mesh_axis_sizes, settings["batch_size"],
            settings["sequence_length"], weights_bytes,
            # Stock's cache is laid out by XLA: its decode estimate assumes ours.
            kv_cache if kv_cache is not None or job != "generate" else programs.kv_cache_bytes(
                built, settings["batch_size"], settings["sequence_length"]),
        )
    else:
        weights = _per_device_bytes(task.weights, built)
        memory = dict(argument_bytes=weights, output_bytes=0, alias_bytes=0, temp_bytes=0, total_bytes=weights)
    optimizer_variables = list(getattr(getattr(task, "optimizer", None), "variables", None) or ())
    return MemoryPlan(
        job=job,
        preset=source.label,
        mesh_axis_sizes=dict(built.mesh_axis_sizes),
        options=dict(settings),
        compiler=targets.compiler_label(target) if target is not None else _compiler(),
        weights_bytes=weights_bytes,
        optimizer_bytes=_per_device_bytes(optimizer_variables, built) if job == "fit" else 0,
        lora_bytes=_per_device_bytes(lora, built),
        kv_cache_bytes=kv_cache,
        argument_bytes=memory.get("argument_bytes", 0),
        output_bytes=memory.get("output_bytes", 0),
        alias_bytes=memory.get("alias_bytes", 0),
        temp_bytes=memory.get("temp_bytes", 0),
        total_bytes=memory["total_bytes"],
        hbm_bytes=None if hbm_gb is None else int(hbm_gb * 2**30),
        change=change,
        target=None if target is None else target.name,
        step_time=step_time,
        refusal=refusal,
    )
