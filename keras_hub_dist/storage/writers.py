"""The object store writer of a URL, by scheme (`storage.uploads` says
what a writer does)."""

from __future__ import annotations

from keras_hub_dist.errors import SaveError
from keras_hub_dist.storage.uploads import WRITE_SCHEMES, ObjectWriter

__all__ = ["open_writer"]


def open_writer(url: str) -> ObjectWriter:
    """The writer of `s3://bucket/prefix` or `gs://bucket/prefix`.

    Raises:
        SaveError: Another scheme, or no bucket in the URL.

    Example:

    ```python
    writer = open_writer("gs://my-bucket/presets/tuned")
    writer.check_writable()
    ```
    """
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in WRITE_SCHEMES or not rest.split("/", 1)[0]:
        raise SaveError(
            f"Expected an object store URL to write into: "
            f"{' or '.join(s + '://bucket/prefix' for s in WRITE_SCHEMES)}. Received: {url!r}."
        )
    if scheme == "s3":
        from keras_hub_dist.storage.s3_writes import S3Writer

        return S3Writer(url)
    from keras_hub_dist.storage.gcs_writes import GcsWriter

    return GcsWriter(url)
