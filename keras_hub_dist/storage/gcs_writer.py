"""Writing into GCS: small objects whole, large ones by a multipart upload
made of GCS's `compose`.

`GcsWriter` implements `writer_base.ObjectWriter` for `gs://bucket/prefix`
through GCS's JSON API, addressed and credentialed as the loader reads it
(`object_stores.GcsStore`: `STORAGE_EMULATOR_HOST` or
`https://storage.googleapis.com`; application-default credentials through
google-auth, here with the `devstorage.read_write` scope; anonymous for the
emulator). Every request goes through the `RangeClient` (its connections,
source address, `X-Khd-Process` and `RetryPolicy`); bodies are sent from
the caller's memory.

Real GCS also speaks S3's multipart protocol in its XML API, but the
emulator the tests run against (gcp-storage-emulator) does not; both have
`compose` (1 to 32 source objects of one bucket into one object; composites
compose again). So a multipart upload here is:

- `create_upload`: a marker object
  `<prefix>/.khd-uploads/<upload_id>/<name>/upload` (its creation time is
  the upload's);
- `upload_part`: the part as a temporary object
  `<prefix>/.khd-uploads/<upload_id>/<name>/<number, 5 digits>` (a retry
  or a second upload of a number replaces it; the token is its
  generation); then the marker is checked, so a part that lands after an
  abort is deleted again and refused, as S3 refuses it;
- `complete_upload`: the upload's folder is listed once (every part there,
  of the generation given, every part but the last at least `MIN_PART`
  bytes, as on S3), the parts composed 32 at a time into temporary
  composites (`.../c<level>-<index>`), those again, until one compose of at
  most 32 writes `<prefix>/<name>`: the object appears only at that last
  compose, whole. Then the temporaries are deleted (batched, 100 per
  request), the marker last;
- `abort_upload`: the marker deleted first, then everything of the upload;
- `list_uploads`: the upload ids under `<prefix>/.khd-uploads/`.

`MIN_PART` is S3's 5 MiB: compose needs none, but one plan of parts then
fits both stores, and smaller parts spend more requests (each part is an
upload, a check and a delete) for no speed. Real GCS bills a deleted
temporary under the bucket's soft-delete policy (7 days by default) as if
it were still stored: a save's parts cost a week of one more copy of its
weights unless the bucket's soft delete is off.

Example:

```python
writer = GcsWriter("gs://my-bucket/gemma_7b_en")
upload = writer.create_upload("model.weights.h5")
tokens = [(n, writer.upload_part("model.weights.h5", upload, n, view)) for n, view in parts]
writer.complete_upload("model.weights.h5", upload, tokens)
```
"""

from __future__ import annotations

import json
import re
import time
import urllib.parse
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from keras_hub_dist.errors import PresetError, SaveError
from keras_hub_dist.storage import writer_base
from keras_hub_dist.storage.object_stores import GcsStore
from keras_hub_dist.storage.ranged_http import RangeClient
from keras_hub_dist.storage.redaction import redact
from keras_hub_dist.storage.writer_base import RESERVED, ObjectMeta, ObjectWriter, Upload

__all__ = ["COMPOSE_LIMIT", "GcsWriter"]

COMPOSE_LIMIT = 32  # source objects of one compose
_BATCH_LIMIT = 100  # calls of one batch request
_MARKER = "upload"
_PERMISSIONS = "storage.objects.create, .get, .delete and .list (roles/storage.objectAdmin)"
_HOW = ("GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`, or the "
        "VM's service account with the read-write storage scope")
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] (\d{3})")


class _ReadWriteStore(GcsStore):
    scope = "https://www.googleapis.com/auth/devstorage.read_write"


class GcsWriter(ObjectWriter):
    """`gs://bucket/prefix` for writing; see the module doc."""

    def __init__(self, location: str, client: RangeClient | None = None) -> None:
        super().__init__(client)
        self.location = location
        self.store = _ReadWriteStore(location, self.client)
        self.bucket, self.prefix = self.store.bucket, self.store.prefix
        self.api = self.store.api

    # -- requests -----------------------------------------------------------

    def _object_url(self, key: str, suffix: str = "") -> str:
        return f"{self.api}/storage/v1/b/{self.bucket}/o/{urllib.parse.quote(key, safe='')}{suffix}"

    def _request(self, method: str, url: str, what: str, body: Any = None,
                 headers: dict[str, str] | None = None) -> Any:
        """One request (retried by the client); 401 / 403 and what the
        retries could not pass as `SaveError`s naming `what` (the request
        in words: "uploading part 3 (...) of upload ... of gs://...")."""
        try:
            response = self.client.request(method, url, self.store, headers, body=body)
        except PresetError as e:
            raise SaveError(f"{_capital(redact(what))} failed: {e}") from None
        if response.status in (401, 403):
            raise writer_base.refused(self, what, _describe(response),
                                      self.store.credential_source(), _PERMISSIONS, _HOW)
        return response

    def _fail(self, response: Any, what: str) -> SaveError:
        return SaveError(
            f"{_capital(what)} answered {_describe(response)}. Expected GCS ({self.api}) to "
            "accept it."
        )

    def _upload(self, key: str, view: memoryview, what: str, headers: dict[str, str] | None = None) -> dict:
        query = urllib.parse.urlencode({"uploadType": "media", "name": key})
        url = f"{self.api}/upload/storage/v1/b/{self.bucket}/o?{query}"
        response = self._request("POST", url, what, body=view,
                                 headers={"Content-Type": "application/octet-stream", **(headers or {})})
        if response.status == 404:
            raise writer_base.missing_bucket(self, self.api, f"gcloud storage buckets create gs://{self.bucket}")
        if response.status != 200:
            raise self._fail(response, what)
        meta = json.loads(response.data)
        if int(meta.get("size", -1)) != view.nbytes:
            raise SaveError(
                f"{_capital(what)} stored {meta.get('size')} bytes. Expected {view.nbytes}: the "
                "upload was cut; the save can be started again."
            )
        return meta

    def _meta(self, key: str, what: str) -> dict | None:
        response = self._request("GET", self._object_url(key), what)
        if response.status == 404:
            return None
        if response.status != 200:
            raise self._fail(response, what)
        return json.loads(response.data)

    def _list_keys(self, prefix: str, what: str, limit: int | None = None) -> list[dict]:
        items, token = [], None
        while True:
            query = {"prefix": prefix} | ({"pageToken": token} if token else {})
            query |= {"maxResults": limit} if limit else {}
            url = f"{self.api}/storage/v1/b/{self.bucket}/o?{urllib.parse.urlencode(query)}"
            response = self._request("GET", url, what)
            if response.status == 404:
                raise writer_base.missing_bucket(self, self.api, f"gcloud storage buckets create gs://{self.bucket}")
            if response.status != 200:
                raise self._fail(response, what)
            page = json.loads(response.data)
            items += page.get("items") or []
            token = page.get("nextPageToken")
            if not token or limit:
                return items

    def _delete_keys(self, keys: list[str], what: str) -> None:
        """Deletes `keys`, 100 per batch request; missing ones are fine;
        calls answered 429 / 5xx are sent again."""
        retry = self.client.retry
        for start in range(0, len(keys), _BATCH_LIMIT):
            pending = keys[start:start + _BATCH_LIMIT]
            for attempt in range(retry.attempts):
                if attempt:
                    time.sleep(retry.delay(attempt - 1))
                statuses = self._batch_delete(pending, what)
                refused = [k for k, s in zip(pending, statuses) if s in (401, 403)]
                if refused:
                    raise writer_base.refused(
                        self, f"{what}: deleting {len(refused)} objects such as "
                        f"gs://{self.bucket}/{refused[0]}", "HTTP 403",
                        self.store.credential_source(), _PERMISSIONS, _HOW)
                failed = [(k, s) for k, s in zip(pending, statuses) if s >= 300 and s != 404]
                pending = [k for k, s in failed if s == 429 or s >= 500]
                if len(pending) < len(failed):
                    key, status = next((k, s) for k, s in failed if k not in pending)
                    raise SaveError(f"{_capital(what)}: deleting gs://{self.bucket}/{key} answered HTTP "
                                    f"{status}. Expected GCS to delete it.")
                if not pending:
                    break
            else:
                raise SaveError(
                    f"{_capital(what)}: {len(pending)} objects such as gs://{self.bucket}/{pending[0]} could "
                    f"not be deleted in {retry.attempts} tries (HTTP 429 / 5xx). Expected GCS "
                    "to delete them; retry later."
                )

    def _batch_delete(self, keys: list[str], what: str) -> list[int]:
        """One batch request of DELETEs; the status of each, in order."""
        if len(keys) == 1:  # no batch for one
            return [self._request("DELETE", self._object_url(keys[0]), what).status]
        boundary = f"khd-{uuid.uuid4().hex}"
        parts = [
            f"--{boundary}\r\nContent-Type: application/http\r\nContent-ID: <{i + 1}>\r\n\r\n"
            f"DELETE /storage/v1/b/{self.bucket}/o/{urllib.parse.quote(key, safe='')} HTTP/1.1\r\n\r\n"
            for i, key in enumerate(keys)
        ]
        body = ("".join(parts) + f"--{boundary}--\r\n").encode()
        response = self._request("POST", f"{self.api}/batch/storage/v1", what, body=body,
                                 headers={"Content-Type": f"multipart/mixed; boundary={boundary}"})
        if response.status != 200:
            raise self._fail(response, what)
        statuses = [int(m) for m in _STATUS_LINE.findall(response.data or b"")]
        if len(statuses) != len(keys):
            raise SaveError(f"{_capital(what)}: the batch of {len(keys)} deletions answered "
                            f"{len(statuses)} statuses. Expected one per deletion.")
        return statuses

    # -- small objects ------------------------------------------------------

    def check_writable(self) -> None:
        if self.prefix:
            meta = self._meta(self.prefix, f"reading the object gs://{self.bucket}/{self.prefix}")
            if meta is not None:
                raise writer_base.prefix_is_object(self, int(meta.get("size", 0)))
        probe = self.key(f"{RESERVED}/probe-{uuid.uuid4().hex}")
        what = f"the write probe gs://{self.bucket}/{probe}"
        self._upload(probe, memoryview(b"khd"), f"uploading {what}")
        self._delete_keys([probe], f"deleting {what}")
        self._list_keys(self.key(""), f"listing {self.location}", limit=1)

    def get(self, name: str) -> bytes | None:
        url = f"{self._object_url(self.key(name))}?alt=media"
        response = self._request("GET", url, f"reading {self.where(name)}")
        if response.status == 404:
            return None
        if response.status != 200:
            raise self._fail(response, f"reading {self.where(name)}")
        return bytes(response.data)

    def put(self, name: str, data: Any) -> None:
        name = self.checked_name(name)
        self._upload(self.key(name), writer_base.byte_view(data), f"uploading {self.where(name)}")

    def list(self, sub: str = "") -> dict[str, ObjectMeta]:
        found = {}
        for item in self._list_keys(self.key(sub), f"listing {self.location}"):
            if self.prefix and not item["name"].startswith(self.prefix + "/"):
                continue
            name = self.relative(item["name"])
            if name != RESERVED and not name.startswith(RESERVED + "/"):
                found[name] = _meta_of(item)
        return found

    def delete(self, names: Iterable[str]) -> None:
        self._delete_keys([self.key(n) for n in names], f"deleting objects of {self.location}")

    # -- multipart uploads --------------------------------------------------

    def _folder(self, upload_id: str, name: str | None = None) -> str:
        if not re.fullmatch(r"[0-9a-f]{32}", str(upload_id)):
            raise SaveError(f"Expected an upload id of {self.location} (32 hex digits, from "
                            f"create_upload). Received: {upload_id!r}.")
        base = self.key(f"{RESERVED}/{upload_id}/")
        return base + f"{name}/" if name is not None else base

    def create_upload(self, name: str) -> str:
        name = self.checked_name(name)
        upload_id = uuid.uuid4().hex
        self._upload(self._folder(upload_id, name) + _MARKER, memoryview(b"{}"),
                     f"starting an upload of {self.where(name)}")
        return upload_id

    def upload_part(self, name: str, upload_id: str, number: int, data: Any) -> str:
        view = writer_base.byte_view(data)
        writer_base.check_part(self, name, number, view.nbytes)
        folder = self._folder(upload_id, name)
        what = f"uploading part {number} ({view.nbytes} bytes) of upload {upload_id} of {self.where(name)}"
        meta = self._upload(f"{folder}{number:05d}", view, what, {"X-Khd-Part": str(number)})
        if self._meta(folder + _MARKER, what) is None:  # aborted meanwhile: leave nothing
            self._delete_keys([f"{folder}{number:05d}"], what)
            raise writer_base.no_upload(self, name, upload_id, f"upload part {number} into")
        return str(meta["generation"])

    def complete_upload(self, name: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        parts = writer_base.check_parts(self, name, parts)
        folder = self._folder(upload_id, name)
        what = f"completing upload {upload_id} of {self.where(name)}"
        stored = {item["name"][len(folder):]: item for item in self._list_keys(folder, what)}
        if _MARKER not in stored:
            raise writer_base.no_upload(self, name, upload_id, "complete")
        sources = []
        for i, (number, token) in enumerate(parts):
            item = stored.get(f"{number:05d}")
            if item is None or str(item["generation"]) != token:
                found = "none" if item is None else f"generation {item['generation']}"
                raise SaveError(
                    f"{_capital(what)}: part {number} is not the one uploaded with token {token!r} "
                    f"(stored: {found}). Expected every part uploaded, and not again since."
                )
            if i < len(parts) - 1 and int(item["size"]) < self.MIN_PART:
                raise SaveError(
                    f"{_capital(what)}: part {number} holds {item['size']} bytes. Expected at least "
                    f"{self.MIN_PART} bytes in every part but the last (as S3 asks)."
                )
            sources.append((item["name"], str(item["generation"])))
        composites, level = [], 0
        while len(sources) > COMPOSE_LIMIT:  # a tree of composes, 32 at a time
            level += 1
            groups = [sources[i:i + COMPOSE_LIMIT] for i in range(0, len(sources), COMPOSE_LIMIT)]
            targets = [f"{folder}c{level}-{i:05d}" for i in range(len(groups))]
            composites += targets
            versions: list[str] = [""] * len(groups)

            def compose(i: int) -> None:
                versions[i] = self._compose(groups[i], targets[i], what)

            self.client.run_all([lambda i=i: compose(i) for i in range(len(groups))])
            sources = list(zip(targets, versions))
        self._compose(sources, self.key(name), what)  # the object appears here, whole
        temporaries = [key for key in stored if key != _MARKER]
        self._delete_keys([folder + key for key in temporaries] + composites, what)
        self._delete_keys([folder + _MARKER], what)

    def _compose(self, sources: list[tuple[str, str]], target: str, what: str) -> str:
        body = json.dumps({
            "kind": "storage#composeRequest",
            "sourceObjects": [{"name": key, "generation": gen} for key, gen in sources],
            "destination": {"contentType": "application/octet-stream"},
        }).encode()
        response = self._request("POST", self._object_url(target, "/compose"), what, body=body,
                                 headers={"Content-Type": "application/json"})
        if response.status in (404, 412):
            raise SaveError(f"{_capital(what)}: composing {len(sources)} objects into gs://{self.bucket}/"
                            f"{target} answered {_describe(response)}. Expected every part of the "
                            "upload still there (was it aborted meanwhile?).")
        if response.status != 200:
            raise self._fail(response, what)
        return str(json.loads(response.data)["generation"])

    def abort_upload(self, name: str, upload_id: str) -> None:
        folder = self._folder(upload_id)
        what = f"aborting upload {upload_id} of {self.where(name)}"
        self._delete_keys([f"{self._folder(upload_id, name)}{_MARKER}"], what)
        self._delete_keys([item["name"] for item in self._list_keys(folder, what)], what)

    def list_uploads(self) -> list[Upload]:
        root = self.key(f"{RESERVED}/")
        names: dict[str, str] = {}
        started: dict[str, float] = {}  # when the marker was made
        oldest: dict[str, float] = {}  # the oldest object's time (the marker may be gone)
        for item in self._list_keys(root, f"listing the uploads of {self.location}"):
            upload_id, _, rest = item["name"][len(root):].partition("/")
            name, _, leaf = rest.rpartition("/")
            if not name or not re.fullmatch(r"[0-9a-f]{32}", upload_id):
                continue  # a write probe, or not ours
            created = writer_base.rfc3339_seconds(item.get("timeCreated") or item["updated"])
            names[upload_id] = name
            oldest[upload_id] = min(created, oldest.get(upload_id, created))
            if leaf == _MARKER:
                started[upload_id] = created
        found = [Upload(name, i, started.get(i, oldest[i])) for i, name in names.items()]
        return sorted(found, key=lambda u: (u.initiated, u.name))


def _meta_of(item: dict) -> ObjectMeta:
    return ObjectMeta(int(item["size"]), str(item["generation"]),
                      writer_base.rfc3339_seconds(item["updated"]))


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def _describe(response: Any) -> str:
    text = (response.data or b"")[:300].decode("utf-8", errors="replace").strip()
    try:
        text = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return redact(f"HTTP {response.status}" + (f" ({text})" if text else ""))
