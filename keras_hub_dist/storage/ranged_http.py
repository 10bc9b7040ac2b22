"""HTTP range reads straight into host buffers: many in flight, retried,
resumed, checked.

Object stores (S3, GCS), the Hugging Face Hub and plain HTTPS servers all
serve a byte range of an object with `GET` + `Range: bytes=a-b`. This module
reads the stretches of a file the loader asks for (`read_stretches`: a file
offset and the buffers the bytes land in, one after another) with a pool of
connections:

- a stretch is cut into requests of at most `chunk_bytes`, so one large
  tensor is fetched over many connections at once, and adjacent pieces
  (scattered into several blocks' buffers) share a request;
- each response body is read with `http.client`'s `readinto` straight into
  the destination buffers: the socket's `recv_into` fills them, with no
  intermediate copy of a response, a tensor or a file (urllib3's own
  `readinto` reads into a new `bytes` and copies it: a second copy);
- a failure that may pass (a connection reset, a timeout, a short body, HTTP
  429 or 5xx) is retried with exponential backoff and the request resumes
  from the byte reached; what arrived stays;
- every response is checked: the status (206, or 200 for a whole-object
  read), `Content-Range` equal to the range asked for, and the object's
  identity (its ETag, or the version pinned in the URL) equal to the one
  seen when the file was opened, so a model is never made of two versions of
  a file;
- what cannot pass (401 / 403, 404, 412, 416, any other status) raises a
  `PresetError` at once naming the URL, the byte range, what the server
  answered and what to do.

Why urllib3 and not a storage SDK, measured (`benchmarks/bench_remote.py
--clients`, 2026-11-24; BENCHMARKS.md "Remote checkpoints"): the 3.8 GB
probe fetched whole as 16 MiB ranges into one aligned buffer from a loopback
server adding 20 ms per request and capping each connection at 50 MB/s
(median of 3; without latency or cap in brackets): this client, 16 in
flight, 6.40 s (1.86 s), 1.13 MB (1.21 MB) of host memory beyond the
buffer; bodies through urllib3's `readinto`, 6.91 s (2.56 s); obstore's
`get_range_async`, 16 in flight, 7.73 s (2.51 s), 0.38 GB (0.33 GB) beyond
the buffer; fsspec's HTTPFileSystem `cat_ranges` (aiohttp), 11.20 s
(5.83 s), 1.33 GB (1.30 GB) beyond; obstore's `get_ranges`, 86.87 s
(4.56 s): it merges adjacent ranges into one request, one connection at
50 MB/s. APIs that return each range as a new object need one more copy and
retry a range whole; urllib3 (pooled keep-alive connections, timeouts,
installed with `requests`) lets a body land in its final buffer and a cut
body resume where it stopped. s3fs, gcsfs and `HfFileSystem` were not
measured (fsspec filesystems on aiohttp whose `cat_ranges` returns `bytes`
the same way). Credentials and addressing stay with each store's own
library (`storage.object_stores`).

Example:

```python
client = RangeClient(concurrency=16)
remote = client.open("https://host/dir/model.safetensors", store)  # size, ETag
buffer = host_io.aligned_empty((1 << 20,), np.uint8)
remote.read_stretches([(4096, [memoryview(buffer)])])
```
"""

from __future__ import annotations

import email.utils
import http.client
import importlib.metadata
import os
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import urllib3

from keras_hub_dist.errors import PresetError
from keras_hub_dist.storage.redaction import SECRET_HEADERS, redact

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_CONCURRENCY", "ObjectInfo", "RangeClient", "RemoteFile",
           "RetryPolicy", "SOURCE_ADDRESS_ENV"]

# Measured on the loopback probe (BENCHMARKS.md): 16 connections of 16 MiB
# requests saturate a link where one connection gets 50 MB/s, and keep the
# bytes in flight per process at 256 MiB.
DEFAULT_CONCURRENCY = 16
DEFAULT_CHUNK_BYTES = 16 << 20
# Bodies go out a MiB per `sendall`: urllib3 sends a bytes-like one whole, in
# one `sendall` whose timeout (the connect timeout, 20 s) bounds the whole
# body: a 64 MiB part failed below 3.4 MB/s per connection.
SEND_PIECE_BYTES = 1 << 20
# A body is read in pieces of at most this size (each a `readinto`).
_READ_STEP = 1 << 20
# Where a process's connections come from (`RangeClient(source_address=)`).
SOURCE_ADDRESS_ENV = "KERAS_HUB_DIST_SOURCE_ADDRESS"
_RETRY_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a failing request is tried again.

    Attributes:
        attempts: Tries per request (the first included).
        backoff_s: Wait before the second try; doubled each time, with full
            jitter, at most `max_backoff_s` (or what `Retry-After` asks).
        max_backoff_s: The longest single wait.
        connect_timeout_s: Seconds to connect.
        read_timeout_s: Seconds without a byte before a read fails.
    """

    attempts: int = 8
    backoff_s: float = 0.2
    max_backoff_s: float = 10.0
    connect_timeout_s: float = 20.0
    read_timeout_s: float = 60.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_backoff_s)
        return random.uniform(0, min(self.max_backoff_s, self.backoff_s * 2**attempt))


@dataclass(frozen=True)
class ObjectInfo:
    """What a store says of one object when it is opened.

    Attributes:
        url: The URL its bytes are read from (a version may be pinned in it).
        size: Its length in bytes.
        etag: Its ETag, if the store gives one; every response must match.
    """

    url: str
    size: int
    etag: str | None = None


class Signer(Protocol):
    """What a store adds to each request (auth headers; a signature)."""

    def headers(self, method: str, url: str, headers: Mapping[str, str]) -> dict[str, str]: ...

    def credential_source(self) -> str: ...


# What a `RangeClient` retries with unless told otherwise.
DEFAULT_RETRY = RetryPolicy()


class _Retryable(Exception):
    """A failure worth another try."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(response: Any) -> float | None:
    value = response.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        parsed = email.utils.parsedate_to_datetime(value)
        return max(0.0, parsed.timestamp() - time.time()) if parsed else None


class RangeClient:
    """A process's pool of connections and request threads.

    Args:
        concurrency: Requests in flight at once (connections per host too).
        chunk_bytes: The largest range one request asks for.
        retry: The `RetryPolicy` (default `DEFAULT_RETRY`).
        process_index: Sent as `X-Khd-Process` with every request (beside a
            `keras-hub-dist/<version>` User-Agent), so a server's logs tell
            the processes of a job apart.
        source_address: The local address connections are made from (default
            `KERAS_HUB_DIST_SOURCE_ADDRESS`, else the system's choice), so
            each process of a job can use its own link or interface.
    """

    def __init__(
        self,
        concurrency: int = DEFAULT_CONCURRENCY,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        retry: RetryPolicy | None = None,
        process_index: int = 0,
        source_address: str | None = None,
    ) -> None:
        if concurrency < 1 or chunk_bytes < 1:
            raise ValueError(
                f"Expected concurrency >= 1 and chunk_bytes >= 1. Received: "
                f"concurrency={concurrency}, chunk_bytes={chunk_bytes}."
            )
        self.concurrency = concurrency
        self.chunk_bytes = chunk_bytes
        self.retry = retry or DEFAULT_RETRY
        self.base_headers = {
            "User-Agent": f"keras-hub-dist/{_version()}",
            "X-Khd-Process": str(process_index),
            "Accept-Encoding": "identity",
        }
        # Range reads run on the `concurrency` request threads; a few more
        # connections serve metadata and small files asked from elsewhere.
        # `block=True`: past that, a request waits for a free connection.
        self.source_address = source_address or os.environ.get(SOURCE_ADDRESS_ENV) or None
        bind = {"source_address": (self.source_address, 0)} if self.source_address else {}
        self._pool = urllib3.PoolManager(
            num_pools=16,
            maxsize=concurrency + 4,
            block=True,
            retries=False,
            timeout=urllib3.Timeout(
                connect=self.retry.connect_timeout_s, read=self.retry.read_timeout_s
            ),
            **bind,
        )
        self._threads = ThreadPoolExecutor(concurrency, "keras_hub_dist-fetch")
        self._stopped = threading.Event()
        self.requests = 0
        self.bytes_received = 0
        self.bytes_sent = 0  # request bodies that were answered
        self._lock = threading.Lock()

    def cancel(self) -> None:
        """Stops retrying: a request that fails now raises at once (a load
        that failed elsewhere does not wait out the others' backoffs)."""
        self._stopped.set()

    def close(self) -> None:
        self._stopped.set()
        self._threads.shutdown(wait=True, cancel_futures=True)
        self._pool.clear()

    def __enter__(self) -> RangeClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one request -------------------------------------------------------

    def request(
        self,
        method: str,
        url: str,
        signer: Signer,
        headers: Mapping[str, str] | None = None,
        *,
        redirect: bool = True,
        body: Any = None,
    ) -> Any:
        """One whole request with the store's headers (metadata, listings,
        small files, uploads: `body`, a bytes-like, is sent whole again on
        each try, a MiB per `sendall`), retried while it may pass.

        Returns:
            The urllib3 response, its body read (a 4xx is the caller's to judge).

        Raises:
            PresetError: It still failed after the last try.
        """
        all_headers = {**self.base_headers, **(headers or {})}
        view = memoryview(body).cast("B") if body is not None else None
        if in_pieces := view is not None and view.nbytes > SEND_PIECE_BYTES:
            all_headers["Content-Length"] = str(view.nbytes)  # not chunked: stores want the length
        cause: Exception | None = None
        for attempt in range(self.retry.attempts):
            if attempt:
                if self._stopped.is_set():
                    break
                time.sleep(self.retry.delay(attempt - 1, getattr(cause, "retry_after", None)))
            try:
                signed = {**all_headers, **signer.headers(method, url, all_headers)}
                sent_body = ((view[i : i + SEND_PIECE_BYTES] for i in range(0, view.nbytes, SEND_PIECE_BYTES))
                             if in_pieces else body)  # a fresh iterator per try
                response = self._pool.request(method, url, body=sent_body, headers=signed,
                                              redirect=redirect, retries=_follow(redirect))
            except (urllib3.exceptions.HTTPError, OSError) as e:
                cause = e
                continue
            self._count(requests=1, received=len(response.data or b""), sent=view.nbytes if view else 0)
            if response.status not in _RETRY_STATUSES:
                return response
            cause = _Retryable(f"HTTP {response.status}", _retry_after(response))
        # `from None`: the cause's text is in the message, redacted.
        raise PresetError(redact(
            f"{method} {url} failed {self.retry.attempts} times; the last answer: "
            f"{_describe(cause)}. Expected the server to answer. Check the endpoint "
            "and the network, or retry later."
        )) from None

    def send_once(self, method: str, url: str, headers: Mapping[str, Any], body: Any = None,
                  chunked: bool = False) -> Any:
        """One try of a request exactly as given (headers already signed;
        `X-Khd-Process` added), its body left unread: for another library's
        requests (botocore's) sent through this client's connections."""
        headers = {**headers, "X-Khd-Process": self.base_headers["X-Khd-Process"]}
        response = self._pool.urlopen(
            method, url, body=body, headers=headers, retries=False, redirect=False,
            preload_content=False, decode_content=False, chunked=chunked,
        )
        self._count(requests=1)
        return response

    def _count(self, requests: int = 0, received: int = 0, sent: int = 0) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_received += received
            self.bytes_sent += sent

    # -- files -------------------------------------------------------------

    def open(self, info: ObjectInfo, signer: Signer, name: str) -> RemoteFile:
        """A `RemoteFile` of an object whose size and identity are known."""
        return RemoteFile(self, info, signer, name)

    def run_all(self, jobs: Sequence[Callable[[], None]]) -> None:
        """Runs `jobs` on the request threads; the first failure cancels the
        rest and is raised once every started job has ended."""
        if threading.current_thread().name.startswith("keras_hub_dist-fetch"):
            for job in jobs:
                job()
            return
        futures = [self._threads.submit(job) for job in jobs]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in done if f.exception() is not None]
        if failed:
            for f in pending:
                f.cancel()
            wait(pending)
            raise failed[0].exception()


def _body_readinto(response: Any) -> Callable[[memoryview], int]:
    """The body's `readinto` that fills the caller's buffer straight from
    the socket and, when the connection breaks, returns what did arrive.

    urllib3's own `readinto` reads into a new `bytes` and copies it (a second
    copy of every byte), and raises on a cut body, losing that read's bytes;
    the `http.client` response it wraps (`_fp`, an attribute of urllib3's
    `HTTPResponse` since 1.x) does neither."""
    raw = getattr(response, "_fp", None)
    if isinstance(raw, http.client.HTTPResponse):
        return raw.readinto
    return response.readinto


def _version() -> str:
    try:
        return importlib.metadata.version("keras-hub-dist")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _follow(redirect: bool) -> urllib3.Retry:
    """urllib3's own retries off (ours resume mid-body); redirects followed,
    dropping every credential header on a change of host (urllib3's default
    keeps SigV4's `X-Amz-Security-Token`: `redaction.SECRET_HEADERS`)."""
    return urllib3.Retry(
        total=None, connect=0, read=0, status=0, other=0,
        redirect=5 if redirect else 0, raise_on_redirect=False,
        remove_headers_on_redirect=SECRET_HEADERS,
    )


def _describe(error: BaseException | None) -> str:
    return redact(error if isinstance(error, _Retryable) else f"{type(error).__name__}: {error}")


class RemoteFile:
    """One remote object, read by byte ranges (see the module doc).

    Attributes:
        name: The location's URL of the object (for messages and indexes).
        size: Its length, as seen when opened.
        etag: Its ETag when opened (`None` if the store gives none).
    """

    # A stretch is one range request (cut into chunks): any length, any
    # number of buffers.
    stretch_limits = (sys.maxsize, sys.maxsize)

    def __init__(self, client: RangeClient, info: ObjectInfo, signer: Signer, name: str) -> None:
        self.client = client
        self.info = info
        self.signer = signer
        self.name = name
        self.size = info.size
        self.etag = info.etag

    def __repr__(self) -> str:
        return f"RemoteFile({self.name!r}, size={self.size})"

    def close(self) -> None:
        """Nothing to release: connections belong to the client."""

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` (for headers and small reads)."""
        out = bytearray(length)
        self.read_stretches([(offset, [memoryview(out)])])
        return bytes(out)

    def read_stretches(
        self,
        stretches: Sequence[tuple[int, Sequence[memoryview]]],
        on_read: Callable[[int, int], None] | None = None,
    ) -> None:
        """Fills each stretch's buffers, in order, from the object's bytes at
        its offset, with requests in flight concurrently.

        Raises:
            PresetError: A range lies past the object's end, or a request
                failed for good (the message names the URL and range).
        """
        jobs = []
        for offset, buffers in stretches:
            length = sum(len(b) for b in buffers)
            if offset < 0 or offset + length > self.size:
                raise PresetError(
                    f"Bytes {offset}:{offset + length} of {self.name} lie past its end. "
                    f"Expected ranges inside its {self.size} bytes. Received: a "
                    "checkpoint whose index disagrees with its files; fetch it again."
                )
            for start, pieces in _chunks(offset, buffers, self.client.chunk_bytes):
                jobs.append(lambda s=start, p=pieces: self._fetch(s, p, on_read))
        self.client.run_all(jobs)

    def _fetch(self, start: int, buffers: list[memoryview], on_read: Callable[[int, int], None] | None) -> None:
        """One range, into `buffers`; a retry resumes from the byte reached."""
        total = sum(len(b) for b in buffers)
        done = 0
        retry = self.client.retry
        cause: Exception | None = None
        for attempt in range(retry.attempts):
            if attempt:
                if self.client._stopped.is_set():
                    break
                time.sleep(retry.delay(attempt - 1, getattr(cause, "retry_after", None)))
            received = 0
            try:
                received = self._fetch_once(start + done, _after(buffers, done))
                cause = None
            except _PartialRead as e:
                received, cause = e.received, e.cause
            done += received
            if on_read is not None:
                on_read(received, 1)
            if cause is None:
                return
        raise PresetError(redact(
            f"Fetching bytes {start + done}:{start + total} of {self.name} ({self.info.url}) "
            f"failed {retry.attempts} times; the last answer: {_describe(cause)}. "
            f"{done} of the {total} bytes asked for arrived. Expected the server to "
            "serve the range. Check the endpoint and the network, or retry later "
            "(the load can be started again: nothing was left on the devices)."
        )) from None

    def _fetch_once(self, start: int, buffers: list[memoryview]) -> int:
        """One request for the bytes of `buffers` at `start`; returns the
        bytes received (all of them) or raises `_PartialRead`."""
        length = sum(len(b) for b in buffers)
        end = start + length - 1
        headers = {**self.client.base_headers, "Range": f"bytes={start}-{end}"}
        if self.etag:
            headers["If-Match"] = self.etag
        url = self.info.url
        try:
            signed = {**headers, **self.signer.headers("GET", url, headers)}
            response = self.client._pool.request(
                "GET", url, headers=signed, preload_content=False, retries=_follow(True)
            )
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise _PartialRead(0, _Retryable(f"{type(e).__name__}: {e}")) from e
        self.client._count(requests=1)
        received = 0
        try:
            self._check(response, start, end, length)
            readinto = _body_readinto(response)
            for view in buffers:
                position = 0
                while position < len(view):
                    n = readinto(view[position : position + _READ_STEP])
                    if not n:
                        raise _Retryable(f"the body ended after {received} of {length} bytes")
                    position += n
                    received += n
        except (_Retryable, urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as e:
            cause = e if isinstance(e, _Retryable) else _Retryable(f"{type(e).__name__}: {e}")
            raise _PartialRead(received, cause) from e
        finally:
            self.client._count(received=received)
            if received == length:
                response.release_conn()
            else:  # mid-body: the connection cannot be reused
                response.close()
        return received

    def _check(self, response: Any, start: int, end: int, length: int) -> None:
        """Raises unless `response` serves exactly bytes `start..end` of the
        object as it was when opened."""
        status = response.status
        where = redact(f"bytes {start}:{end + 1} of {self.name} ({self.info.url})")
        if status in _RETRY_STATUSES:
            response.drain_conn()
            raise _Retryable(f"HTTP {status}", _retry_after(response))
        if status in (401, 403):
            response.drain_conn()
            raise PresetError(
                f"Access to {where} was refused (HTTP {status}). Credentials used: "
                f"{self.signer.credential_source()}. Expected read access to the "
                "object. Grant it, or provide other credentials."
            )
        if status in (404, 410, 412):
            response.drain_conn()
            raise PresetError(
                f"{self.name} changed while it was being loaded: reading {where} "
                f"answered HTTP {status}"
                + (f" (the object with ETag {self.etag} is gone)" if self.etag else "")
                + ". Expected the object seen when the load started. Never load a "
                "checkpoint while it is being replaced; load it again once it is complete."
            )
        ranged = status == 206
        whole = status == 200 and start == 0 and length == self.size
        if not (ranged or whole):
            response.drain_conn()
            raise PresetError(
                f"Reading {where} answered HTTP {status}. Expected 206 (a byte range). "
                "Received a server that does not serve byte ranges, or an error; "
                "use a server (or object store) that honours `Range`."
            )
        if ranged:
            match = _CONTENT_RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
            total = match and match.group(3)
            if not match or (int(match.group(1)), int(match.group(2))) != (start, end) or (
                total != "*" and int(total) != self.size
            ):
                response.drain_conn()
                raise PresetError(
                    f"Reading {where} answered with Content-Range "
                    f"{response.headers.get('Content-Range')!r}. Expected "
                    f"'bytes {start}-{end}/{self.size}': the server sent other bytes "
                    "than those asked for (or the object's size changed). Load it "
                    "again once the checkpoint is complete."
                )
        etag = response.headers.get("ETag")
        if self.etag and etag and _weak(etag) != _weak(self.etag):
            response.drain_conn()
            raise PresetError(
                f"{self.name} changed while it was being loaded: {where} came with "
                f"ETag {etag}, the object had ETag {self.etag} when the load started. "
                "Expected one version of every file. Load it again once the "
                "checkpoint is complete."
            )


class _PartialRead(Exception):
    def __init__(self, received: int, cause: _Retryable) -> None:
        super().__init__(str(cause))
        self.received = received
        self.cause = cause


def _weak(etag: str) -> str:
    return etag.removeprefix("W/")


def _after(buffers: Sequence[memoryview], n: int) -> list[memoryview]:
    """What is left of `buffers` once `n` bytes arrived."""
    out = []
    for view in buffers:
        if n >= len(view):
            n -= len(view)
            continue
        out.append(view[n:] if n else view)
        n = 0
    return out


def _chunks(
    offset: int, buffers: Sequence[memoryview], chunk_bytes: int
) -> Iterator[tuple[int, list[memoryview]]]:
    """Cuts a stretch into requests of at most `chunk_bytes` (buffers split
    where a request ends)."""
    start, pieces, size = offset, [], 0
    for view in buffers:
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        while len(view):
            take = min(len(view), chunk_bytes - size)
            pieces.append(view[:take])
            size += take
            view = view[take:]
            if size == chunk_bytes:
                yield start, pieces
                start, pieces, size = start + size, [], 0
    if pieces:
        yield start, pieces
