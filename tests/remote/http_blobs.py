"""HTTP pieces the loopback servers share: objects (`Blob`, served from
bytes or from a file with `os.pread`), single byte ranges, replies.

Example:

```python
blob = make_blob(b"0123456789")
assert resolve_range("bytes=-3", blob.size) == (7, 10)
assert b"".join(blob.chunks(7, 10)) == b"789"
```
"""

from __future__ import annotations

import dataclasses
import email.utils
import hashlib
import os
import re
import time
from typing import Callable, Iterable, Mapping, Union

Source = Union[bytes, str, os.PathLike]
CHUNK = 256 * 1024
_RANGE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")


@dataclasses.dataclass(frozen=True)
class Blob:
    """An object to serve: bytes, or a file path read with `os.pread`."""

    source: bytes | str
    size: int
    etag: str
    last_modified: float

    def chunks(self, start: int, end: int, chunk: int = CHUNK) -> Iterable[bytes]:
        if isinstance(self.source, bytes):
            view = memoryview(self.source)
            for pos in range(start, end, chunk):
                yield view[pos:min(end, pos + chunk)]
            return
        fd = os.open(self.source, os.O_RDONLY)
        try:
            pos = start
            while pos < end:
                data = os.pread(fd, min(chunk, end - pos), pos)
                if not data:
                    raise OSError(f"{self.source} is shorter than {end} bytes")
                yield data
                pos += len(data)
        finally:
            os.close(fd)


def make_blob(source: Source, etag: str | None = None, version: int = 0) -> Blob:
    """A `Blob` whose strong ETag is the MD5 of the bytes (of path, size and
    mtime for a file), with `-version` appended when `version` is given."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data: bytes | str = bytes(source)
        size, ident = len(data), hashlib.md5(data).hexdigest()
    else:
        data = os.fspath(source)
        stat = os.stat(data)
        size = stat.st_size
        ident = hashlib.md5(
            f"{os.path.realpath(data)}|{size}|{stat.st_mtime_ns}".encode()
        ).hexdigest()
    if etag is None:
        etag = f'"{ident}-{version}"' if version else f'"{ident}"'
    return Blob(data, size, etag, time.time())


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict = dataclasses.field(default_factory=dict)
    chunks: Iterable[bytes] = ()
    length: int = 0
    close: Callable[[], None] | None = None

    @classmethod
    def of(cls, status: int, headers: dict | None = None, body: bytes = b"") -> "Reply":
        return cls(status, dict(headers or {}), (body,) if body else (), len(body))


def requested_range(header: str | None) -> tuple[int | None, int | None]:
    """The range a `Range` header asks for, as logged in `Request`."""
    match = _RANGE.match(header or "")
    if not match or match[1] == match[2] == "":
        return None, None
    if match[1] == "":
        return -int(match[2]), None
    return int(match[1]), int(match[2]) + 1 if match[2] else None


def resolve_range(header: str | None, size: int) -> tuple[int, int] | None | str:
    """`(start, end)` to send, None for the whole object (no Range, several
    ranges or a malformed one, which RFC 9110 says to ignore), or
    "unsatisfiable"."""
    match = _RANGE.match(header or "")
    if not match or match[1] == match[2] == "":
        return None
    if match[1] == "":
        suffix = int(match[2])
        return (max(0, size - suffix), size) if suffix and size else "unsatisfiable"
    start = int(match[1])
    end = min(size, int(match[2]) + 1) if match[2] else size
    if match[2] and int(match[2]) < start:
        return None
    return (start, end) if start < size else "unsatisfiable"


def blob_reply(blob: Blob, method: str, headers: Mapping[str, str], error) -> Reply:
    """The reply to a GET/HEAD of `blob`: If-Match, then Range."""
    base = {
        "ETag": blob.etag,
        "Last-Modified": email.utils.formatdate(blob.last_modified, usegmt=True),
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
    }
    if_match = headers.get("If-Match")
    if if_match and if_match.strip() != "*" and blob.etag not in [
        tag.strip() for tag in if_match.split(",")
    ]:
        return error(412, f"If-Match {if_match} does not match ETag {blob.etag}")
    span = resolve_range(headers.get("Range"), blob.size)
    if span == "unsatisfiable":
        reply = error(416, f"Range {headers.get('Range')} is past the end ({blob.size} bytes)")
        reply.headers["Content-Range"] = f"bytes */{blob.size}"
        return reply
    start, end = span or (0, blob.size)
    if span is not None:
        base["Content-Range"] = f"bytes {start}-{end - 1}/{blob.size}"
    chunks = () if method == "HEAD" else blob.chunks(start, end)
    return Reply(206 if span else 200, base, chunks, end - start)


def read_body(h) -> bytes | None:
    """The request body (Content-Length or chunked), or None when there is none."""
    length = h.headers.get("Content-Length")
    if length is not None:
        return h.rfile.read(int(length))
    if "chunked" not in h.headers.get("Transfer-Encoding", "").lower():
        return None
    parts = []
    while True:
        size = int(h.rfile.readline().split(b";")[0].strip() or b"0", 16)
        if size == 0:
            while h.rfile.readline().strip():  # trailers
                pass
            return b"".join(parts)
        parts.append(h.rfile.read(size))
        h.rfile.readline()


def walk_files(local_dir: str) -> Iterable[tuple[str, str]]:
    """(path, relative posix path) of every file under `local_dir`, sorted."""
    for root, dirs, names in os.walk(local_dir):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(root, name)
            yield path, os.path.relpath(path, local_dir).replace(os.sep, "/")
