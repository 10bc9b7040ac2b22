"""Benchmark: `load_sharded_preset(..., quantize=)` vs stock load + `quantize`.

Side by side in one run, each case in a fresh subprocess, on 8 simulated CPU
devices, mesh (1, 8), from the float32 preset of `bench_load.py --config
width1` (Gemma-7B width, 1 decoder block, 3.8 GB), every model in bfloat16:

- `plain`: `load_sharded_preset(preset, mesh=(1, 8), dtype="bfloat16")`, the
  float load (the time and the final bytes to compare with);
- `ours_int8`, `ours_int4`: the same with `quantize="int8"` / `"int4"`;
- `stock_int8`, `stock_int4`: `Backbone.from_preset(preset, dtype=...)` under
  the same `ModelParallel`, then `backbone.quantize(mode)` (under a host RSS
  cap, `--stock_cap_gb`); a failure is reported as such.

Timing runs have no memory sampler; `<case>_mem` runs sample per-device live
bytes every 2 ms (plus compiled programs' temps) and host RSS. Printed: the
final per-device bytes (and their ratio to the bf16 load's), peak / final
per device, wall time over the plain load's, and host RSS growth over the
file's bytes (one process reads the whole file: its share is all of it).

Usage (heavy: run under the machine's heavy-job lock):

    flock /tmp/khd-heavy.lock python benchmarks/bench_quantize.py --keep
    # more decoder blocks (a smaller share of embedding), ours only:
    flock /tmp/khd-heavy.lock python benchmarks/bench_quantize.py --keep \
        --num_layers 4 --cases plain,ours_int8,ours_int4
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_load  # noqa: E402 - the shared case runner, preset writer, env

CASES = ("plain", "ours_int8", "ours_int4", "stock_int8", "stock_int4")


def _case(args) -> dict:
    import jax
    import keras
    import keras_hub

    import keras_hub_dist
    from keras_hub_dist.measure import memory

    which = args.case.removesuffix("_mem")
    mode = None if which == "plain" else which.split("_")[1]
    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), jax.devices())
    gc.collect()
    sampler = memory.MemorySampler(interval_s=0.002) if args.case.endswith("_mem") else None
    memory.reset_host_peak_rss()
    rss0 = memory.current_rss_bytes()
    error = None
    with sampler if sampler is not None else contextlib.nullcontext():
        cpu0 = bench_load._cpu_seconds()
        start = time.perf_counter()
        if which.startswith("stock"):
            layout_map = keras_hub_dist.get_layout_map(keras_hub.models.GemmaBackbone, mesh)
            distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
            with distribution.scope():
                model = keras_hub.models.Backbone.from_preset(args.preset, dtype="bfloat16")
                try:
                    model.quantize(mode)
                except Exception as e:  # noqa: BLE001 - reported
                    error = f"{type(e).__name__}: {str(e)[:300]}"
        else:
            model = keras_hub_dist.load_sharded_preset(
                args.preset, mesh=mesh, dtype="bfloat16", quantize=mode, progress=False
            )
        arrays = [v.value for v in model.weights]
        jax.block_until_ready(arrays)
        bench_load._touch_arrays(arrays)
        wall = time.perf_counter() - start
        cpu = bench_load._cpu_seconds() - cpu0
        if sampler is not None:
            sampler.sample()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "error": error,
        **bench_load.loaded_memory(arrays, args.preset, rss0, sampler),
    }


def _row(name: str, timed: list[dict], mem: list[dict], plain: dict | None) -> str:
    runs = timed + mem
    if not runs or all(r.get("failed") or r.get("killed") for r in runs):
        r = (runs or [{}])[-1]
        note = r.get("reason") or r.get("stderr_tail", "")[-300:]
        return f"| {name} | stopped | - | - | - | - | {note!r} |"
    good = [r for r in runs if not (r.get("failed") or r.get("killed"))]
    wall = bench_load._median([r["wall_s"] for r in (timed or mem) if not (r.get("failed") or r.get("killed"))])
    weights = max(good[0]["weights_per_device"].values())
    over_bf16 = "-"
    if plain:
        over_bf16 = f"{weights / max(plain['weights_per_device'].values()):.3f}"
    peak = "-"
    if mem and "peak_per_device" in mem[0]:
        m = mem[0]
        peak = (
            f"{max(m['peak_per_device'].values()) / 2**20:.0f} MiB max; peak/final "
            + f"{max(m['peak_per_device'][d] / f for d, f in m['final_per_device'].items() if f):.3f}"
        )
    growth = max((r["host_rss_peak"] - r["host_rss_start"]) / r["file_bytes"] for r in good)
    time_ratio = f"{wall / plain['wall_s']:.2f}" if plain else "-"
    error = good[0].get("error")
    return (
        f"| {name} | {wall:.2f} ({time_ratio}x plain) | {weights / 2**20:.1f} MiB ({over_bf16}x bf16) "
        f"| {peak} | {growth:.2f} | {'FAILED: ' + error if error else 'ok'} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default=None)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--workdir", default="/work/bench_tmp")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--stock_cap_gb", type=float, default=18.0)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--cases", default=",".join(CASES), help="Comma-separated subset of the cases.")
    parser.add_argument("--num_layers", type=int, default=0,
                        help="Decoder blocks of the probe (default 1: the embedding is 83%% of its weights).")
    args = parser.parse_args()
    if args.case:
        result = _case(args)
        sys.stdout.write(bench_load.RESULT_TAG + json.dumps(result) + "\n")
        sys.stdout.flush()
        os._exit(0)
    suffix = f"_L{args.num_layers}" if args.num_layers else ""
    args.preset = args.preset or os.path.join(args.workdir, "bench_quantize_width1" + suffix)
    write = argparse.Namespace(config="width1", format="keras", preset=args.preset, num_layers=args.num_layers or None)
    bench_load._write(write)
    results: dict[str, list[dict]] = {}
    try:
        for repeat in range(args.repeats):
            for case in [c for c in CASES if c in args.cases.split(",")]:
                for name in (case, case + "_mem") if repeat == 0 else (case,):
                    command = [sys.executable, os.path.abspath(__file__), "--case", name, "--preset", args.preset]
                    cap = int(args.stock_cap_gb * 1e9) if case.startswith("stock") else 0
                    r = bench_load.run_capped(command, cap)
                    results.setdefault(name, []).append(r)
                    print(name, json.dumps({k: v for k, v in r.items() if k in ("wall_s", "error", "reason")}), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.preset, ignore_errors=True)
    plain_runs = [r for r in results.get("plain", []) if "wall_s" in r and not r.get("failed")]
    plain = dict(plain_runs[0], wall_s=bench_load._median([r["wall_s"] for r in plain_runs])) if plain_runs else None
    print("\n| case | wall s (vs plain bf16 load) | final per device | per-device peak | host RSS growth / file bytes | result |")
    print("|---|---|---|---|---|---|")
    for case in CASES:
        print(_row(case, results.get(case, []), results.get(case + "_mem", []), plain))


if __name__ == "__main__":
    main()
