"""Benchmark: `save_sharded_preset` vs stock `save_to_preset` vs writing the bytes.

Side by side in one run, each case in a fresh subprocess (so one case's memory
cannot hide another's), on 8 simulated CPU devices, mesh (1, 8):

- `floor`: write the model's byte count to a new file in the workdir from one
  reused 64 MiB buffer (sequential `os.write`), then close: the physical
  floor of any saver (time only).
- `floor_durable`: the same, then `os.fsync` before closing: the floor of a
  save that waits for the disk.
- `ours`: `model = keras_hub_dist.load_sharded_preset(preset, mesh=(1, 8))`,
  then `keras_hub_dist.save_sharded_preset(model, out_dir)`.
- `ours_durable`: the same with `durable=True` (every file and directory
  fsynced, the parent around the rename); the time spent in `os.fsync` is
  reported too.
- `stock`: the same load, then `model.save_to_preset(out_dir)` (the
  `ModelParallel` distribution the load set stays active, as it would for a
  user).

For `ours` and `stock`, around the save call only:

- wall time (and CPU time) of the call;
- host anonymous memory: `RssAnon` of /proc/self/status, read before, after,
  and every 1 ms by a thread; growth = peak - before, reported over the
  model's bytes. (On CPU the simulated devices' buffers are host anonymous
  memory too, so "before" includes the model.) The thread needs the GIL: the
  largest gap between its samples is reported, and the kernel's high-water
  mark `VmHWM` (reset before the call; all resident pages, file-backed ones
  included) is reported beside it as a cross-check;
- per-device bytes: `keras_hub_dist.MemorySampler` (live jax array bytes per
  shard, sampled every 2 ms, plus compiled programs' temps), entered before
  the call; reported as the max over devices of
  `peak_per_device[d] / start_per_device[d]`;
- the output: its files (config.json, metadata.json, and model.weights.h5 or
  model.weights.json + its shards must be there), their size and the disk
  blocks they take.

`--check` then, in the same subprocess after measuring, compares every
dataset of the saved weights byte for byte with the source preset's (the
model was loaded from it and not changed), compares a few of the model's
variables (the small ones, and one sharded one) bitwise with what was saved,
and for `ours` verifies the checksums recorded in metadata.json.

Configs (shared with bench_load.py):

- `width1` (default): Gemma-7B width, 1 decoder block, float32 (3.8 GB), the
  configuration the team measured stock at (host anonymous memory +1.66x
  the model bytes, 14 s).
- `full7b`: the full `gemma_7b_en` architecture in bfloat16 (17 GB). Stock
  would need about 28 GB on top of the loaded model, so it runs under a
  host-RSS cap (`--stock_cap_gb`, default 21 GB for this config), watched
  from the parent every 5 ms; if it crosses the cap it is stopped and
  reported as such.

The source preset is a synthetic one (random weights) written by
`keras_hub_dist.write_synthetic_preset` under `--workdir`. Outputs are
deleted (and the disk synced) after every case; everything the benchmark
created under `--workdir` is deleted at the end unless `--keep`. Timings
are medians over the repeats in `--cases`; memory ratios are maxima.

Usage (heavy: run under the machine's heavy-job lock):

    flock /tmp/khd-heavy.lock python benchmarks/bench_save.py --config width1 --workdir /tmp/bench_save
    flock /tmp/khd-heavy.lock python benchmarks/bench_save.py --config width1 --workdir /tmp/bench_save --check
    python benchmarks/bench_save.py --config full7b --workdir /tmp/bench_save --write_only --keep
    flock /tmp/khd-heavy.lock python benchmarks/bench_save.py --config full7b --workdir /tmp/bench_save --keep
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_load import (  # noqa: E402
    CONFIGS,
    RESULT_TAG,
    _cpu_seconds,
    _env,
    _median,
    _write,
    run_capped,
)

FLOOR_BUFFER_BYTES = 64 << 20
TARGETS = {"host_growth": 0.15, "device_peak": 1.05}


# --- measuring helpers (in the case's process) ----------------------------------


class _AnonSampler:
    """`RssAnon` of this process: before, after, and every `interval_s` by a
    thread (which needs the GIL, hence `max_gap_s`)."""

    def __init__(self, interval_s: float = 0.001):
        self.interval_s = interval_s
        self.before = self.after = self.peak = 0
        self.samples = 0
        self.max_gap_s = 0.0
        self._fd = os.open("/proc/self/status", os.O_RDONLY)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> int:
        os.lseek(self._fd, 0, os.SEEK_SET)
        text = os.read(self._fd, 1 << 16)
        start = text.index(b"RssAnon:")
        return int(text[start + 8:text.index(b"\n", start)].split()[0]) * 1024

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            value = self.read()
            now = time.perf_counter()
            self.max_gap_s = max(self.max_gap_s, now - last)
            last = now
            self.samples += 1
            if value > self.peak:
                self.peak = value

    def __enter__(self) -> "_AnonSampler":
        self.before = self.peak = self.read()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self.after = self.read()
        self.peak = max(self.peak, self.after)
        os.close(self._fd)


def _weights_path(preset: str) -> str | None:
    for name in ("model.weights.h5", "model.weights.json"):
        path = os.path.join(preset, name)
        if os.path.isfile(path):
            return path
    return None


def _hashed_files(weights_path: str) -> list[str]:
    """The files whose checksums `save_sharded_preset` records."""
    from keras_hub_dist.formats import keras_h5

    shards = list(keras_h5.weights_files(weights_path))
    return shards if weights_path.endswith(".h5") else [weights_path, *shards]


def _output_report(out: str) -> dict:
    files = sorted(os.listdir(out)) if os.path.isdir(out) else []
    stats = [os.stat(os.path.join(out, f)) for f in files]
    missing = [f for f in ("config.json", "metadata.json") if f not in files]
    weights = _weights_path(out)
    if weights is None:
        missing.append("model.weights.h5 (or model.weights.json)")
    else:
        try:
            _hashed_files(weights)
        except Exception as e:  # noqa: BLE001 - a listed shard is missing
            missing.append(f"a shard of {os.path.basename(weights)}: {e}")
    return {
        "out_files": files,
        "out_bytes": sum(s.st_size for s in stats),
        "out_disk_bytes": sum(s.st_blocks * 512 for s in stats),
        "out_missing": missing,
    }


def _read_dataset(info, start: int, stop: int) -> bytes:
    """Bytes `start:stop` of one dataset's (uncompressed) data."""
    if info.offset is not None:
        with open(info.file, "rb", buffering=0) as f:
            return os.pread(f.fileno(), stop - start, info.offset + start)
    import h5py

    with h5py.File(info.file, "r") as h5:
        return h5[info.name][()].tobytes()[start:stop]


def _check(args, model, out: str, which: str) -> dict:
    """Bitwise checks of the saved weights (see the module docstring)."""
    import numpy as np

    from keras_hub_dist.formats import checksums, keras_h5

    start = time.perf_counter()
    problems: list[str] = []
    source = keras_h5.read_datasets(keras_h5.weights_files(_weights_path(args.preset)))
    saved = keras_h5.read_datasets(keras_h5.weights_files(_weights_path(out)))
    if sorted(source) != sorted(saved):
        problems.append(
            f"dataset names differ: only in source {sorted(set(source) - set(saved))[:5]}, "
            f"only in output {sorted(set(saved) - set(source))[:5]}"
        )
    compared = 0
    for name in sorted(set(source) & set(saved)):
        a, b = source[name], saved[name]
        if (a.shape, a.nbytes, str(a.dtype)) != (b.shape, b.nbytes, str(b.dtype)):
            problems.append(f"{name}: {a.shape} {a.dtype} in source, {b.shape} {b.dtype} saved")
            continue
        for lo in range(0, a.nbytes, 64 << 20):
            hi = min(lo + (64 << 20), a.nbytes)
            if _read_dataset(a, lo, hi) != _read_dataset(b, lo, hi):
                problems.append(f"{name}: bytes {lo}:{hi} differ from the source")
                break
        compared += a.nbytes
    # A few variables of the model itself, bitwise against what was saved:
    # every one up to 64 MiB, and the smallest sharded one.
    variables = keras_h5.expected_datasets(model)
    small = [n for n, v in variables.items() if v.value.nbytes <= 64 << 20]
    sharded = sorted(
        (v.value.nbytes, n) for n, v in variables.items()
        if not v.value.sharding.is_fully_replicated
    )
    picked = small + ([sharded[0][1]] if sharded else [])
    for name in picked:
        value = np.asarray(variables[name].value)
        if name not in saved:
            problems.append(f"variable {variables[name].path}: no dataset {name!r} saved")
        elif value.tobytes() != _read_dataset(saved[name], 0, saved[name].nbytes):
            problems.append(f"variable {variables[name].path}: saved bytes differ from the model")
    verified = None
    if which.startswith("ours"):
        with open(os.path.join(out, "metadata.json")) as f:
            metadata = json.load(f)
        try:
            checksums.verify_files(_hashed_files(_weights_path(out)), metadata, out)
            verified = True
        except Exception as e:  # noqa: BLE001 - reported
            verified = False
            problems.append(f"checksums: {type(e).__name__}: {e}")
    return {
        "check_ok": not problems,
        "check_problems": problems[:10],
        "check_datasets_bytes": compared,
        "check_variables": len(picked),
        "check_checksums_verified": verified,
        "check_s": time.perf_counter() - start,
    }


# --- cases (run in a fresh subprocess) -----------------------------------------------


def _case_floor(args, durable: bool = False) -> dict:
    buffer = memoryview(os.urandom(FLOOR_BUFFER_BYTES))
    cpu0 = _cpu_seconds()
    start = time.perf_counter()
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    done = 0
    while done < args.nbytes:
        done += os.write(fd, buffer[: min(len(buffer), args.nbytes - done)])
    if durable:
        os.fsync(fd)
    os.close(fd)
    wall = time.perf_counter() - start
    return {
        "wall_s": wall,
        "cpu_s": _cpu_seconds() - cpu0,
        "model_bytes": args.nbytes,
        "out_bytes": os.path.getsize(args.out),
    }


def _case_save(args, which: str) -> dict:
    import gc

    import jax

    import keras_hub_dist

    load_start = time.perf_counter()
    model = keras_hub_dist.load_sharded_preset(args.preset, mesh=(1, 8), progress=False)
    arrays = [v.value for v in model.weights]
    jax.block_until_ready(arrays)
    model_bytes = sum(a.nbytes for a in arrays)
    del arrays
    load_s = time.perf_counter() - load_start
    if os.path.exists(args.out):
        shutil.rmtree(args.out)
    gc.collect()

    fsyncs = {"s": 0.0, "calls": 0}
    if which == "ours_durable":  # how long the save waits for the disk
        real_fsync = os.fsync

        def timed_fsync(fd):
            start = time.perf_counter()
            try:
                return real_fsync(fd)
            finally:
                fsyncs["s"] += time.perf_counter() - start
                fsyncs["calls"] += 1

        os.fsync = timed_fsync
    sampler = keras_hub_dist.MemorySampler(interval_s=0.002)
    with _AnonSampler(interval_s=0.001) as anon:
        with sampler:
            cpu0 = _cpu_seconds()
            start = time.perf_counter()
            if which.startswith("ours"):
                keras_hub_dist.save_sharded_preset(
                    model, args.out, progress=False, num_threads=args.num_threads,
                    durable=which == "ours_durable",
                )
            else:
                model.save_to_preset(args.out)
            wall = time.perf_counter() - start
            cpu = _cpu_seconds() - cpu0
            sampler.sample()
    device_ratios = {
        str(d): sampler.peak_per_device[d] / before
        for d, before in sampler.start_per_device.items()
        if before > 0
    }
    result = {
        "wall_s": wall,
        "cpu_s": cpu,
        "load_s": load_s,
        "model_bytes": model_bytes,
        "anon_before": anon.before,
        "anon_peak": anon.peak,
        "anon_after": anon.after,
        "anon_samples": anon.samples,
        "anon_max_gap_s": anon.max_gap_s,
        "host_growth": (anon.peak - anon.before) / model_bytes,
        "hwm_growth": (sampler.host_peak_rss - sampler.host_start_rss) / model_bytes,
        "hwm_reset": sampler.host_peak_reset,
        "device_start_per_device": {str(d): b for d, b in sampler.start_per_device.items()},
        "device_peak_per_device": {str(d): b for d, b in sampler.peak_per_device.items()},
        "device_ratio_per_device": device_ratios,
        "device_peak": max(device_ratios.values()) if device_ratios else float("nan"),
        "compiled_programs": [c["name"] for c in sampler.compiled],
        "fsync_s": fsyncs["s"],
        "fsync_calls": fsyncs["calls"],
        **_output_report(args.out),
    }
    if args.check:
        result.update(_check(args, model, args.out, which))
    return result


def run_case(args) -> None:
    if args.case.startswith("floor"):
        result = _case_floor(args, durable=args.case == "floor_durable")
    else:
        result = _case_save(args, args.case)
    sys.stdout.write(RESULT_TAG + json.dumps(result) + "\n")
    sys.stdout.flush()
    # Skip interpreter teardown of 8 simulated devices' worth of arrays.
    os._exit(0)


# --- orchestration -------------------------------------------------------------------


def _spawn(args, case: str, out: str) -> dict:
    """Runs one case in a fresh process; stock under the host-RSS cap."""
    command = [
        sys.executable, os.path.abspath(__file__), "--case", case, "--config", args.config,
        "--preset", args.preset, "--out", out, "--nbytes", str(args.nbytes),
        "--num_threads", str(args.num_threads),
    ] + (["--check"] if args.check else [])
    cap = int(args.stock_cap_gb * 1e9) if case == "stock" and args.stock_cap_gb else 0
    return run_capped(command, cap)


def _remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)
    # A save stopped half-way leaves its staging directory (and its owner
    # record) beside the target.
    parent, base = os.path.split(path)
    for partial in glob.glob(os.path.join(parent, f".{base}.partial-*")):
        shutil.rmtree(partial, ignore_errors=True)
    for record in glob.glob(os.path.join(parent, f".{base}.owner-*.json")):
        os.remove(record)


def _model_bytes(preset: str) -> int:
    from keras_hub_dist.formats import keras_h5

    datasets = keras_h5.read_datasets(keras_h5.weights_files(_weights_path(preset)))
    return sum(info.nbytes for info in datasets.values())


def _ratio(a: float, b: float) -> str:
    return "-" if a != a or b != b or not b else f"{a / b:.2f}"


def _summarize(results: list[tuple[str, dict]]) -> tuple[str, list[str]]:
    by_case: dict[str, list[dict]] = {}
    for name, r in results:
        by_case.setdefault(name, []).append(r)

    def good(name):
        return [r for r in by_case.get(name, []) if not (r.get("failed") or r.get("killed"))]

    def wall(name):
        return _median([r["wall_s"] for r in good(name)])

    stock, floor, ours_wall = wall("stock"), wall("floor"), wall("ours")
    rows = [
        "| case | time s (median; all) | time / stock | time / floor "
        "| host anon growth / model bytes (max) | device peak / before (max) | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ("ours", "ours_durable", "stock", "floor", "floor_durable"):
        runs = by_case.get(name, [])
        if not runs:
            rows.append(f"| {name} | not run | - | - | - | - | - |")
            continue
        ok = good(name)
        stopped = [r for r in runs if r.get("failed") or r.get("killed")]
        if not ok:
            r = stopped[-1]
            note = r.get("reason") or f"exit {r.get('returncode')}: {r.get('stderr_tail', '')[-300:]!r}"
            rows.append(f"| {name} | stopped after {r['wall_s']:.1f} s | - | - | - | - | {note} |")
            continue
        walls = "; ".join(f"{r['wall_s']:.2f}" for r in ok)
        cpu = _median([r["cpu_s"] for r in ok])
        if name.startswith("floor"):
            label = "sequential write, 64 MiB buffer" + (", fsync" if name == "floor_durable" else "")
            rows.append(
                f"| {name} ({label}) | {wall(name):.2f} ({walls}) "
                f"| {_ratio(wall(name), stock)} | {_ratio(wall(name), floor)} | - | - "
                f"| {ok[0]['out_bytes'] / 1e9:.2f} GB written; CPU {cpu:.2f} s |"
            )
            continue
        growth = max(r["host_growth"] for r in ok)
        device = max(r["device_peak"] for r in ok)
        hwm = max(r["hwm_growth"] for r in ok)
        gap = max(r["anon_max_gap_s"] for r in ok) * 1e3
        last = ok[-1]
        notes = [
            f"{last['model_bytes'] / 1e9:.2f} GB model",
            f"CPU {cpu:.2f} s",
            f"VmHWM growth / model {hwm:.2f}",
            f"RssAnon sampler max gap {gap:.0f} ms",
            f"output {last['out_bytes'] / 1e9:.2f} GB ({last['out_disk_bytes'] / 1e9:.2f} GB on disk): "
            + ", ".join(last["out_files"]),
        ]
        if any(r["out_missing"] for r in ok):
            notes.append(f"MISSING {last['out_missing']}")
        if name == "ours_durable":
            fsync_s = "; ".join(f"{r['fsync_s']:.2f}" for r in ok)
            notes.insert(0, f"time / ours {_ratio(wall(name), ours_wall)}, time / floor_durable "
                         f"{_ratio(wall(name), wall('floor_durable'))}; in fsync {fsync_s} s "
                         f"({last['fsync_calls']} calls)")
        if last["compiled_programs"]:
            notes.append(f"{len(last['compiled_programs'])} XLA programs compiled")
        if "check_ok" in last:
            bad = [p for r in ok for p in r["check_problems"]]
            notes.append(
                "--check OK" if all(r["check_ok"] for r in ok) else f"--check FAILED: {bad[:3]}"
            )
        if stopped:
            notes.append(f"{len(stopped)} run(s) stopped: {stopped[-1].get('reason', '')}")
        rows.append(
            f"| {name} | {wall(name):.2f} ({walls}) | {_ratio(wall(name), stock)} "
            f"| {_ratio(wall(name), floor)} | {growth:.3f} | {device:.3f} | {'; '.join(notes)} |"
        )

    targets = []
    ours = good("ours")
    if ours:
        growth = max(r["host_growth"] for r in ours)
        device = max(r["device_peak"] for r in ours)
        ok_out = all(not r["out_missing"] for r in ours)
        targets.append(
            f"host anon growth <= {TARGETS['host_growth']} x model bytes: {growth:.3f} -> "
            + ("PASS" if growth <= TARGETS["host_growth"] else "FAIL")
        )
        targets.append(
            f"device peak <= {TARGETS['device_peak']} x bytes before saving: {device:.3f} -> "
            + ("PASS" if device <= TARGETS["device_peak"] else "FAIL")
        )
        if stock == stock:
            targets.append(
                f"time <= stock: {wall('ours'):.2f} s vs {stock:.2f} s -> "
                + ("PASS" if wall("ours") <= stock else "FAIL")
            )
        else:
            targets.append("time <= stock: n/a (stock did not complete)")
        if not ok_out:
            targets.append("output files: FAIL (some missing, see the table)")
    else:
        targets.append("ours did not complete: no targets checked")
    return "\n".join(rows), targets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="width1")
    parser.add_argument("--workdir", default="/tmp/bench_save")
    parser.add_argument(
        "--cases",
        default="floor,floor_durable,ours,ours_durable,stock,floor,floor_durable,ours,ours_durable,stock",
        help="cases in run order (repeats: times are medians, memory ratios maxima)",
    )
    parser.add_argument("--stock_cap_gb", type=float, default=0.0,
                        help="stop stock when its host RSS crosses this (0: no cap; "
                        "full7b: 21 by default)")
    parser.add_argument("--num_threads", type=int, default=2,
                        help="hashing threads of save_sharded_preset")
    parser.add_argument("--num_layers", type=int, default=0,
                        help="override the config's decoder blocks")
    parser.add_argument("--check", action="store_true",
                        help="after measuring, compare the saved weights bitwise (and "
                        "verify ours' checksums)")
    parser.add_argument("--write_only", action="store_true", help="only write the source preset")
    parser.add_argument("--keep", action="store_true",
                        help="keep the source preset and the last outputs")
    parser.add_argument("--json", default=None, help="also write results here")
    # Internal: one case in this (fresh) process.
    parser.add_argument("--case", default=None)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--nbytes", type=int, default=0)
    args = parser.parse_args()
    if args.case:
        run_case(args)
        return

    config = CONFIGS[args.config]
    suffix = f"_L{args.num_layers}" if args.num_layers else ""
    args.format = "keras"  # for bench_load._write
    args.workdir = os.path.abspath(args.workdir)
    args.preset = os.path.join(args.workdir, f"bench_save_{args.config}{suffix}_source")
    outputs = {
        "floor": os.path.join(args.workdir, "bench_save_floor.bin"),
        "floor_durable": os.path.join(args.workdir, "bench_save_floor_durable.bin"),
        "ours": os.path.join(args.workdir, "bench_save_ours"),
        "ours_durable": os.path.join(args.workdir, "bench_save_ours_durable"),
        "stock": os.path.join(args.workdir, "bench_save_stock"),
    }
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(outputs))
    if unknown:
        parser.error(f"unknown cases {unknown}; expected some of {sorted(outputs)}")
    if args.config == "full7b" and not args.stock_cap_gb:
        args.stock_cap_gb = 21.0
    created_workdir = not os.path.isdir(args.workdir)
    os.makedirs(args.workdir, exist_ok=True)
    os.environ.update(_env())
    try:
        _write(args)
        if args.write_only:
            return
        args.nbytes = _model_bytes(args.preset)
        # One unmeasured read so every case's load starts from the page cache
        # when it fits, and one unmeasured floor: the first large write after
        # the preset's pays for the kernel reclaiming memory.
        with open("/proc/meminfo") as f:
            total_ram = int(f.readline().split()[1]) * 1024
        if args.nbytes < total_ram // 4:
            subprocess.run(["cat", *_hashed_files(_weights_path(args.preset))],
                           stdout=subprocess.DEVNULL, check=True)
        warm = _spawn(args, "floor", outputs["floor"])
        print(f"warm-up floor: {json.dumps(warm)[:120]}", flush=True)
        _remove(outputs["floor"])
        os.sync()
        results = []
        for case in cases:
            _remove(outputs[case])
            result = _spawn(args, case, outputs[case])
            results.append((case, result))
            brief = {k: v for k, v in result.items() if not isinstance(v, (dict, list))}
            print(f"{case}: {json.dumps(brief)}", flush=True)
            if result.get("check_problems"):
                print(f"  check problems: {result['check_problems']}", flush=True)
            if not (args.keep and not case.startswith("floor")):
                _remove(outputs[case])
            os.sync()  # the next case starts with no dirty pages of this one
        print()
        print(
            f"bench_save --config {args.config}{suffix}: {time.strftime('%Y-%m-%d %H:%M')}, "
            f"{os.cpu_count()} cores, {total_ram / 2**30:.0f} GiB RAM, 8 simulated CPU devices, "
            f"mesh (1, 8), dtype {config['dtype']}, {args.nbytes / 1e9:.2f} GB of weights"
        )
        table, targets = _summarize(results)
        print(table)
        print()
        print("Targets for ours:")
        for line in targets:
            print(f"  {line}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"config": args.config, "results": results}, f, indent=2)
    finally:
        if not args.keep:
            for path in outputs.values():
                _remove(path)
            if not args.write_only:
                _remove(args.preset)
            if created_workdir and not os.listdir(args.workdir):
                os.rmdir(args.workdir)


if __name__ == "__main__":
    main()
