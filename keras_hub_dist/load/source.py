"""Where a load reads from: resolving what the user passed, and its JSON files.

`load_sharded_preset` accepts a local directory, a remote location read by
byte ranges (`"s3://..."`, `"gs://..."`, `"hf://..."`, `"https://..."`; see
`storage.locations`), a KerasHub preset name or handle (`"gemma_7b_en"`,
`"kaggle://..."`, fetched by KerasHub's own downloader), or a keras_hub_dist
architecture name. Typos and missing directories are caught here, with the
close names, before KerasHub's generic "Unknown preset identifier".
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from typing import Any

from keras_hub_dist import _compat
from keras_hub_dist.errors import PresetError
from keras_hub_dist.storage.locations import Location, is_url
from keras_hub_dist.plan import presets

__all__ = ["PresetSource", "read_config", "read_metadata", "resolve_source"]

_METADATA_FILE = "metadata.json"


@dataclasses.dataclass(frozen=True)
class PresetSource:
    """A resolved preset.

    Attributes:
        ref: A local directory, a remote location or a KerasHub handle
            (`storage.locations.open_location` opens it).
        label: How messages name it.
        short: A short name for the progress bar.
    """

    ref: str
    label: str
    short: str


def _looks_like_path(preset: str) -> bool:
    return (
        os.sep in preset
        or (os.altsep is not None and os.altsep in preset)
        or preset.startswith((".", "~"))
    )


def _unknown(preset: str) -> PresetError:
    if os.path.isfile(preset):
        return PresetError(
            f"The preset {preset!r} is a file. Expected a preset directory "
            "holding config.json and the weights. Received: a file, not a "
            "directory. Pass the directory it is in, "
            f"{os.path.dirname(os.path.abspath(preset))!r}, if that is the preset."
        )
    if _looks_like_path(preset):
        parent = os.path.dirname(os.path.abspath(os.path.expanduser(preset)))
        return PresetError(
            f"The preset directory {preset!r} does not exist. Expected a "
            "directory holding config.json and the weights. Received: no such "
            f"directory ({'its parent exists' if os.path.isdir(parent) else 'nor its parent ' + repr(parent)}). "
            "Check the path, or pass a KerasHub preset name or handle."
        )
    known = presets.names() + list(presets.aliases()) + _compat.builtin_preset_names()
    close = difflib.get_close_matches(preset, known, n=5, cutoff=0.6)
    hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    return PresetError(
        f"Unknown preset {preset!r}. Expected a local preset directory, a "
        "KerasHub preset name or handle ('kaggle://...', 'hf://...'), or a "
        "keras_hub_dist architecture name (keras_hub_dist.presets.names()). "
        f"Received: {preset!r}, which is none of these.{hint}"
    )


def resolve_source(preset: Any) -> PresetSource:
    """Resolves what the user passed as a preset.

    Raises:
        PresetError: Not a string or path; a file, or a directory that does
            not exist; a name that is neither a KerasHub preset nor a
            keras_hub_dist architecture (the message lists the closest names).
    """
    if isinstance(preset, os.PathLike):
        preset = os.fspath(preset)
    if not isinstance(preset, str) or not preset:
        raise PresetError(
            "Expected a preset: a local preset directory, a KerasHub "
            "preset name or handle, or a keras_hub_dist architecture name. "
            f"Received: preset={preset!r}."
        )
    short = preset.rstrip("/").split("/")[-1]
    if is_url(preset):  # before any local look-up: a URL is never a local path
        return PresetSource(preset, preset, short)
    if os.path.isdir(preset):
        return PresetSource(preset, preset, os.path.basename(os.path.normpath(preset)))
    if preset in _compat.builtin_preset_names():
        return PresetSource(preset, preset, short)
    try:
        entry = presets.resolve(preset)
    except ValueError:
        raise _unknown(preset) from None
    return PresetSource(entry.handle, f"{preset} ({entry.handle})", entry.name)


def read_config(location: Location) -> dict[str, Any]:
    """The preset's `config.json`.

    Raises:
        PresetError: There is none, or it is over
            `presets.JSON_FILE_LIMIT` bytes, not valid JSON (naming the file
            and the line) or not a JSON object.
    """
    try:
        return presets.read_json_object(location, presets.CONFIG_FILE)
    except FileNotFoundError as e:
        raise PresetError(
            f"The preset {location.label!r} has no {presets.CONFIG_FILE}. Expected a "
            "KerasHub preset (written by `save_to_preset`) or a Hugging Face "
            f"checkpoint directory. Received: {e}"
        ) from e


def read_metadata(location: Location) -> dict[str, Any]:
    """The preset's `metadata.json`, or `{}` without one."""
    if not location.has(_METADATA_FILE):
        return {}
    return presets.read_json_object(location, _METADATA_FILE)
