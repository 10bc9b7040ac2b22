"""The embedding-path registry."""

import json

import keras_hub
import pytest

from keras_hub_dist.init import registry


@pytest.fixture(autouse=True)
def _fresh_registry(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    registry._reset_for_tests()
    yield
    registry._reset_for_tests()


@pytest.mark.parametrize(
    "backbone_cls,family",
    [
        (keras_hub.models.GemmaBackbone, "gemma"),
        (keras_hub.models.Gemma3Backbone, "gemma3"),
        (keras_hub.models.LlamaBackbone, "llama"),
        (keras_hub.models.Llama3Backbone, "llama3"),
        (keras_hub.models.QwenBackbone, "qwen"),
        (keras_hub.models.Qwen3Backbone, "qwen3"),
        (keras_hub.models.MistralBackbone, "mistral"),
    ],
)
def test_defaults_match_real_backbone_variable_paths(backbone_cls, family):
    assert registry.family_of(backbone_cls) == family
    config = dict(vocabulary_size=64, num_layers=1, num_query_heads=2,
                  num_key_value_heads=1, hidden_dim=16, intermediate_dim=32)
    if family in ("gemma", "qwen3"):
        config.update(head_dim=8)
    elif family == "gemma3":
        config.update(head_dim=8, image_size=16, vision_encoder=None)
    backbone = backbone_cls(**config)
    paths = {v.path for v in backbone.weights}
    assert registry.lookup(family) in paths


def test_register_lookup_and_conflict():
    registry.register("my_llm", "decoder/tok/embeddings")
    assert registry.lookup("MY_LLM") == "decoder/tok/embeddings"
    with pytest.raises(ValueError, match="already registered"):
        registry.register("my_llm", "other/path")
    registry.register("my_llm", "other/path", overwrite=True)
    assert registry.entries()["my_llm"] == "other/path"
    registry.unregister("my_llm")
    with pytest.raises(KeyError, match="Expected one of"):
        registry.lookup("my_llm")


def test_override_restores_even_when_the_block_raises():
    before = registry.entries()
    with pytest.raises(RuntimeError):
        with registry.override("gemma", "x/y"):
            assert registry.lookup("gemma") == "x/y"
            with registry.override("brand_new", "a/b"):
                assert registry.lookup("brand_new") == "a/b"
            raise RuntimeError("boom")
    assert registry.entries() == before


def test_invalid_paths_are_rejected():
    with pytest.raises(ValueError, match="valid regex"):
        registry.register("bad", "a/(b")
    with pytest.raises(ValueError, match="non-empty"):
        registry.register("bad", "")
    with pytest.raises(ValueError, match="default"):
        registry.unregister("default")


def test_environment_json_string(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, json.dumps({"Gemma": "g/emb", "new": "n/emb"}))
    registry._reset_for_tests()
    assert registry.lookup("gemma") == "g/emb"
    assert registry.lookup("new") == "n/emb"
    assert registry.lookup("llama") == "token_embedding/embeddings"


def test_environment_json_file(monkeypatch, tmp_path):
    path = tmp_path / "paths.json"
    path.write_text(json.dumps({"default": "emb/table"}))
    monkeypatch.setenv(registry.ENV_VAR, str(path))
    registry._reset_for_tests()
    assert registry.lookup() == "emb/table"


@pytest.mark.parametrize("value,match", [
    ("{not json", "not JSON"),
    ("[1, 2]", "a list"),
    ('["a"]', "a list"),
    ("/no/such/file.json", "cannot be read"),
])
def test_environment_errors_are_clear(monkeypatch, value, match):
    monkeypatch.setenv(registry.ENV_VAR, value)
    registry._reset_for_tests()
    with pytest.raises(ValueError, match=match):
        registry.entries()
