"""Validate: measure ours against stock KerasHub, per device.

The `keras-hub-dist` command (`cli`) and its settings (`options`); the driver
that runs each case in a fresh process (`runner`) and the measuring child
(`worker`); the report's verdicts and table (`report`), its JSON schema and
exit codes (`schema`) and its plot (`plot`); memory sampling per device
(`memory`) and of the host process (`host_rss`).
"""
