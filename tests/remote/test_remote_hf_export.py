"""`save_sharded_preset(model, "s3://..." | "gs://...", format="huggingface")`:
the local export's files byte for byte, uploaded in parts in the files'
order with bounded part buffers; config.json last; a failure aborts every
upload and keeps the old preset; clear errors before any byte is uploaded."""

import hashlib
import json
import time

import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES

from keras_hub_dist import SaveError, StaleStagingWarning, load_sharded_preset, save_sharded_preset, write_synthetic_preset
from keras_hub_dist.save import hf_export, remote_publish
from keras_hub_dist.save.hf_part_plan import peak_open_parts, plan_steps
from keras_hub_dist.storage import uploads
from remote import stores
from tests.remote.test_remote_save import _local_files, _objects

# Over 20 MiB of float32 (an untied head beside the embedding): with 5 MiB
# parts (moto's real minimum) several parts, and with 2 shards two files.
WIDE = dict(vocabulary_size=20_000, num_layers=2, num_query_heads=8, num_key_value_heads=8,
            hidden_dim=128, intermediate_dim=256)


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    return write_synthetic_preset(str(tmp_path_factory.mktemp("remote_hf") / "llama"),
                                  keras_hub.models.Llama3Backbone, dtype="float32", seed=3, **WIDE)


@pytest.fixture(scope="module")
def models(preset, tmp_path_factory):
    """Per mesh: the model and its local export (12 MB shards: two files)."""
    out = {}

    def get(mesh):
        if mesh not in out:
            model = load_sharded_preset(preset, mesh=mesh, progress=False)
            local = str(tmp_path_factory.mktemp("local_hf") / "export")
            save_sharded_preset(model, local, format="huggingface", max_shard_size=0.012, progress=False)
            out[mesh] = model, _local_files(local)
        return out[mesh]

    return get


def _assert_same(remote, local):
    assert sorted(remote) == sorted(local)
    for name in local:
        assert hashlib.sha256(remote[name]).digest() == hashlib.sha256(local[name]).digest(), name


# Every mesh into S3; GCS (the same export through another writer) on (2, 4).
@pytest.mark.parametrize("store, mesh", [("s3", m) for m in MESH_SHAPES] + [("gs", (2, 4))], indirect=["store"])
def test_export_into_a_bucket_is_the_local_export_and_loads_verified(models, store, mesh, small_parts):
    _, url, writer = store
    model, local = models(mesh)
    save_sharded_preset(model, url, format="huggingface", max_shard_size=0.012, progress=False)
    _assert_same(_objects(writer), local)
    assert len([n for n in local if n.endswith(".safetensors")]) == 2
    assert writer.list_uploads() == [] and not [n for n in writer.list() if n.startswith(".")]
    reloaded = load_sharded_preset(url, mesh=(2, 4), verify=True, progress=False)
    for a, b in zip(model.weights, reloaded.weights):
        np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))


@pytest.mark.parametrize("mesh", MESH_SHAPES)
def test_file_order_keeps_few_parts_open(models, mesh):
    """The steps write every byte of every tensor once, and taken in file
    order keep at most three parts open at once, whatever the parts' size
    (64 KiB: about 370 parts; 256 KiB) and the blocks' layout."""
    model, _ = models(mesh)
    mapping, layout, weight_set = hf_export.checked_mapping(model, None, None, 0.012)
    indices = hf_export.device_indices_of(mapping, weight_set)
    plans = [hf_export.plan_blocks(mapping, layout, "", indices, process_index=0, process_count=1)[0]]
    for part in (64 << 10, 256 << 10):
        steps = plan_steps(plans, [f.name for f in layout.files], part // 4)
        assert sum(s.runs.nbytes for s in steps) == layout.total_size
        assert all(s.runs.nbytes <= part // 4 or s.stop - s.first == 1 for s in steps)
        assert peak_open_parts(steps, 0, part) <= 3


def test_lora_merged_and_bfloat16(preset, s3, tmp_path):
    model = load_sharded_preset(preset, mesh=(2, 4), progress=False)
    model.enable_lora(rank=2)
    rng = np.random.default_rng(0)
    for variable in model.trainable_variables:
        variable.assign(rng.standard_normal(variable.shape).astype("float32") * 0.1)
    url = f"s3://{stores.fresh_bucket(s3)}/lora"
    save_sharded_preset(model, url, format="huggingface", dtype="bfloat16", progress=False)
    save_sharded_preset(model, str(tmp_path / "local"), format="huggingface", dtype="bfloat16", progress=False)
    _assert_same(_objects(uploads.open_writer(url)), _local_files(str(tmp_path / "local")))


def test_failure_aborts_and_overwrite_replaces_a_keras_preset(models, store, small_parts, monkeypatch):
    _, url, writer = store
    model, local = models((2, 4))
    save_sharded_preset(model, url)  # a KerasHub preset in place
    old = _objects(writer)
    real = stores.fail_second_part(monkeypatch, writer)
    with pytest.raises(SaveError, match="injected by the test"):
        save_sharded_preset(model, url, format="huggingface", max_shard_size=0.012, overwrite=True)
    assert _objects(writer) == old and writer.list_uploads() == []
    monkeypatch.setattr(type(writer), "upload_part", real)
    save_sharded_preset(model, url, format="huggingface", max_shard_size=0.012, overwrite=True)
    _assert_same(_objects(writer), local)  # the old preset's files are gone


def test_killed_export_uploads_aborted_by_the_next(models, s3, gcs, small_parts, monkeypatch):
    """An export killed outright left a recorded upload and an unrecorded
    one: the next export to the target aborts both, names them, and writes
    the local export's files (into S3 and GCS, after one wait)."""
    model, local = models((2, 4))
    monkeypatch.setattr(remote_publish, "LEASE_SECONDS", 3.0)  # 3 s: see test_remote_save
    targets = []
    for scheme, server in (("s3", s3), ("gs", gcs)):
        url = f"{scheme}://{stores.fresh_bucket(server)}/presets/tuned"
        writer = uploads.open_writer(url)
        dead = writer.create_upload("model-00001-of-00002.safetensors")
        writer.put(".khd-save-0badc0ffee00.json", json.dumps(
            {"host": "gone", "pid": 1, "uploads": {"model-00001-of-00002.safetensors": dead}}).encode())
        writer.create_upload("model-00002-of-00002.safetensors")  # no record claims it
        targets.append((url, writer, dead))
    time.sleep(3.2)  # every lease lapses (the stores' clocks)
    for url, writer, dead in targets:
        with pytest.warns(StaleStagingWarning) as warned:
            save_sharded_preset(model, url, format="huggingface", max_shard_size=0.012, progress=False)
        text = str(warned[0].message)
        assert f"'model-00001-of-00002.safetensors' ({dead[:12]}" in text and "0badc0ffee00" in text, text
        assert "'model-00002-of-00002.safetensors' started" in text, text
        assert writer.list_uploads() == []
        _assert_same(_objects(writer), local)


def test_bad_targets_fail_before_any_upload(models, s3):
    model, _ = models((1, 8))
    with pytest.raises(SaveError, match="nonexistent-bucket"):
        save_sharded_preset(model, "s3://nonexistent-bucket/x", format="huggingface")
    with pytest.raises(SaveError, match="huggingface-cli upload"):
        save_sharded_preset(model, "hf://owner/name", format="huggingface")
    bucket = stores.fresh_bucket(s3)
    save_sharded_preset(model, f"s3://{bucket}/p", format="huggingface")
    with pytest.raises(SaveError, match="overwrite=True"):
        save_sharded_preset(model, f"s3://{bucket}/p", format="huggingface")
    with pytest.raises(SaveError, match="is an object|a file"):
        save_sharded_preset(model, f"s3://{bucket}/p/config.json", format="huggingface")
    with pytest.raises(SaveError, match="durable=False"):
        save_sharded_preset(model, f"s3://{bucket}/q", format="huggingface", durable=True)
    assert uploads.open_writer(f"s3://{bucket}/q").list() == {}
