"""Where bytes live and how they move; nothing here knows what they mean.

- `locations`: a checkpoint's files behind one small read interface
  (`Location`: `has`, `read_bytes`, `open` for range reads), for a local
  directory, a KerasHub handle or a remote location;
- `host_io`: local files (positioned reads and writes), byte runs of a
  block in a C-ordered tensor, and host buffers (`BufferPool`,
  `ScratchBuffers`);
- `ranged_http`: concurrent, retried, version-pinned range reads over HTTP
  into host buffers;
- `object_stores`: S3, GCS, the Hugging Face Hub and plain HTTP: addressing,
  credentials, listing.
- `names`: every name a checkpoint gives (index entries, listed keys,
  tokenizer paths) checked before any read or write, local reads kept
  inside the checkpoint, staged files created inside their folder only;
- `redaction` (`redact`): no secret in an error, a warning or a log;
- `uploads` (`open_writer`): writing a preset into S3 or GCS: small objects
  whole, large ones by multipart upload (`writer_base.ObjectWriter`; S3's
  own in `s3_writer`, GCS's made of `compose` in `gcs_writer`).

This room imports nothing of `formats/` or `quantize/` (checked by
`tests/test_package_layout.py`).
"""
