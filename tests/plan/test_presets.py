"""Named architectures: data files, aliases, errors, packaging."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import keras_hub_dist
from keras_hub_dist.plan import presets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REQUIRED = [
    "gemma_2b_en", "gemma_7b_en", "gemma2_2b_en", "gemma2_9b_en",
    "gemma2_27b_en", "llama2_7b_en", "llama3_8b_en", "llama3.1_8b",
    "qwen2.5_7b_en", "qwen3_8b_en", "mistral_7b_en",
]


def test_required_architectures_are_named():
    assert set(REQUIRED) <= set(presets.names())
    assert presets.names() == sorted(presets.names())


@pytest.mark.parametrize(
    "alias, name",
    [
        ("gemma_7b", "gemma_7b_en"),
        ("gemma2_9b", "gemma2_9b_en"),
        ("gemma2_27b", "gemma2_27b_en"),
        ("llama3_8b", "llama3_8b_en"),
        ("llama2_7b", "llama2_7b_en"),
        ("qwen2.5_7b", "qwen2.5_7b_en"),
        ("qwen3_8b", "qwen3_8b_en"),
        ("mistral_7b", "mistral_7b_en"),
        ("GEMMA_7B_EN", "gemma_7b_en"),
        ("kaggle://keras/gemma/keras/gemma_7b_en/4", "gemma_7b_en"),
    ],
)
def test_aliases_and_handles_resolve(alias, name):
    assert presets.resolve(alias).name == name


def test_gemma2_7b_is_a_documented_alias_of_gemma_7b_en():
    entry = presets.resolve("gemma2_7b")
    assert entry.name == "gemma_7b_en"
    assert entry.backbone_class_name == "GemmaBackbone"
    assert "no Gemma 2 7B" in entry.alias_notes["gemma2_7b"]
    assert presets.aliases()["gemma2_7b"] == "gemma_7b_en"
    # Said wherever names are listed: the module docs and names()' docs.
    assert "gemma2_7b" in presets.__doc__ and "no Gemma 2 7B" in presets.__doc__
    assert "gemma2_7b" in presets.names.__doc__


def test_unknown_name_lists_closest_names():
    with pytest.raises(keras_hub_dist.UnknownPresetError) as info:
        presets.resolve("gema2_9b")
    message = str(info.value)
    assert "'gema2_9b'" in message
    assert "gemma2_9b" in message and "closest" in message
    assert isinstance(info.value, ValueError)
    with pytest.raises(keras_hub_dist.UnknownPresetError, match="No known name"):
        presets.resolve("zzzzzzzz")
    with pytest.raises(keras_hub_dist.UnknownPresetError):
        presets.resolve("")


def test_entries_match_kerashub_preset_metadata():
    for entry in presets.entries():
        cls = entry.backbone_class
        published = cls.presets
        assert entry.kerashub_preset in published, entry.name
        meta = published[entry.kerashub_preset]
        assert entry.handle == meta["kaggle_handle"], entry.name
        # The count is KerasHub's published metadata for `params_preset`
        # (itself, except where `notes` explain a KerasHub metadata error).
        assert entry.parameter_count == (
            published[entry.params_preset]["metadata"]["params"]
        ), entry.name
        if entry.params_preset != entry.name:
            assert entry.notes and entry.kerashub_metadata_params == (
                meta["metadata"]["params"]
            )
        assert entry.config_json()["class_name"] == entry.backbone_class_name
        assert entry.config_json()["registered_name"] == (
            f"keras_hub>{entry.backbone_class_name}"
        )


def test_entry_is_frozen_and_config_is_a_fresh_copy():
    entry = presets.resolve("gemma_7b_en")
    config = entry.config
    config["num_layers"] = 1
    assert entry.config["num_layers"] == 28
    with pytest.raises(AttributeError):
        entry.name = "x"
    assert entry.family == "gemma" and entry.aliases == ("gemma_7b", "gemma2_7b")


def test_backbone_config_overrides_and_config_forms(tmp_path):
    cls, config, entry = presets.backbone_config("gemma2_7b", num_layers=2)
    assert (cls.__name__, config["num_layers"], entry.name) == (
        "GemmaBackbone", 2, "gemma_7b_en",
    )
    full = presets.resolve("qwen3_8b_en").config_json()
    cls, config, entry = presets.backbone_config(full, dtype="float32")
    assert cls.__name__ == "Qwen3Backbone" and entry is None
    assert config["dtype"] == "float32" and config["hidden_dim"] == 4096
    (tmp_path / "config.json").write_text(json.dumps(full))
    cls, config, _ = presets.backbone_config(str(tmp_path))
    assert cls.__name__ == "Qwen3Backbone" and config["num_layers"] == 36
    with pytest.raises(ValueError, match="backbone_class"):
        presets.backbone_config({"num_layers": 2})
    with pytest.raises(TypeError, match="Received: 3"):
        presets.backbone_config(3)


@pytest.mark.parametrize(
    "name, num_layers, shared",
    [
        ("gemma4_2b", 2, 0),  # 35 layers, the last 20 KV-shared: 15 lead
        ("gemma4_2b", 17, 2),
        ("gemma4_2b", 35, 20),
        ("gemma4_instruct_2b_assistant", 2, 2),  # a drafter: every layer shared
        ("qwen3_5_0.8b", 3, None),
    ],
)
def test_a_smaller_depth_keeps_the_leading_layers(name, num_layers, shared):
    full = presets.resolve(name).config
    _, config, _ = presets.backbone_config(name, num_layers=num_layers)
    assert config["layer_types"] == full["layer_types"][:num_layers]
    assert config.get("num_kv_shared_layers") == shared
    # Asked for explicitly, an override is kept as given.
    _, config, _ = presets.backbone_config(name, num_layers=num_layers, layer_types=None, num_kv_shared_layers=1)
    assert config["layer_types"] is None and config["num_kv_shared_layers"] == 1


def test_data_files_are_one_per_architecture():
    files = sorted(
        f for f in os.listdir(os.path.join(REPO, "presets")) if f.endswith(".json")
    )
    assert files == sorted(name + ".json" for name in presets.names())


def test_plain_pip_install_finds_the_data_files(tmp_path):
    """A non-editable install into a throwaway venv ships presets/*.json."""
    import keras

    venv = tmp_path / "venv"
    # Without a pip of its own (ensurepip: ~7 CPU-s): this interpreter's pip
    # installs into it (`--python`), building the wheel as a plain `pip
    # install` does (isolated, from the build-system table).
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
        check=True,
    )
    result = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
         "--no-deps", REPO],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    # The throwaway venv has no keras/jax: borrow them from this interpreter's
    # site-packages, appended last so keras_hub_dist comes from the install
    # (and no editable finder, whose .pth only runs for site directories).
    deps = os.path.dirname(os.path.dirname(keras.__file__))
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.append({deps!r})
        import keras_hub_dist
        from keras_hub_dist.plan import presets
        from keras_hub_dist import _preset_data
        for module in (keras_hub_dist, _preset_data):
            assert module.__file__.startswith({str(venv)!r}), module.__file__
        print(presets.resolve("gemma2_7b").name, len(presets.names()))
        """
    )
    env = {**os.environ, "KERAS_BACKEND": "jax", "JAX_PLATFORMS": "cpu"}
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-I", "-c", script],
        cwd=tmp_path, env=env, capture_output=True, text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split()[-2:] == ["gemma_7b_en", str(len(presets.names()))]
