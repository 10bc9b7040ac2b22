"""Positioned writes into multipart uploads: the write side of an object
store, with the interface the savers write local files through.

An object store has no positioned writes. It has multipart uploads: the
object is cut into numbered parts, each uploaded whole (any process may
upload any part, given the upload id), and the object appears only when
the upload is completed. `PartUploads` lets a saver keep writing byte runs
at file offsets, as it does into a local file (`host_io.FileDescriptors`):
each run is copied into the host buffer of the part it falls in, and a part
is uploaded as soon as its last byte has been written, on a small thread
pool, while the writing goes on.

Parts are fixed: part `k` (numbered from 1) of a file holds its bytes
`[(k - 1) * part_bytes, k * part_bytes)`, the last part the rest, so a
part's bytes are known before any is written and every writer agrees on the
numbering without a word. With `part_bytes` equal to the checksums' chunk
(64 MiB, `formats.checksums.CHUNK_BYTES`) a part is exactly one checksum
chunk, hashed from the buffer it is uploaded from (`on_part`).

Bytes the writer never writes (a file's own structure around the values,
e.g. HDF5 metadata) come from `prefill`, asked for each part this process
uploads when the part is opened; a part with none of the writer's bytes is
filled by it alone in `finish`.

Host memory: a part's buffer exists from its first written byte until its
upload returns. Writers must fill parts in about file order (the savers'
"slabs" strategy does, `in_file_order`, in slabs of `slab_bytes`): then one
or two parts are being filled while the others upload; `max_buffers` bounds
the buffers held at once (a write that would take one more waits for an
upload to finish).

Example:

```python
uploads = PartUploads(writer, {"model.weights.h5": FileUpload("model.weights.h5", size, upload_id)})
fd = uploads("model.weights.h5")
uploads.pwritev(fd, [memoryview(block)], offset)
parts = uploads.finish()             # {"model.weights.h5": [(1, etag), ...]}
```
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["FileUpload", "PartUploads", "part_count", "part_range"]


@dataclass(frozen=True)
class FileUpload:
    """One file being uploaded in parts.

    Attributes:
        name: The object's name under the writer's prefix.
        size: The file's length in bytes.
        upload_id: The multipart upload it goes to.
        parts: The part numbers this process uploads (`None`: all of them).
        mixed: Part numbers several processes write bytes of: this
            process's bytes of them gather in a zeroed buffer until
            `PartUploads.combine` sums the processes' buffers.
    """

    name: str
    size: int
    upload_id: str
    parts: frozenset[int] | None = None
    mixed: frozenset[int] = frozenset()


def part_count(size: int, part_bytes: int) -> int:
    """The number of parts of a `size`-byte file (an empty file has one)."""
    return max(1, -(-size // part_bytes))


def part_range(number: int, size: int, part_bytes: int) -> tuple[int, int]:
    """The file bytes `[start, stop)` of part `number` (from 1)."""
    start = (number - 1) * part_bytes
    return start, min(start + part_bytes, size)


@dataclass
class _Part:
    buffer: np.ndarray
    filled: int = 0


@dataclass
class _File:
    path: str
    upload: FileUpload
    open_parts: dict[int, _Part] = field(default_factory=dict)
    done: dict[int, Future] = field(default_factory=dict)

    def owns(self, number: int) -> bool:
        return self.upload.parts is None or number in self.upload.parts


class PartUploads:
    """Positioned writes into multipart uploads (see the module doc).

    Args:
        writer: An object store writer (`upload_part(name, upload_id,
            number, data) -> token`).
        files: Per local name (what the saver writes to), its upload.
        part_bytes: Bytes per part but the last (at least the store's
            minimum part size).
        max_buffers: Part buffers held at once, filling or uploading.
        num_threads: Uploads in flight at once.
        prefill: Called with `(path, start, stop, buffer)` when a part this
            process uploads is opened: writes the bytes of `[start, stop)`
            the writer will not write into `buffer` (indexed from `start`)
            and returns how many.
        on_part: Called with `(name, number, bytes)` of each part once
            complete, on an upload thread, before it is uploaded (hashing).
    """

    # Writers go in about file order (`save.write_execute`'s "slabs").
    in_file_order = True

    def __init__(
        self,
        writer: Any,
        files: Mapping[str, FileUpload],
        *,
        part_bytes: int,
        max_buffers: int = 6,
        num_threads: int = 4,
        prefill: Callable[[str, int, int, np.ndarray], int] | None = None,
        on_part: Callable[[str, int, memoryview], None] | None = None,
    ) -> None:
        if max_buffers < 2:
            raise ValueError(f"Expected max_buffers >= 2. Received: {max_buffers}.")
        self._writer = writer
        self._files = {path: _File(path, upload) for path, upload in files.items()}
        self._part_bytes = part_bytes
        # Writers go in slabs of this many file bytes: a quarter part, so a
        # slab spans at most two parts.
        self.slab_bytes = max(1, min(16 << 20, part_bytes // 4))
        self._prefill = prefill
        self._on_part = on_part
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="khd-upload")
        self._buffers = threading.BoundedSemaphore(max_buffers)
        self._max_buffers = max_buffers
        self._in_flight = 0
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self.bytes_uploaded = 0
        self.parts_uploaded = 0

    def __call__(self, path: str) -> str:
        """The handle `pwritev` takes for `path` (the path itself)."""
        if path not in self._files:
            raise KeyError(f"Expected one of the files being uploaded {sorted(self._files)}. Received: {path!r}.")
        return path

    def pwritev(self, handle: str, buffers: Sequence[memoryview], offset: int) -> int:
        """Copies `buffers`, in order, to the file bytes at `offset`; uploads
        every part this completes. Returns the number of calls (1)."""
        self._raise_if_failed()
        file = self._files[handle]
        for buffer in buffers:
            data = memoryview(buffer).cast("B")
            while len(data):
                number = offset // self._part_bytes + 1
                start, stop = part_range(number, file.upload.size, self._part_bytes)
                if offset + len(data) > file.upload.size or stop <= start:
                    raise ValueError(
                        f"Expected writes within the {file.upload.size} bytes of "
                        f"{file.upload.name!r}. Received: {len(data)} bytes at offset {offset}."
                    )
                take = min(len(data), stop - offset)
                part = self._open(file, number)
                part.buffer[offset - start : offset - start + take] = np.frombuffer(data[:take], np.uint8)
                part.filled += take
                self._submit_if_full(file, number, part)
                data = data[take:]
                offset += take
        return 1

    def _open(self, file: _File, number: int) -> _Part:
        part = file.open_parts.get(number)
        if part is not None:
            return part
        mixed = number in file.upload.mixed
        if number in file.done or not (file.owns(number) or mixed):
            raise ValueError(
                f"Expected writes only to the parts of {file.upload.name!r} this process uploads"
                f"{'' if file.upload.parts is None else ' ' + str(sorted(file.upload.parts))}. "
                f"Received: a write to part {number}{' again' if number in file.done else ''}."
            )
        self._acquire(f"opening part {number} of {file.upload.name!r}")
        start, stop = part_range(number, file.upload.size, self._part_bytes)
        # A mixed part's bytes are summed over the processes: zeros elsewhere.
        part = file.open_parts[number] = _Part((np.zeros if mixed else np.empty)(stop - start, np.uint8))
        if self._prefill is not None and file.owns(number):
            part.filled += self._prefill(file.path, start, stop, part.buffer)
        return part

    def _submit_if_full(self, file: _File, number: int, part: _Part) -> None:
        length = len(part.buffer)
        if part.filled > length:
            raise ValueError(
                f"Expected each byte of part {number} of {file.upload.name!r} written once. "
                f"Received: {part.filled} bytes of {length}."
            )
        if part.filled == length and number not in file.upload.mixed:
            del file.open_parts[number]
            self._submit(file, number, part.buffer)

    def _submit(self, file: _File, number: int, buffer: np.ndarray) -> None:
        with self._lock:
            self._in_flight += 1
        file.done[number] = self._pool.submit(self._upload, file.upload, number, buffer)

    def combine(self, path: str, number: int, reduce: Callable[[np.ndarray | None, int], np.ndarray | None]) -> None:
        """Combines mixed part `number` of `path` over the processes and, on
        its owner, uploads it. A write to it afterwards is an error.

        Args:
            reduce: Called (on every process, collectively) with this
                process's buffer of the part (`None`: it wrote no byte of
                it) and the part's length; returns the summed part on the
                owner, `None` elsewhere.
        """
        file = self._files[path]
        start, stop = part_range(number, file.upload.size, self._part_bytes)
        part = file.open_parts.pop(number, None)
        if part is None and file.owns(number) and self._error is None:
            part = self._open(file, number)  # its prefilled bytes
            file.open_parts.pop(number)
        # The collective first, whatever failed here: the other processes
        # wait for this one in it.
        combined = reduce(None if part is None else part.buffer, stop - start)
        if part is not None:
            self._buffers.release()
        file.done.setdefault(number, None)  # type: ignore[arg-type] - no later write
        self._raise_if_failed()
        if combined is None:
            return
        if not file.owns(number):
            raise ValueError(f"Expected part {number} of {file.upload.name!r} combined on its owner only.")
        self._acquire(f"combining part {number} of {file.upload.name!r}")
        del file.done[number]
        self._submit(file, number, combined)

    def _acquire(self, doing: str) -> None:
        """Takes a buffer slot, waiting for an upload to return one."""
        while not self._buffers.acquire(timeout=0.5):
            self._raise_if_failed()
            if not self._in_flight:  # every slot is a part still being filled
                raise ValueError(
                    f"Expected writes to fill parts in about file order. Received: more "
                    f"than {self._max_buffers} parts partly written at once ({doing}). "
                    "Raise max_buffers."
                )

    def _upload(self, upload: FileUpload, number: int, buffer: np.ndarray) -> str:
        try:
            view = memoryview(buffer)
            if self._on_part is not None:
                self._on_part(upload.name, number, view)
            token = self._writer.upload_part(upload.name, upload.upload_id, number, view)
            with self._lock:
                self.bytes_uploaded += len(buffer)
                self.parts_uploaded += 1
            return token
        except BaseException as e:
            with self._lock:
                self._error = self._error or e
            raise
        finally:
            del buffer
            with self._lock:
                self._in_flight -= 1
            self._buffers.release()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def sync(self) -> None:
        """Nothing to flush: a part is durable once its upload returns."""

    def close(self) -> None:
        """Nothing to close (the saver's writes end here): `finish` waits
        for the uploads and says what they were."""

    def finish(self) -> dict[str, list[tuple[int, str]]]:
        """Uploads the parts this process owns that the writer left to
        `prefill` alone, waits for every upload, and returns per file the
        `(number, token)` of the parts this process uploaded, in order.

        Raises:
            The first upload's error; or `ValueError` when a part this
            process owns was left partly written.
        """
        try:
            for file in self._files.values():
                for number in range(1, part_count(file.upload.size, self._part_bytes) + 1):
                    untouched = number not in file.done and number not in file.open_parts
                    if untouched and file.owns(number) and number not in file.upload.mixed:
                        self._submit_if_full(file, number, self._open(file, number))
            parts = {
                f.upload.name: [(n, f.done[n].result()) for n in sorted(f.done) if f.done[n] is not None]
                for f in self._files.values()
            }
        finally:
            self._pool.shutdown(wait=True)
        left = {f.upload.name: sorted(f.open_parts) for f in self._files.values() if f.open_parts}
        for file in self._files.values():
            for _ in file.open_parts:
                self._buffers.release()
            file.open_parts.clear()
        if left:
            raise ValueError(f"Expected every part written whole. Received: parts left partly written: {left}.")
        return parts

    def abandon(self) -> None:
        """Stops: drops buffers, waits for uploads in flight (errors ignored)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        for file in self._files.values():
            file.open_parts.clear()
