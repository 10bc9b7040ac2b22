"""The embedding-path registry: which variable path is a family's token table.

The distributed initializers look the path up in the active distribution's
LayoutMap when Keras does not hand them a layout. The defaults cover the
KerasHub LLM families; users add or override entries in code, temporarily
with a context manager, or without code through the environment variable
`KERAS_HUB_DIST_EMBEDDING_PATHS` (a JSON object, or the path of a JSON file
holding one), read once when the registry is first used.

Example:

```python
from keras_hub_dist import registry

registry.register("my_llm", "decoder/tok_emb/embeddings")
with registry.override("gemma", "backbone/token_embedding/embeddings"):
    ...
registry.lookup("gemma")  # 'token_embedding/embeddings'
```
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from collections.abc import Iterator
from typing import Any

from keras_hub_dist.plan.families import keras_hub_family

__all__ = [
    "DEFAULT_FAMILY",
    "ENV_VAR",
    "entries",
    "family_of",
    "lookup",
    "override",
    "register",
    "unregister",
]

ENV_VAR = "KERAS_HUB_DIST_EMBEDDING_PATHS"
DEFAULT_FAMILY = "default"

# Every KerasHub decoder LLM names its `ReversibleEmbedding` "token_embedding"
# at the top of the backbone, so the variable path is the same across families;
# the entries still exist per family so one can be moved without the others.
# (Gemma 4's second token-indexed table, `per_layer_token_embedding/embeddings`,
# is not a family's token table: the factory gives its twin that exact path.)
_BUILTIN: dict[str, str] = {
    DEFAULT_FAMILY: "token_embedding/embeddings",
    "gemma": "token_embedding/embeddings",
    "gemma2": "token_embedding/embeddings",
    "gemma3": "token_embedding/embeddings",
    "gemma4": "token_embedding/embeddings",
    "gpt_oss": "token_embedding/embeddings",
    "llama": "token_embedding/embeddings",
    "llama3": "token_embedding/embeddings",
    "mistral": "token_embedding/embeddings",
    "mixtral": "token_embedding/embeddings",
    "qwen": "token_embedding/embeddings",
    "qwen3": "token_embedding/embeddings",
    "qwen_moe": "token_embedding/embeddings",
    "qwen3_moe": "token_embedding/embeddings",
    "qwen3_5": "token_embedding/embeddings",
    "qwen3_5_moe": "token_embedding/embeddings",
    "phi3": "token_embedding/embeddings",
}

_lock = threading.RLock()
_entries: dict[str, str] | None = None


def _normalize_family(family: str) -> str:
    if not isinstance(family, str) or not family.strip():
        raise ValueError(
            f"Expected a non-empty family name. Received: family={family!r}."
        )
    return family.strip().lower()


def _validate_path(family: str, path: Any) -> str:
    if not isinstance(path, str) or not path.strip():
        raise ValueError(
            f"Expected a non-empty variable path (or regex) for family "
            f"'{family}'. Received: path={path!r}."
        )
    try:
        re.compile(path)
    except re.error as error:
        raise ValueError(
            f"Expected the path of family '{family}' to be a valid regex, as "
            f"LayoutMap keys are. Received: path={path!r} ({error})."
        ) from None
    return path


def _from_environment() -> dict[str, str]:
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return {}
    source = "the value"
    if not raw.startswith(("{", "[")):
        source = f"the file {raw!r}"
        try:
            with open(raw, encoding="utf-8") as handle:
                raw = handle.read()
        except OSError as error:
            raise ValueError(
                f"{ENV_VAR} must be a JSON object or the path of a JSON file. "
                f"Received: {raw!r}, which cannot be read ({error})."
            ) from None
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{ENV_VAR}: expected a JSON object mapping family names to "
            f"variable paths. Received: {source}, which is not JSON ({error})."
        ) from None
    if not isinstance(data, dict):
        raise ValueError(
            f"{ENV_VAR}: expected a JSON object mapping family names to "
            f"variable paths. Received: {source}, a {type(data).__name__}."
        )
    return {
        _normalize_family(family): _validate_path(family, path)
        for family, path in data.items()
    }


def _table() -> dict[str, str]:
    global _entries
    with _lock:
        if _entries is None:
            _entries = {**_BUILTIN, **_from_environment()}
        return _entries


def register(family: str, path: str, *, overwrite: bool = False) -> None:
    """Registers the embedding variable path (or regex) of a model family.

    Args:
        family: Family name, e.g. `"gemma"` (case-insensitive).
        path: The variable path, as LayoutMap keys see it, e.g.
            `"token_embedding/embeddings"`. A regex is allowed.
        overwrite: Replace an existing entry instead of raising.

    Raises:
        ValueError: the family exists and `overwrite` is False, or the path is
            not a valid regex.
    """
    family = _normalize_family(family)
    path = _validate_path(family, path)
    with _lock:
        table = _table()
        if family in table and not overwrite and table[family] != path:
            raise ValueError(
                f"Family '{family}' is already registered with path "
                f"{table[family]!r}. Expected a new family, or overwrite=True. "
                f"Received: path={path!r}. Use registry.override() to change it "
                "temporarily."
            )
        table[family] = path


def unregister(family: str) -> None:
    """Removes a family's entry (the default entry cannot be removed)."""
    family = _normalize_family(family)
    if family == DEFAULT_FAMILY:
        raise ValueError(
            f"Expected a family other than '{DEFAULT_FAMILY}': the default "
            "entry backs initializers created without a `path`."
        )
    with _lock:
        _table().pop(family, None)


def lookup(family: str | None = None) -> str:
    """The embedding path of `family` (default: the `"default"` entry).

    Raises:
        KeyError: unknown family; the message lists the known ones.
    """
    family = DEFAULT_FAMILY if family is None else _normalize_family(family)
    table = _table()
    if family not in table:
        raise KeyError(
            f"No embedding path is registered for family '{family}'. Expected "
            f"one of {sorted(table)}. Register it with "
            f"keras_hub_dist.registry.register('{family}', '<variable path>') "
            f"or the {ENV_VAR} environment variable."
        )
    return table[family]


def entries() -> dict[str, str]:
    """A copy of every registered `family -> path` entry."""
    with _lock:
        return dict(_table())


@contextlib.contextmanager
def override(family: str, path: str) -> Iterator[None]:
    """Sets `family`'s path inside a `with` block, restoring it afterwards.

    The previous entry (or its absence) comes back even if the block raises.
    """
    family = _normalize_family(family)
    path = _validate_path(family, path)
    with _lock:
        table = _table()
        missing = object()
        previous = table.get(family, missing)
        table[family] = path
    try:
        yield
    finally:
        with _lock:
            if previous is missing:
                table.pop(family, None)
            else:
                table[family] = previous


def family_of(model_or_class: Any) -> str | None:
    """The registry family of a KerasHub backbone class or instance, if any."""
    return keras_hub_family(model_or_class, _table())


def _reset_for_tests() -> None:
    """Forgets runtime registrations and re-reads the environment."""
    global _entries
    with _lock:
        _entries = None
