"""Abstract builds: Keras's block-by-block tracing against ours.

KerasHub's functional backbones infer each decoder block's output by
tracing its `call` (`jax.eval_shape`) block after block; ours
(`plan/build._each_layer_kind_traced_once`) traces each kind of block once
per build. Both build the same model (weights, layers, output specs; the
script checks it). Medians of `--repeats` builds each, side by side in one
process, automatic names reset before each build.

    python benchmarks/bench_abstract_build.py
    python benchmarks/bench_abstract_build.py gpt_oss_120b_en llama3_8b_en

Measured: BENCHMARKS.md, "Abstract builds: each kind of block traced once".
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time

DEFAULT = ["gpt_oss_120b_en", "gpt_oss_20b_en", "llama3_8b_en", "gemma3_27b_text", "qwen3_moe_235b_a22b_en"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", default=DEFAULT)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras

    from keras_hub_dist.plan import build, presets

    ours = build._each_layer_kind_traced_once
    print(f"{'architecture':28s} {'keras s':>8s} {'ours s':>8s} {'ratio':>7s}")
    for name in args.names:
        cls, config, _ = presets.backbone_config(presets.resolve(name).name)
        seconds: dict[str, list[float]] = {"keras": [], "ours": []}
        models = {}
        for _ in range(args.repeats):
            for mode in seconds:
                build._each_layer_kind_traced_once = contextlib.nullcontext if mode == "keras" else ours
                keras.backend.clear_session()
                start = time.perf_counter()
                model = build.build_abstract(cls, config)
                seconds[mode].append(time.perf_counter() - start)
                models[mode] = (build.specs_of(model), [layer.name for layer in model.layers])
        build._each_layer_kind_traced_once = ours
        assert models["keras"] == models["ours"], name
        keras_s, ours_s = (statistics.median(seconds[m]) for m in ("keras", "ours"))
        print(f"{name:28s} {keras_s:8.2f} {ours_s:8.2f} {ours_s / keras_s:6.2f}x")


if __name__ == "__main__":
    main()
