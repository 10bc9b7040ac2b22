"""Benchmark: pre-quantized Hugging Face checkpoints vs the bf16 checkpoint.

Side by side in one run, each case in a fresh subprocess, on 8 simulated CPU
devices, mesh (1, 8), every model in bfloat16, from checkpoints written by
`keras_hub_dist.write_synthetic_hf_checkpoint` at Llama-3-8B width (hidden
4096, MLP 14336, 32 query / 8 KV heads, vocabulary 128256, untied lm_head;
`--num_layers` of its 32 blocks, default 2):

- `bf16`: the bfloat16 checkpoint, `load_sharded_preset(path, mesh=(1, 8),
  dtype="bfloat16")`, the time and bytes to compare with;
- `fp8_block`: the same model written as compressed-tensors FP8_BLOCK (e4m3
  projections, 128 x 128 float32 scales; embeddings, norms and lm_head in
  bfloat16 as llmcompressor leaves them), dequantized per block on the host
  into bfloat16 (the same device bytes, fewer file bytes read);
- `fp8_block_int8`: the same with `quantize="int8"` (Keras int8);
- `w4a16`: compressed-tensors W4A16 (int4 in groups of 128, bfloat16
  scales), into Keras's int4 layers, 4 bits a weight on the device.

Timing runs have no memory sampler; `<case>_mem` runs sample per-device live
bytes every 2 ms and host RSS. Printed per case: the file bytes, the bytes
the load read, wall time and CPU seconds (medians; and over bf16's: on a
shared machine the CPU seconds are the steadier figure), the final per-device bytes (and
over bf16's), per-device peak / final, host RSS growth over the file's bytes
(one process reads the whole file: its share is all of it), and, since the
simulated devices' memory is host memory, the host's growth beyond the
loaded model over the bytes read.

Usage (heavy: run under the machine's heavy-job lock):

    flock /tmp/khd-heavy.lock python benchmarks/bench_prequantized.py --keep
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
import bench_load  # noqa: E402 - the shared case runner and env

CASES = ("bf16", "fp8_block", "fp8_block_int8", "w4a16")
_CHECKPOINT = {"bf16": None, "fp8_block": "fp8_block", "fp8_block_int8": "fp8_block", "w4a16": "w4a16"}


def _case(args) -> dict:
    import jax
    import keras

    import keras_hub_dist
    from keras_hub_dist.measure import memory

    which = args.case.removesuffix("_mem")
    mesh = keras.distribution.DeviceMesh((1, 8), ("batch", "model"), jax.devices())
    gc.collect()
    sampler = memory.MemorySampler(interval_s=0.002) if args.case.endswith("_mem") else None
    memory.reset_host_peak_rss()
    rss0 = memory.current_rss_bytes()
    with sampler if sampler is not None else contextlib.nullcontext():
        cpu0 = bench_load._cpu_seconds()
        start = time.perf_counter()
        model, report = keras_hub_dist.load_sharded_preset(
            args.preset, mesh=mesh, dtype="bfloat16", progress=False, memory_report=True,
            quantize="int8" if which.endswith("_int8") else None,
        )
        arrays = [v.value for v in model.weights]
        jax.block_until_ready(arrays)
        bench_load._touch_arrays(arrays)
        wall = time.perf_counter() - start
        cpu = bench_load._cpu_seconds() - cpu0
        if sampler is not None:
            sampler.sample()
    modes = sorted({str(getattr(layer, "quantization_mode", None)) for layer in model._flatten_layers()
                    if getattr(layer, "quantization_mode", None)})
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "modes": modes,
        "read_bytes": report.bytes_read,
        **bench_load.loaded_memory(arrays, args.preset, rss0, sampler),
    }


def _write(path: str, quantization: str | None, num_layers: int) -> None:
    import keras_hub_dist

    if os.path.isdir(path) and bench_load._weights_files(path):
        print(f"reusing {path}")
        return
    entry = keras_hub_dist.presets.resolve("llama3_8b_en")
    config = {**entry.config_json()["config"], "num_layers": num_layers}
    start = time.perf_counter()
    keras_hub_dist.write_synthetic_hf_checkpoint(
        path, entry.backbone_class, config, dtype="bfloat16", shard_bytes=2 * 10**9,
        overwrite=True, progress=sys.stderr.isatty(), quantization=quantization,
    )
    print(f"wrote {path}: {bench_load._weights_bytes(path) / 1e9:.2f} GB in {time.perf_counter() - start:.1f} s")


def _row(name: str, timed: list[dict], mem: list[dict], base: dict | None) -> str:
    good = [r for r in timed if "wall_s" in r and not r.get("failed")]
    if not good:
        reason = (timed or [{}])[0].get("reason", "no run")
        return f"| {name} | - | - | - | - | - | - | - | - | FAILED: {reason} |"
    wall = bench_load._median([r["wall_s"] for r in good])
    cpu = bench_load._median([r["cpu_s"] for r in good])
    weights = max(good[0]["weights_per_device"].values())
    over = cpu_over = ""
    if base is not None:
        over = f" ({wall / base['wall_s']:.2f}x)"
        cpu_over = f" ({cpu / base['cpu_s']:.2f}x)"
        device_over = f" ({weights / max(base['weights_per_device'].values()):.3f}x)"
    else:
        device_over = ""
    peak = "-"
    if mem and "peak_per_device" in mem[0]:
        m = mem[0]
        peak = f"{max(m['peak_per_device'][d] / f for d, f in m['final_per_device'].items() if f):.3f}"
    growth = max((r["host_rss_peak"] - r["host_rss_start"]) / r["file_bytes"] for r in good)
    # The simulated devices' memory is host memory: what the host held
    # beyond the loaded model, over the bytes this process read.
    beyond = max((r["host_rss_peak"] - r["host_rss_start"] - r["model_bytes"]) / r["read_bytes"] for r in good)
    read = good[0].get("read_bytes")
    return (
        f"| {name} ({', '.join(good[0]['modes']) or 'float'}) | {good[0]['file_bytes'] / 1e9:.2f} GB | "
        f"{'-' if read is None else f'{read / 1e9:.2f} GB'} | {wall:.1f}{over} | {cpu:.1f}{cpu_over} | "
        f"{weights / 2**20:.0f} MiB{device_over} | {peak} | {growth:.2f} | {beyond:.2f} | ok |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default=None)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--workdir", default="/work/bench_tmp")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num_layers", type=int, default=2)
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--cases", default=",".join(CASES), help="Comma-separated subset of the cases.")
    args = parser.parse_args()
    if args.case:
        result = _case(args)
        sys.stdout.write(bench_load.RESULT_TAG + json.dumps(result) + "\n")
        sys.stdout.flush()
        os._exit(0)
    cases = [c for c in CASES if c in args.cases.split(",")]
    paths = {}
    for case in cases:
        kind = _CHECKPOINT[case]
        paths[case] = os.path.join(args.workdir, f"bench_prequantized_{kind or 'bf16'}_L{args.num_layers}")
        _write(paths[case], kind, args.num_layers)
    results: dict[str, list[dict]] = {}
    try:
        for repeat in range(args.repeats):
            for case in cases:
                for name in (case, case + "_mem") if repeat == 0 else (case,):
                    command = [sys.executable, os.path.abspath(__file__), "--case", name, "--preset", paths[case]]
                    r = bench_load.run_capped(command, 0)
                    results.setdefault(name, []).append(r)
                    print(name, json.dumps({k: v for k, v in r.items() if k in ("wall_s", "error", "reason")}), flush=True)
    finally:
        if not args.keep:
            for path in set(paths.values()):
                shutil.rmtree(path, ignore_errors=True)
    base_runs = [r for r in results.get("bf16", []) if "wall_s" in r and not r.get("failed")]
    base = dict(
        base_runs[0],
        wall_s=bench_load._median([r["wall_s"] for r in base_runs]),
        cpu_s=bench_load._median([r["cpu_s"] for r in base_runs]),
    ) if base_runs else None
    print("\n| case | file | read | wall s (vs bf16) | CPU s (vs bf16) | final per device (vs bf16) "
          "| per-device peak / final | host RSS growth / file bytes | host growth beyond the model / bytes read | result |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        print(_row(case, results.get(case, []), results.get(case + "_mem", []), base))


if __name__ == "__main__":
    main()
