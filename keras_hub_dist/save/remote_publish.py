"""What a save into object storage (`s3://`, `gs://`) does whatever the
format: claim the target, keep an owner record, combine mixed parts, and
publish all or nothing.

`save.remote_save` (KerasHub preset) and `save.remote_hf_export` (Hugging
Face checkpoint) differ only in how the weights files are laid out and in
which order their bytes are written; both use these steps:

- **claim** (`claim_remote`, process 0, before any byte is uploaded): the
  target is writable (bucket exists, no 403, the prefix is not an object),
  what killed saves left is aborted (`StaleStagingWarning`), and a target
  holding objects needs `overwrite=True`;
- **owner record** (`OwnerRecord`): `.khd-save-<token>.json` beside the
  preset, naming the save's uploads, renewed every `LEASE_SECONDS / 4` by a
  thread; the next save aborts the uploads of records whose lease lapsed by
  the store's own clock, and uploads no record claims once that old;
- **combine** (`Combiner`): a part several processes write bytes of
  (`save.part_plan`) is summed over the processes on its owner, in
  `COMBINE_BYTES` slices, once its last writing step has run everywhere;
- **publish** (`publish`, process 0): complete the uploads (each object
  appears whole), write the small files, config.json last; with
  `overwrite=True` the old config.json goes first, so the old preset is
  unreadable (never mixed) while it is replaced.

Example:

```python
with open_writer(url) as writer:
    existing = claim_remote(writer, overwrite=False)
    owner = OwnerRecord(writer, token)
    start_uploads(writer, owner, ["model.weights.h5"], uploads)
    ...
    publish(writer, folder, files, uploads, parts, existing, names)
```
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import threading
import time
import warnings
from typing import Any

import jax
import numpy as np

from keras_hub_dist import _processes
from keras_hub_dist.errors import SaveError, StaleStagingWarning
from keras_hub_dist.save.part_plan import FileParts
from keras_hub_dist.storage.part_uploads import PartUploads

__all__ = [
    "COMBINE_BYTES", "LEASE_SECONDS", "SCHEMES", "Combiner", "OwnerRecord", "agreed_url", "check_url", "claim_remote",
    "memory_dir", "publish", "reduce_on", "start_uploads",
]

SCHEMES = ("s3", "gs")

# How long an owner record stays valid without renewal: a save whose record
# is older than this (by the store's clock) is taken for dead.
LEASE_SECONDS = 120.0
OWNER_PREFIX = ".khd-save-"


def check_url(url: str, durable: bool, argument: str = "preset_dir") -> None:
    """Raises `SaveError` unless `url` is a bucket this package writes to
    and `durable` is False (an object is durable once written)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise SaveError(
            f"Expected {argument} to be a local directory or an object store URL "
            f"({', '.join(s + '://' for s in SCHEMES)}). Received: {url!r}. "
            + ("Pushing to the Hugging Face Hub is not supported: save to a local directory, "
               "then upload it with `huggingface-cli upload`." if scheme == "hf" else
               "Save to a local directory or a bucket.")
        )
    if durable:
        raise SaveError(
            f"Expected durable=False for a save into {url!r} (an object is durable once "
            f"written). Received: durable={durable!r}."
        )


def agreed_url(url: str, argument: str = "preset_dir") -> None:
    """Raises `SaveError` (on every process) unless every process passed `url`."""
    targets = _processes.gather_strings(url)
    if len(set(targets)) > 1:
        raise SaveError(
            f"Expected every process to pass the same {argument}. Received: "
            + ", ".join(f"process {i}: {t!r}" for i, t in enumerate(targets)) + "."
        )


def start_uploads(writer: Any, owner: OwnerRecord, names: list[str], uploads: dict[str, str]) -> None:
    """Starts the owner record, then one multipart upload per object in
    `names` (into `uploads`), each recorded before the next is created."""
    owner.start()
    for name in names:
        uploads[name] = writer.create_upload(name)
        owner.uploads = dict(uploads)
    owner.renew()


def memory_dir() -> str | None:
    """A directory in memory (tmpfs) for the small files, else the default."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def claim_remote(writer: Any, overwrite: bool, what: str = "preset") -> dict[str, Any]:
    """Aborts what dead saves to the target left (warning with what), then
    checks the target may be written (it holds no `what`, or `overwrite`);
    returns what it holds now."""
    writer.check_writable()
    listing = writer.list()
    removed = _sweep_stale(writer, listing)
    if removed:
        warnings.warn(
            f"Removed what killed saves to {writer.location} left: " + "; ".join(removed),
            StaleStagingWarning, stacklevel=4,
        )
        listing = writer.list()
    existing = {n: m for n, m in listing.items() if not n.startswith(".")}
    if existing and not overwrite:
        shown = ", ".join(sorted(existing)[:5]) + (" ..." if len(existing) > 5 else "")
        raise SaveError(
            f"Expected {writer.location} to hold no {what}. Received: {len(existing)} "
            f"object(s) there ({shown}). Pass overwrite=True to replace it, or choose another prefix."
        )
    return existing


def _sweep_stale(writer: Any, listing: dict[str, Any]) -> list[str]:
    """Aborts the uploads of saves whose owner record's lease has lapsed (by
    the store's clock: the time of a record written now), and those records."""
    records = {n: m for n, m in listing.items() if n.startswith(OWNER_PREFIX)}
    pending = writer.list_uploads()
    if not records and not pending:
        return []
    probe = f"{OWNER_PREFIX}probe-{secrets.token_hex(4)}.json"
    writer.put(probe, b"{}")
    now = writer.list(probe)[probe].updated
    writer.delete([probe])
    claimed: set[str] = set()  # by a record, live or dead
    removed: list[str] = []
    for name, meta in records.items():
        body = writer.get(name)
        record = json.loads(body) if body else {}
        claimed.update(record.get("uploads", {}).values())
        if now - meta.updated < LEASE_SECONDS:
            continue
        for upload_name, upload_id in record.get("uploads", {}).items():
            with contextlib.suppress(Exception):
                writer.abort_upload(upload_name, upload_id)
            removed.append(f"upload of {upload_name!r} ({upload_id[:12]}...) by {record.get('host', '?')} pid {record.get('pid', '?')}")
        writer.delete([name])
        removed.append(f"owner record {name!r} (lease lapsed {now - meta.updated:.0f} s ago)")
    for upload in pending:
        if upload.upload_id in claimed:
            continue
        # No record claims it: a save killed between starting the upload and
        # recording it, once as old as a lease.
        if now - upload.initiated >= LEASE_SECONDS:
            with contextlib.suppress(Exception):
                writer.abort_upload(upload.name, upload.upload_id)
            removed.append(f"unclaimed upload of {upload.name!r} started {now - upload.initiated:.0f} s ago")
    return removed


class OwnerRecord:
    """The save's owner record in the store, renewed by a thread."""

    def __init__(self, writer: Any, token: str) -> None:
        self.writer, self.name = writer, f"{OWNER_PREFIX}{token}.json"
        self.uploads: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def renew(self) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "uploads": self.uploads,
                  "lease_seconds": LEASE_SECONDS, "written": time.time()}
        self.writer.put(self.name, json.dumps(record).encode())

    def start(self) -> None:
        self.renew()

        def loop() -> None:
            while not self._stop.wait(LEASE_SECONDS / 4):
                with contextlib.suppress(Exception):  # the next renewal may pass
                    self.renew()

        self._thread = threading.Thread(target=loop, name="khd-save-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            with contextlib.suppress(Exception):
                self.writer.delete([self.name])


# Mixed parts are summed over the processes this many bytes at a time: each
# device holds 2 x COMBINE_BYTES / (its process's devices) meanwhile (1 MiB
# with 4 devices a process).
COMBINE_BYTES = 2 << 20


class Combiner:
    """Combines each mixed part (`save.part_plan`) as soon as every process
    has written it whole: after the slab that writes the last value with
    bytes in it up to the part's end. The same parts, in the same order, on
    every process."""

    def __init__(self, sink: PartUploads, layout: dict[str, FileParts]) -> None:
        self._sink, self._layout = sink, layout
        self._due = {
            path: sorted(parts.mixed, key=lambda k, p=parts: (p.last_value.get(k, -1), k))
            for path, parts in layout.items()
        }
        self._me = jax.process_index()

    def advance(self, path: str, index: int, written_to: int, value_end: int, errors: list[str]) -> None:
        """Value `index` of the walk is written up to byte `written_to` of
        file `path` (it ends at `value_end`), by every process."""
        parts, due = self._layout[path], self._due[path]
        while due:
            number = due[0]
            last = parts.last_value.get(number, -1)
            part_end = min(parts.size, number * parts.part_bytes)
            if last > index or (last == index and written_to < min(part_end, value_end)):
                return
            due.pop(0)
            reduce = reduce_on(parts.owners[number - 1], self._me)
            if errors:  # take part, with nothing
                reduce(None, part_length(parts, number))
                continue
            try:
                self._sink.combine(path, number, reduce)
            except Exception as e:  # noqa: BLE001 - the others wait in the next combine
                errors.append(f"combining part {number} of {os.path.basename(path)!r}: {type(e).__name__}: {e}")


def part_length(parts: FileParts, number: int) -> int:
    start = (number - 1) * parts.part_bytes
    return min(parts.size, start + parts.part_bytes) - start


def reduce_on(owner: int, me: int) -> Any:
    """Sums a part's buffers over the processes, `COMBINE_BYTES` at a time;
    the part on `owner`, `None` elsewhere."""

    def reduce(buffer: np.ndarray | None, length: int) -> np.ndarray | None:
        out = np.empty(length, np.uint8) if me == owner else None
        for start in range(0, length, COMBINE_BYTES):
            stop = min(length, start + COMBINE_BYTES)
            mine = buffer[start:stop] if buffer is not None else np.zeros(stop - start, np.uint8)
            summed = _processes.sum_disjoint_bytes(mine)
            if out is not None:
                out[start:stop] = summed
        return out

    return reduce


def publish(
    writer: Any, folder: str, files: list[str], uploads: dict[str, str],
    parts: dict[str, list[tuple[int, str]]], existing: dict[str, Any], names: dict[str, str],
) -> None:
    """Completes the uploads, then writes the small files, config.json last
    (see the module doc)."""
    _processes.reached("publish")
    config = names["config"]
    if config in existing:
        writer.delete([config])  # the old preset is unreadable from here on
    for name, upload_id in uploads.items():
        writer.complete_upload(name, upload_id, parts[name])
    weights = {os.path.relpath(f, folder) for f in files}  # names only: they need not exist
    small = [
        os.path.relpath(os.path.join(root, n), folder)
        for root, _, found in os.walk(folder) for n in found
    ]
    small = sorted(n for n in small if n not in weights and n != config)
    for name in small:
        with open(os.path.join(folder, name), "rb") as f:
            writer.put(name.replace(os.sep, "/"), f.read())
    stale = sorted(set(existing) - weights - set(small) - {config})
    if stale:
        writer.delete(stale)
    with open(os.path.join(folder, config), "rb") as f:
        writer.put(config, f.read())


def publish_job(
    url: str, uploads: dict[str, str], digests: np.ndarray, parts: dict[str, list], first: bool,
    finish: Any,
) -> None:
    """After every process uploaded its parts: sums the chunk digests over
    the processes and gathers every process's parts; the first process then
    runs `finish(digests, merged_parts)` (write the small files, `publish`).
    Raises `SaveError` on every process if that failed."""
    digests = _processes.sum_over_processes(digests)
    every = [json.loads(b) for b in _processes.gather_bytes(json.dumps(parts).encode())]
    error = None
    if first:
        merged = {n: sorted(tuple(p) for process in every for p in process.get(n, [])) for n in uploads}
        try:
            finish(digests, merged)
            uploads.clear()
        except Exception as e:  # noqa: BLE001 - reported on every process
            error = f"{type(e).__name__}: {e}"
    _processes.check_all(error, SaveError, f"Publishing {url!r} failed")


def release_job(writer: Any, owner: OwnerRecord, uploads: dict[str, str], folder: str, first: bool) -> None:
    """The end of a remote save, published or not: the uploads not
    published are aborted (nothing stays billed), the owner record stops,
    the local skeleton goes."""
    if first:
        for name, upload_id in uploads.items():
            with contextlib.suppress(Exception):
                writer.abort_upload(name, upload_id)
        owner.stop()
    shutil.rmtree(folder, ignore_errors=True)


def finish_parts(sink: PartUploads, errors: list[str]) -> tuple[dict[str, list[tuple[int, str]]], str | None]:
    """This process's uploaded parts per file, once its last part is sent,
    and its first error as a message; after an error its parts are
    abandoned (the uploads are aborted by the first process)."""
    error = errors[0] if errors else None
    parts: dict[str, list[tuple[int, str]]] = {}
    if error is None:
        try:
            parts = sink.finish()
        except Exception as e:  # noqa: BLE001 - reported on every process
            error = f"{type(e).__name__}: {e}"
    if error is not None:
        sink.abandon()
    return parts, error
