"""One measured case of `keras-hub-dist validate`, run in a fresh process.

`python -m keras_hub_dist.validate.worker SPEC.json RESULT.json`

The parent (`keras_hub_dist.validate.runner`) sets `XLA_FLAGS` / `KERAS_BACKEND` in this
process's environment before JAX is imported, so each case starts from an
empty device and a fresh host heap: one case's memory cannot hide another's.
Tasks (`spec["task"]`):

- `"measure"`: build (`phase="init"`) or load (`phase="load"`) one backbone,
  `case="ours"` (keras_hub_dist) or `case="stock"` (plain KerasHub), under the
  same `ModelParallel`, inside a `MemorySampler`; write its figures.
- `"write_preset"`: write a synthetic preset of the architecture (random
  weights) for the load phase: a KerasHub preset, or a Hugging Face
  checkpoint with `spec["checkpoint_format"] = "huggingface"`.

`spec["preset"]` is a named architecture, a KerasHub preset directory or a
Hugging Face checkpoint directory (see `resolve_architecture`).

The result file is JSON: `{"ok": true, ...}` or `{"ok": false, "error": ...}`.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Mapping, Sequence  # noqa: E402
from typing import Any  # noqa: E402

__all__ = [
    "hf_checkpoint_dtype",
    "hf_round_trip_differences",
    "main",
    "resolve_architecture",
    "run_task",
]

# The result file stays small whatever the case's length: the timeline is
# downsampled to this many points, only the programs with the largest temps listed.
TIMELINE_POINTS = 600
TOP_PROGRAMS = 8

# The dtypes a checkpoint's own `torch_dtype` may give the load phase (and a
# synthetic Hugging Face checkpoint may be written in).
CHECKPOINT_DTYPES = ("float32", "bfloat16", "float16")


def resolve_architecture(
    preset: str, overrides: Mapping[str, Any], dtype: str | None
) -> tuple[type, dict[str, Any], dict[str, Any]]:
    """(backbone class, full config with overrides, description) of `preset`.

    `preset` is a named architecture, a KerasHub preset directory or a
    Hugging Face checkpoint directory (a Transformers config.json, detected
    by `formats.detect.checkpoint_format`); the last is converted by
    KerasHub's own converter (`formats.huggingface.backbone_config`).
    """
    from keras_hub_dist.plan import presets

    extra = dict(overrides)
    if dtype:
        extra["dtype"] = dtype
    hf = _hf_resolve(preset, extra)
    if hf is not None:
        return hf
    cls, config, entry = presets.backbone_config(preset, **extra)
    if entry is None:
        source = {"kind": "preset_dir", "path": os.path.abspath(preset)}
    else:
        source = {
            "kind": "named",
            "name": entry.name,
            "handle": entry.handle,
            "full_parameter_count": entry.parameter_count,
        }
    return cls, config, source


def _hf_resolve(
    preset: str, extra: Mapping[str, Any]
) -> tuple[type, dict[str, Any], dict[str, Any]] | None:
    """`resolve_architecture` of a Hugging Face checkpoint directory; None otherwise.

    The model's dtype, unless `extra` sets one, is the checkpoint's own
    (`torch_dtype`, or `dtype` in newer Transformers) where it is one of
    `CHECKPOINT_DTYPES`, as a KerasHub preset's config carries its own.
    """
    from keras_hub_dist.errors import PresetError
    from keras_hub_dist.formats import detect, huggingface
    from keras_hub_dist.plan import presets

    if not presets.is_preset_dir(preset):
        return None
    hf_config = presets.read_json(os.path.join(preset, presets.CONFIG_FILE))
    if not isinstance(hf_config, Mapping):
        return None
    try:
        module = detect.checkpoint_format(hf_config, preset)
    except PresetError:
        # Not ours to judge: `presets.backbone_config` names the problem.
        return None
    if module.FORMAT != huggingface.FORMAT:
        return None
    cls, config = huggingface.backbone_config(hf_config, preset)
    own_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype")
    if own_dtype in CHECKPOINT_DTYPES:
        config["dtype"] = own_dtype
    config.update(extra)
    source = {
        "kind": "hf_dir",
        "path": os.path.abspath(preset),
        "model_type": str(hf_config.get("model_type")),
        "torch_dtype": own_dtype if isinstance(own_dtype, str) else None,
    }
    return cls, config, source


def serialized_config(cls: type, config: Mapping[str, Any]) -> dict[str, Any]:
    """The `config.json` object of a backbone class and its arguments."""
    import keras

    return {
        "module": cls.__module__,
        "class_name": cls.__name__,
        "config": dict(config),
        "registered_name": keras.saving.get_registered_name(cls),
    }


def _make_distribution(
    cls: type, config: Mapping[str, Any], mesh_shape: Sequence[int]
) -> tuple[Any, Any, dict[str, Any], Any]:
    """`(DeviceMesh, LayoutMap, layout description, ModelParallel)` of a case."""
    import jax
    import keras

    devices = jax.devices()
    needed = math.prod(mesh_shape)
    if needed > len(devices):
        raise ValueError(
            f"The mesh {'x'.join(map(str, mesh_shape))} needs {needed} devices. "
            f"Expected at most {len(devices)} (the {devices[0].platform} devices "
            f"this process sees). Received: --mesh {'x'.join(map(str, mesh_shape))}."
            " Use a smaller mesh or simulate more CPU devices with --devices."
        )
    mesh = keras.distribution.DeviceMesh(
        shape=tuple(mesh_shape), axis_names=("batch", "model"), devices=devices[:needed]
    )
    layout_map, layout_source = _layout_map(cls, config, mesh)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    return mesh, layout_map, layout_source, distribution


def _layout_map(cls: type, config: Mapping[str, Any], mesh: Any) -> tuple[Any, dict[str, Any]]:
    """The family's layout map, checked against this config's shapes."""
    from keras_hub_dist.plan.abstract import abstract_backbone
    from keras_hub_dist.plan.layouts import get_layout_map

    with warnings.catch_warnings():
        # Fallbacks are reported in the result, not as noise on stderr.
        warnings.simplefilter("ignore")
        # An abstract model (shapes, no values) lets every layout be checked.
        target = abstract_backbone(serialized_config(cls, config))
        layout_map = get_layout_map(target, mesh)
    report = layout_map.report
    return layout_map, {
        "source": report.source,
        "checked": bool(report.checked),
        "fallbacks": [f.path for f in report.fallbacks],
    }


def _policy_name(policy: Any) -> str | None:
    """The dtype policy's name, from a name or a serialized `DTypePolicy`."""
    if isinstance(policy, str):
        return policy
    if isinstance(policy, Mapping):
        return (policy.get("config") or {}).get("name")
    return None


def _ours_init(cls: type, config: dict[str, Any], quantize: str | None = None) -> Any:
    """Builds the backbone with keras_hub_dist's factory of its class.

    Raises:
        ValueError: keras_hub_dist has no factory for `cls`.
    """
    from keras_hub_dist.init.factories import factory_for_class, supported_class_names

    factory = factory_for_class(cls)
    if factory is None:
        raise ValueError(
            f"keras_hub_dist has no backbone factory for {cls.__name__}. "
            f"Expected one of {sorted(supported_class_names())}. Received: "
            f"{cls.__name__}."
        )
    # The stock build keeps a multimodal config's encoders; so must ours.
    text_only = {"text_only": False} if "text_only" in inspect.signature(factory).parameters else {}
    return factory(serialized_config(cls, config), **text_only, **({"quantize": quantize} if quantize else {}))


def _ours_load(preset_dir: str, mesh: Any, layout_map: Any, dtype: str | None, quantize: str | None = None) -> Any:
    from keras_hub_dist.load.loader import load_sharded_preset

    kwargs: dict[str, Any] = {"mesh": mesh, "layout_map": layout_map, "quantize": quantize}
    if dtype:
        kwargs["dtype"] = dtype
    return load_sharded_preset(preset_dir, progress=False, **kwargs)


def _stock_load(preset_dir: str, dtype: str | None) -> Any:
    import keras_hub

    kwargs = {"dtype": dtype} if dtype else {}
    return keras_hub.models.Backbone.from_preset(preset_dir, **kwargs)


def _downsample(
    timeline: Sequence[tuple[float, Mapping[int, int]]],
    with_temps: Sequence[tuple[float, Mapping[int, int]]],
    host: Sequence[tuple[float, int]],
    device_ids: Sequence[int],
    points: int = TIMELINE_POINTS,
) -> dict[str, Any]:
    """Column-form timeline, at most `points` long, keeping each bucket's max."""
    n = len(timeline)
    step = max(1, math.ceil(n / points))
    t, rss = [], []
    live: dict[str, list[int]] = {str(d): [] for d in device_ids}
    total: dict[str, list[int]] = {str(d): [] for d in device_ids}
    for start in range(0, n, step):
        stop = start + step
        t.append(round(timeline[min(stop, n) - 1][0], 6))
        for d in device_ids:
            live[str(d)].append(max(p.get(d, 0) for _, p in timeline[start:stop]))
            total[str(d)].append(max(p.get(d, 0) for _, p in with_temps[start:stop]))
        rss.append(max(r for _, r in host[start:stop]))
    return {"t": t, "bytes": total, "live_bytes": live, "host_rss": rss}


def _versions() -> dict[str, str]:
    import jax
    import keras
    import keras_hub

    return {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "keras": keras.__version__,
        "keras_hub": keras_hub.__version__,
    }


def _measure(spec: Mapping[str, Any]) -> dict[str, Any]:
    import jax

    from keras_hub_dist.measure import memory
    from keras_hub_dist.measure.event_samples import sampling_after_calls

    case, phase = spec["case"], spec["phase"]
    dtype = spec.get("dtype")
    quantize = spec.get("quantize")
    preset = spec["preset_dir"] if phase == "load" else spec["preset"]
    overrides = {} if phase == "load" else dict(spec.get("overrides") or {})
    cls, config, source = resolve_architecture(preset, overrides, dtype)
    if not dtype:
        # KerasHub's `from_preset` would default to float32 whatever the
        # preset holds; both loaders get the preset's own dtype instead, as
        # the init phase builds with it.
        dtype = _policy_name(config.get("dtype"))
    mesh, layout_map, layout_source, distribution = _make_distribution(
        cls, config, spec["mesh"]
    )
    devices = jax.local_devices()
    limits = {
        str(d.id): (memory.device_memory_stats(d) or {}).get("bytes_limit")
        for d in devices
    }
    import keras_hub  # noqa: F401 - imported before timing starts, as users do

    gc.collect()
    sampler = memory.MemorySampler(
        interval_s=float(spec.get("interval_s", 0.002)), devices=devices
    )
    # A sample at each `jax.device_put` (stock reshards whole tensors with
    # it; ours places blocks) sees those moments however busy the machine is.
    with sampler, sampling_after_calls(sampler, jax, "device_put"):
        if case == "ours" and phase == "init":
            with distribution.scope():
                model = _ours_init(cls, config, quantize)
        elif case == "stock" and phase == "init":
            with distribution.scope():
                # A copy: some `from_config`s (Gemma 3) deserialize sub-layers in place.
                model = cls.from_config(dict(config))
                if quantize:
                    model.quantize(quantize)
        elif case == "ours" and phase == "load":
            model = _ours_load(preset, mesh, layout_map, dtype, quantize)
        elif case == "stock" and phase == "load":
            with distribution.scope():
                model = _stock_load(preset, dtype)
                if quantize:
                    model.quantize(quantize)
        else:
            raise ValueError(
                "Expected case in ('ours', 'stock') and phase in ('init', "
                f"'load'). Received: case={case!r}, phase={phase!r}."
            )
        # Done means every weight is resident, not merely dispatched.
        values = [v.value for v in model.weights]
        jax.block_until_ready(values)
        sampler.sample()
        del values
    weights = [v.value for v in model.weights]
    weights_per_device = memory.live_bytes_per_device(weights, devices=devices)
    model_bytes = sum(int(w.nbytes) for w in weights)
    parameter_count = sum(int(math.prod(w.shape)) for w in weights)
    dtypes = sorted({str(w.dtype) for w in weights})
    unsharded = [
        v.path
        for v, w in zip(model.weights, weights)
        if w.nbytes >= 2**20 and w.sharding.is_fully_replicated and len(devices) > 1
    ]
    del weights
    report = sampler.report()
    programs = sorted(sampler.compiled, key=lambda c: -c.get("temp_bytes", 0))
    return {
        "ok": True,
        "task": "measure",
        "case": case,
        "phase": phase,
        "backbone_class": type(model).__name__,
        "architecture": source,
        "config": {k: v for k, v in config.items() if _jsonable(v)},
        "parameter_count": parameter_count,
        "model_bytes": model_bytes,
        "dtype": dtype,
        "weight_dtypes": dtypes,
        "weights_per_device": {str(k): v for k, v in weights_per_device.items()},
        "replicated_weights_over_1mib": unsharded[:20],
        "layout_map": layout_source,
        "mesh": list(spec["mesh"]),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "bytes_limit_per_device": limits,
        "versions": _versions(),
        **report,
        "compiled_top": programs[:TOP_PROGRAMS],
        "timeline": _downsample(
            sampler.timeline,
            sampler.timeline_with_temps,
            sampler.host_timeline,
            sampler.device_ids,
        ),
    }


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _write_preset(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Writes the synthetic checkpoint of `spec["preset"]` to `spec["out_dir"]`.

    `spec["checkpoint_format"]` picks the writer: `"keras"` (default) a
    KerasHub preset (`write_synthetic_preset`), `"huggingface"` a Hugging
    Face checkpoint (`write_synthetic_hf_checkpoint`) in
    `spec["checkpoint_dtype"]`, else the run's dtype or the architecture's own.
    """
    out_dir = spec["out_dir"]
    fmt = spec.get("checkpoint_format") or "keras"
    cls, config, source = resolve_architecture(
        spec["preset"], dict(spec.get("overrides") or {}), spec.get("dtype")
    )
    extra: dict[str, Any] = {}
    if fmt == "huggingface":
        # Checked before anything is written (and not timed).
        dtype = spec.get("checkpoint_dtype") or hf_checkpoint_dtype(
            cls.__name__, spec.get("dtype") or _policy_name(config.get("dtype")), spec["preset"]
        )
        extra["config_differences"] = hf_round_trip_differences(
            cls, config, dtype, spec["preset"]
        )
    start = time.perf_counter()
    # Streamed tensor by tensor: a full-size model is never built in memory.
    if fmt == "huggingface":
        from keras_hub_dist.formats.synthetic_hf import write_synthetic_hf_checkpoint

        write_synthetic_hf_checkpoint(
            out_dir,
            cls,
            config,
            dtype=dtype,
            seed=int(spec.get("seed", 0)),
            overwrite=True,
            progress=False,
        )
        writer = "keras_hub_dist.formats.synthetic_hf.write_synthetic_hf_checkpoint"
    elif fmt == "keras":
        from keras_hub_dist.formats.synthetic import write_synthetic_preset

        write_synthetic_preset(
            out_dir,
            serialized_config(cls, config),
            seed=int(spec.get("seed", 0)),
            overwrite=True,
            progress=False,
        )
        writer = "keras_hub_dist.formats.synthetic.write_synthetic_preset"
    else:
        raise ValueError(
            "Expected checkpoint_format 'keras' or 'huggingface'. "
            f"Received: checkpoint_format={fmt!r}."
        )
    size = sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(out_dir)
        for f in files
    )
    return {
        "ok": True,
        "task": "write_preset",
        "preset_dir": out_dir,
        "format": fmt,
        "backbone_class": cls.__name__,
        "architecture": source,
        "writer": writer,
        "bytes_on_disk": size,
        "wall_s": time.perf_counter() - start,
        **extra,
    }


_MISSING = object()
# Config fields that never decide a weight's shape, compared for the record.
_IGNORED_FIELDS = ("dtype", "name", "trainable")


def hf_round_trip_differences(
    cls: type, config: Mapping[str, Any], dtype: str, preset: str
) -> list[str]:
    """What the architecture loses in its Hugging Face layout, checked harmless.

    The synthetic checkpoint's config.json (`formats.synthetic_hf.hf_layout`)
    is read back through KerasHub's converter, as both loaders will read it.
    Fields that come back otherwise (e.g. Llama's `layer_norm_epsilon`, which
    the converter does not read, or Llama 3.1's RoPE scaling) are listed;
    they are fine as long as the model has the very same weights (paths and
    shapes, compared on models built without values). The load phase then
    measures this architecture's weights exactly.

    Returns:
        `"field=value reads back as other"` per changed field (empty when
        the round trip is exact).

    Raises:
        ValueError: The checkpoint would load as a model with other weights
            (e.g. Gemma 2's extra norms in Gemma's layout), or another class.
    """
    import inspect

    from keras_hub_dist.formats import huggingface
    from keras_hub_dist.formats.synthetic_hf import hf_layout

    hf_config, _ = hf_layout(cls, config, dtype)
    back_cls, back = huggingface.backbone_config(hf_config, f"{preset} (synthetic)")
    defaults = {
        name: p.default
        for name, p in inspect.signature(back_cls.__init__).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    differences = []
    for key, value in config.items():
        if key in _IGNORED_FIELDS:
            continue
        got = back.get(key, defaults.get(key, _MISSING))
        if got != value:
            shown = "(no such argument)" if got is _MISSING else repr(got)
            differences.append(f"{key}={value!r} reads back as {shown}")
    same_class = issubclass(back_cls, cls) or issubclass(cls, back_cls)
    if same_class and not differences:
        return []
    if same_class and _weight_specs(cls, config, dtype) == _weight_specs(back_cls, back, dtype):
        return differences
    raise ValueError(
        f"--checkpoint_format huggingface cannot write {preset!r} faithfully: its "
        f"Hugging Face layout (model_type={hf_config.get('model_type')!r}) reads back "
        f"through KerasHub's converter as a {back_cls.__name__} with other weights ("
        + ", ".join(differences or [f"class {back_cls.__name__} instead of {cls.__name__}"])
        + "). Expected an architecture that layout keeps (e.g. gemma_7b_en, "
        f"llama3_8b_en). Received: --preset {preset} ({cls.__name__}). Use "
        "--checkpoint_format keras for this architecture."
    )


def _weight_specs(cls: type, config: Mapping[str, Any], dtype: str) -> list[tuple[str, tuple]]:
    """`(path, shape)` of every weight (less build counters: `moe_2`), built without values."""
    from keras_hub_dist.plan.abstract import abstract_backbone

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        built = abstract_backbone(serialized_config(cls, {**config, "dtype": dtype}))
    return sorted(("/".join(p.rstrip("0123456789_") for p in v.path.split("/")), tuple(v.shape)) for v in built.variables)


def hf_checkpoint_dtype(class_name: str, dtype: str | None, preset: str) -> str:
    """The dtype of a synthetic Hugging Face checkpoint, checked.

    Args:
        class_name: The backbone class name; it needs a Hugging Face layout
            (`formats.synthetic_hf.SUPPORTED_CLASSES`).
        dtype: `--dtype`, else the architecture's own (a policy name);
            None for float32.
        preset: The architecture, for the messages.

    Raises:
        ValueError: No Hugging Face layout for the class, or a dtype that
            safetensors checkpoints are not written in.
    """
    from keras_hub_dist.formats.synthetic_hf import SUPPORTED_CLASSES

    if class_name not in SUPPORTED_CLASSES:
        raise ValueError(
            f"--checkpoint_format huggingface cannot write {preset!r}: no Hugging Face "
            f"layout for its backbone class {class_name}. Expected an architecture whose "
            f"class is one of {list(SUPPORTED_CLASSES)} (e.g. gemma_7b_en, llama3_8b_en). "
            f"Received: --preset {preset} ({class_name}). Use --checkpoint_format keras "
            "for this architecture."
        )
    dtype = dtype or "float32"
    if dtype not in CHECKPOINT_DTYPES:
        raise ValueError(
            f"--checkpoint_format huggingface writes weights in one of "
            f"{list(CHECKPOINT_DTYPES)}. Expected --dtype (or the architecture's own "
            f"dtype) among them. Received: {dtype!r}. Pass e.g. --dtype bfloat16."
        )
    return dtype


def run_task(spec: Mapping[str, Any]) -> dict[str, Any]:
    """Runs one task spec (see the module docstring) and returns its result."""
    task = spec.get("task")
    if task == "measure":
        return _measure(spec)
    if task == "write_preset":
        return _write_preset(spec)
    raise ValueError(
        "Expected task 'measure' or 'write_preset'. "
        f"Received: task={task!r}."
    )


def main(argv: Sequence[str] | None = None, run: Any = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2:
        sys.stderr.write(
            "usage: python -m keras_hub_dist.validate.worker SPEC.json RESULT.json\n"
        )
        return 2
    spec_path, result_path = argv
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    try:
        result = (run or run_task)(spec)
        code = 0
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        result = {
            "ok": False,
            "error": f"{type(e).__name__}: {e}",
            # A ValueError (PresetError included) is about the input: the
            # parent reports it as such, without the traceback.
            "input_error": isinstance(e, ValueError),
            "traceback": traceback.format_exc(),
        }
        code = 1
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return code


if __name__ == "__main__":
    sys.exit(main())
