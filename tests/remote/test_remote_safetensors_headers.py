"""The safetensors header rules hold for remote files, whose header is read
by range (one speculative 64 KiB read, a second one for a longer header):
every bad file of tests/formats/safetensors_cases.py, served over plain
HTTP and S3 on 127.0.0.1, is refused naming its URL and the rule; a whole
remote load of a checkpoint with a bad header fails the same way."""

import json
import re

import pytest

from keras_hub_dist import load_sharded_preset
from keras_hub_dist.errors import PresetError
from keras_hub_dist.formats.safetensors_files import read_header
from keras_hub_dist.storage.locations import open_location
from tests.formats.hf import dense
from tests.formats.hf.writer import write_hf_checkpoint
from tests.formats.safetensors_cases import BAD, STRICTER, file_bytes

SCHEMES = ("http", "s3")
_CASES = {**BAD, **STRICTER,
          # A header past the first 64 KiB read: the rule is checked on the second.
          "long_header_overlap": (file_bytes({"__metadata__": {"pad": "x" * 100_000},
                                              "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                              "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}),
                                  "overlaps tensor", "b")}


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad_safetensors")
    for case, (data, _, _) in _CASES.items():
        (folder / f"{case}.safetensors").write_bytes(data)
    return str(folder)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_bad_remote_header_is_refused_naming_the_url(bad_files, remote_checkpoint, scheme):
    remote = remote_checkpoint(bad_files, schemes=[scheme])[scheme]
    with open_location(remote.url) as location:
        for case, (data, rule, tensor) in sorted(_CASES.items()):
            name = f"{case}.safetensors"
            with pytest.raises(PresetError) as info:
                read_header(location.open(name))
            message = str(info.value)
            assert repr(location.path_of(name)) in message, (case, message)
            assert re.search(rule, message), (case, message)
            assert tensor is None or repr(tensor) in message, (case, message)
            # Read by range: never more than the header's bytes and 64 KiB.
            reads = remote.requests(name, method="GET")
            assert reads and all(r.start is not None for r in reads), (case, reads)
            header_end = 8 + min(int.from_bytes(data[:8].ljust(8, b"\0"), "little"), len(data))
            assert remote.bytes_sent(name) <= max(64 * 1024, header_end), case


@pytest.fixture(scope="module")
def shared_offsets_checkpoint(tmp_path_factory):
    """A tiny Llama checkpoint in which two tensors share data_offsets."""
    config, tensors = dense.hf_checkpoint("llama", tied=False, dtype="float32", seed=5)
    folder = write_hf_checkpoint(str(tmp_path_factory.mktemp("hf_bad") / "llama"), config, tensors)
    path = f"{folder}/model.safetensors"
    data = open(path, "rb").read()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    # Two norms of one shape: the old loader read both from the first's bytes.
    first, second = sorted(n for n in header if n.endswith("layernorm.weight"))[:2]
    header[second]["data_offsets"] = header[first]["data_offsets"]
    text = json.dumps(header).encode()
    open(path, "wb").write(len(text).to_bytes(8, "little") + text + data[8 + length :])
    return folder, second


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_remote_load_of_a_bad_header_fails_naming_the_url(shared_offsets_checkpoint, remote_checkpoint,
                                                           clean_state, scheme):
    folder, tensor = shared_offsets_checkpoint
    remote = remote_checkpoint(folder, schemes=[scheme])[scheme]
    with clean_state(), pytest.raises(PresetError) as info:
        load_sharded_preset(remote.url, mesh=(1, 8), progress=False)
    message = str(info.value)
    assert "model.safetensors' is truncated or corrupt" in message and remote.url in message, message
    assert "overlaps tensor" in message or "bytes after the last tensor" in message, message
