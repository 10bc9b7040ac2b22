"""`convert_checkpoint(src, "s3://..." | "gs://...")`: the files a
conversion into a directory writes, byte for byte, uploaded in parts in the
target files' order; from a local or a remote source (S3 to the GCS
emulator, no local copy); clear errors before any byte is uploaded."""

import os

import keras
import keras_hub
import numpy as np
import pytest

from keras_hub_dist import SaveError, convert_checkpoint, load_sharded_preset
from keras_hub_dist import write_synthetic_preset
from keras_hub_dist.formats import checksums
from keras_hub_dist.storage import uploads
from keras_hub_dist.cli import main as cli
from keras_hub_dist.convert import into_bucket as convert_remote
from remote import stores
from tests.remote.test_remote_save import _local_files, _objects

# About 24 MB of float32: several 5 MiB parts (moto's real minimum).
WIDE = dict(vocabulary_size=20_000, num_layers=2, num_query_heads=8, num_key_value_heads=4,
            hidden_dim=128, intermediate_dim=256)


@pytest.fixture(scope="module", autouse=True)
def small_parts():
    """5 MiB parts and checksum chunks, for the local conversions too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checksums, "CHUNK_BYTES", 5 << 20)
        yield


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A KerasHub preset, and the Hugging Face checkpoint converted from it
    (two files), with their conversions into directories."""
    root = tmp_path_factory.mktemp("remote_convert")
    keras_dir = write_synthetic_preset(str(root / "keras"), keras_hub.models.Llama3Backbone,
                                       dtype="float32", seed=5, **WIDE)
    hf_dir = str(root / "hf")
    convert_checkpoint(keras_dir, hf_dir, to="huggingface", max_shard_size=0.012, progress=False)
    convert_checkpoint(hf_dir, str(root / "keras_again"), to="keras", progress=False)
    return {"keras": keras_dir, "hf": hf_dir, "keras_again": str(root / "keras_again")}


@pytest.fixture(scope="module")
def keras_again_weights(sources):
    """The local conversion back to KerasHub, loaded (verified) on (2, 4):
    one reference for both stores' conversions."""
    keras.distribution.set_distribution(None)
    model = load_sharded_preset(sources["keras_again"], mesh=(2, 4), verify=True, progress=False)
    keras.distribution.set_distribution(None)
    return [np.asarray(v.value) for v in model.weights]


def _same(remote, local):
    assert sorted(remote) == sorted(local)
    for name in local:
        assert remote[name] == local[name], name


def _same_preset(url, remote, local_dir, local_weights):
    """A KerasHub preset holds its layers' auto-numbered names (each
    conversion builds the model anew), so as for a local conversion: the
    same files, the weights files of the same sizes, the weights bitwise."""
    local = _local_files(local_dir)
    assert sorted(remote) == sorted(local)
    assert all(len(remote[n]) == len(local[n]) for n in local if n.endswith(".h5"))
    ours = load_sharded_preset(url, mesh=(2, 4), verify=True, progress=False)
    assert len(ours.weights) == len(local_weights)
    for a, b in zip(ours.weights, local_weights):
        np.testing.assert_array_equal(np.asarray(a.value), b)


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_convert_into_a_bucket_is_the_local_conversion(sources, keras_again_weights, request, scheme, tmp_path,
                                                       monkeypatch):
    server = request.getfixturevalue("s3" if scheme == "s3" else "gcs")
    bucket = stores.fresh_bucket(server)
    monkeypatch.chdir(tmp_path)
    orders = []
    real = convert_remote.buffers_needed

    def buffers_needed(spans, part_bytes, num_threads):
        orders.append(spans)
        return real(spans, part_bytes, num_threads)

    monkeypatch.setattr(convert_remote, "buffers_needed", buffers_needed)
    convert_checkpoint(sources["keras"], f"{scheme}://{bucket}/hf", to="huggingface", max_shard_size=0.012,
                       progress=False)
    convert_checkpoint(sources["hf"], f"{scheme}://{bucket}/keras", to="keras", progress=False)
    assert os.listdir(tmp_path) == []  # nothing written to the working directory
    hf, keras_preset = (uploads.open_writer(f"{scheme}://{bucket}/{p}") for p in ("hf", "keras"))
    _same(_objects(hf), _local_files(sources["hf"]))
    _same_preset(f"{scheme}://{bucket}/keras", _objects(keras_preset), sources["keras_again"], keras_again_weights)
    assert hf.list_uploads() == [] and keras_preset.list_uploads() == []
    # The tiles' order keeps few parts open, even with parts of 64 KiB (about
    # 190 per file): at most 3 that several tiles write, and 3 per thread.
    assert len(orders) == 2 and all(real(spans, 64 << 10, 2) <= 3 + 3 * 2 for spans in orders), \
        [real(spans, 64 << 10, 2) for spans in orders]


def test_convert_s3_to_gcs_with_no_local_copy(sources, s3, gcs, monkeypatch, tmp_path):
    # The source preset's own files, put in the bucket as they are (a remote
    # save of it is test_remote_save's).
    src = s3.upload_dir(sources["keras"], stores.fresh_bucket(s3), "keras")
    dst = f"gs://{stores.fresh_bucket(gcs)}/hf"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    convert_checkpoint(src, dst, to="huggingface", max_shard_size=0.012, progress=False)
    assert os.listdir(tmp_path) == []
    # The preset saved from a backbone has no tokenizer to carry over (nor
    # its token ids in config.json): the weights and their index are the same.
    remote, local = _objects(uploads.open_writer(dst)), _local_files(sources["hf"])
    weights = sorted(n for n in local if "safetensors" in n)
    assert len(weights) == 3 and all(remote[n] == local[n] for n in weights)


def test_bad_targets_fail_before_any_upload(sources, s3):
    bucket = stores.fresh_bucket(s3)
    with pytest.raises(SaveError, match="huggingface-cli upload"):
        convert_checkpoint(sources["keras"], "hf://owner/name", to="huggingface")
    with pytest.raises(SaveError, match="nonexistent-bucket"):
        convert_checkpoint(sources["keras"], "s3://nonexistent-bucket/x", to="huggingface")
    uploads.open_writer(f"s3://{bucket}/p").put("config.json", b"{}")
    with pytest.raises(SaveError, match="overwrite=True"):
        convert_checkpoint(sources["keras"], f"s3://{bucket}/p", to="huggingface")
    assert sorted(uploads.open_writer(f"s3://{bucket}/p").list()) == ["config.json"]
    # The command line: the same errors (exit status 2), and the same result.
    assert cli.main(["convert", sources["keras"], f"s3://{bucket}/p", "--to", "huggingface"]) == 2
    assert cli.main(["convert", sources["keras"], f"s3://{bucket}/p", "--to", "huggingface", "--overwrite",
                     "--max_shard_size", "0.012", "--no-progress"]) == 0
    assert uploads.open_writer(f"s3://{bucket}/p").list_uploads() == []
    assert _objects(uploads.open_writer(f"s3://{bucket}/p")) == _local_files(sources["hf"])
