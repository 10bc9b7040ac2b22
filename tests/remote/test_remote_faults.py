"""Remote loads under faults and bad input: retried and resumed when a
failure may pass, a clear error naming the URL, the byte range and what to
do when it will not, and nothing left on the devices either way."""

import os
import sys

import keras
import keras_hub
import numpy as np
import pytest

from keras_hub_dist import PresetError, RemoteDownloadWarning, load_sharded_preset
from keras_hub_dist import write_synthetic_preset
from keras_hub_dist import _compat
from keras_hub_dist.formats import keras_h5
from keras_hub_dist.storage import ranged_http
from keras_hub_dist.load import loader

SMALL = dict(vocabulary_size=4096, num_layers=1, num_query_heads=8, num_key_value_heads=8,
             hidden_dim=64, intermediate_dim=128)


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    """A KerasHub Llama preset of ~1.3 MB (a 1 MB embedding)."""
    path = write_synthetic_preset(
        str(tmp_path_factory.mktemp("faults") / "llama"), keras_hub.models.LlamaBackbone,
        dtype="float32", seed=7, **SMALL)
    return path


@pytest.fixture(scope="module")
def reference(preset):
    model = load_sharded_preset(preset, mesh=(2, 4), progress=False)
    keras.distribution.set_distribution(None)
    return [np.asarray(v.value) for v in model.weights]


@pytest.fixture
def quick_retries(monkeypatch):
    """Retries without waiting (the policy's backoff is not what is tested)."""
    monkeypatch.setattr(ranged_http, "DEFAULT_RETRY", ranged_http.RetryPolicy(backoff_s=0.001, max_backoff_s=0.005))


def _assert_equal(model, reference):
    assert len(model.weights) == len(reference)
    for variable, expected in zip(model.weights, reference):
        np.testing.assert_array_equal(np.asarray(variable.value), expected, err_msg=variable.path)


@pytest.mark.parametrize("scheme", ["http", "s3"])
def test_flaky_server_gives_a_bitwise_correct_load(preset, reference, remote_checkpoint, scheme, quick_retries):
    # 10% of requests answered 503 and 5% of bodies cut short: every range
    # is retried, and a cut one resumed from the byte it reached.
    remote = remote_checkpoint(preset, schemes=[scheme], fail_rate=0.1, cut_rate=0.05,
                               retry_after=0, seed=3)[scheme]
    server, forced = remote.server, []
    draw = server._draw

    def one_of_each(kind, method, path, range_header):
        # Beside the random faults, the weights file's first ranged GET is
        # cut for sure and its second refused, whatever the seed draws:
        # both paths of the retry are taken in every run.
        if path.endswith("model.weights.h5") and range_header and kind == "fail":
            forced.append(range_header)
        if len(forced) == 1 and range_header == forced[0]:
            return {"fail": 1.0, "cut": 0.0}.get(kind, draw(kind, method, path, range_header))
        if len(forced) == 2 and range_header == forced[1] and kind == "fail":
            return 0.0
        return draw(kind, method, path, range_header)

    server._draw = one_of_each
    model = load_sharded_preset(remote.url, mesh=(2, 4), progress=False)
    _assert_equal(model, reference)
    log = remote.requests("model.weights.h5")
    assert {"cut", "fail"} <= {r.fault for r in log}, log
    # A cut body's bytes are not asked for again (each retry resumes where
    # its body stopped): beside the metadata reads, each tensor byte comes
    # once, but what a failed attempt sent before it failed.
    datasets = keras_h5.read_datasets([os.path.join(preset, "model.weights.h5")]).values()
    tensor_bytes = sum(d.nbytes for d in datasets)
    metadata = (2 + len(datasets)) * 64 * 1024
    wasted = sum(r.bytes_sent for r in log if r.fault)
    sent = remote.bytes_sent("model.weights.h5", process=0)
    assert tensor_bytes <= sent <= tensor_bytes + metadata + wasted


def test_a_server_that_always_fails_gives_the_error_and_leaves_nothing(
    preset, remote_checkpoint, clean_state, quick_retries
):
    remote = remote_checkpoint(preset, schemes=["http"])["http"]
    answered = []

    def fail_after_the_index(path):
        # The file's size and HDF5 metadata are read; then every request fails.
        if path.endswith("model.weights.h5"):
            answered.append(path)
            if len(answered) > 3:
                return 503
        return None

    remote.server.status_for = fail_after_the_index
    with clean_state(), pytest.raises(PresetError) as error:
        load_sharded_preset(remote.url, mesh=(1, 8), progress=False)
    message = str(error.value)
    assert "model.weights.h5" in message and "HTTP 503" in message
    assert "failed 8 times" in message and "retry later" in message


def test_access_refused_names_the_credentials_used(preset, remote_checkpoint, clean_state):
    remote = remote_checkpoint(preset, schemes=["s3"])["s3"]
    remote.server.status_for = lambda path: 403 if path.endswith("model.weights.h5") else None
    with clean_state(), pytest.raises(PresetError) as error:
        load_sharded_preset(remote.url, mesh=(1, 8), progress=False)
    message = str(error.value)
    assert "HTTP 403" in message and "model.weights.h5" in message
    assert "Credentials used: AWS credentials from botocore's chain (env)" in message
    assert "provide other credentials" in message


def test_a_gated_hub_model_names_the_token_source(preset, remote_checkpoint, clean_state, monkeypatch):
    remote = remote_checkpoint(preset, schemes=["hf"])["hf"]
    remote.server.require_token = "right"
    monkeypatch.setenv("HF_TOKEN", "wrong")
    with clean_state(), pytest.raises(PresetError, match=r"HTTP 403.*HF_TOKEN from the environment"):
        load_sharded_preset(remote.url, mesh=(1, 8), progress=False)
    monkeypatch.setenv("HF_TOKEN", "right")
    load_sharded_preset(remote.url, mesh=(1, 8), progress=False)


def test_missing_files_name_what_the_location_holds(preset, remote_checkpoint, clean_state):
    remote = remote_checkpoint(preset, schemes=["gs"])["gs"]
    with clean_state(), pytest.raises(PresetError) as error:
        load_sharded_preset(remote.url + "-not-there", mesh=(1, 8), progress=False)
    assert "has no config.json" in str(error.value) and "-not-there" in str(error.value)
    remote = remote_checkpoint(preset, schemes=["s3"])["s3"]
    remote.server.status_for = lambda path: 404 if path.endswith("model.weights.h5") else None
    with clean_state(), pytest.raises(PresetError) as error:
        load_sharded_preset(remote.url, mesh=(1, 8), progress=False)
    message = str(error.value)
    assert "has no weights" in message or "does not exist" in message


@pytest.mark.parametrize("scheme", ["http", "s3", "gs"])
def test_an_object_replaced_during_the_load_is_refused(
    preset, remote_checkpoint, clean_state, scheme, monkeypatch, request
):
    remote = remote_checkpoint(preset, schemes=[scheme])[scheme]
    data = open(os.path.join(preset, "model.weights.h5"), "rb").read()
    changed = data[:-1] + bytes([data[-1] ^ 1])

    def upload_new_version():
        key = remote.key("model.weights.h5")
        bucket = remote.url.split("://", 1)[1].split("/", 1)[0]
        if scheme == "http":
            remote.server.put(key, changed)
        elif scheme == "s3":
            request.getfixturevalue("moto_server").client().put_object(Bucket=bucket, Key=key, Body=changed)
        else:
            request.getfixturevalue("gcs_server").upload(bucket, key, changed)

    # The new version lands after the file was indexed (size and version
    # pinned) and before a weight byte is read: the reads must not mix.
    real = loader.execute_plan

    def replacing(*args, **kwargs):
        upload_new_version()
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "execute_plan", replacing)
    with clean_state(), pytest.raises(PresetError, match="changed while it was being loaded"):
        load_sharded_preset(remote.url, mesh=(1, 8), progress=False)


def test_a_truncated_remote_file_gets_the_local_error(preset, remote_checkpoint, clean_state, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(preset, broken)
    weights = broken / "model.weights.h5"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    remote = remote_checkpoint(str(broken), schemes=["http"])["http"]
    with clean_state(), pytest.raises(PresetError, match="is truncated"):
        load_sharded_preset(remote.url, mesh=(1, 8), progress=False)


def test_no_weight_file_is_written_to_disk(preset, reference, remote_checkpoint, tmp_path, monkeypatch):
    """During a remote load no file over 1 MB appears under HOME, TMPDIR or
    the caches, and no weights file is opened for writing anywhere (every
    open is seen by an audit hook, at the event)."""
    for name in ("HOME", "TMPDIR", "HF_HOME", "KERAS_HOME", "XDG_CACHE_HOME"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
        os.makedirs(tmp_path / name.lower())
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmpdir"))
    remote = remote_checkpoint(preset, schemes=["s3"])["s3"]
    assert os.path.getsize(os.path.join(preset, "model.weights.h5")) > 1 << 20
    written = []
    watching = [True]

    def audit(event, args):
        if watching[0] and event == "open" and args[0] is not None:
            mode, flags = args[1], args[2]
            if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR)
            ):
                written.append(os.fspath(args[0]) if not isinstance(args[0], int) else "")

    sys.addaudithook(audit)
    try:
        model = load_sharded_preset(remote.url, mesh=(2, 4), progress=False)
    finally:
        watching[0] = False
    _assert_equal(model, reference)
    assert not [w for w in written if w.endswith((".h5", ".safetensors"))], written
    for root, _, files in os.walk(tmp_path):
        for name in files:
            assert os.path.getsize(os.path.join(root, name)) <= 1 << 20, (root, name)


def test_kaggle_handles_download_whole_files_and_say_so(preset, monkeypatch):
    # KerasHub's downloader fetches kaggle:// files whole into its cache;
    # here its getter returns the local preset's files.
    handle = "kaggle://someone/llama/keras/tiny"
    monkeypatch.setattr(_compat, "preset_file", lambda ref, name: os.path.join(preset, name))
    monkeypatch.setattr(_compat, "preset_has_file",
                        lambda ref, name: os.path.exists(os.path.join(preset, name)))
    with pytest.warns(RemoteDownloadWarning, match="downloads whole weight files"):
        load_sharded_preset(handle, mesh=(1, 8), progress=False)
