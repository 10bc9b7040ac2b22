"""Writing into GCS: `GcsWriter`, multipart uploads built on `compose`.

GCS's JSON API has no multipart upload, but it has `compose`: an object
made of up to 32 others, in order (composites compose again). Both real GCS
and the gcp-storage-emulator have it, so the protocol is built on it:

- `create_upload(name)` writes a marker object
  `<prefix>/.khd-uploads/<id>/<name>/upload` (what `list_uploads` finds, its
  time the upload's start);
- `upload_part` writes part `k` as the temporary object
  `<prefix>/.khd-uploads/<id>/<name>/<k:05d>` (any process, any order; the
  same number overwrites);
- `complete_upload` composes the parts in order, 32 at a time into
  temporary composites until at most 32 are left, the last compose
  writing `<prefix>/<name>` (the object appears then, whole), and deletes
  the temporaries;
- `abort_upload` deletes them.

Requests are urllib3's (the loader's HTTP stack), retried by urllib3 on
429 / 5xx (with `Retry-After`) and broken connections, bodies streamed
from the caller's buffer and resent whole (`uploads.PartBody`). Endpoint and credentials as the loader's
(`storage.object_stores.GcsStore`): `STORAGE_EMULATOR_HOST` (anonymous),
else `https://storage.googleapis.com` with application-default credentials
(google-auth), read-write scope.

Example:

```python
writer = GcsWriter("gs://my-bucket/presets/tuned")
upload = writer.create_upload("model.weights.h5")
```
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import urllib.parse
from collections.abc import Sequence
from typing import Any

import urllib3

from keras_hub_dist.errors import SaveError
from keras_hub_dist.storage.uploads import ObjectMeta, ObjectWriter, PartBody, Upload

__all__ = ["GcsWriter"]

_UPLOADS = ".khd-uploads"
_MARKER = "upload"
_COMPOSE_MAX = 32
_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"


def _time(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class GcsWriter(ObjectWriter):
    """`gs://bucket/prefix` (see the module doc)."""

    def __init__(self, url: str) -> None:
        self.location = url
        parsed = urllib.parse.urlparse(url)
        self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            self.api = (emulator if "://" in emulator else f"http://{emulator}").rstrip("/")
        else:
            self.api = "https://storage.googleapis.com"
        retries = urllib3.Retry(
            total=8, backoff_factor=0.25, status_forcelist=(429, 500, 502, 503, 504),
            allowed_methods=None, respect_retry_after_header=True, raise_on_status=False,
        )
        self._pool = urllib3.PoolManager(maxsize=32, retries=retries)
        self._credentials: Any = None
        self._note = "none (the emulator at STORAGE_EMULATOR_HOST)" if emulator else "none found: anonymous"
        self._lock = threading.Lock()
        if not emulator:
            try:
                import google.auth

                self._credentials, _ = google.auth.default(scopes=[_SCOPE])
                self._note = f"Google application-default credentials ({type(self._credentials).__name__})"
            except Exception:  # noqa: BLE001 - anonymous, named in any refusal
                self._credentials = None

    def _object(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        headers = dict(extra or {})
        if self._credentials is not None:
            with self._lock:
                if not self._credentials.valid:
                    import google.auth.transport.requests

                    self._credentials.refresh(google.auth.transport.requests.Request())
                headers["Authorization"] = f"Bearer {self._credentials.token}"
        return headers

    def _request(self, method: str, path: str, doing: str, *, body: Any = None,
                 headers: dict[str, str] | None = None, ok: tuple[int, ...] = ()) -> Any:
        url = self.api + path
        try:
            response = self._pool.request(method, url, body=body, headers=self._headers(headers))
        except urllib3.exceptions.HTTPError as e:
            raise SaveError(f"{doing} failed: {method} {url}: {type(e).__name__}: {e}.") from e
        if 200 <= response.status < 300 or response.status in ok:
            return response
        text = (response.data or b"")[:300].decode("utf-8", "replace").strip() or "(no body)"
        hint = (
            f" Credentials used: {self._note}. Grant write access to {self.location}, "
            "or provide other credentials." if response.status in (401, 403) else ""
        )
        raise SaveError(f"{doing} failed: {method} {url} answered HTTP {response.status}: {text}.{hint}")

    def _quoted(self, name: str) -> str:
        return urllib.parse.quote(self._object(name), safe="")

    def check_writable(self) -> None:
        response = self._request("GET", f"/storage/v1/b/{self.bucket}", f"Checking the bucket of {self.location}",
                                 ok=(404,))
        if response.status == 404:
            raise SaveError(
                f"Expected the bucket {self.bucket!r} of {self.location!r} to exist. Received: no "
                "such bucket (HTTP 404). Create it, or check the URL and STORAGE_EMULATOR_HOST."
            )
        if self.prefix:
            found = self._request("GET", f"/storage/v1/b/{self.bucket}/o/{urllib.parse.quote(self.prefix, safe='')}",
                                  f"Looking up {self.location}", ok=(404,))
            if found.status != 404:
                raise SaveError(
                    f"Expected {self.location!r} to be a prefix to write a preset under. Received: "
                    "it is an object (a file). Choose another prefix, or delete the object."
                )
        probe = f".khd-write-probe-{os.urandom(4).hex()}"
        self.put(probe, b"probe")  # not empty: the emulator fails on an empty media upload
        self.delete([probe])

    def list(self, sub: str = "") -> dict[str, ObjectMeta]:
        base = f"{self.prefix}/" if self.prefix else ""
        out, token = {}, None
        while True:
            query = {"prefix": base + sub, **({"pageToken": token} if token else {})}
            page = json.loads(self._request(
                "GET", f"/storage/v1/b/{self.bucket}/o?{urllib.parse.urlencode(query)}", f"Listing {self.location}",
            ).data)
            for item in page.get("items", []):
                out[item["name"][len(base):]] = ObjectMeta(
                    int(item["size"]), str(item.get("generation", "")), _time(item["updated"])
                )
            token = page.get("nextPageToken")
            if not token:
                return out

    def get(self, name: str) -> bytes | None:
        response = self._request(
            "GET", f"/download/storage/v1/b/{self.bucket}/o/{self._quoted(name)}?alt=media",
            f"Reading gs://{self.bucket}/{self._object(name)}", ok=(404,),
        )
        return None if response.status == 404 else bytes(response.data)

    def _insert(self, name: str, data: Any, doing: str) -> dict[str, Any]:
        query = urllib.parse.urlencode({"uploadType": "media", "name": self._object(name)})
        body = PartBody(data)  # streamed from the caller's buffer; urllib3 seeks back to retry
        response = self._request(
            "POST", f"/upload/storage/v1/b/{self.bucket}/o?{query}", doing, body=body,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(body))},
        )
        return json.loads(response.data or b"{}")

    def put(self, name: str, data: bytes) -> None:
        self._insert(name, bytes(data), f"Writing gs://{self.bucket}/{self._object(name)}")

    def delete(self, names: Sequence[str]) -> None:
        for name in names:
            self._request("DELETE", f"/storage/v1/b/{self.bucket}/o/{self._quoted(name)}",
                          f"Deleting gs://{self.bucket}/{self._object(name)}", ok=(404,))

    def _staged(self, upload_id: str, name: str) -> str:
        return f"{_UPLOADS}/{upload_id}/{name}"

    def create_upload(self, name: str) -> str:
        upload_id = os.urandom(12).hex()
        self.put(f"{self._staged(upload_id, name)}/{_MARKER}", b"{}")
        return upload_id

    def upload_part(self, name: str, upload_id: str, number: int, data: Any) -> str:
        meta = self._insert(
            f"{self._staged(upload_id, name)}/{number:05d}", data,
            f"Uploading part {number} ({memoryview(data).nbytes} bytes) of gs://{self.bucket}/{self._object(name)}",
        )
        return str(meta.get("generation", number))

    def _compose(self, sources: list[str], destination: str, name: str) -> None:
        body = json.dumps({"sourceObjects": [{"name": self._object(s)} for s in sources],
                           "destination": {"contentType": "application/octet-stream"}})
        self._request(
            "POST", f"/storage/v1/b/{self.bucket}/o/{self._quoted(destination)}/compose",
            f"Composing {len(sources)} parts into gs://{self.bucket}/{self._object(destination)} (of {name!r})",
            body=body, headers={"Content-Type": "application/json"},
        )

    def complete_upload(self, name: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        staged = self._staged(upload_id, name)
        sources = [f"{staged}/{int(n):05d}" for n, _ in sorted(parts)]
        level = 0
        while len(sources) > _COMPOSE_MAX:
            level += 1
            composites = []
            for i in range(0, len(sources), _COMPOSE_MAX):
                composite = f"{staged}/c{level}-{i // _COMPOSE_MAX:05d}"
                self._compose(sources[i : i + _COMPOSE_MAX], composite, name)
                composites.append(composite)
            sources = composites
        self._compose(sources, name, name)  # the object appears here, whole
        self.abort_upload(name, upload_id)

    def abort_upload(self, name: str, upload_id: str) -> None:
        staged = self._staged(upload_id, name)
        self.delete(list(self.list(staged + "/")))

    def list_uploads(self) -> list[Upload]:
        out = []
        for key, meta in self.list(_UPLOADS + "/").items():
            parts = key.split("/")
            if parts[-1] == _MARKER and len(parts) >= 4:
                out.append(Upload("/".join(parts[2:-1]), parts[1], meta.updated))
        return out
