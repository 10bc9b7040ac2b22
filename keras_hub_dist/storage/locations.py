"""Where a checkpoint lives: a local directory, a KerasHub handle, or a
remote location read by byte ranges.

Every format reads a checkpoint through a `Location`: its small files whole
(`read_bytes`: config.json, the safetensors index, metadata.json), its
weight files by ranges (`open`: a `host_io.LocalFile` or a
`ranged_http.RemoteFile`, both with `read_stretches`), and, for KerasHub's
own task and tokenizer loaders, a local directory holding the files that
are not weights (`keras_hub_dir`).

- `LocalDirectory`: a directory on this host (or a shared filesystem).
- `KerasHubHandle`: a KerasHub preset name or `kaggle://` handle, fetched by
  KerasHub's own downloader into its cache: whole files, on every host
  (Kaggle's download API is what KerasHub uses; range reads of it were not
  available to test here, so a `RemoteDownloadWarning` says so).
- `RemoteLocation`: `s3://`, `gs://`, `hf://`, `http(s)://` (see
  `storage.object_stores`): small files are fetched into memory, weight
  files are never downloaded whole, and the files KerasHub's tokenizer
  loaders read from disk (only for `task=...`) are fetched into a temporary
  directory that is removed after the load (or kept in `cache_dir`).

Example:

```python
with open_location("s3://bucket/gemma_7b_en") as location:
    config = json.loads(location.read_bytes("config.json"))
    weights = location.open("model.weights.h5")       # a RemoteFile
```
"""

from __future__ import annotations

import abc
import hashlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from keras_hub_dist import _compat
from keras_hub_dist.errors import PresetError, RemoteDownloadWarning
from keras_hub_dist.storage import host_io
from keras_hub_dist.storage.names import check_asset_paths, check_name, create_staged, local_path
from keras_hub_dist.storage.object_stores import REMOTE_SCHEMES, Store, open_store, parse_hub_location
from keras_hub_dist.storage.ranged_http import RangeClient

__all__ = [
    "KerasHubHandle",
    "LocalDirectory",
    "Location",
    "RemoteLocation",
    "WEIGHT_SUFFIXES",
    "check_keras_hub_configs",
    "keras_hub_configs",
    "is_remote",
    "is_url",
    "open_location",
]

# Files that hold weights: never fetched whole from a remote location.
WEIGHT_SUFFIXES = (".h5", ".safetensors", ".bin", ".pt", ".pth", ".msgpack", ".gguf", ".npz")
# What KerasHub's loaders may read from a preset besides weights, for a
# location that cannot be listed (plain HTTP).
_KNOWN_SMALL_FILES = (
    "config.json", "metadata.json", "task.json", "preprocessor.json", "tokenizer.json",
    "assets/tokenizer/vocabulary.spm", "assets/tokenizer/vocabulary.json",
    "assets/tokenizer/vocabulary.txt", "assets/tokenizer/merges.txt",
    "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "tekken.json",
    "model.safetensors.index.json", "model.weights.json",
)


# KerasHub's own configs of what it builds from a preset besides the backbone.
_KERAS_HUB_CONFIGS = ("task.json", "preprocessor.json", "tokenizer.json")


def keras_hub_configs(location: Location) -> Iterator[tuple[str, dict]]:
    """Each KerasHub task, preprocessor or tokenizer config of `location`
    (`(file name, parsed config)`) that KerasHub will deserialize: one with a
    `registered_name`. Unparsable files are KerasHub's own loader's to
    refuse; a Hugging Face `tokenizer.json` (no `registered_name`) is
    KerasHub's converters' to read."""
    for name in _KERAS_HUB_CONFIGS:
        if not location.has(name):
            continue
        try:
            config = json.loads(location.read_bytes(name))
        except ValueError:
            continue
        if isinstance(config, dict) and "registered_name" in config:
            yield name, config


def check_keras_hub_configs(location: Location) -> None:
    """Refuses a KerasHub preset whose task, preprocessor or tokenizer config
    names a file for a tokenizer to open (`storage.names.check_asset_paths`),
    before KerasHub's loaders see it."""
    for name, config in keras_hub_configs(location):
        check_asset_paths(config, source=location.path_of(name))


def is_url(text: str) -> bool:
    """Whether `text` is a URL (`scheme://...`): never a local path, even
    where a local directory of that name (`./s3:/bucket/x`) exists."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.isascii() and scheme.replace("+", "").replace("-", "").isalnum()


def is_remote(preset: str) -> bool:
    """Whether `preset` names a location read by byte ranges."""
    return is_url(preset) and preset.split("://", 1)[0].lower() in REMOTE_SCHEMES


class Location(abc.ABC):
    """A checkpoint's files (see the module doc).

    Attributes:
        label: How messages name it.
    """

    label: str

    @abc.abstractmethod
    def has(self, name: str) -> bool:
        """Whether file `name` exists."""

    @abc.abstractmethod
    def read_bytes(self, name: str) -> bytes:
        """The whole of small file `name`.

        Raises:
            FileNotFoundError: There is none.
        """

    @abc.abstractmethod
    def open(self, name: str) -> Any:
        """File `name` for range reads (`read_stretches`, `read`, `size`).

        Raises:
            FileNotFoundError: There is none.
        """

    @abc.abstractmethod
    def keras_hub_dir(self) -> str:
        """What KerasHub's own loaders get as the preset (a directory or a
        handle) to read config, task, preprocessor and tokenizer files."""

    def path_of(self, name: str) -> str:
        """How file `name` is named in indexes and messages."""
        return name

    def local_copy(self, name: str) -> str:
        """A local path of small file `name` (fetched if needed), for
        KerasHub's loaders that read files by path (task weights)."""
        return self.path_of(name)

    def listing(self) -> str:
        """What the location holds, for messages."""
        return ""

    def close(self) -> None:
        """Releases what the location holds (temporary files)."""

    def __enter__(self) -> Location:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class LocalDirectory(Location):
    """A preset directory on this host."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.label = path

    def path_of(self, name: str) -> str:
        return os.path.join(self.path, name)

    def _file(self, name: str) -> str:
        # Every file read goes through here: a valid name whose real path is
        # inside the directory (`storage.names.local_path`).
        return local_path(self.path, name, source=f"the checkpoint {self.path!r}")

    def has(self, name: str) -> bool:
        return os.path.isfile(self._file(name))

    def read_bytes(self, name: str) -> bytes:
        with open(self._file(name), "rb") as f:
            return f.read()

    def open(self, name: str) -> host_io.LocalFile:
        return host_io.LocalFile(self._file(name))

    def local_copy(self, name: str) -> str:
        return self._file(name)

    def keras_hub_dir(self) -> str:
        check_keras_hub_configs(self)
        return self.path

    def listing(self) -> str:
        try:
            return ", ".join(sorted(os.listdir(self.path))[:30])
        except OSError:
            return ""


class KerasHubHandle(Location):
    """A KerasHub preset name or handle, downloaded by KerasHub (whole files)."""

    def __init__(self, handle: str, label: str | None = None) -> None:
        self.handle = handle
        self.label = label or handle
        self._warned = False

    def path_of(self, name: str) -> str:
        return _compat.preset_file(self.handle, check_name(name, source=self.label))

    def has(self, name: str) -> bool:
        return _compat.preset_has_file(self.handle, check_name(name, source=self.label))

    def read_bytes(self, name: str) -> bytes:
        with open(self.path_of(name), "rb") as f:
            return f.read()

    def open(self, name: str) -> host_io.LocalFile:
        if name.endswith(WEIGHT_SUFFIXES) and not self._warned:
            self._warned = True
            warnings.warn(
                f"{self.label!r} is fetched by KerasHub's downloader: every host "
                f"downloads whole weight files into its cache before loading "
                "(byte-range reads are used for s3://, gs://, hf:// and https:// "
                "locations). Copy the preset to one of those to read only each "
                "host's share.",
                RemoteDownloadWarning,
                stacklevel=2,
            )
        return host_io.LocalFile(self.path_of(name))

    def keras_hub_dir(self) -> str:
        check_keras_hub_configs(self)
        return self.handle


class RemoteLocation(Location):
    """A remote location read by byte ranges (see the module doc).

    Args:
        location: `s3://...`, `gs://...`, `hf://...` or `http(s)://...`.
        client: The `RangeClient` requests go through.
        cache_dir: Keep the files staged for KerasHub here (else a temporary
            directory removed on `close`).
    """

    def __init__(self, location: str, client: RangeClient, cache_dir: str | None = None) -> None:
        self.location = location.rstrip("/")
        self.label = self.location
        self.client = client
        self.store: Store = open_store(self.location, client)
        self._cache_dir = cache_dir
        self._stats: dict[str, Any] = {}
        self._small: dict[str, bytes] = {}
        self._staged: str | None = None
        self._listed: list[str] | None = None
        self._listed_once = False

    def path_of(self, name: str) -> str:
        return f"{self.location}/{name}"

    def _stat(self, name: str) -> Any:
        check_name(name, source=self.location)
        if name not in self._stats:
            self._stats[name] = self.store.stat(name)
        return self._stats[name]

    def has(self, name: str) -> bool:
        return self._stat(name) is not None

    def _missing(self, name: str) -> FileNotFoundError:
        held = self.listing()
        return FileNotFoundError(
            f"{self.path_of(name)} does not exist. "
            + (f"{self.location} holds: {held}." if held else
               f"{self.location} cannot be listed over plain HTTP.")
        )

    def read_bytes(self, name: str) -> bytes:
        cached = self.store.cached(check_name(name, source=self.location))
        if cached is not None:
            with open(cached, "rb") as f:
                return f.read()
        if name not in self._small:
            data = self.store.get(name)
            if data is None:
                raise self._missing(name)
            self._small[name] = data
        return self._small[name]

    def open(self, name: str) -> Any:
        cached = self.store.cached(check_name(name, source=self.location))
        if cached is not None:  # the same version, already on this host
            return host_io.LocalFile(cached)
        info = self._stat(name)
        if info is None:
            raise self._missing(name)
        return self.client.open(info, self.store, self.path_of(name))

    def _names(self) -> list[str] | None:
        if not self._listed_once:
            self._listed_once = True
            self._listed = self.store.list()
        return self._listed

    def listing(self) -> str:
        names = self._names()
        if names is None:
            return ""
        shown = sorted(names)[:30]
        return ", ".join(shown) + (f", ... ({len(names)} files)" if len(names) > 30 else "") or "no files"

    def local_copy(self, name: str) -> str:
        folder = self.keras_hub_dir()
        return create_staged(folder, name, self.read_bytes(name), source=self.location)

    def keras_hub_dir(self) -> str:
        """A local directory with every file of the location that is not a
        weight file, fetched once (for KerasHub's task and tokenizer loaders).

        Every listed name is checked first (`storage.names`: a key such as
        `prefix//etc/x` or `prefix/../x` is refused), and each file is
        created inside the folder only, never replacing what is there."""
        if self._staged is not None:
            return self._staged
        check_keras_hub_configs(self)
        names = self._names()
        if names is None:
            names = [n for n in _KNOWN_SMALL_FILES if self.has(n)]
        # A key ending in '/' (or the prefix itself) is a folder marker that
        # consoles create, not a file.
        names = [n for n in names if n and not n.endswith("/")]
        for name in names:
            check_name(name, source=f"the listing of {self.location}")
        names = [n for n in names if not n.endswith(WEIGHT_SUFFIXES)]
        with ThreadPoolExecutor(min(8, max(1, len(names)))) as pool:
            contents = list(pool.map(self.read_bytes, names))
        if self._cache_dir:
            # Named by the contents too: a folder holds one version of the
            # files, so a file found there is never rewritten.
            digest = hashlib.sha256(self.location.encode())
            for name, data in sorted(zip(names, contents)):
                digest.update(b"\0%s\0%s" % (name.encode(), hashlib.sha256(data).digest()))
            folder = os.path.join(self._cache_dir, digest.hexdigest()[:16])
            os.makedirs(folder, exist_ok=True)
        else:
            folder = tempfile.mkdtemp(prefix="keras_hub_dist-")
        for name, data in zip(names, contents):
            create_staged(folder, name, data, source=self.location)
        self._small = {n: d for n, d in self._small.items() if n not in names}
        self._staged = folder
        return folder

    def close(self) -> None:
        if self._staged is not None and not self._cache_dir:
            shutil.rmtree(self._staged, ignore_errors=True)
        self._staged = None


def open_location(
    preset: str,
    label: str | None = None,
    *,
    client: RangeClient | None = None,
    cache_dir: str | None = None,
) -> Location:
    """The `Location` of what `resolve_source` resolved `preset` to: a local
    directory, a remote location, or a KerasHub handle."""
    if not is_url(preset) and os.path.isdir(preset):
        return LocalDirectory(preset)
    if preset.lower().startswith("hf://") and _hub_offline():
        return LocalDirectory(_hub_snapshot(preset))
    if is_remote(preset):
        return RemoteLocation(preset, client or RangeClient(), cache_dir)
    return KerasHubHandle(preset, label)


def _hub_offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _hub_snapshot(location: str) -> str:
    """The local Hugging Face cache's snapshot of `hf://...` (offline mode)."""
    import huggingface_hub

    repo, revision, folder = parse_hub_location(location)
    try:
        path = huggingface_hub.snapshot_download(repo, revision=revision, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any cache miss is the same answer
        raise PresetError(
            f"{location} is not in the local Hugging Face cache, and huggingface_hub "
            f"is offline (HF_HUB_OFFLINE). Expected a cached snapshot of {repo!r} at "
            f"{revision!r}. Received: {type(e).__name__}: {e}. Go online, or download "
            "it first (`hf download`)."
        ) from None
    return os.path.join(path, folder) if folder else path
