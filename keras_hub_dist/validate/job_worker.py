"""One job case of `keras-hub-dist validate` (`fit` / `generate`), in a fresh process.

`python -m keras_hub_dist.validate.job_worker SPEC.json RESULT.json`

The loaded causal LM runs the job for real while a `MemorySampler` watches
(live arrays per shard plus the temporaries of the XLA programs compiled
and run meanwhile; `memory_stats()` on TPU/GPU), and XLA's memory analysis
of the program the run compiled (Keras's `train_step`, KerasHub's
`generate`) is recorded beside `keras_hub_dist.plan_memory`'s figures for
the same job, planned afterwards in the same process (same preset, mesh,
batch, sequence, dtype, stock flag): the plan lowers the same program on
abstract values, so XLA's fields must be equal.

- `case="ours"`: `load_sharded_preset(..., task="causal_lm")` (the
  package's layouts; `generate` with its chunked prompt pass,
  `prompt_chunk`), built under `keras.RematScope(remat)` when asked.
- `case="stock"`: `keras_hub.models.CausalLM.from_preset` under a
  `ModelParallel` of the backbone's own `get_layout_map`, KerasHub's own
  `generate`.
- `phase="fit"`: `compile(optimizer="adam")` and one `fit` step of
  `batch x seq` preprocessed arrays (token ids, padding mask, labels,
  sample weights); LoRA (`lora_rank`, `keras_hub_dist.enable_lora`, both
  cases) optional.
- `phase="generate"`: one greedy `generate` of `batch` prompts padded to
  `seq` (`max_length`), the first half of each row the prompt.

The spec and result files are those of `keras_hub_dist.validate.worker`.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import contextlib  # noqa: E402
import gc  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from keras_hub_dist.validate import worker  # noqa: E402

__all__ = ["JOB_PHASES", "PLAN_FIELDS", "PROGRAMS", "measure_job", "main"]

JOB_PHASES = ("fit", "generate")
# XLA's per-device fields of one compiled program, compared plan vs measured.
PLAN_FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")
# The program each job compiles, by the name XLA gives its module.
PROGRAMS = {"fit": "train_step", "generate": "generate"}
SAMPLER = "greedy"


def _stock_distribution(cls: type, config: Mapping[str, Any], mesh_shape: Sequence[int]) -> Any:
    """`ModelParallel` of the backbone's own KerasHub `get_layout_map`
    (what a stock user passes), else the package's map; as `plan_memory(...,
    stock=True)` lays the job out."""
    import keras

    _, layout_map, _, _ = worker._make_distribution(cls, config, mesh_shape)
    own = getattr(cls, "get_layout_map", None)
    if callable(own):
        layout_map = own(layout_map.device_mesh)
    return keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _load(spec: Mapping[str, Any], cls: type, config: Mapping[str, Any], dtype: str | None) -> tuple[Any, Any]:
    """`(causal LM, its distribution)`, loaded as the case loads it."""
    import keras

    case, preset = spec["case"], spec["preset_dir"]
    quantize = spec.get("quantize")
    if case == "ours":
        from keras_hub_dist.load.loader import load_sharded_preset

        remat = spec.get("remat")
        with keras.RematScope(mode=remat) if remat else contextlib.nullcontext():
            lm = load_sharded_preset(
                preset, mesh=tuple(spec["mesh"]), task="causal_lm", dtype=dtype,
                quantize=quantize, prompt_chunk=int(spec.get("prompt_chunk") or 512),
                task_kwargs={"preprocessor": None}, progress=False,
            )
        return lm, keras.distribution.distribution()
    import keras_hub

    distribution = _stock_distribution(cls, config, spec["mesh"])
    with distribution.scope():
        kwargs = {"dtype": dtype} if dtype else {}
        lm = keras_hub.models.CausalLM.from_preset(preset, preprocessor=None, **kwargs)
        if quantize:
            lm.quantize(quantize)
    return lm, distribution


def _inputs(spec: Mapping[str, Any], vocabulary_size: int) -> dict[str, Any]:
    """One batch of preprocessed arrays, the same for both cases."""
    import numpy as np

    batch, seq = int(spec["batch"]), int(spec["seq"])
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, max(2, vocabulary_size), size=(batch, seq), dtype=np.int32)
    if spec["phase"] == "generate":
        # The first half of each row is the prompt; generate fills the rest.
        mask = np.arange(seq)[None, :] < np.full((batch, 1), max(1, seq // 2))
        return {"x": {"token_ids": np.where(mask, tokens, 0).astype(np.int32), "padding_mask": mask}}
    ones = np.ones((batch, seq), bool)
    return {"x": {"token_ids": tokens, "padding_mask": ones}, "y": tokens, "sample_weight": ones}


def _run_job(spec: Mapping[str, Any], lm: Any, data: Mapping[str, Any]) -> None:
    """The job itself (inside the sampler), blocked until its results exist."""
    import jax

    if spec["phase"] == "fit":
        lm.fit(
            data["x"], data["y"], sample_weight=data["sample_weight"],
            batch_size=int(spec["batch"]), epochs=1, shuffle=False, verbose=0,
        )
        jax.block_until_ready([v.value for v in lm.trainable_variables])
    else:
        out = lm.generate(data["x"], stop_token_ids=None)
        jax.block_until_ready(out)


def _program(sampler: Any, phase: str) -> dict[str, Any] | None:
    """XLA's figures of the job's own program among those the run compiled
    (the largest, should there be several of that name)."""
    name = PROGRAMS[phase]
    seen = [c for c in sampler.compiled if name in str(c.get("name", ""))]
    if not seen:
        return None
    best = max(seen, key=lambda c: (c.get("temp_bytes", 0), c.get("argument_bytes", 0)))
    program = {"name": str(best["name"])}
    for field in PLAN_FIELDS:
        program[field] = int(best.get(field, 0))
    program["total_bytes"] = (
        program["argument_bytes"] + program["output_bytes"] + program["temp_bytes"]
        - program["alias_bytes"]
    )
    return program


def _plan(spec: Mapping[str, Any], dtype: str | None) -> dict[str, Any]:
    """`plan_memory`'s figures for the same job (no alternatives)."""
    from keras_hub_dist.jobs.memory_plan import plan_memory

    stock = spec["case"] == "stock"
    fit = spec["phase"] == "fit"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_memory(
            spec["preset_dir"], tuple(spec["mesh"]), job=spec["phase"],
            batch_size=int(spec["batch"]), sequence_length=int(spec["seq"]),
            optimizer="adam", lora_rank=spec.get("lora_rank") if fit else None,
            remat=None if stock else spec.get("remat"), dtype=dtype,
            quantize=spec.get("quantize"), stock=stock, sampler=SAMPLER,
            prompt_chunk=int(spec.get("prompt_chunk") or 512), alternatives=False,
        )
    out = plan.to_json()
    keep = (
        *PLAN_FIELDS, "total_bytes", "weights_bytes", "optimizer_bytes", "lora_bytes",
        "kv_cache_bytes", "compiler",
    )
    return {k: out[k] for k in keep}


def measure_job(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Runs one job case (see the module docstring) and returns its figures."""
    import jax
    import keras

    from keras_hub_dist.measure import memory

    case, phase = spec["case"], spec["phase"]
    if case not in ("ours", "stock") or phase not in JOB_PHASES:
        raise ValueError(
            f"Expected case in ('ours', 'stock') and phase in {JOB_PHASES}. "
            f"Received: case={case!r}, phase={phase!r}."
        )
    cls, config, source = worker.resolve_architecture(spec["preset_dir"], {}, spec.get("dtype"))
    dtype = spec.get("dtype") or worker._policy_name(config.get("dtype"))
    previous = keras.distribution.distribution()
    try:
        lm, distribution = _load(spec, cls, config, dtype)
        lm.preprocessor = None
        with distribution.scope():
            if phase == "fit" and spec.get("lora_rank"):
                from keras_hub_dist.adapters import enable_lora

                enable_lora(lm, int(spec["lora_rank"]))
            if phase == "fit":
                lm.compile(optimizer=keras.optimizers.Adam())
            else:
                lm.compile(sampler=SAMPLER)
            data = _inputs(spec, int(lm.backbone.vocabulary_size))
            devices = jax.local_devices()
            limits = {
                str(d.id): (memory.device_memory_stats(d) or {}).get("bytes_limit")
                for d in devices
            }
            gc.collect()
            sampler = memory.MemorySampler(
                interval_s=float(spec.get("interval_s", 0.002)), devices=devices
            )
            # No sample hooked to `jax.device_put` (as the load phase has): a
            # sample taken inside Keras's tracing of the model can raise there.
            with sampler:
                _run_job(spec, lm, data)
                sampler.sample()
        weights = [v.value for v in lm.weights]
        weights_per_device = memory.live_bytes_per_device(weights, devices=devices)
        result = {
            "ok": True,
            "task": "measure",
            "case": case,
            "phase": phase,
            "backbone_class": type(lm.backbone).__name__,
            "task_class": type(lm).__name__,
            "architecture": source,
            "config": {k: v for k, v in config.items() if worker._jsonable(v)},
            "parameter_count": sum(int(math.prod(w.shape)) for w in weights),
            "model_bytes": sum(int(w.nbytes) for w in weights),
            "dtype": dtype,
            "weight_dtypes": sorted({str(w.dtype) for w in weights}),
            "weights_per_device": {str(k): v for k, v in weights_per_device.items()},
            "mesh": list(spec["mesh"]),
            "platform": devices[0].platform,
            "device_kind": devices[0].device_kind,
            "device_count": len(devices),
            "bytes_limit_per_device": limits,
            "versions": worker._versions(),
            "job": {
                "batch": int(spec["batch"]), "seq": int(spec["seq"]),
                "lora_rank": spec.get("lora_rank") if phase == "fit" else None,
                "remat": spec.get("remat") if case == "ours" else None,
                "optimizer": "adam" if phase == "fit" else None,
                "sampler": SAMPLER if phase == "generate" else None,
                "prompt_chunk": (
                    int(spec.get("prompt_chunk") or 512)
                    if case == "ours" and phase == "generate" else None
                ),
            },
            **sampler.report(),
            "compiled_top": sorted(sampler.compiled, key=lambda c: -c.get("temp_bytes", 0))[
                : worker.TOP_PROGRAMS
            ],
            "timeline": worker._downsample(
                sampler.timeline, sampler.timeline_with_temps, sampler.host_timeline,
                sampler.device_ids,
            ),
            "program": _program(sampler, phase),
        }
        del weights, lm, data
        gc.collect()
        # Planned after the run, outside the sampler: it allocates nothing.
        result["plan"] = _plan(spec, dtype)
    finally:
        keras.distribution.set_distribution(previous)
    result["plan_mismatches"] = mismatches(result["program"], result["plan"])
    return result


def mismatches(program: Mapping[str, Any] | None, plan: Mapping[str, Any]) -> list[str]:
    """The XLA fields where the plan and the measured program differ
    (`"temp_bytes"`, ...); `["program"]` when the run compiled no such program."""
    if program is None:
        return ["program"]
    return [f for f in PLAN_FIELDS if int(program[f]) != int(plan[f])]


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m keras_hub_dist.validate.job_worker SPEC.json RESULT.json`."""
    return worker.main(argv, run=measure_job)


if __name__ == "__main__":
    sys.exit(main())
