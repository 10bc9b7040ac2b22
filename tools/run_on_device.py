"""On a machine with an accelerator: run the planned job for real and print plan vs measured.

Plans the job (`plan_memory`, on this machine's own compiler, or with
`--target` the deviceless compile of a target) and then runs it: a
synthetic preset of the architecture (random weights, `--num_layers`
layers, written to a temporary directory), loaded sharded as a causal LM on
the mesh, then `--steps` fit steps or generate calls. Prints the plan's
per-device total and estimated step time beside the measured peak of
`device.memory_stats()` (the most loaded device) and the median step
time after the first (compiling) step. Sized to finish in under 10 minutes
on one host (2 layers by default).

```
python tools/run_on_device.py --preset gemma_7b_en --mesh 1x8 --job fit --lora 8 --batch 8 --seq 2048
python tools/run_on_device.py --preset llama3_8b_en --job generate --batch 8 --seq 8192 --target v5e-8
python tools/run_on_device.py --preset gemma_7b_en --plan-only   # the plan half only (any host)
```
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--preset", default="gemma_7b_en", help="A named architecture.")
    add("--mesh", default=None, help="BATCHxMODEL, e.g. 1x8. Default: 1 x all devices.")
    add("--job", default="fit", choices=("fit", "generate"))
    add("--batch", type=int, default=8)
    add("--seq", type=int, default=2048, help="Sequence length (generate: max_length).")
    add("--lora", type=int, default=None, metavar="RANK")
    add("--remat", default=None)
    add("--dtype", default="bfloat16")
    add("--num_layers", "--num-layers", type=int, default=2, help="Layers of the synthetic model (0: full depth).")
    add("--override", action="append", default=[], metavar="KEY=JSON", help="Backbone config override; repeatable.")
    add("--steps", type=int, default=3, help="Steps run (the first compiles and is not timed).")
    add("--target", default=None, help="Plan with this target's deviceless compiler (e.g. v5e-8) instead.")
    add("--stock", action="store_true", help="Plan and run stock KerasHub's layout / generate.")
    add("--plan-only", action="store_true", help="Only the plan half (runs on any host).")
    add("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    if args.steps < 2 and not args.plan_only:
        parser.error(f"Expected --steps >= 2 (the first compiles). Received: --steps {args.steps}.")
    args.overrides = {}
    for item in args.override:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"Expected --override KEY=JSON. Received: --override {item}.")
        args.overrides[key] = json.loads(value)
    if args.num_layers:
        args.overrides["num_layers"] = args.num_layers
    return args


def _mesh(args: argparse.Namespace, devices: int) -> tuple[int, int]:
    if args.mesh is None:
        return (1, devices)
    batch, model = (int(p) for p in args.mesh.lower().split("x"))
    return batch, model


def plan_half(args: argparse.Namespace) -> object:
    """The plan of the job this script runs."""
    import jax

    import keras_hub_dist
    from keras_hub_dist.jobs import targets

    mesh = _mesh(args, jax.device_count() if args.target is None else targets.get_target(args.target).devices)
    kwargs = dict(job=args.job, batch_size=args.batch, sequence_length=args.seq, dtype=args.dtype,
                  overrides=args.overrides, stock=args.stock, alternatives=False, target=args.target)
    if args.job == "fit":
        kwargs.update(lora_rank=args.lora, remat=args.remat)
    return keras_hub_dist.plan_memory(args.preset, mesh, **kwargs)


def run_half(args: argparse.Namespace) -> dict:
    """Runs the job for real; the peak device memory and step times."""
    import jax
    import numpy as np

    import keras_hub_dist

    cls, config, _ = keras_hub_dist.presets.backbone_config(args.preset, dtype=args.dtype, **args.overrides)
    mesh = _mesh(args, jax.device_count())
    with tempfile.TemporaryDirectory() as tmp:
        path = keras_hub_dist.write_synthetic_preset(os.path.join(tmp, "preset"), cls, tokenizer=True, **config)
        load = dict(mesh=mesh, task="causal_lm", remat=args.remat) if args.job == "fit" else dict(mesh=mesh, task="causal_lm")
        lm = keras_hub_dist.load_sharded_preset(path, **load)
    lm.preprocessor = None
    tokens = np.ones((args.batch, args.seq), "int32")
    mask = np.ones((args.batch, args.seq), bool)
    times = []
    if args.job == "fit":
        import keras

        if args.lora:
            keras_hub_dist.enable_lora(lm, rank=args.lora)
        lm.compile(optimizer=keras.optimizers.Adam(1e-4))
        for _ in range(args.steps):
            start = time.perf_counter()
            lm.fit({"token_ids": tokens, "padding_mask": mask}, tokens, sample_weight=mask,
                   batch_size=args.batch, verbose=0)
            jax.effects_barrier()
            times.append(time.perf_counter() - start)
    else:
        prompt = {"token_ids": tokens, "padding_mask": np.zeros_like(mask)}
        prompt["padding_mask"][:, : args.seq // 2] = True
        for _ in range(args.steps):
            start = time.perf_counter()
            lm.generate(prompt, max_length=args.seq)
            times.append(time.perf_counter() - start)
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    return dict(device=jax.devices()[0].device_kind, peak_bytes=max((p for p in peaks if p), default=None),
                step_s=statistics.median(times[1:]), first_step_s=times[0])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_half(args)
    print(plan.summary())
    report = {"plan_total_bytes": plan.total_bytes, "plan_compiler": plan.compiler,
              "plan_step_overlapped_s": plan.step_time.step.overlapped_s if plan.step_time else None}
    if not args.plan_only:
        measured = run_half(args)
        report.update(measured)
        peak = measured["peak_bytes"]
        print(f"measured on {measured['device']}: peak {peak / 2**20:,.1f} MiB per device (plan "
              f"{plan.total_bytes / 2**20:,.1f} MiB)" if peak else "measured: the device reports no memory_stats()")
        print(f"measured step {measured['step_s'] * 1e3:,.1f} ms (median after the first, "
              f"{measured['first_step_s']:.1f} s with compiling); whole generate call for generate")
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
