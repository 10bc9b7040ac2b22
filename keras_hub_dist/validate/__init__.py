"""Validate: measure ours against stock KerasHub, per device.

The `keras-hub-dist` command (`cli`) and its settings (`options`); the driver
that runs each case in a fresh process (`runner`) and the measuring child
(`worker`); the report's verdicts and table (`report`), its JSON schema and
exit codes (`schema`) and its plot (`plot`). The memory it measures with is
`keras_hub_dist.measure`, a room below the loader, which measures with it too
(`memory_report=True`).
"""
