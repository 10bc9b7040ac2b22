"""Checkpoint formats: one module per format, behind one reader protocol.

`base` defines what the loader asks of a checkpoint (`CheckpointReader`:
for every model variable a `TensorSource` with its dtype, shape and the bytes
of any block). `keras_h5` reads KerasHub presets (`model.weights.h5`, single
or multi-file), `huggingface` Transformers checkpoints. A new format is a
new module here that returns those sources; the loader core never names a
file format. The writers sit beside the formats they write
(`keras_h5_writer`, `safetensors_writer`), and `pieces` describes a
transform of stored tensors element by element, for writing blocks through
it.
"""
