"""Writing into object storage: the small interface every store's writer
implements (`ObjectWriter`); `storage.writers.open_writer` gives the one
of a URL.

A writer is one bucket and prefix. Small objects are written whole (`put`);
large ones by multipart upload: one caller creates the upload, any process
may upload parts of it given its id (numbered in byte order, each but the
last at least `MIN_PART` bytes), one caller completes it with every part's
token, and only then does the object appear, whole. What a killed save left
(`list_uploads`) can be aborted by anyone.

- `s3://bucket/prefix`: S3's own multipart upload, through botocore
  (`storage.s3_writes`);
- `gs://bucket/prefix`: the same protocol built on GCS's `compose`
  (`storage.gcs_writes`), which real GCS and the gcp-storage-emulator
  both have.

Endpoints and credentials are the loader's (`storage.object_stores`):
`AWS_ENDPOINT_URL(_S3)` and botocore's chain; `STORAGE_EMULATOR_HOST` and
application-default credentials.

Example:

```python
writer = open_writer("s3://my-bucket/presets/tuned")
writer.check_writable()
upload = writer.create_upload("model.weights.h5")
token = writer.upload_part("model.weights.h5", upload, 1, memoryview(part))
writer.complete_upload("model.weights.h5", upload, [(1, token)])
```
"""

from __future__ import annotations

import abc
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


__all__ = ["ObjectMeta", "ObjectWriter", "PartBody", "Upload", "WRITE_SCHEMES"]

WRITE_SCHEMES = ("s3", "gs")


@dataclass(frozen=True)
class ObjectMeta:
    """An object's size, version (ETag or generation) and the store's time
    of its last write (seconds since the epoch)."""

    size: int
    version: str
    updated: float


@dataclass(frozen=True)
class Upload:
    """An unfinished multipart upload: its object, id and start time (the
    store's clock)."""

    name: str
    upload_id: str
    initiated: float


class ObjectWriter(abc.ABC):
    """One bucket and prefix to write into (see the module doc).

    Attributes:
        location: The URL as the user wrote it.
        MIN_PART: Bytes of every part but the last, at least.
        MAX_PARTS: Parts of one upload, at most.
    """

    location: str
    MIN_PART = 5 << 20
    MAX_PARTS = 10_000

    @abc.abstractmethod
    def check_writable(self) -> None:
        """Raises `SaveError` unless objects can be written under the prefix:
        the bucket exists, the credentials may write, and the prefix is not
        itself an object (a file)."""

    @abc.abstractmethod
    def list(self, sub: str = "") -> dict[str, ObjectMeta]:
        """Objects whose names (relative to the prefix) start with `sub`."""

    @abc.abstractmethod
    def get(self, name: str) -> bytes | None:
        """The whole of object `name`, or `None` when there is none."""

    @abc.abstractmethod
    def put(self, name: str, data: bytes) -> None:
        """Writes object `name` whole."""

    @abc.abstractmethod
    def delete(self, names: Sequence[str]) -> None:
        """Deletes these objects (missing ones are fine)."""

    @abc.abstractmethod
    def create_upload(self, name: str) -> str:
        """Starts a multipart upload of object `name`; returns its id."""

    @abc.abstractmethod
    def upload_part(self, name: str, upload_id: str, number: int, data: Any) -> str:
        """Uploads part `number` (from 1) of the upload; returns its token.
        Retried on throttling, 5xx and cut connections (the same number
        overwrites)."""

    @abc.abstractmethod
    def complete_upload(self, name: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        """Makes object `name` of the parts, in order: it appears whole."""

    @abc.abstractmethod
    def abort_upload(self, name: str, upload_id: str) -> None:
        """Drops the upload and its parts (a finished or unknown one is fine)."""

    @abc.abstractmethod
    def list_uploads(self) -> list[Upload]:
        """The unfinished uploads under the prefix."""


class PartBody(io.RawIOBase):
    """A part's bytes as the file object HTTP clients stream a body from,
    with no copy of the part (`bytes(part)` would hold a second 64 MiB per
    upload in flight): each read copies one chunk, and a retry seeks back.

    Example:

    ```python
    client.upload_part(..., Body=PartBody(memoryview(buffer)))
    ```
    """

    def __init__(self, data: Any) -> None:
        super().__init__()
        self._view = memoryview(data).cast("B")
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: len(self._view)}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), len(self._view) - self._position))
        buffer[:n] = self._view[self._position : self._position + n]
        self._position += n
        return n

    def __len__(self) -> int:
        """The bytes left to read (what a client sends as Content-Length)."""
        return len(self._view) - self._position
