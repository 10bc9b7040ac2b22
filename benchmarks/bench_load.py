"""Benchmark: `load_sharded_preset` vs stock `from_preset` vs reading the file.

Side by side in one run, each case in a fresh subprocess (so one case's memory
cannot hide another's), on 8 simulated CPU devices, mesh (1, 8):

Cases named `<x>_mem` run `<x>` again with the memory sampler (a thread that
costs CPU); the wall-time ratios come from the runs without it.

- `floor`: read the weights file into fresh memory (one sequential read, every
  page touched): the physical floor of any loader. `floor_thp` is the same
  read into the huge-page-backed anonymous memory the loader itself uses (a
  page fault per 2 MiB instead of per 4 KiB), the floor for that memory.
- `ours`: `keras_hub_dist.load_sharded_preset(preset, mesh=(1, 8))`.
- `stock`: `keras_hub.models.Backbone.from_preset(preset)` inside the same
  `ModelParallel` (same mesh, same layout map).

`--format huggingface` writes the same architecture as a Hugging Face
checkpoint (config.json + 2 GB safetensors shards + index,
`write_synthetic_hf_checkpoint`): stock then reads it through KerasHub's
converter (`port_weight`: whole tensor, transform, assign), ours block by
block; the floor reads the safetensors files.

Each case is timed until every weight is resident: arrays are blocked on and
every page of every shard is read. Per-device figures come from
`keras_hub_dist.memory.MemorySampler` (live-array bytes per shard, sampled
every 2 ms, plus compiled programs' temps); host figures from VmRSS/VmHWM.

Configs:

- `width1` (default): Gemma-7B width, 1 decoder block, float32: vocab 256000,
  hidden 3072, 16 heads of 256, KerasHub `intermediate_dim=24576` (3.8 GB, the
  configuration the team measured stock at 8.45x / 3.3x / ~7x on).
- `full7b`: the full `gemma_7b_en` architecture (28 blocks, 8.54 B params) in
  bfloat16 (17 GB). Stock runs under a host-RSS cap (`--stock_cap_gb`,
  default 20 GB for this config), watched from the parent every 5 ms, so it
  cannot take the shared machine down; if it crosses the cap it is stopped and
  reported as such.
- `mixtral2`: the `mixtral_8_7b_en` architecture (MoE: 8 experts per block)
  with 2 of its 32 blocks, bfloat16 (5.9 GB); stock under the same cap.

The preset is a synthetic one (random weights) written by
`keras_hub_dist.write_synthetic_preset`, streaming, under `--workdir`; it is
deleted at the end unless `--keep`.

Usage (heavy: run under the machine's heavy-job lock):

    flock /tmp/khd-heavy.lock python benchmarks/bench_load.py --config width1
    python benchmarks/bench_load.py --config full7b --write_only --keep
    flock /tmp/khd-heavy.lock python benchmarks/bench_load.py --config full7b --keep
    python benchmarks/bench_load.py --config width1 --format huggingface
    flock /tmp/khd-heavy.lock python benchmarks/bench_load.py --config mixtral2
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import threading
import time

CONFIGS = {
    "width1": dict(
        architecture="gemma_7b_en",
        dtype="float32",
        overrides=dict(num_layers=1, intermediate_dim=24576),
    ),
    "full7b": dict(architecture="gemma_7b_en", dtype="bfloat16", overrides={}),
    # Mixtral 8x7B's shape (8 experts of 4096 x 14336, 32 query / 8 KV heads,
    # vocab 32000) with 2 of its 32 blocks, bfloat16: 5.9 GB, so stock fits
    # beside it on this 24 GB host.
    "mixtral2": dict(architecture="mixtral_8_7b_en", dtype="bfloat16", overrides=dict(num_layers=2)),
}
RESULT_TAG = "RESULT "


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["KERAS_BACKEND"] = "jax"
    env["JAX_PLATFORMS"] = "cpu"
    env["TF_CPP_MIN_LOG_LEVEL"] = "3"
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    return env


# --- cases (run in a fresh subprocess) ---------------------------------------


def _touch_arrays(arrays) -> int:
    """Reads one byte per page of every shard (no copy): forces residency."""
    total = 0
    for array in arrays:
        for shard in array.addressable_shards:
            data = shard.data
            nbytes = data.nbytes
            if not nbytes:
                continue
            view = (ctypes.c_uint8 * nbytes).from_address(data.unsafe_buffer_pointer())
            import numpy as np

            total += int(np.frombuffer(view, np.uint8)[::4096].sum())
    return total


def _cpu_seconds() -> float:
    """User + system CPU time of this process (all threads, incl. the
    memory sampler's)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _weights_files(preset: str) -> list[str]:
    """The checkpoint's weight files: `model.weights.h5`, or the safetensors
    files of a Hugging Face checkpoint."""
    names = sorted(f for f in os.listdir(preset) if f.endswith((".weights.h5", ".safetensors")))
    return [os.path.join(preset, f) for f in names]


def _weights_bytes(preset: str) -> int:
    return sum(os.path.getsize(f) for f in _weights_files(preset))


def loaded_memory(arrays, preset: str, rss0: int, sampler) -> dict:
    """The memory figures of a loaded model's `arrays` (bench_quantize,
    bench_prequantized): their bytes, per device, the preset's weights
    bytes, host RSS from `rss0` to its peak and, with a `sampler`, each
    device's peak and final over its start."""
    from keras_hub_dist.measure import memory

    result = {
        "model_bytes": sum(a.nbytes for a in arrays),
        "weights_per_device": {str(k): v for k, v in memory.live_bytes_per_device(arrays).items()},
        "file_bytes": _weights_bytes(preset),
        "host_rss_start": rss0,
        "host_rss_peak": max(memory.host_peak_rss_bytes(), memory.current_rss_bytes()),
    }
    if sampler is not None:
        start_per_device = sampler.start_per_device
        result["peak_per_device"] = {
            str(d): p - start_per_device.get(d, 0) for d, p in sampler.peak_per_device.items()
        }
        result["final_per_device"] = {
            str(d): f - start_per_device.get(d, 0) for d, f in sampler.final_per_device.items()
        }
    return result


def _case_floor(args, huge_pages: bool) -> dict:
    import numpy as np

    from keras_hub_dist.measure import memory
    from keras_hub_dist.storage.host_io import aligned_empty

    files = _weights_files(args.preset)
    size = sum(os.path.getsize(f) for f in files)
    memory.reset_host_peak_rss()
    rss0 = memory.current_rss_bytes()
    cpu0 = _cpu_seconds()
    start = time.perf_counter()
    if huge_pages:  # the same fresh memory the loader fills
        buffer = aligned_empty((size,), np.uint8)
    else:  # plain fresh memory, as `f.read()` would give
        buffer = np.empty((size,), np.uint8)
    view = memoryview(buffer)
    done = 0
    for path in files:
        end = done + os.path.getsize(path)
        with open(path, "rb", buffering=0) as f:
            while done < end:
                n = f.readinto(view[done:end])
                if not n:
                    raise RuntimeError("file shrank while reading")
                done += n
    checksum = int(buffer[::4096].sum())
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "cpu_s": _cpu_seconds() - cpu0,
        "file_bytes": size,
        "host_rss_start": rss0,
        "host_rss_peak": memory.host_peak_rss_bytes(),
        "checksum": checksum,
    }


def _case_load(
    args, which: str, sample: bool, mesh_shape: tuple[int, int] = (1, 8), **load_kwargs
) -> dict:
    import contextlib
    import gc

    import jax
    import keras
    import keras_hub

    import keras_hub_dist
    from keras_hub_dist.measure import memory

    mesh = keras.distribution.DeviceMesh(mesh_shape, ("batch", "model"), jax.devices())
    if which == "stock":
        backbone_cls = keras_hub_dist.presets.resolve(CONFIGS[args.config]["architecture"]).backbone_class
        layout_map = keras_hub_dist.get_layout_map(backbone_cls, mesh)
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    gc.collect()
    # Timing runs have no sampler thread (it costs CPU, which the file-read
    # floor does not pay); memory runs sample every 2 ms.
    sampler = memory.MemorySampler(interval_s=0.002) if sample else None
    memory.reset_host_peak_rss()
    rss0 = memory.current_rss_bytes()
    with sampler if sampler is not None else contextlib.nullcontext():
        cpu0 = _cpu_seconds()
        start = time.perf_counter()
        if which == "ours":
            model = keras_hub_dist.load_sharded_preset(
                args.preset, mesh=mesh, dtype=args.dtype, progress=False,
                num_threads=args.num_threads, **load_kwargs,
            )
        else:
            with distribution.scope():
                model = keras_hub.models.Backbone.from_preset(args.preset, dtype=args.dtype)
        arrays = [v.value for v in model.weights]
        jax.block_until_ready(arrays)
        _touch_arrays(arrays)
        wall = time.perf_counter() - start
        cpu = _cpu_seconds() - cpu0
        if sampler is not None:
            sampler.sample()
    result = {
        "wall_s": wall,
        "cpu_s": cpu,
        "model_bytes": sum(a.nbytes for a in arrays),
        # What this process's devices hold (all of it in a one-process job).
        "held_bytes": sum(s.data.nbytes for a in arrays for s in a.addressable_shards),
        "host_rss_start": rss0,
        "host_rss_peak": max(memory.host_peak_rss_bytes(), memory.current_rss_bytes()),
        "specs": sorted({str(a.sharding.spec) for a in arrays}),
    }
    if sampler is not None:
        start_per_device = sampler.start_per_device
        result.update(
            peak_per_device={
                d: p - start_per_device.get(d, 0) for d, p in sampler.peak_per_device.items()
            },
            final_per_device={
                d: f - start_per_device.get(d, 0) for d, f in sampler.final_per_device.items()
            },
            compiled_programs=[c["name"] for c in sampler.compiled],
        )
    return result


def run_case(args) -> None:
    if args.case in ("floor", "floor_thp"):
        result = _case_floor(args, huge_pages=args.case == "floor_thp")
    else:
        which = args.case.removesuffix("_mem")
        result = _case_load(args, which, sample=args.case.endswith("_mem"))
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    # Skip interpreter teardown of 8 simulated devices' worth of arrays.
    os._exit(0)


# --- orchestration -----------------------------------------------------------


def _rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _spawn(args, case: str) -> dict:
    """Runs one case in a fresh process; stock cases under the RSS cap."""
    command = [
        sys.executable, os.path.abspath(__file__), "--case", case,
        "--preset", args.preset, "--dtype", args.dtype, "--config", args.config,
        "--num_threads", str(args.num_threads), "--format", args.format,
    ]
    cap = int(args.stock_cap_gb * 1e9) if case.startswith("stock") and args.stock_cap_gb else 0
    return run_capped(command, cap)


def run_capped(command: list[str], cap: int) -> dict:
    """Runs a case command in a fresh process and returns its `RESULT` json.
    With `cap` (bytes), the process is watched from here every 5 ms and
    stopped above that host RSS: a process holding the GIL in a long C call
    cannot watch itself."""
    started = time.perf_counter()
    with subprocess.Popen(
        command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        peak_rss = 0
        killed = None
        out: list[str] = []
        err: list[str] = []
        readers = [
            threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True),
            threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True),
        ]
        for r in readers:
            r.start()
        while proc.poll() is None:
            rss = _rss_of(proc.pid)
            peak_rss = max(peak_rss, rss)
            if cap and rss > cap and killed is None:
                proc.kill()
                killed = {
                    "killed": True,
                    "reason": f"stopped by the benchmark at host RSS {rss / 1e9:.2f} GB "
                    f"(cap {cap / 1e9:.1f} GB) after {time.perf_counter() - started:.1f} s "
                    "(process start included)",
                    "rss_at_kill": rss,
                    "wall_s": time.perf_counter() - started,
                }
            time.sleep(0.005)
        for r in readers:
            r.join()
    if killed is not None:
        killed["stderr_tail"] = "".join(err)[-1000:]
        return killed
    lines = [line for line in out if line.startswith(RESULT_TAG)]
    if not lines:
        return {
            "failed": True,
            "returncode": proc.returncode,
            "stderr_tail": "".join(err)[-2000:],
            "wall_s": time.perf_counter() - started,
        }
    result = json.loads(lines[-1][len(RESULT_TAG):])
    result["returncode"] = proc.returncode
    result["process_peak_rss_polled"] = peak_rss
    return result


def _write(args) -> None:
    import keras_hub_dist

    config = CONFIGS[args.config]
    overrides = dict(config["overrides"])
    if args.num_layers:
        overrides["num_layers"] = args.num_layers
    if os.path.isdir(args.preset) and _weights_files(args.preset):
        print(f"reusing {args.preset}")
        return
    start = time.perf_counter()
    if args.format == "huggingface":
        entry = keras_hub_dist.presets.resolve(config["architecture"])
        keras_config = {**entry.config_json()["config"], **overrides}
        keras_hub_dist.write_synthetic_hf_checkpoint(
            args.preset, entry.backbone_class, keras_config, dtype=config["dtype"],
            shard_bytes=2 * 10**9, overwrite=True, progress=sys.stderr.isatty(),
        )
    else:
        keras_hub_dist.write_synthetic_preset(
            args.preset, config["architecture"], dtype=config["dtype"],
            overwrite=True, tokenizer=False, progress=sys.stderr.isatty(),
            **overrides,
        )
    size = _weights_bytes(args.preset)
    print(
        f"wrote {args.preset} ({args.format}): {size / 1e9:.2f} GB in "
        f"{time.perf_counter() - start:.1f} s (streaming)"
    )


def _max_ratio(result: dict) -> float:
    ratios = [
        result["peak_per_device"][d] / f
        for d, f in result["final_per_device"].items()
        if f > 0
    ]
    return max(ratios) if ratios else float("nan")


def _median(values: list[float]) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def _ratio(a: float, b: float) -> str:
    return "-" if b != b or a != a else f"{a / b:.2f}"  # NaN: case not run


def _summarize(results: list[tuple[str, dict]]) -> str:
    by_case: dict[str, list[dict]] = {}
    for name, r in results:
        by_case.setdefault(name, []).append(r)

    def good(name):
        return [r for r in by_case.get(name, []) if not (r.get("failed") or r.get("killed"))]

    floor = _median([r["wall_s"] for r in good("floor")])
    floor_thp = _median([r["wall_s"] for r in good("floor_thp")])
    rows = [
        "| case | wall s (median of timing runs; all) | CPU s (median) | wall / file read "
        "| wall / file read (huge pages) | per-device peak / final (max) "
        "| host RSS growth / model bytes (max) | notes |",
        "|---|---|---|---|---|---|---|---|",
    ]
    names = [n for n in dict.fromkeys(name.removesuffix("_mem") for name, _ in results)]
    for name in names:
        timing, mem = good(name), good(name + "_mem")
        runs = by_case.get(name, []) + by_case.get(name + "_mem", [])
        walls = "; ".join(f"{r['wall_s']:.2f}" for r in by_case.get(name, []))
        stopped = [r for r in runs if r.get("failed") or r.get("killed")]
        if not timing and not mem:
            r = stopped[-1]
            note = r.get("reason") or f"exit {r.get('returncode')}: {r.get('stderr_tail', '')[-300:]!r}"
            rows.append(
                f"| {name} | stopped after {r['wall_s']:.1f} s | - | - | - | - | - | {note} |"
            )
            continue
        timed = timing or mem
        wall = _median([r["wall_s"] for r in timed])
        cpu = _median([r["cpu_s"] for r in timed])
        if name.startswith("floor"):
            growth = max((r["host_rss_peak"] - r["host_rss_start"]) / r["file_bytes"] for r in timed)
            label = "read file, plain memory" if name == "floor" else "read file, huge pages"
            rows.append(
                f"| {name} ({label}) | {wall:.2f} ({walls}) | {cpu:.2f} | {_ratio(wall, floor)} "
                f"| {_ratio(wall, floor_thp)} | - | {growth:.2f} | {timed[0]['file_bytes'] / 1e9:.2f} GB file |"
            )
            continue
        peak = max((_max_ratio(r) for r in mem), default=float("nan"))
        growth = max((r["host_rss_peak"] - r["host_rss_start"]) / r["model_bytes"] for r in timed + mem)
        programs = mem[0]["compiled_programs"] if mem else []
        note = f"{timed[0]['model_bytes'] / 1e9:.2f} GB model; {len(programs)} XLA programs compiled"
        if not timing:
            note += "; timed with the memory sampler on"
        if stopped:
            note += f"; {len(stopped)} run(s) stopped: {stopped[-1].get('reason', '')}"
        rows.append(
            f"| {name} | {wall:.2f} ({walls or 'mem run'}) | {cpu:.2f} | {_ratio(wall, floor)} "
            f"| {_ratio(wall, floor_thp)} | {peak:.2f} | {growth:.2f} | {note} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="width1")
    parser.add_argument("--workdir", default="/work/bench_tmp")
    parser.add_argument(
        "--cases",
        default=(
            "floor,floor_thp,ours,floor,floor_thp,ours,floor,floor_thp,ours,"
            "ours_mem,stock,stock_mem"
        ),
        help="cases in run order (interleaved repeats; medians are reported)",
    )
    parser.add_argument("--stock_cap_gb", type=float, default=0.0,
                        help="stop stock when its host RSS crosses this (0: no cap)")
    parser.add_argument("--num_threads", type=int, default=2, help="reader threads of ours")
    parser.add_argument("--num_layers", type=int, default=0,
                        help="override the config's decoder blocks (e.g. to project stock's "
                        "memory to the full depth from shallower runs)")
    parser.add_argument("--format", choices=("keras", "huggingface"), default="keras",
                        help="checkpoint format of the synthetic preset: KerasHub's "
                        "model.weights.h5, or Hugging Face safetensors (2 GB shards + index, "
                        "read by stock through KerasHub's converter)")
    parser.add_argument("--write_only", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the preset")
    parser.add_argument("--json", default=None, help="also write results here")
    # Internal: one case in this (fresh) process.
    parser.add_argument("--case", default=None)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    if args.case:
        run_case(args)
        return

    config = CONFIGS[args.config]
    args.dtype = config["dtype"]
    suffix = f"_L{args.num_layers}" if args.num_layers else ""
    fmt = "_hf" if args.format == "huggingface" else ""
    args.preset = os.path.join(args.workdir, f"bench_load_{args.config}{suffix}{fmt}")
    if args.config in ("full7b", "mixtral2"):
        args.stock_cap_gb = args.stock_cap_gb or 20.0
        if args.cases == parser.get_default("cases"):
            args.cases = "floor_thp,ours,floor_thp,ours_mem,stock_mem"
    os.makedirs(args.workdir, exist_ok=True)
    os.environ.update(_env())
    try:
        _write(args)
        if args.write_only:
            return
        # One unmeasured read so every case starts with the same page cache,
        # and one unmeasured case: the first large allocation after a write
        # pays for the kernel reclaiming memory, which no case should.
        with open("/proc/meminfo") as f:
            total_ram = int(f.readline().split()[1]) * 1024
        if _weights_bytes(args.preset) < total_ram // 4:
            subprocess.run(["cat", *_weights_files(args.preset)], stdout=subprocess.DEVNULL, check=True)
        print(f"warm-up: {json.dumps(_spawn(args, 'floor_thp'))[:120]}", flush=True)
        results = []
        for case in args.cases.split(","):
            result = _spawn(args, case)
            results.append((case, result))
            brief = {k: v for k, v in result.items() if not isinstance(v, dict)}
            print(f"{case}: {json.dumps(brief)}", flush=True)
        print()
        print(
            f"bench_load --config {args.config}{suffix} --format {args.format}: "
            f"{time.strftime('%Y-%m-%d %H:%M')}, "
            f"{os.cpu_count()} cores, 8 simulated CPU devices, mesh (1, 8), "
            f"dtype {args.dtype}"
        )
        print(_summarize(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"config": args.config, "results": results}, f, indent=2)
    finally:
        if not args.keep and not args.write_only and os.path.exists(args.preset):
            shutil.rmtree(args.preset)


if __name__ == "__main__":
    main()
