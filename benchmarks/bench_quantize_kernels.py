"""Benchmark: Keras's int8 / int4 of one float32 block on the host, two ways.

A quantized load (`load_sharded_preset(..., quantize=...)`) reads each float
block and quantizes it on the host, rounded to bfloat16 first where the
model is bfloat16 and the checkpoint float32 (the bench_quantize probe).
This measures, per element of one block of Gemma-7B width (`--rows` x 3072,
float32: 8 MiB by default), single-threaded, the best of `--repeats`:

- `numpy`: `keras_math`'s steps (bfloat16 rounding and widening,
  statistics, values in place, packing), what the loader runs where the
  kernels do not apply;
- `kernels`: `kernels` (statistics, then rounding, values and
  packing in one pass);
- `copy`: one `np.copyto` of the block, the floor of any pass over it.

Each layout is one the loader meets: `int4_rows` (an embedding table:
groups of 128 along each row, packed along it), `int4_cols` (a Dense kernel:
groups of 128 rows, packed along the columns), `int8_cols` (a kernel's
per-column scale). The two ways' results are checked to be the same bits,
and Keras's own (`keras.quantizers` on the bfloat16 block: with ml_dtypes
0.7 each product / quotient rounded to bfloat16, `keras_math.step_dtype`).

Usage:

    python benchmarks/bench_quantize_kernels.py
"""

from __future__ import annotations

import argparse
import os
import time

import ml_dtypes
import numpy as np

from keras_hub_dist.quantize import kernels as qk
from keras_hub_dist.quantize import keras_math as qm

BF16 = ml_dtypes.bfloat16


def _numpy(x: np.ndarray, layout: str) -> np.ndarray:
    wide = x.astype(BF16).astype(np.float32)  # the block as the bfloat16 variable holds it
    if layout == "int8_cols":
        scale = qm.int8_scale(qm.abs_max(x, (0,)).astype(BF16))
        return qm.int8_values(wide, scale, overwrite=True, step=qm.step_dtype(BF16, scale))
    axis = 1 if layout == "int4_rows" else 0
    low, high = (s.astype(BF16) for s in qm.group_stats(x, axis, 0, 128))
    scale, zero = qm.group_params(low, high)
    step = qm.step_dtype(BF16, scale)
    return qm.pack_int4(qm.group_values(wide, axis, 0, 128, scale, zero, overwrite=True, step=step), 1)


def _kernels(x: np.ndarray, layout: str) -> np.ndarray:
    if layout == "int8_cols":
        scale = qm.int8_scale(qk.int8_abs_max(x, 0).astype(BF16))
        out = np.empty(x.shape, np.int8)
        qk.int8_values(x, True, scale, 0, out, round_step=qm.step_dtype(BF16, scale) == BF16)
        return out
    axis = 1 if layout == "int4_rows" else 0
    low, high = (s.astype(BF16) for s in qk.int4_stats(x, axis, 0, 128))
    scale, zero = qm.group_params(low, high)
    out = np.empty((x.shape[0], x.shape[1] // 2), np.int8)
    qk.int4_values(x, True, axis, 0, 128, scale, zero, 1, out, round_step=qm.step_dtype(BF16, scale) == BF16)
    return out


def _keras(x: np.ndarray, layout: str) -> np.ndarray:
    """Keras's own quantizers on the block as a bfloat16 variable holds it."""
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import keras  # only for the check

    rounded = x.astype(BF16)
    if layout == "int8_cols":
        return np.asarray(keras.quantizers.abs_max_quantize(rounded, axis=0, to_numpy=True)[0])
    oriented = rounded if layout == "int4_cols" else rounded.T  # Keras groups along axis 0
    values = np.asarray(keras.quantizers.abs_max_quantize_grouped_with_zero_point(oriented, 128, to_numpy=True)[0])
    return np.asarray(keras.quantizers.pack_int4(values if layout == "int4_cols" else values.T, axis=1)[0])


def _best(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=683)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    x = (np.random.default_rng(0).standard_normal((args.rows, 3072)) * 0.02).astype(np.float32)
    copy = np.empty_like(x)
    floor = _best(lambda: np.copyto(copy, x), args.repeats) / x.size * 1e9
    print(f"block {args.rows} x 3072 float32 ({x.nbytes / 2**20:.1f} MiB), one thread; ns per element:")
    print("| layout | numpy | kernels | copy (floor) | numpy / kernels | kernels / copy |")
    print("|---|---|---|---|---|---|")
    for layout in ("int4_rows", "int4_cols", "int8_cols"):
        if _numpy(x, layout).tobytes() != _kernels(x, layout).tobytes():
            raise SystemExit(f"{layout}: the kernels' bits differ from keras_math's")
        if _kernels(x, layout).tobytes() != _keras(x, layout).tobytes():
            raise SystemExit(f"{layout}: the kernels' bits differ from Keras's")
        slow = _best(lambda: _numpy(x, layout), args.repeats) / x.size * 1e9
        fast = _best(lambda: _kernels(x, layout), args.repeats) / x.size * 1e9
        print(f"| {layout} | {slow:.2f} | {fast:.2f} | {floor:.2f} | {slow / fast:.1f}x | {fast / floor:.1f}x |")


if __name__ == "__main__":
    main()
