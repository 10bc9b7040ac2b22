"""Two processes x 4 devices load one remote checkpoint on a (2, 4) mesh
whose batch axis spans the processes: every block is held on both, yet the
job fetches each byte of the weights about once, each process about half,
and the model is bitwise the one loaded from local disk."""

import pathlib
import sys

import keras
import keras_hub
import pytest

from keras_hub_dist import write_synthetic_preset
from keras_hub_dist.formats import keras_h5
from tests.multiprocess_jobs import run_job

WORKER = pathlib.Path(__file__).with_name("remote_load_worker.py")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux and loopback")


def test_the_job_fetches_each_byte_once(tmp_path, remote_checkpoint):
    preset = write_synthetic_preset(
        str(tmp_path / "llama"), keras_hub.models.LlamaBackbone, dtype="float32", seed=5,
        vocabulary_size=2048, num_layers=2, num_query_heads=8, num_key_value_heads=8,
        hidden_dim=64, intermediate_dim=128)
    keras.distribution.set_distribution(None)
    remote = remote_checkpoint(preset, schemes=["http"])["http"]
    out = tmp_path / "out"
    out.mkdir()
    reports = run_job(WORKER, 2, 4, [remote.url, preset, "2x4", out], out)
    assert all(r["unequal"] == [] and r["variables"] > 0 for r in reports)
    datasets = keras_h5.read_datasets([str(tmp_path / "llama" / "model.weights.h5")]).values()
    checkpoint = sum(d.nbytes for d in datasets)
    metadata = (2 + len(datasets)) * 64 * 1024  # each process indexes the file
    per_process = [remote.bytes_sent("model.weights.h5", process=p) for p in range(2)]
    # Each process fetched about half; together about the checkpoint once.
    for sent in per_process:
        assert sent <= 0.55 * checkpoint + metadata, (sent, checkpoint)
    assert sum(per_process) <= 1.02 * checkpoint + 2 * metadata, (per_process, checkpoint)
    # KerasHub's Llama layout splits the embedding and the down and output
    # projections on their last axis over the batch axis, i.e. over the
    # processes: read as they are that is a range request per row (over
    # 2,500 per process here). Each process reads whole rows instead.
    weights = [len(remote.requests("model.weights.h5", method="GET", process=p)) for p in range(2)]
    assert all(n <= 200 for n in weights), weights
