"""Plans on the target compilers (TPU v5e / v6e via libtpu, H100 via XLA:GPU), from this CPU host.

Each row: one `plan_memory(..., target=...)` (stock and ours), its
per-device total, the verdict against the device's memory, the ESTIMATED
step time (`jobs.step_time`: overlapped and serial bounds) and the wall
time of the plan. A full-depth compile of a 7-9B model on this 2-core VM
takes minutes, so `--layers 1 2` plans reduced depths: the per-layer cost
(2 layers - 1 layer) extrapolates to full depth, and the table says which
rows are extrapolated.

```
python benchmarks/bench_targets.py --models gemma_7b_en --targets v5e-8 --jobs fit_lora generate --layers 1 2
```

Prints one JSON line per plan (and writes them to --out). `--table FILE`
prints the markdown table of such a file instead: each (model, target, job,
variant) planned at two depths gives the per-layer cost and the full depth
extrapolated from it (`FULL_LAYERS`), marked "extrapolated".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

JOBS = {
    "fit_full": dict(job="fit", batch_size=8, sequence_length=2048, remat="full"),
    "fit_lora": dict(job="fit", batch_size=8, sequence_length=2048, lora_rank=8, remat="full"),
    "generate": dict(job="generate", batch_size=8, sequence_length=8192),
}


FULL_LAYERS = {
    "gemma_7b_en": 28, "llama3_8b_en": 32, "qwen3_8b_en": 36, "mistral_7b_en": 32,
    "gemma2_9b_en": 42, "gpt_oss_20b_en": 24,
}
HBM_GIB = {"v5e": 16, "v6e": 32, "v4": 32, "v5p": 95, "h100": 84_929_347_584 / 2**30}


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    groups: dict[tuple, dict] = {}
    for row in rows:
        if "error" in row:
            print(f"<!-- {row['model']} {row['target']} {row['job']} {row['variant']}: {row['error']} -->")
            continue
        key = (row["model"], row["target"], row["job"], row["variant"])
        groups.setdefault(key, {})[row["layers"]] = row
    print("| model | target | job | variant | planned (layers: MiB, est. ms) | per layer: MiB, ms | full depth (layers) | MiB | verdict | est. step ms (overlapped / serial) |")
    print("|---|---|---|---|---|---:|---|---:|---|---:|")
    for (model, target, job, variant), by_depth in groups.items():
        depths = sorted(d for d in by_depth if isinstance(d, int))
        planned = "; ".join(
            f"{d}: {by_depth[d]['total_mib']:,.0f}" + (f", {_ms(by_depth[d])}" if _ms(by_depth[d]) else "")
            for d in depths
        )
        full = FULL_LAYERS.get(model)
        hbm = HBM_GIB[target.split("-")[0]]
        if "full" in by_depth:
            r = by_depth["full"]
            key = "decode_overlapped_s" if job == "generate" else "step_overlapped_s"
            serial = None if job == "generate" else _s(r, "step_serial_s")
            mib, over, label, per = r["total_mib"], _s(r, key), f"{full} (compiled)", "-"
        elif len(depths) >= 2 and full:
            a, b = by_depth[depths[-2]], by_depth[depths[-1]]
            n = depths[-1] - depths[-2]
            d_mib = (b["total_mib"] - a["total_mib"]) / n
            mib = b["total_mib"] + (full - depths[-1]) * d_mib if d_mib >= 0 else None
            over = serial = None
            per = f"{d_mib:,.0f}"
            key = "decode_overlapped_s" if job == "generate" else "step_overlapped_s"
            if b.get(key) is not None and a.get(key) is not None:
                d_over = (b[key] - a[key]) / n
                over = b[key] + (full - depths[-1]) * d_over
                per += f", {d_over * 1e3:,.2f}"
                if job != "generate":
                    d_ser = (b["step_serial_s"] - a["step_serial_s"]) / n
                    serial = b["step_serial_s"] + (full - depths[-1]) * d_ser
            label = f"{full} (extrapolated)"
        else:
            continue
        refused = any(by_depth[d].get("refusal") for d in by_depth)
        if mib is None:  # the compiler's cost fell with depth: no line to extrapolate
            verdict, mib_text = ("does NOT fit (refused)" if refused else "n/a"), "n/a (not linear)"
        else:
            verdict = "does NOT fit (refused)" if refused else ("fits" if mib <= hbm * 1024 else "does NOT fit")
            mib_text = f"{mib:,.0f}"
        times = "" if over is None else f"{over * 1e3:,.1f}" + ("" if serial is None else f" / {serial * 1e3:,.1f}")
        if job == "generate" and times:
            times = "decode " + times
        print(f"| {model} | {target} | {job} | {variant} | {planned} | {per} | {label} | {mib_text} | {verdict} | {times} |")


def _ms(row: dict) -> str:
    key = "decode_overlapped_s" if row["job"] == "generate" else "step_overlapped_s"
    return "" if row.get(key) is None else f"{row[key] * 1e3:,.2f} ms"


def _s(row: dict, key: str):
    return row.get(key)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--table":
        table(sys.argv[2])
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", nargs="+", default=["gemma_7b_en"])
    parser.add_argument("--targets", nargs="+", default=["v5e-8"])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--layers", nargs="+", type=int, default=[1, 2], help="0: full depth")
    parser.add_argument("--mesh", default="1x8")
    parser.add_argument("--stock", nargs="+", default=["ours", "stock"], choices=["ours", "stock"])
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import keras_hub_dist

    mesh = tuple(int(p) for p in args.mesh.split("x"))
    for model in args.models:
        for target in args.targets:
            for job in args.jobs:
                for layers in args.layers:
                    for variant in args.stock:
                        settings = dict(JOBS[job])
                        if args.batch:
                            settings["batch_size"] = args.batch
                        if args.seq:
                            settings["sequence_length"] = args.seq
                        if variant == "stock":
                            settings.pop("remat", None)
                        start = time.perf_counter()
                        try:
                            plan = keras_hub_dist.plan_memory(
                                model, mesh, dtype="bfloat16", target=target, stock=variant == "stock",
                                num_layers=layers or None, alternatives=False, **settings,
                            )
                        except Exception as error:  # a row that fails is reported, not fatal
                            row = dict(model=model, target=target, job=job, layers=layers, variant=variant,
                                       error=f"{type(error).__name__}: {str(error)[:300]}")
                        else:
                            est = plan.step_time
                            row = dict(
                                model=model, target=target, job=job, layers=layers or "full", variant=variant,
                                total_mib=round(plan.total_bytes / 2**20, 1), fits=plan.fits,
                                refusal=plan.refusal, compiler=plan.compiler,
                                step_overlapped_s=est and est.step.overlapped_s,
                                step_serial_s=est and est.step.serial_s,
                                step_compute_s=est and est.step.compute_s,
                                step_memory_s=est and est.step.memory_s,
                                step_comms_s=est and est.step.comms_s,
                                decode_overlapped_s=est and est.decode and est.decode.overlapped_s,
                                tokens_per_s_per_chip=est and est.tokens_per_s_per_chip,
                                mfu=est and est.mfu, optimal_s=est and est.compiler_optimal_raw_s,
                                flops=est and est.step.flops,
                            )
                        row["plan_s"] = round(time.perf_counter() - start, 1)
                        print(json.dumps(row), flush=True)
                        if args.out:
                            with open(args.out, "a", encoding="utf-8") as f:
                                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
