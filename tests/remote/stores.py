"""S3 (moto) and GCS (gcp-storage-emulator) on loopback, and one checkpoint
served from all four remote places at once.

`MotoS3` runs moto's `ThreadedMotoServer` (the real S3 wire protocol,
kept up to date by a large project); `GcsEmulator` runs
gcp-storage-emulator (the JSON and media APIs of GCS, no JVM or Docker,
unlike fake-gcs-server). `checkpoint_everywhere` uploads a directory to
both, to a Hub repo and to a plain HTTP server, each behind a logging and
fault-injecting `RangeServer` (a proxy for S3 and GCS), and yields one
`Remote` per scheme with its URL, environment and request log.

Example:

```python
with MotoS3() as s3, GcsEmulator() as gcs:
    with checkpoint_everywhere(local_dir, s3=s3, gcs=gcs) as remotes:
        remote = remotes["gs"]  # or "s3", "hf", "http"
        assert remote.get("config.json").status == 200
        remote.bytes_sent("model.weights.h5", process=0)
```

What the emulators do (moto 5.2.5, gcp-storage-emulator 2026.7.19):

- moto: requests need to look SigV4-signed for service `s3`: an unsigned
  GET or HEAD is 403 with an empty body, even in a public-read bucket,
  unless the object itself is public-read; an `Authorization` header that
  is not SigV4 is a 500 (HTML: moto cannot tell the service). The signature
  itself is not checked (any key, secret or region passes). Paths are
  path-style, `{endpoint}/{bucket}/{key}`, through the proxy too (which
  forwards the `Host` header unchanged). Signed: `bytes=a-b`,
  `a-` and `-n` answer 206 with `Content-Range: bytes a-b/size`; a start
  past the end 416 (XML `InvalidRange`); several ranges 200 and the whole
  object. ETag: the quoted MD5 hex (`"md5-N"` after an N-part upload);
  `If-Match` with another ETag is 412 (XML `PreconditionFailed`); missing
  key or bucket 404 (XML `NoSuchKey` / `NoSuchBucket`). Every response
  carries `Connection: close` (werkzeug), so nothing is kept alive behind
  the proxy. Multipart uploads: parts under 5 MiB but the last are refused
  at complete (`EntityTooSmall`), as S3 does; every upload is listed as
  initiated 2010-11-10; a part uploaded after an abort answers 500 (a
  KeyError; S3 answers 404 `NoSuchUpload`); completing a completed upload
  answers 200 again.
- gcp-storage-emulator: a single-threaded HTTP/1.0 server (one request at a
  time, a connection per request). Media download (`/download/storage/v1/
  b/B/o/O?alt=media`, or `/storage/v1/b/B/o/O?alt=media`) honours `bytes=a-b`
  and `a-` (206, `Content-Range`), but ignores `bytes=-n` (200, whole
  object) and answers a start past the end 206 with an empty body and
  `Content-Range: bytes 20000-10239/10240`. It sends no ETag, no
  `Accept-Ranges` and no `x-goog-generation`; ignores `If-Match`,
  `generation=` (serves the live object for any) and `ifGenerationMatch=`;
  HEAD is 501; a 404 has an empty body. Metadata (`/storage/v1/b/B/o/O`):
  `size`, `generation` and `metageneration` as strings; `generation` is the
  upload time in microseconds and changes on each upload; `etag` equals
  `md5Hash` (base64). Listing (`/storage/v1/b/B/o?prefix=`) returns every
  match in one page (`items`, `prefixes`).
  `gcs_semantics`, the GCS proxy's hook, restores GCS's answers for what a
  client relies on: `generation=` of another generation 404,
  `ifGenerationMatch=` of another 412, a suffix range 206, a start past the
  end 416, JSON error bodies, and `ETag` / `X-Goog-Generation` headers on
  media downloads. It costs one metadata request per media GET.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import urllib.parse
import uuid
from typing import Iterator

import urllib3

from remote.servers import GCS_OBJECT, RangeServer, resolve_range, walk_files

AWS_TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1"}


def s3_env(endpoint: str) -> dict[str, str | None]:
    """Environment for S3 at `endpoint` with test credentials (None: unset),
    away from any real AWS configuration of the machine."""
    return {**AWS_TEST_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": None,
            "AWS_SESSION_TOKEN": None, "AWS_SECURITY_TOKEN": None, "AWS_PROFILE": None,
            "AWS_CONFIG_FILE": "/nonexistent/aws-config",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/aws-credentials"}


def gcs_env(endpoint: str) -> dict[str, str | None]:
    return {"STORAGE_EMULATOR_HOST": endpoint, "GOOGLE_CLOUD_PROJECT": "test"}


def sign_s3(method: str, url: str, headers: dict | None = None) -> dict:
    """The headers of `method url` signed with SigV4 (test credentials)."""
    import botocore.auth
    import botocore.awsrequest
    import botocore.credentials

    request = botocore.awsrequest.AWSRequest(method=method, url=url, headers=dict(headers or {}))
    credentials = botocore.credentials.Credentials("testing", "testing")
    botocore.auth.S3SigV4Auth(credentials, "s3", "us-east-1").add_auth(request)
    return dict(request.headers)


class MotoS3:
    """moto's S3 server on 127.0.0.1 (an ephemeral port) as a context manager."""

    def __init__(self):
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint = ""
        self._client = None

    def __enter__(self) -> "MotoS3":
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()
        self._server._server.server_close()  # moto's stop leaves the socket open

    def client(self):
        """A boto3 S3 client of this server (test credentials)."""
        if self._client is None:
            import boto3

            self._client = boto3.client(
                "s3", endpoint_url=self.endpoint, region_name="us-east-1",
                aws_access_key_id="testing", aws_secret_access_key="testing")
        return self._client

    def upload_dir(self, local_dir: str, bucket: str, prefix: str = "",
                   public: bool = False) -> str:
        """Creates `bucket` if needed, uploads every file under `local_dir`
        to `prefix/` (public-read objects with `public`: unsigned GETs then
        work); returns `s3://bucket/prefix`."""
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        extra = {"ACL": "public-read"} if public else None
        for path, relative in walk_files(local_dir):
            client.upload_file(path, bucket, f"{prefix.strip('/')}/{relative}".lstrip("/"),
                               ExtraArgs=extra)
        return f"s3://{bucket}/{prefix.strip('/')}".rstrip("/")

    def create_bucket(self, bucket: str) -> None:
        client = self.client()
        try:
            client.create_bucket(Bucket=bucket)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass

    def list_names(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under `prefix`, straight from moto (no proxy)."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def list_uploads(self, bucket: str) -> list[tuple[str, str]]:
        """(key, upload id) of every unfinished multipart upload."""
        uploads = self.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        return [(u["Key"], u["UploadId"]) for u in uploads]


class GcsEmulator:
    """gcp-storage-emulator on 127.0.0.1 (an ephemeral port), in memory."""

    def __init__(self, default_bucket: str | None = None):
        from gcp_storage_emulator.server import create_server

        logging.getLogger("gcp_storage_emulator").setLevel(logging.WARNING)
        self._server = create_server("127.0.0.1", 0, in_memory=True, default_bucket=default_bucket)
        self.endpoint = ""
        self._pool = urllib3.PoolManager()

    def __enter__(self) -> "GcsEmulator":
        self._server.start()
        port = self._server._api._httpd.server_address[1]  # bound to port 0
        self.endpoint = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop()  # shuts the HTTP server down, but does not join:
        threading.Thread.join(self._server._api, 10)
        self._pool.clear()

    def _call(self, method: str, path: str, body=None, headers=None) -> dict:
        response = self._pool.request(method, self.endpoint + path, body=body,
                                      headers=headers or {})
        if response.status >= 300:
            raise RuntimeError(f"GCS emulator: {method} {path} -> {response.status} "
                               f"{response.data[:200]!r}")
        return json.loads(response.data) if response.data else {}

    def create_bucket(self, bucket: str) -> None:
        existing = self._call("GET", "/storage/v1/b?project=test").get("items", [])
        if bucket not in {b["name"] for b in existing}:
            self._call("POST", "/storage/v1/b?project=test", json.dumps({"name": bucket}),
                       {"Content-Type": "application/json"})

    def upload(self, bucket: str, name: str, data: bytes) -> dict:
        """Uploads one object (media upload); returns its metadata."""
        query = urllib.parse.urlencode({"uploadType": "media", "name": name})
        return self._call("POST", f"/upload/storage/v1/b/{bucket}/o?{query}", data,
                          {"Content-Type": "application/octet-stream"})

    def list_names(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object name under `prefix`, straight from the emulator."""
        query = urllib.parse.urlencode({"prefix": prefix})
        items = self._call("GET", f"/storage/v1/b/{bucket}/o?{query}").get("items") or []
        return sorted(item["name"] for item in items)

    def upload_dir(self, local_dir: str, bucket: str, prefix: str = "") -> str:
        """Like `MotoS3.upload_dir`; returns `gs://bucket/prefix`."""
        self.create_bucket(bucket)
        for path, relative in walk_files(local_dir):
            with open(path, "rb") as f:
                self.upload(bucket, f"{prefix.strip('/')}/{relative}".lstrip("/"), f.read())
        return f"gs://{bucket}/{prefix.strip('/')}".rstrip("/")


def gcs_semantics(server: RangeServer, method: str, path: str, query: str, headers: dict):
    """`RangeServer.upstream_hook` giving the emulator GCS's answers (see
    the module docstring): a `Reply` to answer with, or headers to add."""
    found = GCS_OBJECT.match(path)
    params = urllib.parse.parse_qs(query)
    if method != "GET" or found is None:
        return {}
    bucket, name = found["bucket"], found["object"]
    media = bool(found["media"]) or params.get("alt") == ["media"]
    conditions = {"generation", "ifGenerationMatch", "ifMetagenerationMatch"} & params.keys()
    if not media and not conditions:
        return {}
    response = server.upstream_request(
        "GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")
    if response.status == 404:
        return server.error(404, f"No such object: {bucket}/{name}")
    if response.status != 200:
        return {}
    meta = json.loads(response.data)
    generation, metageneration = meta["generation"], meta["metageneration"]
    if params.get("generation", [generation])[0] != generation:
        return server.error(404, f"No such object: {bucket}/{name}#{params['generation'][0]}"
                                 f" (the live generation is {generation})")
    for param, live in (("ifGenerationMatch", generation), ("ifMetagenerationMatch", metageneration)):
        if params.get(param, [live])[0] != live:
            return server.error(412, f"{param}={params[param][0]} but the object's is {live}")
    extra = {"X-Goog-Generation": generation, "X-Goog-Metageneration": metageneration}
    if not media:
        return extra
    extra.update({"ETag": f'"{meta["etag"]}"', "Accept-Ranges": "bytes",
                  "X-Goog-Stored-Content-Length": meta["size"]})
    range_key = next((k for k in headers if k.lower() == "range"), None)
    if range_key:
        size = int(meta["size"])
        span = resolve_range(headers[range_key], size)
        if span == "unsatisfiable":
            reply = server.error(416, f"Range {headers[range_key]} is past the end ({size} bytes)")
            reply.headers["Content-Range"] = f"bytes */{size}"
            return reply
        if span is None:
            del headers[range_key]
        else:
            headers[range_key] = f"bytes={span[0]}-{span[1] - 1}"
    return extra


@dataclasses.dataclass
class Remote:
    """One checkpoint in one place: `url` for `load_sharded_preset`
    (`pinned_url` names the exact version where the scheme can), the
    `server` in front of it with its log, and the environment the client
    needs (None: unset; the Hub also needs `remote_hub.patch_huggingface_hub`)."""

    scheme: str
    url: str
    pinned_url: str
    server: RangeServer
    prefix: str  # the key prefix of the checkpoint's files in `server.log`
    env: dict
    object_url: str  # `object_url.format(key=...)`: the plain HTTP URL of a file
    bucket: str = ""
    backend: MotoS3 | GcsEmulator | None = None  # the store behind the proxy

    def key(self, filename: str) -> str:
        return self.prefix + filename

    def requests(self, filename: str | None = None, **filters):
        if filename is None:
            return self.server.requests(key_prefix=self.prefix, **filters)
        return self.server.requests(key=self.key(filename), **filters)

    def bytes_sent(self, filename: str | None = None, process: int | None = None) -> int:
        """Body bytes the server sent for one file (or all) of the checkpoint."""
        if filename is None:
            return self.server.bytes_sent(process=process, key_prefix=self.prefix)
        return self.server.bytes_sent(process=process, key=self.key(filename))

    def bytes_received(self, process: int | None = None, *, parts: bool = False) -> int:
        """Request body bytes the server read for the checkpoint's objects
        (uploads; `parts`: part uploads only) in 2xx-answered requests."""
        return self.server.bytes_received(process, key_prefix=self.prefix, parts=parts)

    def stored_keys(self) -> list[str]:
        """Every object in the bucket, asked of the store itself (a writer's
        temporaries and probes too)."""
        return self.backend.list_names(self.bucket)

    def get(self, filename: str, headers: dict | None = None, method: str = "GET"):
        """A plain urllib3 request for one file (SigV4-signed for S3)."""
        url = self.object_url.format(key=urllib.parse.quote(self.key(filename), safe="/"),
                                     quoted_key=urllib.parse.quote(self.key(filename), safe=""))
        headers = dict(headers or {})
        if self.scheme == "s3":
            headers = sign_s3(method, url, headers)
        return urllib3.PoolManager().request(method, url, headers=headers, retries=False)


@contextlib.contextmanager
def empty_remote(scheme: str, *, s3: MotoS3 | None = None, gcs: GcsEmulator | None = None,
                 prefix: str = "preset", upstream_hook=None, **options) -> Iterator[Remote]:
    """A fresh, empty bucket of `scheme` ("s3" or "gs") behind a
    `RangeServer` proxy made with `options` (faults, caps: e.g.
    `fault_methods=("PUT", "POST"), fault_parts_only=True, fail_rate=0.2`),
    as a `Remote` whose `url` (`scheme://bucket/prefix`) is where a save
    writes; `upstream_hook` runs before GCS's own (`gcs_semantics`)."""
    bucket = f"khd-{uuid.uuid4().hex[:12]}"
    prefix = prefix.strip("/")
    url = f"{scheme}://{bucket}/{prefix}".rstrip("/")
    key_prefix = f"{prefix}/" if prefix else ""
    if scheme == "s3":
        s3.create_bucket(bucket)
        with RangeServer(upstream=s3.endpoint, flavor="s3", upstream_hook=upstream_hook,
                         **options) as server:
            yield Remote("s3", url, url, server, key_prefix, s3_env(server.url),
                         f"{server.url}/{bucket}/{{key}}", bucket, s3)
        return
    if scheme != "gs":
        raise ValueError(f"Expected scheme 's3' or 'gs'. Received: {scheme!r}")

    def hook(*args):
        return (upstream_hook and upstream_hook(*args)) or gcs_semantics(*args)

    gcs.create_bucket(bucket)
    with RangeServer(upstream=gcs.endpoint, flavor="gcs", upstream_hook=hook, **options) as server:
        yield Remote("gs", url, url, server, key_prefix, gcs_env(server.url),
                     f"{server.url}/download/storage/v1/b/{bucket}/o/{{quoted_key}}?alt=media",
                     bucket, gcs)


@contextlib.contextmanager
def checkpoint_everywhere(local_dir: str, *, s3: MotoS3 | None, gcs: GcsEmulator | None,
                          schemes=("s3", "gs", "hf", "http"), prefix: str = "ckpt",
                          repo_id: str = "khd-tests/ckpt", bucket: str | None = None,
                          lfs_redirect: bool = False, **faults) -> Iterator[dict[str, Remote]]:
    """Uploads `local_dir` to every scheme in `schemes` and yields
    `{scheme: Remote}`; `faults` are `RangeServer` options for every server
    in front (`fail_rate`, `cut_rate`, `latency_s`, ...). Each call makes a
    fresh bucket, so shared moto/GCS servers keep calls apart."""
    bucket = bucket or f"khd-{uuid.uuid4().hex[:12]}"
    prefix = prefix.strip("/")
    key_prefix = f"{prefix}/" if prefix else ""
    remotes = {}
    with contextlib.ExitStack() as stack:
        if "s3" in schemes:
            url = s3.upload_dir(local_dir, bucket, prefix)
            server = stack.enter_context(RangeServer(upstream=s3.endpoint, flavor="s3", **faults))
            remotes["s3"] = Remote("s3", url, url, server, key_prefix, s3_env(server.url),
                                   f"{server.url}/{bucket}/{{key}}")
        if "gs" in schemes:
            url = gcs.upload_dir(local_dir, bucket, prefix)
            server = stack.enter_context(RangeServer(
                upstream=gcs.endpoint, flavor="gcs", upstream_hook=gcs_semantics, **faults))
            remotes["gs"] = Remote("gs", url, url, server, key_prefix, gcs_env(server.url),
                                   f"{server.url}/download/storage/v1/b/{bucket}/o/{{quoted_key}}?alt=media")
        if "hf" in schemes:
            server = stack.enter_context(RangeServer(lfs_redirect=lfs_redirect, **faults))
            sha = server.add_hub_repo(repo_id, {rel: path for path, rel in walk_files(local_dir)})
            remotes["hf"] = Remote("hf", f"hf://{repo_id}", f"hf://{repo_id}@{sha}", server, "",
                                   {"HF_ENDPOINT": server.url},
                                   f"{server.url}/{repo_id}/resolve/{sha}/{{key}}")
        if "http" in schemes:
            server = stack.enter_context(RangeServer(**faults))
            server.put_dir(local_dir, prefix)
            url = f"{server.url}/{prefix}".rstrip("/")
            remotes["http"] = Remote("http", url, url, server, key_prefix, {}, f"{server.url}/{{key}}")
        yield remotes


def fresh_bucket(server: MotoS3 | GcsEmulator) -> str:
    """The name of a new, empty bucket on `server`."""
    name = f"b-{uuid.uuid4().hex[:10]}"
    server.create_bucket(name)
    return name


def fail_second_part(monkeypatch, writer) -> callable:
    """Makes `writer`'s class fail the second part upload of a save (a
    `SaveError` "injected by the test"); returns the real `upload_part`, to
    put back with `monkeypatch.setattr(type(writer), "upload_part", real)`."""
    from keras_hub_dist import SaveError

    calls = []
    real = type(writer).upload_part

    def upload_part(self, name, upload_id, number, data):
        calls.append(number)
        if len(calls) == 2:
            raise SaveError("injected by the test")
        return real(self, name, upload_id, number, data)

    monkeypatch.setattr(type(writer), "upload_part", upload_part)
    return real
