"""Benchmark: `restore_checkpoint` vs stock `model.load_weights(dir)` on a
`keras.callbacks.OrbaxCheckpoint` directory, side by side.

On 8 simulated CPU devices, mesh (1, 8), a Gemma-7B-width causal LM (vocab
256000, hidden 3072, 16 heads of 256, intermediate 24576) with `--num_layers`
decoder blocks (default 1) in `--dtype` (default bfloat16: Adam's moments
take the weights' dtype, so the state is 3x the weights), compiled with Adam.

`prepare` (once): writes a synthetic preset, loads it with
`load_sharded_preset`, builds Adam and gives it the state of one step
(random moments, iteration 1; a real `fit` step of this probe needs more than
the 24 GB host has), then saves it with `OrbaxCheckpoint(save_freq=1)`
through the callback's own hooks (`on_train_batch_end`): the checkpoint
holds weights, both moments and the iteration, as after a fit step.

Each case then runs in a fresh process (so one case's memory cannot hide
another's): `load_sharded_preset(preset, mesh=(1, 8), task="causal_lm")`,
`compile(Adam)`, then the restore, timed until every array is ready:

- `ours`: `keras_hub_dist.restore_checkpoint(lm, dir)` into a model whose
  optimizer is built (as after a `fit`: every variable replaced);
- `ours_fresh`: the same into a model compiled and never fitted (the usual
  restart: the optimizer is built by the restore, filled from the file);
- `stock`: `lm.load_weights(dir)` into a model whose optimizer is built
  (Keras's Orbax path: the whole state tree restored beside the live one,
  then assigned). With an optimizer not built, stock skips the moments.

Runs named `<case>_mem` repeat a case with the memory sampler on: a sample of
every device's live-array bytes after every `jax.device_put` (Orbax places
each block with one) and every 10 ms, plus XLA programs' temps; host figures
are VmRSS / VmHWM (reset at the start of the restore). Host RSS on CPU
includes the "device" arrays, which are host memory here.

Usage (heavy: run under the machine's heavy-job lock):

    flock /tmp/khd-heavy.lock python benchmarks/bench_restore.py --repeats 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_load import _env, _median, run_capped  # noqa: E402

RESULT_TAG = "RESULT "
OVERRIDES = dict(num_layers=1, intermediate_dim=24576)


def _lm(args):
    import keras

    import keras_hub_dist

    start = time.perf_counter()
    lm = keras_hub_dist.load_sharded_preset(
        args.preset, mesh=(1, 8), task="causal_lm", dtype=args.dtype, progress=False
    )
    load_s = time.perf_counter() - start
    lm.preprocessor = None
    lm.compile(optimizer=keras.optimizers.Adam(1e-4, name="adam"))
    return lm, load_s


def _prepare(args) -> None:
    import keras

    import keras_hub_dist

    if not os.path.isdir(args.preset):
        overrides = dict(OVERRIDES, num_layers=args.num_layers)
        if args.vocabulary_size:
            overrides["vocabulary_size"] = args.vocabulary_size
        keras_hub_dist.write_synthetic_preset(
            args.preset, "gemma_7b_en", dtype=args.dtype, tokenizer=True, **overrides
        )
    if os.path.isdir(args.checkpoint):
        print(f"reusing {args.checkpoint}")
        return
    import jax

    lm, _ = _lm(args)
    start = time.perf_counter()
    # The state one `fit` step leaves (random moments, iteration 1), made in
    # place: a fit step of this probe took > 17 GB of host memory (it was
    # OOM-killed on the 24 GB benchmark host).
    lm.optimizer.build(lm.trainable_variables)
    key = jax.random.PRNGKey(0)
    for i, v in enumerate(lm.optimizer.variables):
        if len(v.shape) == 0:
            continue
        value = v.value
        fill = jax.jit(
            lambda k, shape=tuple(value.shape), dtype=value.dtype: (
                jax.random.uniform(k, shape, "float32") * 1e-3
            ).astype(dtype),
            out_shardings=value.sharding,
        )
        v.assign(fill(jax.random.fold_in(key, i)))
        del value
    lm.optimizer.iterations.assign(1)
    # Saved by the callback's own path, as `fit` would at a batch's end.
    callback = keras.callbacks.OrbaxCheckpoint(args.checkpoint, save_freq=1, save_on_background=False)
    callback.set_model(lm)
    callback.on_train_batch_end(0)
    callback.on_train_end()
    print(f"saved {args.checkpoint} in {time.perf_counter() - start:.1f} s")


def _case(args) -> dict:
    import jax

    import keras_hub_dist
    from keras_hub_dist.measure import memory
    from keras_hub_dist.measure.event_samples import sampling_after_calls

    if args.group_mib:
        from keras_hub_dist.load import restore as restore_module

        restore_module.GROUP_BYTES = args.group_mib << 20
    name = args.case.removesuffix("_mem")
    measure = args.case.endswith("_mem")
    lm, load_s = _lm(args)
    if name != "ours_fresh":
        lm.optimizer.build(lm.trainable_variables)
    variables = lambda: list(lm.trainable_variables) + list(lm.non_trainable_variables) + list(lm.optimizer.variables)  # noqa: E731
    jax.block_until_ready([v.value for v in variables()])
    gc.collect()
    restore = (
        (lambda: lm.load_weights(args.checkpoint)) if name == "stock"
        else (lambda: keras_hub_dist.restore_checkpoint(lm, args.checkpoint, progress=False))
    )
    result = {"case": args.case, "load_s": load_s}
    if measure:
        with memory.MemorySampler(interval_s=0.01) as sampler, \
                sampling_after_calls(sampler, jax, "device_put") as puts:
            start = time.perf_counter()
            restore()
            jax.block_until_ready([v.value for v in variables()])
            wall = time.perf_counter() - start
        final = sampler.final_per_device
        peak = {d: max([s[d] for s in puts] + [sampler.peak_per_device[d]]) for d in final}
        result.update(
            peak_over_final=max(peak[d] / final[d] for d in final),
            final_per_device=max(final.values()),
            start_per_device=max(sampler.start_per_device.values()),
            placements_sampled=len(puts),
            host_rss_start=sampler.host_start_rss,
            host_rss_peak=sampler.host_peak_rss,
            host_rss_final=sampler.host_final_rss,
        )
    else:
        start = time.perf_counter()
        restore()
        jax.block_until_ready([v.value for v in variables()])
        wall = time.perf_counter() - start
    result["wall_s"] = wall
    result["state_bytes"] = sum(v.value.nbytes for v in variables())
    result["iterations"] = int(lm.optimizer.iterations.value)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default="/work/bench_tmp/restore")
    parser.add_argument("--num_layers", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--vocabulary_size", type=int, default=0,
                        help="smaller than Gemma's 256000: a smoke test only")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--group_mib", type=int, default=0,
                        help="restore_checkpoint's group size (default: its GROUP_BYTES)")
    parser.add_argument("--cases", default="ours,ours_fresh,stock")
    parser.add_argument("--stock_cap_gb", type=float, default=15.0,
                        help="stop a stock run above this host RSS (0: no cap)")
    parser.add_argument("--keep", action="store_true", help="keep the preset and checkpoint")
    parser.add_argument("--json", default=None, help="also write results here")
    # Internal: one case in this process.
    parser.add_argument("--case", default=None)
    parser.add_argument("--preset", default=None)
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()
    tag = f"gemma7b_width_{args.num_layers}l_{args.dtype}_v{args.vocabulary_size or 256000}"
    args.preset = args.preset or os.path.join(args.workdir, tag)
    args.checkpoint = args.checkpoint or os.path.join(args.workdir, tag + "_ckpt")
    if args.case == "prepare":
        _prepare(args)
        return
    if args.case:
        sys.stdout.write(RESULT_TAG + json.dumps(_case(args)) + "\n")
        return

    me = [sys.executable, os.path.abspath(__file__), "--preset", args.preset,
          "--checkpoint", args.checkpoint, "--num_layers", str(args.num_layers), "--dtype", args.dtype,
          "--vocabulary_size", str(args.vocabulary_size), "--group_mib", str(args.group_mib)]
    subprocess.run(me + ["--case", "prepare"], env=_env(), check=True)
    results = []
    cases = args.cases.split(",")
    for repeat in range(args.repeats):
        for case in cases:
            for run in ([case + "_mem"] if repeat == 0 else []) + [case]:
                cap = int(args.stock_cap_gb * 1e9) if case == "stock" and args.stock_cap_gb else 0
                r = run_capped(me + ["--case", run], cap)
                results.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "stderr_tail"}), flush=True)
                if r.get("failed") or r.get("killed"):
                    print(r.get("stderr_tail", ""), file=sys.stderr)
    rows = [
        "| case | restore wall s (median; runs) | per-device peak / final | host RSS growth "
        "(peak - start) / state bytes | final per device | load_sharded_preset s (median) |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        timed = [r for r in results if r.get("case") == case]
        mem = [r for r in results if r.get("case") == case + "_mem"]
        if not timed or not mem:
            rows.append(f"| {case} | did not finish: {results[-1].get('reason', 'see above')} | | | | |")
            continue
        m = mem[0]
        growth = (m["host_rss_peak"] - m["host_rss_start"]) / m["state_bytes"]
        walls = "; ".join(f"{r['wall_s']:.2f}" for r in timed)
        rows.append(
            f"| {case} | {_median([r['wall_s'] for r in timed]):.2f} ({walls}) | "
            f"{m['peak_over_final']:.3f} | {growth:.2f} | "
            f"{m['final_per_device'] / 2**20:.1f} MiB | {_median([r['load_s'] for r in timed]):.2f} |"
        )
    table = "\n".join(rows)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "table": table}, f, indent=1)
    if not args.keep:
        shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
