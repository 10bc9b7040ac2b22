"""Benchmark: a LoRA fine-tune saved as a PEFT adapter vs as the merged full
Hugging Face export, and the adapter loaded into the shards.

On 8 simulated CPU devices, mesh (1, 8), the Gemma-7B-width probe (vocab
256000, hidden 3072, 16 heads of 256, intermediate 24576) with `--num_layers`
decoder blocks (default 1), float32, written as a Hugging Face checkpoint by
`write_synthetic_hf_checkpoint`. The fine-tune is `keras_hub_dist.enable_lora`
(rank `--rank`, lora_alpha 2 x rank) on all seven projections, its factors
random (the same in every case: one seed, in model order).

Each case runs in a fresh process (one case's memory cannot hide another's)
and times only its call:

- `save_adapter`: `save_lora_adapter(model, dir)`;
- `save_merged`: `save_sharded_preset(model, dir, format="huggingface")`
  (Keras merges the factors into the kernels as it saves);
- `load_base`: `load_sharded_preset(base)` (the base alone, for reference);
- `load_adapter`: `load_sharded_preset(base, lora_adapter=adapter)`;
- `load_adapter_merged`: the same with `merge=True`;
- `load_merged`: `load_sharded_preset(merged_export)`.

Loads run with `memory_report=True`: per-device peak / final is the most a
device held during the load over what it holds at the end (live arrays and
compiled programs' temps, `MemorySampler`). Sizes are the directories' bytes.

Usage (heavy: run under the machine's heavy-job lock):

    flock /tmp/khd-heavy.lock python benchmarks/bench_lora_adapter.py --workdir /tmp/bench_lora
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_load import _env, _median  # noqa: E402

RESULT_TAG = "RESULT "
CASES = ("save_adapter", "save_merged", "load_base", "load_adapter", "load_adapter_merged", "load_merged")


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder))


def _prepare(args) -> str:
    import keras_hub

    import keras_hub_dist

    base = os.path.join(args.workdir, "base_hf")
    if not os.path.exists(os.path.join(base, "config.json")):
        config = dict(keras_hub_dist.presets.resolve("gemma_7b_en").config, num_layers=args.num_layers)
        keras_hub_dist.write_synthetic_hf_checkpoint(base, keras_hub.models.GemmaBackbone, config, dtype="float32")
    return base


def _tuned(args, base):
    import numpy as np

    import keras_hub_dist

    backbone = keras_hub_dist.load_sharded_preset(base, mesh=(1, 8), progress=False)
    keras_hub_dist.enable_lora(backbone, rank=args.rank, lora_alpha=2 * args.rank)
    rng = np.random.default_rng(0)
    for v in backbone.weights:
        if "lora_kernel" in v.path:
            v.assign(rng.normal(scale=0.01, size=v.shape).astype("float32"))
    return backbone


def _case(args) -> dict:
    import jax

    import keras_hub_dist

    base = os.path.join(args.workdir, "base_hf")
    adapter, merged = os.path.join(args.workdir, "adapter"), os.path.join(args.workdir, "merged_hf")
    result: dict = {"case": args.case}
    if args.case.startswith("save"):
        model = _tuned(args, base)
        target = adapter if args.case == "save_adapter" else merged
        shutil.rmtree(target, ignore_errors=True)
        start = time.perf_counter()
        if args.case == "save_adapter":
            keras_hub_dist.save_lora_adapter(model, target, progress=False)
        else:
            keras_hub_dist.save_sharded_preset(model, target, format="huggingface", progress=False)
        result.update(wall_s=time.perf_counter() - start, bytes=_size(target))
        return result
    kwargs = {
        "load_base": dict(preset=base),
        "load_adapter": dict(preset=base, lora_adapter=adapter),
        "load_adapter_merged": dict(preset=base, lora_adapter=adapter, merge=True),
        "load_merged": dict(preset=merged),
    }[args.case]
    preset = kwargs.pop("preset")
    start = time.perf_counter()
    model, report = keras_hub_dist.load_sharded_preset(preset, mesh=(1, 8), progress=False, memory_report=True, **kwargs)
    jax.block_until_ready([v.value for v in model.weights])
    ratios = [report.peak_per_device[d] / report.final_per_device[d] for d in report.final_per_device]
    result.update(
        wall_s=time.perf_counter() - start,
        peak_over_final_max=max(ratios),
        peak_over_final_min=min(ratios),
        model_bytes=report.model_bytes,
        bytes_read=report.bytes_read,
        lora_variables=sum("lora_kernel" in v.path for v in model.weights),
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/tmp/bench_lora")
    parser.add_argument("--num_layers", type=int, default=1)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--case", choices=("prepare",) + CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    if args.case == "prepare":
        _prepare(args)
        return
    if args.case:
        print(RESULT_TAG + json.dumps(_case(args)), flush=True)
        return
    command = [sys.executable, os.path.abspath(__file__), "--workdir", args.workdir,
               "--num_layers", str(args.num_layers), "--rank", str(args.rank)]
    subprocess.run(command + ["--case", "prepare"], env=_env(), check=True)
    results: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for case in CASES:
            out = subprocess.run(command + ["--case", case], env=_env(), capture_output=True, text=True)
            lines = [l for l in out.stdout.splitlines() if l.startswith(RESULT_TAG)]
            if out.returncode or not lines:
                sys.exit(f"case {case} failed:\n{out.stderr[-3000:]}")
            results.setdefault(case, []).append(json.loads(lines[-1][len(RESULT_TAG):]))
    print(f"{'case':<22}{'wall s (median)':>16}{'bytes':>16}{'peak/final max':>16}")
    for case, runs in results.items():
        wall = _median([r["wall_s"] for r in runs])
        size = runs[0].get("bytes", runs[0].get("bytes_read", 0))
        ratio = runs[0].get("peak_over_final_max")
        print(f"{case:<22}{wall:>16.2f}{size:>16,}{'' if ratio is None else f'{ratio:.3f}':>16}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
