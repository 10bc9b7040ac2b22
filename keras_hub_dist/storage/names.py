"""The names a checkpoint gives (index entries, listed keys, asset paths)
are checked here, and only here, before anything is read or written.

A checkpoint is untrusted input: a bucket's owner, a Hub repository or a
copied directory decides what its index, its listing and its configs name.
Every such name goes through `check_name` (the rules), and then:

- `local_path`: a file of a local checkpoint, whose real path
  (`os.path.realpath`, every symlink followed) lies inside the checkpoint's
  root; the one exception is a Hugging Face cache snapshot
  (`.../models--org--name/snapshots/<rev>/file -> ../../blobs/<hash>`),
  whose files may resolve into that same repository's `blobs/`.
- `remote_key`: the object key of a file under a remote prefix, which
  stays under the prefix after normalization.
- `check_asset_paths`: a KerasHub config (`tokenizer.json`,
  `preprocessor.json`, `task.json`) names no file for a tokenizer to read
  (`proto`, `vocabulary`, `merges` as a string are a path KerasHub's
  tokenizers open as given, relative to the working directory: a stock
  preset stores them as assets and leaves these `null`).
- `create_staged`: a small remote file written into a local staging
  folder: created there only (no symlink followed on the way, no existing
  file replaced: `O_CREAT | O_EXCL | O_NOFOLLOW`).

A refused name raises `PresetError` (or the caller's error class) naming
the name, where it was read, the rule it breaks and the fix.

Example:

```python
check_name("model-00001-of-00002.safetensors", source="model.safetensors.index.json")
path = local_path("/ckpt", "model-00001-of-00002.safetensors", source="...")
```
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
import uuid
from typing import Any

from keras_hub_dist.errors import PresetError

__all__ = ["check_asset_paths", "check_name", "create_staged", "local_path", "remote_key", "rule_broken"]

_DRIVE = re.compile(r"^[A-Za-z]:")
_RULES = (
    "a relative name of '/'-separated segments: no leading '/', no empty "
    "segment, no '.' or '..' segment, no drive letter, backslash or NUL"
)


def rule_broken(name: object) -> str | None:
    """Which rule `name` breaks (a phrase), or `None` when it is a valid
    name of a file inside a checkpoint."""
    if not isinstance(name, str):
        return f"is not a string but a {type(name).__name__}"
    if not name:
        return "is empty"
    if "\x00" in name:
        return "holds a NUL character"
    if "\\" in name:
        return "holds a backslash"
    if _DRIVE.match(name):
        return "starts with a drive letter"
    if name.startswith("/"):
        return "is an absolute path"
    segments = name.split("/")
    if "" in segments:
        return "has an empty segment ('//' or a trailing '/')"
    if ".." in segments:
        return "has a '..' segment"
    # '.' names the folder itself ('.' alone opened the checkpoint's directory:
    # a raw IsADirectoryError), and a remote store keeps it as it is.
    if "." in segments:
        return "has a '.' segment"
    return None


def _refused(name: object, source: str, why: str, error: type[Exception]) -> Exception:
    return error(
        f"{source} names {name!r}, which {why}. Expected {_RULES}, naming a "
        f"file inside the checkpoint. Received: {name!r}. A checkpoint's names "
        "never reach outside it: nothing was read or written. Fix the name where "
        "the checkpoint lists it (or ask its author to), or do not load it."
    )


def check_name(name: object, *, source: str, error: type[Exception] = PresetError) -> str:
    """`name` itself, when it is a valid relative name of a file inside a
    checkpoint (see `rule_broken`).

    Args:
        name: What the checkpoint names (an index entry, a listed key).
        source: Where the name was read, for the message (an index file,
            a listing URL).
        error: The class raised (the caller's own: `PresetError`,
            `CheckpointError`).

    Raises:
        PresetError: The name breaks a rule.
    """
    why = rule_broken(name)
    if why is not None:
        raise _refused(name, source, why, error)
    return name  # type: ignore[return-value]


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _hub_blobs(root: str) -> str | None:
    """The `blobs/` folder of the Hugging Face cache repository whose
    snapshot holds `root` (`.../models--org--name/snapshots/<rev>[/sub]`),
    or `None` where `root` is not inside a snapshot."""
    parts = os.path.abspath(root).split(os.sep)
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(("models--", "datasets--", "spaces--")):
            blobs = os.path.join(os.path.realpath(os.sep.join(parts[:i])), "blobs")
            # `blobs` itself a link (to `/`, say) would let every link in.
            return blobs if os.path.realpath(blobs) == blobs else None
    return None


def local_path(root: str, name: str, *, source: str, error: type[Exception] = PresetError) -> str:
    """The path of file `name` of the local checkpoint at `root`
    (`os.path.join(root, name)`), once `name` is valid and its real path is
    inside `root` (or, for a Hugging Face cache snapshot, inside its
    repository's `blobs/`).

    Raises:
        PresetError: The name breaks a rule, or the file resolves (through
            a symlink) outside the checkpoint.
    """
    check_name(name, source=source, error=error)
    path = os.path.join(root, name)
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if _inside(real, real_root):
        return path
    blobs = _hub_blobs(root)
    if blobs is not None and _inside(real, blobs) and real != blobs:
        return path
    raise error(
        f"{path!r} (named by {source}) resolves to {real!r}, outside the "
        f"checkpoint {real_root!r}. Expected every file of a checkpoint inside "
        "its directory (a symlink only into the same Hugging Face cache "
        f"repository's blobs/). Received: a link to {real!r}; nothing was read. "
        "Copy the file into the checkpoint directory instead of linking it."
    )


def remote_key(prefix: str, name: str, *, source: str) -> str:
    """The object key of file `name` under remote `prefix` (`prefix/name`,
    or `name` for an empty prefix), once `name` is valid and the key stays
    under the prefix after normalization.

    Raises:
        PresetError: It does not.
    """
    check_name(name, source=source)
    prefix = prefix.strip("/")
    key = f"{prefix}/{name}" if prefix else name
    normal = posixpath.normpath(key)
    if prefix and not normal.startswith(prefix + "/"):
        raise _refused(name, source, f"leaves the prefix {prefix!r} ({normal!r})", PresetError)
    return key


def create_staged(folder: str, name: str, data: bytes, *, source: str) -> str:
    """Writes `data` as file `name` inside staging folder `folder`, creating
    the subfolders it needs; returns its path.

    Nothing outside `folder` is touched: each subfolder is opened relative to
    the one above without following a symlink, and the file is written under
    a fresh name (`O_CREAT | O_EXCL | O_NOFOLLOW`), then linked to `name`
    whole, which never replaces what is there. A plain file of `name` holding
    exactly `data` (an earlier load's, or another process's racing this one)
    is kept; anything else there is refused.

    Raises:
        PresetError: The name breaks a rule, a subfolder is a symlink, or
            something else than `data` exists as `name`.
    """
    check_name(name, source=source)
    *subfolders, leaf = name.split("/")
    fd = os.open(folder, os.O_RDONLY | _DIRECTORY)
    try:
        for part in subfolders:
            try:
                os.mkdir(part, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            try:
                below = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW, dir_fd=fd)
            except OSError as e:
                raise _staging_refused(folder, name, source, f"its folder {part!r} is not a plain folder ({e.strerror})") from None
            os.close(fd)
            fd = below
        if not _holds(fd, leaf, data):
            _write_new(fd, leaf, data, lambda why: _staging_refused(folder, name, source, why))
    finally:
        os.close(fd)
    return os.path.join(folder, name)


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_EXISTS = "a link, or a file with other bytes, of that name exists there already"


def _holds(fd: int, leaf: str, data: bytes) -> bool:
    """Whether `leaf` (in folder `fd`) is a plain file holding `data`."""
    try:
        opened = os.open(leaf, os.O_RDONLY | _NOFOLLOW, dir_fd=fd)
    except OSError:  # none, or a link (ELOOP)
        return False
    with os.fdopen(opened, "rb") as f:
        return stat.S_ISREG(os.fstat(f.fileno()).st_mode) and f.read(len(data) + 1) == data


def _write_new(fd: int, leaf: str, data: bytes, refused: Any) -> None:
    temporary = f".{leaf}.{uuid.uuid4().hex}.part"
    out = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=fd)
    try:
        with os.fdopen(out, "wb") as f:
            f.write(data)
        try:
            os.link(temporary, leaf, src_dir_fd=fd, dst_dir_fd=fd, follow_symlinks=False)
        except FileExistsError:
            if not _holds(fd, leaf, data):  # another process's same bytes pass
                raise refused(_EXISTS) from None
        except OSError:  # a filesystem without hard links: create it directly
            try:
                out = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644, dir_fd=fd)
            except FileExistsError:
                raise refused(_EXISTS) from None
            with os.fdopen(out, "wb") as f:
                f.write(data)
    finally:
        os.unlink(temporary, dir_fd=fd)


def _staging_refused(folder: str, name: str, source: str, why: str) -> PresetError:
    return PresetError(
        f"Staging {name!r} (from {source}) into {folder!r} was refused: {why}. "
        "Expected a staging folder holding only what this load fetched. Received: "
        "something else there (another process, or a link planted in the cache "
        "folder). Nothing was replaced: empty the cache folder, or use another one."
    )


# Tokenizer arguments KerasHub's tokenizers open as a file path when given a
# string (`SentencePieceTokenizer.set_proto`, `BytePairTokenizer`,
# `WordPieceTokenizer`, ...); a stock preset leaves them `null` (its assets
# are read from `assets/tokenizer/`).
_ASSET_ARGUMENTS = frozenset({"proto", "vocabulary", "merges", "spm_proto", "vocabulary_file",
                              "merges_file", "tokenizer_file", "dict_or_path"})
_INLINE_PROTO_CHARS = 2048  # KerasHub reads a longer base64 string as the proto itself


def _inline(key: str, value: str) -> bool:
    if key not in ("proto", "spm_proto") or len(value) <= _INLINE_PROTO_CHARS:
        return False
    return re.fullmatch(r"[A-Za-z0-9+/=\s]+", value) is not None


def check_asset_paths(config: object, *, source: str) -> None:
    """Refuses a KerasHub config (any nesting) that gives a tokenizer a file
    path (`proto`, `vocabulary`, `merges`, ... as a string): KerasHub would
    open it as given, outside the checkpoint.

    Raises:
        PresetError: Naming the config, the argument and the fix.
    """
    stack = [config]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in _ASSET_ARGUMENTS and isinstance(value, str) and not _inline(key, value):
                    raise PresetError(
                        f"{source} gives a tokenizer {key}={value[:200]!r}, a file path "
                        "KerasHub would open as given, outside the checkpoint. Expected "
                        f"{key}=null (a preset keeps its tokenizer files under "
                        "assets/tokenizer/, which KerasHub reads itself) or the data "
                        f"inline. Received: a path. Nothing was read; set {key!r} to "
                        "null in that config (save_to_preset writes it so)."
                    )
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
