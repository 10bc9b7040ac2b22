"""config.json and metadata.json are read with a size bound (checked before
a byte is read) and must be JSON objects: anything else is a `PresetError`
naming the file."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keras_hub_dist.errors import PresetError
from keras_hub_dist.load.source import read_config, read_metadata
from keras_hub_dist.plan import presets
from keras_hub_dist.storage.locations import LocalDirectory


class _Spy(LocalDirectory):
    """A local directory that records which files were read whole."""

    def __init__(self, path):
        super().__init__(path)
        self.read = []

    def read_bytes(self, name):
        self.read.append(name)
        return super().read_bytes(name)


@pytest.mark.parametrize("name", ["config.json", "metadata.json"])
def test_a_file_over_the_bound_is_refused_unread(tmp_path, name):
    (tmp_path / "config.json").write_text("{}")
    with open(tmp_path / name, "wb") as f:
        f.truncate(presets.JSON_FILE_LIMIT + 1)  # sparse: nothing to read anyway
    location = _Spy(str(tmp_path))
    with pytest.raises(PresetError) as info:
        (read_config if name == "config.json" else read_metadata)(location)
    message = str(info.value)
    assert repr(str(tmp_path / name)) in message and "too large" in message, message
    assert f"Expected a JSON file of at most {presets.JSON_FILE_LIMIT} bytes" in message
    assert f"Received: {presets.JSON_FILE_LIMIT + 1} bytes" in message
    assert name not in location.read


def test_read_json_is_bounded_too(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"a": "x" * 100}))
    with pytest.raises(PresetError, match="too large to be a config file"):
        presets.read_json(str(path), limit=50)
    assert presets.read_json(str(path)) == {"a": "x" * 100}


@pytest.mark.parametrize("name", ["config.json", "metadata.json"])
@pytest.mark.parametrize("text, expected", [
    ("[1, 2]", "holds a JSON list. Expected a JSON object"),
    ('"config"', "holds a JSON str. Expected a JSON object"),
    ("[" * 100_000 + "]" * 100_000, "cannot be parsed. Expected a JSON object of plain values. Received: RecursionError"),
    ('{"n": ' + "9" * 5000 + "}", "cannot be parsed.*Received: ValueError"),
])
def test_a_file_that_is_not_a_json_object_is_refused(tmp_path, name, text, expected):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / name).write_text(text)
    reader = read_config if name == "config.json" else read_metadata
    with pytest.raises(PresetError, match=expected) as info:
        reader(LocalDirectory(str(tmp_path)))
    assert repr(str(tmp_path / name)) in str(info.value)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


@st.composite
def _config_bytes(draw):
    text = json.dumps(draw(_json))
    if draw(st.booleans()) and text:
        at = draw(st.integers(0, len(text) - 1))
        text = text[:at] + draw(st.sampled_from(list('{}[]",:0\\\udc80'))) + text[at + 1:]
    return text.encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def _folder(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzzed_config")


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(_config_bytes())
def test_fuzz_the_config_parser_returns_an_object_or_a_preset_error(_folder, data):
    folder = _folder
    (folder / "config.json").write_bytes(data)
    try:
        config = read_config(LocalDirectory(str(folder)))
    except PresetError as e:
        assert repr(str(folder / "config.json")) in str(e)
        return
    assert isinstance(config, dict) and config == json.loads(data)


@pytest.mark.parametrize("text, expected", [("[" * 100_000 + "]" * 100_000, "RecursionError"),
                                            ("[]", "holds a JSON list")])
def test_an_adapter_config_is_parsed_the_same_way(tmp_path, text, expected):
    from keras_hub_dist.adapters import peft_lora

    (tmp_path / "adapter_config.json").write_text(text)
    with pytest.raises(PresetError, match=expected) as info:
        peft_lora._read_config(LocalDirectory(str(tmp_path)), str(tmp_path))
    assert repr(str(tmp_path / "adapter_config.json")) in str(info.value)
