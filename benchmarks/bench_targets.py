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

Prints one JSON line per plan (and writes them to --out).
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


def main() -> None:
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
                                mfu=est and est.mfu, optimal_s=est and est.compiler_optimal_s,
                                flops=est and est.step.flops,
                            )
                        row["plan_s"] = round(time.perf_counter() - start, 1)
                        print(json.dumps(row), flush=True)
                        if args.out:
                            with open(args.out, "a", encoding="utf-8") as f:
                                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
