"""The JSON report of `keras-hub-dist validate`: its schema and exit codes.

The report (`--json`) has `schema_version` 2 (1: before the job phases;
such reports still validate); `REPORT_SCHEMA` is its JSON
Schema (draft 7) and `check_report` validates a report against it with the
`jsonschema` library. Byte figures are ints, device ids are strings of
`device.id`:

```
{
  "schema_version": 2,
  "tool": "keras-hub-dist validate", "created": ISO-8601 time,
  "options": {preset, mesh: [batch, model], dtype, phases, num_layers,
              overrides, baseline, hbm_gb, devices, interval_ms,
              checkpoint_format: "keras" | "huggingface" (optional),
              quantize: "int8" | "int4" | null (optional),
              # with a job phase only:
              batch, seq, lora_rank, remat, prompt_chunk},
  "model": {backbone_class, parameter_count, model_bytes, weight_dtypes,
            architecture: {"kind": "named", name, handle, full_parameter_count}
                        | {"kind": "preset_dir", path}
                        | {"kind": "hf_dir", path, model_type, torch_dtype},
            config} | null,
  "environment": {platform, device_kind, device_count, versions} | null,
  "synthetic_preset": {preset_dir, format: "keras" | "huggingface" (optional),
                       writer, bytes_on_disk, wall_s,
                       config_differences: [str] (optional)} | null,
  "budget_bytes": int | null, "budget_source": "hbm_gb" | "bytes_limit" | null,
  "cases": [{
      "phase": "init" | "load" | "fit" | "generate",
      "case": "ours" | "stock", "ok": bool,
      "error": str | null, "returncode": int, "process_wall_s": float,
      # only when ok:
      "wall_s", "source": "memory_stats" | "live_arrays",
      "peak_per_device", "final_per_device", "start_per_device",
      "live_peak_per_device", "temp_per_device", "weights_per_device",
      "host_start_rss", "host_peak_rss", "host_final_rss",
      "timeline": {"t": [s], "bytes": {device: [live + running temps]},
                   "live_bytes": {device: [live arrays]}, "host_rss": [bytes]},
      # fit / generate cases, when ok:
      "job": {batch, seq, lora_rank, remat, optimizer, sampler, prompt_chunk},
      "program": {name, argument_bytes, output_bytes, alias_bytes, temp_bytes,
                  total_bytes} | null (XLA's analysis of the program run),
      "plan": {argument_bytes, output_bytes, alias_bytes, temp_bytes,
               total_bytes, weights_bytes, optimizer_bytes, lora_bytes,
               kv_cache_bytes, compiler} (plan_memory's, same job),
      "plan_mismatches": [field] (empty: the plan equals the program),
      ...}],
  "comparisons": [{phase, ours_peak_max, stock_peak_max, ours_final_max,
                   stock_final_max, ours_peak_over_final, stock_peak_over_final,
                   stock_over_ours_peak, ours_host_peak_growth,
                   stock_host_peak_growth, stock_over_ours_host_growth,
                   ours_wall_s, stock_wall_s, stock_over_ours_wall,
                   # job phases: {ours,stock}_program_temp_bytes,
                   # {ours,stock}_program_total_bytes,
                   # {ours,stock}_plan_total_bytes,
                   # stock_over_ours_program_temp}],
  "over_budget": [{phase, case, device, peak_bytes, budget_bytes}],
  "plan_mismatches": [{phase, case, field, plan_bytes, measured_bytes}]
                     (with a job phase only),
  "exit_code": int
}
```

Ratios are `null` where a side is missing or failed. `peak_over_final` is
the worst device's peak divided by that device's final bytes.

Exit code (`exit_code`): `EXIT_OK` (0) ok; `EXIT_OVER_BUDGET` (1) a device's
peak in one of *our* cases exceeds the budget (stock exceeding it is
reported, not failed on: it is the problem this package solves);
`EXIT_CASE_FAILED` (3) one of our cases failed; `EXIT_PLAN_MISMATCH` (4)
`plan_memory`'s XLA figures differ from the program a job case (ours or
stock: both plans are this package's) compiled. The budget applies to the
job phases' peaks as to init's and load's.

Example:

```python
from keras_hub_dist.validate.schema import check_report

check_report(json.load(open("report.json")))  # ValueError if malformed
```
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

from keras_hub_dist.validate.options import CASES, CHECKPOINT_FORMATS, JOB_PHASES, PHASES

__all__ = [
    "EXIT_CASE_FAILED",
    "EXIT_OK",
    "EXIT_OVER_BUDGET",
    "EXIT_PLAN_MISMATCH",
    "REPORT_SCHEMA",
    "SCHEMA_VERSION",
    "check_report",
]

EXIT_OK = 0
EXIT_OVER_BUDGET = 1
EXIT_CASE_FAILED = 3
EXIT_PLAN_MISMATCH = 4
SCHEMA_VERSION = 2
# Reports of every version still validate (1: init and load only).
SCHEMA_VERSIONS = (1, 2)

# `check_report` lists at most this many problems (a wrong type repeated per
# device and sample would otherwise bury the first, telling one).
_MAX_SHOWN = 20

_INT = {"type": "integer", "minimum": 0}
_NUM_OR_NULL = {"type": ["number", "null"]}
_PER_DEVICE = {"type": "object", "additionalProperties": _INT}
_FORMAT = {"type": "string", "enum": list(CHECKPOINT_FORMATS)}
_INT_OR_NULL = {"type": ["integer", "null"], "minimum": 0}
_XLA_FIELDS = ["argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes"]
# XLA's memory analysis of a job's program, measured (`program`) or planned.
_PROGRAM = {
    "type": "object",
    "required": _XLA_FIELDS,
    "properties": {"name": {"type": "string"}, **{f: _INT for f in _XLA_FIELDS}},
}
_PLAN = {
    "type": "object",
    "required": [*_XLA_FIELDS, "weights_bytes", "optimizer_bytes", "lora_bytes", "compiler"],
    "properties": {
        **{f: _INT for f in _XLA_FIELDS},
        "weights_bytes": _INT,
        "optimizer_bytes": _INT,
        "lora_bytes": _INT,
        "kv_cache_bytes": _INT_OR_NULL,
        "compiler": {"type": "string"},
    },
}
# What the measured backbone was resolved from (`worker.resolve_architecture`).
_ARCHITECTURE = {
    "type": "object",
    "required": ["kind"],
    "properties": {
        "kind": {"type": "string", "enum": ["named", "preset_dir", "hf_dir"]},
        "path": {"type": "string"},
        "model_type": {"type": "string"},
        "torch_dtype": {"type": ["string", "null"]},
    },
    "allOf": [
        {
            "if": {"properties": {"kind": {"const": "hf_dir"}}},
            "then": {"required": ["path", "model_type"]},
        },
        {
            "if": {"properties": {"kind": {"const": "preset_dir"}}},
            "then": {"required": ["path"]},
        },
    ],
}

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
        "schema_version": {"type": "integer", "enum": list(SCHEMA_VERSIONS)},
        "tool": {"type": "string"},
        "created": {"type": "string"},
        "options": {
            "type": "object",
            "required": [
                "preset", "mesh", "dtype", "phases", "num_layers", "overrides",
                "baseline", "hbm_gb", "devices", "interval_ms",
            ],
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
                # Optional: reports written before the flag existed are "keras".
                "checkpoint_format": _FORMAT,
                # Optional: null (float models) where the flag is absent.
                "quantize": {"type": ["string", "null"], "enum": ["int8", "int4", None]},
                # Optional: present with a job phase.
                "batch": {"type": "integer", "minimum": 1},
                "seq": {"type": "integer", "minimum": 1},
                "lora_rank": {"type": ["integer", "null"], "minimum": 1},
                "remat": {"type": ["string", "null"]},
                "prompt_chunk": {"type": "integer", "minimum": 1},
            },
        },
        "model": {
            "type": ["object", "null"],
            "required": ["backbone_class", "parameter_count", "model_bytes"],
            "properties": {
                "backbone_class": {"type": "string"},
                "parameter_count": _INT,
                "model_bytes": _INT,
                "architecture": {"anyOf": [_ARCHITECTURE, {"type": "null"}]},
            },
        },
        "environment": {
            "type": ["object", "null"],
            "required": ["platform", "device_count", "versions"],
            "properties": {
                "platform": {"type": "string"},
                "device_count": {"type": "integer", "minimum": 1},
                "versions": {"type": "object"},
            },
        },
        "synthetic_preset": {
            "type": ["object", "null"],
            "required": ["preset_dir", "writer"],
            "properties": {
                "preset_dir": {"type": "string"},
                "format": _FORMAT,
                "writer": {"type": "string"},
                "config_differences": {"type": "array", "items": {"type": "string"}},
            },
        },
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
                            "bytes": {
                                "type": "object",
                                "additionalProperties": {"type": "array", "items": _INT},
                            },
                            "live_bytes": {
                                "type": "object",
                                "additionalProperties": {"type": "array", "items": _INT},
                            },
                            "host_rss": {"type": "array", "items": _INT},
                        },
                    },
                    "job": {"type": "object", "required": ["batch", "seq"]},
                    "program": {"anyOf": [_PROGRAM, {"type": "null"}]},
                    "plan": _PLAN,
                    "plan_mismatches": {"type": "array", "items": {"type": "string"}},
                },
                # A failed case has no figures; a measured one has them all.
                "if": {"properties": {"ok": {"const": True}}},
                "then": {
                    "required": [
                        "wall_s", "source", "peak_per_device", "final_per_device",
                        "start_per_device", "live_peak_per_device", "temp_per_device",
                        "weights_per_device", "host_start_rss", "host_peak_rss",
                        "host_final_rss", "timeline",
                    ]
                },
                # A measured job case also has its program and its plan.
                "allOf": [
                    {
                        "if": {
                            "properties": {
                                "ok": {"const": True},
                                "phase": {"enum": list(JOB_PHASES)},
                            },
                            "required": ["ok", "phase"],
                        },
                        "then": {"required": ["job", "program", "plan", "plan_mismatches"]},
                    }
                ],
            },
        },
        "comparisons": {
            "type": "array",
            "items": {
                "type": "object",
                "required": [
                    "phase", "ours_peak_max", "stock_peak_max", "ours_final_max",
                    "stock_final_max", "ours_peak_over_final", "stock_peak_over_final",
                    "stock_over_ours_peak", "ours_host_peak_growth",
                    "stock_host_peak_growth", "stock_over_ours_host_growth",
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
        "plan_mismatches": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["phase", "case", "field", "plan_bytes", "measured_bytes"],
                "properties": {
                    "phase": {"type": "string", "enum": list(JOB_PHASES)},
                    "case": {"type": "string", "enum": list(CASES)},
                    "field": {"type": "string"},
                    "plan_bytes": _INT_OR_NULL,
                    "measured_bytes": _INT_OR_NULL,
                },
            },
        },
        "exit_code": {
            "type": "integer",
            "enum": [EXIT_OK, EXIT_OVER_BUDGET, EXIT_CASE_FAILED, EXIT_PLAN_MISMATCH],
        },
    },
}


@functools.cache
def _validator() -> Any:
    """A draft-7 validator of `REPORT_SCHEMA` whose integers are Python ints.

    Raises:
        ImportError: jsonschema is not installed (with the install command).
    """
    try:
        import jsonschema
    except ImportError as e:
        raise ImportError(
            "Checking a keras-hub-dist validate report needs jsonschema, which "
            "is not installed. Install it with `pip install jsonschema`."
        ) from e
    base = jsonschema.Draft7Validator
    # JSON Schema counts 3.0 as an integer; byte figures written as floats
    # mean a bug upstream, so only real ints (never bools) pass.
    checker = base.TYPE_CHECKER.redefine(
        "integer", lambda _checker, v: isinstance(v, int) and not isinstance(v, bool)
    )
    return jsonschema.validators.extend(base, type_checker=checker)(REPORT_SCHEMA)


def _where(path: Any) -> str:
    """`["cases", 0, "case"]` -> `"report.cases[0].case"`."""
    where = "report"
    for part in path:
        where += f"[{part}]" if isinstance(part, int) else f".{part}"
    return where


def _problems(error: Any) -> Iterator[str]:
    """One line per problem of a `jsonschema.ValidationError`, naming its path."""
    where, value, expected = _where(error.absolute_path), error.instance, error.validator_value
    kind = error.validator
    if kind == "required":
        # jsonschema raises one error per missing key; each lists them all
        # here and `check_report` drops the repeats.
        for key in expected:
            if key not in value:
                yield f"{where}: missing key {key!r}"
    elif kind == "type":
        types = [expected] if isinstance(expected, str) else list(expected)
        yield f"{where}: expected {'/'.join(types)}, got {type(value).__name__} {value!r:.60}"
    elif kind == "const":
        yield f"{where}: expected {expected!r}, got {value!r}"
    elif kind == "enum":
        yield f"{where}: expected one of {expected}, got {value!r}"
    elif kind == "minimum":
        yield f"{where}: expected >= {expected}, got {value}"
    else:
        yield f"{where}: {error.message}"


def check_report(report: Any) -> None:
    """Checks a report against `REPORT_SCHEMA`.

    Args:
        report: A report as `run_validation` returns it or as read back from
            its JSON file.

    Raises:
        ValueError: The report departs from the schema; the message lists
            every problem (the first 20), each with its path, e.g.
            `report.cases[0]: missing key 'peak_per_device'`.
        ImportError: jsonschema is not installed.

    Example:

    >>> check_report({"schema_version": 1})
    Traceback (most recent call last):
    ...
    ValueError: Invalid keras-hub-dist validate report ...missing key 'tool'...
    """
    # jsonschema reports in the schema's key order, items in index order;
    # dict.fromkeys drops repeated lines and keeps that order.
    errors = _validator().iter_errors(report)
    problems = list(dict.fromkeys(p for e in errors for p in _problems(e)))
    if problems:
        shown = "\n  ".join(problems[:_MAX_SHOWN])
        raise ValueError(
            f"Invalid keras-hub-dist validate report ({len(problems)} problem(s)). "
            f"Expected the schema of REPORT_SCHEMA. Received:\n  {shown}"
        )
