"""Writing into S3 (and S3-compatible stores): `S3Writer`.

Every call is botocore's S3 client (the well-kept client: signing, XML,
retries). The endpoint and credentials are the loader's
(`storage.object_stores.S3Store`): `AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL`
(path-style there), the region from `AWS_REGION` / `AWS_DEFAULT_REGION` /
the config, credentials from botocore's chain, unsigned when there are
none. Retries: botocore's `standard` mode, 8 attempts, on throttling (429,
503 SlowDown), 5xx and broken connections; a part's body is streamed from
its buffer (`uploads.PartBody`), so a retry sends it again whole.

Example:

```python
writer = S3Writer("s3://my-bucket/presets/tuned")
upload = writer.create_upload("model.weights.h5")
```
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Sequence
from typing import Any

from keras_hub_dist.errors import SaveError
from keras_hub_dist.storage.uploads import ObjectMeta, ObjectWriter, PartBody, Upload

__all__ = ["S3Writer"]

_MAX_ATTEMPTS = 8


class S3Writer(ObjectWriter):
    """`s3://bucket/prefix` (see the module doc)."""

    def __init__(self, url: str) -> None:
        try:
            import botocore.config
            import botocore.session
        except ImportError as e:
            raise SaveError(
                f"Expected botocore to write into {url!r}. Received: {e}. "
                "Install it: pip install 'keras-hub-dist[remote]'."
            ) from e
        self.location = url
        parsed = urllib.parse.urlparse(url)
        self.bucket, self.prefix = parsed.netloc, parsed.path.strip("/")
        session = botocore.session.get_session()
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        region = (os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                  or session.get_config_variable("region") or "us-east-1")
        credentials = session.get_credentials()
        options: dict[str, Any] = dict(
            retries={"max_attempts": _MAX_ATTEMPTS, "mode": "standard"},
            s3={"addressing_style": "path"} if endpoint else {},
            max_pool_connections=32,
        )
        if credentials is None:
            from botocore import UNSIGNED

            options["signature_version"] = UNSIGNED
        self._credentials = (
            "none found by botocore's chain: requests are unsigned" if credentials is None
            else f"AWS credentials from botocore's chain ({credentials.method})"
        )
        self._client = session.create_client(
            "s3", endpoint_url=endpoint or None, region_name=region,
            config=botocore.config.Config(**options),
        )

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _error(self, error: Exception, doing: str, name: str = "") -> SaveError:
        response = getattr(error, "response", None) or {}
        code = response.get("Error", {}).get("Code", type(error).__name__)
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        where = f"s3://{self.bucket}/{self._key(name)}" if name else self.location
        hint = (
            f" Credentials used: {self._credentials}. Grant write access to {self.location}, "
            "or provide other credentials." if status in (401, 403) else ""
        )
        return SaveError(f"{doing} {where} failed: {code} (HTTP {status}): {error}.{hint}")

    def _call(self, doing: str, name: str, method: str, **kwargs: Any) -> Any:
        try:
            return getattr(self._client, method)(Bucket=self.bucket, **kwargs)
        except Exception as e:  # noqa: BLE001 - botocore's errors, named in a SaveError
            raise self._error(e, doing, name) from e

    def check_writable(self) -> None:
        try:
            self._client.head_bucket(Bucket=self.bucket)
        except Exception as e:  # noqa: BLE001
            status = (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status == 404:
                raise SaveError(
                    f"Expected the bucket {self.bucket!r} of {self.location!r} to exist. Received: "
                    "no such bucket (HTTP 404). Create it, or check the URL and AWS_ENDPOINT_URL."
                ) from e
            raise self._error(e, "Checking the bucket of") from e
        if self.prefix and self._exists(self.prefix):
            raise SaveError(
                f"Expected {self.location!r} to be a prefix to write a preset under. Received: it "
                "is an object (a file). Choose another prefix, or delete the object."
            )
        probe = f".khd-write-probe-{os.urandom(4).hex()}"
        self._call("Writing a probe object into", probe, "put_object", Key=self._key(probe), Body=b"probe")
        self._call("Deleting the probe object of", probe, "delete_object", Key=self._key(probe))

    def _exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=key)
            return True
        except Exception as e:  # noqa: BLE001
            if (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return False
            raise self._error(e, "Looking up") from e

    def list(self, sub: str = "") -> dict[str, ObjectMeta]:
        base = f"{self.prefix}/" if self.prefix else ""
        out = {}
        try:
            for page in self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base + sub
            ):
                for item in page.get("Contents", []):
                    out[item["Key"][len(base):]] = ObjectMeta(
                        int(item["Size"]), item.get("ETag", ""), item["LastModified"].timestamp()
                    )
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "Listing") from e
        return out

    def get(self, name: str) -> bytes | None:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
        except Exception as e:  # noqa: BLE001
            if (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                return None
            raise self._error(e, "Reading", name) from e

    def put(self, name: str, data: bytes) -> None:
        self._call("Writing", name, "put_object", Key=self._key(name), Body=bytes(data))

    def delete(self, names: Sequence[str]) -> None:
        names = list(names)
        for start in range(0, len(names), 1000):  # DeleteObjects takes 1,000 keys
            batch = [{"Key": self._key(n)} for n in names[start : start + 1000]]
            result = self._call("Deleting objects of", "", "delete_objects", Delete={"Objects": batch, "Quiet": True})
            if result.get("Errors"):
                first = result["Errors"][0]
                raise SaveError(f"Deleting s3://{self.bucket}/{first.get('Key')} failed: {first.get('Code')}: "
                                f"{first.get('Message')}.")

    def create_upload(self, name: str) -> str:
        return self._call("Starting the upload of", name, "create_multipart_upload", Key=self._key(name))["UploadId"]

    def upload_part(self, name: str, upload_id: str, number: int, data: Any) -> str:
        body = PartBody(data)  # botocore hashes it, sends it and seeks back to retry
        result = self._call(
            f"Uploading part {number} ({len(body)} bytes) of", name, "upload_part",
            Key=self._key(name), UploadId=upload_id, PartNumber=number, Body=body,
            ContentLength=len(body),
        )
        return result["ETag"]

    def complete_upload(self, name: str, upload_id: str, parts: Sequence[tuple[int, str]]) -> None:
        self._call(
            f"Completing the upload ({len(parts)} parts) of", name, "complete_multipart_upload",
            Key=self._key(name), UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": int(n), "ETag": e} for n, e in parts]},
        )

    def abort_upload(self, name: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=self._key(name), UploadId=upload_id)
        except Exception as e:  # noqa: BLE001
            if (getattr(e, "response", None) or {}).get("ResponseMetadata", {}).get("HTTPStatusCode") != 404:
                raise self._error(e, "Aborting the upload of", name) from e

    def list_uploads(self) -> list[Upload]:
        base = f"{self.prefix}/" if self.prefix else ""
        out = []
        try:
            for page in self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=base
            ):
                for item in page.get("Uploads", []):
                    out.append(Upload(item["Key"][len(base):], item["UploadId"], item["Initiated"].timestamp()))
        except Exception as e:  # noqa: BLE001
            raise self._error(e, "Listing the uploads under") from e
        return out
