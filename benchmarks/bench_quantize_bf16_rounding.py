"""Measure: Keras's int8 / int4 of a bfloat16 kernel against a float64 reference.

With ml_dtypes 0.7 (NumPy 2's NEP 50 promotion: a Python scalar takes the
array's dtype), `keras.quantizers.abs_max_quantize(..., to_numpy=True)` of a
bfloat16 kernel computes its scale and `w * scale` in bfloat16, so each int8
value is rounded twice (to bfloat16, then to an integer). This prints, for a
2048 x 2048 bfloat16 kernel of normal values with a per-column spread of
e^-3 .. e^1:

- int8 (per column): the share of values that are not the nearest integer
  of `w * scale` in float64 (the scale each method stores), and the RMS
  dequantization error `q / scale - w` relative to RMS(w), for Keras as
  installed, for float32 products (what ml_dtypes 0.5's promotion gave:
  `bf16 + 1e-7` is float32) and for the nearest integers;
- int4 (groups of 128 rows): the same for Keras as installed.

`load_sharded_preset(..., quantize=)` gives Keras's bits as installed
(docs/quantization.md); this measures what those bits cost.

Usage:

    python benchmarks/bench_quantize_bf16_rounding.py
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import keras  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

BF16 = ml_dtypes.bfloat16


def _error(q: np.ndarray, dequantized: np.ndarray, nearest: np.ndarray, w: np.ndarray, best: np.ndarray) -> str:
    rms = np.sqrt(np.mean(w**2))
    err = np.sqrt(np.mean((dequantized - w) ** 2)) / rms
    err_best = np.sqrt(np.mean((best - w) ** 2)) / rms
    return (f"{np.mean(q != nearest) * 100:.2f}% not the nearest integer; RMS error {err:.4g} of RMS(w) "
            f"(nearest integers: {err_best:.4g})")


def main() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((2048, 2048)) * np.exp(rng.uniform(-3, 1, 2048))).astype(BF16)
    w64 = w.astype(np.float64)
    eps = keras.backend.epsilon()
    print(f"ml_dtypes {ml_dtypes.__version__}, NumPy {np.__version__}, Keras {keras.__version__}")

    q, s = (np.asarray(a).astype(np.float64) for a in keras.quantizers.abs_max_quantize(w, axis=0, to_numpy=True))
    nearest = np.clip(np.rint(w64 * s), -127, 127)
    print("int8, Keras as installed:", _error(q, q / s, nearest, w64, nearest / s))

    top = np.abs(w).astype(np.float32).max(axis=0, keepdims=True)
    s32 = np.float32(127) / (top + np.float32(eps))  # float32, as ml_dtypes 0.5 promoted it
    q32 = np.clip(np.rint(w.astype(np.float32) * s32), -127, 127).astype(np.float64)
    stored = s32.astype(BF16).astype(np.float64)  # the scale variable is bfloat16
    nearest32 = np.clip(np.rint(w64 * stored), -127, 127)
    print("int8, float32 products:", _error(q32, q32 / stored, nearest32, w64, nearest32 / stored))

    values, scale, zero = keras.quantizers.abs_max_quantize_grouped_with_zero_point(w, block_size=128, to_numpy=True)
    v, s4, z4 = (np.repeat(np.asarray(a).astype(np.float64), 128, axis=0) if i else np.asarray(a).astype(np.float64)
                 for i, a in enumerate((values, scale, zero)))
    nearest4 = np.clip(np.rint(w64 / s4) + z4, -8, 7)
    print("int4, Keras as installed:", _error(v, (v - z4) * s4, nearest4, w64, (nearest4 - z4) * s4))


if __name__ == "__main__":
    main()
