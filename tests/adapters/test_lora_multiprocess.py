"""`save_lora_adapter` under `jax.distributed`: 2 processes x 4 CPU devices
on loopback. The adapter's values are their own element ids, so every byte
says which element it is: over the job each byte of the file is written
exactly once, each process writes its share (the factors are replicated:
each holds all of them), and the file equals the single-process save byte
for byte. No torch: the adapter is written with `safetensors` directly.
"""

import json
import os
import pathlib
import sys

import numpy as np
import pytest
import safetensors.numpy

import keras_hub_dist
from keras_hub_dist.save.lora_map import lora_modules
from tests.formats.hf import dense
from tests.formats.hf.writer import write_hf_checkpoint
from tests.multiprocess_jobs import digest, merge_ranges, run_job

WORKER = pathlib.Path(__file__).with_name("lora_save_worker.py")

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux (/proc) and loopback"),
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Qwen 3 and an r=4 adapter of all seven projections whose
    values are element ids; the single-process save of it."""
    root = tmp_path_factory.mktemp("lora_mp")
    config, tensors = dense.hf_checkpoint("qwen3", tied=True, dtype="float32")
    hf = write_hf_checkpoint(str(root / "hf"), config, tensors)
    backbone = keras_hub_dist.load_sharded_preset(hf, mesh=(1, 8), progress=False)
    factors, start = {}, 0
    for _, module in lora_modules(backbone):
        for factor, shape in (("A", (4, module.in_features)), ("B", (module.out_features, 4))):
            size = int(np.prod(shape))
            factors[f"base_model.model.{module.module}.lora_{factor}.weight"] = (
                start + np.arange(size, dtype=np.float64)).astype(np.float32).reshape(shape)
            start += size
    assert start < 2**24  # ids exact in float32
    (root / "adapter").mkdir()
    safetensors.numpy.save_file(factors, str(root / "adapter" / "adapter_model.safetensors"), {"format": "pt"})
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    (root / "adapter" / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": targets, "bias": "none"}))
    loaded = keras_hub_dist.load_sharded_preset(hf, mesh=(1, 8), progress=False, lora_adapter=str(root / "adapter"))
    keras_hub_dist.save_lora_adapter(loaded, str(root / "single"), progress=False)
    return root, hf


def test_each_process_writes_its_share_once(checkpoint, tmp_path):
    """Mesh 1 x 8: the model axis spans both processes."""
    root, hf = checkpoint
    reports = run_job(WORKER, 2, 4, [hf, root / "adapter", "1x8", tmp_path], tmp_path)
    assert [r["error"] for r in reports] == [None, None]
    assert digest(tmp_path / "saved") == digest(root / "single")
    path = tmp_path / "saved" / "adapter_model.safetensors"
    with open(path, "rb") as f:
        data_start = 8 + int.from_bytes(f.read(8), "little")
    written = [[(o, o + n) for name, o, n in r["writes"] if name == path.name] for r in reports]
    data = os.path.getsize(path) - data_start
    counts = [sum(b - a for a, b in w) for w in written]
    # Every byte once, split between the processes (each holds every factor).
    assert merge_ranges(written[0] + written[1]) == [(data_start, data_start + data)]
    assert sum(counts) == data and min(counts) > 0.3 * data, counts
    assert all(r["held"] >= c for r, c in zip(reports, counts))
    tensors = safetensors.numpy.load_file(str(path))
    assert all(np.array_equal(tensors[k], v) for k, v in safetensors.numpy.load_file(
        str(root / "adapter" / "adapter_model.safetensors")).items())
