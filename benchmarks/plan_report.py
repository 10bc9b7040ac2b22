"""Automatic layout plans for 7B-class LLMs, vs the hand-written layout maps.

For each named architecture (full config from `presets/`), the backbone is
built abstractly (variables with shapes, no values) and planned with
`keras_hub_dist.plan_layout` on an abstract mesh (default 1x8; no devices are
needed). Printed per architecture:

- per-device bytes of the automatic plan vs total / N (the physical floor),
  the plan's wall time, and its fallbacks;
- the same for the hand-written maps: ours (`keras_hub_dist.get_layout_map`,
  which reuses KerasHub's where it exists) and KerasHub's own
  `Backbone.get_layout_map` (raw, unchecked), and which variables get a
  different effective layout from the automatic plan (mesh axes of size 1 are
  ignored when comparing).

Every figure is computed from variable shapes and layouts: bytes each device
would hold. A markdown table closes the report.

    python benchmarks/plan_report.py
    python benchmarks/plan_report.py --mesh 2x4 --archs gemma_7b_en,qwen3_8b_en
    python benchmarks/plan_report.py --details   # full plan summaries
"""

from __future__ import annotations

import argparse
import math
import os
import re
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

DEFAULT_ARCHS = (
    "gemma_7b_en",
    "gemma2_9b_en",
    "llama3_8b_en",
    "qwen2.5_7b_en",
    "qwen3_8b_en",
    "mistral_7b_en",
    "gemma3_12b_text",
    "gemma2_27b_en",
)


def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def _effective(axes, rank, sizes):
    """Layout axes with size-1 mesh axes dropped, padded to the rank."""
    out = []
    for entry in tuple(axes or ()) + (None,) * (rank - len(tuple(axes or ()))):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(n for n in names if sizes.get(n, 1) > 1)
        out.append(kept[0] if len(kept) == 1 else (kept or None))
    return tuple(out)


def _fmt(axes) -> str:
    return "(" + ", ".join("-" if a is None else str(a) for a in axes) + ")"


def _compare(plan, variables, layout_map, sizes):
    """Per-device bytes under `layout_map`, invalid entries, and differences."""
    from keras_hub_dist.plan import specs
    from keras_hub_dist.errors import LayoutError

    per_device = 0
    invalid = []
    diffs = {}
    for v in variables:
        shape = tuple(int(d) for d in v.shape)
        layout = layout_map[v.path]
        axes = tuple(layout.axes) if layout is not None else (None,) * len(shape)
        itemsize = plan.decision(v.path).total_bytes // max(1, math.prod(shape))
        try:
            specs.validate_spec(v.path, shape, axes, sizes)
            block = specs.shard_shape(shape, axes, sizes)
            per_device += math.prod(block) * itemsize
        except LayoutError:
            invalid.append(v.path)
            per_device += math.prod(shape) * itemsize
        auto = _effective(plan.spec(v.path), len(shape), sizes)
        hand = _effective(axes, len(shape), sizes)
        if auto != hand:
            key = (re.sub(r"\d+", "#", v.path, count=1), _fmt(auto), _fmt(hand))
            diffs[key] = diffs.get(key, 0) + 1
    return per_device, invalid, diffs


def _print_map_comparison(title, plan, variables, layout_map, sizes, n):
    per_device, invalid, diffs = _compare(plan, variables, layout_map, sizes)
    floor = plan.total_bytes / n
    line = (
        f"  {title}: per device {_gib(per_device)} = "
        f"{per_device / floor:.4f} x total/{n}"
    )
    if invalid:
        line += (
            f"; INVALID on this mesh for {len(invalid)} variables (counted "
            f"replicated), e.g. {invalid[0]}"
        )
    print(line)
    count = sum(diffs.values())
    print(f"    variables whose layout differs from the automatic plan: {count}")
    for (path, auto, hand), k in sorted(diffs.items()):
        print(f"      {path}{f' x{k}' if k > 1 else ''}: auto {auto} vs map {hand}")
    return per_device, invalid, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default=",".join(DEFAULT_ARCHS))
    parser.add_argument("--mesh", default="1x8", help="batch x model, e.g. 2x4")
    parser.add_argument("--num_layers", type=int, default=None,
                        help="override depth for a quick run")
    parser.add_argument("--details", action="store_true",
                        help="print every plan's summary")
    args = parser.parse_args()

    import keras

    from keras_hub_dist.plan import layouts
    from keras_hub_dist.plan.mesh import abstract_device_mesh
    from keras_hub_dist.plan.abstract import abstract_backbone
    from keras_hub_dist.errors import LayoutFallbackWarning
    from keras_hub_dist.plan.auto_layout import plan_layout

    batch, model_size = (int(x) for x in args.mesh.split("x"))
    mesh = abstract_device_mesh((batch, model_size))
    sizes = {"batch": batch, "model": model_size}
    n = batch * model_size
    overrides = {} if args.num_layers is None else {"num_layers": args.num_layers}
    print(
        f"# plan_report: mesh {args.mesh} (batch x model), keras "
        f"{keras.__version__}, figures computed from shapes"
        + (f", num_layers={args.num_layers}" if overrides else "")
    )
    rows = []
    for name in args.archs.split(","):
        t0 = time.perf_counter()
        report = abstract_backbone(name, **overrides)
        t1 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LayoutFallbackWarning)
            plan = plan_layout(report.model, mesh)
        t2 = time.perf_counter()
        variables = report.model.weights
        floor = plan.total_bytes / n
        print(
            f"\n## {name} ({report.backbone_class_name}, "
            f"{report.parameter_count / 1e9:.2f} B params, "
            f"{_gib(plan.total_bytes)}): abstract build {t1 - t0:.1f} s, "
            f"plan {t2 - t1:.1f} s ({'traced' if plan.traced else 'UNTRACED'})"
        )
        print(
            f"  automatic plan: per device {_gib(plan.per_device_bytes)} = "
            f"{plan.per_device_bytes / floor:.4f} x total/{n} "
            f"(floor {_gib(floor)}); fallbacks: {len(plan.fallbacks)}"
        )
        seen = set()
        for d in plan.fallbacks:
            key = (re.sub(r"\d+", "#", d.path, count=1), d.fallback)
            if key not in seen:
                seen.add(key)
                print(f"    fallback {key[0]}: {d.fallback}")
        if args.details:
            print(plan.summary())

        ours_ratio = kh_ratio = None
        ours_diff = kh_diff = None
        kh_invalid = 0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", LayoutFallbackWarning)
            ours = layouts.get_layout_map(report.model, mesh)
        source = getattr(getattr(ours, "report", None), "source", "?")
        per_device, _, ours_diff = _print_map_comparison(
            f"keras_hub_dist.get_layout_map (rules from {source})",
            plan, variables, ours, sizes, n,
        )
        ours_ratio = per_device / floor
        cls = type(report.model)
        if callable(getattr(cls, "get_layout_map", None)):
            kh_map = cls.get_layout_map(mesh)
            per_device, invalid, kh_diff = _print_map_comparison(
                f"KerasHub {cls.__name__}.get_layout_map (raw)",
                plan, variables, kh_map, sizes, n,
            )
            kh_ratio = per_device / floor
            kh_invalid = len(invalid)
        else:
            print(f"  KerasHub {cls.__name__} has no get_layout_map")
        rows.append(
            (name, report.parameter_count, plan.total_bytes, plan.per_device_bytes,
             plan.per_device_bytes / floor, len(plan.fallbacks), t2 - t1,
             ours_ratio, ours_diff, kh_ratio, kh_diff, kh_invalid)
        )

    print(f"\n| architecture | params | per device (auto) | auto / (total/{n}) "
          "| auto fallbacks | plan s | ours / (total/N) | vars != ours "
          "| KerasHub / (total/N) | vars != KerasHub |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (name, params, _total, per_dev, ratio, fb, secs, o_ratio, o_diff,
         k_ratio, k_diff, k_invalid) in rows:
        kh = "-" if k_ratio is None else f"{k_ratio:.4f}"
        if k_invalid:
            kh += f" (invalid: {k_invalid} vars)"
        print(
            f"| {name} | {params / 1e9:.2f} B | {_gib(per_dev)} | {ratio:.4f} | "
            f"{fb} | {secs:.1f} | {o_ratio:.4f} | {o_diff} | {kh} | "
            f"{'-' if k_diff is None else k_diff} |"
        )


if __name__ == "__main__":
    main()
