"""Measure: per-device and host memory, as the library itself reports it.

The sampler of live arrays and compiled programs' temps (`memory`), the
process's resident set and its peak (`host_rss`), the callbacks on XLA
compilations and program runs that the sampler counts temps with
(`program_watch`), and samples taken at the moment of an event
(`event_samples`). The package's public name for it is
`keras_hub_dist.memory`.

It is a room of its own, low in the order (above `_compat` and `errors`,
below `plan`), because rooms at different heights use it:
`load_sharded_preset(..., memory_report=True)` measures its own load, and the
`keras-hub-dist validate` tool (`validate/`, at the top) measures ours and
stock KerasHub's. Kept inside `validate/`, the loader would import upward.
It imports nothing of the package but `_compat`.
"""
