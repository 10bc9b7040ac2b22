"""What a save writes into an object store: the interface S3 and GCS both
implement (`ObjectWriter`), and what they share.

A preset in a bucket is a set of objects under one prefix. Object stores
have no positioned writes and no rename; what they have, and what an
`ObjectWriter` offers the save:

- small objects written whole (`put`: config.json, metadata.json, owner
  records), read back (`get`), listed with their size, version and time
  (`list`), deleted (`delete`);
- large objects written by a multipart upload: one caller creates it
  (`create_upload`), any process then uploads numbered parts of it given
  the name and upload id (`upload_part`, from a bytes-like, no copy), one
  caller completes it with every part's token (`complete_upload`). The
  object appears only then, whole; until then readers see the old object
  or none. `abort_upload` drops the parts, `list_uploads` finds the
  uploads a killed save left (they cost money until aborted).

Parts are numbered 1..`MAX_PARTS` (10,000) in byte order; every part but
the last holds at least `MIN_PART` bytes (5 MiB on both stores, so one plan
of parts fits either). Uploading a part again under the same number
replaces it, so a retried part is harmless; the token of the last upload of
a number is the one to complete with.

Both stores keep a hidden folder beside the preset's files,
`<prefix>/.khd-uploads/` (`RESERVED`): the tiny probe object that
`check_writable` writes and deletes, and on GCS the parts and composites of
unfinished uploads. `list` never shows it.

Example:

```python
from keras_hub_dist.storage.uploads import open_writer

with open_writer("s3://my-bucket/gemma_7b_en") as writer:
    writer.check_writable()
    upload = writer.create_upload("model.weights.h5")
    token = writer.upload_part("model.weights.h5", upload, 1, memoryview(buffer))
    writer.complete_upload("model.weights.h5", upload, [(1, token)])
```
"""

from __future__ import annotations

import abc
import dataclasses
import datetime
from collections.abc import Iterable, Sequence
from typing import Any

from keras_hub_dist.errors import SaveError
from keras_hub_dist.storage.ranged_http import RangeClient

__all__ = ["MAX_PARTS", "MIN_PART", "RESERVED", "ObjectMeta", "ObjectWriter", "Upload"]

# The folder of a writer's own objects beside a preset's files.
RESERVED = ".khd-uploads"
MIN_PART = 5 << 20
MAX_PARTS = 10_000
# S3's largest part; GCS takes the same, so a plan fits both.
MAX_PART = 5 << 30


@dataclasses.dataclass(frozen=True)
class ObjectMeta:
    """One object under a writer's prefix.

    Attributes:
        size: Its length in bytes.
        version: What changes whenever the object is written again: the
            ETag on S3, the generation on GCS.
        updated: When it was last written (POSIX seconds, the store's clock).
    """

    size: int
    version: str
    updated: float


@dataclasses.dataclass(frozen=True)
class Upload:
    """An unfinished multipart upload under a writer's prefix.

    Attributes:
        name: The object it will write, relative to the prefix.
        upload_id: What `upload_part`, `complete_upload` and `abort_upload` take.
        initiated: When it was created (POSIX seconds, the store's clock).
    """

    name: str
    upload_id: str
    initiated: float


class ObjectWriter(abc.ABC):
    """One bucket and prefix that a preset is written into (see the module doc).

    Attributes:
        location: The location as the user wrote it (`s3://bucket/prefix`).
        bucket: The bucket.
        prefix: The prefix, without slashes at either end ("" for the root).
        client: The `RangeClient` whose connections every request uses (its
            `source_address`, `process_index` and `RetryPolicy` apply).
        MIN_PART: The fewest bytes of every part but the last.
        MAX_PARTS: The most parts of one upload.
    """

    MIN_PART = MIN_PART
    MAX_PARTS = MAX_PARTS
    location: str
    bucket: str
    prefix: str
    client: RangeClient

    def __init__(self, client: RangeClient | None) -> None:
        self.client = client or RangeClient()
        self._own_client = client is None

    def close(self) -> None:
        """Releases the connections, if the writer made its own client."""
        if self._own_client:
            self.client.close()

    def __enter__(self) -> ObjectWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.location!r})"

    # -- names ----------------------------------------------------------

    def key(self, name: str) -> str:
        """The object key (GCS: object name) of `name` under the prefix."""
        return f"{self.prefix}/{name}" if self.prefix else name

    def relative(self, key: str) -> str:
        """`name` of an object key under the prefix."""
        return key[len(self.prefix) + 1:] if self.prefix else key

    def where(self, name: str) -> str:
        """How messages name object `name`: `scheme://bucket/key`."""
        return f"{self.location.split('://', 1)[0]}://{self.bucket}/{self.key(name)}"

    def checked_name(self, name: str) -> str:
        """`name` if a preset's file may have it; `SaveError` otherwise."""
        if not isinstance(name, str) or not name or name.startswith("/") or "//" in name or (
            name == RESERVED or name.startswith(RESERVED + "/")
        ):
            raise SaveError(
                f"Expected a file name relative to {self.location} (not empty, no leading "
                f"'/', not under {RESERVED}/, which the writer keeps for itself). "
                f"Received: {name!r}."
            )
        return name

    # -- the interface ----------------------------------------------------

    @abc.abstractmethod
    def check_writable(self) -> None:
        """Proves, before any byte of a preset is uploaded, that this
        location can be written: the bucket exists, the credentials may
        write, delete and list under the prefix (a tiny probe object under
        `RESERVED` is written, deleted), and the prefix is not itself an
        object (a "file").

        Raises:
            SaveError: Naming what failed, the credentials used and how to
                fix it.
        """

    @abc.abstractmethod
    def get(self, name: str) -> bytes | None:
        """The whole of object `name`, or `None` when there is none."""

    @abc.abstractmethod
    def put(self, name: str, data: Any) -> None:
        """Writes small object `name` whole (replacing one that exists)."""

    @abc.abstractmethod
    def list(self, sub: str = "") -> dict[str, ObjectMeta]:
        """Every object whose name (relative to the prefix) starts with
        `sub`, `RESERVED` left out: `{name: ObjectMeta}`."""

    @abc.abstractmethod
    def delete(self, names: Iterable[str]) -> None:
        """Deletes objects `names` (relative to the prefix), many per
        request where the store allows; a missing one is fine."""

    @abc.abstractmethod
    def create_upload(self, name: str) -> str:
        """Starts a multipart upload of object `name`; returns its id."""

    @abc.abstractmethod
    def upload_part(self, name: str, upload_id: str, number: int, data: Any) -> str:
        """Uploads part `number` (1..`MAX_PARTS`) of an upload from `data`
        (any C-contiguous bytes-like: sent from its own memory, no copy).
        Failures that may pass (HTTP 429 / 5xx, a connection cut) are
        retried with backoff, the part re-sent whole. Returns the part's
        token (S3: its ETag; GCS: its generation) for `complete_upload`.

        Raises:
            SaveError: It still failed after the client's last try, or the
                upload does not exist (aborted, completed); the message
                names the object, the part and its bytes.
        """

    @abc.abstractmethod
    def complete_upload(self, name: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        """Makes object `name` of the given parts, `(number, token)` in
        ascending order of number; the object appears now, whole.

        Raises:
            SaveError: A part is missing or was uploaded again since its
                token was taken, a part but the last is under `MIN_PART`,
                or the upload does not exist.
        """

    @abc.abstractmethod
    def abort_upload(self, name: str, upload_id: str) -> None:
        """Drops an upload and its parts; an upload that is gone is fine."""

    @abc.abstractmethod
    def list_uploads(self) -> list[Upload]:
        """The unfinished uploads under the prefix, oldest first."""


def byte_view(data: Any) -> memoryview:
    """`data` as a flat memoryview of bytes, sharing its memory."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    if view.format == "B" and view.ndim == 1:
        return view
    if not view.c_contiguous:
        raise SaveError(
            "Expected a C-contiguous bytes-like part (it is sent from its own memory). "
            f"Received: a {view.ndim}-d view of format {view.format!r} that is not contiguous."
        )
    return view.cast("B")


def check_part(writer: ObjectWriter, name: str, number: int, size: int) -> None:
    """`SaveError` unless `number` and `size` make a valid part."""
    if not isinstance(number, int) or not 1 <= number <= writer.MAX_PARTS:
        raise SaveError(
            f"Expected a part number in 1..{writer.MAX_PARTS} for {writer.where(name)}. "
            f"Received: {number!r}."
        )
    if size > MAX_PART:
        raise SaveError(
            f"Expected parts of at most {MAX_PART} bytes (5 GiB) for {writer.where(name)}. "
            f"Received: part {number} of {size} bytes; cut it into more parts."
        )


def check_parts(writer: ObjectWriter, name: str, parts: Sequence[tuple[int, str]]) -> list[tuple[int, str]]:
    """`parts` as a list, or `SaveError` unless they are strictly ascending
    valid numbers, at least one."""
    parts = [(int(n), str(t)) for n, t in parts]
    numbers = [n for n, _ in parts]
    if not parts or numbers != sorted(set(numbers)) or not 1 <= numbers[0] <= numbers[-1] <= writer.MAX_PARTS:
        raise SaveError(
            f"Expected the parts of {writer.where(name)} as (number, token) pairs in strictly "
            f"ascending order of number, numbers in 1..{writer.MAX_PARTS}, at least one. "
            f"Received part numbers: {_numbers(numbers)}."
        )
    return parts


def _numbers(numbers: list[int]) -> str:
    return str(numbers) if len(numbers) <= 12 else f"{numbers[:6]} ... {numbers[-6:]} ({len(numbers)})"


def rfc3339_seconds(text: str) -> float:
    """POSIX seconds of a time as the stores write it (`2026-11-24T10:00:00.123Z`)."""
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def refused(writer: ObjectWriter, what: str, status: Any, credentials: str,
            permissions: str, how: str) -> SaveError:
    """The error for a request the store refused (401 / 403); `what` says
    the request in words."""
    return SaveError(
        f"Writing to {writer.location} was refused: {what} answered {status}. "
        f"Credentials used: {credentials}. Expected permission to {permissions} under "
        f"{writer.location}. Grant it, or provide other credentials ({how})."
    )


def missing_bucket(writer: ObjectWriter, endpoint: str, how: str) -> SaveError:
    return SaveError(
        f"Expected an existing bucket {writer.bucket!r} to save {writer.location} into. "
        f"Received: no such bucket at {endpoint}. Create it first ({how}), or check the "
        "bucket's name and the endpoint."
    )


def prefix_is_object(writer: ObjectWriter, size: int) -> SaveError:
    return SaveError(
        f"Expected {writer.location} to be a folder (a prefix) to save a preset under. "
        f"Received: an object (a file of {size} bytes) of that very name. Save to another "
        "prefix, or delete that object first."
    )


def no_upload(writer: ObjectWriter, name: str, upload_id: str, action: str) -> SaveError:
    return SaveError(
        f"Expected an unfinished upload {upload_id!r} of {writer.where(name)} to {action}. "
        "Received: none with that id (it was completed or aborted, by this save or "
        "another process, or a lifecycle rule removed it). Start the upload again."
    )
