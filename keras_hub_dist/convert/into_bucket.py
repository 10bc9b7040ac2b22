"""`convert SRC DST` with `DST` in object storage (`s3://`, `gs://`): the
converted files uploaded in parts as they are written, with no local copy.

`convert.file_to_file` converts tile by tile: each tile of a source tensor is
read, transposed or cast, and written at its offsets in the target file. An
object store has no positioned writes, so here the target files are
multipart uploads (`storage.part_uploads.PartUploads`, 64 MiB parts, each a
checksum chunk hashed as it is uploaded) and the tiles are taken in the
order of the **target** files' bytes (`ordered_items`: by file, then by the
first byte a tile writes), so a part fills soon after it opens. The worker
threads write into the parts through one lock (the copy into a part buffer
is short next to a tile's read and transpose). Part buffers: as many as
the tile order keeps open at once (`buffers_needed`: the parts several
tiles write, open from the first of them to the last, plus three per
thread: a tile writes its rows in file order, so a part it alone writes
fills while it runs), computed before the first upload; `PartUploads`
refuses to hold more. For the tested models 4 to 8 parts, on top of the
conversion's own `num_threads x (2 x 256 + 24)` MiB.

The rest is the save's into a bucket (`save.remote_publish`): the target
is claimed (writable, not a preset unless `overwrite`, what killed saves
left aborted) before any byte is uploaded; an owner record is kept while
the conversion runs; the small files (config.json, metadata.json or the
index, tokenizer files) are laid out in memory and published after the
weights objects are complete, config.json last; a failure aborts every
upload. The files are those a conversion into a directory writes, byte for
byte.

Example:

```python
convert_checkpoint("s3://my-bucket/Qwen3-8B", "gs://my-bucket/qwen3_8b_keras", to="keras")
```
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from keras_hub_dist.errors import SaveError
from keras_hub_dist.formats import checksums
from keras_hub_dist.formats.pieces import block_writes
from keras_hub_dist.save.remote_publish import OwnerRecord, claim_remote, memory_dir, publish, start_uploads
from keras_hub_dist.storage.part_uploads import FileUpload, PartUploads, part_count

__all__ = ["RemoteTarget", "buffers_needed", "ordered_items"]


def ordered_items(jobs: Sequence[Any], items: Sequence[tuple[Any, Any]], file_order: Sequence[str]) -> list[tuple[Any, Any, list[tuple[str, int, int]]]]:
    """`(job, box, spans)` per item, in the target files' byte order; `spans`
    are `(file, first byte, one past the last)` of what the tile writes."""
    rank = {name: i for i, name in enumerate(file_order)}
    out = []
    for job, box in items:
        spans = []
        for path, piece, offset, dtype in job.targets:
            for write in block_writes(piece, job.shape, box, offset, dtype.itemsize):
                runs = write.runs()
                if runs.num_runs:
                    end = runs.offset + sum((c - 1) * s for c, s in zip(runs.counts, runs.strides)) + runs.run_bytes
                    spans.append((path, runs.offset, end))
        first = min(spans, key=lambda s: (rank[s[0]], s[1]), default=(file_order[0], 0, 0))
        out.append((rank[first[0]], first[1], len(out), job, box, spans))
    out.sort(key=lambda x: x[:3])
    return [(job, box, spans) for *_, job, box, spans in out]


def buffers_needed(spans_in_order: Sequence[list[tuple[str, int, int]]], part_bytes: int, num_threads: int) -> int:
    """Part buffers the tile order needs (module doc).

    A tile writes its target rows in file order, so a part only it writes
    fills while it runs: each thread holds at most two such parts being
    filled and one uploading. A part several tiles write (a tile boundary
    inside it, or a transposed tensor cut along the columns its rows take)
    stays open from the first of them, counted from `num_threads - 1` tiles
    early (threads run ahead), to the last.
    """
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    for index, spans in enumerate(spans_in_order):
        for path, start, end in spans:
            for part in range(start // part_bytes, (end - 1) // part_bytes + 1):
                first.setdefault((path, part), index)
                last[(path, part)] = index
    lead = max(0, num_threads - 1)
    shared = [k for k in first if last[k] > first[k]]
    events = sorted([(max(0, first[k] - lead), 1) for k in shared] + [(last[k] + 1, -1) for k in shared],
                    key=lambda e: (e[0], e[1]))
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return max(4, peak + 3 * max(1, num_threads))


class _Locked:
    """`PartUploads` behind one lock, for the converting threads."""

    def __init__(self, sink: PartUploads) -> None:
        self._sink, self._lock = sink, threading.Lock()

    def __call__(self, path: str) -> str:
        return self._sink(path)

    def pwritev(self, handle: str, buffers: Sequence[memoryview], offset: int) -> int:
        with self._lock:
            return self._sink.pwritev(handle, buffers, offset)

    def close(self) -> None:
        """The sink is finished by `RemoteTarget.upload`."""


class RemoteTarget:
    """A conversion's target in a bucket: claimed, then uploaded into, then
    published (module doc). Use as a context manager: leaving it without
    `publish` aborts every upload.

    Args:
        writer: The target's `ObjectWriter`.
        overwrite: Replace a preset found there.
    """

    def __init__(self, writer: Any, overwrite: bool) -> None:
        self.writer = writer
        self._overwrite = overwrite
        self.folder = ""
        self.uploads: dict[str, str] = {}
        self.parts: dict[str, list[tuple[int, str]]] = {}
        self._existing: dict[str, Any] = {}
        self._owner: OwnerRecord | None = None

    def __enter__(self) -> RemoteTarget:
        self._existing = claim_remote(self.writer, self._overwrite)
        self.folder = tempfile.mkdtemp(prefix="khd-convert-", dir=memory_dir())
        self._owner = OwnerRecord(self.writer, secrets.token_hex(6))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, upload_id in self.uploads.items():  # not published: nothing stays billed
            with contextlib.suppress(Exception):
                self.writer.abort_upload(name, upload_id)
        if self._owner is not None:
            self._owner.stop()
        shutil.rmtree(self.folder, ignore_errors=True)

    def name_of(self, path: str) -> str:
        """The object name of a file laid out in `folder` (or already a name)."""
        if os.path.isabs(path):
            return os.path.relpath(path, self.folder).replace(os.sep, "/")
        return path

    def upload(
        self,
        files: Sequence[tuple[str, int]],
        prefill: Callable[[str, int, int, np.ndarray], int],
        items: Sequence[tuple[Any, Any, list[tuple[str, int, int]]]],
        run: Callable[[Iterator[tuple[Any, Any]], Any], None],
        num_threads: int,
    ) -> np.ndarray:
        """Uploads the weights files `files` (`(key the jobs write to,
        size)`), their non-value bytes from `prefill`, by running `run(items,
        sink)`; returns their chunk digests (`checksums.all_chunks` order).

        Raises:
            SaveError: A file over the store's part count.
        """
        part_bytes = checksums.CHUNK_BYTES  # a part is a checksum chunk: hashed as uploaded
        for key, size in files:
            if part_count(size, part_bytes) > self.writer.MAX_PARTS:
                raise SaveError(
                    f"Expected at most {self.writer.MAX_PARTS} parts of {part_bytes >> 20} MiB per file. "
                    f"Received: {self.name_of(key)!r} of {size} bytes. Pass a smaller max_shard_size."
                )
        start_uploads(self.writer, self._owner, [self.name_of(k) for k, _ in files], self.uploads)
        keys = checksums.all_chunks([size for _, size in files])
        row_of = {key: row for row, key in enumerate(keys)}
        number_of = {self.name_of(k): i for i, (k, _) in enumerate(files)}
        table = np.zeros((len(keys), 32), np.uint8)

        def on_part(name: str, number: int, data: memoryview) -> None:
            table[row_of[(number_of[name], number - 1)]] = np.frombuffer(hashlib.sha256(data).digest(), np.uint8)

        buffers = buffers_needed([spans for _, _, spans in items], part_bytes, num_threads)
        sink = PartUploads(
            self.writer,
            {k: FileUpload(self.name_of(k), size, self.uploads[self.name_of(k)]) for k, size in files},
            part_bytes=part_bytes, max_buffers=buffers, num_threads=max(2, num_threads),
            prefill=prefill, on_part=on_part,
        )
        try:
            run(iter([(job, box) for job, box, _ in items]), _Locked(sink))
            self.parts = sink.finish()
        except BaseException:
            sink.abandon()
            raise
        return table

    def publish(self, files: Sequence[str], names: dict[str, str]) -> None:
        """Completes the uploads and writes the small files in `folder`,
        config.json last (`save.remote_publish.publish`)."""
        paths = [os.path.join(self.folder, self.name_of(f)) for f in files]
        publish(self.writer, self.folder, paths, self.uploads, self.parts, self._existing, names)
        self.uploads.clear()
