"""Safetensors headers are checked as strictly as the safetensors crate
checks them: every file the crate refuses, the loader refuses with a
`PresetError` naming the file, the tensor, the rule and the fix; every file
it accepts (bar three refused on purpose) the loader reads alike; the
package's own writer's files pass."""

import json
import re

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_hub_dist.errors import PresetError
from keras_hub_dist.formats import safetensors_writer
from keras_hub_dist.formats.safetensors_files import checkpoint_files, read_header
from keras_hub_dist.formats.safetensors_header import DTYPE_BITS, validate_header
from tests.formats.safetensors_cases import BAD, GOOD, STRICTER, file_bytes


def _crate_accepts(data: bytes) -> bool:
    try:
        safetensors.deserialize(data)
    except Exception:  # the binding's SafetensorError (and a Rust panic) alike
        return False
    return True


def _refused(path, data, rule, tensor):
    with open(path, "wb") as f:
        f.write(data)
    with pytest.raises(PresetError) as info:
        read_header(str(path))
    message = str(info.value)
    assert repr(str(path)) in message, message
    assert re.search(rule, message), message
    assert tensor is None or repr(tensor) in message, message
    assert "Expected " in message and "Received: " in message, message
    assert "safetensors.torch.save_file" in message, message
    return message


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_header_the_crate_refuses_is_refused(tmp_path, case):
    data, rule, tensor = BAD[case]
    assert not _crate_accepts(data), case
    _refused(tmp_path / "model.safetensors", data, rule, tensor)


@pytest.mark.parametrize("case", sorted(STRICTER))
def test_three_headers_the_crate_accepts_are_refused_on_purpose(tmp_path, case):
    data, rule, tensor = STRICTER[case]
    assert _crate_accepts(data), case
    _refused(tmp_path / "model.safetensors", data, rule, tensor)


@pytest.mark.parametrize("case", sorted(GOOD))
def test_a_header_the_crate_accepts_is_read_alike(case):
    data, expected = GOOD[case]
    crate = {name: (info["dtype"], tuple(info["shape"])) for name, info in safetensors.deserialize(data)}
    header = validate_header(data, len(data), case)
    got = {n: (e.dtype, e.shape, e.begin, e.end) for n, e in header.tensors.items()}
    assert got == expected
    assert {n: v[:2] for n, v in got.items()} == crate


def test_a_sub_byte_dtype_is_valid_but_not_read(tmp_path):
    data, _ = GOOD["fp8_and_sub_byte"]
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    with pytest.raises(PresetError, match=r"Tensor 'f' .* has dtype 'F4', a safetensors dtype the loader cannot read"):
        read_header(str(path))


def test_a_bad_shard_is_named_through_the_index(tmp_path):
    good, _ = GOOD["two"]
    bad, _, _ = BAD["shared_offsets"]
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(good)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(bad)
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(PresetError, match=r"model-00002-of-00002.safetensors' is truncated or corrupt: tensor 'b' overlaps"):
        checkpoint_files(str(tmp_path))


def test_files_safetensors_writes_are_read_with_their_bytes(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"w": rng.standard_normal((3, 5)).astype(np.float32), "i": np.arange(7, dtype=np.int64),
               "e": np.zeros((0, 4), np.float16), "s": np.array(2.5, np.float64), "b": np.array([True, False])}
    path = str(tmp_path / "model.safetensors")
    safetensors.numpy.save_file(tensors, path, metadata={"format": "np"})
    header = read_header(path)
    data = open(path, "rb").read()
    for name, value in tensors.items():
        stored = header.tensors[name]
        got = np.frombuffer(data[stored.offset : stored.offset + stored.nbytes], stored.dtype).reshape(stored.shape)
        np.testing.assert_array_equal(got, value)


@pytest.mark.parametrize("max_shard_size", [10**9, 300])
def test_the_writers_files_pass_both_checks(tmp_path, max_shard_size):
    specs = [safetensors_writer.TensorSpec(f"t{i}", shape, np.dtype(dtype)) for i, (shape, dtype) in enumerate(
        [((4, 3), "float32"), ((5,), "bfloat16"), ((), "int32"), ((0, 2), "float16"), ((7,), "uint8"),
         ((2, 2), "float8_e4m3fn"), ((3,), "int64"), ((9,), "bool")])]
    import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with NumPy)

    layout = safetensors_writer.plan_files(specs, max_shard_size=max_shard_size)
    paths = safetensors_writer.create_files(layout, str(tmp_path))
    assert len(paths) == (1 if max_shard_size > 1000 else len(layout.files)) and len(paths) >= 1
    for file, path in zip(layout.files, paths):
        data = open(path, "rb").read()
        assert _crate_accepts(data)
        header = validate_header(data, len(data), path)
        assert {n: header.data_start + e.begin for n, e in header.tensors.items()} == dict(file.offsets)


# Property: over random valid files and their random corruptions, what the
# crate refuses is refused, and what is accepted the crate reads alike.
_DTYPES = sorted(DTYPE_BITS)
_tensor = st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 4), max_size=3))


@st.composite
def _files(draw):
    names = draw(st.lists(st.text("abc.", min_size=1, max_size=4), unique=True, max_size=4))
    header, position = {}, 0
    for name in names:
        dtype, shape = draw(_tensor)
        size = int(np.prod(shape, dtype=np.int64)) * DTYPE_BITS[dtype]
        if size % 8:
            shape, size = shape + [8], size * 8
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + size // 8]}
        position += size // 8
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":"))
    data_len = position
    mutation = draw(st.sampled_from(["none", "byte", "insert", "delete", "data", "length"]))
    if mutation in ("byte", "insert", "delete") and text:
        at = draw(st.integers(0, len(text) - 1))
        char = draw(st.sampled_from(list('{}[]",:0123456789.-e ta\\')))
        text = {"byte": text[:at] + char + text[at + 1 :], "insert": text[:at] + char + text[at:],
                "delete": text[:at] + text[at + 1 :]}[mutation]
    elif mutation == "data":
        data_len = max(0, data_len + draw(st.integers(-3, 3)))
    raw = text.encode("utf-8", "surrogatepass")
    length = len(raw) + draw(st.integers(-2, 2)) if mutation == "length" else None
    return file_bytes(raw, data_len, None if length is None or length < 0 else length)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(_files())
def test_fuzz_the_header_check_agrees_with_the_crate(data):
    crate_accepts = _crate_accepts(data)
    try:
        header = validate_header(data, len(data), "fuzz.safetensors")
    except PresetError as e:  # refused: the crate too, or a rule of STRICTER
        assert not crate_accepts or re.search("a malformed entry|a name appears twice", str(e)), str(e)
        return
    assert crate_accepts
    crate = dict(safetensors.deserialize(data))
    assert {n: (e.dtype, list(e.shape)) for n, e in header.tensors.items()} == {
        n: (i["dtype"], i["shape"]) for n, i in crate.items()}
