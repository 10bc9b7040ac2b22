"""Loopback HTTP servers for the remote-checkpoint tests and benchmarks.

`RangeServer` is a threaded HTTP/1.1 server (keep-alive) on 127.0.0.1 that
serves objects with single byte ranges, logs every request at the event and
injects faults, latency and bandwidth caps (per connection, or per client
address: each process binding its own 127.0.0.x gets its own link). Uploads
are logged too (body bytes read, part number, process, client address) and
faulted (503 / 429, or a body cut mid-way), so the writers' retries and
each process's share of a save are measured at the server. It has three
roles:

- plain objects: `{path: bytes | file path}` (files are read with `os.pread`
  chunk by chunk, so a 4 GB probe never lives in memory);
- a Hugging Face Hub (`add_hub_repo`, routes in `remote/hub.py`);
- a proxy in front of moto (S3) or gcp-storage-emulator (GCS), so their
  traffic is logged and faulted the same way (`remote/stores.py`).

Built on the standard library's `http.server.ThreadingHTTPServer` (no new
dependency; werkzeug's development server closes every connection, which
would hide connection reuse). The proxy forwards with urllib3, which the
client uses anyway.

Example:

```python
with RangeServer({"ckpt/model.weights.h5": "/tmp/model.weights.h5"}) as server:
    pool = urllib3.PoolManager()
    r = pool.request("GET", server.url + "/ckpt/model.weights.h5",
                     headers={"Range": "bytes=0-7", "X-Khd-Process": "3"})
    assert r.status == 206
    assert server.bytes_sent(process=3) == 8
```

Tests use the fixtures of tests/remote/conftest.py; pointing huggingface_hub
at the Hub routes is explained in remote/hub.py, the emulators' quirks in
remote/stores.py.

Benchmarks serve a directory from the command line and read the URL from the
first line printed (JSON):

    python tests/remote/servers.py --dir PATH --latency 0.02 --rate 50e6 [--hub owner/name]

or proxy an object store (a write benchmark: AWS_ENDPOINT_URL or
STORAGE_EMULATOR_HOST at the printed endpoint), each client address capped:

    python tests/remote/servers.py --upstream http://127.0.0.1:PORT --flavor s3 --rate-per-address 25e6
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import http.server
import json
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
from typing import Callable, Mapping

import urllib3

if __package__ in (None, ""):  # run as a script: the package `remote` lives in tests/
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from remote import hub as remote_hub  # noqa: E402  (tests/ is on sys.path under pytest)
from remote.http_blobs import (  # noqa: E402, F401  (re-exported)
    CHUNK, Blob, Reply, Source, blob_reply, make_blob, read_body, requested_range,
    resolve_range, walk_files,
)

_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
    "proxy-connection", "proxy-authorization", "proxy-authenticate",
    "expect",  # answered here (100 Continue); the body is forwarded whole
})
# A GCS object in the JSON API (`/storage/v1/b/B/o/O`) or the media API
# (`/download/storage/v1/b/B/o/O`), path decoded.
# A GCS upload (`/upload/storage/v1/b/B/o?name=O`).
GCS_UPLOAD = re.compile(r"^/upload(?:/storage/v1)?/b/(?P<bucket>[^/]+)/o$")
GCS_OBJECT = re.compile(r"^(?P<media>/download)?(?:/storage/v1)?/b/(?P<bucket>[^/]+)/o/(?P<object>.+)$")
# Error codes in each store's own words: (S3 XML code, GCS JSON reason).
_ERROR_CODES = {
    401: ("Unauthorized", "required"), 403: ("AccessDenied", "forbidden"),
    404: ("NoSuchKey", "notFound"), 405: ("MethodNotAllowed", "methodNotAllowed"),
    412: ("PreconditionFailed", "conditionNotMet"),
    416: ("InvalidRange", "requestedRangeNotSatisfiable"),
    500: ("InternalError", "internalError"), 503: ("SlowDown", "backendError"),
}


@dataclasses.dataclass(frozen=True)
class Request:
    """One logged request, appended as its reply starts (before the first
    byte leaves, so a client that has read a reply always finds it logged).

    `start`/`end` are the requested range as sent (`bytes=a-b` -> (a, b + 1),
    `bytes=a-` -> (a, None), `bytes=-n` -> (-n, None), no Range -> (None,
    None)); `bytes_sent` counts the body bytes written (the whole body, or
    what left before a cut, a stop or the client going away: the record is
    corrected then); `process` is the `X-Khd-Process` header as an int;
    `time` is when the request arrived (`time.time()`); `key` is the object
    key it addressed (S3 key without the bucket, GCS object name, Hub file
    name, plain path); `fault` is "status", "auth", "fail" or "cut" when one
    was injected. Uploads: `bytes_received` counts the request body bytes
    read (all of it, or what arrived before an injected cut), `part` is the
    part number of a part upload (S3's `partNumber`, or the `X-Khd-Part`
    header the writers send), `client_host` the address the request came
    from (a process binding its own 127.0.0.x shows here)."""

    method: str
    path: str
    query: str
    start: int | None
    end: int | None
    status: int
    bytes_sent: int
    user_agent: str | None
    process: int | None
    client_port: int
    time: float
    key: str | None = None
    fault: str | None = None
    bytes_received: int = 0
    part: int | None = None
    client_host: str | None = None


class RangeServer:
    """A loopback HTTP/1.1 server of byte ranges with a request log and faults.

    Args:
        objects: `{path: bytes | file path}` served at `/{path}`.
        upstream: proxy every request to this base URL instead.
        flavor: "plain", "s3" or "gcs": how error bodies are worded and how
            `Request.key` is read from the path.
        seed: faults are drawn from a hash of (seed, kind, method, path,
            Range, how many times that same request came before), so they
            do not depend on how threads interleave, and a retry draws anew.
        fail_rate: fraction of the requests (of `fault_methods`) answered
            `fail_status` (503, or 429 for throttling).
        retry_after: if not None, the `Retry-After` header of those answers.
        cut_rate: fraction of faultable bodies cut short. A reply: the
            headers carry the full Content-Length, part of the body follows,
            then the connection closes. An upload (a request with a body):
            part of its body is read, then the connection closes unanswered.
        fail_status: the status of the injected failures.
        fault_parts_only: faults only for part uploads (`Request.part`).
        fault_first_tries: besides the rates, the first N tries of every
            faultable request are faulted (cut where `cut_rate` is set,
            else failed): a fault every request meets, whatever the draws.
        status_for: `path -> int | None`; a status answers the request.
        require_token: if set, `Authorization: Bearer <token>` is required
            (401 without one, 403 with a wrong one; `/lfs-objects/` exempt,
            like the Hub's signed CDN URLs).
        latency_s: added before each response's first byte.
        bytes_per_second_per_connection: bandwidth cap for each connection.
        bytes_per_second_per_address: bandwidth cap for each client address
            (all its connections, both directions: replies sent and request
            bodies read), so processes binding their own 127.0.0.x each get
            their own link (`traffic` measures it).
        lfs_redirect: Hub LFS files answer 302 to `/lfs-objects/<sha256>` on
            `localhost` (another origin, like the Hub's CDN; huggingface_hub
            reads the metadata from the 302 and follows it only to download).
        fault_methods: the methods faults apply to.
        upstream_hook: `(server, method, path, query, headers) -> Reply |
            dict`, run before proxying: a `Reply` answers instead, a dict
            adds response headers; `headers` may be changed in place.

    Every option is also an attribute that a test may change while the
    server runs (`server.fail_rate = 0.3`).
    """

    def __init__(self, objects: Mapping[str, Source] | None = None, *,
                 upstream: str | None = None, flavor: str = "plain", seed: int = 0,
                 fail_rate: float = 0.0, retry_after: float | None = None,
                 cut_rate: float = 0.0, status_for: Callable[[str], int | None] | None = None,
                 require_token: str | None = None, latency_s: float = 0.0,
                 bytes_per_second_per_connection: float | None = None,
                 lfs_redirect: bool = False, fault_methods: tuple = ("GET",),
                 upstream_hook: Callable | None = None, host: str = "127.0.0.1",
                 port: int = 0, fail_status: int = 503, fault_parts_only: bool = False,
                 bytes_per_second_per_address: float | None = None, fault_first_tries: int = 0):
        if flavor not in ("plain", "s3", "gcs"):
            raise ValueError(f"Expected flavor 'plain', 's3' or 'gcs'. Received: {flavor!r}")
        self.upstream = upstream.rstrip("/") if upstream else None
        self.flavor, self.seed = flavor, seed
        self.fail_rate, self.retry_after, self.cut_rate = fail_rate, retry_after, cut_rate
        self.status_for, self.require_token = status_for, require_token
        self.latency_s = latency_s
        self.bytes_per_second_per_connection = bytes_per_second_per_connection
        self.bytes_per_second_per_address = bytes_per_second_per_address
        self.fail_status, self.fault_parts_only = fail_status, fault_parts_only
        self.fault_first_tries = fault_first_tries
        self._address_due: dict[str, float] = {}
        self._traffic: dict[str, list[tuple[float, int]]] = {}
        self.lfs_redirect, self.fault_methods = lfs_redirect, tuple(fault_methods)
        self.upstream_hook = upstream_hook
        self.hub = remote_hub.HubRepos()
        self._lock = threading.Lock()
        self._objects: dict[str, Blob] = {}
        self._versions = 0
        self._log: list[Request] = []
        self._attempts: dict[tuple, int] = {}
        self._stopping = threading.Event()
        self._pool = urllib3.PoolManager(maxsize=64, timeout=urllib3.Timeout(connect=5, read=120))
        self._httpd = _HTTPServer((host, port), self)
        self.host, self.port = self._httpd.server_address[:2]
        self.url = f"http://{self.host}:{self.port}"
        self._thread: threading.Thread | None = None
        for path, source in (objects or {}).items():
            self.put(path, source)

    # Life cycle.
    def start(self) -> "RangeServer":
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05},
            name=f"RangeServer:{self.port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops serving, closes every open connection and joins every thread."""
        self._stopping.set()
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()
        self._httpd.close_connections()
        self._pool.clear()

    def __enter__(self) -> "RangeServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # Objects.
    def put(self, path: str, source: Source) -> Blob:
        """Serves `source` (bytes or a file path) at `/{path}`; a new ETag."""
        with self._lock:
            self._versions += 1
            blob = make_blob(source, version=self._versions)
            self._objects[path.lstrip("/")] = blob
        return blob

    replace = put

    def delete(self, path: str) -> None:
        with self._lock:
            del self._objects[path.lstrip("/")]

    def put_dir(self, local_dir: str, prefix: str = "") -> list[str]:
        """Serves every file under `local_dir` at `/{prefix}/{relative path}`
        (from disk); returns the paths."""
        paths = []
        for path, relative in walk_files(local_dir):
            paths.append(f"{prefix.strip('/')}/{relative}".lstrip("/"))
            self.put(paths[-1], path)
        return paths

    def add_hub_repo(self, repo_id: str, files: Mapping[str, Source], revision: str = "main",
                     commit_sha: str | None = None) -> str:
        """Serves a Hub model repo (see `remote_hub.HubRepos.add`); returns
        the commit sha."""
        return self.hub.add(repo_id, files, revision=revision, commit_sha=commit_sha)

    # The log.
    @property
    def log(self) -> list[Request]:
        with self._lock:
            return list(self._log)

    def requests(self, method: str | None = None, path_prefix: str | None = None,
                 process: int | None = None, *, key: str | None = None,
                 key_prefix: str | None = None, status: int | None = None,
                 host: str | None = None, parts: bool = False) -> list[Request]:
        """The logged requests that match every filter given (`parts`: part
        uploads only)."""
        return [r for r in self.log
                if (method is None or r.method == method)
                and (host is None or r.client_host == host)
                and (not parts or r.part is not None)
                and (path_prefix is None or r.path.startswith(path_prefix))
                and (process is None or r.process == process)
                and (key is None or r.key == key)
                and (key_prefix is None or (r.key or "").startswith(key_prefix))
                and (status is None or r.status == status)]

    def bytes_sent(self, path_prefix: str | None = None, process: int | None = None, *,
                   key: str | None = None, key_prefix: str | None = None,
                   errors: bool = False) -> int:
        """Body bytes sent in 2xx replies (all replies with `errors=True`),
        a cut body counting what left before the cut."""
        return sum(r.bytes_sent for r in self.requests(
            None, path_prefix, process, key=key, key_prefix=key_prefix)
            if errors or r.status < 300)

    def bytes_received(self, process: int | None = None, *, key: str | None = None,
                       key_prefix: str | None = None, host: str | None = None,
                       parts: bool = False, errors: bool = False) -> int:
        """Request body bytes read (uploads) of requests answered 2xx (all
        requests with `errors=True`: faulted and cut ones too)."""
        return sum(r.bytes_received for r in self.requests(
            None, None, process, key=key, key_prefix=key_prefix, host=host, parts=parts)
            if errors or 200 <= r.status < 300)

    def traffic(self, host: str) -> tuple[int, float]:
        """`(bytes, seconds)` that client address `host` moved through this
        server, both directions, between the first and the last piece
        (pieces of at most 256 KiB): its rate as the server saw it."""
        with self._lock:
            flow = list(self._traffic.get(host, ()))
        if not flow:
            return 0, 0.0
        return sum(n for _, n in flow), flow[-1][0] - flow[0][0]

    def clear(self) -> None:
        with self._lock:
            self._log.clear()
            self._attempts.clear()
            self._traffic.clear()

    def upstream_request(self, method: str, path: str, headers: dict | None = None):
        """A request to the upstream, read whole (for `upstream_hook`s)."""
        return self._pool.request(method, self.upstream + path, headers=headers or {},
                                  redirect=False, retries=False)

    # Serving.
    def error(self, status: int, message: str) -> Reply:
        """An error reply worded as the server's flavor words errors."""
        s3_code, gcs_reason = _ERROR_CODES.get(status, ("Error", "error"))
        if self.flavor == "s3":
            body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{s3_code}</Code>'
                    f"<Message>{message}</Message></Error>").encode()
            return Reply.of(status, {"Content-Type": "application/xml"}, body)
        payload = {"error": {"code": status, "message": message,
                             "errors": [{"reason": gcs_reason, "message": message}]}}
        if self.flavor == "plain":
            payload = {"error": message}
        return Reply.of(status, {"Content-Type": "application/json"}, json.dumps(payload).encode())

    def _draw(self, kind: str, method: str, path: str, range_header: str | None) -> float:
        return self._draw_counted(kind, method, path, range_header)[0]

    def _draw_counted(self, kind, method, path, range_header) -> tuple[float, int]:
        key = (kind, method, path, range_header)
        with self._lock:
            count = self._attempts[key] = self._attempts.get(key, 0) + 1
        digest = hashlib.blake2b(repr((self.seed, *key, count)).encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "big") / 2**64, count

    def _hit(self, kind: str, method: str, path: str, range_header: str | None, rate: float) -> bool:
        """Whether this try gets fault `kind` ("fail" or "cut"): drawn at
        `rate`, or it is one of the first `fault_first_tries` tries of the
        request (the cut where a cut rate is set, else the failure)."""
        first = self.fault_first_tries if kind == ("cut" if self.cut_rate else "fail") else 0
        if not rate and not first:
            return False
        value = self._draw(kind, method, path, range_header)  # tests replace `_draw` to force a fault
        with self._lock:
            count = self._attempts.get((kind, method, path, range_header), 0)
        return value < rate or 0 < count <= first

    def _key(self, raw_path: str, path: str, query: str = "") -> str | None:
        hub_key = self.hub.key(raw_path)
        if hub_key is not None:
            return hub_key
        if self.flavor == "s3":
            return path.lstrip("/").partition("/")[2] or None
        if self.flavor == "gcs" and GCS_UPLOAD.match(path):
            return (urllib.parse.parse_qs(query).get("name") or [None])[0]
        if self.flavor == "gcs":
            match = GCS_OBJECT.match(path)
            return match["object"] if match else None
        return path.lstrip("/") or None

    def _reply(self, h, method, raw_path, path, query, body, faultable=True,
               draw_path=None) -> tuple[Reply, str | None]:
        headers, range_header = h.headers, h.headers.get("Range")
        status = self.status_for(path) if self.status_for else None
        if status:
            return self.error(status, f"status_for({path!r}) answered {status}"), "status"
        if self.require_token and not path.startswith("/lfs-objects/"):
            auth = headers.get("Authorization")
            if auth != f"Bearer {self.require_token}":
                reply = self.error(401 if auth is None else 403,
                                   "Expected Authorization: Bearer <token>. Received: "
                                   + ("none" if auth is None else "a wrong token"))
                reply.headers["WWW-Authenticate"] = "Bearer"
                return reply, "auth"
        if faultable and self._hit("fail", method, draw_path or raw_path, range_header, self.fail_rate):
            reply = self.error(self.fail_status, "Injected fault: service unavailable or "
                                                 "throttled, retry")
            if self.retry_after is not None:
                reply.headers["Retry-After"] = f"{self.retry_after:g}"
            return reply, "fail"
        answer = self.hub.route(method, raw_path, query, body,
                                headers.get("Content-Type", ""), self._redirect_base())
        if answer is not None:
            status, hub_headers, payload = answer
            if isinstance(payload, Blob):
                reply = blob_reply(payload, method, headers, self.error)
                reply.headers.update(hub_headers)
                return reply, None
            return Reply.of(status, hub_headers, payload), None
        if self.upstream:
            return self._proxy(h, method, raw_path, path, query, body), None
        if method not in ("GET", "HEAD"):
            return self.error(405, f"{method} is not served here: GET and HEAD only"), None
        with self._lock:
            blob = self._objects.get(path.lstrip("/"))
        if blob is None:
            return self.error(404, f"No object at {path}"), None
        return blob_reply(blob, method, headers, self.error), None

    def _redirect_base(self) -> str | None:
        return f"http://localhost:{self.port}" if self.lfs_redirect else None

    def _proxy(self, h, method, raw_path, path, query, body) -> Reply:
        forward = {k: v for k, v in h.headers.items() if k.lower() not in _HOP_BY_HOP}
        extra = {}
        if self.upstream_hook:
            out = self.upstream_hook(self, method, path, query, forward)
            if isinstance(out, Reply):
                return out
            extra = out or {}
        if body is not None:
            forward = {k: v for k, v in forward.items() if k.lower() != "content-length"}
            forward["Content-Length"] = str(len(body))
        url = self.upstream + raw_path + (f"?{query}" if query else "")
        resp = self._pool.urlopen(method, url, body=body, headers=forward, redirect=False,
                                  retries=False, preload_content=False, decode_content=False)
        headers = {k: v for k, v in resp.headers.items()
                   if k.lower() not in _HOP_BY_HOP | {"content-length", "date", "server"}}
        headers.update(extra)
        length = resp.headers.get("Content-Length")
        if method == "HEAD" or resp.status in (204, 304):
            resp.release_conn()
            return Reply(resp.status, headers, (), int(length or 0))
        if length is None:
            data = resp.read()
            resp.release_conn()
            return Reply.of(resp.status, headers, data)

        def close():
            resp.close()
            resp.release_conn()
        return Reply(resp.status, headers, resp.stream(CHUNK), int(length), close)

    def handle(self, h) -> None:
        """Answers one request on handler `h` and logs it."""
        arrived = time.time()
        split = urllib.parse.urlsplit(h.path)
        raw_path, query, method = split.path, split.query, h.command
        path = urllib.parse.unquote(raw_path)
        range_header = h.headers.get("Range")
        host = h.client_address[0]
        part = _part_number(query, h.headers.get("X-Khd-Part"))
        faultable = method in self.fault_methods and (not self.fault_parts_only or part is not None)
        # Requests with a body differ by their query too (the parts of one S3 object).
        draw_path = raw_path if method in ("GET", "HEAD") else f"{raw_path}?{query}"
        length = int(h.headers.get("Content-Length") or 0)
        upload_cut = None
        if faultable and length and self._hit("cut", method, draw_path, range_header, self.cut_rate):
            upload_cut = int(self._draw("cut-at", method, draw_path, range_header) * length)
        # A proxied upload with nothing to inject goes upstream as it arrives,
        # at the address's pace, as a store takes a body: read whole first, a
        # part reached moto only once the link had carried all of it, and the
        # link idled while moto took the parts handed to it at once.
        streamed = (self.upstream and method in ("PUT", "POST") and length > CHUNK and upload_cut is None
                    and not (self.fail_rate or self.cut_rate or self.fault_first_tries or self.status_for
                             or self.require_token or self.upstream_hook))
        body = _PacedBody(self, h, host, length) if streamed else self._read_body(h, host, upload_cut)
        process = h.headers.get("X-Khd-Process")
        process = int(process) if process and process.strip().lstrip("-").isdigit() else None
        start, end = requested_range(range_header)
        key = self._key(raw_path, path, query)
        common = dict(user_agent=h.headers.get("User-Agent"), process=process,
                      client_port=h.client_address[1], time=arrived, key=key,
                      bytes_received=len(body or b""), part=part, client_host=host)
        if upload_cut is not None:  # the connection closes unanswered
            h.close_connection = True
            with self._lock:
                self._log.append(Request(method, path, query, start, end, 0, 0, fault="cut", **common))
            return
        self._wait(self.latency_s)
        try:
            reply, fault = self._reply(h, method, raw_path, path, query, body, faultable, draw_path)
        except (OSError, urllib3.exceptions.HTTPError) as e:  # the upstream failed
            reply, fault = self.error(502, f"Upstream {self.upstream} failed: {e!r}"), None
        if streamed:
            common["bytes_received"] = body.received
        cut_at = None
        if (faultable and method != "HEAD" and body is None and reply.length and fault is None
                and self._hit("cut", method, raw_path, range_header, self.cut_rate)):
            cut_at = int(self._draw("cut-at", method, raw_path, range_header) * reply.length)
            fault = "cut"
        planned = 0 if method == "HEAD" else reply.length if cut_at is None else cut_at
        record = Request(method, path, query, start, end, reply.status, planned, fault=fault, **common)
        # Logged before the first byte leaves, so a client that has read its
        # reply always finds it in the log; corrected if the body falls short.
        with self._lock:
            self._log.append(record)
        try:
            self._send(h, reply, method, cut_at)
        except (OSError, urllib3.exceptions.HTTPError):
            h.close_connection = True
            with self._lock:
                for i in range(len(self._log) - 1, -1, -1):
                    if self._log[i] is record:
                        self._log[i] = dataclasses.replace(record, bytes_sent=h.khd_sent)
                        break
        finally:
            if reply.close:
                reply.close()

    def _read_body(self, h, host: str, limit: int | None = None) -> bytes | None:
        """The request body (its first `limit` bytes), read at the address's
        pace; a chunked body is read whole, unpaced."""
        length = h.headers.get("Content-Length")
        if length is None:
            return read_body(h)
        total = int(length) if limit is None else limit
        pieces, got = [], 0
        while got < total:
            self._pace(host, min(CHUNK, total - got))
            piece = h.rfile.read(min(CHUNK, total - got))
            if not piece:
                break
            pieces.append(piece)
            got += len(piece)
            self._moved(host, len(piece))
        return b"".join(pieces)

    def _send(self, h, reply: Reply, method: str, cut_at: int | None) -> int:
        h.khd_sent = 0  # read back if sending fails
        h.send_response(reply.status)
        for name, value in reply.headers.items():
            h.send_header(name, value)
        h.send_header("Content-Length", str(reply.length))
        h.end_headers()
        if method == "HEAD":
            return 0
        if cut_at is not None:
            h.close_connection = True
        rates = [r for r in (self.bytes_per_second_per_connection,
                             self.bytes_per_second_per_address) if r]
        step = int(min(CHUNK, max(4096, min(rates) / 50))) if rates else CHUNK
        host = h.client_address[0]
        for chunk in reply.chunks:
            for pos in range(0, len(chunk), step):
                piece = chunk[pos:pos + step]
                if cut_at is not None:
                    piece = piece[:cut_at - h.khd_sent]
                self._throttle(h, len(piece))
                self._pace(host, len(piece))
                h.wfile.write(piece)
                h.khd_sent += len(piece)
                self._moved(host, len(piece))
                if cut_at is not None and h.khd_sent >= cut_at:
                    return h.khd_sent
        return h.khd_sent

    def _throttle(self, h, n: int) -> None:
        """Per-connection pacing: a chunk leaves once the previous ones have
        had their time at the capped rate (a bucket one chunk deep)."""
        rate = self.bytes_per_second_per_connection
        if not rate or not n:
            return
        if self._stopping.is_set():
            raise ConnectionAbortedError("the server is stopping")
        now = time.monotonic()
        due = max(getattr(h, "khd_due", now), now)
        self._wait(due - now)
        h.khd_due = due + n / rate

    def _pace(self, host: str, n: int) -> None:
        """Per-address pacing: `n` bytes of `host` move once its earlier
        ones (on any of its connections) have had their time at the cap."""
        rate = self.bytes_per_second_per_address
        if not rate or not n:
            return
        if self._stopping.is_set():
            raise ConnectionAbortedError("the server is stopping")
        with self._lock:
            now = time.monotonic()
            due = max(self._address_due.get(host, now), now)
            self._address_due[host] = due + n / rate
        self._wait(due - now)

    def _moved(self, host: str, n: int) -> None:
        with self._lock:
            self._traffic.setdefault(host, []).append((time.monotonic(), n))

    def _wait(self, seconds: float) -> None:
        if seconds > 0:
            self._stopping.wait(seconds)


class _PacedBody:
    """A request body read from the client at its address's pace while it
    is sent upstream (`len`: its Content-Length); a client gone mid-body
    fails the upstream request rather than leave it waiting."""

    def __init__(self, server: RangeServer, h, host: str, length: int) -> None:
        self.server, self.h, self.host, self.length = server, h, host, length
        self.received = 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        while self.received < self.length:
            n = min(CHUNK, self.length - self.received)
            self.server._pace(self.host, n)
            piece = self.h.rfile.read(n)
            if not piece:
                raise ConnectionAbortedError(f"the client sent {self.received} of {self.length} bytes")
            self.received += len(piece)
            self.server._moved(self.host, len(piece))
            yield piece


def _part_number(query: str, header: str | None) -> int | None:
    """The part number of a part upload: S3's `partNumber`, or `X-Khd-Part`."""
    value = (urllib.parse.parse_qs(query).get("partNumber") or [header])[0]
    return int(value) if value and value.strip().isdigit() else None


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "RangeServer/1"
    timeout = 60  # an idle keep-alive connection closes after this
    # Headers and body leave in separate writes: without TCP_NODELAY, Nagle
    # and the client's delayed ACK stall each response ~40 ms.
    disable_nagle_algorithm = True

    def _dispatch(self):
        self.server.owner.handle(self)

    do_GET = do_HEAD = do_POST = do_PUT = do_DELETE = do_PATCH = _dispatch

    def log_message(self, *args):  # the request log is `RangeServer.log`
        pass


class _HTTPServer(http.server.ThreadingHTTPServer):
    """Tracks its connections and their threads, so `stop` leaves none."""

    daemon_threads = True
    # socketserver's default listen backlog is 5: a client opening 16
    # connections at once has the rest dropped and retried a second later
    # (the kernel's SYN retransmit), which no object store does.
    request_queue_size = 128

    def __init__(self, address, owner: RangeServer):
        self.owner = owner
        self._live: dict[socket.socket, threading.Thread] = {}
        self._live_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request, client_address):
        thread = threading.Thread(target=self._serve_connection, args=(request, client_address),
                                  name=f"RangeServer:{self.server_address[1]}:conn", daemon=True)
        with self._live_lock:
            self._live[request] = thread
        thread.start()

    def _serve_connection(self, request, client_address):
        try:
            self.process_request_thread(request, client_address)
        finally:
            with self._live_lock:
                self._live.pop(request, None)

    def close_connections(self) -> None:
        with self._live_lock:
            live = dict(self._live)
        for sock in live:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for thread in live.values():
            thread.join(10)


def main(argv: list[str] | None = None) -> None:
    """Serves a directory until SIGINT/SIGTERM; prints one JSON line with the
    URL first, and writes the request log as JSON lines to --log at exit."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--dir", help="the checkpoint directory to serve")
    parser.add_argument("--upstream", help="instead, proxy to this URL (moto, the GCS emulator)")
    parser.add_argument("--flavor", default="plain", choices=["plain", "s3", "gcs"])
    parser.add_argument("--prefix", default="ckpt", help="served at http://HOST:PORT/PREFIX/")
    parser.add_argument("--hub", help="also serve it as the Hub model repo owner/name")
    parser.add_argument("--lfs-redirect", action="store_true")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each response")
    parser.add_argument("--rate", type=float, default=None, help="bytes/s per connection")
    parser.add_argument("--rate-per-address", type=float, default=None,
                        help="bytes/s per client address, both ways (one link per 127.0.0.x)")
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--cut-rate", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--log", help="write the request log here (JSON lines) at exit")
    args = parser.parse_args(argv)
    if not (args.dir or args.upstream):
        parser.error("give --dir or --upstream")
    hook = None
    if args.flavor == "gcs":
        from remote.stores import gcs_semantics
        hook = gcs_semantics
    server = RangeServer(latency_s=args.latency, bytes_per_second_per_connection=args.rate,
                         bytes_per_second_per_address=args.rate_per_address,
                         fail_rate=args.fail_rate, cut_rate=args.cut_rate, seed=args.seed,
                         lfs_redirect=args.lfs_redirect, port=args.port, upstream=args.upstream,
                         flavor=args.flavor, upstream_hook=hook)
    info = {"endpoint": server.url, "url": server.url}
    if args.dir:
        server.put_dir(args.dir, args.prefix)
        info["url"] = f"{server.url}/{args.prefix.strip('/')}"
    if args.hub:
        sha = server.add_hub_repo(args.hub, {rel: path for path, rel in walk_files(args.dir)})
        info.update(hf=f"hf://{args.hub}", hf_sha=sha, HF_ENDPOINT=server.url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with server:
        print(json.dumps(info), flush=True)
        try:
            while not stop.wait(0.5):
                pass
        except KeyboardInterrupt:
            pass
    if args.log:
        with open(args.log, "w") as f:
            for record in server.log:
                f.write(json.dumps(dataclasses.asdict(record)) + "\n")


if __name__ == "__main__":
    main()
