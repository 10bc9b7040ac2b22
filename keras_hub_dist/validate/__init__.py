"""Validate: measure ours against stock KerasHub, per device.

The `keras-hub-dist` command (`cli`) and its settings (`options`); the driver
that runs each case in a fresh process (`runner`) and the measuring child
(`worker`); the report's verdicts and table (`report`), its JSON schema and
exit codes (`schema`) and its plot (`plot`). `convert` (`keras-hub-dist
convert`) turns a checkpoint into the other format file to file: it reads as
`load` does and writes as `save` does, so it lives in this room above both. The memory it measures with is
`keras_hub_dist.measure`, a room below the loader, which measures with it too
(`memory_report=True`).
"""
