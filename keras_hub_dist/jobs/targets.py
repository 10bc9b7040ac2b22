"""Plan targets: the TPU and GPU compilers, run from a CPU host.

A target is a chip and a slice (`"v5e-8"`: 8 TPU v5e chips). Its devices
are compile-only: `jax.experimental.topologies.get_topology_desc` gives
libtpu's (pip `jax[tpu]`) or XLA:GPU's (pip `jax-cuda12-plugin`, with a GPU
target config and no GPU) devices, a `jax.sharding.Mesh` of them lowers and
compiles the job's program with that chip's own compiler, and nothing can
run or be allocated on them. The compiler's memory analysis is then the
figure a job on that slice would get; a TPU program that does not fit is
refused at compile time (`RESOURCE_EXHAUSTED`), the way MaxText's
`train_compile.py` checks a run.

Example:

```python
from keras_hub_dist.jobs import targets

target = targets.get_target("v5e-8")
mesh = targets.target_mesh(target, (1, 8))  # a jax Mesh of compile-only devices
targets.compiler_label(target)              # 'TPU v5 lite: libtpu 0.0.42.1 ...'
```
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import importlib.resources
import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from keras_hub_dist.errors import PlanError
from keras_hub_dist.jobs.chips import CHIPS, Chip

__all__ = [
    "CPU_COMPILER",
    "TARGETS",
    "Target",
    "check_budget",
    "compile_for_target",
    "compile_job",
    "compiler_label",
    "get_target",
    "target_devices",
    "target_mesh",
]

CPU_COMPILER = "cpu (XLA's CPU compiler on simulated devices, not a target's compiler)"


@dataclasses.dataclass(frozen=True)
class Target:
    """A slice of accelerators the plan compiles for.

    Attributes:
        name: E.g. `"v5e-8"` (Cloud TPU's accelerator type) or `"h100-8"`.
        platform: `"tpu"` or `"cuda"`.
        chip: The key of its chip in `chips.CHIPS`.
        topology: libtpu's topology name (`"v5e:2x4"`) or XLA:GPU's
            `"1x1x8"` (slices x hosts x devices).
        devices: JAX devices (TPU v4 / v5p: one per chip, megacore).
        chip_config: libtpu's chip config (`"default"`, `"megacore"`).
    """

    name: str
    platform: str
    chip: str
    topology: str
    devices: int
    chip_config: str = "default"

    @property
    def spec(self) -> Chip:
        """The chip's published peaks."""
        return CHIPS[self.chip]

    @property
    def hbm_bytes(self) -> int:
        """Each device's memory (bytes)."""
        return self.spec.hbm_bytes


def _table() -> dict[str, Target]:
    table = {}
    # v5e / v6e: one TensorCore per chip, `vXe-N` is N chips (2D slices).
    for chip, tpu in (("v5e", "v5e"), ("v6e", "v6e")):
        for chips, shape in ((8, "2x4"), (16, "4x4"), (32, "4x8"), (64, "8x8"), (128, "8x16"), (256, "16x16")):
            table[f"{chip}-{chips}"] = Target(f"{chip}-{chips}", "tpu", chip, f"{tpu}:{shape}", chips)
    # v4 / v5p: two TensorCores per chip as one megacore device, `vX-N` is
    # N TensorCores, N / 2 chips (3D slices).
    for chip in ("v4", "v5p"):
        for cores, shape in ((8, "2x2x1"), (16, "2x2x2"), (32, "2x2x4"), (64, "2x4x4"), (128, "4x4x4")):
            chips = cores // 2
            table[f"{chip}-{cores}"] = Target(f"{chip}-{cores}", "tpu", chip, f"{chip}:{shape}", chips, "megacore")
    for gpus in (1, 2, 4, 8):
        table[f"h100-{gpus}"] = Target(f"h100-{gpus}", "cuda", "h100", f"1x1x{gpus}", gpus)
    return table


TARGETS: Mapping[str, Target] = _table()

_INSTALL = {
    "tpu": ('libtpu', 'pip install "keras-hub-dist[tpu]"  (or: pip install "jax[tpu]=={jax}")'),
    "cuda": ('jax-cuda12-plugin', 'pip install "keras-hub-dist[cuda-plan]"  (or: pip install jax-cuda12-plugin=={jax})'),
}


def get_target(target: Any) -> Target:
    """The `Target` named `target` (a `Target` is returned as is).

    Raises:
        PlanError: An unknown name (the message lists the supported ones).
    """
    if isinstance(target, Target):
        return target
    key = str(target).lower().replace("_", "-") if isinstance(target, str) else None
    if key not in TARGETS:
        raise PlanError(
            f"Unknown plan target. Expected one of {sorted(TARGETS, key=_order)}. "
            f"Received: target={target!r}. Other GPUs need an XLA GpuTargetConfigProto; "
            "H100 SXM 80GB's ships with the package."
        )
    return TARGETS[key]


def _order(name: str) -> tuple:
    chip, count = name.rsplit("-", 1)
    return chip, int(count)


def _installed(platform: str) -> str | None:
    package = _INSTALL[platform][0]
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _require_compiler(target: Target) -> str:
    version = _installed(target.platform)
    if version is None:
        package, command = _INSTALL[target.platform]
        raise PlanError(
            f"Planning for {target.name} compiles with its own compiler: Expected "
            f"the {package} package installed. Received: none in this environment. "
            f"Install it with `{command.format(jax=jax.__version__)}`."
        )
    return version


def gpu_target_config(target: Target) -> str:
    """The XLA `GpuTargetConfigProto` text of a GPU target (shipped with the
    package: `jobs/h100_sxm_80gb.txtpb`, NVIDIA's published H100 SXM figures)."""
    return importlib.resources.files("keras_hub_dist.jobs").joinpath("h100_sxm_80gb.txtpb").read_text()


@functools.cache
def target_devices(name: str) -> tuple[Any, ...]:
    """The target's compile-only JAX devices (created once per process).

    Raises:
        PlanError: An unknown target, or its compiler is not installed.
    """
    from jax.experimental import topologies

    target = get_target(name)
    _require_compiler(target)
    if target.platform == "tpu":
        # libtpu looks for a TPU host's metadata server and worker list when
        # it starts; a compile-only client needs neither, and with these it
        # starts quietly. Several processes (test workers) may each load it.
        os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=target.topology, chip_config_name=target.chip_config,
            chips_per_host_bounds=(2, 2, 1), num_slices=1, wrap=(False, False, False),
        )
    else:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=gpu_target_config(target), topology=target.topology
        )
    devices = tuple(topology.devices)
    if len(devices) != target.devices:
        raise PlanError(
            f"Expected {target.devices} devices for {target.name} ({target.topology}). "
            f"Received: {len(devices)} from the {target.platform} compiler."
        )
    return devices


def target_mesh(target: Any, mesh: Any, axis_names: Sequence[str] = ("batch", "model")) -> jax.sharding.Mesh:
    """A `jax.sharding.Mesh` of the target's devices in the shape of `mesh`
    (a `(batch, model)` shape, a `{name: size}` dict, or `None` for
    `(1, devices)`).

    Raises:
        PlanError: A mesh whose size is not the target's device count, or a
            mesh of real devices (pass its shape instead).
    """
    target = get_target(target)
    if mesh is None:
        names, shape = tuple(axis_names), (1, target.devices)
    elif isinstance(mesh, Mapping):
        names, shape = tuple(str(k) for k in mesh), tuple(mesh.values())
    elif isinstance(mesh, Sequence) and not isinstance(mesh, str):
        names, shape = tuple(axis_names), tuple(mesh)
    else:
        raise PlanError(
            f"With target={target.name!r}, expected the mesh as a shape such as (1, "
            f"{target.devices}) or a dict such as {{'batch': 1, 'model': {target.devices}}}. "
            f"Received: {mesh!r} of type {type(mesh).__name__} (a mesh of this host's devices)."
        )
    if len(names) != len(shape) or not all(isinstance(s, (int, np.integer)) and s >= 1 for s in shape):
        raise PlanError(f"Expected positive integer mesh axis sizes. Received: mesh={mesh!r}.")
    if math.prod(shape) != target.devices:
        works = [f"({b}, {target.devices // b})" for b in range(1, target.devices + 1) if target.devices % b == 0]
        raise PlanError(
            f"{target.name} has {target.devices} devices: Expected a mesh of "
            f"{target.devices} devices, e.g. {', '.join(works)}. Received: mesh={mesh!r} "
            f"({math.prod(shape)} devices)."
        )
    devices = np.array(target_devices(target.name)).reshape(tuple(int(s) for s in shape))
    return jax.sharding.Mesh(devices, names)


def check_budget(target: Any, hbm_gb: float | None) -> None:
    """A budget the target's devices cannot have is refused.

    Raises:
        PlanError: `hbm_gb` over the target's per-device memory.
    """
    target = get_target(target)
    if hbm_gb is not None and hbm_gb * 2**30 > target.hbm_bytes:
        raise PlanError(
            f"{target.name}'s devices have {target.hbm_bytes / 2**30:g} GiB each: Expected "
            f"hbm_gb <= {target.hbm_bytes / 2**30:g}. Received: hbm_gb={hbm_gb!r}. Leave it "
            "out to plan against the whole device."
        )


def compiler_label(target: Any) -> str:
    """What compiled the plan: the target's chip, compiler and its version."""
    if target is None:
        return CPU_COMPILER
    target = get_target(target)
    kind = target_devices(target.name)[0].device_kind
    if target.platform == "tpu":
        return f"{kind} x{target.devices} ({target.name}): libtpu {_installed('tpu')}'s TPU compiler, compile-only"
    return f"{kind} x{target.devices} ({target.name}): XLA:GPU of jax-cuda12-plugin {_installed('cuda')}, compile-only"


_SIZE = r"([0-9.]+)\s*([KMGT]?)i?B?"
_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _refusal_figures(message: str) -> tuple[int, int | None] | None:
    """(required, available) bytes from libtpu's out-of-memory refusal."""
    for pattern in (
        rf"\({_SIZE}\) exceeds available HBM \({_SIZE}\)",
        rf"Used {_SIZE} of {_SIZE} hbm",
    ):
        match = re.search(pattern, message)
        if match:
            used = float(match.group(1)) * _UNITS[match.group(2)]
            available = float(match.group(3)) * _UNITS[match.group(4)]
            return int(used), int(available)
    return None


@dataclasses.dataclass(frozen=True)
class Compiled:
    """A program compiled for a target, or the compiler's refusal.

    Attributes:
        executable: The `jax.stages.Compiled` (None when refused).
        refusal: The compiler's out-of-memory message (None when compiled).
        required_bytes: The refusal's figure of what the program needs.
        available_bytes: The refusal's figure of what a device offers.
    """

    executable: Any
    refusal: str | None = None
    required_bytes: int | None = None
    available_bytes: int | None = None


def compile_for_target(lowered: Any) -> Compiled:
    """Compiles `lowered` with its devices' compiler; a TPU program that does
    not fit HBM is the compiler's refusal (its own figures), not an error."""
    try:
        with warnings.catch_warnings():
            # JAX's persistent compilation cache (when on, as in the tests)
            # stores a compile-only client's executable but cannot load it
            # back: JAX warns and compiles, as it would with no cache.
            warnings.filterwarnings("ignore", message="Error reading persistent compilation cache entry")
            return Compiled(lowered.compile())
    except Exception as error:  # jax.errors.JaxRuntimeError, told by its message
        message = str(error)
        if "RESOURCE_EXHAUSTED" not in message:
            raise
    figures = _refusal_figures(message)
    first = message.strip().splitlines()[0][:400]
    if figures is None:
        return Compiled(None, first)
    return Compiled(None, first, *figures)


def compile_job(lowered: Any, target: Any, job: str, backbone: Any, mesh_axis_sizes: Mapping[str, int],
                batch_size: int, sequence_length: int, weights_bytes: int, kv_cache_bytes: int | None) -> tuple[dict[str, int], Any, str | None]:
    """Compiles a job's lowered program for `target` (None: this host's CPU
    compiler): `(memory, step time estimate or None, refusal or None)`.

    The memory is the compiler's `memory_analysis()` (`programs.program_memory`);
    a TPU refusal gives the compiler's figure of what the program needs as
    the total and the refusal's first line."""
    from keras_hub_dist.jobs import collectives, programs, step_time

    if target is None:
        return programs.program_memory(lowered.compile()), None, None
    target = get_target(target)
    result = compile_for_target(lowered)
    if result.executable is None:
        need = result.required_bytes or 0
        memory = dict(argument_bytes=0, output_bytes=0, alias_bytes=0, temp_bytes=need, total_bytes=need)
        return memory, None, result.refusal
    memory = programs.program_memory(result.executable)
    hlo = collectives.read_hlo(result.executable.as_text(), mesh_axis_sizes)
    cost = result.executable.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost
    estimate = step_time.estimate(
        job, target.spec, hlo, cost or None, memory, backbone=backbone, batch_size=batch_size,
        sequence_length=sequence_length, devices=target.devices, weights_bytes=weights_bytes,
        kv_cache_bytes=kv_cache_bytes,
    )
    return memory, estimate, None

