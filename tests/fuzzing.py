"""Hypothesis strategies and targets for fuzzing the checkpoint parsers.

Each target takes one generated case, runs one parser of the package on it
and returns "accepted", or lets the parser's `PresetError` out: anything else
is a bug. Used by the bounded runs in tests/test_fuzz_parsers.py (and
tests/formats/test_safetensors_header.py, tests/load/test_config_bound.py)
and the long runs of benchmarks/bench_fuzz.py.

Targets:
- `safetensors_header`: `formats.safetensors_header.validate_header` on a
  valid file's bytes, mutated (a byte, an insertion, a deletion, the data
  length, the length prefix);
- `safetensors_index`: `formats.safetensors_files.checkpoint_files` on a
  directory whose `model.safetensors.index.json` is a mutated index;
- `keras_weights_index`: `formats.keras_h5.weights_files` on a mutated
  sharded `model.weights.json`;
- `hdf5_indexer`: `formats.keras_h5.read_datasets` on a small `.h5` written
  by h5py (datasets of any dtype and layout, groups, links, attributes),
  then maybe with a few bytes overwritten, maybe truncated;
- `config`: `load.source.read_config` on mutated JSON.

Shard and file names are drawn from plain file names: hostile names (`""`,
`".."`, absolute paths) are the name checks' tests.
"""

from __future__ import annotations

import json
import os

import h5py
import numpy as np
from hypothesis import strategies as st

from keras_hub_dist.formats import keras_h5
from keras_hub_dist.formats.safetensors_files import checkpoint_files
from keras_hub_dist.formats.safetensors_header import DTYPE_BITS, validate_header
from keras_hub_dist.load.source import read_config
from keras_hub_dist.storage.locations import LocalDirectory
from tests.formats.safetensors_cases import file_bytes

__all__ = ["STRATEGIES", "TARGETS", "safetensors_files", "mutated_json"]

_JSON_CHARS = list('{}[]",:0123456789.-e tanul\\')


def _mutate(draw, text: str) -> str:
    kind = draw(st.sampled_from(["none", "byte", "insert", "delete"]))
    if kind == "none" or not text:
        return text
    at = draw(st.integers(0, len(text) - 1))
    char = draw(st.sampled_from(_JSON_CHARS))
    return {"byte": text[:at] + char + text[at + 1 :], "insert": text[:at] + char + text[at:],
            "delete": text[:at] + text[at + 1 :]}[kind]


@st.composite
def safetensors_files(draw) -> bytes:
    """A valid safetensors file's bytes, maybe mutated."""
    names = draw(st.lists(st.text("abc.", min_size=1, max_size=4), unique=True, max_size=4))
    header, position = {}, 0
    for name in names:
        dtype = draw(st.sampled_from(sorted(DTYPE_BITS)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        bits = int(np.prod(shape, dtype=np.int64)) * DTYPE_BITS[dtype]
        if bits % 8:
            shape, bits = shape + [8], bits * 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + bits // 8]}
        position += bits // 8
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    text = _mutate(draw, json.dumps(header, separators=(",", ":")))
    data_len = max(0, position + draw(st.sampled_from([0, 0, 0, -1, 1, 3])))
    raw = text.encode("utf-8")
    length = len(raw) + draw(st.sampled_from([0, 0, 0, -2, -1, 1, 2**63]))
    return file_bytes(raw, data_len, max(length, 0))


_json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)


@st.composite
def mutated_json(draw, value=_json_value) -> bytes:
    return _mutate(draw, json.dumps(draw(value))).encode("utf-8", "surrogatepass")


_FILE = st.sampled_from(["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                         "model.safetensors", "missing.safetensors", "x.h5", "model.weights.h5"])
_TENSOR = st.sampled_from(["a", "b", "c"])


@st.composite
def _safetensors_index(draw) -> bytes:
    other = st.none() | st.booleans() | st.integers() | st.lists(_FILE, max_size=2) | st.dictionaries(_TENSOR, _FILE)
    weight_map = draw(st.dictionaries(_TENSOR, _FILE | other, max_size=4))
    index = {"metadata": draw(_json_value), "weight_map": weight_map}
    if draw(st.integers(0, 9)) == 0:
        index = draw(_json_value)
    return _mutate(draw, json.dumps(index)).encode("utf-8")


@st.composite
def _keras_index(draw) -> bytes:
    shard = _FILE | st.lists(_FILE, max_size=3) | _json_value
    index = {"metadata": {}, "weight_map": draw(st.dictionaries(st.text("ab/", max_size=4), shard, max_size=4))}
    if draw(st.integers(0, 9)) == 0:
        index = draw(_json_value)
    return _mutate(draw, json.dumps(index)).encode("utf-8")


_H5_DTYPES = ["f4", "f2", "i8", "u1", "?", "c8", "S3", "O", "V4", "<f4,<i2"]


@st.composite
def _h5_plan(draw) -> dict:
    datasets = []
    for i in range(draw(st.integers(0, 3))):
        shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
        layout = draw(st.sampled_from(["contiguous", "chunked", "gzip", "empty_chunked", "empty"]))
        datasets.append((f"g{i % 2}/vars/{i}", shape, draw(st.sampled_from(_H5_DTYPES)), layout,
                         draw(st.sampled_from([None, "bfloat16", "float32"]))))
    links = draw(st.lists(st.sampled_from(["soft", "external", "dangling"]), max_size=2))
    cut = draw(st.sampled_from([None, None, None, 0.3, 0.6, 0.95]))
    flips = draw(st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), max_size=4))
    return {"datasets": datasets, "links": links, "cut": cut, "flips": flips}


def _write_h5(path: str, plan: dict) -> None:
    with h5py.File(path, "w") as h5:
        for name, shape, dtype, layout, tag in plan["datasets"]:
            dt = h5py.string_dtype() if dtype == "O" else np.dtype(dtype)
            chunks = tuple(shape) if shape and all(shape) and layout not in ("contiguous", "empty") else None
            if layout in ("empty", "empty_chunked") or dtype == "O":
                ds = h5.create_dataset(name, shape=shape, dtype=dt, chunks=chunks)
            else:
                data = np.zeros(shape, dt)
                ds = h5.create_dataset(name, data=data, chunks=chunks,
                                       compression="gzip" if layout == "gzip" and chunks else None)
            if tag:
                ds.attrs["dtype"] = tag
        for i, link in enumerate(plan["links"]):
            h5[f"link{i}"] = {"soft": h5py.SoftLink("/g0"), "dangling": h5py.SoftLink("/nowhere"),
                              "external": h5py.ExternalLink("other.h5", "/x")}[link]
    with open(path, "r+b") as f:
        size = os.path.getsize(path)
        for where, byte in plan["flips"]:  # corrupt metadata (or data) bytes
            f.seek(int(size * where))
            f.write(bytes([byte]))
        if plan["cut"] is not None:
            f.truncate(int(size * plan["cut"]))


class Targets:
    """The targets, writing their files into `folder` (reused case to case)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        shard = file_bytes({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                            "b": {"dtype": "U8", "shape": [3], "data_offsets": [8, 11]}}, data_len=11)
        for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors"):
            with open(os.path.join(folder, name), "wb") as f:
                f.write(shard)
        for name in ("x.h5", "model.weights.h5"):
            with h5py.File(os.path.join(folder, name), "w") as h5:
                h5["vars/0"] = np.ones(3, np.float32)

    def _write(self, name: str, data: bytes) -> str:
        path = os.path.join(self.folder, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def safetensors_header(self, data: bytes) -> str:
        validate_header(data, len(data), "fuzz.safetensors")
        return "accepted"

    def safetensors_index(self, data: bytes) -> str:
        self._write("model.safetensors.index.json", data)
        checkpoint_files(LocalDirectory(self.folder))
        return "accepted"

    def keras_weights_index(self, data: bytes) -> str:
        keras_h5.weights_files(self._write("model.weights.json", data))
        return "accepted"

    def hdf5_indexer(self, plan: dict) -> str:
        path = os.path.join(self.folder, "fuzz.weights.h5")
        _write_h5(path, plan)
        keras_h5.read_datasets([path])
        return "accepted"

    def config(self, data: bytes) -> str:
        sub = os.path.join(self.folder, "config")
        os.makedirs(sub, exist_ok=True)
        with open(os.path.join(sub, "config.json"), "wb") as f:
            f.write(data)
        read_config(LocalDirectory(sub))
        return "accepted"


STRATEGIES = {
    "safetensors_header": safetensors_files(),
    "safetensors_index": _safetensors_index(),
    "keras_weights_index": _keras_index(),
    "hdf5_indexer": _h5_plan(),
    "config": mutated_json(),
}
TARGETS = tuple(STRATEGIES)
