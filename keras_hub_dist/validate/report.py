"""The report's verdicts and views: summary, ratios, budget, table and JSON file.

`summarize` fills in what the measured cases imply (the model, the budget,
the ours-vs-stock comparisons, the cases over budget and the exit code);
`format_report` renders the terminal table, `over_budget_lines` the budget
verdicts, and `write_json` the checked JSON file (its schema:
`keras_hub_dist.validate.schema`).

Example:

```python
report = run_validation(options)  # summarized already
print(format_report(report))
write_json(report, "report.json")
```
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from keras_hub_dist.plan.sizes import format_bytes
from keras_hub_dist.validate.options import ValidateOptions
from keras_hub_dist.validate.job_report import job_comparison, job_lines, plan_mismatches
from keras_hub_dist.validate.schema import (
    EXIT_CASE_FAILED,
    EXIT_OK,
    EXIT_OVER_BUDGET,
    EXIT_PLAN_MISMATCH,
    check_report,
)

__all__ = [
    "find_case",
    "format_report",
    "over_budget_lines",
    "summarize",
    "write_json",
]

GIB = 2**30


def find_case(report: Mapping[str, Any], phase: str, case: str) -> dict[str, Any] | None:
    """The report's entry of one (phase, case), failed or not; None if not run."""
    for c in report["cases"]:
        if c["phase"] == phase and c["case"] == case:
            return c
    return None


def _max_value(values: Mapping[str, int]) -> int:
    return max(values.values()) if values else 0


def _ratio(a: float | None, b: float | None) -> float | None:
    """`a / b`, or None where either is missing or `b` is 0."""
    if a is None or b is None or not b:
        return None
    return float(a) / float(b)


def _peak_over_final(case: Mapping[str, Any]) -> float | None:
    """The worst device's peak over its own final bytes."""
    ratios = [
        _ratio(peak, case["final_per_device"].get(d))
        for d, peak in case["peak_per_device"].items()
    ]
    ratios = [r for r in ratios if r is not None]
    return max(ratios) if ratios else None


def _host_growth(case: Mapping[str, Any]) -> int:
    return int(case["host_peak_rss"]) - int(case["host_start_rss"])


def _budget(
    cases: Sequence[Mapping[str, Any]], options: ValidateOptions
) -> tuple[int | None, str | None]:
    """`(bytes per device, source)`: `--hbm_gb`, else the smallest device limit."""
    if options.hbm_gb is not None:
        return int(options.hbm_gb * GIB), "hbm_gb"
    limits = [v for c in cases for v in (c.get("bytes_limit_per_device") or {}).values() if v]
    if limits:
        return int(min(limits)), "bytes_limit"
    return None, None


def _comparison(report: Mapping[str, Any], phase: str) -> dict[str, Any]:
    """One phase's row of `comparisons`: maxima, ratios, host growth, wall time."""
    ours, stock = find_case(report, phase, "ours"), find_case(report, phase, "stock")
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
    row.update(job_comparison(ours, stock))
    return row


def summarize(report: dict[str, Any], options: ValidateOptions) -> None:
    """Fills in `model`, `environment`, the budget, `comparisons`,
    `over_budget` and `exit_code` from the report's `cases`, in place.

    Args:
        report: A report whose `cases` are measured (see `run_validation`).
        options: The options the cases were measured with.
    """
    ok_cases = [c for c in report["cases"] if c["ok"]]
    if ok_cases:
        first = ok_cases[0]
        report["model"] = {
            k: first.get(k)
            for k in (
                "backbone_class", "parameter_count", "model_bytes", "weight_dtypes",
                "architecture", "config",
            )
        }
        report["environment"] = {
            k: first.get(k) for k in ("platform", "device_kind", "device_count", "versions")
        }
    budget, source = _budget(ok_cases, options)
    report["budget_bytes"], report["budget_source"] = budget, source
    report["comparisons"] = [_comparison(report, phase) for phase in options.phases]

    over = []
    if budget is not None:
        for c in ok_cases:
            for d, peak in c["peak_per_device"].items():
                if peak > budget:
                    over.append(
                        {
                            "phase": c["phase"], "case": c["case"], "device": d,
                            "peak_bytes": int(peak), "budget_bytes": budget,
                        }
                    )
    report["over_budget"] = over
    mismatches = plan_mismatches(ok_cases)
    if mismatches or any("plan_mismatches" in c for c in ok_cases):
        report["plan_mismatches"] = mismatches
    # Only our own cases fail the run: stock over budget is the problem this
    # package solves, so it is reported, not failed on. A plan that differs
    # from the measured program (either case: both are this package's plans)
    # is a bug of `plan_memory`.
    if any(o["case"] == "ours" for o in over):
        report["exit_code"] = EXIT_OVER_BUDGET
    elif any(c["case"] == "ours" and not c["ok"] for c in report["cases"]):
        report["exit_code"] = EXIT_CASE_FAILED
    elif mismatches:
        report["exit_code"] = EXIT_PLAN_MISMATCH
    else:
        report["exit_code"] = EXIT_OK


def over_budget_lines(report: Mapping[str, Any]) -> list[str]:
    """One line per (phase, case, device) whose peak exceeds the budget.

    Lines of our cases start with `OVER BUDGET`, stock's with `stock would
    not fit`.
    """
    lines = []
    for o in report.get("over_budget", []):
        verdict = "OVER BUDGET" if o["case"] == "ours" else "stock would not fit"
        lines.append(
            f"{verdict}: phase {o['phase']}, {o['case']}, device {o['device']}: peak "
            f"{format_bytes(o['peak_bytes'])} > budget {format_bytes(o['budget_bytes'])}"
        )
    return lines


def _fmt_count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(n)


def _fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def _fmt_s(s: float | None) -> str:
    return "-" if s is None else f"{s:.1f} s"


def _table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> list[str]:
    """Aligned columns: the first left-aligned, the figures right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            str(c).rjust(w) if i else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths))
        )

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _checkpoint_note(report: Mapping[str, Any]) -> str:
    """` [Hugging Face checkpoint ...]` where the load phase read one, else ``."""
    synthetic = report.get("synthetic_preset") or {}
    if synthetic.get("format") == "huggingface":
        return " [synthetic Hugging Face checkpoint]"
    for c in report["cases"]:
        arch = c.get("architecture") or {}
        if c.get("ok") and arch.get("kind") == "hf_dir":
            return f" [Hugging Face checkpoint, model_type={arch.get('model_type')}]"
    return ""


def _header_lines(report: Mapping[str, Any]) -> list[str]:
    """What was measured: architecture, model size, mesh, platform, budget."""
    opts = report["options"]
    model = report.get("model") or {}
    env = report.get("environment") or {}
    arch = opts["preset"] + (
        f" ({', '.join(f'{k}={v}' for k, v in opts['overrides'].items())})"
        if opts["overrides"] else ""
    ) + _checkpoint_note(report)
    if opts.get("quantize"):
        arch += (
            f" quantized {opts['quantize']} (ours: quantize=; stock: float, then "
            "model.quantize under the same distribution)"
        )
    params = model.get("parameter_count")
    out = [
        f"keras-hub-dist validate: {arch}"
        + (f", {model.get('backbone_class')}, {_fmt_count(params)} params" if params else "")
        + (
            f", {'/'.join(model.get('weight_dtypes') or [])} "
            f"{format_bytes(model.get('model_bytes'))}"
            if model else ""
        )
    ]
    stats = any(c.get("source") == "memory_stats" for c in report["cases"] if c["ok"])
    out.append(
        f"mesh {opts['mesh'][0]}x{opts['mesh'][1]} (batch x model) on "
        f"{env.get('device_count', '?')} {env.get('platform', '?')} device(s); "
        "figures per device: "
        + ("allocator memory_stats" if stats else "live arrays per shard + compiled temps")
    )
    if report.get("budget_bytes") is not None:
        out.append(
            f"budget per device: {format_bytes(report['budget_bytes'])} "
            f"({report['budget_source']})"
        )
    return out


def _phase_lines(report: Mapping[str, Any], phase: str, max_device_rows: int) -> list[str]:
    """One phase's section: failures, the per-device table, host RSS, wall time."""
    ours, stock = find_case(report, phase, "ours"), find_case(report, phase, "stock")
    out = ["", f"== {phase} =="]
    for name, c in (("ours", ours), ("stock", stock)):
        if c is not None and not c["ok"]:
            out.append(f"{name} FAILED: {c['error']}")
    ours = ours if ours and ours["ok"] else None
    stock = stock if stock and stock["ok"] else None
    if not ours and not stock:
        return out
    header = ["device", "ours peak", "ours final", "peak/final"]
    if stock:
        header += ["stock peak", "stock final", "peak/final", "stock/ours peak"]
    rows = []
    for d in (ours or stock)["peak_per_device"]:
        row = [d]
        for c in (ours, stock) if stock else (ours,):
            if c is None:
                row += ["-", "-", "-"]
                continue
            p, f = c["peak_per_device"][d], c["final_per_device"][d]
            row += [format_bytes(p), format_bytes(f), _fmt_ratio(_ratio(p, f))]
        if stock:
            ours_peak = ours["peak_per_device"][d] if ours else None
            row.append(_fmt_ratio(_ratio(stock["peak_per_device"][d], ours_peak)))
        rows.append(row)
    if len(rows) > max_device_rows:
        # Many devices: show the worst ones, by the peak that matters most.
        peaks = (stock or ours)["peak_per_device"]
        rows = sorted(rows, key=lambda r: -float(peaks[r[0]]))[:max_device_rows]
    cmp = next(r for r in report["comparisons"] if r["phase"] == phase)
    rows.append(
        [
            "max", format_bytes(cmp["ours_peak_max"]), format_bytes(cmp["ours_final_max"]),
            _fmt_ratio(cmp["ours_peak_over_final"]),
        ]
        + (
            [
                format_bytes(cmp["stock_peak_max"]), format_bytes(cmp["stock_final_max"]),
                _fmt_ratio(cmp["stock_peak_over_final"]),
                _fmt_ratio(cmp["stock_over_ours_peak"]),
            ]
            if stock else []
        )
    )
    out.extend(_table(rows, header))
    out.append(
        f"host peak RSS growth: ours {format_bytes(cmp['ours_host_peak_growth'])}"
        + (
            f", stock {format_bytes(cmp['stock_host_peak_growth'])} "
            f"({_fmt_ratio(cmp['stock_over_ours_host_growth'])})"
            if stock else ""
        )
    )
    out.append(
        f"wall time: ours {_fmt_s(cmp['ours_wall_s'])}"
        + (
            f", stock {_fmt_s(cmp['stock_wall_s'])} ({_fmt_ratio(cmp['stock_over_ours_wall'])})"
            if stock else ""
        )
    )
    out.extend(job_lines(ours, stock, cmp))
    return out


def format_report(report: Mapping[str, Any], max_device_rows: int = 16) -> str:
    """The terminal table: per device and phase, ours vs stock, with ratios.

    Args:
        report: A summarized report.
        max_device_rows: Devices shown per phase; beyond it only the ones
            with the highest peaks.

    Returns:
        The text, lines joined by newlines (no trailing newline).
    """
    out = _header_lines(report)
    for phase in report["options"]["phases"]:
        out.extend(_phase_lines(report, phase, max_device_rows))
    lines = over_budget_lines(report)
    if lines:
        out.append("")
        out.extend(lines)
    return "\n".join(out)


def write_json(report: Mapping[str, Any], path: str) -> None:
    """Checks the report against the schema and writes it to `path`.

    Args:
        report: A summarized report.
        path: The file to write; missing parent directories are created.

    Raises:
        ValueError: The report departs from `REPORT_SCHEMA` (nothing is
            written).
    """
    check_report(report)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
