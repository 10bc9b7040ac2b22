"""Two processes x 4 devices save one model into S3 (moto) with no shared
filesystem: each uploads only its own parts, about half the file each, the
job the file once; the object is byte for byte the local save's; the same
for the Hugging Face export (in the same job); a failure on one process
aborts every upload and publishes nothing."""

import hashlib
import json
import os
import pathlib
import sys

import keras
import keras_hub
import pytest

from keras_hub_dist import write_synthetic_preset
from keras_hub_dist.save import remote_publish
from keras_hub_dist.storage import uploads
from tests.multiprocess_jobs import run_job

WORKER = pathlib.Path(__file__).with_name("remote_save_worker.py")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux and loopback")


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    # Over 20 MiB of float32: 5 parts of 5 MiB; KerasHub's Llama layout puts
    # the batch axis (the processes, on a 2 x 4 mesh) on the last axis of
    # the embedding and the down projections: their parts are mixed.
    return write_synthetic_preset(
        str(tmp_path_factory.mktemp("mp_save") / "llama"), keras_hub.models.Llama3Backbone,
        dtype="float32", seed=7, vocabulary_size=40_000, num_layers=2, num_query_heads=8,
        num_key_value_heads=8, hidden_dim=128, intermediate_dim=256)


def _files(folder):
    return {
        os.path.relpath(os.path.join(r, n), folder): open(os.path.join(r, n), "rb").read()
        for r, _, names in os.walk(folder) for n in names
    }


@pytest.mark.parametrize("mesh", ["2x4", "1x8"])
def test_each_process_uploads_only_its_parts(preset, remote_target, tmp_path, mesh):
    target = remote_target("s3")  # behind a proxy that logs every upload
    url = target.url
    keras.distribution.set_distribution(None)
    # The 2 x 4 job exports the Hugging Face format too.
    reports = run_job(WORKER, 2, 4, [preset, mesh, url, tmp_path] + (["hf"] if mesh == "2x4" else []), tmp_path)
    assert [r["error"] for r in reports] == [None, None]
    writer = uploads.open_writer(url)
    remote = {n: writer.get(n) for n in writer.list() if not n.startswith(".")}
    local = _files(tmp_path / "local")
    assert sorted(remote) == sorted(local)
    for name in local:
        if name != "metadata.json":
            assert hashlib.sha256(remote[name]).digest() == hashlib.sha256(local[name]).digest(), name
    metadata = [json.loads(x) for x in (remote["metadata.json"], local["metadata.json"])]
    assert metadata[0]["keras_hub_dist"] == metadata[1]["keras_hub_dist"]
    size = len(local["model.weights.h5"])
    # Counted at the server, by the process each request says it is from.
    per_process = [target.bytes_received(process=p, parts=True) for p in range(2)]
    numbers = [sorted(k for name, k, _ in r["uploaded"]) for r in reports]
    assert sum(per_process) == size and not set(numbers[0]) & set(numbers[1]), (per_process, numbers)
    assert all(p <= 0.55 * size for p in per_process), (per_process, size)
    assert writer.list_uploads() == []
    # The batch axis (the processes) splits the embedding's last axis: its
    # parts hold both processes' bytes and were combined, on both processes.
    if mesh == "2x4":
        assert reports[0]["combined"] and reports[0]["combined"] == reports[1]["combined"]
        # Each slice spread over a process's 4 devices: a device holds its
        # quarter of the slice and of the sum, nothing more.
        assert 0 < max(r["combine_extra"] for r in reports) <= 2 * remote_publish.COMBINE_BYTES // 4, reports
        _check_hf_export(url, tmp_path, reports)


def _check_hf_export(url, tmp_path, reports):
    """The Hugging Face export: the local export's files byte for byte, each
    part uploaded by one process, about half of the weights each."""
    writer = uploads.open_writer(url.rstrip("/") + "-hf")
    remote = {n: writer.get(n) for n in writer.list() if not n.startswith(".")}
    local = _files(tmp_path / "local_hf")
    assert sorted(remote) == sorted(local)
    for name in local:
        assert hashlib.sha256(remote[name]).digest() == hashlib.sha256(local[name]).digest(), name
    parts = [{(name, k): n for name, k, n in r["uploaded_hf"]} for r in reports]
    size = sum(len(v) for k, v in local.items() if k.endswith(".safetensors"))
    assert not set(parts[0]) & set(parts[1]) and sum(sum(p.values()) for p in parts) == size
    assert all(sum(p.values()) <= 0.55 * size for p in parts), ([sum(p.values()) for p in parts], size)
    assert writer.list_uploads() == []
    # The embedding's rows are split over the processes here too: combined.
    assert reports[0]["combined_hf"] and reports[0]["combined_hf"] == reports[1]["combined_hf"]


def test_a_failure_on_one_process_aborts_every_upload(preset, remote_target, tmp_path):
    target = remote_target("s3")
    keras.distribution.set_distribution(None)
    reports = run_job(WORKER, 2, 4, [preset, "2x4", target.url, tmp_path, "fail_part"], tmp_path)
    assert all(r["error"] and "injected by the test" in r["error"] for r in reports), reports
    writer = uploads.open_writer(target.url)
    assert writer.list() == {} and writer.list_uploads() == []
    assert target.stored_keys() == []  # nothing at all: no record, probe or part
