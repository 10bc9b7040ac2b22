"""Sharded init of a token-embedding table: ours vs stock Keras, side by side.

Each case runs in a fresh subprocess with N simulated CPU devices, builds a
`keras.layers.Embedding` named `token_embedding` under `ModelParallel` with
KerasHub Gemma's layout for it (vocabulary on "model", hidden on "batch"), and
reports, per device: the compiled init program's output + temp bytes
(`memory_analysis()`), the sampled live-array peak, and the wall time of the
build (cold: tracing and compiling included; warm: median of `--repeats`
further builds).

    python benchmarks/bench_init.py                       # 256000 x 3072 f32, 1x8
    python benchmarks/bench_init.py --vocab 32000 --hidden 1024 --mesh 2x4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# stock: keras.initializers.VarianceScaling through a Keras layer build.
# ours: our twin through the same layer build (Keras 3.15 passes `layout=`
#   under `explicit_axes`, then reshards the result: one extra copy).
# deferred: our twin, variables created without values, then
#   `initializers.initialize_variables` places each drawn shard as is.
CASES = ("stock", "ours", "deferred")


def _worker(args: argparse.Namespace) -> None:
    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={args.devices}"
    )
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras
    import numpy as np

    import keras_hub_dist
    from keras_hub_dist import _compat
    from keras_hub_dist.measure.memory import MemorySampler

    batch, model = (int(x) for x in args.mesh.split("x"))
    mesh = keras.distribution.DeviceMesh(
        (batch, model), ("batch", "model"), jax.devices()[: batch * model]
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["token_embedding/embeddings"] = ("model", "batch")
    distribution = keras.distribution.ModelParallel(layout_map=layout_map)
    kwargs = dict(scale=1.0, mode="fan_in", distribution="untruncated_normal", seed=0)
    if args.case == "stock":
        initializer = keras.initializers.VarianceScaling(**kwargs)
    else:
        initializer = keras_hub_dist.DistributedVarianceScaling(**kwargs)

    def make_layer():
        layer = keras.layers.Embedding(
            args.vocab, args.hidden, embeddings_initializer=initializer,
            dtype=args.dtype, name="token_embedding",
        )
        layer.build(None)
        return layer

    def build():
        with distribution.scope():
            if args.case == "deferred":
                # How our factories build: variables first, values after,
                # each drawn straight into its shards.
                with _compat.creating_variables_without_values() as created:
                    layer = make_layer()
                keras_hub_dist.initializers.initialize_variables(created)
            else:
                layer = make_layer()
        value = layer.embeddings.value
        jax.block_until_ready(value)
        return layer, value

    results = {}
    warm_walls = []
    for phase in ["cold"] + ["warm"] * args.repeats:
        start = time.perf_counter()
        with MemorySampler(interval_s=0.002) as sampler:
            layer, value = build()
        wall = time.perf_counter() - start
        if phase == "warm":
            warm_walls.append(wall)
            wall = float(np.median(warm_walls))
        results[phase] = {
            "wall_s": wall,
            "peak_per_device": sampler.peak_per_device,
            "live_peak_per_device": sampler.live_peak_per_device,
            "final_per_device": sampler.final_per_device,
            "compiled": sampler.compiled,
            "host_peak_rss": sampler.host_peak_rss,
            "host_start_rss": sampler.host_start_rss,
        }
        shard = value.addressable_shards[0]
        results["shard_bytes"] = int(shard.data.nbytes)
        results["spec"] = str(value.sharding.spec)
        np.save(os.path.join(args.out, f"{args.case}.npy"),
                np.asarray(shard.data[:4]))
        del layer, value
    print(json.dumps(results))


def _run_case(args: argparse.Namespace, case: str, out: str) -> dict:
    command = [sys.executable, __file__, "--worker", "--case", case, "--out", out,
               "--vocab", str(args.vocab), "--hidden", str(args.hidden),
               "--mesh", args.mesh, "--dtype", args.dtype,
               "--devices", str(args.devices), "--repeats", str(args.repeats)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{case} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=256000)
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--mesh", default="1x8")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3,
                        help="warm builds after the cold one; the median is shown")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return

    import numpy as np

    with tempfile.TemporaryDirectory() as out:
        results = {case: _run_case(args, case, out) for case in CASES}
        first_rows = {c: np.load(os.path.join(out, f"{c}.npy")) for c in results}
    shard = results["ours"]["shard_bytes"]
    gib = 2**30
    print(f"token embedding {args.vocab} x {args.hidden} {args.dtype}, mesh "
          f"{args.mesh}, spec {results['ours']['spec']}, shard "
          f"{shard / gib:.3f} GiB per device")
    header = (f"{'case':8} {'program out+temp':>17} {'peak/shard':>11} "
              f"{'final/shard':>12} {'cold s':>8} {'warm s':>8} {'host peak GiB':>14}")
    print(header)
    print("-" * len(header))
    for case, r in results.items():
        program = max(
            (c.get("output_bytes", 0) + c.get("temp_bytes", 0)
             for c in r["cold"]["compiled"]), default=0,
        )
        peak = max(r["cold"]["peak_per_device"].values())
        final = max(r["cold"]["final_per_device"].values())
        print(f"{case:8} {program / shard:16.3f}x {peak / shard:10.3f}x "
              f"{final / shard:11.3f}x {r['cold']['wall_s']:8.2f} "
              f"{r['warm']['wall_s']:8.2f} {r['cold']['host_peak_rss'] / gib:14.2f}")
    print("floor    (physical)          1.000x      1.000x       1.000x")
    scale = float(np.max(np.abs(first_rows["stock"])))
    for case in CASES[1:]:
        diff = float(np.max(np.abs(first_rows[case] - first_rows["stock"])))
        print(f"values: max |{case} - stock| on shard 0 rows 0-3 = {diff:.3g} "
              f"(max |value| {scale:.3g})")
        for phase in ("cold", "warm"):
            ratio = results[case][phase]["wall_s"] / results["stock"][phase]["wall_s"]
            print(f"wall time {case}/stock ({phase}): {ratio:.2f}")


if __name__ == "__main__":
    main()
