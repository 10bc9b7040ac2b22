"""Where remote objects are and how to ask for them: S3, GCS, the Hugging
Face Hub and plain HTTP(S).

A store turns `scheme://bucket-or-repo/prefix` and a file name into the URL
its bytes are served from, says how big the object is and which version it
is (`stat`), lists what the location holds (for messages), and signs each
request. Addressing and credentials are each service's own, resolved the
way its own library does:

- `s3://bucket/prefix`: the endpoint from `AWS_ENDPOINT_URL_S3` or
  `AWS_ENDPOINT_URL` (path-style there; `https://BUCKET.s3.REGION.amazonaws.com`
  otherwise), credentials from botocore's chain (environment, shared files,
  instance roles; anonymous when there are none), SigV4 signatures by
  botocore (`pip install keras-hub-dist[remote]`). Versions: the ETag,
  sent back as `If-Match`.
- `gs://bucket/prefix`: the JSON API at `STORAGE_EMULATOR_HOST` or
  `https://storage.googleapis.com`, application-default credentials through
  google-auth (anonymous when there are none, and always for the emulator).
  Versions: the object's generation, pinned in every media URL.
- `hf://owner/name[@revision][/subfolder]`: the Hub at `HF_ENDPOINT`
  (huggingface_hub's setting), the token huggingface_hub finds (`HF_TOKEN`
  or a saved login). The revision is resolved once to its commit, and every
  file is read at that commit (`/resolve/<commit>/<file>`), so it cannot
  change under the load.
- `http(s)://host/path`: a directory URL; versions by ETag.

Example:

```python
store = open_store("s3://my-bucket/gemma_7b_en")
info = store.stat("model.weights.h5")     # ObjectInfo(url, size, etag)
```
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.parse
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
from typing import Any

from keras_hub_dist.errors import PresetError
from keras_hub_dist.storage.names import remote_key
from keras_hub_dist.storage.redaction import redact, remember
from keras_hub_dist.storage.ranged_http import ObjectInfo, RangeClient

__all__ = ["REMOTE_SCHEMES", "Store", "open_store", "parse_hub_location"]

REMOTE_SCHEMES = ("s3", "gs", "hf", "http", "https")


class Store:
    """One remote location (a bucket and prefix, a Hub repo, a directory URL).

    Attributes:
        location: The location as the user wrote it (for messages).
    """

    location: str
    client: RangeClient

    def url(self, name: str) -> str:
        """The URL of file `name` (no version pinned)."""
        raise NotImplementedError

    def headers(self, method: str, url: str, headers: Mapping[str, str]) -> dict[str, str]:
        """Headers this store adds to a request (auth)."""
        return {}

    def credential_source(self) -> str:
        """Which credentials requests carry, for error messages."""
        return "none (anonymous requests)"

    def stat(self, name: str) -> ObjectInfo | None:
        """Size and version of file `name`, or `None` when there is none."""
        response = self.client.request("HEAD", self.url(name), self)
        if response.status == 404:
            return None
        self._raise_for(response, "HEAD", self.url(name))
        etag = response.headers.get("ETag")
        return ObjectInfo(self.url(name), int(response.headers["Content-Length"]), etag)

    def list(self) -> list[str] | None:
        """File names under the location, or `None` where it cannot be listed."""
        return None

    def cached(self, name: str) -> str | None:
        """A local copy of file `name` this very version, if one exists."""
        return None

    def get(self, name: str) -> bytes | None:
        """The whole of a small file, or `None` when there is none."""
        response = self.client.request("GET", self.url(name), self)
        if response.status == 404:
            return None
        self._raise_for(response, "GET", self.url(name))
        return bytes(response.data)

    def _raise_for(self, response: Any, method: str, url: str) -> None:
        if 200 <= response.status < 300:
            return
        if response.status in (401, 403):
            raise PresetError(redact(
                f"Access to {url} was refused (HTTP {response.status}, {method}). "
                f"Credentials used: {self.credential_source()}. Expected read access "
                f"to {self.location}. Grant it, or provide other credentials."
            ))
        raise PresetError(redact(
            f"{method} {url} answered HTTP {response.status}: "
            f"{_body_excerpt(response)}. Expected the object store to serve "
            f"{self.location}. Check the location and the endpoint."
        ))


def _body_excerpt(response: Any) -> str:
    text = (response.data or b"")[:300].decode("utf-8", errors="replace")
    return text.strip() or "(no body)"


def _join(prefix: str, name: str) -> str:
    # Every key asked of a store is checked here: a name from a listing or an
    # index never reaches outside the prefix (`storage.names`).
    return remote_key(prefix, name, source=f"a file of the prefix {prefix.strip('/')!r}")


class HttpStore(Store):
    """A plain HTTP(S) directory URL."""

    def __init__(self, location: str, client: RangeClient) -> None:
        self.location = location
        self.client = client
        self.base = location.rstrip("/")

    def url(self, name: str) -> str:
        return f"{self.base}/{urllib.parse.quote(_join('', name))}"


class S3Store(Store):
    """An S3 (or S3-compatible) bucket and prefix; see the module doc."""

    def __init__(self, location: str, client: RangeClient) -> None:
        self.location = location
        self.client = client
        parsed = urllib.parse.urlparse(location)
        self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")
        try:
            import botocore.session
        except ImportError:
            botocore = None
        session = botocore.session.get_session() if botocore else None
        self.region = (
            os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
            or (session.get_config_variable("region") if session else None) or "us-east-1"
        )
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        # The endpoint set in the environment (path-style), or None for AWS's.
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        if endpoint:
            self.base = f"{endpoint.rstrip('/')}/{self.bucket}"
        else:
            self.base = f"https://{self.bucket}.s3.{self.region}.amazonaws.com"
        self._credentials = session.get_credentials() if session else None
        self._botocore_missing = botocore is None

    def url(self, name: str) -> str:
        return f"{self.base}/{urllib.parse.quote(_join(self.prefix, name))}"

    def headers(self, method: str, url: str, headers: Mapping[str, str]) -> dict[str, str]:
        if self._credentials is None:
            return {}
        from botocore.auth import S3SigV4Auth
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method=method, url=url, headers=dict(headers))
        frozen = self._credentials.get_frozen_credentials()
        remember(frozen.secret_key, frozen.token)  # never shown in a message
        S3SigV4Auth(frozen, "s3", self.region).add_auth(request)
        return {k: v for k, v in request.headers.items() if k not in headers}

    def credential_source(self) -> str:
        if self._botocore_missing:
            return ("none: botocore is not installed, so requests are unsigned "
                    "(pip install 'keras-hub-dist[remote]' to use AWS credentials)")
        if self._credentials is None:
            return ("none found by botocore's chain (AWS_ACCESS_KEY_ID, "
                    "~/.aws/credentials, AWS_PROFILE, instance roles): requests are unsigned")
        return f"AWS credentials from botocore's chain ({self._credentials.method})"

    def list(self) -> list[str] | None:
        names, token = [], None
        prefix = f"{self.prefix}/" if self.prefix else ""
        while True:
            query = {"list-type": "2", "prefix": prefix}
            if token:
                query["continuation-token"] = token
            url = f"{self.base}?{urllib.parse.urlencode(query)}"
            response = self.client.request("GET", url, self)
            self._raise_for(response, "GET", url)
            root = ElementTree.fromstring(response.data)
            ns = re.match(r"\{.*\}", root.tag)
            ns = ns.group(0) if ns else ""
            names += [k.text[len(prefix):] for k in root.iter(f"{ns}Key") if k.text]
            token_node = root.find(f"{ns}NextContinuationToken")
            if token_node is None or not token_node.text:
                return names
            token = token_node.text


class GcsStore(Store):
    """A GCS bucket and prefix; see the module doc.

    Attributes:
        scope: The OAuth scope asked of application-default credentials
            (read-only here; the save's writer asks read-write).
    """

    scope = "https://www.googleapis.com/auth/devstorage.read_only"

    def __init__(self, location: str, client: RangeClient) -> None:
        self.location = location
        self.client = client
        parsed = urllib.parse.urlparse(location)
        self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        if emulator:
            self.api = emulator if "://" in emulator else f"http://{emulator}"
            self.api = self.api.rstrip("/")
        else:
            self.api = "https://storage.googleapis.com"
        self.emulator = bool(emulator)
        self._credentials: Any = None
        self._credentials_note = "none (the emulator at STORAGE_EMULATOR_HOST)" if emulator else ""
        self._lock = threading.Lock()
        if not emulator:
            self._find_credentials()

    def _find_credentials(self) -> None:
        try:
            import google.auth
            import google.auth.exceptions
        except ImportError:
            self._credentials_note = ("none: google-auth is not installed, so requests "
                                      "are anonymous (pip install 'keras-hub-dist[remote]')")
            return
        try:
            self._credentials, project = google.auth.default(scopes=[self.scope])
            kind = type(self._credentials).__name__
            self._credentials_note = f"Google application-default credentials ({kind})"
        except google.auth.exceptions.DefaultCredentialsError:
            self._credentials_note = ("none found (GOOGLE_APPLICATION_CREDENTIALS, "
                                      "`gcloud auth application-default login`, the metadata "
                                      "server): requests are anonymous")

    def _object(self, name: str) -> str:
        return urllib.parse.quote(_join(self.prefix, name), safe="")

    def url(self, name: str) -> str:
        return f"{self.api}/download/storage/v1/b/{self.bucket}/o/{self._object(name)}?alt=media"

    def headers(self, method: str, url: str, headers: Mapping[str, str]) -> dict[str, str]:
        if self._credentials is None:
            return {}
        with self._lock:
            if not self._credentials.valid:
                import google.auth.transport.requests

                self._credentials.refresh(google.auth.transport.requests.Request())
            remember(self._credentials.token)
            return {"Authorization": f"Bearer {self._credentials.token}"}

    def credential_source(self) -> str:
        return self._credentials_note

    def stat(self, name: str) -> ObjectInfo | None:
        url = f"{self.api}/storage/v1/b/{self.bucket}/o/{self._object(name)}"
        response = self.client.request("GET", url, self)
        if response.status == 404:
            return None
        self._raise_for(response, "GET", url)
        meta = json.loads(response.data)
        media = f"{self.url(name)}&generation={meta['generation']}"
        return ObjectInfo(media, int(meta["size"]), None)

    def list(self) -> list[str] | None:
        names, token = [], None
        prefix = f"{self.prefix}/" if self.prefix else ""
        while True:
            query = {"prefix": prefix, **({"pageToken": token} if token else {})}
            url = f"{self.api}/storage/v1/b/{self.bucket}/o?{urllib.parse.urlencode(query)}"
            response = self.client.request("GET", url, self)
            self._raise_for(response, "GET", url)
            page = json.loads(response.data)
            names += [item["name"][len(prefix):] for item in page.get("items", [])]
            token = page.get("nextPageToken")
            if not token:
                return names


def parse_hub_location(location: str) -> tuple[str, str, str]:
    """`(repo id, revision, folder)` of `hf://owner/name[@revision][/folder]`."""
    parts = location.split("://", 1)[1].strip("/").split("/")
    if len(parts) < 2 or not all(parts[:2]):
        raise PresetError(
            f"Expected a Hugging Face location 'hf://owner/name[@revision][/folder]'. "
            f"Received: {location!r}."
        )
    owner, name = parts[0], parts[1]
    revision = "main"
    if "@" in name:
        name, revision = name.split("@", 1)
    return f"{owner}/{name}", revision, "/".join(parts[2:])


class HubStore(Store):
    """A Hugging Face Hub model repository at one commit; see the module doc."""

    def __init__(self, location: str, client: RangeClient) -> None:
        import huggingface_hub
        from huggingface_hub import constants

        self.location = location
        self.client = client
        self.repo, self.revision, self.prefix = parse_hub_location(location)
        self.endpoint = os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")
        self._token = huggingface_hub.get_token()
        remember(self._token)
        self._token_source = (
            "HF_TOKEN from the environment" if os.environ.get("HF_TOKEN")
            else "the token saved by `hf auth login`" if self._token else
            "none (no HF_TOKEN, no saved login): anonymous requests"
        )
        self.commit, self._files = self._resolve()

    def _resolve(self) -> tuple[str, list[str]]:
        quoted = urllib.parse.quote(self.revision, safe="")
        url = f"{self.endpoint}/api/models/{self.repo}/revision/{quoted}"
        response = self.client.request("GET", url, self)
        if response.status in (401, 403, 404):
            raise PresetError(redact(
                f"The Hub has no model {self.repo!r} at revision {self.revision!r} that "
                f"these credentials can read (HTTP {response.status} from {url}). "
                f"Credentials used: {self._token_source}. Expected an existing model "
                "repository; check the name and revision, or set HF_TOKEN for a "
                "gated or private model."
            ))
        self._raise_for(response, "GET", url)
        info = json.loads(response.data)
        siblings = [s["rfilename"] for s in info.get("siblings", [])]
        prefix = f"{self.prefix}/" if self.prefix else ""
        return info["sha"], [s[len(prefix):] for s in siblings if s.startswith(prefix)]

    def url(self, name: str) -> str:
        path = urllib.parse.quote(_join(self.prefix, name))
        return f"{self.endpoint}/{self.repo}/resolve/{self.commit}/{path}"

    def headers(self, method: str, url: str, headers: Mapping[str, str]) -> dict[str, str]:
        if self._token and url.startswith(self.endpoint):
            return {"Authorization": f"Bearer {self._token}"}
        return {}

    def credential_source(self) -> str:
        return self._token_source

    def stat(self, name: str) -> ObjectInfo | None:
        if name not in self._files:
            return None
        # The commit in the URL pins the version: no ETag check (a redirect
        # to the file store answers with that store's own ETag).
        response = self.client.request("HEAD", self.url(name), self, redirect=False)
        if response.status == 404:
            return None
        if response.status >= 400:
            self._raise_for(response, "HEAD", self.url(name))
        size = response.headers.get("X-Linked-Size") or response.headers.get("Content-Length")
        return ObjectInfo(self.url(name), int(size), None)

    def list(self) -> list[str] | None:
        return list(self._files)

    def cached(self, name: str) -> str | None:
        """The file at this commit in the local Hugging Face cache, if there."""
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(self.repo, _join(self.prefix, name), revision=self.commit)
        return path if isinstance(path, str) else None


_STORES = {"s3": S3Store, "gs": GcsStore, "hf": HubStore, "http": HttpStore, "https": HttpStore}


def open_store(location: str, client: RangeClient) -> Store:
    """The `Store` of a remote location (`scheme://...`, see the module doc)."""
    scheme = location.split("://", 1)[0].lower()
    if scheme not in _STORES:
        raise PresetError(
            f"Expected a location with one of the schemes {', '.join(REMOTE_SCHEMES)}. "
            f"Received: {location!r}."
        )
    return _STORES[scheme](location, client)
