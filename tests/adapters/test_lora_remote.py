"""`save_lora_adapter(model, "s3://..." | "gs://...")`: the local save's
files byte for byte, uploaded straight from the processes (S3 by moto, GCS
by gcp-storage-emulator, on loopback: the servers of tests/remote/), read
back by `load_sharded_preset(base, lora_adapter=url)` bit for bit; a failed
part upload aborts every upload and keeps the old adapter; a target that
holds an adapter is refused, without `overwrite`, before any upload. Two
processes x 4 devices (`lora_remote_worker.py`, one job): a write failing
on one process leaves nothing; the replicated factors' blocks written by
both into the one part, combined on its owner.

The model is the tiny Qwen3 of tests/formats/hf (2 layers, hidden 64) with
PEFT-form LoRA on its seven projections: an adapter of a few kB, one part,
as real adapters (a few MB) are too: under S3's 5 MiB minimum part, which
only the last part may be.
"""

import json
import pathlib
import sys

import keras
import numpy as np
import pytest

import keras_hub_dist
from keras_hub_dist import SaveError
from keras_hub_dist.formats import checksums
from keras_hub_dist.formats.base import ByteRuns
from keras_hub_dist.save.hf_part_plan import Step, unwritten
from keras_hub_dist.storage import uploads
from remote import conftest as remote_fixtures
from remote import stores
from tests.formats.hf import dense
from tests.formats.hf.writer import write_hf_checkpoint
from tests.multiprocess_jobs import run_job
from tests.remote.test_remote_save import _local_files, _objects

# The S3 (moto) and GCS (gcp-storage-emulator) fixtures of tests/remote/, as this module's.
moto_server, gcs_server = remote_fixtures.moto_server, remote_fixtures.gcs_server
s3, gcs = remote_fixtures.s3, remote_fixtures.gcs

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
WORKER = pathlib.Path(__file__).with_name("lora_remote_worker.py")
FILES = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.safetensors.index.json"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    config, tensors = dense.hf_checkpoint("qwen3", tied=True, dtype="float32")
    return write_hf_checkpoint(str(tmp_path_factory.mktemp("lora_remote") / "qwen3"), config, tensors)


@pytest.fixture(scope="module")
def tuned(base, tmp_path_factory):
    """Per mesh (and form): the base with random LoRA factors, and its local
    adapter. PEFT's form (`keras_hub_dist.enable_lora`, every projection at
    rank 3), or Keras's (`backbone.enable_lora(2)`: query and value, one
    update per head, so the file has zeros the save never writes: value's
    ranks padded to query's, lora_B off its diagonal)."""
    out = {}

    def get(mesh, keras_form=False):
        if (mesh, keras_form) not in out:
            keras.distribution.set_distribution(None)
            backbone = keras_hub_dist.load_sharded_preset(base, mesh=mesh, progress=False)
            if keras_form:
                backbone.enable_lora(rank=2)
            else:
                keras_hub_dist.enable_lora(backbone, rank=3, lora_alpha=5, target_modules=SEVEN)
            rng = np.random.default_rng(2)
            for variable in _lora(backbone).values():
                variable.assign(rng.normal(scale=0.02, size=variable.shape).astype("float32"))
            local = str(tmp_path_factory.mktemp("local_adapter") / "adapter")
            keras_hub_dist.save_lora_adapter(backbone, local, base_model_name_or_path=base, progress=False)
            out[mesh, keras_form] = backbone, _local_files(local)
        return out[mesh, keras_form]

    return get


def _lora(model):
    return {v.path: v for v in model.weights if "lora_" in v.path}


def _target(server, scheme, prefix="adapters/v1"):
    url = f"{scheme}://{stores.fresh_bucket(server)}/{prefix}"
    return url, uploads.open_writer(url)


def _assert_round_trip(backbone, base, url, mesh):
    keras.distribution.set_distribution(None)
    again = keras_hub_dist.load_sharded_preset(base, mesh=mesh, progress=False, lora_adapter=url)
    saved = {p: np.asarray(v.value).tobytes() for p, v in _lora(backbone).items()}
    assert {p: np.asarray(v.value).tobytes() for p, v in _lora(again).items()} == saved


def _assert_nothing_left(server, writer, bucket):
    """No object in the bucket (no owner record, no part), no open upload."""
    assert server.list_names(bucket) == []
    assert writer.list_uploads() == []


@pytest.mark.parametrize("mesh", [(1, 8), (2, 4), (8, 1)])
def test_s3_adapter_is_the_local_one_and_loads_bitwise(tuned, base, s3, mesh):
    backbone, local = tuned(mesh)
    url, writer = _target(s3, "s3")
    keras_hub_dist.save_lora_adapter(backbone, url, base_model_name_or_path=base, progress=False)
    assert sorted(local) == FILES
    assert _objects(writer) == local
    assert writer.list_uploads() == [] and not [n for n in writer.list() if n.startswith(".")]
    _assert_round_trip(backbone, base, url, (2, 4))


def test_gcs_adapter_is_the_local_one_and_loads_bitwise(tuned, base, gcs):
    backbone, local = tuned((2, 4))
    url, writer = _target(gcs, "gs")
    keras_hub_dist.save_lora_adapter(backbone, url, base_model_name_or_path=base, progress=False)
    assert _objects(writer) == local
    assert writer.list_uploads() == [] and not [n for n in writer.list() if n.startswith(".")]
    _assert_round_trip(backbone, base, url, (8, 1))


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_keras_form_with_padding_is_the_local_one(tuned, base, scheme, request, tmp_path):
    server = request.getfixturevalue("s3" if scheme == "s3" else "gcs")
    backbone, local = tuned((2, 4), keras_form=True)
    config = json.loads(local["adapter_config.json"])
    assert config["target_modules"] == ["q_proj", "v_proj"] and config["r"] == 2 * 8  # 8 query heads
    url, writer = _target(server, scheme)
    keras_hub_dist.save_lora_adapter(backbone, url, base_model_name_or_path=base, progress=False)
    assert _objects(writer) == local
    # Loaded, it is PEFT's form (rank 16, lora_B block diagonal): the same
    # factors as the local adapter's, bit for bit.
    folder = tmp_path / "local"
    folder.mkdir()
    for name, data in local.items():
        (folder / name).write_bytes(data)
    loaded = {}
    for where in (url, str(folder)):
        keras.distribution.set_distribution(None)
        model = keras_hub_dist.load_sharded_preset(base, mesh=(1, 8), progress=False, lora_adapter=where)
        loaded[where] = {p: np.asarray(v.value).tobytes() for p, v in _lora(model).items()}
    assert loaded[url] and loaded[url] == loaded[str(folder)]


def test_unwritten_ranges_are_the_holes_past_the_header():
    runs = [ByteRuns(10, 4, (3,), (8,)), ByteRuns(30, 5, (), ()), ByteRuns(4, 6, (), ())]
    steps = [Step(p, "v", 0, 0, f, 0, 1, r) for p, f, r in zip((0, 1, 0), ("f", "f", "g"), runs)]
    # f: header 0-8, runs 10-14, 18-22, 26-30 and 30-35 of 40 bytes; g: whole.
    assert unwritten(steps, {"f": 40, "g": 10}, {"f": 8, "g": 4}) == {"f": [(8, 10), (14, 18), (22, 26), (35, 40)]}


@pytest.mark.parametrize("scheme", ["s3", "gs"])
def test_failed_part_aborts_every_upload(tuned, base, scheme, request, monkeypatch):
    """4 KiB parts, so that the adapter has a second part to fail: into an
    empty prefix nothing is left; over an adapter (`overwrite=True`) the old
    one stays whole, and the next save replaces it."""
    server = request.getfixturevalue("s3" if scheme == "s3" else "gcs")
    backbone, local = tuned((2, 4))
    url, writer = _target(server, scheme)
    bucket = url.split("/")[2]
    with monkeypatch.context() as patch:
        patch.setattr(checksums, "CHUNK_BYTES", 4 << 10)
        assert len(local["adapter_model.safetensors"]) > 2 * (4 << 10)
        stores.fail_second_part(patch, writer)
        with pytest.raises(SaveError, match="injected by the test"):
            keras_hub_dist.save_lora_adapter(backbone, url, progress=False)
        _assert_nothing_left(server, writer, bucket)

    keras_hub_dist.save_lora_adapter(backbone, url, progress=False)
    old = _objects(writer)
    with monkeypatch.context() as patch:
        patch.setattr(checksums, "CHUNK_BYTES", 4 << 10)
        stores.fail_second_part(patch, writer)
        with pytest.raises(SaveError, match="injected by the test"):
            keras_hub_dist.save_lora_adapter(backbone, url, base_model_name_or_path=base, overwrite=True,
                                             progress=False)
    assert _objects(writer) == old and writer.list_uploads() == []
    keras_hub_dist.save_lora_adapter(backbone, url, base_model_name_or_path=base, overwrite=True, progress=False)
    assert _objects(writer) == local


def test_bad_targets_fail_before_any_upload(tuned, base, s3, monkeypatch):
    backbone, local = tuned((2, 4))
    url, writer = _target(s3, "s3")
    keras_hub_dist.save_lora_adapter(backbone, url, base_model_name_or_path=base, progress=False)
    started = []
    real = type(writer).create_upload
    monkeypatch.setattr(type(writer), "create_upload",
                        lambda self, *a, **k: started.append(a) or real(self, *a, **k))
    with pytest.raises(SaveError, match="to hold no adapter.*Pass overwrite=True"):
        keras_hub_dist.save_lora_adapter(backbone, url, progress=False)
    with pytest.raises(SaveError, match="nonexistent-bucket"):
        keras_hub_dist.save_lora_adapter(backbone, "s3://nonexistent-bucket/adapter", progress=False)
    with pytest.raises(SaveError, match="huggingface-cli upload"):
        keras_hub_dist.save_lora_adapter(backbone, "hf://owner/adapter", progress=False)
    with pytest.raises(SaveError, match="durable=False"):
        keras_hub_dist.save_lora_adapter(backbone, url + "2", durable=True, progress=False)
    no_lora = keras_hub_dist.load_sharded_preset(base, mesh=(2, 4), progress=False)
    with pytest.raises(SaveError, match="no LoRA-enabled layer"):
        keras_hub_dist.save_lora_adapter(no_lora, url + "3", progress=False)
    assert started == []
    assert _objects(writer) == local and writer.list_uploads() == []
    assert uploads.open_writer(url + "2").list() == {} and uploads.open_writer(url + "3").list() == {}
    assert json.loads(local["adapter_config.json"])["base_model_name_or_path"] == base


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs Linux and loopback")
def test_two_processes_upload_the_local_adapter_and_a_failing_write_aborts(base, s3, tmp_path):
    """2 processes x 4 devices, mesh 1 x 8, one job. First process 1's
    write into its part buffer raises: both raise, that bucket holds
    nothing (no adapter, owner record or part), no upload is left open.
    Then the save that goes through: the factors are replicated on both,
    each writes its share of the one part (under 5 MiB) into a zeroed
    buffer, the part is combined on its owner, which alone uploads it."""
    failing, failing_writer = _target(s3, "s3")
    url, writer = _target(s3, "s3")
    keras.distribution.set_distribution(None)
    reports = run_job(WORKER, 2, 4, [base, "1x8", url, tmp_path, failing], tmp_path)
    failed = [r["failed"] for r in reports]
    assert all(f["error"] and "injected by the test" in f["error"] for f in failed), failed
    # Process 0 may have uploaded the combined part (the collective goes on
    # after an error): the upload is aborted, nothing is left.
    _assert_nothing_left(s3, failing_writer, failing.split("/")[2])

    assert [r["error"] for r in reports] == [None, None]
    local = _local_files(str(tmp_path / "local"))
    assert sorted(local) == FILES and _objects(writer) == local
    parts = [[(name, number) for name, number, _ in r["uploaded"]] for r in reports]
    assert sorted(parts[0] + parts[1]) == [("adapter_model.safetensors", 1)]
    assert reports[0]["combined"] == reports[1]["combined"] == [1]
    assert writer.list_uploads() == [] and not [n for n in writer.list() if n.startswith(".")]
