"""The job phases' part of the report: XLA's program, measured vs planned.

A `fit` / `generate` case (`keras_hub_dist.validate.job_worker`) carries
`program` (XLA's memory analysis of the program the real run compiled),
`plan` (`plan_memory`'s figures for the same job) and `plan_mismatches`
(the XLA fields where they differ; empty when the plan is exact).
`job_comparison` adds the comparison row's job figures, `plan_mismatches`
lists the report's mismatches, `job_lines` renders a phase's program table.

Example:

```python
from keras_hub_dist.validate.job_report import job_lines

print("\\n".join(job_lines(ours_case, stock_case, comparison_row)))
```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from keras_hub_dist.plan.sizes import format_bytes

__all__ = ["FIELDS", "job_comparison", "job_lines", "plan_mismatches"]

# (label, key) of the program table's rows, XLA's per-device figures.
FIELDS = (
    ("arguments", "argument_bytes"),
    ("outputs", "output_bytes"),
    ("aliases", "alias_bytes"),
    ("temporaries", "temp_bytes"),
    ("total", "total_bytes"),
)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b:
        return None
    return float(a) / float(b)


def job_comparison(ours: Mapping[str, Any] | None, stock: Mapping[str, Any] | None) -> dict[str, Any]:
    """The comparison row's job figures (none for init / load): each side's
    measured program temporaries and total, the plan's total, and stock
    over ours of the temporaries."""
    if not any(c is not None and "program" in c for c in (ours, stock)):
        return {}
    row: dict[str, Any] = {}
    for name, c in (("ours", ours), ("stock", stock)):
        program = (c or {}).get("program") or {}
        plan = (c or {}).get("plan") or {}
        row[f"{name}_program_temp_bytes"] = program.get("temp_bytes")
        row[f"{name}_program_total_bytes"] = program.get("total_bytes")
        row[f"{name}_plan_total_bytes"] = plan.get("total_bytes")
    row["stock_over_ours_program_temp"] = _ratio(
        row["stock_program_temp_bytes"], row["ours_program_temp_bytes"]
    )
    return row


def plan_mismatches(cases: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`{phase, case, field, plan_bytes, measured_bytes}` per XLA field where
    a job case's plan differs from its measured program (`field: "program"`,
    the byte figures null, when the run compiled no such program)."""
    out = []
    for c in cases:
        for field in c.get("plan_mismatches") or ():
            program, plan = c.get("program") or {}, c.get("plan") or {}
            out.append(
                {
                    "phase": c["phase"], "case": c["case"], "field": field,
                    "plan_bytes": plan.get(field), "measured_bytes": program.get(field),
                }
            )
    return out


def _fmt(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def job_lines(
    ours: Mapping[str, Any] | None, stock: Mapping[str, Any] | None, row: Mapping[str, Any]
) -> list[str]:
    """A job phase's lines: the job's settings, then per XLA field the
    measured program and the plan, ours and stock, and the verdict."""
    cases = [(n, c) for n, c in (("ours", ours), ("stock", stock)) if c and "program" in c]
    if not cases:
        return []
    job = cases[0][1].get("job") or {}
    settings = ", ".join(
        f"{k}={v}" for k, v in job.items() if v is not None and k not in ("remat", "prompt_chunk")
    )
    extra = [
        f"{n} {k}={(c.get('job') or {}).get(k)}"
        for n, c in cases for k in ("remat", "prompt_chunk")
        if (c.get("job") or {}).get(k) is not None
    ]
    program = (cases[0][1].get("program") or {}).get("name", "?")
    out = [
        f"XLA's memory analysis of the program the run compiled ({program}; per device; "
        f"{settings}{'; ' + ', '.join(extra) if extra else ''}), and plan_memory's:"
    ]
    header = ["program"]
    for name, _ in cases:
        header += [f"{name} measured", f"{name} plan"]
    rows = []
    for label, key in FIELDS:
        line = [label]
        for _, c in cases:
            line += [_fmt((c.get("program") or {}).get(key)), _fmt((c.get("plan") or {}).get(key))]
        rows.append(line)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        out.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    ratio = row.get("stock_over_ours_program_temp")
    if ratio is not None:
        out.append(f"temporaries: stock / ours {ratio:.2f}x")
    for name, c in cases:
        bad = c.get("plan_mismatches") or []
        if bad:
            out.append(f"PLAN MISMATCH ({name}): plan_memory differs from the measured program in {', '.join(bad)}")
        else:
            out.append(f"plan = measured ({name}): XLA's arguments, outputs, aliases and temporaries equal")
    return out
