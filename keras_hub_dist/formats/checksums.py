"""Checksums of a preset's weights files: chunked SHA-256.

A weights file is cut into 64 MiB chunks; each chunk's SHA-256 is recorded,
and the file's digest is the SHA-256 of the chunk digests in order. Chunks
let every process (and every thread) hash its own part of a file that
several processes wrote, and tell which byte range changed when a check
fails. SHA-256 runs at about 1.5 GB/s per core with SHA extensions, so a
check costs about one read of the files.

`save_sharded_preset` records the checksums in the preset's `metadata.json`
under `"keras_hub_dist"`; `load_sharded_preset(..., verify=True)` checks
them. Stock KerasHub ignores the extra key.

Example:

```python
entry = file_checksum("preset/model.weights.h5")
entry.to_json()  # {"algorithm": "sha256-chunked", "chunk_bytes": ..., ...}
```
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from keras_hub_dist import _processes
from keras_hub_dist.errors import PresetError
from keras_hub_dist.storage import host_io
from keras_hub_dist.formats.base import ByteRuns

__all__ = [
    "ALGORITHM",
    "CHUNK_BYTES",
    "FileChecksum",
    "HashingAsWritten",
    "METADATA_KEY",
    "all_chunks",
    "chunk_digests",
    "entries",
    "file_checksum",
    "mismatches",
    "recorded_checksums",
    "share",
    "verify_files",
]

ALGORITHM = "sha256-chunked"
CHUNK_BYTES = 64 << 20
# Where the checksums live in metadata.json.
METADATA_KEY = "keras_hub_dist"
_DIGEST_BYTES = 32


@dataclass(frozen=True)
class FileChecksum:
    """The recorded checksum of one weights file.

    Attributes:
        size: File length in bytes.
        chunk_bytes: Length of every chunk but the last.
        chunks: SHA-256 of each chunk, hex.
    """

    size: int
    chunk_bytes: int
    chunks: tuple[str, ...]

    @property
    def digest(self) -> str:
        """SHA-256 of the chunk digests, in order: the file's checksum."""
        return hashlib.sha256(b"".join(bytes.fromhex(c) for c in self.chunks)).hexdigest()

    def to_json(self) -> dict[str, Any]:
        return {
            "algorithm": ALGORITHM,
            "size": self.size,
            "chunk_bytes": self.chunk_bytes,
            "sha256": self.digest,
            "chunks": list(self.chunks),
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> FileChecksum:
        """Parses (and checks) a recorded entry.

        Raises:
            PresetError: The entry is malformed or disagrees with itself.
        """
        try:
            if data["algorithm"] != ALGORITHM:
                raise ValueError(f"algorithm {data['algorithm']!r}, expected {ALGORITHM!r}")
            entry = cls(int(data["size"]), int(data["chunk_bytes"]), tuple(data["chunks"]))
            if entry.chunk_bytes <= 0 or len(entry.chunks) != num_chunks(entry.size, entry.chunk_bytes):
                raise ValueError("chunk count does not match size and chunk_bytes")
            for chunk in entry.chunks:
                if len(bytes.fromhex(chunk)) != _DIGEST_BYTES:
                    raise ValueError(f"chunk digest {chunk!r} is not SHA-256")
            if entry.digest != data["sha256"]:
                raise ValueError("sha256 is not the digest of the chunk digests")
        except (KeyError, TypeError, ValueError) as e:
            raise PresetError(
                f"The checksum recorded for {where} is malformed. Expected "
                f"{{'algorithm': {ALGORITHM!r}, 'size', 'chunk_bytes', 'sha256', "
                f"'chunks'}}. Received: {e!s}. Save the preset again with "
                "`keras_hub_dist.save_sharded_preset`."
            ) from e
        return entry


def num_chunks(size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    return max(1, -(-size // chunk_bytes))


# Each thread hashes its chunk this many bytes at a time.
_HASH_STEP = 8 << 20


def _size(file: Any) -> int:
    return os.path.getsize(file) if isinstance(file, str) else file.size


def _name(file: Any) -> str:
    return file if isinstance(file, str) else file.name


def _hash_chunk(file: Any, start: int, stop: int) -> bytes:
    """SHA-256 of bytes `start:stop` of a local path or an opened (remote) file."""
    digest = hashlib.sha256()
    buffer = host_io.aligned_empty((min(stop - start, _HASH_STEP),), np.uint8)
    view = memoryview(buffer)
    opened = host_io.LocalFile(file) if isinstance(file, str) else file
    try:
        position = start
        while position < stop:
            piece = view[: min(len(view), stop - position)]
            try:
                opened.read_stretches([(position, [piece])])
            except PresetError as e:
                raise PresetError(
                    f"{_name(file)!r} ended before byte {stop} while hashing bytes "
                    f"{start}:{stop}. Expected a file of at least {stop} bytes. ({e})"
                ) from e
            digest.update(piece)  # releases the GIL: threads hash in parallel
            position += len(piece)
    finally:
        if isinstance(file, str):
            opened.close()
    return digest.digest()


def chunk_digests(
    files: Sequence[Any],
    chunks: Iterable[tuple[int, int]],
    *,
    chunk_bytes: Sequence[int] | None = None,
    num_threads: int = 2,
) -> dict[tuple[int, int], bytes]:
    """SHA-256 of chunks `(file number, chunk number)` of `files` (local
    paths or opened files; `chunk_bytes` per file, default `CHUNK_BYTES`)."""
    wanted = list(chunks)
    sizes = [_size(file) for file in files]
    steps = list(chunk_bytes) if chunk_bytes is not None else [CHUNK_BYTES] * len(files)

    def one(key: tuple[int, int]) -> bytes:
        start = key[1] * steps[key[0]]
        return _hash_chunk(files[key[0]], start, min(start + steps[key[0]], sizes[key[0]]))

    if num_threads <= 1 or len(wanted) < 2:
        return {key: one(key) for key in wanted}
    with ThreadPoolExecutor(num_threads, "keras_hub_dist-hash") as pool:
        return dict(zip(wanted, pool.map(one, wanted)))


class HashingAsWritten:
    """Hashes each chunk of files being filled as soon as its last byte is
    written, on a thread pool: the hashing overlaps the writing and reads
    the chunks back while the page cache still holds them.

    Args:
        files: The files, at their final sizes.
        pending: Per file, the byte ranges `(start, stop)` still to be
            written (each byte exactly once); the rest is written already.
        num_threads: Hashing threads.

    Example:

    ```python
    hasher = HashingAsWritten(paths, {p: [(header, size)] for p in paths})
    hasher.written(path, runs)             # from every writer thread
    table = hasher.table()                 # as `chunk_digests`, in order
    ```
    """

    def __init__(self, files: Sequence[str], pending: Mapping[str, Sequence[tuple[int, int]]], num_threads: int = 1) -> None:
        import threading

        self.files = list(files)
        self.keys = all_chunks([os.path.getsize(f) for f in self.files])
        self._number = {f: i for i, f in enumerate(self.files)}
        self._left: dict[tuple[int, int], int] = {key: 0 for key in self.keys}
        for path, ranges in pending.items():
            for start, stop in ranges:
                self._count(self._number[path], start, stop, +1)
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max(1, num_threads), "keras_hub_dist-hash")
        self._futures = {key: self._submit(key) for key, left in self._left.items() if left == 0}

    def _count(self, number: int, start: int, stop: int, sign: int) -> list[tuple[int, int]]:
        """Adds `sign` x the bytes of `start:stop` to each chunk's count;
        returns the chunks that reach 0."""
        done = []
        while start < stop:
            chunk = start // CHUNK_BYTES
            end = min(stop, (chunk + 1) * CHUNK_BYTES)
            self._left[(number, chunk)] += sign * (end - start)
            if self._left[(number, chunk)] == 0:
                done.append((number, chunk))
            start = end
        return done

    def _submit(self, key: tuple[int, int]) -> Any:
        path = self.files[key[0]]
        size = os.path.getsize(path)
        start = key[1] * CHUNK_BYTES
        return self._pool.submit(_hash_chunk, path, start, min(start + CHUNK_BYTES, size))

    def written(self, path: str, runs: ByteRuns) -> None:
        """The bytes of `runs` in `path` have been written."""
        if not runs.num_runs:
            return
        if runs.counts:
            grid = np.indices(runs.counts).reshape(len(runs.counts), -1)
            starts = runs.offset + (np.asarray(runs.strides)[:, None] * grid).sum(axis=0)
        else:
            starts = np.asarray([runs.offset])
        first = starts // CHUNK_BYTES
        last = (starts + runs.run_bytes - 1) // CHUNK_BYTES
        inside = first == last
        chunks, bytes_in = np.unique(first[inside], return_counts=True)
        number = self._number[path]
        with self._lock:
            done = []
            for chunk, count in zip(chunks.tolist(), bytes_in.tolist()):
                self._left[(number, chunk)] -= count * runs.run_bytes
                if self._left[(number, chunk)] == 0:
                    done.append((number, chunk))
            for start in starts[~inside].tolist():  # a run across a chunk boundary
                done += self._count(number, start, start + runs.run_bytes, -1)
            for key in done:
                self._futures[key] = self._submit(key)

    def table(self) -> np.ndarray:
        """The SHA-256 of every chunk, one row each in `all_chunks` order
        (a chunk not reported complete is hashed now)."""
        with self._lock:
            for key in self.keys:
                if key not in self._futures:
                    self._futures[key] = self._submit(key)
        table = np.zeros((len(self.keys), 32), np.uint8)
        try:
            for row, key in enumerate(self.keys):
                table[row] = np.frombuffer(self._futures[key].result(), np.uint8)
        finally:
            self._pool.shutdown()
        return table


def all_chunks(sizes: Sequence[int], chunk_bytes: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """Every `(file number, chunk number)` of files of these sizes, in order."""
    steps = list(chunk_bytes) if chunk_bytes is not None else [CHUNK_BYTES] * len(sizes)
    return [
        (f, c) for f, (size, step) in enumerate(zip(sizes, steps)) for c in range(num_chunks(size, step))
    ]


def entries(files: Sequence[str], digests: np.ndarray, sizes: Sequence[int] | None = None) -> dict[str, dict[str, Any]]:
    """File name -> its recorded checksum (`FileChecksum.to_json()`), from
    `digests`: one SHA-256 row per chunk of `files`, in `all_chunks` order
    (`sizes`: the files' lengths, where they are not on this disk)."""
    sizes = [os.path.getsize(f) for f in files] if sizes is None else list(sizes)
    keys = all_chunks(sizes)
    out = {}
    for number, (path, size) in enumerate(zip(files, sizes)):
        rows = [row for row, key in enumerate(keys) if key[0] == number]
        out[os.path.basename(path)] = FileChecksum(
            size, CHUNK_BYTES, tuple(digests[r].tobytes().hex() for r in rows)
        ).to_json()
    return out


def share(keys: Sequence[Any], process_index: int, process_count: int) -> list[Any]:
    """This process's part of `keys`: every `process_count`-th one."""
    return list(keys[process_index::process_count])


def file_checksum(path: str, *, num_threads: int = 2) -> FileChecksum:
    """The checksum of one file, hashed in this process."""
    size = os.path.getsize(path)
    keys = all_chunks([size])
    digests = chunk_digests([path], keys, num_threads=num_threads)
    return FileChecksum(size, CHUNK_BYTES, tuple(digests[k].hex() for k in keys))


def recorded_checksums(metadata: Mapping[str, Any], label: str) -> dict[str, FileChecksum]:
    """File name -> recorded checksum, from a preset's metadata.json.

    Raises:
        PresetError: The preset has no recorded checksums, or they are
            malformed.
    """
    recorded = metadata.get(METADATA_KEY, {})
    files = recorded.get("checksums") if isinstance(recorded, Mapping) else None
    if not isinstance(files, Mapping) or not files:
        raise PresetError(
            f"Cannot verify preset {label!r}: its metadata.json records no "
            f"checksums. Expected a '{METADATA_KEY}': {{'checksums': ...}} entry, "
            "written by `keras_hub_dist.save_sharded_preset`. Received: "
            + ("no metadata.json" if not metadata else f"keys {sorted(metadata)}")
            + ". Load with verify=False, or save the preset again with "
            "`save_sharded_preset`."
        )
    return {
        name: FileChecksum.from_json(entry, f"{name!r} in {label!r}")
        for name, entry in files.items()
    }


def mismatches(
    names: Sequence[str],
    paths: Sequence[Any],
    recorded: Mapping[str, FileChecksum],
    keys: Iterable[tuple[int, int]],
    *,
    num_threads: int = 2,
) -> list[str]:
    """Checks chunks `keys` of files `paths` against `recorded`; returns one
    message per difference (wrong size, or a chunk whose digest differs)."""
    problems = []
    keys = list(keys)
    for name, path in zip(names, paths):
        size = _size(path)
        if size != recorded[name].size:
            problems.append(
                f"{_name(path)!r} has {size} bytes; expected {recorded[name].size} "
                "(the file was truncated or extended after saving)"
            )
    if problems:
        return problems
    steps = [recorded[name].chunk_bytes for name in names]
    digests = chunk_digests(paths, keys, chunk_bytes=steps, num_threads=num_threads)
    for (f, c), digest in sorted(digests.items()):
        entry = recorded[names[f]]
        if digest.hex() != entry.chunks[c]:
            start = c * entry.chunk_bytes
            problems.append(
                f"bytes {start}:{min(start + entry.chunk_bytes, entry.size)} of "
                f"{_name(paths[f])!r} changed since saving (SHA-256 {digest.hex()[:16]}..., "
                f"recorded {entry.chunks[c][:16]}...)"
            )
    return problems


def verify_files(
    files: Sequence[Any],
    metadata: Mapping[str, Any],
    label: str,
    *,
    num_threads: int = 2,
) -> None:
    """Checks `files` against the checksums recorded in `metadata`; each
    process of a `jax.distributed` job hashes a share of the chunks, and all
    raise together.

    Raises:
        PresetError: No checksums are recorded, a file has none, or a file's
            size or bytes differ from what was saved (the message names the
            file and the byte ranges).
    """
    import jax

    recorded = recorded_checksums(metadata, label)
    names = [os.path.basename(_name(f).rstrip("/")) for f in files]
    unrecorded = [n for n in names if n not in recorded]
    if unrecorded:
        raise PresetError(
            f"Cannot verify preset {label!r}: metadata.json records no "
            f"checksum for {unrecorded}. Expected one for every weights file; "
            f"recorded: {sorted(recorded)}. Save the preset again with "
            "`save_sharded_preset`."
        )
    steps = [recorded[n].chunk_bytes for n in names]
    keys = all_chunks([_size(f) for f in files], steps)
    mine = share(keys, jax.process_index(), jax.process_count())
    problems = mismatches(names, list(files), recorded, mine, num_threads=num_threads)
    _processes.check_all(
        "; ".join(problems) or None,
        PresetError,
        f"Preset {label!r} is not the one that was saved (download or save it "
        "again)",
    )
