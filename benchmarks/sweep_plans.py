"""Every named architecture through `plan_memory`: the three jobs, one mesh.

For each distinct backbone config among the named architectures (names that
share one config are planned once; the first name stands for them), plans
`job="load"`, `"fit"` (Adam, full fine-tune) and `"generate"` at a reduced
depth on 8 simulated CPU devices, bf16, and prints per device XLA's
arguments, temporaries and total (MiB), the KV cache where the package lays
it out, and each plan's wall time; a plan that raises prints its error and
the sweep goes on. Exit status 1 when any plan failed.

    python benchmarks/sweep_plans.py                         # all, mesh 1x8, 2 layers
    python benchmarks/sweep_plans.py --mesh 2x4 --names gemma3_1b,qwen3_5_0.8b
    python benchmarks/sweep_plans.py --mesh 2x4 --jobs fit --vocabulary 1024  # without most of the vocabulary
    python benchmarks/sweep_plans.py --mesh 2x4 --jobs generate --dtype float32  # no bf16 upcast (XLA:CPU)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import keras_hub_dist  # noqa: E402
from keras_hub_dist.plan import presets  # noqa: E402

MIB = 2**20


def distinct_names() -> list[str]:
    """One name per distinct backbone config (depth aside), in name order."""
    seen: dict[str, str] = {}
    for name in presets.names():
        cls, config, _ = presets.backbone_config(name)
        rest = {k: v for k, v in config.items() if k != "num_layers"}
        seen.setdefault(json.dumps([cls.__name__, rest], sort_keys=True, default=str), name)
    return sorted(seen.values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", default="", help="Comma-separated names (default: every distinct config).")
    parser.add_argument("--mesh", default="1x8")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--jobs", default="load,fit,generate")
    parser.add_argument("--fit", default="8x512", help="BATCHxSEQ of the fit step.")
    parser.add_argument("--generate", default="8x1024", help="BATCHxMAX_LENGTH of generate.")
    parser.add_argument(
        "--vocabulary", type=int, default=None,
        help="A vocabulary_size for every architecture instead of its own (what the embedding tables cost).",
    )
    parser.add_argument(
        "--dtype", default="bfloat16",
        help="The models' dtype; float32 shows the programs without the f32 copies XLA:CPU makes of bf16 operands.",
    )
    args = parser.parse_args()
    mesh = tuple(int(x) for x in args.mesh.split("x"))
    names = args.names.split(",") if args.names else distinct_names()
    print(f"jax {jax.__version__}, keras_hub_dist {keras_hub_dist.__version__}, {len(names)} architectures, "
          f"mesh {args.mesh}, {args.layers} layers, {args.dtype}"
          + ("" if args.vocabulary is None else f", vocabulary {args.vocabulary}"), flush=True)
    failed = 0
    for name in names:
        for job in args.jobs.split(","):
            batch, seq = (int(x) for x in (args.fit if job == "fit" else args.generate).split("x"))
            start = time.perf_counter()
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    plan = keras_hub_dist.plan_memory(
                        name, mesh, job=job, batch_size=batch, sequence_length=seq,
                        num_layers=args.layers, dtype=args.dtype, alternatives=False,
                        overrides=None if args.vocabulary is None else {"vocabulary_size": args.vocabulary},
                    )
            except Exception as error:  # noqa: BLE001 - the sweep reports and goes on
                failed += 1
                first = str(error).splitlines()[0][:300] if str(error) else ""
                print(f"{name:<36} {job:<8} FAILED {type(error).__name__}: {first}", flush=True)
                continue
            cache = "-" if plan.kv_cache_bytes is None else f"{plan.kv_cache_bytes / MIB:,.1f}"
            print(
                f"{name:<36} {job:<8} args {plan.argument_bytes / MIB:>9,.1f}  temps {plan.temp_bytes / MIB:>9,.1f}  "
                f"total {plan.total_bytes / MIB:>9,.1f}  kv {cache:>7} MiB  {time.perf_counter() - start:5.1f} s",
                flush=True,
            )
    print(f"{failed} plan(s) failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
