"""Byte arithmetic shared by sizing, planning and reports."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import keras

__all__ = ["format_bytes", "itemsize"]


def itemsize(dtype: Any) -> int:
    """Bytes per element of a Keras / JAX / NumPy dtype (or its name)."""
    return int(jnp.dtype(keras.backend.standardize_dtype(dtype)).itemsize)


def format_bytes(n: float | None) -> str:
    """`n` bytes in binary units (`"1.50 GiB"`, `"512 B"`); `"-"` for `None`."""
    if n is None:
        return "-"
    n = float(n)
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
