"""A bucket, a Hub repository or a server is untrusted: what it lists and
what its index names never make a load read or write outside the
checkpoint (`storage.names`). Every server runs on 127.0.0.1.

- A listed key such as `<prefix>//abs/path` or `<prefix>/../x` is refused
  (a `PresetError` naming it and the rule) before any file is staged, so
  nothing is written outside the staging folder.
- An index naming `../other/<shard>` is refused before any shard is read,
  on every scheme.
"""

import json
import os
import shutil

import keras
import keras_hub
import pytest

from keras_hub_dist import PresetError, load_sharded_preset, write_synthetic_preset
from remote.servers import walk_files
from tests.formats.hf import dense
from tests.formats.hf.writer import write_hf_checkpoint

TINY = dict(vocabulary_size=64, num_layers=1, num_query_heads=2, num_key_value_heads=1,
            hidden_dim=16, intermediate_dim=32, head_dim=8)
SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    path = write_synthetic_preset(str(tmp_path_factory.mktemp("keras") / "gemma"),
                                  keras_hub.models.GemmaBackbone, dtype="float32", progress=False, **TINY)
    keras.distribution.set_distribution(None)
    return path


def _bucket(url):
    return url.split("://", 1)[1].split("/", 1)[0]


def _put(request, scheme, remote, key, data):
    """Adds one object at `key` (relative to the bucket) behind the proxy."""
    if scheme == "s3":
        request.getfixturevalue("moto_server").client().put_object(
            Bucket=_bucket(remote.url), Key=key, Body=data)
    else:
        request.getfixturevalue("gcs_server").upload(_bucket(remote.url), key, data)


# gcp-storage-emulator cannot store a name with a '..' segment (it keeps
# objects as paths); the Hub test below lists one.
@pytest.mark.parametrize("scheme,kind", [("s3", "absolute"), ("s3", "dotdot"), ("gs", "absolute")])
def test_a_listed_key_outside_the_prefix_is_refused_and_nothing_is_written(
        preset, remote_checkpoint, request, tmp_path, clean_state, scheme, kind):
    remote = remote_checkpoint(preset, schemes=[scheme])[scheme]
    cache = tmp_path / "cache"
    target = tmp_path / "owned.txt"  # where os.path.join(folder, name) lands
    name = str(target) if kind == "absolute" else "../owned.txt"
    _put(request, scheme, remote, f"{remote.prefix}{name}", b"written by the bucket's owner")
    rule = "is an absolute path" if kind == "absolute" else r"has a '\.\.' segment"
    with clean_state(), pytest.raises(PresetError, match=rule) as info:
        load_sharded_preset(remote.url, mesh=(1, 8), task="causal_lm", cache_dir=str(cache),
                            progress=False)
    assert "listing" in str(info.value) and repr(name) in str(info.value)
    assert not target.exists() and not (cache / "owned.txt").exists()


def test_a_hub_repo_listing_a_file_outside_is_refused(preset, hub_server, tmp_path, clean_state):
    files = {rel: path for path, rel in walk_files(preset)}
    files["../owned.txt"] = b"written by the repository's owner"
    hub_server.add_hub_repo("khd-tests/evil", files)
    cache = tmp_path / "cache"
    with clean_state(), pytest.raises(PresetError, match=r"has a '\.\.' segment"):
        load_sharded_preset("hf://khd-tests/evil", mesh=(1, 8), task="causal_lm",
                            cache_dir=str(cache), progress=False)
    assert not (cache / "owned.txt").exists() and not (tmp_path / "owned.txt").exists()


@pytest.fixture(scope="module")
def escaping_index(tmp_path_factory):
    """`ckpt/` (config, index, second shard) whose index names its first
    shard `../other/<shard>`, beside `other/<shard>`: served with an empty
    prefix, the checkpoint is `<url>/ckpt`."""
    root = tmp_path_factory.mktemp("escaping")
    config, tensors = dense.hf_checkpoint("llama", tied=False, dtype="float32", seed=0)
    ckpt = write_hf_checkpoint(str(root / "ckpt"), config, tensors, num_shards=2)
    os.makedirs(root / "other")
    shutil.move(os.path.join(ckpt, SHARD), root / "other" / SHARD)
    index_path = os.path.join(ckpt, "model.safetensors.index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["weight_map"] = {k: (f"../other/{SHARD}" if v == SHARD else v) for k, v in index["weight_map"].items()}
    with open(index_path, "w") as f:
        json.dump(index, f)
    return str(root)


@pytest.mark.parametrize("scheme", ["s3", "gs", "hf", "http"])
def test_an_index_naming_a_key_outside_the_prefix_is_refused(escaping_index, remote_checkpoint, clean_state, scheme):
    remote = remote_checkpoint(escaping_index, schemes=[scheme], prefix="")[scheme]
    with clean_state(), pytest.raises(PresetError, match=r"has a '\.\.' segment") as info:
        load_sharded_preset(f"{remote.url}/ckpt", mesh=(1, 8), progress=False)
    assert "model.safetensors.index.json" in str(info.value)
    assert not remote.requests(f"other/{SHARD}")  # never asked for


def test_the_staging_cache_is_reused_and_never_written_through_a_planted_link(preset, range_server, tmp_path):
    from keras_hub_dist.storage.locations import RemoteLocation
    from keras_hub_dist.storage.ranged_http import RangeClient

    range_server.put_dir(preset, "ckpt")
    url, cache = f"{range_server.url}/ckpt", tmp_path / "cache"
    with RangeClient() as client:
        with RemoteLocation(url, client, cache_dir=str(cache)) as first:
            folder = first.keras_hub_dir()
        with RemoteLocation(url, client, cache_dir=str(cache)) as again:  # the same files: reused
            assert again.keras_hub_dir() == folder
        assert open(os.path.join(folder, "config.json"), "rb").read() == open(
            os.path.join(preset, "config.json"), "rb").read()
        os.remove(os.path.join(folder, "config.json"))
        target = tmp_path / "target"
        os.symlink(target, os.path.join(folder, "config.json"))  # planted by someone else
        with RemoteLocation(url, client, cache_dir=str(cache)) as planted:
            with pytest.raises(PresetError, match="exists there already"):
                planted.keras_hub_dir()
    assert not target.exists()
