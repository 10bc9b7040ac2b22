"""Named LLM architectures: KerasHub preset configs, handles and sizes.

Every named architecture is one JSON file in the package data
(`keras_hub_dist._preset_data`, the repository's `presets/` folder) with the
backbone config exactly as KerasHub's preset `config.json` has it, the
KerasHub preset name and Kaggle handle of its weights, its parameter count
(KerasHub's published preset metadata) and short aliases.

Named architectures (aliases in brackets):

- Gemma: gemma_2b_en [gemma_2b], gemma_7b_en [gemma_7b, gemma2_7b],
  gemma2_2b_en [gemma2_2b], gemma2_9b_en [gemma2_9b],
  gemma2_27b_en [gemma2_27b]. `gemma2_7b` is an alias of the 7B-class
  Gemma, gemma_7b_en: KerasHub publishes no Gemma 2 7B checkpoint (Gemma 2
  comes in 2B, 9B and 27B).
- Gemma 3 (text only): gemma3_270m, gemma3_1b, gemma3_4b_text,
  gemma3_12b_text, gemma3_27b_text.
- Llama: llama2_7b_en [llama2_7b], llama3_8b_en [llama3_8b],
  llama3.1_8b [llama3.1_8b_en, llama3_1_8b], llama3.2_1b [llama3.2_1b_en],
  llama3.2_3b [llama3.2_3b_en], llama3.2_instruct_1b, llama3.2_instruct_3b,
  llama3.2_guard_1b [llama_guard3_1b] (these three also with `_en` aliases).
- Qwen 2.5: qwen2.5_0.5b_en, qwen2.5_3b_en, qwen2.5_7b_en (aliases without
  `_en`). Qwen 3: qwen3_0.6b_en ... qwen3_32b_en (aliases without `_en`).
- Mistral: mistral_7b_en [mistral_7b], mistral_0.3_7b_en [mistral_0.3_7b].
- Gemma 4 (KerasHub's presets: text decoder + vision encoder, + audio encoder
  for E2B/E4B): gemma4_2b [gemma4_e2b], gemma4_instruct_2b [gemma4_e2b_it],
  gemma4_4b [gemma4_e4b], gemma4_instruct_4b [gemma4_e4b_it],
  gemma4_26b_a4b [gemma4_26b], gemma4_instruct_26b_a4b [gemma4_26b_a4b_it],
  gemma4_31b, gemma4_instruct_31b [gemma4_31b_it]; the speculative-decoding
  assistants (their Gemma4Backbone) gemma4_instruct_2b_assistant,
  gemma4_instruct_4b_assistant, gemma4_instruct_26b_a4b_assistant,
  gemma4_instruct_31b_assistant [gemma4_e2b_it_assistant, ...].
- Qwen 3.5 (with the vision encoder): qwen3_5_0.8b_base, qwen3_5_0.8b,
  qwen3_5_2b_base, qwen3_5_2b, qwen3_5_4b_base, qwen3_5_4b, qwen3_5_9b_base,
  qwen3_5_9b, qwen3_5_27b, qwen3_6_27b, qwen3_8_27b (aliases with a dot:
  qwen3.5_0.8b, ..., qwen3.6_27b, qwen3.8_27b).
- Qwen 3.5 MoE: qwen3_5_moe_35b_a3b_base [qwen3.5_35b_a3b_base],
  qwen3_5_moe_35b_a3b [qwen3.5_35b_a3b], qwen3_6_moe_35b_a3b
  [qwen3.6_35b_a3b] (with the vision encoder), qwen_agent_world_35b_a3b
  [qwen_agentworld_35b_a3b] (text only).
- Qwen 3 MoE: qwen3_moe_30b_a3b_en [qwen3_moe_30b_a3b, qwen3_30b_a3b],
  qwen3_moe_235b_a22b_en [qwen3_moe_235b_a22b, qwen3_235b_a22b],
  qwen3_coder_instruct_30b_a3b_en [qwen3_coder_30b_a3b].
- Mixtral: mixtral_8_7b_en [mixtral_8x7b], mixtral_8_instruct_7b_en
  [mixtral_8x7b_instruct].
- gpt-oss: gpt_oss_20b_en [gpt_oss_20b], gpt_oss_120b_en [gpt_oss_120b],
  gpt_oss_safeguard_20b_en [gpt_oss_safeguard_20b],
  gpt_oss_safeguard_120b_en [gpt_oss_safeguard_120b].

Where a config or count needs explaining (KerasHub's rounded or mislabelled
metadata, towers included, values inferred rather than sourced), the entry's
`notes` say so, and `source` names where its config comes from.

Example:

```python
from keras_hub_dist import presets

entry = presets.resolve("gemma2_7b")   # alias of gemma_7b_en
entry.name, entry.parameter_count       # ('gemma_7b_en', 8537680896)
backbone_cls = entry.backbone_class     # keras_hub.models.GemmaBackbone
config = entry.config                   # a fresh dict of constructor args
```
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.resources
import json
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from keras_hub_dist.errors import PresetError, UnknownPresetError

__all__ = [
    "CONFIG_FILE",
    "PresetEntry",
    "aliases",
    "backbone_config",
    "entries",
    "is_preset_dir",
    "names",
    "INDEX_FILE_LIMIT",
    "JSON_FILE_LIMIT",
    "parse_json",
    "read_json",
    "read_json_object",
    "resolve",
]

_DATA_PACKAGE = "keras_hub_dist._preset_data"
CONFIG_FILE = "config.json"
# A config, metadata or index file is read whole and parsed: larger ones are
# refused unread (the largest real ones are a few MB: a tokenizer.json is not
# read here).
JSON_FILE_LIMIT = 16 * 1024 * 1024
# An index (`model.safetensors.index.json`) of a model of a trillion
# parameters is ~10 MB; its bound is the safetensors header's.
INDEX_FILE_LIMIT = 100_000_000
_REQUIRED_FIELDS = (
    "name", "family", "backbone_class", "kerashub_preset", "handle", "params",
    "aliases", "config",
)


@dataclasses.dataclass(frozen=True)
class PresetEntry:
    """One named architecture.

    Attributes:
        name: The canonical name (KerasHub's preset name), e.g. `"gemma_7b_en"`.
        family: The registry family, e.g. `"gemma"`, `"llama3"`, `"qwen3"`.
        handle: KerasHub's handle for the weights, e.g.
            `"kaggle://keras/gemma/keras/gemma_7b_en/4"`.
        kerashub_preset: The name `keras_hub.models.Backbone.from_preset`
            accepts for these weights.
        backbone_class_name: The KerasHub backbone class name.
        parameter_count: Parameters of the backbone (KerasHub's published
            preset metadata for `params_preset`).
        params_preset: The KerasHub preset whose published metadata gives
            `parameter_count` (the entry itself unless `notes` say otherwise).
        aliases: Short names that resolve to this entry.
        alias_notes: Why an alias exists, where it is not obvious.
        description: KerasHub's description of the preset.
        notes: Where this entry deviates from KerasHub's metadata, and why.
        kerashub_metadata_params: KerasHub's published count when it differs
            from `parameter_count` (see `notes`), else `None`.
        source: Where the config comes from (a stored copy of the preset's or
            the Hugging Face checkpoint's `config.json`, and how it was
            converted); `""` where not recorded.
    """

    name: str
    family: str
    handle: str
    kerashub_preset: str
    backbone_class_name: str
    parameter_count: int
    params_preset: str
    aliases: tuple[str, ...]
    alias_notes: Mapping[str, str]
    description: str
    notes: tuple[str, ...]
    kerashub_metadata_params: int | None
    _config_json: str = dataclasses.field(repr=False)
    source: str = dataclasses.field(default="", repr=False)

    @property
    def config(self) -> dict[str, Any]:
        """The backbone's constructor arguments (a fresh dict on every call)."""
        return json.loads(self._config_json)["config"]

    def config_json(self) -> dict[str, Any]:
        """The full KerasHub `config.json` object (module, class_name, config)."""
        return json.loads(self._config_json)

    @property
    def backbone_class(self) -> type:
        """The KerasHub backbone class, e.g. `keras_hub.models.GemmaBackbone`."""
        import keras_hub

        return getattr(keras_hub.models, self.backbone_class_name)


def _entry_from_data(data: Mapping[str, Any], source: str) -> PresetEntry:
    missing = [field for field in _REQUIRED_FIELDS if field not in data]
    if missing:
        raise ValueError(
            f"Preset data file {source} is incomplete. Expected the fields "
            f"{list(_REQUIRED_FIELDS)}. Received: a file without {missing}."
        )
    config = data["config"]
    if config.get("class_name") != data["backbone_class"]:
        raise ValueError(
            f"Preset data file {source}: expected config.class_name to equal "
            f"backbone_class {data['backbone_class']!r}. Received: "
            f"{config.get('class_name')!r}."
        )
    return PresetEntry(
        name=data["name"],
        family=data["family"],
        handle=data["handle"],
        kerashub_preset=data["kerashub_preset"],
        backbone_class_name=data["backbone_class"],
        parameter_count=int(data["params"]),
        params_preset=data.get("params_preset", data["name"]),
        aliases=tuple(data["aliases"]),
        alias_notes=MappingProxyType(dict(data.get("alias_notes", {}))),
        description=data.get("description", ""),
        notes=tuple(data.get("notes", ())),
        kerashub_metadata_params=data.get("kerashub_metadata_params"),
        _config_json=json.dumps(config, sort_keys=True),
        source=str(data.get("source", "")),
    )


@functools.cache
def _load() -> tuple[dict[str, PresetEntry], dict[str, str]]:
    """Reads every data file once: `(name -> entry, lowercased key -> name)`."""
    by_name: dict[str, PresetEntry] = {}
    for resource in sorted(
        importlib.resources.files(_DATA_PACKAGE).iterdir(), key=lambda r: r.name
    ):
        if not resource.name.endswith(".json"):
            continue
        entry = _entry_from_data(
            json.loads(resource.read_text(encoding="utf-8")), resource.name
        )
        if entry.name in by_name:
            raise ValueError(
                f"Two preset data files name '{entry.name}'. Expected one "
                f"file per named architecture. Received: a second in "
                f"{resource.name}."
            )
        by_name[entry.name] = entry
    if not by_name:
        raise RuntimeError(
            f"No preset data files were found in the package {_DATA_PACKAGE}. "
            "Expected the *.json files of presets/ to be installed with "
            "keras_hub_dist. Received: an empty package; reinstall it."
        )
    keys: dict[str, str] = {}
    for entry in by_name.values():
        for key in (entry.name, entry.kerashub_preset, entry.handle, *entry.aliases):
            owner = keys.setdefault(key.lower(), entry.name)
            if owner != entry.name:
                raise ValueError(
                    f"The name {key!r} resolves to both '{owner}' and "
                    f"'{entry.name}'. Expected every name and alias to be "
                    "unique across presets/."
                )
    return by_name, keys


def names() -> list[str]:
    """The canonical names of every named architecture, sorted.

    Aliases (see `aliases()`) resolve too; `gemma2_7b` is an alias of
    `gemma_7b_en` because KerasHub publishes no Gemma 2 7B checkpoint.
    """
    return sorted(_load()[0])


def aliases() -> dict[str, str]:
    """Every alias -> the canonical name it resolves to."""
    return {
        alias: entry.name
        for entry in _load()[0].values()
        for alias in entry.aliases
    }


def entries() -> list[PresetEntry]:
    """Every named architecture's entry, sorted by name."""
    by_name = _load()[0]
    return [by_name[name] for name in sorted(by_name)]


def resolve(name: str) -> PresetEntry:
    """The entry of a named architecture, alias, KerasHub preset or handle.

    Names are matched case-insensitively.

    Args:
        name: e.g. `"gemma_7b_en"`, `"gemma2_7b"` (alias of `gemma_7b_en`),
            `"llama3.1_8b"` or `"kaggle://keras/gemma/keras/gemma_7b_en/4"`.

    Returns:
        The frozen `PresetEntry`.

    Raises:
        UnknownPresetError: the name is unknown; the message lists the
            closest known names.

    Example:

    >>> resolve("gemma2_7b").name
    'gemma_7b_en'
    """
    if not isinstance(name, str) or not name.strip():
        raise UnknownPresetError(
            "Expected the name of a named architecture, e.g. 'gemma_7b_en'. "
            f"Received: name={name!r}."
        )
    by_name, keys = _load()
    key = name.strip().lower()
    if key in keys:
        return by_name[keys[key]]
    known = sorted(set(by_name) | set(aliases()))
    closest = difflib.get_close_matches(key, known, n=5, cutoff=0.5)
    hint = (
        f"The closest known names are {closest}." if closest
        else "No known name is close."
    )
    raise UnknownPresetError(
        f"Unknown architecture name {name!r}. {hint} Expected one of "
        f"keras_hub_dist.presets.names() ({len(by_name)} architectures) or an "
        f"alias. Received: name={name!r}. For a local preset directory or "
        "another KerasHub preset, pass its config instead."
    )


def is_preset_dir(path: Any) -> bool:
    """Whether `path` is a local directory holding a `config.json`."""
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(
        os.path.join(os.fspath(path), CONFIG_FILE)
    )


def _too_large(name: str, size: int, limit: int) -> PresetError:
    return PresetError(
        f"{name!r} is too large to be a config file. Expected a JSON file of at "
        f"most {limit} bytes. Received: {size} bytes. Check that the file is the "
        "checkpoint's own (re-download it)."
    )


def read_json(path: str | os.PathLike, limit: int = JSON_FILE_LIMIT) -> Any:
    """Reads a JSON file, naming the file, line and column of a syntax error.

    Raises:
        PresetError: The file is over `limit` bytes (checked before it is
            read), not valid JSON, or not UTF-8 text.
    """
    path = os.fspath(path)
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size > limit:
            raise _too_large(path, size, limit)
        return parse_json(handle.read(limit + 1), path, limit)


def read_json_object(location: Any, name: str, limit: int = JSON_FILE_LIMIT) -> dict[str, Any]:
    """File `name` of a `storage.locations.Location`, as a JSON object, its
    size checked before a byte of it is read.

    Raises:
        FileNotFoundError: There is no such file.
        PresetError: It is over `limit` bytes, not UTF-8 JSON, or not an
            object.
    """
    path = location.path_of(name)
    opened = location.open(name)
    size = opened.size
    getattr(opened, "close", lambda: None)()
    if size > limit:
        raise _too_large(path, size, limit)
    parsed = parse_json(location.read_bytes(name), path, limit)
    if not isinstance(parsed, dict):
        raise PresetError(
            f"{path!r} holds a JSON {type(parsed).__name__}. Expected a JSON object. "
            "Fix or re-download the file."
        )
    return parsed


def parse_json(data: bytes, name: str, limit: int = JSON_FILE_LIMIT) -> Any:
    """Parses the bytes of JSON file `name` (a path or a URL), naming the
    file, line and column of a syntax error.

    Raises:
        PresetError: Over `limit` bytes, not valid JSON (or nested past
            Python's recursion limit), or not UTF-8 text.
    """
    if len(data) > limit:
        raise _too_large(name, len(data), limit)
    try:
        return json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise PresetError(
            f"{name!r} is not valid JSON: {e.msg} at line {e.lineno}, column "
            f"{e.colno}. Expected a JSON object. Received: a file of "
            f"{len(data)} bytes. Fix or re-download the file."
        ) from e
    except UnicodeDecodeError as e:
        raise PresetError(
            f"{name!r} is not UTF-8 text. Expected a JSON file. Received: "
            f"{e}. Fix or re-download the file."
        ) from e
    except (RecursionError, ValueError) as e:  # deep nesting; a 5000-digit int
        raise PresetError(
            f"{name!r} cannot be parsed. Expected a JSON object of plain values. "
            f"Received: {type(e).__name__}: {str(e)[:200]}. Fix or re-download the file."
        ) from None


def _backbone_class_from_config(config_json: Mapping[str, Any]) -> type:
    import keras
    import keras_hub

    class_name = config_json.get("class_name")
    cls = getattr(keras_hub.models, str(class_name), None)
    if cls is None and config_json.get("registered_name"):
        cls = keras.saving.get_registered_object(config_json["registered_name"])
    if not isinstance(cls, type):
        raise ValueError(
            "Expected a KerasHub backbone config.json object whose class_name "
            "names a keras_hub.models backbone class. Received: "
            f"class_name={class_name!r}."
        )
    return cls


def backbone_config(
    name_or_config: Any,
    /,
    *,
    backbone_class: type | None = None,
    **overrides: Any,
) -> tuple[type, dict[str, Any], PresetEntry | None]:
    """Resolves a named architecture or config to `(class, kwargs, entry)`.

    Args:
        name_or_config: A named architecture or alias (`"gemma_7b_en"`), a
            `PresetEntry`, a local preset directory holding `config.json`, a
            KerasHub `config.json` object (`{"class_name": ..., "config":
            {...}}`), or a plain dict of backbone constructor arguments (then
            `backbone_class` names the class).
        backbone_class: The class for a plain dict (ignored otherwise).
        **overrides: Constructor arguments replacing the config's, e.g.
            `num_layers=2, dtype="bfloat16"`. A smaller `num_layers` keeps
            the model's leading layers: per-layer lists (`layer_types`) are
            cut to it, and Gemma 4's trailing KV-shared layers shrink so
            that its leading non-shared ones stay (none may be left).

    Returns:
        `(backbone class, constructor kwargs (a fresh dict), entry or None)`.

    Example:

    >>> cls, config, entry = backbone_config("gemma2_7b", num_layers=2)
    >>> cls.__name__, config["num_layers"], entry.name
    ('GemmaBackbone', 2, 'gemma_7b_en')
    """
    entry = None
    if isinstance(name_or_config, PresetEntry):
        entry = name_or_config
    elif is_preset_dir(name_or_config):
        name_or_config = read_json(os.path.join(os.fspath(name_or_config), CONFIG_FILE))
    elif isinstance(name_or_config, str):
        entry = resolve(name_or_config)
    if entry is not None:
        cls, config = entry.backbone_class, entry.config
    elif isinstance(name_or_config, Mapping):
        if "class_name" in name_or_config and isinstance(
            name_or_config.get("config"), Mapping
        ):
            cls = _backbone_class_from_config(name_or_config)
            config = json.loads(json.dumps(name_or_config["config"]))
        elif backbone_class is not None:
            cls, config = backbone_class, dict(name_or_config)
        else:
            raise ValueError(
                "Expected a named architecture, a KerasHub config.json object "
                "(with 'class_name' and 'config'), or a plain config dict with "
                "`backbone_class=`. Received: a dict with keys "
                f"{sorted(name_or_config)[:8]} and no backbone_class."
            )
    else:
        raise TypeError(
            "Expected a named architecture (str), a PresetEntry, a preset "
            "directory or a config dict. Received: "
            f"{name_or_config!r} of type {type(name_or_config).__name__}."
        )
    depth = config.get("num_layers")
    config.update(overrides)
    if isinstance(depth, int) and isinstance(config.get("num_layers"), int) and config["num_layers"] < depth:
        _keep_leading_layers(config, depth, given=set(overrides))
    return cls, config, entry


def _keep_leading_layers(config: dict[str, Any], depth: int, given: set[str]) -> None:
    """`config` (of a `depth`-layer model, `num_layers` now smaller) made
    consistent: the first `num_layers` layers of the model, as they were.
    Keys in `given` (overridden explicitly) stay as given."""
    num_layers = config["num_layers"]
    for key, value in config.items():
        if key.endswith("layer_types") and key not in given and isinstance(value, list) and len(value) == depth:
            config[key] = value[:num_layers]
    shared = config.get("num_kv_shared_layers")
    if isinstance(shared, int) and shared > 0 and "num_kv_shared_layers" not in given:
        # Trailing layers reuse the K/V of the last non-shared layer of their
        # kind; cut from the end, they go first (a drafter, all shared, stays so).
        config["num_kv_shared_layers"] = max(0, num_layers - (depth - shared)) if shared < depth else num_layers
