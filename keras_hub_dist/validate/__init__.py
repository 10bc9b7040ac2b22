"""Validate: measure ours against stock KerasHub, per device.

The settings of a run (`options`); the driver that runs each case in a
fresh process (`runner`) and the measuring children (`worker`, and
`job_worker` for fit / generate, reported by `job_report`); the report's
verdicts and table (`report`), its JSON schema and exit codes (`schema`)
and its plot (`plot`). The `keras-hub-dist validate` command that runs it
is `keras_hub_dist.cli`. The memory it measures with is
`keras_hub_dist.measure`, a room below the loader, which measures with it
too (`memory_report=True`).
"""
