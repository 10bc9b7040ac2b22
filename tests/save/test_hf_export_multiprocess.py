"""Hugging Face export under `jax.distributed`: 2 processes x 4 CPU devices
on loopback.

The model's weights are their own element ids (variable k's element i holds
`1000 * k + i` for a tiny Qwen3-MoE, exact in float32), so every byte a
process wrote says which variable element it is: each process wrote only
elements its own devices hold, every byte of every tensor was written
exactly once over the job, and the files equal a single-process export byte
for byte. A write failure on one process publishes nothing on either.
"""

import os
import pathlib
import sys

import keras
import keras_hub
import numpy as np
import pytest

import keras_hub_dist
from tests.formats.hf import moe
from tests.formats.hf.writer import write_hf_checkpoint
from tests.multiprocess_jobs import digest, merge_ranges, run_save_jobs

WORKER = pathlib.Path(__file__).with_name("multiprocess_save_worker.py")
STRIDE = 100_000  # ids of variable k: STRIDE * k + element index

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="needs Linux (/proc) and loopback"
)


@pytest.fixture(scope="module")
def id_checkpoint(tmp_path_factory):
    """A Qwen3-MoE checkpoint whose values are element ids, and the
    single-process export of it."""
    root = tmp_path_factory.mktemp("mp_export")
    config, tensors = moe.hf_checkpoint("qwen3_moe", tied=False, dtype="float32")
    write_hf_checkpoint(str(root / "random"), config, tensors)
    backbone = keras_hub.models.Backbone.from_preset(str(root / "random"))
    for k, variable in enumerate(backbone.weights):
        size = int(np.prod(variable.shape))
        assert size < STRIDE
        variable.assign((STRIDE * k + np.arange(size, dtype=np.float64)).astype("float32").reshape(variable.shape))
    keras_hub_dist.save_sharded_preset(
        backbone, str(root / "ids"), format="huggingface", max_shard_size="100KB", progress=False)
    keras.distribution.set_distribution(None)
    return root, [(v.path, tuple(v.shape)) for v in backbone.weights]


@pytest.fixture(scope="module")
def job(id_checkpoint, tmp_path_factory):
    """One job on 1 x 8 (the model axis spans both processes, so each holds
    half of every sharded weight and all of the replicated ones): a plain
    export, then one whose write fails on process 1, over an existing export."""
    root, _ = id_checkpoint
    return run_save_jobs(WORKER, root / "ids", tmp_path_factory.mktemp("mp_export_jobs"),
                         {"1x8": ["ok", "fail_write"]}, save_format="huggingface",
                         existing=("fail_write",))


def _data_start(path):
    """Where a safetensors file's tensor data starts (after its header)."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_each_process_writes_only_its_elements_once(id_checkpoint, job):
    """Mesh 1 x 8: the model axis spans both processes, so each holds half
    of every sharded weight (and all of the replicated ones)."""
    root, variables = id_checkpoint
    parent, reports, _ = job["1x8", "ok"]
    target = parent / "saved"
    assert [r["error"] for r in reports] == [None, None]
    assert os.listdir(parent) == ["saved"]  # no staging left beside it
    files = sorted(n for n in os.listdir(target) if n.endswith(".safetensors"))
    # Byte-identical to the single-process export: the source itself was
    # exported by one process, with the shard size the worker passes.
    assert files == sorted(n for n in os.listdir(root / "ids") if n.endswith(".safetensors"))
    assert len(files) > 1
    for name in files:
        assert (target / name).read_bytes() == (root / "ids" / name).read_bytes(), name

    # The workers' variable paths, in `backbone.weights` order: Keras numbers
    # auto-named layers per process, so this process's names may differ.
    paths = list(reports[0]["held"])
    assert len(paths) == len(variables) and paths == list(reports[1]["held"])
    starts = {name: _data_start(target / name) for name in files}
    sizes = {name: os.path.getsize(target / name) for name in files}
    everything = []
    for process, report in enumerate(reports):
        held = {path: [tuple(map(tuple, b)) for b in blocks] for path, blocks in report["held"].items()}
        writes = [(n, o, c) for n, o, c in report["writes"]]
        assert writes and all(n in files for n, _, _ in writes)
        mine = 0
        for name, offset, count in writes:
            assert offset >= starts[name] and offset + count <= sizes[name]  # data, never a header
            with open(target / name, "rb") as f:
                f.seek(offset)
                ids = np.frombuffer(f.read(count), np.float32).astype(np.int64)
            for element in ids:
                k, flat = divmod(int(element), STRIDE)
                path, shape = paths[k], variables[k][1]
                index = np.unravel_index(flat, shape)
                assert any(all(a <= i < b for i, (a, b) in zip(index, block)) for block in held[path]), (
                    process, path, index)
            mine += count
            everything.append((name, offset, offset + count))
        assert 0 < mine < sum(sizes[n] - starts[n] for n in files)  # a share, not everything
    by_file = {}
    for name, start, end in everything:
        by_file.setdefault(name, []).append((start, end))
    for name in files:
        merged = merge_ranges(by_file[name])
        assert merged == [(starts[name], sizes[name])]  # every data byte...
        assert sum(e - s for s, e in by_file[name]) == sizes[name] - starts[name]  # ...exactly once


def test_a_write_failure_on_one_process_publishes_nothing(job):
    parent, reports, before = job["1x8", "fail_write"]  # over a copy of the export
    target = parent / "saved"
    errors = [r["error"] for r in reports]
    assert all(e and e.startswith("SaveError") and "injected by the test" in e for e in errors), errors
    assert digest(target) == before
    assert os.listdir(parent) == ["saved"]  # no staging left
