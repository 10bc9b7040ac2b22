"""`keras-hub-dist validate`: per-device memory of init, load and the jobs, ours vs stock.

Each case (ours / stock KerasHub x init / load) runs in a fresh Python process
(`keras_hub_dist.validate.worker`) under the same `ModelParallel`, so one
case's allocations cannot hide another's. Per device it measures the peak and
final bytes (`memory_stats()` on TPU/GPU; on CPU, live arrays per shard plus
the temps of the XLA programs compiled during the case), and per case the
host peak RSS and the wall time. The parent process never touches a device.

Phases:

- `init`: build the backbone randomly initialized. Ours: the
  `keras_hub_dist.<family>_backbone` factory (embedding created sharded by
  the distributed initializers). Stock: the KerasHub class itself.
- `load`: load a preset directory (a KerasHub preset or a Hugging Face
  checkpoint). Ours: `keras_hub_dist.load_sharded_preset`; stock:
  `keras_hub.models.Backbone.from_preset`. For a named architecture a
  synthetic checkpoint (random weights) is written first, untimed: a KerasHub
  preset, or with `checkpoint_format="huggingface"` a Hugging Face one
  (`formats.synthetic_hf`), which both loaders read through KerasHub's
  converter.
- `fit` / `generate` (opt-in): the jobs on that preset loaded as a causal
  LM, one train step / one greedy generate of `batch x seq`, each beside
  `plan_memory`'s figures for the same job (`keras_hub_dist.validate.job_worker`).

`run_validation` returns the JSON-ready report, summarized
(`keras_hub_dist.validate.report`); its schema and exit codes are in
`keras_hub_dist.validate.schema`.

Example:

```python
from keras_hub_dist.validate.options import ValidateOptions
from keras_hub_dist.validate.report import format_report
from keras_hub_dist.validate.runner import run_validation

report = run_validation(ValidateOptions(preset="gemma_7b_en", num_layers=1))
print(format_report(report))
```
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

from keras_hub_dist.plan.presets import CONFIG_FILE, is_preset_dir, read_json, resolve
from keras_hub_dist.plan.sizes import format_bytes
from keras_hub_dist.validate.options import CASES, JOB_PHASES, ValidateOptions
from keras_hub_dist.validate.report import summarize
from keras_hub_dist.validate.schema import SCHEMA_VERSION

__all__ = ["child_environment", "run_validation"]

_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"
# Kept of a failed case's log: enough for a traceback, not a whole run's noise.
_LOG_TAIL_CHARS = 3000

Event = Callable[[str], None]


def child_environment(devices: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The case processes' environment: JAX backend and `devices` CPU devices.

    Args:
        devices: CPU devices to simulate (replaces any device count already
            in `XLA_FLAGS`; TPU/GPU platforms ignore it).
        base: The environment to start from; default `os.environ`.

    Returns:
        A new environment dict.
    """
    env = dict(os.environ if base is None else base)
    flags = re.sub(rf"{_DEVICE_COUNT_FLAG}=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags.strip()} {_DEVICE_COUNT_FLAG}={int(devices)}".strip()
    env["KERAS_BACKEND"] = "jax"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _run_worker(
    spec: Mapping[str, Any],
    workdir: str,
    label: str,
    env: Mapping[str, str],
    options: ValidateOptions,
) -> dict[str, Any]:
    """Runs one worker task in a fresh process; returns its result.

    A process that fails, is killed or times out gives `{"ok": False,
    "error": ..., "log_tail": ...}`; every result gets `returncode` and
    `process_wall_s`.
    """
    spec_path = os.path.join(workdir, f"{label}.spec.json")
    result_path = os.path.join(workdir, f"{label}.result.json")
    log_path = os.path.join(workdir, f"{label}.log")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        try:
            # The job phases run in their own worker module (worker.py is full).
            module = "job_worker" if spec.get("phase") in JOB_PHASES else "worker"
            proc = subprocess.run(
                [options.python, "-m", f"keras_hub_dist.validate.{module}", spec_path, result_path],
                env=dict(env),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=options.timeout_s,
                check=False,
            )
            returncode = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = -9
            timed_out = True
        else:
            timed_out = False
    elapsed = time.perf_counter() - start
    result: dict[str, Any] = {}
    if os.path.exists(result_path):
        with open(result_path, encoding="utf-8") as f:
            result = json.load(f)
    if not result.get("ok"):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-_LOG_TAIL_CHARS:]
        if timed_out:
            error = f"timed out after {options.timeout_s:.0f} s"
        elif returncode < 0:
            # SIGKILL with no result file is most often the kernel's OOM killer.
            error = f"killed by signal {-returncode}" + (
                " (out of host memory?)" if returncode == -9 else ""
            )
        else:
            error = result.get("error") or f"exited with status {returncode}"
        result = {
            "ok": False,
            "error": error,
            "log_tail": result.get("traceback") or tail,
            **({"input_error": True} if result.get("input_error") else {}),
        }
    result["returncode"] = returncode
    result["process_wall_s"] = elapsed
    return result


def _preset_cache_dir(options: ValidateOptions, workdir: str) -> str:
    """Where the synthetic preset goes: per run, or keyed by what shapes it.

    The key holds the checkpoint format, so a KerasHub preset and a Hugging
    Face checkpoint of the same architecture never share a directory (the
    Hugging Face one also gets `-hf` in its name; KerasHub presets keep the
    key they always had, so existing caches stay valid).
    """
    if not options.preset_cache:
        return os.path.join(workdir, "synthetic_preset")
    parts: list[Any] = [options.preset, options.config_overrides(), options.dtype]
    suffix = ""
    if options.checkpoint_format != "keras":
        parts.append(options.checkpoint_format)
        suffix = "-hf" if options.checkpoint_format == "huggingface" else (
            "-" + options.checkpoint_format
        )
    key = json.dumps(parts, sort_keys=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", options.preset)[:60]
    digest = f"{_hash_text(key):016x}"[:12]
    return os.path.join(os.path.abspath(options.preset_cache), f"{safe}{suffix}-{digest}")


def _hash_text(text: str) -> int:
    """A stable 64-bit hash (Python's `hash` is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _new_report(options: ValidateOptions) -> dict[str, Any]:
    """The report before any case ran: the options, and nulls to fill in."""
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "keras-hub-dist validate",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "options": {
            "preset": options.preset,
            "mesh": list(options.mesh_shape),
            "dtype": options.dtype,
            "phases": list(options.phases),
            "num_layers": options.num_layers,
            "overrides": options.config_overrides(),
            "baseline": options.baseline,
            "hbm_gb": options.hbm_gb,
            "devices": options.simulated_devices,
            "interval_ms": options.interval_ms,
            "checkpoint_format": options.checkpoint_format,
            "quantize": options.quantize,
            **_job_options(options),
        },
        "model": None,
        "environment": None,
        "synthetic_preset": None,
        "budget_bytes": None,
        "budget_source": None,
        "cases": [],
    }


def _job_options(options: ValidateOptions) -> dict[str, Any]:
    """The job phases' settings (in the report and the specs), or none
    without a job phase: a report of init / load only is as it was."""
    if not any(p in JOB_PHASES for p in options.phases):
        return {}
    return {
        "batch": options.batch,
        "seq": options.seq,
        "lora_rank": options.lora_rank,
        "remat": options.remat,
        "prompt_chunk": options.prompt_chunk,
    }


def run_validation(options: ValidateOptions, on_event: Event | None = None) -> dict[str, Any]:
    """Measures every requested case, each in a fresh process; returns the report.

    Args:
        options: What to measure.
        on_event: Called with a one-line progress message per step.

    Returns:
        The JSON-ready, summarized report (schema:
        `keras_hub_dist.validate.schema`).

    Raises:
        RuntimeError: The synthetic preset of the load phase could not be
            written.
        ValueError: Config overrides were given with a preset directory, or
            `checkpoint_format="huggingface"` with an architecture that has
            no Hugging Face layout (or a preset directory of another format).
    """
    say = on_event or (lambda _msg: None)
    env = child_environment(options.simulated_devices)
    workdir = tempfile.mkdtemp(prefix="khd-validate-")
    report = _new_report(options)
    try:
        base_spec = {
            "preset": options.preset,
            "overrides": options.config_overrides(),
            "dtype": options.dtype,
            "mesh": list(options.mesh_shape),
            "interval_s": options.interval_ms / 1000.0,
            "checkpoint_format": options.checkpoint_format,
            "quantize": options.quantize,
        }
        preset_dir = None
        if any(p in ("load", *JOB_PHASES) for p in options.phases):
            preset_dir, synthetic = _prepare_preset(options, base_spec, workdir, env, say)
            report["synthetic_preset"] = synthetic
        cases = CASES if options.baseline else ("ours",)
        plan = [(phase, case) for phase in options.phases for case in cases]
        for index, (phase, case) in enumerate(plan, 1):
            step = f"[{index}/{len(plan)}] {phase} {case}"
            say(f"{step}: running in a fresh process ...")
            spec = {**base_spec, "task": "measure", "case": case, "phase": phase}
            if phase != "init":
                spec["preset_dir"] = preset_dir
            if phase in JOB_PHASES:
                spec.update(_job_options(options))
            result = _run_worker(spec, workdir, f"{phase}-{case}", env, options)
            result.update(phase=phase, case=case)
            result.setdefault("error", None)
            report["cases"].append(result)
            if result["ok"]:
                say(
                    f"{step}: done in {result['wall_s']:.1f} s, max device peak "
                    f"{format_bytes(max(result['peak_per_device'].values()))}"
                    + _plan_note(result)
                )
            else:
                say(f"{step}: FAILED: {result['error']}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    summarize(report, options)
    return report


def _plan_note(result: Mapping[str, Any]) -> str:
    """`, plan = measured` / `, PLAN MISMATCH in ...` for a job case, else ``."""
    if "plan_mismatches" not in result:
        return ""
    if not result["plan_mismatches"]:
        return ", XLA's figures = plan_memory's"
    return f", PLAN MISMATCH in {', '.join(result['plan_mismatches'])}"


def _prepare_preset(
    options: ValidateOptions,
    base_spec: Mapping[str, Any],
    workdir: str,
    env: Mapping[str, str],
    say: Event,
) -> tuple[str, dict[str, Any] | None]:
    """The preset directory the load phase reads, written first if need be.

    Returns:
        `(preset directory, synthetic_preset entry of the report)`; the entry
        is None for a preset directory given by the user.

    Raises:
        ValueError: Config overrides with a preset directory;
            `--checkpoint_format huggingface` with a KerasHub preset directory,
            or with an architecture that has no Hugging Face layout.
        RuntimeError: The synthetic preset could not be written.
    """
    fmt = options.checkpoint_format
    if is_preset_dir(options.preset):
        if options.config_overrides():
            raise ValueError(
                "Config overrides (--num_layers, --override) cannot change a preset "
                "directory's weights. Expected no overrides with --preset DIR and "
                f"--phases load. Received: {options.config_overrides()}."
            )
        if fmt == "huggingface" and not _is_hf_dir(options.preset):
            raise ValueError(
                "--checkpoint_format huggingface picks the format of the synthetic "
                "checkpoint written for a named architecture; a preset directory is "
                "read in its own format. Expected a Hugging Face checkpoint directory "
                "(config.json with 'model_type') or a named architecture. Received: "
                f"--preset {options.preset} (not a Hugging Face checkpoint). Drop "
                "--checkpoint_format."
            )
        return os.path.abspath(options.preset), None
    spec = {**base_spec, "task": "write_preset"}
    what = "synthetic preset"
    if fmt == "huggingface":
        # Checked here, before minutes of writing or measuring.
        spec["checkpoint_dtype"] = _hf_checkpoint_dtype(options)
        what = "synthetic Hugging Face checkpoint"
    out_dir = _preset_cache_dir(options, workdir)
    if is_preset_dir(out_dir):
        # Only complete presets are ever renamed into place (see below).
        say(f"{what}: reusing {out_dir}")
        return out_dir, {
            "preset_dir": out_dir,
            "format": fmt,
            "writer": "reused",
            "bytes_on_disk": _dir_bytes(out_dir),
            "wall_s": 0.0,
        }
    say(f"writing a {what} of {options.preset} (random weights) to {out_dir} ...")
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    partial = out_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    spec["out_dir"] = partial
    result = _run_worker(spec, workdir, "write-preset", env, options)
    if not result.get("ok"):
        shutil.rmtree(partial, ignore_errors=True)
        if result.get("input_error"):
            # e.g. an architecture its Hugging Face layout cannot keep.
            raise ValueError(f"Could not write a {what} of {options.preset!r}: {result['error']}")
        raise RuntimeError(
            f"Could not write a {what} of {options.preset!r}: "
            f"{result['error']}\n{result.get('log_tail', '')}"
        )
    os.replace(partial, out_dir)
    say(
        f"{what}: {format_bytes(result['bytes_on_disk'])} written in "
        f"{result['wall_s']:.1f} s by {result['writer']}"
    )
    entry = {
        "preset_dir": out_dir,
        "format": fmt,
        "writer": result["writer"],
        "bytes_on_disk": result["bytes_on_disk"],
        "wall_s": result["wall_s"],
    }
    if result.get("config_differences"):
        # Same weights, other numerics (see `worker.hf_round_trip_differences`).
        entry["config_differences"] = list(result["config_differences"])
        say(
            f"{what}: same weights, but KerasHub's converter reads back "
            + "; ".join(entry["config_differences"])
        )
    return out_dir, entry


def _is_hf_dir(path: str) -> bool:
    """Whether the preset directory's config.json is a Transformers one."""
    from keras_hub_dist.formats import huggingface

    try:
        config = read_json(os.path.join(path, CONFIG_FILE))
    except (OSError, ValueError):
        return False
    return isinstance(config, Mapping) and huggingface.recognizes(config)


def _hf_checkpoint_dtype(options: ValidateOptions) -> str:
    """The dtype of the synthetic Hugging Face checkpoint of a named architecture.

    `--dtype`, else a `dtype` override, else the architecture's own; checked
    (with the class's Hugging Face layout) by `worker.hf_checkpoint_dtype`.

    Raises:
        ValueError: Not a named architecture, no Hugging Face layout for its
            class, or a dtype other than float32/bfloat16/float16.
    """
    from keras_hub_dist.validate.worker import _policy_name, hf_checkpoint_dtype

    entry = resolve(options.preset)
    dtype = (
        options.dtype
        or _policy_name(options.config_overrides().get("dtype"))
        or _policy_name(entry.config.get("dtype"))
    )
    return hf_checkpoint_dtype(entry.backbone_class_name, dtype, options.preset)


def _dir_bytes(path: str) -> int:
    """Bytes of every file under `path`."""
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(path)
        for f in files
    )
