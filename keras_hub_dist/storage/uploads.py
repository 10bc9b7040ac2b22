"""The writer of an object-store location: `open_writer("s3://..." |
"gs://...")`.

What a writer offers is `writer_base.ObjectWriter` (small objects whole,
large ones by multipart upload, listing, deleting, unfinished uploads);
`s3_writer` and `gcs_writer` say how each store does it.

Example:

```python
with open_writer("gs://my-bucket/gemma_7b_en") as writer:
    writer.check_writable()
    writer.put("config.json", b"{...}")
```
"""

from __future__ import annotations

from keras_hub_dist.errors import SaveError
from keras_hub_dist.storage.gcs_writer import GcsWriter
from keras_hub_dist.storage.ranged_http import RangeClient
from keras_hub_dist.storage.s3_writer import S3Writer
from keras_hub_dist.storage.writer_base import ObjectMeta, ObjectWriter, Upload

__all__ = ["WRITE_SCHEMES", "ObjectMeta", "ObjectWriter", "Upload", "is_writable_url", "open_writer"]

WRITE_SCHEMES = ("s3", "gs")
_WRITERS = {"s3": S3Writer, "gs": GcsWriter}


def is_writable_url(location: str) -> bool:
    """Whether `location` names an object store a writer can write."""
    return "://" in location and location.split("://", 1)[0].lower() in WRITE_SCHEMES


def open_writer(location: str, client: RangeClient | None = None) -> ObjectWriter:
    """The `ObjectWriter` of `s3://bucket/prefix` or `gs://bucket/prefix`.

    Args:
        location: Where the preset goes.
        client: The `RangeClient` whose connections, retry policy, process
            index and source address every request uses; by default the
            writer makes its own (released by `close`).

    Raises:
        SaveError: Another scheme, or no bucket in the location.
    """
    scheme, _, rest = location.partition("://") if isinstance(location, str) else ("", "", "")
    if scheme.lower() not in _WRITERS or not rest.split("/", 1)[0]:
        raise SaveError(
            f"Expected a location to write of the form "
            f"{' or '.join(f'{s}://bucket/prefix' for s in WRITE_SCHEMES)}. "
            f"Received: {location!r}."
        )
    return _WRITERS[scheme.lower()](location, client)
