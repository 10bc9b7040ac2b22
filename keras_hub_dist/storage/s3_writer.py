"""Writing into S3 (and S3-compatible stores): small objects whole, large
ones by S3's own multipart upload.

`S3Writer` implements `writer_base.ObjectWriter` for `s3://bucket/prefix`,
addressed and credentialed as the loader reads it (`object_stores.S3Store`:
`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`, path-style there; botocore's
credential chain, unsigned requests when it finds none).

- The API calls (PutObject, GetObject, ListObjectsV2, DeleteObjects,
  CreateMultipartUpload, CompleteMultipartUpload, AbortMultipartUpload,
  ListMultipartUploads, HeadObject) are botocore's: its serialization,
  parsing, SigV4 signing and retries ("standard" mode, as many tries as the
  client's `RetryPolicy`). They are sent through the `RangeClient`'s
  connections (botocore's `before-send` event), so they leave from its
  `source_address` and carry its `X-Khd-Process`.
- Part bodies (UploadPart) go straight from the caller's buffer: a
  SigV4-signed urllib3 `PUT` of the memoryview (`RangeClient.request`),
  with `x-amz-checksum-crc32` (S3 checks it) and, as botocore does, the
  payload's SHA-256 signed over plain HTTP and `UNSIGNED-PAYLOAD` over
  HTTPS. Measured (`benchmarks/bench_part_upload.py --rounds 3`,
  2026-11-26, moto in its own process on loopback, 2 shared cores; per
  part, median of 5, over 3 rounds): 64 MiB parts, botocore's
  `upload_part` 132-149 ms of client CPU and 454-651 ms wall, this path
  66-69 ms and 330-544 ms; 16 MiB parts, 25-30 ms vs 21 ms of CPU, wall
  the same (76-165 ms, moto's: it hashes and stores every part). Both hash
  the body alike (SHA-256 over HTTP, CRC32); botocore also refuses a
  memoryview (a 16-64 MiB copy into `bytes` per part) and sends the body
  from a file object in 16 KiB reads. A failure that may pass (429 with `Retry-After`, 5xx, a
  connection cut mid-body) is retried by the client's `RetryPolicy`, the
  part re-sent whole from the caller's buffer; S3 keeps the last upload of
  a part number.

Example:

```python
writer = S3Writer("s3://my-bucket/gemma_7b_en")
upload = writer.create_upload("model.weights.h5")
tokens = [(n, writer.upload_part("model.weights.h5", upload, n, view)) for n, view in parts]
writer.complete_upload("model.weights.h5", upload, tokens)
```
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import socket
import threading
import urllib.parse
import uuid
import xml.etree.ElementTree as ElementTree
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import urllib3

from keras_hub_dist.errors import PresetError, SaveError
from keras_hub_dist.storage import writer_base
from keras_hub_dist.storage.object_stores import S3Store
from keras_hub_dist.storage.ranged_http import RangeClient
from keras_hub_dist.storage.redaction import redact
from keras_hub_dist.storage.writer_base import ObjectMeta, ObjectWriter, Upload

__all__ = ["S3Writer"]

_PERMISSIONS = ("s3:PutObject, s3:GetObject, s3:DeleteObject, s3:ListBucket, "
                "s3:AbortMultipartUpload and s3:ListBucketMultipartUploads")
_HOW = "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role"
_DELETE_BATCH = 1000  # DeleteObjects' limit


_data_loader: Any = None
_data_loader_lock = threading.Lock()


def _botocore_session() -> Any:
    """A new botocore session, as `botocore.session.get_session()` gives
    (credentials and configuration read afresh), sharing one data loader
    per process: the loader keeps the parsed service models, which every
    fresh session otherwise parses again (S3's and the endpoints' JSON:
    0.07-0.09 -> 0.015 CPU-s per client, `benchmarks/bench_s3_client.py`;
    21 s of the test suite's py-spy samples were this parsing)."""
    import botocore.session

    global _data_loader
    session = botocore.session.get_session()
    with _data_loader_lock:
        if _data_loader is None:
            _data_loader = session.get_component("data_loader")
        else:
            session.register_component("data_loader", _data_loader)
    return session


class S3Writer(ObjectWriter):
    """`s3://bucket/prefix` for writing; see the module doc."""

    def __init__(self, location: str, client: RangeClient | None = None) -> None:
        super().__init__(client)
        try:
            import botocore.config
            import botocore.session
        except ImportError as e:
            self.close()
            raise SaveError(
                f"Expected botocore to write {location} (S3's multipart upload). Received: it "
                "is not installed. pip install 'keras-hub-dist[remote]'."
            ) from e
        self.location = location
        self.store = S3Store(location, self.client)
        self.bucket, self.prefix = self.store.bucket, self.store.prefix
        self.endpoint = self.store.endpoint
        session = _botocore_session()
        self._credentials = session.get_credentials()
        retry = self.client.retry
        config = botocore.config.Config(
            region_name=self.store.region,
            signature_version=None if self._credentials else botocore.UNSIGNED,
            s3={"addressing_style": "path" if self.endpoint else "virtual"},
            retries={"mode": "standard", "total_max_attempts": retry.attempts},
            connect_timeout=retry.connect_timeout_s,
            read_timeout=retry.read_timeout_s,
        )
        self.s3 = session.create_client("s3", endpoint_url=self.endpoint, config=config)
        self.s3.meta.events.register("before-send.s3", self._send)

    # -- botocore's requests through the client's connections ------------

    def _send(self, request: Any, **_: Any) -> Any:
        """botocore's `before-send`: the request sent by this writer's
        `RangeClient`, failures as botocore's own (so it retries them)."""
        from botocore import exceptions
        from botocore.awsrequest import AWSResponse

        chunked = "chunked" in str(request.headers.get("Transfer-Encoding", "")).lower()
        try:
            raw = self.client.send_once(request.method, request.url, request.headers,
                                        request.body, chunked=chunked)
            response = AWSResponse(request.url, raw.status, raw.headers, raw)
            if not request.stream_output:
                response.content  # noqa: B018  (reads and releases the connection)
            return response
        except (urllib3.exceptions.NewConnectionError, socket.gaierror) as e:
            raise exceptions.EndpointConnectionError(endpoint_url=request.url, error=e) from e
        except urllib3.exceptions.ConnectTimeoutError as e:
            raise exceptions.ConnectTimeoutError(endpoint_url=request.url, error=e) from e
        except urllib3.exceptions.ReadTimeoutError as e:
            raise exceptions.ReadTimeoutError(endpoint_url=request.url, error=e) from e
        except (urllib3.exceptions.ProtocolError, OSError) as e:
            raise exceptions.ConnectionClosedError(error=e, request=request,
                                                   endpoint_url=request.url) from e
        except urllib3.exceptions.HTTPError as e:
            raise exceptions.HTTPClientError(error=e) from e

    def _call(self, operation: str, what: str, **params: Any) -> Any:
        """botocore's `operation`; its failures as `SaveError`s naming `what`."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return getattr(self.s3, operation)(Bucket=self.bucket, **params)
        except ClientError as e:
            raise _ClientFailure(e) from e
        except BotoCoreError as e:
            raise SaveError(
                f"{operation} of {what} failed after {self.client.retry.attempts} tries: {redact(e)}. "
                f"Expected the S3 endpoint ({self.endpoint or 'AWS'}) to answer. Check "
                "AWS_ENDPOINT_URL and the network, or retry later."
            ) from e

    def _failed(self, failure: _ClientFailure, operation: str, what: str) -> SaveError:
        if failure.status in (401, 403):
            return writer_base.refused(self, f"{operation} of {what}", failure.describe(),
                                       self.store.credential_source(), _PERMISSIONS, _HOW)
        if failure.code == "NoSuchBucket":
            return writer_base.missing_bucket(self, self.endpoint or "AWS",
                                              f"aws s3 mb s3://{self.bucket}")
        return SaveError(
            f"{operation} of {what} answered {failure.describe()}. Expected S3 to accept it; "
            "see the message above for what it refused."
        )

    # -- small objects ------------------------------------------------------

    def check_writable(self) -> None:
        if self.prefix:
            try:
                head = self._call("head_object", self.location, Key=self.prefix)
                raise writer_base.prefix_is_object(self, int(head["ContentLength"]))
            except _ClientFailure as failure:
                if failure.status not in (403, 404):  # 403: no read access; the probe tells
                    raise self._failed(failure, "HeadObject", self.location) from failure
        probe = f"{writer_base.RESERVED}/probe-{uuid.uuid4().hex}"
        steps = [
            ("PutObject", "put_object", dict(Key=self.key(probe), Body=b"")),
            ("DeleteObject", "delete_object", dict(Key=self.key(probe))),
            ("ListObjectsV2", "list_objects_v2", dict(Prefix=self.key(""), MaxKeys=1)),
            ("ListMultipartUploads", "list_multipart_uploads", dict(Prefix=self.key(""), MaxUploads=1)),
        ]
        for operation, method, params in steps:
            what = self.where(probe) if "Key" in params else self.location
            try:
                self._call(method, what, **params)
            except _ClientFailure as failure:
                raise self._failed(failure, operation, what) from failure

    def get(self, name: str) -> bytes | None:
        try:
            return self._call("get_object", self.where(name), Key=self.key(name))["Body"].read()
        except _ClientFailure as failure:
            if failure.code in ("NoSuchKey", "404"):
                return None
            raise self._failed(failure, "GetObject", self.where(name)) from failure

    def put(self, name: str, data: Any) -> None:
        name = self.checked_name(name)
        body = bytes(writer_base.byte_view(data))
        try:
            self._call("put_object", self.where(name), Key=self.key(name), Body=body)
        except _ClientFailure as failure:
            raise self._failed(failure, "PutObject", self.where(name)) from failure

    def list(self, sub: str = "") -> dict[str, ObjectMeta]:
        found, token = {}, None
        while True:
            params = {"Prefix": self.key(sub)} | ({"ContinuationToken": token} if token else {})
            try:
                page = self._call("list_objects_v2", self.location, **params)
            except _ClientFailure as failure:
                raise self._failed(failure, "ListObjectsV2", self.location) from failure
            for item in page.get("Contents", []):
                name = self.relative(item["Key"])
                if self.prefix and not item["Key"].startswith(self.prefix + "/"):
                    continue  # `prefix` itself, or `prefix-other/...`
                if name != writer_base.RESERVED and not name.startswith(writer_base.RESERVED + "/"):
                    found[name] = ObjectMeta(int(item["Size"]), item["ETag"],
                                             item["LastModified"].timestamp())
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return found

    def delete(self, names: Iterable[str]) -> None:
        keys = [self.key(name) for name in names]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = [{"Key": key} for key in keys[start:start + _DELETE_BATCH]]
            try:
                answer = self._call("delete_objects", self.location,
                                    Delete={"Objects": batch, "Quiet": True})
            except _ClientFailure as failure:
                raise self._failed(failure, "DeleteObjects", self.location) from failure
            errors = [e for e in answer.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                listed = ", ".join(f"{e.get('Key')} ({e.get('Code')}: {e.get('Message')})"
                                   for e in errors[:5])
                raise SaveError(
                    f"Deleting {len(errors)} objects of {self.location} failed: {listed}. "
                    f"Expected permission to delete them. Credentials used: "
                    f"{self.store.credential_source()}."
                )

    # -- multipart uploads --------------------------------------------------

    def create_upload(self, name: str) -> str:
        name = self.checked_name(name)
        try:
            answer = self._call("create_multipart_upload", self.where(name), Key=self.key(name),
                                ContentType="application/octet-stream")
        except _ClientFailure as failure:
            raise self._failed(failure, "CreateMultipartUpload", self.where(name)) from failure
        return answer["UploadId"]

    def upload_part(self, name: str, upload_id: str, number: int, data: Any) -> str:
        view = writer_base.byte_view(data)
        writer_base.check_part(self, name, number, view.nbytes)
        query = urllib.parse.urlencode({"partNumber": number, "uploadId": upload_id})
        url = f"{self.store.url(name)}?{query}"
        crc = base64.b64encode(zlib.crc32(view).to_bytes(4, "big")).decode()
        headers = {"x-amz-checksum-crc32": crc, "X-Khd-Part": str(number),
                   "Content-Type": "application/octet-stream"}
        signer = _BodySigner(self, view)
        where = (f"part {number} ({view.nbytes} bytes) of upload {upload_id} of "
                 f"{self.where(name)} ({url})")
        try:
            response = self.client.request("PUT", url, signer, headers, body=view)
        except PresetError as e:  # what the client's retries could not pass
            raise SaveError(f"Uploading {redact(where)} failed: {e}") from None
        if response.status == 200:
            return response.headers["ETag"]
        failure = _ClientFailure.of_response(response)
        if failure.code == "NoSuchUpload":
            raise writer_base.no_upload(self, name, upload_id, f"upload part {number} into")
        raise self._failed(failure, "UploadPart", redact(where))

    def complete_upload(self, name: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        parts = writer_base.check_parts(self, name, parts)
        listed = [{"PartNumber": n, "ETag": token} for n, token in parts]
        try:
            self._call("complete_multipart_upload", self.where(name), Key=self.key(name),
                       UploadId=upload_id, MultipartUpload={"Parts": listed})
        except _ClientFailure as failure:
            if failure.code == "NoSuchUpload" and self._completed(name, parts):
                return  # an earlier try completed it; its answer was lost
            if failure.code == "NoSuchUpload":
                raise writer_base.no_upload(self, name, upload_id, "complete") from failure
            if failure.code in ("InvalidPart", "InvalidPartOrder", "EntityTooSmall"):
                raise SaveError(
                    f"Completing {self.where(name)} from {len(parts)} parts was refused: "
                    f"{failure.describe()}. Expected every part uploaded with the token "
                    f"given, and every part but the last of at least {self.MIN_PART} bytes."
                ) from failure
            raise self._failed(failure, "CompleteMultipartUpload", self.where(name)) from failure

    def _completed(self, name: str, parts: list[tuple[int, str]]) -> bool:
        """Whether object `name` is these parts: its multipart ETag is the
        MD5 of the parts' MD5s and their count."""
        try:
            head = self._call("head_object", self.where(name), Key=self.key(name))
            digests = b"".join(binascii.unhexlify(token.strip('"')) for _, token in parts)
        except (_ClientFailure, binascii.Error, ValueError):
            return False
        return head.get("ETag", "").strip('"') == f"{hashlib.md5(digests).hexdigest()}-{len(parts)}"

    def abort_upload(self, name: str, upload_id: str) -> None:
        try:
            self._call("abort_multipart_upload", self.where(name), Key=self.key(name),
                       UploadId=upload_id)
        except _ClientFailure as failure:
            if failure.code not in ("NoSuchUpload", "404"):
                raise self._failed(failure, "AbortMultipartUpload", self.where(name)) from failure

    def list_uploads(self) -> list[Upload]:
        found, markers = [], {}
        while True:
            try:
                page = self._call("list_multipart_uploads", self.location,
                                  Prefix=self.key(""), **markers)
            except _ClientFailure as failure:
                raise self._failed(failure, "ListMultipartUploads", self.location) from failure
            found += [Upload(self.relative(u["Key"]), u["UploadId"], u["Initiated"].timestamp())
                      for u in page.get("Uploads", [])]
            if not page.get("IsTruncated"):
                return sorted(found, key=lambda u: (u.initiated, u.name))
            markers = {"KeyMarker": page["NextKeyMarker"],
                       "UploadIdMarker": page["NextUploadIdMarker"]}


class _ClientFailure(Exception):
    """A request S3 answered with an error: its status, code and message."""

    def __init__(self, error: Any = None, status: int = 0, code: str = "", message: str = "") -> None:
        if error is not None:
            info = error.response.get("Error", {})
            status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code, message = info.get("Code", str(status)), info.get("Message", "")
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = int(status or 0), str(code), message or ""

    @classmethod
    def of_response(cls, response: Any) -> _ClientFailure:
        code, message = str(response.status), ""
        try:
            root = ElementTree.fromstring(response.data or b"")
            code = root.findtext("Code") or code
            message = root.findtext("Message") or ""
        except ElementTree.ParseError:
            message = (response.data or b"")[:200].decode("utf-8", "replace")
        return cls(status=response.status, code=code, message=message)

    def describe(self) -> str:
        return redact(f"HTTP {self.status} {self.code}" + (f" ({self.message})" if self.message else ""))


class _BodySigner:
    """SigV4 headers of one part upload, its body hashed as botocore does:
    SHA-256 over plain HTTP, `UNSIGNED-PAYLOAD` with the CRC32 over HTTPS."""

    def __init__(self, writer: S3Writer, body: memoryview) -> None:
        self.writer, self.body = writer, body

    def headers(self, method: str, url: str, headers: Mapping[str, str]) -> dict[str, str]:
        credentials = self.writer._credentials
        if credentials is None:
            return {}
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method=method, url=url, headers=dict(headers), data=self.body)
        request.context["checksum"] = {
            "request_algorithm": {"in": "header", "name": "x-amz-checksum-crc32"}}
        request.context["has_streaming_input"] = True
        S3SigV4Auth(credentials.get_frozen_credentials(), "s3", self.writer.store.region).add_auth(request)
        return {k: v for k, v in request.headers.items() if k not in headers and k != "Content-Length"}

    def credential_source(self) -> str:
        return self.writer.store.credential_source()
