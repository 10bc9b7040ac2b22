"""Remote checkpoints (s3://, gs://, hf://, http://) load straight into their
shards, bitwise equal to the same checkpoint loaded from local disk, reading
only the bytes the devices hold plus the files' metadata.

Every server runs on 127.0.0.1 (tests/remote/conftest.py), each behind a
`RangeServer` that logs every request with its range: bytes are counted at
the server, per file.
"""

import functools
import os

import jax
import keras
import keras_hub
import numpy as np
import pytest
from conftest import MESH_SHAPES

from keras_hub_dist import convert_checkpoint, load_sharded_preset, save_sharded_preset, write_synthetic_preset
from keras_hub_dist.formats import keras_h5, safetensors_files
from tests.formats.hf import dense, moe
from tests.formats.hf.writer import write_hf_checkpoint
from tests.convert.test_convert import _datasets

SCHEMES = ("s3", "gs", "hf", "http")
SMALL = dict(vocabulary_size=256, num_layers=2, num_query_heads=8, num_key_value_heads=8,
             hidden_dim=64, intermediate_dim=128)


def _keras_multi_file(root, name, cls, dtype, **config):
    """A KerasHub preset whose weights are Keras's multi-file set."""
    single = write_synthetic_preset(str(root / f"{name}_one"), cls, dtype=dtype, seed=3, **config)
    model = load_sharded_preset(single, mesh=(1, 8), progress=False)
    keras.distribution.set_distribution(None)
    save_sharded_preset(model, str(root / name), max_shard_size=0.0004)
    assert os.path.exists(root / name / "model.weights.json")
    return str(root / name)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Four checkpoints: KerasHub single-file f32 (dense), KerasHub
    multi-file bf16 (MoE), HF single-file bf16 (dense), HF index-sharded f32
    (MoE)."""
    root = tmp_path_factory.mktemp("remote_sources")
    out = {
        "keras_dense_f32": write_synthetic_preset(
            str(root / "keras_dense"), keras_hub.models.LlamaBackbone, dtype="float32",
            seed=1, **SMALL),
        "keras_moe_bf16_multi": _keras_multi_file(
            root, "keras_moe", keras_hub.models.MixtralBackbone, "bfloat16",
            **SMALL, num_experts=8, top_k=2),
    }
    config, tensors = dense.hf_checkpoint("llama", tied=False, dtype="bfloat16", seed=2)
    out["hf_dense_bf16"] = write_hf_checkpoint(str(root / "hf_dense"), config, tensors)
    config, tensors = moe.hf_checkpoint("qwen3_moe", tied=False, dtype="float32", seed=4)
    out["hf_moe_f32_index"] = write_hf_checkpoint(str(root / "hf_moe"), config, tensors, num_shards=3)
    keras.distribution.set_distribution(None)
    return out


@pytest.fixture(scope="module")
def references(checkpoints):
    """`references(kind, mesh)`: the weights of the local checkpoint loaded
    on `mesh`, once per module: one reference for the four schemes (it does
    not depend on where the remote copy is served from)."""

    @functools.cache
    def get(kind, mesh):
        keras.distribution.set_distribution(None)
        weights = _weights(load_sharded_preset(checkpoints[kind], mesh=mesh, progress=False))
        keras.distribution.set_distribution(None)
        return weights

    yield get
    get.cache_clear()


def _weights(model):
    # In model order: auto-numbered layer names differ from build to build.
    return [(v.path.split("/")[-1], v.value) for v in model.weights]


def _weight_files(local_dir):
    """Per weights file: the bytes of its tensors, how many 64 KiB metadata
    reads indexing it may take (one speculative read of a safetensors
    header; HDF5's metadata near each dataset), and how many tensors it has."""
    names = [n for n in os.listdir(local_dir) if n.endswith((".h5", ".safetensors"))]
    out = {}
    for name in names:
        path = os.path.join(local_dir, name)
        if name.endswith(".h5"):
            datasets = keras_h5.read_datasets([path]).values()
            out[name] = (sum(d.nbytes for d in datasets), 2 + len(datasets), len(datasets))
        else:
            tensors = safetensors_files.read_header(path).tensors.values()
            out[name] = (sum(t.nbytes for t in tensors), 1, len(tensors))
    return out


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("kind", ["keras_dense_f32", "keras_moe_bf16_multi", "hf_dense_bf16", "hf_moe_f32_index"])
def test_remote_load_equals_local_and_reads_only_the_blocks(checkpoints, references, remote_checkpoint, scheme,
                                                            kind):
    local = checkpoints[kind]
    remote = remote_checkpoint(local, schemes=[scheme])[scheme]
    weight_files = _weight_files(local)
    for mesh in MESH_SHAPES:
        reference = references(kind, mesh)
        remote.server.clear()
        model = load_sharded_preset(remote.url, mesh=mesh, progress=False)
        keras.distribution.set_distribution(None)
        loaded = _weights(model)
        assert len(loaded) == len(reference)
        for (path, value), (name, expected) in zip(loaded, reference):
            assert path == name
            assert value.sharding.is_equivalent_to(expected.sharding, value.ndim), path
            assert value.dtype == expected.dtype, path
            np.testing.assert_array_equal(np.asarray(value), np.asarray(expected), err_msg=path)
        # One process holds every device: it fetches each tensor byte once,
        # plus the files' headers; adjacent blocks share a request, so there
        # is at most one request per tensor beside the metadata reads.
        for name, (nbytes, metadata_reads, tensors) in weight_files.items():
            sent = remote.bytes_sent(name, process=0)
            assert nbytes <= sent <= nbytes * 1.01 + metadata_reads * 64 * 1024, (name, sent, nbytes)
            gets = [r for r in remote.requests(name) if r.method == "GET" and r.start is not None]
            assert len(gets) <= metadata_reads + tensors, (name, len(gets))
        del model, loaded, reference


def test_causal_lm_with_its_tokenizer_and_verified_checksums(tmp_path, remote_checkpoint):
    source = write_synthetic_preset(
        str(tmp_path / "gemma"), keras_hub.models.GemmaBackbone, dtype="float32", tokenizer=True,
        seed=8, **dict(SMALL, head_dim=8))
    lm = load_sharded_preset(source, mesh=(1, 8), task="causal_lm", progress=False)
    save_sharded_preset(lm, str(tmp_path / "saved"))  # records checksums
    keras.distribution.set_distribution(None)
    remote = remote_checkpoint(str(tmp_path / "saved"), schemes=["hf"])["hf"]
    ours = load_sharded_preset(remote.url, mesh=(2, 4), task="causal_lm", verify=True, progress=False)
    prompts = ["the quick brown", "a fox"]
    ours_tokens = ours.generate(prompts, max_length=12)
    keras.distribution.set_distribution(None)
    local = load_sharded_preset(str(tmp_path / "saved"), mesh=(2, 4), task="causal_lm", progress=False)
    assert ours_tokens == local.generate(prompts, max_length=12)
    # verify=True hashed the remote file (split over the fetch threads).
    assert remote.bytes_sent("model.weights.h5", process=0) >= 2 * os.path.getsize(
        tmp_path / "saved" / "model.weights.h5") * 0.99


def test_verify_names_a_remote_byte_range_that_changed(tmp_path, remote_checkpoint, clean_state):
    import shutil

    source = write_synthetic_preset(
        str(tmp_path / "llama"), keras_hub.models.LlamaBackbone, dtype="float32", seed=9, **SMALL)
    model = load_sharded_preset(source, mesh=(1, 8), progress=False)
    save_sharded_preset(model, str(tmp_path / "saved"))
    keras.distribution.set_distribution(None)
    del model
    changed = tmp_path / "changed"
    shutil.copytree(tmp_path / "saved", changed)
    weights = changed / "model.weights.h5"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1
    weights.write_bytes(bytes(data))
    remote = remote_checkpoint(str(changed), schemes=["s3"])["s3"]
    with clean_state(), pytest.raises(Exception, match=r"bytes 0:\d+ of .*model.weights.h5.* changed since saving"):
        load_sharded_preset(remote.url, mesh=(1, 8), verify=True, progress=False)


@pytest.mark.parametrize("kind, to", [("hf_moe_f32_index", "keras"), ("keras_moe_bf16_multi", "huggingface")])
def test_convert_from_a_remote_source_equals_the_local_conversion(checkpoints, remote_checkpoint, tmp_path,
                                                                  kind, to):
    """`convert_checkpoint` reads a remote source by byte ranges, as the
    loader does: the same files as converting the local copy, and the
    source's weight bytes fetched about once."""
    local = checkpoints[kind]
    remote = remote_checkpoint(local, schemes=["http"])["http"]
    convert_checkpoint(local, str(tmp_path / "from_local"), to=to, task=None, progress=False)
    remote.server.clear()
    convert_checkpoint(remote.url, str(tmp_path / "from_remote"), to=to, task=None, progress=False)
    names = sorted(os.listdir(tmp_path / "from_local"))
    assert sorted(os.listdir(tmp_path / "from_remote")) == names
    if to == "keras":  # HDF5's own metadata differs from file to file
        assert _datasets(tmp_path / "from_remote") == _datasets(tmp_path / "from_local")
    for name in names:
        if name.endswith((".safetensors", ".index.json")):
            assert (tmp_path / "from_remote" / name).read_bytes() == (tmp_path / "from_local" / name).read_bytes(), name
    for name, (nbytes, metadata_reads, _) in _weight_files(local).items():
        sent = remote.bytes_sent(name, process=0)
        assert nbytes <= sent <= nbytes * 1.01 + metadata_reads * 64 * 1024, (name, sent, nbytes)


@pytest.fixture(scope="module")
def prequantized(tmp_path_factory):
    """A pre-quantized W4A16 (compressed-tensors) Qwen 3 checkpoint in
    several files, checksums recorded in its index, and its local load on
    (2, 4): one for the four schemes."""
    import json

    from keras_hub_dist import write_synthetic_hf_checkpoint
    from keras_hub_dist.formats import checksums
    from tests.formats.test_prequantized_families import FAMILIES

    cls, config, _ = FAMILIES["qwen3"]
    local = str(tmp_path_factory.mktemp("prequantized") / "qwen3_w4a16")
    write_synthetic_hf_checkpoint(local, cls, config, dtype="bfloat16", quantization="w4a16",
                                  shard_bytes=40_000, progress=False)
    files = sorted(n for n in os.listdir(local) if n.endswith(".safetensors"))
    assert len(files) > 1
    with open(os.path.join(local, safetensors_files.INDEX_FILE)) as f:
        index = json.load(f)
    index["metadata"][checksums.METADATA_KEY] = {"checksums": {
        n: checksums.file_checksum(os.path.join(local, n)).to_json() for n in files}}
    with open(os.path.join(local, safetensors_files.INDEX_FILE), "w") as f:
        json.dump(index, f)
    keras.distribution.set_distribution(None)
    reference = _weights(load_sharded_preset(local, mesh=(2, 4), verify=True, progress=False))
    keras.distribution.set_distribution(None)
    yield local, files, reference
    del reference


@pytest.mark.parametrize("scheme", SCHEMES)
def test_prequantized_w4a16_remote_verified_equals_the_local_load(prequantized, remote_checkpoint, scheme):
    """The pre-quantized checkpoint served from a bucket (S3, GCS), the Hub
    or plain HTTP: `verify=True` checks the files against the checksums
    recorded in its index, and the load (Keras int4 layers holding the
    checkpoint's codes) is bitwise the local one's."""
    local, files, expected = prequantized
    remote = remote_checkpoint(local, schemes=[scheme])[scheme]
    remote.server.clear()
    model = load_sharded_preset(remote.url, mesh=(2, 4), verify=True, progress=False)
    keras.distribution.set_distribution(None)
    modes = {layer.quantization_mode for layer in model._flatten_layers()
             if getattr(layer, "quantization_mode", None)}
    assert modes == {"int4"}
    loaded = _weights(model)
    assert len(loaded) == len(expected)
    for (path, value), (name, want) in zip(loaded, expected):
        assert path == name and value.dtype == want.dtype, path
        assert value.sharding.is_equivalent_to(want.sharding, value.ndim), path
        np.testing.assert_array_equal(np.asarray(value), np.asarray(want), err_msg=path)
    # verify=True hashed every remote file, then the load read its tensors'
    # bytes (a group's scales may be read twice) and the header (one
    # speculative 64 KiB read).
    for name in files:
        size, sent = os.path.getsize(os.path.join(local, name)), remote.bytes_sent(name, process=0)
        assert 2 * size <= sent <= 2 * size * 1.02 + 64 * 1024, (name, size, sent)
