"""`keras-hub-dist validate`: per-device memory of init and load, ours vs stock.

Each case (ours / stock KerasHub x init / load) runs in a fresh Python process
(`keras_hub_dist._validate_worker`) under the same `ModelParallel`, so one
case's allocations cannot hide another's. Per device it measures the peak and
final bytes (`memory_stats()` on TPU/GPU; on CPU, live arrays per shard plus
the temps of the XLA programs compiled during the case), and per case the
host peak RSS and the wall time. The parent process never touches a device.

Phases:

- `init`: build the backbone randomly initialized. Ours: the
  `keras_hub_dist.<family>_backbone` factory (embedding created sharded by
  the distributed initializers). Stock: the KerasHub class itself.
- `load`: load a preset directory. Ours: `keras_hub_dist.load_sharded_preset`;
  stock: `keras_hub.models.Backbone.from_preset`. For a named architecture a
  synthetic preset (random weights) is written first, untimed.

JSON report (`--json`), `schema_version` 1; `REPORT_SCHEMA` is its JSON Schema
and `check_report` validates a report against it. Byte figures are ints,
device ids are strings of `device.id`:

```
{
  "schema_version": 1,
  "tool": "keras-hub-dist validate", "created": ISO-8601 time,
  "options": {preset, mesh: [batch, model], dtype, phases, num_layers,
              overrides, baseline, hbm_gb, devices, interval_ms},
  "model": {backbone_class, parameter_count, model_bytes, weight_dtypes,
            architecture, config} | null,
  "environment": {platform, device_kind, device_count, versions} | null,
  "synthetic_preset": {preset_dir, writer, bytes_on_disk, wall_s} | null,
  "budget_bytes": int | null, "budget_source": "hbm_gb" | "bytes_limit" | null,
  "cases": [{
      "phase": "init" | "load", "case": "ours" | "stock", "ok": bool,
      "error": str | null, "returncode": int, "process_wall_s": float,
      # only when ok:
      "wall_s", "source": "memory_stats" | "live_arrays",
      "peak_per_device", "final_per_device", "start_per_device",
      "live_peak_per_device", "temp_per_device", "weights_per_device",
      "host_start_rss", "host_peak_rss", "host_final_rss",
      "timeline": {"t": [s], "bytes": {device: [live + running temps]},
                   "live_bytes": {device: [live arrays]}, "host_rss": [bytes]},
      ...}],
  "comparisons": [{phase, ours_peak_max, stock_peak_max, ours_final_max,
                   stock_final_max, ours_peak_over_final, stock_peak_over_final,
                   stock_over_ours_peak, ours_host_peak_growth,
                   stock_host_peak_growth, stock_over_ours_host_growth,
                   ours_wall_s, stock_wall_s, stock_over_ours_wall}],
  "over_budget": [{phase, case, device, peak_bytes, budget_bytes}],
  "exit_code": int
}
```

Ratios are `null` where a side is missing or failed. `peak_over_final` is
the worst device's peak divided by that device's final bytes.

Exit code (`exit_code`): 0 ok; 1 a device's peak in one of *our* cases
exceeds the budget (stock exceeding it is reported, not failed on: it is the
problem this package solves); 3 one of our cases failed.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = [
    "EXIT_CASE_FAILED",
    "EXIT_OK",
    "EXIT_OVER_BUDGET",
    "REPORT_SCHEMA",
    "ValidateOptions",
    "check_report",
    "format_report",
    "over_budget_lines",
    "parse_mesh",
    "parse_overrides",
    "plot_report",
    "require_matplotlib",
    "run_validation",
    "write_json",
]

EXIT_OK = 0
EXIT_OVER_BUDGET = 1
EXIT_CASE_FAILED = 3
SCHEMA_VERSION = 1
GIB = 2**30
PHASES = ("init", "load")
CASES = ("ours", "stock")
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

Event = Callable[[str], None]


@dataclasses.dataclass
class ValidateOptions:
    """What `keras-hub-dist validate` measures; see `cli.py` for the flags.

    Attributes:
        preset: A named architecture (`keras_hub_dist.presets`) or a KerasHub
            preset directory.
        mesh: `(batch, model)` mesh shape; default `(1, devices)`.
        dtype: Weight dtype (e.g. "bfloat16"); default the preset's own.
        phases: Any of "init", "load".
        num_layers: Override of the number of transformer layers.
        overrides: Further backbone config overrides (named architectures).
        baseline: Also measure stock KerasHub.
        hbm_gb: Per-device budget in GiB; default the devices' `bytes_limit`
            where the platform reports one, else none.
        devices: CPU devices to simulate (`XLA_FLAGS`); default the mesh size
            or 8. Harmless on TPU/GPU, where the real devices are used.
        interval_ms: Sampling interval of the memory sampler.
        timeout_s: Limit per case process.
        preset_cache: Directory to keep (and reuse) the synthetic preset in;
            default a temporary directory removed afterwards.
        python: Interpreter of the case processes.
    """

    preset: str = "gemma_7b_en"
    mesh: tuple[int, int] | None = None
    dtype: str | None = None
    phases: tuple[str, ...] = PHASES
    num_layers: int | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    baseline: bool = True
    hbm_gb: float | None = None
    devices: int | None = None
    interval_ms: float = 2.0
    timeout_s: float = 1800.0
    preset_cache: str | None = None
    python: str = sys.executable

    @classmethod
    def from_flags(
        cls, *, mesh: str | None, phases: str, override: list[str] | None,
        **values: Any,
    ) -> "ValidateOptions":
        """Options from command-line strings (`--mesh 1x8`, `--phases init,load`,
        repeated `--override KEY=VALUE`); the other flags pass through as is.

        Raises:
            ValueError: a malformed mesh, phase list or override.
        """
        return cls(
            mesh=parse_mesh(mesh),
            phases=tuple(p.strip() for p in str(phases).split(",") if p.strip()),
            overrides=parse_overrides(override or []),
            **values,
        )

    def __post_init__(self) -> None:
        phases = tuple(self.phases)
        bad = [p for p in phases if p not in PHASES]
        if not phases or bad:
            raise ValueError(
                f"Expected phases among {PHASES}. Received: phases={phases}. "
                "Use e.g. --phases init,load."
            )
        self.phases = tuple(p for p in PHASES if p in phases)
        if self.mesh is not None:
            self.mesh = tuple(int(m) for m in self.mesh)  # type: ignore[assignment]
            if len(self.mesh) != 2 or min(self.mesh) < 1:
                raise ValueError(
                    "Expected a (batch, model) mesh of two positive sizes. "
                    f"Received: mesh={self.mesh}."
                )
        if self.hbm_gb is not None and self.hbm_gb <= 0:
            raise ValueError(f"Expected hbm_gb > 0. Received: hbm_gb={self.hbm_gb}.")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(
                f"Expected num_layers >= 1. Received: num_layers={self.num_layers}."
            )
        if self.interval_ms <= 0:
            raise ValueError(
                f"Expected interval_ms > 0. Received: interval_ms={self.interval_ms}."
            )

    @property
    def simulated_devices(self) -> int:
        if self.devices:
            return int(self.devices)
        return math.prod(self.mesh) if self.mesh else 8

    @property
    def mesh_shape(self) -> tuple[int, int]:
        return tuple(self.mesh) if self.mesh else (1, self.simulated_devices)

    def config_overrides(self) -> dict[str, Any]:
        overrides = dict(self.overrides)
        if self.num_layers is not None:
            overrides["num_layers"] = int(self.num_layers)
        return overrides


def parse_mesh(text: str | None) -> tuple[int, int] | None:
    """`"1x8"` -> `(1, 8)` (batch x model); `"8"` -> `(1, 8)`; None stays None."""
    if text is None or str(text).strip() == "":
        return None
    parts = re.split(r"[x,*]", str(text).strip().lower())
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) == 1:
        sizes = (1, sizes[0])
    if len(sizes) != 2 or min(sizes) < 1:
        raise ValueError(
            "Expected --mesh as BATCHxMODEL, e.g. 1x8 or 2x4. "
            f"Received: --mesh {text!r}."
        )
    return sizes  # type: ignore[return-value]


def parse_overrides(items: Sequence[str]) -> dict[str, Any]:
    """`["hidden_dim=64", "dtype=\"float32\""]` -> config overrides (JSON values)."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(
                "Expected --override KEY=VALUE (VALUE in JSON, e.g. 64, true, "
                f"\"bfloat16\"). Received: --override {item!r}."
            )
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value
    return overrides


def require_matplotlib() -> None:
    """Raises `ImportError` with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "--plot needs matplotlib, which is not installed. Install it with "
            "`pip install 'keras-hub-dist[plot]'` (or `pip install matplotlib`), "
            "or leave out --plot."
        ) from e


# -- running the cases -----------------------------------------------------


def child_environment(devices: int, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The case processes' environment: JAX backend and `devices` CPU devices."""
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
    spec_path = os.path.join(workdir, f"{label}.spec.json")
    result_path = os.path.join(workdir, f"{label}.result.json")
    log_path = os.path.join(workdir, f"{label}.log")
    with open(spec_path, "w", encoding="utf-8") as f:
        json.dump(spec, f)
    start = time.perf_counter()
    with open(log_path, "wb") as log:
        try:
            proc = subprocess.run(
                [options.python, "-m", "keras_hub_dist._validate_worker", spec_path, result_path],
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
            tail = f.read()[-3000:]
        if timed_out:
            error = f"timed out after {options.timeout_s:.0f} s"
        elif returncode < 0:
            error = f"killed by signal {-returncode}" + (
                " (out of host memory?)" if returncode == -9 else ""
            )
        else:
            error = result.get("error") or f"exited with status {returncode}"
        result = {"ok": False, "error": error, "log_tail": result.get("traceback") or tail}
    result["returncode"] = returncode
    result["process_wall_s"] = elapsed
    return result


def _preset_cache_dir(options: ValidateOptions, workdir: str) -> str:
    if not options.preset_cache:
        return os.path.join(workdir, "synthetic_preset")
    key = json.dumps(
        [options.preset, options.config_overrides(), options.dtype], sort_keys=True
    )
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", options.preset)[:60]
    digest = f"{_hash_text(key):016x}"[:12]
    return os.path.join(os.path.abspath(options.preset_cache), f"{safe}-{digest}")


def _hash_text(text: str) -> int:
    """A stable 64-bit hash (Python's `hash` is salted per process)."""
    import hashlib

    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _is_preset_dir(preset: str) -> bool:
    return os.path.isfile(os.path.join(preset, "config.json"))


def run_validation(options: ValidateOptions, on_event: Event | None = None) -> dict[str, Any]:
    """Measures every requested case, each in a fresh process; returns the report.

    Args:
        options: What to measure.
        on_event: Called with a one-line progress message per step.

    Returns:
        The JSON-ready report described in the module docstring.
    """
    say = on_event or (lambda _msg: None)
    env = child_environment(options.simulated_devices)
    workdir = tempfile.mkdtemp(prefix="khd-validate-")
    report: dict[str, Any] = {
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
        },
        "model": None,
        "environment": None,
        "synthetic_preset": None,
        "budget_bytes": None,
        "budget_source": None,
        "cases": [],
    }
    try:
        base_spec = {
            "preset": options.preset,
            "overrides": options.config_overrides(),
            "dtype": options.dtype,
            "mesh": list(options.mesh_shape),
            "interval_s": options.interval_ms / 1000.0,
        }
        preset_dir = None
        if "load" in options.phases:
            preset_dir, synthetic = _prepare_preset(options, base_spec, workdir, env, say)
            report["synthetic_preset"] = synthetic
        cases = CASES if options.baseline else ("ours",)
        plan = [(phase, case) for phase in options.phases for case in cases]
        for index, (phase, case) in enumerate(plan, 1):
            say(f"[{index}/{len(plan)}] {phase} {case}: running in a fresh process ...")
            spec = {**base_spec, "task": "measure", "case": case, "phase": phase}
            if phase == "load":
                spec["preset_dir"] = preset_dir
            result = _run_worker(spec, workdir, f"{phase}-{case}", env, options)
            result.update(phase=phase, case=case)
            result.setdefault("error", None)
            report["cases"].append(result)
            if result["ok"]:
                say(
                    f"[{index}/{len(plan)}] {phase} {case}: done in {result['wall_s']:.1f} s, "
                    f"max device peak {_fmt_bytes(max(result['peak_per_device'].values()))}"
                )
            else:
                say(f"[{index}/{len(plan)}] {phase} {case}: FAILED: {result['error']}")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _summarize(report, options)
    return report


def _prepare_preset(
    options: ValidateOptions,
    base_spec: Mapping[str, Any],
    workdir: str,
    env: Mapping[str, str],
    say: Event,
) -> tuple[str, dict[str, Any] | None]:
    if _is_preset_dir(options.preset):
        if options.config_overrides():
            raise ValueError(
                "Config overrides (--num_layers, --override) cannot change a preset "
                "directory's weights. Expected no overrides with --preset DIR and "
                f"--phases load. Received: {options.config_overrides()}."
            )
        return os.path.abspath(options.preset), None
    out_dir = _preset_cache_dir(options, workdir)
    if _is_preset_dir(out_dir):
        # Only complete presets are ever renamed into place (see below).
        say(f"synthetic preset: reusing {out_dir}")
        return out_dir, {
            "preset_dir": out_dir,
            "writer": "reused",
            "bytes_on_disk": _dir_bytes(out_dir),
            "wall_s": 0.0,
        }
    say(f"writing a synthetic preset of {options.preset} (random weights) to {out_dir} ...")
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    partial = out_dir + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    spec = {**base_spec, "task": "write_preset", "out_dir": partial}
    result = _run_worker(spec, workdir, "write-preset", env, options)
    if not result.get("ok"):
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(
            f"Could not write a synthetic preset of {options.preset!r}: "
            f"{result['error']}\n{result.get('log_tail', '')}"
        )
    os.replace(partial, out_dir)
    say(
        f"synthetic preset: {_fmt_bytes(result['bytes_on_disk'])} written in "
        f"{result['wall_s']:.1f} s by {result['writer']}"
    )
    return out_dir, {
        "preset_dir": out_dir,
        "writer": result["writer"],
        "bytes_on_disk": result["bytes_on_disk"],
        "wall_s": result["wall_s"],
    }


def _dir_bytes(path: str) -> int:
    return sum(
        os.path.getsize(os.path.join(root, f))
        for root, _, files in os.walk(path)
        for f in files
    )


# -- summaries -------------------------------------------------------------


def _max_value(values: Mapping[str, int]) -> int:
    return max(values.values()) if values else 0


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return float(a) / float(b)


def _peak_over_final(case: Mapping[str, Any]) -> float | None:
    ratios = [
        _ratio(peak, case["final_per_device"].get(d))
        for d, peak in case["peak_per_device"].items()
    ]
    ratios = [r for r in ratios if r is not None]
    return max(ratios) if ratios else None


def _host_growth(case: Mapping[str, Any]) -> int:
    return int(case["host_peak_rss"]) - int(case["host_start_rss"])


def _find(report: Mapping[str, Any], phase: str, case: str) -> dict[str, Any] | None:
    for c in report["cases"]:
        if c["phase"] == phase and c["case"] == case:
            return c
    return None


def _summarize(report: dict[str, Any], options: ValidateOptions) -> None:
    ok_cases = [c for c in report["cases"] if c["ok"]]
    if ok_cases:
        first = ok_cases[0]
        report["model"] = {
            k: first.get(k)
            for k in ("backbone_class", "parameter_count", "model_bytes", "weight_dtypes", "architecture", "config")
        }
        report["environment"] = {
            k: first.get(k) for k in ("platform", "device_kind", "device_count", "versions")
        }
    budget, source = None, None
    if options.hbm_gb is not None:
        budget, source = int(options.hbm_gb * GIB), "hbm_gb"
    else:
        limits = [
            v for c in ok_cases for v in (c.get("bytes_limit_per_device") or {}).values() if v
        ]
        if limits:
            budget, source = int(min(limits)), "bytes_limit"
    report["budget_bytes"], report["budget_source"] = budget, source

    comparisons = []
    for phase in options.phases:
        ours, stock = _find(report, phase, "ours"), _find(report, phase, "stock")
        ours = ours if ours and ours["ok"] else None
        stock = stock if stock and stock["ok"] else None
        row: dict[str, Any] = {"phase": phase}
        for name, c in (("ours", ours), ("stock", stock)):
            row[f"{name}_peak_max"] = _max_value(c["peak_per_device"]) if c else None
            row[f"{name}_final_max"] = _max_value(c["final_per_device"]) if c else None
            row[f"{name}_peak_over_final"] = _peak_over_final(c) if c else None
            row[f"{name}_host_peak_growth"] = _host_growth(c) if c else None
            row[f"{name}_wall_s"] = c["wall_s"] if c else None
        row["stock_over_ours_peak"] = _ratio(row["stock_peak_max"], row["ours_peak_max"])
        row["stock_over_ours_host_growth"] = _ratio(
            row["stock_host_peak_growth"], row["ours_host_peak_growth"]
        )
        row["stock_over_ours_wall"] = _ratio(row["stock_wall_s"], row["ours_wall_s"])
        comparisons.append(row)
    report["comparisons"] = comparisons

    over = []
    if budget is not None:
        for c in ok_cases:
            for d, peak in c["peak_per_device"].items():
                if peak > budget:
                    over.append(
                        {"phase": c["phase"], "case": c["case"], "device": d, "peak_bytes": int(peak), "budget_bytes": budget}
                    )
    report["over_budget"] = over
    if any(o["case"] == "ours" for o in over):
        report["exit_code"] = EXIT_OVER_BUDGET
    elif any(c["case"] == "ours" and not c["ok"] for c in report["cases"]):
        report["exit_code"] = EXIT_CASE_FAILED
    else:
        report["exit_code"] = EXIT_OK


def over_budget_lines(report: Mapping[str, Any]) -> list[str]:
    """One line per (phase, case, device) whose peak exceeds the budget."""
    lines = []
    for o in report.get("over_budget", []):
        verdict = "OVER BUDGET" if o["case"] == "ours" else "stock would not fit"
        lines.append(
            f"{verdict}: phase {o['phase']}, {o['case']}, device {o['device']}: peak "
            f"{_fmt_bytes(o['peak_bytes'])} > budget {_fmt_bytes(o['budget_bytes'])}"
        )
    return lines


def _fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _fmt_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def format_report(report: Mapping[str, Any], max_device_rows: int = 16) -> str:
    """The terminal table: per device and phase, ours vs stock, with ratios."""
    opts = report["options"]
    out = []
    model = report.get("model") or {}
    env = report.get("environment") or {}
    arch = opts["preset"] + (
        f" ({', '.join(f'{k}={v}' for k, v in opts['overrides'].items())})" if opts["overrides"] else ""
    )
    params = model.get("parameter_count")
    out.append(
        f"keras-hub-dist validate: {arch}"
        + (f", {model.get('backbone_class')}, {_fmt_count(params)} params" if params else "")
        + (f", {'/'.join(model.get('weight_dtypes') or [])} {_fmt_bytes(model.get('model_bytes'))}" if model else "")
    )
    out.append(
        f"mesh {opts['mesh'][0]}x{opts['mesh'][1]} (batch x model) on "
        f"{env.get('device_count', '?')} {env.get('platform', '?')} device(s); "
        "figures per device: "
        + ("allocator memory_stats" if any(c.get("source") == "memory_stats" for c in report["cases"] if c["ok"]) else "live arrays per shard + compiled temps")
    )
    if report.get("budget_bytes") is not None:
        out.append(f"budget per device: {_fmt_bytes(report['budget_bytes'])} ({report['budget_source']})")
    for phase in opts["phases"]:
        ours, stock = _find(report, phase, "ours"), _find(report, phase, "stock")
        out.append("")
        out.append(f"== {phase} ==")
        for name, c in (("ours", ours), ("stock", stock)):
            if c is not None and not c["ok"]:
                out.append(f"{name} FAILED: {c['error']}")
        ours = ours if ours and ours["ok"] else None
        stock = stock if stock and stock["ok"] else None
        if not ours and not stock:
            continue
        header = ["device", "ours peak", "ours final", "peak/final"]
        if stock:
            header += ["stock peak", "stock final", "peak/final", "stock/ours peak"]
        ids = list((ours or stock)["peak_per_device"].keys())
        rows = []
        for d in ids:
            row = []
            for c in (ours, stock) if stock else (ours,):
                if c is None:
                    row += ["-", "-", "-"]
                    continue
                p, f = c["peak_per_device"][d], c["final_per_device"][d]
                row += [_fmt_bytes(p), _fmt_bytes(f), _fmt_ratio(_ratio(p, f))]
            if stock:
                row.append(_fmt_ratio(_ratio(stock["peak_per_device"][d], ours["peak_per_device"][d] if ours else None)))
            rows.append([d, *row])
        if len(rows) > max_device_rows:
            worst = sorted(rows, key=lambda r: -float((stock or ours)["peak_per_device"][r[0]]))
            rows = worst[:max_device_rows]
        cmp = next(r for r in report["comparisons"] if r["phase"] == phase)
        rows.append(
            ["max", _fmt_bytes(cmp["ours_peak_max"]), _fmt_bytes(cmp["ours_final_max"]), _fmt_ratio(cmp["ours_peak_over_final"])]
            + ([_fmt_bytes(cmp["stock_peak_max"]), _fmt_bytes(cmp["stock_final_max"]), _fmt_ratio(cmp["stock_peak_over_final"]), _fmt_ratio(cmp["stock_over_ours_peak"])] if stock else [])
        )
        out.extend(_table(rows, header))
        out.append(
            f"host peak RSS growth: ours {_fmt_bytes(cmp['ours_host_peak_growth'])}"
            + (f", stock {_fmt_bytes(cmp['stock_host_peak_growth'])} ({_fmt_ratio(cmp['stock_over_ours_host_growth'])})" if stock else "")
        )
        out.append(
            f"wall time: ours {_fmt_s(cmp['ours_wall_s'])}"
            + (f", stock {_fmt_s(cmp['stock_wall_s'])} ({_fmt_ratio(cmp['stock_over_ours_wall'])})" if stock else "")
        )
    lines = over_budget_lines(report)
    if lines:
        out.append("")
        out.extend(lines)
    return "\n".join(out)


def _fmt_s(s: float | None) -> str:
    return "-" if s is None else f"{s:.1f} s"


def write_json(report: Mapping[str, Any], path: str) -> None:
    """Writes the report (see the module docstring for the schema)."""
    check_report(report)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


def plot_report(report: Mapping[str, Any], path: str) -> None:
    """Writes a PNG: per-device bytes over time, one row per phase, ours | stock.

    Raises:
        ImportError: matplotlib is not installed (with the install command).
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    phases = report["options"]["phases"]
    cases = [c for c in CASES if any(x["case"] == c for x in report["cases"])] or ["ours"]
    fig, axes = plt.subplots(
        len(phases), len(cases), figsize=(6.5 * len(cases), 3.6 * len(phases)), squeeze=False, sharey="row", sharex="row"
    )
    budget = report.get("budget_bytes")
    for i, phase in enumerate(phases):
        for j, name in enumerate(cases):
            ax = axes[i][j]
            case = _find(report, phase, name)
            ax.set_title(f"{phase} - {name}" + ("" if case and case["ok"] else " (failed)"))
            ax.set_xlabel("seconds")
            if j == 0:
                ax.set_ylabel("MiB per device\n(live arrays + running temps)")
            if not case or not case["ok"]:
                ax.text(0.5, 0.5, (case or {}).get("error") or "not run", ha="center", va="center", transform=ax.transAxes, wrap=True)
                continue
            timeline = case["timeline"]
            for d, values in timeline["bytes"].items():
                # Steps: between two samples nothing is known to have changed.
                ax.plot(
                    timeline["t"], [v / 2**20 for v in values], label=f"device {d}",
                    linewidth=1, drawstyle="steps-post",
                )
            if budget is not None:
                ax.axhline(budget / 2**20, color="red", linestyle="--", linewidth=1, label="budget")
            peak = max(case["peak_per_device"].values())
            ax.axhline(peak / 2**20, color="gray", linestyle=":", linewidth=1, label="peak")
            if len(timeline["bytes"]) <= 8:
                ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"keras-hub-dist validate: {report['options']['preset']}, mesh {report['options']['mesh'][0]}x{report['options']['mesh'][1]}")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


# -- schema ----------------------------------------------------------------

_INT = {"type": "integer", "minimum": 0}
_NUM_OR_NULL = {"type": ["number", "null"]}
_PER_DEVICE = {"type": "object", "additionalProperties": _INT}

REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "keras-hub-dist validate report",
    "type": "object",
    "required": [
        "schema_version", "tool", "created", "options", "model", "environment",
        "synthetic_preset", "budget_bytes", "budget_source", "cases",
        "comparisons", "over_budget", "exit_code",
    ],
    "properties": {
        "schema_version": {"type": "integer", "enum": [SCHEMA_VERSION]},
        "tool": {"type": "string"},
        "created": {"type": "string"},
        "options": {
            "type": "object",
            "required": ["preset", "mesh", "dtype", "phases", "num_layers", "overrides", "baseline", "hbm_gb", "devices", "interval_ms"],
            "properties": {
                "preset": {"type": "string"},
                "mesh": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                "dtype": {"type": ["string", "null"]},
                "phases": {"type": "array", "items": {"type": "string", "enum": list(PHASES)}},
                "num_layers": {"type": ["integer", "null"]},
                "overrides": {"type": "object"},
                "baseline": {"type": "boolean"},
                "hbm_gb": _NUM_OR_NULL,
                "devices": {"type": "integer", "minimum": 1},
                "interval_ms": {"type": "number"},
            },
        },
        "model": {
            "type": ["object", "null"],
            "required": ["backbone_class", "parameter_count", "model_bytes"],
            "properties": {"backbone_class": {"type": "string"}, "parameter_count": _INT, "model_bytes": _INT},
        },
        "environment": {
            "type": ["object", "null"],
            "required": ["platform", "device_count", "versions"],
            "properties": {"platform": {"type": "string"}, "device_count": {"type": "integer", "minimum": 1}, "versions": {"type": "object"}},
        },
        "synthetic_preset": {"type": ["object", "null"], "required": ["preset_dir", "writer"]},
        "budget_bytes": {"type": ["integer", "null"], "minimum": 0},
        "budget_source": {"type": ["string", "null"], "enum": ["hbm_gb", "bytes_limit", None]},
        "cases": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["phase", "case", "ok", "error", "returncode", "process_wall_s"],
                "properties": {
                    "phase": {"type": "string", "enum": list(PHASES)},
                    "case": {"type": "string", "enum": list(CASES)},
                    "ok": {"type": "boolean"},
                    "error": {"type": ["string", "null"]},
                    "returncode": {"type": "integer"},
                    "process_wall_s": {"type": "number"},
                    "wall_s": {"type": "number", "minimum": 0},
                    "source": {"type": "string", "enum": ["memory_stats", "live_arrays"]},
                    "peak_per_device": _PER_DEVICE,
                    "final_per_device": _PER_DEVICE,
                    "start_per_device": _PER_DEVICE,
                    "live_peak_per_device": _PER_DEVICE,
                    "temp_per_device": _PER_DEVICE,
                    "weights_per_device": _PER_DEVICE,
                    "host_start_rss": _INT,
                    "host_peak_rss": _INT,
                    "host_final_rss": _INT,
                    "timeline": {
                        "type": "object",
                        "required": ["t", "bytes", "live_bytes", "host_rss"],
                        "properties": {
                            "t": {"type": "array", "items": {"type": "number"}},
                            "bytes": {"type": "object", "additionalProperties": {"type": "array", "items": _INT}},
                            "live_bytes": {"type": "object", "additionalProperties": {"type": "array", "items": _INT}},
                            "host_rss": {"type": "array", "items": _INT},
                        },
                    },
                },
                "if": {"properties": {"ok": {"const": True}}},
                "then": {
                    "required": [
                        "wall_s", "source", "peak_per_device", "final_per_device", "start_per_device",
                        "live_peak_per_device", "temp_per_device", "weights_per_device",
                        "host_start_rss", "host_peak_rss", "host_final_rss", "timeline",
                    ]
                },
            },
        },
        "comparisons": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "phase", "ours_peak_max", "stock_peak_max", "ours_final_max", "stock_final_max",
                    "ours_peak_over_final", "stock_peak_over_final", "stock_over_ours_peak",
                    "ours_host_peak_growth", "stock_host_peak_growth", "stock_over_ours_host_growth",
                    "ours_wall_s", "stock_wall_s", "stock_over_ours_wall",
                ],
                "properties": {"phase": {"type": "string", "enum": list(PHASES)}},
                "additionalProperties": _NUM_OR_NULL,
            },
        },
        "over_budget": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["phase", "case", "device", "peak_bytes", "budget_bytes"],
                "properties": {
                    "phase": {"type": "string", "enum": list(PHASES)},
                    "case": {"type": "string", "enum": list(CASES)},
                    "device": {"type": "string"},
                    "peak_bytes": _INT,
                    "budget_bytes": _INT,
                },
            },
        },
        "exit_code": {"type": "integer", "enum": [EXIT_OK, EXIT_OVER_BUDGET, EXIT_CASE_FAILED]},
    },
}

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


def _check(value: Any, schema: Mapping[str, Any], where: str, errors: list[str]) -> None:
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else types
        if not any(_JSON_TYPES[t](value) for t in types):
            errors.append(f"{where}: expected {'/'.join(types)}, got {type(value).__name__} {value!r:.60}")
            return
    if "const" in schema and value != schema["const"]:
        errors.append(f"{where}: expected {schema['const']!r}, got {value!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: expected one of {schema['enum']}, got {value!r}")
    if "minimum" in schema and isinstance(value, (int, float)) and not isinstance(value, bool) and value < schema["minimum"]:
        errors.append(f"{where}: expected >= {schema['minimum']}, got {value}")
    if isinstance(value, dict):
        required = list(schema.get("required", []))
        if "if" in schema and not _errors_of(value, schema["if"]):
            required += schema.get("then", {}).get("required", [])
        for key in required:
            if key not in value:
                errors.append(f"{where}: missing key {key!r}")
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            if key in props:
                _check(item, props[key], f"{where}.{key}", errors)
            elif isinstance(extra, Mapping):
                _check(item, extra, f"{where}.{key}", errors)
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(item, schema["items"], f"{where}[{i}]", errors)


def _errors_of(value: Any, schema: Mapping[str, Any]) -> list[str]:
    errors: list[str] = []
    _check(value, schema, "", errors)
    return errors


def check_report(report: Any) -> None:
    """Raises `ValueError` listing every way `report` departs from `REPORT_SCHEMA`.

    Example:

    >>> check_report({"schema_version": 1})
    Traceback (most recent call last):
    ...
    ValueError: Invalid keras-hub-dist validate report ... missing key 'tool' ...
    """
    errors: list[str] = []
    _check(report, REPORT_SCHEMA, "report", errors)
    if errors:
        shown = "\n  ".join(errors[:20])
        raise ValueError(
            f"Invalid keras-hub-dist validate report ({len(errors)} problem(s)). "
            f"Expected the schema of REPORT_SCHEMA. Received:\n  {shown}"
        )
