"""Saving under `jax.distributed`: 2 processes x 4 CPU devices on loopback.

Checks: each process writes only bytes of blocks its own devices hold, every
byte of every dataset is written exactly once over the job, stock KerasHub
loads the result bitwise equal, and the checksums verify. A write failure on
one process and disagreeing targets raise on every process and leave the
target untouched. With `durable=True` each process flushes the file it
wrote, process 0 everything else.
"""

import os
import pathlib
import sys

import keras
import keras_hub
import numpy as np
import pytest

import keras_hub_dist
from keras_hub_dist.formats.keras_h5 import build_index
from tests.multiprocess_jobs import block_byte_ranges, digest, merge_ranges, run_save_jobs

WORKER = pathlib.Path(__file__).with_name("multiprocess_save_worker.py")

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="needs Linux (/proc) and loopback"
)


@pytest.fixture(scope="module")
def tiny_preset(tmp_path_factory):
    keras.utils.set_random_seed(3)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=256, num_layers=2, num_query_heads=8,
        num_key_value_heads=4, hidden_dim=64, intermediate_dim=128,
    )
    path = tmp_path_factory.mktemp("mp_save") / "tiny_llama"
    backbone.save_to_preset(str(path))
    return str(path)


# The saves of this file, in two jobs (one per mesh): each process starts
# Python, JAX, Keras and KerasHub once per job, not once per save. The plain
# save comes first, the failures after it.
JOBS = {
    "1x8": ["ok", "fail_write", "different_target"],
    "2x4": ["ok", "durable"],
}


@pytest.fixture(scope="module")
def jobs(tiny_preset, tmp_path_factory):
    return run_save_jobs(WORKER, tiny_preset, tmp_path_factory.mktemp("mp_save_jobs"), JOBS,
                         existing=("fail_write", "different_target"))


def _assert_same_weights(a, b):
    for x, y in zip(a.weights, b.weights, strict=True):
        assert x.path == y.path
        np.testing.assert_array_equal(np.asarray(x.value), np.asarray(y.value), err_msg=x.path)


@pytest.mark.parametrize("mesh", ["1x8", "2x4"])
def test_each_process_writes_only_its_blocks(tiny_preset, jobs, mesh):
    parent, reports, _ = jobs[mesh, "ok"]
    target = parent / "saved"
    assert [r["error"] for r in reports] == [None, None]
    assert os.listdir(parent) == ["saved"]  # no staging left beside it

    saved = keras_hub.models.Backbone.from_preset(str(target))
    _assert_same_weights(keras_hub.models.Backbone.from_preset(tiny_preset), saved)
    index = {e.path: e.source.dataset for e in build_index(
        saved, str(target / "model.weights.h5")).entries}
    total = sum(d.nbytes for d in index.values())

    written_by = []
    for report in reports:
        held = merge_ranges(
            r for path, blocks in report["held"].items()
            for block in blocks for r in block_byte_ranges(index[path], block)
        )
        writes = [(offset, offset + n) for name, offset, n in report["writes"]
                  if name == "model.weights.h5"]
        assert len(writes) == len(report["writes"])  # nothing else is written to
        merged = merge_ranges(writes)
        # Only bytes its own devices hold.
        for start, end in merged:
            assert any(a <= start and end <= b for a, b in held), (start, end)
        assert sum(b - a for a, b in writes) == sum(b - a for a, b in merged)
        written = sum(b - a for a, b in writes)
        assert 0 < written < total  # a share, not a gathered whole
        written_by.append(merged)
    # Over the job: every dataset byte exactly once.
    everything = merge_ranges(r for ranges in written_by for r in ranges)
    assert sum(b - a for a, b in everything) == sum(
        b - a for ranges in written_by for a, b in ranges) == total
    assert everything == merge_ranges(
        r for d in index.values() for r in block_byte_ranges(d, tuple((0, n) for n in d.shape)))

    loaded = keras_hub_dist.load_sharded_preset(str(target), mesh=(4, 2), verify=True, progress=False)
    keras.distribution.set_distribution(None)
    _assert_same_weights(saved, loaded)


@pytest.mark.parametrize("mode", ["fail_write", "different_target"])
def test_a_failure_on_one_process_leaves_the_target_untouched(jobs, mode):
    parent, reports, before = jobs["1x8", mode]
    target = parent / "saved"
    errors = [r["error"] for r in reports]
    assert all(e and e.startswith("SaveError") for e in errors), errors
    if mode == "fail_write":
        assert all("process 1" in e and "injected by the test" in e for e in errors), errors
    else:
        assert all("same preset_dir" in e and "_other" in e for e in errors), errors
    assert digest(target) == before
    assert os.listdir(parent) == ["saved"]  # no staging left, no "saved_other"


def test_durable_each_process_flushes_what_it_wrote(tiny_preset, jobs):
    parent, reports, _ = jobs["2x4", "durable"]
    target = parent / "saved"
    assert [r["error"] for r in reports] == [None, None]
    assert all(r["writes"] for r in reports)  # both wrote blocks of the weights
    (staging,) = {os.path.dirname(p) for p in reports[1]["fsynced"]}
    assert os.path.basename(staging).startswith(".saved.partial-")
    # Process 1: the weights file it wrote to, nothing else.
    assert set(reports[1]["fsynced"]) == {os.path.join(staging, "model.weights.h5")}
    # Process 0: every file and directory of the preset, the parent around the rename.
    flushed = set(reports[0]["fsynced"])
    assert {os.path.join(staging, n) for n in os.listdir(target)} | {staging, str(parent)} <= flushed
    keras.distribution.set_distribution(None)
    _assert_same_weights(keras_hub.models.Backbone.from_preset(tiny_preset),
                         keras_hub_dist.load_sharded_preset(str(target), mesh=(1, 8), verify=True,
                                                            progress=False))
