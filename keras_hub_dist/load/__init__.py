"""Load: read each device's blocks and place them, straight into the shards.

`block_plan` decides which block of which variable goes to which device
(pure, testable with a fake mesh); `execute` reads, casts, places and
assembles; `loader` is the public `load_sharded_preset`.
"""
