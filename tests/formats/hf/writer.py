"""Writes a Hugging Face checkpoint directory: config.json + safetensors.

`num_shards=1` writes `model.safetensors`; more writes
`model-0000k-of-0000n.safetensors` files and `model.safetensors.index.json`,
as `transformers`' `save_pretrained` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

__all__ = ["float_dtype", "random_float", "write_hf_checkpoint"]


def float_dtype(name: str) -> np.dtype:
    """`"float32"` / `"bfloat16"` / `"float16"` as a NumPy dtype."""
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def random_float(rng: np.random.Generator, shape, dtype: str, scale: float = 0.5):
    """Random normal values of `shape` in `dtype` (values well inside bf16 range)."""
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(float_dtype(dtype))


def write_hf_checkpoint(
    directory: str,
    config: Mapping[str, Any],
    tensors: Mapping[str, np.ndarray],
    *,
    num_shards: int = 1,
) -> str:
    """Writes `config.json` and the tensors in HF layout; returns `directory`."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dict(config), f, indent=2)
    names = list(tensors)
    if num_shards <= 1:
        save_file({k: np.asarray(tensors[k], order="C") for k in names},
                  os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return directory
    weight_map = {}
    total = 0
    for s in range(num_shards):
        part = names[s::num_shards]
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: np.asarray(tensors[k], order="C") for k in part},
                  os.path.join(directory, fname), metadata={"format": "pt"})
        for k in part:
            weight_map[k] = fname
            total += tensors[k].nbytes
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return directory
