"""The report's plot: per-device memory over time, one row per phase, ours | stock.

matplotlib is optional (`pip install 'keras-hub-dist[plot]'`), so it is
imported only here and only when a plot is asked for; `require_matplotlib`
lets the command fail before minutes of measuring rather than after.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from keras_hub_dist.validate.options import CASES
from keras_hub_dist.validate.report import find_case

__all__ = ["plot_report", "require_matplotlib"]

_MIB = 2**20


def require_matplotlib() -> None:
    """Checks that matplotlib can be imported.

    Raises:
        ImportError: matplotlib is not installed (with the install command).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "--plot needs matplotlib, which is not installed. Install it with "
            "`pip install 'keras-hub-dist[plot]'` (or `pip install matplotlib`), "
            "or leave out --plot."
        ) from e


def _plot_case(ax: Any, case: Mapping[str, Any], budget: int | None) -> None:
    """One panel: each device's bytes over time, with the budget and the peak."""
    timeline = case["timeline"]
    for d, values in timeline["bytes"].items():
        # Steps: between two samples nothing is known to have changed.
        ax.plot(
            timeline["t"], [v / _MIB for v in values], label=f"device {d}",
            linewidth=1, drawstyle="steps-post",
        )
    if budget is not None:
        ax.axhline(budget / _MIB, color="red", linestyle="--", linewidth=1, label="budget")
    peak = max(case["peak_per_device"].values())
    ax.axhline(peak / _MIB, color="gray", linestyle=":", linewidth=1, label="peak")
    # Past 8 devices a legend hides the curves it names.
    if len(timeline["bytes"]) <= 8:
        ax.legend(fontsize=7, loc="upper left")


def plot_report(report: Mapping[str, Any], path: str) -> None:
    """Writes a PNG: per-device bytes over time, one row per phase, ours | stock.

    Args:
        report: A summarized report.
        path: The PNG file to write; missing parent directories are created.

    Raises:
        ImportError: matplotlib is not installed (with the install command).
    """
    require_matplotlib()
    import matplotlib

    # Agg: no display needed (the command runs on headless TPU hosts).
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    options = report["options"]
    phases = options["phases"]
    cases = [c for c in CASES if any(x["case"] == c for x in report["cases"])] or ["ours"]
    fig, axes = plt.subplots(
        len(phases), len(cases), figsize=(6.5 * len(cases), 3.6 * len(phases)),
        squeeze=False, sharey="row", sharex="row",
    )
    for i, phase in enumerate(phases):
        for j, name in enumerate(cases):
            ax = axes[i][j]
            case = find_case(report, phase, name)
            ax.set_title(f"{phase} - {name}" + ("" if case and case["ok"] else " (failed)"))
            ax.set_xlabel("seconds")
            if j == 0:
                ax.set_ylabel("MiB per device\n(live arrays + running temps)")
            if not case or not case["ok"]:
                ax.text(
                    0.5, 0.5, (case or {}).get("error") or "not run", ha="center",
                    va="center", transform=ax.transAxes, wrap=True,
                )
                continue
            _plot_case(ax, case, report.get("budget_bytes"))
    mesh = options["mesh"]
    fig.suptitle(f"keras-hub-dist validate: {options['preset']}, mesh {mesh[0]}x{mesh[1]}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)
