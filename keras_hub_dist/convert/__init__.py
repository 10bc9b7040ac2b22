"""Convert: a checkpoint turned into the other format, file to file.

`convert_checkpoint` (`file_to_file`; `keras-hub-dist convert`) reads a
KerasHub preset or a Hugging Face checkpoint as `load` reads it and writes
the other format as `save` writes it, tile by tile, never holding the
model's values; into a bucket (`s3://`, `gs://`) its files are uploaded in
parts as they are written (`into_bucket`). It reads as `load` does and
writes as `save` does, so it sits in the room above both.
"""
